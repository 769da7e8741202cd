"""``FlatDict``: a rank's shards of one flat layout as named views of few buffers, and packing into it.

The vocabulary is :mod:`zerofn.flat`'s. No collectives here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from zerofn._offsets import FlatLayout
from zerofn._tree import FrozenDict

__all__ = ["FlatDict", "as_flat", "owned", "pack", "packable", "pieces", "run_view", "split", "zeros_like"]


class FlatDict(FrozenDict[torch.Tensor]):
    """A read-only ``name -> Tensor`` mapping backed by one flat buffer per group.

    ``d[name]`` is a view (``buffers[g][off:off + shard_numel]``) for a split or
    ``blocked(B)`` param, the tensor itself for a loose (whole) one; eagerly the same view
    object on every read (made at the first). Iteration follows the
    layout order of the names held. A pytree node: the leaves are the buffers (``None``
    for a group without a held name) followed by the loose tensors; the context is the
    :class:`FlatLayout` and the names held.

    Build one with :func:`pack` (from a mapping) or :meth:`from_buffers`. The buffers are
    1-D and contiguous; padding elements are zero, and so are the ranges of layout names
    the dict does not hold when it carries gradients.
    """

    __slots__ = ("_buffers", "_flat", "_held", "_loose", "_names", "_views")
    _flat: FlatLayout
    _buffers: tuple[torch.Tensor | None, ...]
    _loose: dict[str, torch.Tensor]
    _names: tuple[str, ...]
    _held: frozenset[str] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("build a FlatDict with zerofn.flat.pack(...) or FlatDict.from_buffers(...)")

    @classmethod
    def from_buffers(
        cls,
        flat: FlatLayout,
        buffers: Iterable[torch.Tensor | None],
        loose: Mapping[str, torch.Tensor] | None = None,
        names: tuple[str, ...] | None = None,
    ) -> FlatDict:
        """A FlatDict over ``flat`` holding ``names`` (default: all of the layout's), from its buffers.

        ``buffers``: one 1-D tensor of ``group.numel`` elements per group (``None`` where
        no held name lives); ``loose``: name -> full-shape tensor for the held loose names.
        Nothing is copied.
        """
        self = object.__new__(cls)
        setter = object.__setattr__
        setter(self, "_flat", flat)
        setter(self, "_buffers", tuple(buffers))
        setter(self, "_loose", dict(loose or {}))
        names = flat.names if names is None else tuple(names)
        setter(self, "_names", names)
        setter(self, "_held", None if names is flat.names or names == flat.names else _held(names))
        setter(self, "_views", {})
        return self

    @property
    def flat_layout(self) -> FlatLayout:
        return self._flat

    @property
    def buffers(self) -> tuple[torch.Tensor | None, ...]:
        """One 1-D buffer per group of :attr:`flat_layout` (``None`` where no held name lives)."""
        return self._buffers

    @property
    def loose(self) -> Mapping[str, torch.Tensor]:
        return self._loose

    @property
    def names(self) -> tuple[str, ...]:
        """The names held, in layout order."""
        return self._names

    @property
    def holds_all(self) -> bool:
        """True if every name of the layout is held."""
        return self._held is None

    def __getitem__(self, key: str) -> torch.Tensor:
        if not self.__contains__(key):
            raise KeyError(key)
        g, off, n = self._flat.where[key]
        if g < 0:
            return self._loose[key]
        if torch.compiler.is_compiling():
            return self._buffers[g][off : off + n]  # type: ignore[index]
        view = self._views.get(key)
        if view is None:  # one view object per name: d[name] is d[name], as in a dict
            view = self._views[key] = self._buffers[g][off : off + n]  # type: ignore[index]
        return view

    def group_views(self, g: int) -> dict[str, torch.Tensor]:
        """Group ``g``'s held names -> their tensors (``d[name]``'s objects), in layout order.

        Eagerly the buffer is cut by one ``split`` (one call, not a slice per name: the
        facade takes every shard of a reduction at once).
        """
        group, buf = self._flat.groups[g], self._buffers[g]
        if buf is None:
            return {}
        if torch.compiler.is_compiling():
            return {n: self[n] for n in group.names if n in self}
        views = self._views
        for name, view in zip(group.names, buf.split(group.numels), strict=True):
            views.setdefault(name, view)
        return {n: views[n] for n in group.names if n in self}

    # Its values are views made on demand (no dict of them): Mapping's generic lookups and
    # views over __getitem__, not FrozenDict's views of its dict.
    get = Mapping.get
    keys = Mapping.keys
    values = Mapping.values
    items = Mapping.items

    def __contains__(self, key: object) -> bool:
        if self._held is None:
            return key in self._flat.where
        return key in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"FlatDict({dict(self.items())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._flat, self._buffers, self._loose, self._names))

    def replace(self, changes: Mapping[str, torch.Tensor]) -> FlatDict:  # type: ignore[override]
        """A new FlatDict on the same layout with ``changes`` applied (new buffers: one ``cat`` each).

        Raises:
          ValueError: a change the layout cannot hold (a name it does not have, another
            shape, or a dtype or device other than its buffer's); the message names them.
            For a mapping of other tensors, build a plain dict: ``{**d, name: tensor}``.
        """
        merged = {**dict(self.items()), **changes}
        if not packable(self._flat, merged):
            wrong = {
                n: (tuple(getattr(t, "shape", ())), getattr(t, "dtype", None))
                for n, t in changes.items()
                if not packable(self._flat, {**dict(self.items()), n: t})
            }
            raise ValueError(
                f"FlatDict.replace: {wrong} do not fit the layout (its names, shard shapes, one dtype and device per "
                "buffer); for other tensors build a plain dict: {**d, name: tensor}"
            )
        return pack(self._flat, merged)

    def pieces(self) -> list[torch.Tensor]:
        """The held entries as few tensors as possible, in layout order: one view per contiguous run."""
        out = []
        for g, start, stop, members in self._flat.runs(self._names):
            out.append(self._loose[members[0]] if g < 0 else self._buffers[g][start:stop])  # type: ignore[index]
        return out

    def with_buffers(
        self, buffers: Iterable[torch.Tensor | None], loose: Mapping[str, torch.Tensor] | None = None
    ) -> FlatDict:
        """The same names over new buffers (and loose tensors; default: these)."""
        return FlatDict.from_buffers(self._flat, buffers, self._loose if loose is None else loose, self._names)


@functools.lru_cache(maxsize=256)
def _held(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(names)


def _rebuild(
    flat: FlatLayout, buffers: tuple[Any, ...], loose: dict[str, torch.Tensor], names: tuple[str, ...]
) -> FlatDict:
    return FlatDict.from_buffers(flat, buffers, loose, names)


def _flatten(d: FlatDict) -> tuple[list[Any], Any]:
    loose_names = tuple(d._loose)
    return [*d._buffers, *(d._loose[n] for n in loose_names)], (d._flat, d._names, len(d._buffers), loose_names)


def _unflatten(leaves: Iterable[Any], ctx: Any) -> FlatDict:
    flat, names, n_buffers, loose_names = ctx
    leaves = list(leaves)
    return FlatDict.from_buffers(
        flat, leaves[:n_buffers], dict(zip(loose_names, leaves[n_buffers:], strict=True)), names
    )


pytree.register_pytree_node(FlatDict, _flatten, _unflatten, serialized_type_name="zerofn.FlatDict")


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)


def packable(flat: FlatLayout, mapping: Mapping[str, Any]) -> bool:
    """True if :func:`pack` can hold ``mapping``: plain tensors of the layout's names and shapes,
    one dtype and device per group."""
    if isinstance(mapping, FlatDict):
        return mapping._flat == flat
    if not mapping:
        return False
    seen: dict[int, tuple[torch.dtype, torch.device]] = {}
    shapes = flat.shapes
    for name, t in mapping.items():
        if name not in flat.where or not _plain(t) or tuple(t.shape) != shapes[name]:
            return False
        g = flat.where[name][0]
        if g < 0:
            continue
        kind = (t.dtype, t.device)
        if seen.setdefault(g, kind) != kind:
            return False
    return True


def pack(flat: FlatLayout, mapping: Mapping[str, torch.Tensor]) -> FlatDict:
    """``mapping`` (:func:`packable`) copied into new flat buffers, one ``torch.cat`` per group.

    The result holds ``mapping``'s names; the ranges of the others are zero. Loose
    tensors are kept as they are (not copied). A FlatDict over ``flat`` is returned as is.
    """
    if isinstance(mapping, FlatDict) and mapping._flat == flat:
        return mapping
    buffers: list[torch.Tensor | None] = []
    for group in flat.groups:
        present = [n for n in group.names if n in mapping]
        if not present:
            buffers.append(None)
            continue
        first = mapping[present[0]]
        parts = []
        for n, k in zip(group.names, group.numels, strict=True):
            t = mapping.get(n)
            parts.append(t.detach().reshape(-1) if t is not None else first.new_zeros(k))
        buffers.append(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
    loose = {n: mapping[n] for n in flat.loose if n in mapping}
    names = tuple(n for n in flat.names if n in mapping)
    return FlatDict.from_buffers(flat, buffers, loose, names)


def as_flat(mapping: Mapping[str, torch.Tensor]) -> FlatDict:
    """``mapping`` as a :class:`FlatDict`: itself if it is one, else its tensors held loose.

    A plain ``name -> tensor`` mapping (a user's own call of an optimizer, a part of a
    :func:`~zerofn.optim.partition`) becomes a FlatDict whose every name is loose: each keeps
    its own tensor and shape, nothing is copied, and an update runs once per tensor, as
    over per-name shards.
    """
    if isinstance(mapping, FlatDict):
        return mapping
    tensors = dict(mapping)
    return FlatDict.from_buffers(loose_layout(tuple((n, tuple(t.shape)) for n, t in tensors.items())), (), tensors)


@functools.lru_cache(maxsize=256)
def loose_layout(shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> FlatLayout:
    """The :class:`FlatLayout` of tensors that are all loose: ``(name, shape)`` pairs, in order."""
    names = tuple(n for n, _ in shapes)
    where = {n: (-1, 0, math.prod(shape)) for n, shape in shapes}
    runs = tuple((-1, 0, where[n][2], (n,)) for n in names)
    return FlatLayout(1, 0, f"loose:{shapes!r}", (), names, names, where, dict(shapes), runs)


def split(mapping: Mapping[str, Any], parts: Iterable[Iterable[str]]) -> list[Mapping[str, Any]]:
    """``mapping`` cut into one mapping per part's names (each a subset of its names, in order).

    A FlatDict's parts are FlatDicts on its layout over the same buffers (nothing copied; a
    group none of whose names a part holds has no buffer there); a plain mapping's are
    plain dicts.
    """
    out = []
    for names in parts:
        wanted = set(names)
        if not isinstance(mapping, FlatDict):
            out.append({n: v for n, v in mapping.items() if n in wanted})
            continue
        held = tuple(n for n in mapping._names if n in wanted)
        fl = mapping._flat
        used = {fl.where[n][0] for n in held}
        buffers = [b if g in used else None for g, b in enumerate(mapping._buffers)]
        loose = {n: t for n, t in mapping._loose.items() if n in wanted}
        out.append(FlatDict.from_buffers(fl, buffers, loose, held))
    return out


def pieces(mapping: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``mapping``: a FlatDict's runs (:meth:`FlatDict.pieces`), a plain mapping's values."""
    return mapping.pieces() if isinstance(mapping, FlatDict) else list(mapping.values())


