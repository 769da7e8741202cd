"""Where the one representation is kept: what becomes a :class:`FlatDict`, and how code reads either form.

Every representation test of zerofn is here or in :mod:`zerofn.flat._dict`: a
:class:`~zerofn.state.ZeroState` holds its master shards flat and its optimizer state in
the form its optimizer made it (:func:`held_flat`, at its construction: per-name shards of
a hand-built state or a checkpoint are packed there, once); an optimizer that computes per
name hands its results back in the form its inputs had (:func:`hold_like`); and the few
places that take a user's per-name mapping at the boundary read it through
:func:`metadata`, :func:`named_pieces` and :func:`names_with_values`. No collectives here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from zerofn._offsets import FlatLayout, flat_layout
from zerofn._tree import FrozenDict
from zerofn.flat._dict import FlatDict, pack, packable, run_view

__all__ = [
    "bucket_range",
    "buffer_metadata",
    "buffer_views",
    "grads_on",
    "held_flat",
    "hold_like",
    "metadata",
    "named_pieces",
    "names_with_values",
    "pack_state",
    "reshare_steps",
    "same_flat_layout",
]


def names_with_values(grads: Mapping[str, Any], params: Mapping[str, Any]) -> list[str]:
    """The names of ``params`` (in their order) that ``grads`` holds a value for (not ``None``).

    A FlatDict holds tensors only, so it is not read per name: when it holds every name of
    ``params``' own layout, those are the names (a compiled step traces no loop over them).
    """
    if isinstance(grads, FlatDict):
        if grads.holds_all and isinstance(params, FlatDict) and params.names == grads.names:
            return list(grads.names)
        return [n for n in params if n in grads]
    return [n for n in params if n in grads and grads[n] is not None]


def same_flat_layout(sub: Mapping[str, Any], full: Mapping[str, Any]) -> bool:
    """Whether ``sub`` and ``full`` are FlatDicts on one flat layout and ``full`` holds all its
    names: then every name of ``sub`` is one of ``full``'s, with no lookup per name."""
    return (
        isinstance(sub, FlatDict)
        and isinstance(full, FlatDict)
        and full.holds_all
        and sub.flat_layout == full.flat_layout
    )


