"""A bucket's static copy plan: where each member sits in the rank-major ``(N, S)`` rows,
and the views of the rows and of full tensors that an unpack copies between.

Every bucket piece (:mod:`zerofn.buckets`) reads member widths and positions from a
:class:`BucketPlan`, computed once per (layout, bucket) and cached, never from a placement
rule of its own. Public through :mod:`zerofn.buckets`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from zerofn import _traced
from zerofn._offsets import Bucket
from zerofn.layout import ShardLayout, live_layout

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
      filled: every member is split and fills its ``N`` rows exactly (no padding, no whole
        params): one split of the rows' columns gives every member's piece of a row.
    """

    widths: tuple[int, ...]
    members: tuple[MemberPlan, ...]
    split_width: int = 0
    chunked: bool = False
    filled: bool = False

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
    filled = all(m.owner < 0 and m.whole == n for m in members)
    return BucketPlan(widths, tuple(members), split_width, chunked, filled)


def _bucket_plan(layout: ShardLayout, bucket: Bucket) -> BucketPlan:
    """:func:`bucket_plan`; in a compiled step computed at trace time and read as constants
    (tracing the planner costs per member), the layout passed as its fingerprint."""
    if not torch.compiler.is_compiling():
        return bucket_plan(layout, bucket)
    widths, members, split_width, chunked, filled = _traced_bucket_plan(
        layout.fingerprint, bucket.names, bucket.offsets, bucket.shard_numel
    )
    return BucketPlan(widths, tuple(MemberPlan(*m) for m in members), split_width, chunked, filled)


def split_width(layout: ShardLayout, bucket: Bucket) -> int:
    """The bucket plan's ``split_width``; in a compiled step without a plan object per member."""
    if not torch.compiler.is_compiling():
        return bucket_plan(layout, bucket).split_width
    return _traced_bucket_plan(layout.fingerprint, bucket.names, bucket.offsets, bucket.shard_numel)[2]


@_traced.constant_result
def _traced_bucket_plan(fingerprint: str, names: tuple[str, ...], offsets: tuple[int, ...], shard_numel: int) -> tuple:
    """The plan as plain tuples (what a trace takes as constants)."""
    layout = live_layout(fingerprint)
    plan = bucket_plan(layout, Bucket(names, offsets, shard_numel))
    return plan.widths, tuple(tuple(m) for m in plan.members), plan.split_width, plan.chunked, plan.filled


def _pieces(members: Sequence[MemberPlan]) -> list[tuple[MemberPlan, bool]]:
    """The copies an unpack makes, in order: per member with elements, ``(m, False)`` for its
    full rows (a whole param: all of it), then ``(m, True)`` for the rest of its last row.
    Both sides of the copy (:func:`member_targets`, :func:`member_sources`) walk this list."""
    out: list[tuple[MemberPlan, bool]] = []
    for m in members:
        if m.width == 0:
            continue
        if m.owner >= 0 or m.whole:
            out.append((m, False))
        if m.rest:  # (0 for a whole param, and for a split one that fills its N rows)
            out.append((m, True))
    return out


def _filled(plan: BucketPlan, members: Sequence[MemberPlan]) -> bool:
    """A :attr:`BucketPlan.filled` bucket with every member written: an unpack copies the
    pieces as split (block by block, or row by row for rows apart)."""
    return plan.filled and len(members) == len(plan.members)


def member_targets(
    n: int, plan: BucketPlan, members: Sequence[MemberPlan], full: Mapping[str, torch.Tensor], separate: bool
) -> list:
    """The views :func:`~zerofn.buckets.unpack_rows` writes ``full``'s members through, in
    ``members``' order: per split member its full rows as one ``(k, width)`` view (``k`` row
    views when ``separate``), then the rest of its last row; a whole param, all of it.
    Rows apart of a :func:`_filled` bucket: row 0 of every member, then row 1, ..."""
    if separate and _filled(plan, members):
        blocks = [full[m.name].view(n, m.width) for m in members]
        return [b[r] for r in range(n) for b in blocks]
    dst: list[torch.Tensor] = []
    for m, rest in _pieces(members):
        t = full[m.name]
        if m.owner >= 0:  # a whole param: its owner's row
            dst.append(t.view(-1))
        elif rest:
            dst.append(t.view(-1)[m.whole * m.width :])
        else:
            block = t.view(n, m.width) if m.whole == n else t.view(-1)[: m.whole * m.width].view(m.whole, m.width)
            dst.extend(block.unbind(0) if separate else (block,))
    return dst


def member_sources(
    rows: torch.Tensor | Sequence[torch.Tensor], plan: BucketPlan, members: Sequence[MemberPlan], separate: bool
) -> list[torch.Tensor]:
    """What :func:`member_targets`' views receive, in the same order: blocks of the rows' columns."""
    n = len(rows)
    if _filled(plan, members):  # the pieces as split: row by row, or the column blocks
        if separate:
            return [piece for r in rows for piece in r[: plan.split_width].split(plan.widths)]
        return list(rows[:, : plan.split_width].split(plan.widths, dim=1))  # type: ignore[call-overload]
    if separate:  # a member's block is its N row pieces
        per_row = [r[: plan.split_width].split(plan.widths) for r in rows]
        split_blocks: Sequence[Any] = [list(pieces) for pieces in zip(*per_row, strict=True)]
    else:
        split_blocks = rows[:, : plan.split_width].split(plan.widths, dim=1)  # type: ignore[call-overload]
    blocks = dict(zip((m.name for m in plan.split_members), split_blocks, strict=True))
    src: list[torch.Tensor] = []
    for m, rest in _pieces(members):
        if m.owner >= 0:
            src.append(rows[m.owner][m.col : m.col + m.width])
        elif rest:
            src.append(blocks[m.name][m.whole][: m.rest])
        else:
            part = blocks[m.name] if m.whole == n else blocks[m.name][: m.whole]
            src.extend(part if separate else (part,))
    return src
