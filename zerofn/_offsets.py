"""Every offset zerofn uses: computed here, and only read everywhere else.

Note: the tables
----------------
flat group
    The split (and ``blocked(B)``) params of one working dtype, in layout order, side by
    side: member ``k``'s shard starts where member ``k - 1``'s ends (:class:`FlatGroup`).
    The table is the same on every rank; each rank's flat buffer of the group (its
    masters, gradients, each optimizer-state tensor) follows it. No alignment padding:
    a buffer holds the shards' own padding and nothing else.
bucket
    Params that travel in one collective, each rank's shards of them side by side in its
    row of a rank-major ``(N, S)`` buffer (:attr:`Bucket.offsets`). A split bucket of the
    plan is a run of consecutive members of one flat group (a dtype change or the bucket
    size ends it), so its row is one range of the group's buffer, :attr:`Bucket.span`,
    and each member's column is its group offset less the span's start. Whole params
    travel in buckets of their own, each in its owner's row.
full param
    Where each full param starts in a gather's fresh buffer of its dtype: a multiple of
    :data:`FULL_ALIGN`.

:class:`FlatLayout` is one rank's view of the groups: the whole params it owns (kept in
their own tensors, "loose"), and each name's ``(group, offset, numel)``. Everything here
is a pure, cached function of a :class:`~zerofn.layout.ShardLayout` (and a rank): no
tensors, no collectives. Under ``torch.compile`` the tables are computed at trace time
and enter the graph as constants, the layout named by its fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from zerofn import _traced
from zerofn.layout import ParamSpec, ShardLayout, live_layout

__all__ = [
    "FULL_ALIGN",
    "Bucket",
    "FlatGroup",
    "FlatLayout",
    "Span",
    "flat_groups",
    "flat_layout",
    "full_param_offsets",
    "plan_buckets",
    "sub_buckets",
]


class Span(NamedTuple):
    """``buf[start:stop]`` of flat group ``group``'s buffer."""

    group: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Parameters that travel together in one collective.

    Attributes:
      names: parameter names, in layout order.
      offsets: where each parameter's shard starts inside a rank's row of the bucket.
      shard_numel: elements of one rank's row (sum of the members' ``shard_numel``).
      span: where the row lies in every rank's buffer of its flat group, for a bucket of
        split params that is one run of that group (every split bucket of the full plan);
        ``None`` for a bucket of whole params, or of a subset of the names with gaps.
    """

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    shard_numel: int
    span: Span | None = None


@dataclasses.dataclass(frozen=True)
class FlatGroup:
    """One flat buffer's plan: the shards of ``names`` at ``offsets``, ``numel`` elements in all.

    Attributes:
      dtype: the members' working dtype (the buffer's dtype is the kind's: master,
        gradient or state dtype).
      names: members, in layout order.
      offsets: where each member's shard starts in the buffer.
      numels: each member's ``shard_numel``.
      numel: the buffer's length, ``sum(numels)``.
    """

    dtype: torch.dtype
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int


@functools.lru_cache(maxsize=256)
def flat_groups(layout: ShardLayout) -> tuple[FlatGroup, ...]:
    """The flat groups of ``layout``: one per working dtype of its split params, in order of
    first appearance. The same on every rank (every rank holds a shard of every split param)."""
    members: dict[torch.dtype, list[ParamSpec]] = {}
    for spec in layout.params:
        if not spec.is_whole:
            members.setdefault(spec.dtype, []).append(spec)
    groups = []
    for dtype, specs in members.items():
        numels = tuple(s.shard_numel for s in specs)
        starts = tuple(itertools.accumulate(numels, initial=0))
        groups.append(FlatGroup(dtype, tuple(s.name for s in specs), starts[:-1], numels, starts[-1]))
    return tuple(groups)


@functools.lru_cache(maxsize=256)
def _group_table(layout: ShardLayout) -> Mapping[str, tuple[int, int, int]]:
    """split name -> ``(group, offset, numel)``, read from :func:`flat_groups`."""
    return {
        name: (gi, off, k)
        for gi, group in enumerate(flat_groups(layout))
        for name, off, k in zip(group.names, group.offsets, group.numels, strict=True)
    }


# ------------------------------------------------------------------------- the bucket plan


def plan_buckets(layout: ShardLayout, bucket_numel: int, names: Iterable[str] | None = None) -> tuple[Bucket, ...]:
    """The rank-major bucket plan of ``layout`` for ``names`` (default: all params), in layout order.

    Split parameters join a bucket in layout order until the next one would take the
    bucket's padded size (``world_size * shard_numel``) past ``bucket_numel`` or has
    another dtype (a bucket is one flat buffer); a parameter larger than ``bucket_numel``
    travels alone. Empty parameters (``numel == 0``) have nothing to send and are left out
    of every bucket. Each split bucket of every name is one run of its flat group
    (:attr:`Bucket.span`).

    Whole parameters travel in buckets of their own, after the split ones, one dtype per
    bucket. A bucket takes, for every rank, that rank's next whole params in owner-plan
    order (largest first) while its row stays within the bucket's width:
    ``max(bucket_numel // world_size, the largest next param of any rank)``. So every row
    starts with a param of about the same size and the rows are filled to about the same
    length; the padding (the rows' unused tails) is bounded by one param per row and
    measured on the benchmark transformer in the tests.

    Cached per (layout, names, bucket_numel); the same on every rank.

    Raises:
      ValueError: ``bucket_numel`` is not positive.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket_numel must be a positive number of elements, got {bucket_numel}")
    chosen = None if names is None else tuple(names)  # once: `names` may be a one-shot iterator
    if torch.compiler.is_compiling():
        # A compiled step takes the plan as a constant, computed for real (tracing the
        # planner costs per param); the layout travels as its fingerprint, one string.
        return _traced_plan(layout.fingerprint, chosen, operator.index(bucket_numel))
    return _plan_buckets(layout, chosen, bucket_numel)


def _wanted(layout: ShardLayout, names: tuple[str, ...] | None) -> tuple[str, ...]:
    """``names`` (default: all) in layout order."""
    if names is None:
        return layout.names
    chosen = set(names)
    return tuple(n for n in layout.names if n in chosen)


@_traced.constant_result
def _traced_plan(fingerprint: str, names: tuple[str, ...] | None, bucket_numel: int) -> tuple[Bucket, ...]:
    """:func:`plan_buckets` for a compiled step: run at trace time, its result a constant."""
    layout = live_layout(fingerprint)
    return _plan_buckets(layout, names, bucket_numel)


@functools.lru_cache(maxsize=256)
def _plan_buckets(layout: ShardLayout, chosen: tuple[str, ...] | None, bucket_numel: int) -> tuple[Bucket, ...]:
    names = _wanted(layout, chosen)  # inside the cache: a step asks for every name without listing them
    split = tuple(n for n in names if not layout[n].is_whole)
    whole = tuple(n for n in names if layout[n].is_whole)
    return _plan_split_buckets(layout, split, bucket_numel) + _plan_whole_buckets(layout, whole, bucket_numel)


def _plan_split_buckets(layout: ShardLayout, names: tuple[str, ...], bucket_numel: int) -> tuple[Bucket, ...]:
    table = _group_table(layout)
    buckets: list[Bucket] = []
    members: list[str] = []
    row = 0
    for name in names:
        spec = layout[name]
        if spec.numel == 0:
            continue
        too_big = (row + spec.shard_numel) * layout.world_size > bucket_numel
        if members and (too_big or spec.dtype != layout[members[0]].dtype):
            buckets.append(_split_bucket(table, members, layout))
            members, row = [], 0
        members.append(name)
        row += spec.shard_numel
    if members:
        buckets.append(_split_bucket(table, members, layout))
    return tuple(buckets)


def _split_bucket(table: Mapping[str, tuple[int, int, int]], members: list[str], layout: ShardLayout) -> Bucket:
    """The bucket of ``members`` (split, one dtype, layout order): side by side in its row, from column 0."""
    widths = [layout[m].shard_numel for m in members]
    cols = tuple(itertools.accumulate(widths[:-1], initial=0))
    g, start, _ = table[members[0]]
    run = all(table[m][0] == g and table[m][1] == start + c for m, c in zip(members, cols, strict=True))
    return Bucket(tuple(members), cols, sum(widths), Span(g, start, start + sum(widths)) if run else None)


def sub_buckets(layout: ShardLayout, bucket: Bucket, members: int) -> tuple[tuple[Bucket, int], ...]:
    """``bucket`` cut into runs of at most ``members`` members, each ``(sub-bucket, first column)``.

    A sub-bucket is a bucket of its own, its members side by side from column 0: its rows
    are columns ``first : first + sub.shard_numel`` of ``bucket``'s rows. A bucket with whole
    params (placed by owner, not side by side) is returned whole, as is one of at most
    ``members`` members.
    """
    if torch.compiler.is_compiling():  # a walk over the members, run at trace time: a constant
        span = None if bucket.span is None else tuple(bucket.span)
        fields = (bucket.names, bucket.offsets, bucket.shard_numel, span)
        return _traced_sub_buckets(layout.fingerprint, fields, members)
    return _sub_buckets(layout, bucket, members)


@_traced.constant_result
def _traced_sub_buckets(fingerprint: str, fields: tuple[Any, ...], members: int) -> tuple[tuple[Bucket, int], ...]:
    """:func:`sub_buckets` for a compiled step, the layout passed as its fingerprint and the bucket as its fields."""
    layout = live_layout(fingerprint)
    names, offsets, shard_numel, span = fields
    return _sub_buckets(layout, Bucket(names, offsets, shard_numel, None if span is None else Span(*span)), members)


def _sub_buckets(layout: ShardLayout, bucket: Bucket, members: int) -> tuple[tuple[Bucket, int], ...]:
    if len(bucket.names) <= members or any(layout[n].is_whole for n in bucket.names):
        return ((bucket, 0),)
    out = []
    for i in range(0, len(bucket.names), members):
        names, cols = bucket.names[i : i + members], bucket.offsets[i : i + members]
        first = cols[0]
        width = cols[-1] + layout[names[-1]].shard_numel - first
        span = bucket.span and Span(bucket.span.group, bucket.span.start + first, bucket.span.start + first + width)
        out.append((Bucket(names, tuple(c - first for c in cols), width, span), first))
    return tuple(out)


def _plan_whole_buckets(layout: ShardLayout, names: tuple[str, ...], bucket_numel: int) -> tuple[Bucket, ...]:
    """Buckets of whole params: per dtype, rounds over every rank's queue (owner-plan order)."""
    n = layout.world_size
    rank_of = {name: i for i, name in enumerate(_owner_order(layout.params))}
    by_dtype: dict[torch.dtype, list[list[str]]] = {}
    for name in sorted((m for m in names if layout[m].numel), key=rank_of.__getitem__):
        queues = by_dtype.setdefault(layout[name].dtype, [[] for _ in range(n)])
        queues[layout[name].owner].append(name)
    cap = max(1, bucket_numel // n)
    index = layout._index
    buckets: list[Bucket] = []
    for queues in by_dtype.values():
        heads = [0] * n
        while any(heads[r] < len(queues[r]) for r in range(n)):
            width = max([cap] + [layout[queues[r][heads[r]]].numel for r in range(n) if heads[r] < len(queues[r])])
            cols: dict[str, int] = {}
            row_len = 0
            for r in range(n):
                used = 0
                while heads[r] < len(queues[r]) and used + layout[queues[r][heads[r]]].numel <= width:
                    name = queues[r][heads[r]]
                    cols[name] = used
                    used += layout[name].numel
                    heads[r] += 1
                row_len = max(row_len, used)
            members = sorted(cols, key=index.__getitem__)
            buckets.append(Bucket(tuple(members), tuple(cols[m] for m in members), row_len))
    return tuple(buckets)


def _owner_order(specs: Iterable[ParamSpec]) -> list[str]:
    """Whole params in owner-plan order: largest first, ties in layout order."""
    whole = [(i, p) for i, p in enumerate(specs) if p.is_whole]
    return [p.name for _, p in sorted(whole, key=lambda ip: (-ip[1].numel, ip[0]))]


# ------------------------------------------------------------------------- a rank's view


@dataclasses.dataclass(frozen=True, eq=False)
class FlatLayout:
    """Where every name this rank holds lives in its flat buffers (static, hashable).

    Attributes:
      world_size, rank: of the :class:`~zerofn.layout.ShardLayout` it was made from.
      fingerprint: that layout's fingerprint.
      groups: the layout's :func:`flat_groups`.
      loose: the whole params this rank owns, in layout order (own tensors, full shape).
      names: every name this rank holds, in layout order.
      where: name -> ``(group index, offset, numel)``; group index ``-1`` for loose names.
      shapes: name -> the shape ``d[name]`` has: ``(shard_numel,)`` or the full shape.
    """

    world_size: int
    rank: int
    fingerprint: str
    groups: tuple[FlatGroup, ...]
    loose: tuple[str, ...]
    names: tuple[str, ...]
    where: Mapping[str, tuple[int, int, int]] = dataclasses.field(repr=False)
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(repr=False)
    #: :meth:`runs` of every name, computed with the layout (a compiled step reads it, not a loop).
    all_runs: tuple[tuple[int, int, int, tuple[str, ...]], ...] = dataclasses.field(repr=False, default=())

    def __hash__(self) -> int:
        return hash((self.world_size, self.rank, self.fingerprint))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, FlatLayout):
            return NotImplemented
        # A flat layout is a function of its layout (named by the fingerprint) and rank: a
        # compiled step compares these three constants, not a tuple per name.
        return (self.world_size, self.rank, self.fingerprint) == (other.world_size, other.rank, other.fingerprint)

    def runs(self, names: tuple[str, ...]) -> tuple[tuple[int, int, int, tuple[str, ...]], ...]:
        """``names`` (a subsequence of :attr:`names`) as maximal contiguous runs, in layout order.

        Returns ``(group, start, stop, members)`` tuples: ``members`` fill
        ``buf[start:stop]`` of group ``group`` exactly; a loose name is a run of its own
        with group ``-1``. Cached.
        """
        if len(names) == len(self.names) and (self.all_runs or not names):  # such a subsequence is the names
            return self.all_runs
        if torch.compiler.is_compiling():  # a walk over the names, run at trace time: a constant
            return _traced_runs(self.fingerprint, operator.index(self.rank), names)
        return _runs(self, names)


@functools.lru_cache(maxsize=512)
def _runs(flat: FlatLayout, names: tuple[str, ...]) -> tuple[tuple[int, int, int, tuple[str, ...]], ...]:
    return _runs_in(flat.where, names)


@_traced.constant_result
def _traced_runs(
    fingerprint: str, rank: int, names: tuple[str, ...]
) -> tuple[tuple[int, int, int, tuple[str, ...]], ...]:
    """:meth:`FlatLayout.runs` for a compiled step, the layout passed as its fingerprint."""
    layout = live_layout(fingerprint)
    return _runs(_flat_layout(layout, rank), names)


def _runs_in(
    where: Mapping[str, tuple[int, int, int]], names: tuple[str, ...]
) -> tuple[tuple[int, int, int, tuple[str, ...]], ...]:
    out: list[tuple[int, int, int, tuple[str, ...]]] = []
    cur: list[Any] | None = None
    for name in names:
        g, off, n = where[name]
        if g >= 0 and cur is not None and cur[0] == g and cur[2] == off:
            cur[2] = off + n
            cur[3].append(name)
            continue
        if cur is not None:
            out.append((cur[0], cur[1], cur[2], tuple(cur[3])))
        cur = [g, off, off + n, [name]]
    if cur is not None:
        out.append((cur[0], cur[1], cur[2], tuple(cur[3])))
    return tuple(out)


def flat_layout(layout: ShardLayout, rank: int) -> FlatLayout:
    """The :class:`FlatLayout` of ``rank``'s shards under ``layout`` (cached; a pure function).

    Under ``torch.compile`` it is computed at trace time and enters the graph as constants,
    as the bucket plan does: when dynamo compiles one step function again for another
    layout (a second model), its automatic dynamic shapes turn every int read from the
    step's inputs into a symbol, and the offsets here order a group's rows, which takes
    concrete ints.
    """
    if torch.compiler.is_compiling():
        fields = _traced_flat_layout(layout.fingerprint, operator.index(rank))
        ws, r, fp, groups, loose, names, where, shapes, runs = fields
        groups = tuple(FlatGroup(*g) for g in groups)
        return FlatLayout(ws, r, fp, groups, loose, names, dict(where), dict(shapes), runs)
    return _flat_layout(layout, rank)


@_traced.constant_result
def _traced_flat_layout(fingerprint: str, rank: int) -> tuple[Any, ...]:
    """:func:`flat_layout`'s fields as plain tuples, the form a trace takes as constants (an
    object or a dict returned from here would be guarded through its constant source,
    which dynamo cannot guard)."""
    layout = live_layout(fingerprint)
    fl = _flat_layout(layout, rank)
    groups = tuple((g.dtype, g.names, g.offsets, g.numels, g.numel) for g in fl.groups)
    where, shapes = tuple(fl.where.items()), tuple(fl.shapes.items())
    return fl.world_size, fl.rank, fl.fingerprint, groups, fl.loose, fl.names, where, shapes, fl.all_runs


@functools.lru_cache(maxsize=256)
def _flat_layout(layout: ShardLayout, rank: int) -> FlatLayout:
    held = [spec for spec in layout.params if spec.holds(rank)]
    loose = tuple(spec.name for spec in held if spec.is_whole)
    where = {**_group_table(layout), **{n: (-1, 0, 0) for n in loose}}
    names = tuple(spec.name for spec in held)
    where = {n: where[n] for n in names}
    shapes: dict[str, tuple[int, ...]] = {spec.name: spec.local_shape(rank) for spec in held}  # type: ignore[misc]
    groups = flat_groups(layout)
    return FlatLayout(
        layout.world_size, rank, layout.fingerprint, groups, loose, names, where, shapes, _runs_in(where, names)
    )


# ------------------------------------------------------------------------- full params

#: Each full param in a gather's fresh buffers starts at a multiple of this many elements.
FULL_ALIGN = 16


@functools.lru_cache(maxsize=256)
def full_param_offsets(layout: ShardLayout) -> tuple[tuple[tuple[torch.dtype, int], ...], Mapping[str, int]]:
    """Where the full params of ``layout`` lie in one fresh buffer per working dtype (cached).

    Returns ``(sizes, offsets)``: each dtype's buffer size in elements (dtypes in order of
    first appearance) and each param's start in its dtype's buffer, in layout order, every
    start a multiple of :data:`FULL_ALIGN`.
    """
    offsets: dict[str, int] = {}
    sizes: dict[torch.dtype, int] = {}
    for s in layout.params:
        at = sizes.get(s.dtype, 0)
        offsets[s.name] = at
        sizes[s.dtype] = at + -(-s.numel // FULL_ALIGN) * FULL_ALIGN
    return tuple(sizes.items()), offsets
