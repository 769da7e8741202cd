"""The bucket engine: every path that moves a bucket (functional stages, the facade's hooks
and prefetch, checkpoints, ``get_param_grad``) goes through these pieces, once.

Vocabulary (see :mod:`zerofn.layout`): a bucket's *rows* are a rank-major ``(N, S)``
buffer, ``N`` the world size and ``S = bucket.shard_numel``; row ``r`` holds what rank
``r`` owns of every member, members at their ``bucket.offsets``. For a split param that
is chunk ``r`` of the padded flat tensor, the same column block in every row, so a member
of ``numel`` elements and width ``s`` fills ``whole = numel // s`` rows, then ``rest``
elements of the next row, then zero padding. A whole param (placement ``"whole"``) sits
in its owner's row only, its ``numel`` flat elements from its column; the same columns of
the other rows hold those ranks' own whole params, or zero padding. The static
description of this per (layout, bucket) is a :class:`BucketPlan` (cached): pieces read
member widths and positions from it, never from a placement rule of their own.

Pure pieces (no communication)::

    pack_grads      full grads -> (N, S) rows, times 1/(N*R)      (the one mean factor)
    split_row       this rank's reduced (S,) row -> per-param shards
    unpack_rows     (N, S) rows -> full tensors (gathered params, or full reduced grads)
    pack_shards     per-param shards -> this rank's (S,) row (cast, offload aware)
    cut_shard       a full tensor -> rank r's (shard_numel,) shard

Communicating pieces (through the private ``zerofn._comm``, which owns every collective)::

    launch_reduce   (N, S) rows -> Pending (S,) row of the sum  (or the whole (N, S))
    launch_gather   (S,) row -> Pending (N, S) rows of every rank

Where a piece can write into a caller's buffer it takes ``out=``, so the facade's reused
staging buffers go through the same code as the functional path's fresh ones, and both
give the same bits.

Which params travel together, and where each sits in the rows, is the bucket plan
(:func:`plan_buckets`, :class:`Bucket`, its :class:`Span` in the flat buffers), computed
with every other offset in ``zerofn/_offsets.py``. Every name above is public here; the
copy plan (:class:`BucketPlan`) lives in ``zerofn/_bucket_plan.py`` and the gather side
(``pack_shards``, ``launch_gather``, ``cut_shard``) in ``zerofn/_bucket_gather.py``, each
file one concern.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from zerofn import _comm as comm
from zerofn import _traced
from zerofn._bucket_gather import cut_shard as cut_shard
from zerofn._bucket_gather import launch_gather as launch_gather
from zerofn._bucket_gather import pack_shards as pack_shards
from zerofn._bucket_plan import FUSED_MIN_NUMEL, _bucket_plan, member_sources, member_targets
from zerofn._bucket_plan import BucketPlan as BucketPlan
from zerofn._bucket_plan import MemberPlan as MemberPlan
from zerofn._bucket_plan import bucket_plan as bucket_plan
from zerofn._comm import Group
from zerofn._offsets import Bucket as Bucket
from zerofn._offsets import Span as Span
from zerofn._offsets import plan_buckets as plan_buckets
from zerofn._staging import StagingPool as StagingPool
from zerofn.layout import ShardLayout, live_layout

__all__ = [
    "Bucket",
    "BucketPlan",
    "MemberPlan",
    "Span",
    "StagingPool",
    "bucket_plan",
    "cut_shard",
    "launch_gather",
    "launch_reduce",
    "pack_grads",
    "pack_shards",
    "plan_buckets",
    "split_row",
    "unpack_rows",
    "unpack_targets",
]


# --------------------------------------------------------------------------- reduce side


def pack_grads(
    grads: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    bucket: Bucket,
    *,
    replicas: int = 1,
    out: torch.Tensor | None = None,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """A bucket's full local gradients as rank-major rows, times the mean factor ``1/(N*R)``.

    Each element is ``grad * (1 / (N * replicas))`` rounded once in the rows' dtype (the
    gradients' dtype), as DDP scales before the sum so low-precision sums do not
    overflow; absent or ``None`` members and padding are zeros, so the rows' shape and
    every element's position depend only on the layout. Large members are copied and
    scaled in one pass (``torch.mul(..., out=)``); small ones in one ``_foreach_copy_``
    and one ``_foreach_mul_`` per bucket, so a bucket of hundreds of small params costs a
    few calls, not hundreds. Both round exactly as ``rows.mul_(factor)`` with a Python
    float would.

    Args:
      grads: name -> full gradient (param shape); members of one bucket share a dtype
        and device. At least one member of ``bucket`` must be present.
      layout: the shard layout.
      bucket: one bucket of ``layout``.
      replicas: ``R``, replica groups of a hybrid layout (1: none).
      out: an ``(N, S)`` buffer of the gradients' dtype to write into (the facade's reused
        staging buffer); default a new one. Under ``torch.compile`` it is not written: the
        rows are new (the graph plans its buffers).
      after: under ``torch.compile``, a tensor the rows are computed after (the rank
        agreement's verdict): the graph then runs that check before this bucket's
        collective, whatever order the compiler gives its other nodes. Not read eagerly.

    Returns:
      The ``(N, bucket.shard_numel)`` rows in the gradients' dtype (``out`` itself if given,
      eagerly).

    Collectives: none.
    """
    if torch.compiler.is_compiling():  # new rows from one opaque node; ``out`` is the graph's to plan
        return _pack_traced(grads, layout, bucket, replicas, after)
    n = layout.world_size
    scale = 1.0 / (n * replicas)
    if out is None:
        first = next(g for g in (grads.get(name) for name in bucket.names) if g is not None)
        out = torch.empty(n, bucket.shard_numel, dtype=first.dtype, device=first.device)
    plan = _bucket_plan(layout, bucket)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    if not _pack_split_chunked(grads, plan, out, scale):
        _pack_split_members(grads, plan, out, scale, dst, src)
    if plan.split_width < bucket.shard_numel:
        # Whole members: zero the region (other rows' padding, absent members), then
        # write each present member into its owner's row.
        out[:, plan.split_width :].zero_()
        for name, s, _, _, col, owner in plan.whole_members:
            t = grads.get(name)
            if t is None:
                continue
            dst_part, part = out[owner, col : col + s], t.detach().reshape(-1)
            if s >= FUSED_MIN_NUMEL:
                torch.mul(part, scale, out=dst_part)
            else:
                dst.append(dst_part)
                src.append(part)
    if dst:
        torch._foreach_copy_(dst, src)
        # A 0-d tensor, not a Python float: _foreach_mul_ rounds a Python scalar to the
        # list's dtype first (1/3 in fp16 or bf16), mul_ does not; the tensor keeps them equal.
        # Its dtype is mul_'s compute dtype for a Python scalar: float32, float64 for float64.
        factor = torch.tensor(scale, dtype=torch.promote_types(out.dtype, torch.float32), device=out.device)
        torch._foreach_mul_(dst, factor)
    return out


def _pack_traced(
    grads: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    bucket: Bucket,
    replicas: int,
    after: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`pack_grads` in a compiled graph: one opaque ``zerofn::pack_rows`` node that runs
    the eager packing (the same bits) on new rows.

    Opaque on purpose: inductor would otherwise fuse each member's scaled copy into the
    kernel that computes its gradient, at that member's offset in the rows, so the kernels
    of identical layers differ by an offset and each is compiled again; behind the node
    every gradient is a buffer of its own and identical layers share one kernel.
    """
    present = [name for name in bucket.names if grads.get(name) is not None]
    desc = encode_bucket(layout, bucket)
    tensors = [grads[name] for name in present]
    return _pack_rows_op(tensors, desc, "\0".join(present), replicas, after)  # type: ignore[misc,arg-type]


