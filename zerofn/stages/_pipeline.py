"""What the bucketed stages share: the bucket size, the pipeline depth, the option checks."""

from __future__ import annotations

from typing import Any

from zerofn.buckets import StagingPool
from zerofn.precision import PrecisionPolicy

#: Padded elements per bucket (16 MiB in float32; DDP's buckets are 25 MiB). Every collective
#: costs a fixed overhead beside its bytes (on gloo a large one), so fewer, larger buckets move
#: the same bytes in less time; the figures are in docs/functional-loop.md.
DEFAULT_BUCKET_NUMEL = 2**22

#: Buckets the stage functions keep in flight while packing the next or writing the last.
PIPELINE_DEPTH = 1


def _check_staging(staging: object, where: str) -> None:
    if staging is not None and not isinstance(staging, StagingPool):
        raise TypeError(f"{where}: staging must be a zerofn.buckets.StagingPool or None, got {type(staging).__name__}")


def check_reduce_options(stage: Any, bucket_numel: Any, precision: Any, staging: Any, where: str) -> None:
    """The options ``reduce_grads`` and ``value_and_reduced_grads`` share, checked alike (raises, no collective)."""
    if stage not in (1, 2):
        raise ValueError(f"{where}: stage must be 1 or 2, got {stage!r}")
    if not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or bucket_numel <= 0:
        raise ValueError(f"{where}: bucket_numel must be a positive int (elements), got {bucket_numel!r}")
    if precision is not None and not isinstance(precision, PrecisionPolicy):
        raise TypeError(
            f"{where}: precision must be a zerofn.PrecisionPolicy (state.precision) or None, "
            f"got {type(precision).__name__}"
        )
    _check_staging(staging, where)