def bucket_range(shards: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor | None:
    """The range of a flat buffer that holds ``names``' shards side by side, or ``None``
    (``shards`` not a FlatDict of every name, or ``names`` not one run of one buffer)."""
    if not isinstance(shards, FlatDict) or not shards.holds_all:
        return None
    runs = shards.flat_layout.runs(names)
    if len(runs) != 1 or runs[0][0] < 0:
        return None
    return run_view(shards, runs[0])


def metadata(mapping: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every entry; for a FlatDict from its layout and buffers,
    without making a view per name."""
    if not isinstance(mapping, FlatDict):
        for name, t in mapping.items():
            yield name, tuple(t.shape), t.dtype
        return
    fl, buffers, loose = mapping.flat_layout, mapping.buffers, mapping.loose
    for name in mapping.names:
        g = fl.where[name][0]
        t = loose[name] if g < 0 else buffers[g]
        yield name, tuple(t.shape) if g < 0 else fl.shapes[name], t.dtype  # type: ignore[union-attr]


def buffer_metadata(
    mapping: Mapping[str, torch.Tensor], flat: FlatLayout
) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
    """For a FlatDict on ``flat``: ``(name, shape, dtype)`` of each buffer (as its group's first
    name; a buffer of the wrong size gives its own shape) and each loose tensor, which is all
    that can be wrong in it; ``None`` for any other mapping (check it per name: :func:`metadata`)."""
    if not (isinstance(mapping, FlatDict) and mapping.flat_layout == flat):
        return None
    out = []
    for group, buf in zip(flat.groups, mapping.buffers, strict=True):
        if buf is not None:
            name = group.names[0]
            out.append((name, flat.shapes[name] if buf.numel() == group.numel else tuple(buf.shape), buf.dtype))
    out += [(name, tuple(t.shape), t.dtype) for name, t in mapping.loose.items()]
    return out


def named_pieces(mapping: Mapping[str, torch.Tensor]) -> tuple[tuple[str, ...], list[torch.Tensor], bool]:
    """``(names, tensors, by_runs)``: a FlatDict's names and its runs (:meth:`FlatDict.pieces`,
    ``by_runs`` True), or a plain mapping's names and one tensor per name."""
    if isinstance(mapping, FlatDict):
        return mapping.names, mapping.pieces(), True
    names = tuple(mapping)
    return names, [mapping[n] for n in names], False


def grads_on(flat: FlatLayout, grads: Mapping[str, torch.Tensor | None], who: str) -> FlatDict:
    """Gradients for params held on ``flat`` as a FlatDict there: themselves if they are one on
    ``flat``, else the tensors of a plain mapping packed (``None`` entries left out; loose names
    keep their tensors, nothing copied). Raises ``ValueError`` naming ``who`` and the names
    whose shapes are not the params'."""
    if isinstance(grads, FlatDict) and grads.flat_layout == flat:
        return grads
    entries = {n: g for n, g in grads.items() if g is not None}
    wrong = {n: tuple(g.shape) for n, g in entries.items() if n in flat.shapes and tuple(g.shape) != flat.shapes[n]}
    if wrong:
        expected = {n: flat.shapes[n] for n in wrong}
        raise ValueError(f"{who}: gradients of shapes {wrong} for params of shapes {expected}")
    return pack(flat, entries)


def pack_state(flat: FlatLayout, mapping: Mapping[str, torch.Tensor | None], who: str) -> FlatDict:
    """An optimizer-state mapping over ``flat``'s names as a FlatDict: itself if it is one on
    ``flat``, else its tensors packed (:func:`pack`; ``None`` entries, a buffer not made yet,
    are left out). Raises ``ValueError`` naming ``who`` when they do not fit the layout."""
    if isinstance(mapping, FlatDict) and mapping.flat_layout == flat:
        return mapping
    entries = {n: t for n, t in mapping.items() if t is not None}
    if entries and not packable(flat, entries):
        raise ValueError(
            f"{who}: the optimizer state does not fit the params' flat layout (names, shapes, one dtype and device "
            "per buffer); pass the state init or a checkpoint load made for these params"
        )
    return pack(flat, entries)


def _flatten_like(master: FlatDict, tree: Any) -> Any:
    """``tree`` (an optimizer state) with every name -> tensor mapping over ``master``'s names
    held flat (:func:`pack`), where it can be; everything else as it is.

    Walks NamedTuples, tuples and lists; a mapping whose values are plain tensors of the
    shard shapes (a subset of the names is fine) becomes a :class:`FlatDict`; a mapping
    of 0-d step counts, of ``None`` or of low-bit tensors stays.
    """
    if isinstance(tree, FlatDict):
        return tree
    if isinstance(tree, Mapping):
        if tree and packable(master.flat_layout, tree) and any(master.flat_layout.where[n][0] >= 0 for n in tree):
            return pack(master.flat_layout, tree)
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_flatten_like(master, v) for v in tree))
    if isinstance(tree, tuple):
        return tuple(_flatten_like(master, v) for v in tree)
    if isinstance(tree, list):
        return [_flatten_like(master, v) for v in tree]
    return tree


def held_flat(layout: Any, rank: int, master: Mapping[str, torch.Tensor], opt_state: Any) -> tuple[FlatDict, Any]:
    """``rank``'s master shards under ``layout`` (a :class:`~zerofn.layout.ShardLayout`) as a
    :class:`FlatDict` on its :func:`flat_layout`, and its optimizer state over them.

    What every :class:`~zerofn.state.ZeroState` holds: shards that are a FlatDict on that
    layout already come back as they are (with ``opt_state``, untouched). Per-name shards
    (a state built by hand, or read from a checkpoint) are packed once (:func:`pack`: one
    ``cat`` per buffer), and so is every per-name mapping of ``opt_state`` that fits them
    (:func:`_flatten_like`); equal 0-d step counts become one tensor (a host read per count).

    Raises:
      ValueError: the shards are not plain tensors of the layout's names and shard shapes,
        one dtype and device per buffer.
    """
    if (
        isinstance(master, FlatDict)
        and master.flat_layout.rank == rank
        and master.flat_layout.fingerprint == layout.fingerprint
    ):
        return master, opt_state
    flat = flat_layout(layout, rank)
    if master and not packable(flat, master):
        raise ValueError(
            f"zerofn.ZeroState: the master shards {_describe(master)} do not fit rank {flat.rank}'s flat layout "
            f"(plain tensors of the shard shapes {dict(flat.shapes)}, one dtype and device per buffer); build the "
            "state with zerofn.shard_params or a checkpoint load"
        )
    packed = pack(flat, master)
    return packed, _share_steps(_flatten_like(packed, opt_state))


