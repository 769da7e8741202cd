"""The gather side of the bucket engine: master shards into a rank's ``(S,)`` row, the
all-gather of the rows, and a full tensor cut into one rank's shard.

Public through :mod:`zerofn.buckets` (its docstring has the vocabulary: rows, members,
whole and split params); the reduce side and :func:`~zerofn.buckets.unpack_rows`, which
both sides end with, are there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from zerofn import _comm as comm
from zerofn import _placement, flat
from zerofn._bucket_plan import BucketPlan, _bucket_plan, split_width
from zerofn._comm import Group
from zerofn._offsets import Bucket
from zerofn.layout import ParamSpec, ShardLayout


def pack_shards(
    shards: Mapping[str, torch.Tensor],
    layout: ShardLayout,
    bucket: Bucket,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    out: torch.Tensor | None = None,
    rank: int | None = None,
) -> torch.Tensor:
    """This rank's ``(S,)`` row of a bucket: its members' shards side by side.

    Each shard is cast to ``dtype`` (the working dtype for a gather of master shards;
    float32 masters are rounded to nearest) and the row is placed on ``device`` (CPU
    offload: the shards live on the CPU and the row goes to the params' device, from a
    pinned buffer, see :func:`zerofn._placement.cat_to`). Without a ``dtype``, shards of
    mixed dtypes are promoted by ``torch.cat`` (exactly; :func:`unpack_rows` casts back).

    A bucket of one contiguous shard already on ``device`` (and in ``dtype``) is its own
    row: no copy; the caller must not change that shard until the gather reading it has
    completed.

    A bucket with whole params (placement ``"whole"``) needs ``rank``: the row then holds
    the split shards, the whole params ``rank`` owns flattened at their columns, and zeros
    in the columns of the other ranks' whole params.

    Args:
      shards: name -> ``(shard_numel,)`` shard, for every split member of ``bucket``, and
        name -> full-shape tensor for every whole member ``rank`` owns.
      layout: the layout the shards follow.
      bucket: the bucket of ``layout`` whose shards to pack, in its order.
      dtype: dtype of the row; default: the shards' own (promoted).
      device: where the row goes; default the shards' device.
      out: an ``(S,)`` buffer to write into (reused between steps by the facade); used
        when a copy is needed on one device.
      rank: whose row this is; needed when the bucket holds whole params.

    Returns:
      The ``(S,)`` row: ``out``, the lone shard itself, or a new tensor.

    Collectives: none.
    """
    if split_width(layout, bucket) < bucket.shard_numel:
        plan = _bucket_plan(layout, bucket)
        return _pack_whole_row(shards, plan, bucket, dtype=dtype, device=device, out=out, rank=rank)
    lone = flat.bucket_range(shards, bucket.names)
    if lone is not None:  # flat shards: the bucket is one range of a flat buffer, read in place
        device = torch.device(device) if device is not None else lone.device
        if lone.device != device:
            return _placement.cat_to([lone if dtype is None else lone.to(dtype)], device)
        if out is not None and (dtype is not None and lone.dtype != dtype):
            return out.copy_(lone)  # the cast, straight into the caller's buffer
        return lone if dtype is None or lone.dtype == dtype else lone.to(dtype)
    parts = [shards[name] if dtype is None else shards[name].to(dtype) for name in bucket.names]
    device = torch.device(device) if device is not None else parts[0].device
    if any(t.device != device for t in parts):  # CPU offload to an accelerator
        return _placement.cat_to(parts, device)
    if len(parts) == 1 and parts[0].is_contiguous():
        return parts[0]
    if out is not None:
        return torch.cat(parts, out=out)
    return torch.cat(parts)


def _pack_whole_row(
    shards: Mapping[str, torch.Tensor],
    plan: BucketPlan,
    bucket: Bucket,
    *,
    dtype: torch.dtype | None,
    device: torch.device | None,
    out: torch.Tensor | None,
    rank: int | None,
) -> torch.Tensor:
    """:func:`pack_shards` for a bucket with whole members: zeros, then this rank's members."""
    if rank is None:
        raise ValueError("pack_shards: this bucket holds whole params; pass rank= (whose row to pack)")
    mine = [m for m in plan.members if m.owner < 0 or m.owner == rank]
    parts = [shards[m.name] if dtype is None else shards[m.name].to(dtype) for m in mine]
    src_device = parts[0].device if parts else torch.device(device or "cpu")
    row_dtype = dtype or (functools.reduce(torch.promote_types, (t.dtype for t in parts)) if parts else None)
    if row_dtype is None:  # this rank holds none of the bucket: its row is padding
        row_dtype = next(iter(shards.values())).dtype if shards else torch.float32
    device = torch.device(device) if device is not None else src_device
    if out is not None and out.device == src_device:
        row = out.zero_()
    else:
        row = torch.zeros(bucket.shard_numel, dtype=row_dtype, device=src_device)
    if parts:
        torch._foreach_copy_([row[m.col : m.col + m.width] for m in mine], [t.reshape(-1) for t in parts])
    return row if row.device == device else row.to(device)


