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

Communicating pieces (through :mod:`zerofn.comm`, which owns every collective)::

    launch_reduce   (N, S) rows -> Pending (S,) row of the sum  (or the whole (N, S))
    launch_gather   (S,) row -> Pending (N, S) rows of every rank

Where a piece can write into a caller's buffer it takes ``out=``, so the facade's reused
staging buffers go through the same code as the functional path's fresh ones, and both
give the same bits.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

import torch

from zerofn import _comm as comm
from zerofn import _placement
from zerofn._comm import Group
from zerofn.flat import FlatDict, run_view
from zerofn.layout import Bucket, ParamSpec, ShardLayout

__all__ = [
    "BucketPlan",
    "MemberPlan",
    "StagingPool",
    "bucket_plan",
    "cut_shard",
    "launch_gather",
    "launch_reduce",
    "pack_grads",
    "pack_shards",
    "split_row",
    "unpack_rows",
]

# Members of at least this many elements (N * width) are copied and scaled in one pass
# (``torch.mul(..., out=)``); smaller ones in one batched ``_foreach_copy_`` +
# ``_foreach_mul_`` per bucket (per-call overhead dominates for them).
FUSED_MIN_NUMEL = 2**16


class MemberPlan(NamedTuple):
    """Where one member of a bucket sits in the ``(N, S)`` rows.

    Attributes:
      name: the param's name.
      width: split: columns it takes in every row (its ``shard_numel``); whole: its
        ``numel``, the columns it takes in its owner's row.
      whole: split: rows its flat tensor fills completely (``numel // width``; 0 for an
        empty param); 0 for a whole param.
      rest: split: elements of its flat tensor in row ``whole`` (the rest of that row is
        padding); 0 for a whole param.
      col: its first column (``bucket.offsets``).
      owner: the row that holds a whole param; -1 for a split one (every row).
    """

    name: str
    width: int
    whole: int
    rest: int
    col: int = 0
    owner: int = -1


class BucketPlan(NamedTuple):
    """A bucket's static copy plan.

    Attributes:
      widths: the split members' widths, side by side from column 0 (one ``torch.split``
        of the rows' first ``split_width`` columns into column blocks).
      members: every member's :class:`MemberPlan`, in bucket order.
      split_width: columns the split members take; the whole members' region follows.
      chunked: every split member is small (``N * width < FUSED_MIN_NUMEL``), non-empty
        and exactly ``ceil(numel / N)`` wide, so the split region of the rows is
        ``torch._chunk_cat`` of the flattened gradients (each zero-padded, cut into ``N``
        chunks, chunk ``r`` of each in row ``r``): one call for the whole bucket.
    """

    widths: tuple[int, ...]
    members: tuple[MemberPlan, ...]
    split_width: int = 0
    chunked: bool = False

    @property
    def split_members(self) -> tuple[MemberPlan, ...]:
        return tuple(m for m in self.members if m.owner < 0)

    @property
    def whole_members(self) -> tuple[MemberPlan, ...]:
        return tuple(m for m in self.members if m.owner >= 0)


