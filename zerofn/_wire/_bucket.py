"""One bucket's reduction over the compressed wire: the piece ``reduce_grads`` launches per bucket.

A bucket's packed rows are ``(N, S)``: row ``j`` is rank ``j``'s chunk of every member,
side by side at the same columns in every row (:class:`~zerofn.layout.Bucket`'s
offsets). So which elements travel compressed is a choice of *columns*, the same in every
row: the columns of members that :meth:`CompressedWire.compresses` (matrices of at least
``min_numel`` elements) are quantized; the others (vectors, small params) travel as
float32 bytes. (Whole placements are refused: their buckets reduce to an owner.)
:func:`wire_plan` makes that split once per bucket.

Per bucket, on rank ``r``:

1. the ``N - 1`` rows for the other ranks, compressed columns only, plus this rank's
   residual for them (error feedback), are quantized per row in blocks; what the
   quantization lost is the new residual (exact in float32);
2. one ``all_to_all_single`` of one uint8 row per other rank (codes, fp32 scales as bytes,
   the uncompressed columns as float32 bytes), so that rank ``j`` receives every rank's
   chunk ``j``;
3. rank ``j`` dequantizes, and adds the ``N`` chunks in float32 in rank order 0..N-1 (its
   own unquantized): the bucket's ``(S,)`` row of the mean, the same bits on every rank.

The rows come from :func:`~zerofn.buckets.pack_grads`, already times ``1/N``, so the sum
is the mean and the residual is in those units (and in the loss scale's: ``step_shards``
rescales it when the scale moves).

A non-finite element makes its block's scale non-finite (:mod:`zerofn._wire._quant`), so
the owner's dequantized chunk is not finite and ``step_shards`` skips the step on every
rank, leaving the residual as it was.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zerofn import _comm as comm
from zerofn._offsets import Bucket, plan_buckets
from zerofn._wire._policy import CompressedWire
from zerofn._wire._quant import WireFormat, dequantize_rows, quantize_rows
from zerofn.layout import ShardLayout

__all__ = ["WirePlan", "bucket_bytes", "init_residual", "launch_compressed", "wire_plan"]


@dataclass(frozen=True)
class WirePlan:
    """Which columns of a bucket's ``(N, S)`` rows travel compressed.

    Attributes:
      compressed: ``(start, stop)`` column ranges quantized, in column order.
      raw: the other ranges, sent as float32.
      order: every range in column order as ``(compressed, start in its part, length)``,
        to put the summed parts back into one ``(S,)`` row.
      c: compressed columns (``sum`` of their lengths); r: raw columns.
    """

    compressed: tuple[tuple[int, int], ...]
    raw: tuple[tuple[int, int], ...]
    order: tuple[tuple[bool, int, int], ...]
    c: int
    r: int


@functools.lru_cache(maxsize=1024)
def wire_plan(layout: ShardLayout, bucket: Bucket, wire: CompressedWire) -> WirePlan:
    """The column split of ``bucket`` for ``wire`` (cached; no tensors)."""
    compressed: list[tuple[int, int]] = []
    raw: list[tuple[int, int]] = []
    order: list[tuple[bool, int, int]] = []
    sizes = {True: 0, False: 0}
    for name, start in zip(bucket.names, bucket.offsets, strict=True):
        spec = layout[name]
        width = spec.shard_numel  # whole params are refused before any plan (reduce_grads' checks)
        if width == 0:
            continue
        squeezed = wire.compresses(tuple(spec.shape), spec.numel)
        (compressed if squeezed else raw).append((start, start + width))
        order.append((squeezed, sizes[squeezed], width))
        sizes[squeezed] += width
    return WirePlan(tuple(compressed), tuple(raw), tuple(order), sizes[True], sizes[False])


def init_residual(
    layout: ShardLayout, bucket_numel: int, wire: CompressedWire, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """Zero residuals for every bucket of ``plan_buckets(layout, bucket_numel)``: ``(N - 1, c)`` float32 each.

    ``c`` is the bucket's compressed columns (0 for a bucket with none). Memory: ``4 (N - 1) c``
    bytes per bucket, at most ``4 (N - 1) / N`` bytes per element of the params compressed.
    """
    n = layout.world_size
    return tuple(
        torch.zeros(n - 1, wire_plan(layout, b, wire).c, dtype=torch.float32, device=device)
        for b in plan_buckets(layout, bucket_numel)
    )


def bucket_bytes(plan: WirePlan, world_size: int, wire: CompressedWire) -> int:
    """Bytes one rank hands to the ``all_to_all_single`` of one bucket: ``(N - 1)`` rows of
    ``c + 4 ceil(c / block) + 4 r`` bytes (none at ``N = 1``)."""
    return (world_size - 1) * (wire.format.nbytes(plan.c) + 4 * plan.r)


def _columns(x: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    if len(ranges) == 1:
        a, b = ranges[0]
        return x[:, a:b]
    return torch.cat([x[:, a:b] for a, b in ranges], dim=1) if ranges else x.new_empty(x.shape[0], 0)


def _without(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of ``x`` but row ``rank`` (a new contiguous tensor)."""
    return torch.cat([x[:rank], x[rank + 1 :]])