def _describe(mapping: Mapping[str, Any]) -> str:
    return str(
        {n: (type(t).__name__, tuple(getattr(t, "shape", ())), getattr(t, "dtype", None)) for n, t in mapping.items()}
    )


def reshare_steps(opt_state: Any) -> Any:
    """``opt_state`` with equal step counts one tensor again where a copy made leaf by leaf
    (``tree_map(torch.clone, state)``: a pytree round trip) gave every name its own; as it is
    otherwise. What :class:`~zerofn.state.ZeroState`'s pytree unflatten applies, so that such a
    copy steps once per flat buffer, as the original does, eagerly and compiled."""
    return _share_steps(opt_state, only_unaliased=True)


def _share_steps(tree: Any, *, only_unaliased: bool = False) -> Any:
    """An optimizer state whose per-name 0-d ``step`` counts of equal value are one tensor (as
    ``init`` over a FlatDict makes them), so a flat update runs once per group, not per name
    (and a compiled one updates each buffer whole, not as a concatenation of its params).

    Only states whose class says ``shares_step_counts = True`` (an update that never adds
    to a shared count in place) are changed: the container knows that protocol, not the
    optimizers. Reads every count (host): for states built per name (a checkpoint load), once.
    ``only_unaliased``: only a state whose counts are all separate tensors (a copy made leaf
    by leaf, e.g. ``tree_map(torch.clone, state)``); the states the updates return keep
    their sharing, and are not read. Nothing is read while tracing.
    """
    if only_unaliased and torch.compiler.is_compiling():
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        fields = {f: _share_steps(v, only_unaliased=only_unaliased) for f, v in zip(tree._fields, tree, strict=True)}
        step = fields.get("step")
        counts = isinstance(step, Mapping) and all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in step.values())
        separate = not only_unaliased or (counts and len(step) > 1 and len({id(t) for t in step.values()}) == len(step))
        if getattr(type(tree), "shares_step_counts", False) and step and counts and separate:
            shared: dict[tuple[Any, ...], torch.Tensor] = {}
            fields["step"] = FrozenDict(
                {n: shared.setdefault((t.item(), t.dtype, t.device), t) for n, t in step.items()}
            )
        same = all(fields[f] is v for f, v in zip(tree._fields, tree, strict=True))
        return tree if same else type(tree)(**fields)
    if isinstance(tree, tuple):
        parts = tuple(_share_steps(v, only_unaliased=only_unaliased) for v in tree)
        return tree if all(a is b for a, b in zip(parts, tree, strict=True)) else parts
    return tree


def hold_like(template: Mapping[str, Any], values: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``values`` (name -> tensor, computed per name) held the way ``template`` is held.

    For an optimizer that computes per name (:mod:`zerofn.lowbit`, whose torchao kernels
    take one tensor each) and must return its params and state in the form it was given,
    so that a step's outputs have its inputs' structure, eagerly and in a compiled graph:

    * ``values`` a FlatDict on ``template``'s layout: ``values``;
    * ``template`` a :class:`FlatDict` and ``values`` its own tensors (an update in place,
      under donation): ``template`` itself, nothing copied;
    * ``template`` a FlatDict and ``values`` fit its layout (:func:`packable`: plain tensors
      of the shard shapes, one dtype and device per buffer): a FlatDict on that layout
      (:func:`pack`: one ``cat`` per buffer);
    * otherwise (a per-name template, or a value a buffer cannot hold, such as a torchao
      state tensor): a :class:`~zerofn._tree.FrozenDict` of ``values``.
    """
    if isinstance(template, FlatDict):
        fl = template.flat_layout
        if isinstance(values, FlatDict) and values.flat_layout == fl:
            return values
        names = template.names
        if len(values) == len(names) and all(values.get(n) is template[n] for n in names):
            return template
        if values and packable(fl, values):
            return pack(fl, values)
    return FrozenDict(values)


def buffer_views(mapping: Mapping[str, torch.Tensor]) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]] | None:
    """A FlatDict's buffers by group index and its held names' views into them (loose names
    left out); ``None`` for a plain mapping, which has no buffers."""
    if not isinstance(mapping, FlatDict):
        return None
    bufs = {g: b for g, b in enumerate(mapping.buffers) if b is not None}
    return bufs, {n: mapping[n] for n in mapping.names if n not in mapping.loose}