@functools.lru_cache(maxsize=1024)
def bucket_plan(layout: ShardLayout, bucket: Bucket) -> BucketPlan:
    """The :class:`BucketPlan` of ``bucket`` in ``layout`` (cached per pair; pure).

    Raises ``AssertionError`` if the bucket's offsets do not describe such rows: split
    members side by side from column 0 in bucket order, whole members after them, no two
    members of one row overlapping, everything within ``bucket.shard_numel``.
    """
    split = [(n, o) for n, o in zip(bucket.names, bucket.offsets, strict=True) if not layout[n].is_whole]
    widths = tuple(layout[n].shard_numel for n, _ in split)
    starts = (0, *itertools.accumulate(widths))
    if tuple(o for _, o in split) != starts[:-1]:  # split members side by side
        raise AssertionError(f"zerofn: bucket members are not packed side by side: {bucket}")
    split_width = starts[-1]
    used: dict[int, list[tuple[int, int]]] = {}
    members = []
    for name, col in zip(bucket.names, bucket.offsets, strict=True):
        spec = layout[name]
        if spec.is_whole:
            members.append(MemberPlan(name, spec.numel, 0, 0, col, spec.owner))
            used.setdefault(spec.owner, []).append((col, col + spec.numel))
        else:
            s = spec.shard_numel
            whole = spec.numel // s if s else 0
            members.append(MemberPlan(name, s, whole, spec.numel - whole * s, col))
    ends = [split_width]
    for spans in used.values():
        spans.sort()
        if spans[0][0] < split_width or any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            raise AssertionError(f"zerofn: whole members of a bucket overlap: {bucket}")
        ends.append(spans[-1][1])
    if max(ends) != bucket.shard_numel:
        raise AssertionError(f"zerofn: bucket members do not fill a row of {bucket.shard_numel}: {bucket}")
    n = layout.world_size
    chunked = bool(widths) and all(
        m.owner < 0 and 0 < m.width * n < FUSED_MIN_NUMEL and -(-(m.whole * m.width + m.rest) // n) == m.width
        for m in members
        if m.owner < 0
    )
    return BucketPlan(widths, tuple(members), split_width, chunked)


def _bucket_plan(layout: ShardLayout, bucket: Bucket) -> BucketPlan:
    """:func:`bucket_plan`; under torch.compile its pure body, traced once per graph."""
    return (bucket_plan.__wrapped__ if torch.compiler.is_compiling() else bucket_plan)(layout, bucket)


class StagingPool:
    """A free list of flat bucket buffers per (dtype, device), reused between buckets and steps.

    Explicit reuse: the facade keeps one (its gradient staging, which its param gathers
    borrow between ``step`` and the next ``backward``), and a functional loop may pass
    one to :func:`~zerofn.reduce_grads` and :func:`~zerofn.gather_params` (``staging=``).
    Fresh multi-MB buffers every step fault in new pages: measured, a 16 MiB fresh
    buffer costs twice the copy into it, and a fresh-row pack of the benchmark
    transformer's gradients 25 ms against 7 ms into a reused one. What comes out of the
    stage functions never aliases a pool buffer: results are copied out first.

    ``take`` hands out the smallest free buffer with room (or a new one of at least
    ``min_numel`` elements); ``give`` returns one once nothing reads it any more, keeping at
    most ``keep`` per (dtype, device) (the smallest are dropped). Not thread safe; one
    pool per training loop.
    """

    def __init__(self, keep: int = 3, min_numel: int = 0) -> None:
        self._keep = keep
        self._min_numel = min_numel
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled graph plans its own buffers: never reuse in a trace
            return torch.empty(max(numel, self._min_numel), dtype=dtype, device=device)
        free = self._free.get((dtype, device))
        if free:
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(max(numel, self._min_numel), dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # nothing kept between calls of a compiled graph
            return
        free = self._free.setdefault((buf.dtype, buf.device), [])
        free.append(buf)
        if len(free) > self._keep:
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def give_unless_aliased(self, buf: torch.Tensor, readers: Iterable[torch.Tensor]) -> None:
        """Return ``buf`` unless one of ``readers`` is a view of it (then it is simply dropped)."""
        if torch.compiler.is_compiling():  # no storage addresses in a trace: the compiler owns buffers
            return
        ptr = buf.untyped_storage().data_ptr()
        if all(t.untyped_storage().data_ptr() != ptr for t in readers):
            self.give(buf)

    def buffers(self) -> list[torch.Tensor]:
        """The idle buffers held now."""
        return [b for free in self._free.values() for b in free]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def clear(self) -> None:
        self._free = {}


# --------------------------------------------------------------------------- reduce side


def pack_grads(
    grads: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    bucket: Bucket,
    *,
    replicas: int = 1,
    out: torch.Tensor | None = None,
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
        staging buffer); default a new one.

    Returns:
      The ``(N, bucket.shard_numel)`` rows in the gradients' dtype (``out`` itself if given).

    Collectives: none.
    """
    n = layout.world_size
    scale = 1.0 / (n * replicas)
    if out is None:
        first = next(g for g in (grads.get(name) for name in bucket.names) if g is not None)
        out = torch.empty(n, bucket.shard_numel, dtype=first.dtype, device=first.device)
    plan = _bucket_plan(layout, bucket)
    if torch.compiler.is_compiling() and plan.split_width == bucket.shard_numel:
        return _pack_split_traced(grads, plan, out, scale)
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


def _pack_split_traced(
    grads: Mapping[str, torch.Tensor | None], plan: BucketPlan, like: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`pack_grads` of an all-split bucket in a compiled graph: new rows, built out of place.

    Writing members into views of one buffer becomes, in a graph, a scatter of the whole
    buffer per member; here each member is scaled (by the same 0-d factor, so the same
    bits), zero-padded and the column blocks concatenated once. ``like`` gives the rows'
    shape, dtype and device; it is not written.
    """
    n = like.shape[0]
    factor = torch.tensor(scale, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
    blocks = []
    for name, s, _, _, _, _ in plan.split_members:
        t = grads.get(name)
        if t is None:
            blocks.append(torch.zeros(n, s, dtype=like.dtype, device=like.device))
            continue
        flat = t.detach().reshape(-1) * factor
        if flat.numel() < n * s:
            flat = torch.cat([flat, flat.new_zeros(n * s - flat.numel())])
        blocks.append(flat.view(n, s))
    return torch.cat(blocks, dim=1)


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
    tensors = []
    for m in plan.split_members:
        t = grads.get(m.name)
        if t is None:
            return False
        tensors.append(t if t.dim() == 1 else t.reshape(-1))
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
) -> comm.Pending:
    """Start summing one bucket's packed rows (from :func:`pack_grads`) over the group.

    The rows are cast to the wire dtype first (:func:`wire_dtype`: ``comm_dtype``, default
    the params' working dtype; the seed's order: scale in the gradients' dtype, then cast).

    Args:
      rows: ``(N, S)`` rows from :func:`pack_grads`; consumed (the all-reduce sums into them
        when no cast is needed).
      layout: the layout the rows follow.
      bucket: the bucket of ``layout`` the rows hold.
      group: the sharding process group.
      how: ``"reduce_scatter"`` or ``"all_reduce"`` (:func:`zerofn.stages.reduce_realisation`).
      comm_dtype: dtype on the wire; ``None``: the params' working dtype.
      wire_out: an ``(N, S)`` buffer of the wire dtype to cast into (reused by the facade);
        default a new one. Unused when no cast is needed.
      async_op: launch and return at once.
      whole: keep every row of the sum, not just this rank's (needs ``how="all_reduce"``):
        the full mean gradients, for :func:`unpack_rows`.

    Returns:
      A :class:`~zerofn.comm.Pending` whose ``wait()`` is this rank's ``(S,)`` row of the
      sum (with ``whole``, the ``(N, S)`` sum), in the wire dtype.

    Collectives: one ``reduce_scatter`` or ``all_reduce`` (``how``) of ``N * S`` elements.
    """
    wire = wire_dtype(layout, bucket, comm_dtype)
    if wire != rows.dtype:
        if wire_out is not None:
            rows = wire_out.copy_(rows)  # what rows.to(wire) computes
        else:
            rows = rows.to(wire)
    return comm.sum_rows(rows, group, how, async_op=async_op, whole=whole)


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
    rows: torch.Tensor,
    layout: ShardLayout,
    bucket: Bucket,
    out: Mapping[str, torch.Tensor] | None = None,
    *,
    names: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Write an ``(N, S)`` bucket buffer into full tensors, padding dropped.

    The buffer is either the gathered master rows (params) or a whole reduced bucket
    (:func:`launch_reduce` with ``whole=True``: the full mean gradients, as DDP leaves
    them in ``p.grad``). All members are written with one ``_foreach_copy_`` (which
    casts when the buffer's dtype differs from a destination's).

    Args:
      rows: ``(N, S)`` buffer, any dtype.
      layout: the layout the rows follow.
      bucket: the bucket of ``layout`` the rows hold.
      out: name -> destination of the param's shape (contiguous), written in place
        (e.g. the model's params; call under ``torch.no_grad()`` for leaves that require
        grad). Default: new tensors on ``rows.device``.
      names: members to write (default: every member of the bucket), e.g. only the
        params that had gradients.
      dtype: dtype of new tensors (default ``rows.dtype``); ignored with ``out``.

    Returns:
      name -> full tensor (``out``'s where given), in bucket order.

    Collectives: none.
    """
    n = layout.world_size
    wanted = None if names is None else set(names)
    plan = _bucket_plan(layout, bucket)
    result: dict[str, torch.Tensor] = {}
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    split_blocks = rows[:, : plan.split_width].split(plan.widths, dim=1)
    blocks = dict(zip((m.name for m in plan.split_members), split_blocks, strict=True))
    for name, s, whole, rest, col, owner in plan.members:
        if wanted is not None and name not in wanted:
            continue
        if out is not None:
            full = out[name]
        else:
            spec = layout[name]
            full = torch.empty(spec.shape, dtype=dtype or rows.dtype, device=rows.device)
        result[name] = full
        if s == 0:
            continue
        if owner >= 0:  # a whole param: its owner's row
            dst.append(full.view(-1))
            src.append(rows[owner, col : col + s])
            continue
        block = blocks[name]
        if whole == n:
            dst.append(full.view(n, s))
            src.append(block)
            continue
        flat = full.view(-1)
        if whole:
            dst.append(flat[: whole * s].view(whole, s))
            src.append(block[:whole])
        if rest:
            dst.append(flat[whole * s :])
            src.append(block[whole, :rest])
    if dst:
        torch._foreach_copy_(dst, src)
    return result


# --------------------------------------------------------------------------- gather side


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
    plan = _bucket_plan(layout, bucket)
    if plan.split_width < bucket.shard_numel:
        return _pack_whole_row(shards, plan, bucket, dtype=dtype, device=device, out=out, rank=rank)
    lone = _flat_range(shards, bucket)
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


def _flat_range(shards: Mapping[str, torch.Tensor], bucket: Bucket) -> torch.Tensor | None:
    """The range of a flat buffer that holds a split bucket's shards side by side, or ``None``
    (``shards`` not flat, or the members not one run of one buffer)."""
    if not isinstance(shards, FlatDict) or not shards.holds_all:
        return None
    runs = shards.flat_layout.runs(bucket.names)
    if len(runs) != 1 or runs[0][0] < 0:
        return None
    return run_view(shards, runs[0])


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
      row: this rank's contiguous ``(S,)`` row; read, never written. With the broadcast
        realisation it may be ``out[rank]`` (packed in place by ``pack_shards(out=)``).
      group: the sharding process group.
      how: ``"all_gather"`` or ``"broadcast"`` (the gather realisation of a
        :class:`~zerofn.comm.CommPolicy`).
      async_op: launch and return at once.
      out: an ``(N, S)`` buffer to receive into (explicit reuse: the facade's staging
        buffers, idle between ``step`` and the next ``backward``); default a new one.

    Returns:
      A :class:`~zerofn.comm.Pending` whose ``wait()`` is the ``(N, S)`` buffer (row
      ``r`` from rank ``r``; ``out`` if given), for :func:`unpack_rows`.

    Collectives: one ``all_gather`` of ``N * S`` elements, or ``N`` broadcasts of ``S``.
    """
    return comm.gather_rows(row, group, how, async_op=async_op, out=out)


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
