"""What a compressed wire can serve, checked on each rank before any collective.

Each check raises ``ValueError`` naming the rank, the setting and what to write instead;
the stages send the verdict in their agreement all-gather, so every rank raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofn import _comm as comm
from zerofn import _traced
from zerofn._offsets import Bucket
from zerofn._wire._bucket import wire_plan
from zerofn._wire._policy import CompressedWire
from zerofn.layout import ShardLayout

__all__ = ["check_wire"]


def check_wire(
    wire: CompressedWire,
    layout: ShardLayout,
    buckets: Sequence[Bucket],
    residual: Sequence[torch.Tensor] | None,
    *,
    rank: int,
    replicate_group: comm.Group,
    comm_dtype: torch.dtype | None,
    where: str,
) -> None:
    """Refuse what ``wire`` cannot serve, and a ``residual`` that does not fit ``buckets``.

    Served: stage 1 and 2 (both return this rank's shards), every floating gradient dtype
    (widened to float32 exactly), CPU offload (the residual lives with the gradients).
    Refused, with the reason: whole placements (their buckets reduce to one owner, not to
    shards), a hybrid ``replicate_group`` (its second sum would need a residual of its own),
    an explicit ``comm_dtype`` (the codes are summed in float32), and ``torch.compile`` (the
    all-to-all runs eagerly).
    """
    who = f"{where} on rank {rank}: the compressed wire"
    if comm.tracing():  # at trace time, before the graph runs any collective
        _traced.refuse(f"{who} runs eagerly: under torch.compile use a floating wire (PrecisionPolicy(wire=None))")
    whole = [p.name for p in layout.params if p.is_whole]
    if whole:
        raise ValueError(
            f"{who} reduces each bucket to every rank's shards, and {whole[0]!r} is placed whole (reduced to its "
            "owner); compress a layout without whole placements, or use a floating wire with Muon / Adafactor"
        )
    if replicate_group is not None:
        raise ValueError(
            f"{who} sums over the sharding group only; a hybrid replicate group would need a residual for its own "
            "sum: use a floating wire with replicate_group"
        )
    if comm_dtype is not None:
        raise ValueError(f"{who} dequantizes and sums in float32: drop comm_dtype={comm_dtype}")
    if not wire.error_feedback:
        if residual is not None:
            raise ValueError(f"{who} was built with error_feedback=False: pass residual=None")
        return
    if residual is None:
        raise ValueError(
            f"{who} keeps error feedback: pass residual=state.residual (and give the result to step_shards)"
        )
    if len(residual) != len(buckets):
        raise ValueError(
            f"{who}: residual has {len(residual)} buckets, the plan {len(buckets)}; reduce with the state's "
            "bucket_numel (state.bucket_numel), which the residual was made for"
        )
    for i, (r, b) in enumerate(zip(residual, buckets, strict=True)):
        shape = (layout.world_size - 1, wire_plan(layout, b, wire).c)
        if not isinstance(r, torch.Tensor) or r.dtype != torch.float32 or tuple(r.shape) != shape:
            got = f"{r.dtype} of shape {tuple(r.shape)}" if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(
                f"{who}: residual of bucket {i} ({b.names[0]!r}...) must be float32 of shape {shape}, got {got}; "
                "reduce with the state's bucket_numel and pass state.residual"
            )