def encode_bucket(layout: ShardLayout, bucket: Bucket) -> str:
    """``bucket`` of ``layout`` as one constant string of a compiled graph (:func:`decode_bucket` reads it)."""
    span = None if bucket.span is None else tuple(bucket.span)
    return _bucket_desc(
        layout.fingerprint, operator.index(layout.world_size), bucket.names, bucket.offsets, bucket.shard_numel, span
    )


@_traced.constant_result  # a bucket's fields are constants of the trace (the plan's): written out once, natively
def _bucket_desc(
    fingerprint: str,
    world_size: int,
    names: tuple[str, ...],
    offsets: tuple[int, ...],
    shard_numel: int,
    span: tuple[int, int, int] | None,
) -> str:
    return repr((fingerprint, names, offsets, shard_numel, span, world_size))


def decode_bucket(desc: str) -> tuple[str, Bucket, int]:
    """``(layout fingerprint, bucket, world size)`` from :func:`encode_bucket`'s string."""
    fingerprint, names, offsets, shard_numel, span, world_size = _traced.decode(desc)
    return fingerprint, Bucket(names, offsets, shard_numel, None if span is None else Span(*span)), world_size


@torch.library.custom_op("zerofn::pack_rows", mutates_args=())
def _pack_rows_op(
    grads: list[torch.Tensor], desc: str, present: str, replicas: int, after: torch.Tensor | None
) -> torch.Tensor:
    del after  # an input only for the order of the graph's nodes
    fingerprint, bucket, _ = decode_bucket(desc)
    layout = live_layout(fingerprint)
    return pack_grads(dict(zip(present.split("\0"), grads, strict=True)), layout, bucket, replicas=replicas)