def launch_compressed(
    rows: torch.Tensor,
    plan: WirePlan,
    fmt: WireFormat,
    residual: torch.Tensor | None,
    group: comm.Group,
) -> tuple[comm.Pending, torch.Tensor | None]:
    """Start one bucket's compressed reduction (the module docstring's steps 1 and 2).

    Args:
      rows: ``(N, S)`` packed rows (:func:`~zerofn.buckets.pack_grads`), any floating
        dtype (widened to float32 exactly). Not written.
      plan: :func:`wire_plan` of the bucket.
      fmt: the wire's format (:attr:`CompressedWire.format`).
      residual: ``(N - 1, c)`` float32, this rank's residual for the bucket's compressed
        columns of the rows it sends (rank order, its own row left out); ``None``: no error
        feedback. Not written.
      group: the sharding group.

    Returns:
      ``(pending, new_residual)``: ``pending.wait()`` is this rank's ``(S,)`` float32 row of
      the mean (step 3); ``new_residual`` the ``(N - 1, c)`` residual to keep (``None``
      without error feedback).

    Collectives: one ``all_to_all_single`` of :func:`bucket_bytes` bytes, recorded as
    ``"all_to_all"``; none at ``N = 1``.
    """
    n, _s = rows.shape
    rank = comm.group_rank(group)
    x = rows if rows.dtype == torch.float32 else rows.to(torch.float32)
    if n == 1:
        return comm.Pending([], lambda: x[0]), residual
    comp, raw = _columns(x, plan.compressed), _columns(x, plan.raw)
    sent = _without(comp, rank)
    if residual is not None:
        sent = sent + residual
    codes, scales = quantize_rows(sent, fmt)
    new_residual = sent - dequantize_rows(codes, scales, fmt) if residual is not None else None
    packed = torch.cat([codes, scales.view(torch.uint8), _without(raw, rank).view(torch.uint8)], dim=1)
    nb = fmt.num_blocks(plan.c)

    def finish(received: torch.Tensor) -> torch.Tensor:
        # Scales and raw columns start at byte offsets that need not be 4-aligned: copied out first.
        got_scales = received[:, plan.c : plan.c + 4 * nb].reshape(-1).clone().view(torch.float32).view(n - 1, nb)
        got_raw = received[:, plan.c + 4 * nb :].reshape(-1).clone().view(torch.float32).view(n - 1, plan.r)
        values = dequantize_rows(received[:, : plan.c], got_scales, fmt)
        total_c = comm.rank_order_sum(_with_own(comp[rank], values, rank, n))
        total_r = comm.rank_order_sum(_with_own(raw[rank], got_raw, rank, n))
        parts = [(total_c if squeezed else total_r)[at : at + width] for squeezed, at, width in plan.order]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return comm.exchange_rows(packed, group).then(finish), new_residual


def _with_own(own: torch.Tensor, others: torch.Tensor, rank: int, n: int) -> list[torch.Tensor]:
    """The ``N`` rows in rank order: ``own`` at ``rank``, every other rank's row of ``others`` around it."""
    return [own if i == rank else others[i if i < rank else i - 1] for i in range(n)]