def launch_gather(
    row: torch.Tensor, group: Group, how: str, *, async_op: bool = False, out: torch.Tensor | None = None
) -> comm.Pending:
    """Start gathering every rank's ``(S,)`` row of one bucket (from :func:`pack_shards`).

    Args:
      row: this rank's contiguous ``(S,)`` row; read, never written, until the gather
        completes (a lone shard is its own row: the master buffer must not change until
        then). With the broadcast realisation it may be ``out[rank]`` (packed in place by
        ``pack_shards(out=)``).
      group: the sharding process group.
      how: ``"all_gather"`` or ``"broadcast"`` (the gather realisation of a
        :class:`~zerofn.CommPolicy`).
      async_op: launch and return at once.
      out: an ``(N, S)`` buffer to receive into (explicit reuse: the facade's staging
        buffers, idle between ``step`` and the next ``backward``); default a new one.

    Returns:
      A :class:`~zerofn._comm.Pending` whose ``wait()`` is, row ``r`` from rank ``r``,
      the ``(N, S)`` buffer (all-gather; ``out`` if given) or the ``N`` rows apart
      (broadcasts: ``row`` itself and ``out``'s other rows), for :func:`unpack_rows`.

    Collectives: one ``all_gather`` of ``N * S`` elements, or ``N`` broadcasts of ``S``.
    """
    return comm.gather_rows(row, group, how, async_op=async_op, out=out)


def rows_in_place(layout: ShardLayout, bucket: Bucket, dest: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``bucket``'s ``(N, S)`` gathered rows as a view of its one member's own tensor in ``dest``.

    Where a bucket is one split param with no padding (``numel == N * S``), row ``r`` of the
    gathered buffer is the param's ``r``-th chunk, so the param's own contiguous storage can
    receive the gather and nothing is left to unpack. ``None`` for any other bucket (more
    members, a whole or padded param, a destination missing, of another dtype than the
    param's working one, or not contiguous). Collectives: none.
    """
    if len(bucket.names) != 1:
        return None
    name = bucket.names[0]
    spec, n = layout[name], layout.world_size
    t = dest.get(name)
    if spec.is_whole or spec.numel != n * bucket.shard_numel or t is None:
        return None
    if t.dtype != spec.dtype or not t.is_contiguous():
        return None
    return t.detach().view(n, bucket.shard_numel)


def cut_shard(
    full: torch.Tensor,
    spec: ParamSpec,
    rank: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    round_to: torch.dtype | None = None,
) -> torch.Tensor:
    """Rank ``rank``'s zero-padded ``(shard_numel,)`` shard of a full tensor, as a new tensor.

    For a whole param (placement ``"whole"``) the owner's "shard" is a full-shape copy;
    other ranks hold nothing of it and get a ``ValueError`` (check ``spec.holds(rank)``).

    Args:
      full: the param-shaped tensor (any device); not changed.
      spec: the param's :class:`~zerofn.layout.ParamSpec`.
      rank: whose shard.
      dtype: dtype of the shard; default ``full``'s (kept exactly).
      device: where the shard lives; default ``full``'s device.
      round_to: round the values to this dtype first (``shard_params`` rounds to the
        working dtype, so forced dtypes give the values the model will see).

    Collectives: none.
    """
    if spec.is_whole:
        if rank != spec.owner:
            raise ValueError(f"cut_shard: rank {rank} holds nothing of whole param {spec.name!r} (owner {spec.owner})")
        src = full.detach().to(round_to) if round_to is not None else full.detach()
        copy = torch.empty(spec.shape, dtype=dtype or full.dtype, device=device if device is not None else full.device)
        return copy.copy_(src)
    start, stop = spec.owned_range(rank)
    shard = torch.zeros(
        spec.shard_numel, dtype=dtype or full.dtype, device=device if device is not None else full.device
    )
    part = full.detach().reshape(-1)[start:stop]
    shard[: stop - start].copy_(part.to(round_to) if round_to is not None else part)
    return shard