def zeros_like(d: FlatDict, dtype: torch.dtype | None = None) -> FlatDict:
    """Zeros with ``d``'s names, layout and devices (one allocation per buffer and loose tensor)."""
    return FlatDict.from_buffers(
        d._flat,
        [None if b is None else torch.zeros_like(b, dtype=dtype) for b in d._buffers],
        {n: torch.zeros_like(t, dtype=dtype) for n, t in d._loose.items()},
        d._names,
    )


def owned(d: FlatDict, donate: bool, names: Iterable[str] | None = None) -> FlatDict:
    """``d`` itself when donated, else a FlatDict over fresh copies of its buffers and of its
    loose tensors (those of ``names`` only, when given: the others stay the same objects)."""
    if donate:
        return d
    copied = None if names is None else set(names)
    loose = {n: t.clone() if copied is None or n in copied else t for n, t in d._loose.items()}
    return d.with_buffers([None if b is None else b.clone() for b in d._buffers], loose)


def run_view(d: FlatDict, run: tuple[int, int, int, tuple[str, ...]]) -> torch.Tensor:
    """The tensor of one run of :meth:`FlatLayout.runs` in ``d``: a buffer range, or a loose tensor."""
    g, start, stop, members = run
    return d._loose[members[0]] if g < 0 else d._buffers[g][start:stop]  # type: ignore[index]