@_pack_rows_op.register_fake
def _(grads: list[torch.Tensor], desc: str, present: str, replicas: int, after: torch.Tensor | None) -> torch.Tensor:
    del present, replicas, after
    _, bucket, world_size = decode_bucket(desc)
    return grads[0].new_empty(world_size, bucket.shard_numel)


def _pack_split_chunked(
    grads: Mapping[str, torch.Tensor | None], plan: BucketPlan, out: torch.Tensor, scale: float
) -> bool:
    """:func:`pack_grads` for the split members of a :attr:`~BucketPlan.chunked` bucket whose
    members are all present: one ``torch._chunk_cat`` writes them, padding zeroed, into the
    rows' split region and one ``mul_`` scales it (the rounding of ``rows.mul_(factor)``, as
    the other paths), so the cost does not grow with the member count (no view per member
    of a 1-D gradient). False, writing nothing, where that does not apply."""
    if not plan.chunked:
        return False
    n = out.shape[0]
    tensors = []
    for m in plan.split_members:
        t = grads.get(m.name)
        if t is None:
            return False
        # Chunked along dim 0, a contiguous tensor whose rows split evenly N ways gives the
        # chunks of its flat elements: no flat view to make (microseconds each).
        keep = t.dim() == 1 or (t.dim() > 1 and t.shape[0] % n == 0 and t.is_contiguous())
        tensors.append(t if keep else t.reshape(-1))
    region = out[:, : plan.split_width]
    with torch.no_grad():
        torch._chunk_cat(tensors, 0, out.shape[0], out=region)
        region.mul_(scale)
    return True


def _pack_split_members(
    grads: Mapping[str, torch.Tensor | None],
    plan: BucketPlan,
    out: torch.Tensor,
    scale: float,
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
) -> None:
    """:func:`pack_grads` for the split members: large ones copied and scaled in one pass
    now, small ones appended to ``dst`` / ``src`` for the batched copy and scale."""
    n = out.shape[0]
    blocks = out[:, : plan.split_width].split(plan.widths, dim=1) if plan.widths else ()
    # Padding and absent members are zero: one zero_ of the split region when some member
    # needs it (not one per member: the cost of a step must not grow with the tensor count).
    zeroed = any(whole != n or grads.get(name) is None for name, _, whole, _, _, _ in plan.split_members)
    if zeroed and plan.split_width:
        out[:, : plan.split_width].zero_()
    for (name, s, whole, rest, _, _), block in zip(plan.split_members, blocks, strict=True):
        t = grads.get(name)
        if t is None:
            continue
        large = s * n >= FUSED_MIN_NUMEL
        if whole == n:  # no padding: the gradient is the block
            part = t.detach().reshape(n, s)
            if large:
                torch.mul(part, scale, out=block)
            else:
                dst.append(block)
                src.append(part)
            continue
        flat = t.detach().reshape(-1)  # padding (the partial row's tail, empty rows): zeroed above
        parts = [(block[:whole], flat[: whole * s].view(whole, s))] if whole else []
        if rest:
            parts.append((block[whole, :rest], flat[whole * s :]))
        for dst_part, part in parts:
            if large:
                torch.mul(part, scale, out=dst_part)
            else:
                dst.append(dst_part)
                src.append(part)


