"""The static half of :mod:`zerofn.flat`: where every name a rank holds lives in its flat buffers.

:class:`FlatGroup` (one buffer's plan), :class:`FlatLayout` (every group of a rank, the
loose whole params, each name's range and view shape, the contiguous runs of any names)
and :func:`flat_layout`, a pure, cached function of a :class:`~zerofn.layout.ShardLayout`
and a rank; and :func:`full_param_offsets`, where each full param of a gather's fresh
buffers starts. The vocabulary is in :mod:`zerofn.flat`, which exports these names. No
tensors, no collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from typing import Any

import torch

from zerofn import _traced
from zerofn.layout import ShardLayout, layout_by_fingerprint

__all__ = ["FULL_ALIGN", "FlatGroup", "FlatLayout", "flat_layout", "full_param_offsets"]


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


@dataclasses.dataclass(frozen=True, eq=False)
class FlatLayout:
    """Where every name this rank holds lives in its flat buffers (static, hashable).

    Attributes:
      world_size, rank: of the :class:`~zerofn.layout.ShardLayout` it was made from.
      fingerprint: that layout's fingerprint.
      groups: one :class:`FlatGroup` per working dtype, in order of first appearance.
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
        key = (self.world_size, self.rank, self.fingerprint, self.names)
        return key == (other.world_size, other.rank, other.fingerprint, other.names)

    def bucket_span(self, names: tuple[str, ...]) -> tuple[int, int, int]:
        """Where the bucket of ``names`` (its members, in order) lives in this rank's buffers.

        A split bucket is a run of consecutive same-dtype split params (the layout's bucket
        rule), so its members are consecutive in one group and its reduced row fills
        ``buf[start:stop]`` exactly: ``(group, start, stop)``, read from :attr:`where`, the
        one table of offsets. ``(-1, 0, 0)`` for a bucket of a whole param (loose, or not
        held here): it has no range in any buffer.
        """
        first = self.where.get(names[0])
        if first is None or first[0] < 0:
            return -1, 0, 0
        _, off, n = self.where[names[-1]]
        return first[0], first[1], off + n

    def runs(self, names: tuple[str, ...]) -> tuple[tuple[int, int, int, tuple[str, ...]], ...]:
        """``names`` (a subsequence of :attr:`names`) as maximal contiguous runs, in layout order.

        Returns ``(group, start, stop, members)`` tuples: ``members`` fill
        ``buf[start:stop]`` of group ``group`` exactly; a loose name is a run of its own
        with group ``-1``. Cached.
        """
        if len(names) == len(self.names) and (self.all_runs or not names):  # such a subsequence is the names
            return self.all_runs
        fn = _runs.__wrapped__ if torch.compiler.is_compiling() else _runs
        return fn(self, names)


@functools.lru_cache(maxsize=512)
def _runs(flat: FlatLayout, names: tuple[str, ...]) -> tuple[tuple[int, int, int, tuple[str, ...]], ...]:
    return _runs_in(flat.where, names)


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
    as the bucket plan does (:meth:`~zerofn.layout.ShardLayout.buckets`): when dynamo
    compiles one step function again for another layout (a second model), its automatic
    dynamic shapes turn every int read from the step's inputs into a symbol, and the
    offsets here order a group's rows, which takes concrete ints.
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
    layout = layout_by_fingerprint(fingerprint)
    assert layout is not None, "zerofn: a compiled step's layout is alive while it traces"
    fl = _flat_layout(layout, rank)
    groups = tuple((g.dtype, g.names, g.offsets, g.numels, g.numel) for g in fl.groups)
    where, shapes = tuple(fl.where.items()), tuple(fl.shapes.items())
    return fl.world_size, fl.rank, fl.fingerprint, groups, fl.loose, fl.names, where, shapes, fl.all_runs


@functools.lru_cache(maxsize=256)
def _flat_layout(layout: ShardLayout, rank: int) -> FlatLayout:
    members: dict[torch.dtype, list[str]] = {}
    loose: list[str] = []
    names: list[str] = []
    where: dict[str, tuple[int, int, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    offsets: dict[torch.dtype, list[int]] = {}
    sizes: dict[torch.dtype, int] = {}
    for spec in layout.params:
        if not spec.holds(rank):
            continue
        names.append(spec.name)
        shapes[spec.name] = spec.local_shape(rank)  # type: ignore[assignment]
        if spec.is_whole:
            loose.append(spec.name)
            continue
        members.setdefault(spec.dtype, []).append(spec.name)
        offsets.setdefault(spec.dtype, []).append(sizes.get(spec.dtype, 0))
        sizes[spec.dtype] = sizes.get(spec.dtype, 0) + spec.shard_numel
    groups = []
    for gi, (dtype, group_names) in enumerate(members.items()):
        numels = tuple(layout[n].shard_numel for n in group_names)
        groups.append(FlatGroup(dtype, tuple(group_names), tuple(offsets[dtype]), numels, sizes[dtype]))
        for n, off, k in zip(group_names, offsets[dtype], numels, strict=True):
            where[n] = (gi, off, k)
    for n in loose:
        where[n] = (-1, 0, 0)
    held = tuple(names)
    return FlatLayout(
        layout.world_size,
        rank,
        layout.fingerprint,
        tuple(groups),
        tuple(loose),
        held,
        where,
        shapes,
        _runs_in(where, held),
    )


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
