"""What ``reduce_grads`` and ``gather_params`` share: the bucket size, the pipeline depth, the staging check."""

from __future__ import annotations

from zerofn.buckets import StagingPool

#: Padded elements per bucket (16 MiB in float32; DDP's buckets are 25 MiB). Measured on gloo,
#: 2 ranks on 2 cores (benchmarks/README.md, "Current numbers"): every collective costs a fixed
#: ~1 ms beside its bytes, so 2**22 against the seed's 2**20 cut the transformer's gradient
#: all-reduce from 42 to 33 ms and its param broadcasts from 40 to 22 ms.
DEFAULT_BUCKET_NUMEL = 2**22

#: Buckets the stage functions keep in flight while packing the next or writing the last.
PIPELINE_DEPTH = 1


def _check_staging(staging: object, where: str) -> None:
    if staging is not None and not isinstance(staging, StagingPool):
        raise TypeError(f"{where}: staging must be a zerofn.buckets.StagingPool or None, got {type(staging).__name__}")