def wire_dtype(layout: ShardLayout, bucket: Bucket, comm_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a bucket's gradients travel in: ``comm_dtype``, default the params' working dtype."""
    return comm_dtype if comm_dtype is not None else layout[bucket.names[0]].dtype


def launch_reduce(
    rows: torch.Tensor,
    layout: ShardLayout,
    bucket: Bucket,
    group: Group,
    how: str,
    *,
    comm_dtype: torch.dtype | None = None,
    wire_out: torch.Tensor | None = None,
    async_op: bool = False,
    whole: bool = False,
    staging: StagingPool | None = None,
    out: torch.Tensor | None = None,
) -> comm.Pending:
    """Start summing one bucket's packed rows (from :func:`pack_grads`) over the group.

    The rows are cast to the wire dtype first (:func:`wire_dtype`: ``comm_dtype``, default
    the params' working dtype; scaled in the gradients' dtype first, then cast).

    Args:
      rows: ``(N, S)`` rows from :func:`pack_grads`; consumed (the all-reduce sums into them
        when no cast is needed).
      layout: the layout the rows follow.
      bucket: the bucket of ``layout`` the rows hold.
      group: the sharding process group.
      how: ``"reduce_scatter"``, ``"all_to_all"`` or ``"all_reduce"``
        (:func:`zerofn.stages._reduce_grads.reduce_realisation`).
      comm_dtype: dtype on the wire; ``None``: the params' working dtype.
      wire_out: an ``(N, S)`` buffer of the wire dtype to cast into (reused by the facade);
        default a new one. Unused when no cast is needed.
      async_op: launch and return at once.
      whole: keep every row of the sum, not just this rank's (needs ``how="all_reduce"``):
        the full mean gradients, for :func:`unpack_rows`.
      staging: the all-to-all receives into a buffer of this pool, given back when
        ``wait()`` has added its rows (default: a new buffer per call).
      out: an ``(S,)`` contiguous tensor of the wire dtype this rank's row of the sum lands
        in (:meth:`GradShards.target <zerofn.stages._grad_shards.GradShards.target>`: its
        range of the flat gradient buffer, so no copy puts it there); default: a row of
        ``rows`` or a new tensor. Not with ``whole``.

    Returns:
      A :class:`~zerofn._comm.Pending` whose ``wait()`` is this rank's ``(S,)`` row of the
      sum (``out`` when given; with ``whole``, the ``(N, S)`` sum), in the wire dtype.

    Collectives: one ``reduce_scatter``, ``all_to_all_single`` or ``all_reduce`` (``how``)
    of ``N * S`` elements.
    """
    wire = wire_dtype(layout, bucket, comm_dtype)
    if wire != rows.dtype:
        if wire_out is not None:
            rows = wire_out.copy_(rows)  # what rows.to(wire) computes
        else:
            rows = rows.to(wire)
    if how != "all_to_all" or staging is None or rows.shape[0] == 1 or comm.tracing():
        return comm.sum_rows(rows, group, how, async_op=async_op, whole=whole, out=out)
    borrowed = staging.take(rows.numel(), rows.dtype, rows.device)
    received = borrowed[: rows.numel()].view(rows.shape)
    pending = comm.sum_rows(rows, group, how, async_op=async_op, whole=whole, received=received, out=out)

    def given_back(row: torch.Tensor) -> torch.Tensor:
        staging.give(borrowed)  # the row is summed (in rows[rank] or out): nothing reads ``received`` any more
        return row

    return pending.then(given_back)


def split_row(
    row: torch.Tensor,
    layout: ShardLayout,
    bucket: Bucket,
    present: Collection[str],
    *,
    dtype: torch.dtype | None = None,
    rank: int | None = None,
) -> dict[str, torch.Tensor]:
    """Cut this rank's reduced ``(S,)`` bucket row into per-param shards, ``present`` names only.

    The row is cast back from the wire to ``dtype``, the dtype the gradients came in
    (default: the params' working dtype); a row that is a view of a bigger buffer (the
    all-reduce realisation) is copied out so the ``(N, S)`` buffer can be freed. The
    shards are views of that one row.

    Args:
      rank: this rank (whose row ``row`` is); needed when the bucket holds whole params,
        of which only the ones ``rank`` owns are in the row.

    Returns:
      name -> ``(shard_numel,)`` shard for a split param, the full-shape gradient (a view
      of the row) for a whole param this rank owns; whole params of other ranks are left
      out. In bucket order.

    Collectives: none.
    """
    plan = _bucket_plan(layout, bucket)
    if rank is None and plan.split_width < bucket.shard_numel:
        raise ValueError("split_row: this bucket holds whole params; pass rank= (whose row this is)")
    dtype = dtype if dtype is not None else layout[bucket.names[0]].dtype
    if row.dtype != dtype:
        row = row.to(dtype)
    elif row._base is not None:
        row = row.clone()
    out: dict[str, torch.Tensor] = {}
    for name, s, _, _, col, owner in plan.members:
        if name not in present or (owner >= 0 and owner != rank):
            continue
        out[name] = row[col : col + s] if owner < 0 else row[col : col + s].view(layout[name].shape)
    return out


def unpack_rows(
    rows: torch.Tensor | Sequence[torch.Tensor],
    layout: ShardLayout,
    bucket: Bucket,
    out: Mapping[str, torch.Tensor] | None = None,
    *,
    names: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
    targets: Sequence[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Write an ``(N, S)`` bucket buffer into full tensors, padding dropped.

    The buffer is either the gathered master rows (params) or a whole reduced bucket
    (:func:`launch_reduce` with ``whole=True``: the full mean gradients, as DDP leaves
    them in ``p.grad``). All members are written with one ``_foreach_copy_`` (which
    casts when the buffer's dtype differs from a destination's).

    Args:
      rows: ``(N, S)`` buffer, any dtype; or its ``N`` rows as separate ``(S,)`` tensors
        (a gather's broadcasts: each row is read where it lies, and stacking them would
        copy the bucket once more).
      layout: the layout the rows follow.
      bucket: the bucket of ``layout`` the rows hold.
      out: name -> destination of the param's shape (contiguous), written in place
        (e.g. the model's params; call under ``torch.no_grad()`` for leaves that require
        grad). Default: new tensors on ``rows.device``.
      names: members to write (default: every member of the bucket), e.g. only the
        params that had gradients.
      dtype: dtype of new tensors (default ``rows.dtype``); ignored with ``out``.
      targets: :func:`unpack_targets` of the same ``out`` and ``names`` (and rows given
        the same way), made once by a caller that writes the same tensors every step:
        building a view per member costs microseconds each, a model of a thousand params
        milliseconds a step.

    Returns:
      name -> full tensor (``out``'s where given), in bucket order.

    Collectives: none.
    """
    separate = not isinstance(rows, torch.Tensor)
    first = rows[0] if separate else rows
    plan = _bucket_plan(layout, bucket)
    members = _members(plan, names)
    if out is not None:
        result = {m.name: out[m.name] for m in members}
    else:
        make = functools.partial(torch.empty, dtype=dtype or first.dtype, device=first.device)
        result = {m.name: make(layout[m.name].shape) for m in members}
    dst = targets if targets is not None else member_targets(layout.world_size, plan, members, result, separate)
    if dst:
        torch._foreach_copy_(dst, member_sources(rows, plan, members, separate))
    return result


def unpack_targets(
    layout: ShardLayout,
    bucket: Bucket,
    out: Mapping[str, torch.Tensor],
    *,
    names: Iterable[str] | None = None,
    separate: bool = False,
) -> list[torch.Tensor]:
    """The destination views :func:`unpack_rows` writes ``out``'s members through, in its order.

    Views of ``out``'s tensors (``(k, width)`` blocks of their full rows, and the rest
    of the row that holds padding), valid while those tensors keep their storage; pass
    them back as ``unpack_rows(..., targets=)``. ``separate``: for rows given as ``N``
    separate tensors. Collectives: none.
    """
    plan = _bucket_plan(layout, bucket)
    members = _members(plan, names)
    return member_targets(layout.world_size, plan, members, {m.name: out[m.name] for m in members}, separate)


def _members(plan: BucketPlan, names: Iterable[str] | None) -> list[MemberPlan]:
    """The bucket's members to write (all, or those in ``names``), in bucket order."""
    members = plan.members
    if names is None:
        return list(members)
    wanted = set(names)
    return [m for m in members if m.name in wanted]
