"""Where every element of every parameter lives: the shard layout (padding, placement, per-rank slices).

Note: the vocabulary, used the same way everywhere in zerofn
------------------------------------------------------------
full
    A parameter (or gradient) as the model sees it: ``shape``, ``numel`` elements.
padded
    The full tensor flattened to 1-D and zero-padded at the end to
    ``padded_numel = world_size * shard_numel`` elements, the smallest multiple of the
    world size that holds ``numel``.
shard
    Chunk ``r`` of the padded tensor, ``padded[r * shard_numel:(r + 1) * shard_numel]``:
    the part rank ``r`` owns, 1-D, ``shard_numel = ceil(numel / world_size)`` elements.
    Every rank owns exactly one equal chunk of *every* parameter ("shard evenly"), so no
    rank is ever left without work. The last ranks' shards may be partly or wholly
    padding; padding is always zero in parameters and gradients alike.
bucket
    A group of parameters that travel in one collective. Its flat buffer is *rank-major*:
    viewed as ``(world_size, bucket.shard_numel)``, row ``r`` holds rank ``r``'s shards of
    all the bucket's parameters side by side. One reduce-scatter of that buffer leaves
    each rank exactly its own shards, and one all-gather rebuilds every full parameter.
gathered
    The ``(world_size, bucket.shard_numel)`` buffer after an all-gather, from which the
    full parameters are cut out again (padding dropped).
placement
    How a parameter is cut. ``"split"`` (the default, everything above): one equal chunk
    per rank. ``"whole"``: the parameter lives entirely on one *owner* rank, in its full
    shape (for optimizers whose update reads whole tensors: Muon orthogonalises each
    matrix, Adafactor reads row, column and tensor statistics); other ranks hold nothing
    of it. In a bucket, a whole parameter fills ``numel`` columns of its owner's row only;
    the other rows carry their own ranks' whole parameters in those columns, or padding.
    ``"blocked(B)"``: split, with every rank's chunk a multiple of ``B`` elements,
    ``shard_numel = B * ceil(numel / (world_size * B))``, for optimizers whose state is
    quantized in blocks of ``B`` (zerofn.lowbit). ``numel`` must be a multiple of ``B``, so
    the flat param is ``numel / B`` whole blocks and every rank owns whole blocks
    ``[r * shard_numel / B, (r + 1) * shard_numel / B)``: block ``k`` holds elements
    ``[k * B, (k + 1) * B)`` at every world size, so a blockwise quantization sees the same
    blocks, and the same numbers, whatever N is. The padding (``world_size * shard_numel
    - numel``) is whole blocks of zeros at the end, fewer than ``world_size`` of them:
    under ``B`` elements per rank on average. It is also DTensor's ``Shard(0)`` chunking of
    the ``(numel / B, B)`` view, which is how checkpoints describe it.

Owner plan: whole parameters are taken largest first (ties in layout order) and each goes
to the rank that stores the fewest elements so far (ties to the lowest rank); split
shards weigh the same on every rank, so they do not change the choice. This is Graham's
longest-processing-time rule; its bound, checked by the tests: no rank stores more than
``padded_numel / world_size + largest whole numel`` elements, where ``padded_numel`` is
Ψ plus the split parameters' padding.

Everything here is a pure function of (names, shapes, dtypes, world size): no tensors, no
communication. Two ranks with equal layouts have equal ``fingerprint`` strings.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = ["PLACEMENTS", "ParamSpec", "ShardLayout", "block_of", "blocked", "make_layout", "plan_owners"]


@dataclass(frozen=True)
class ParamSpec:
    """Static description of one parameter and how it is cut into shards.

    Attributes:
      name: the parameter's name, as in ``model.named_parameters()``.
      shape: the full shape.
      dtype: the full parameter's (working) dtype.
      numel: elements of the full tensor.
      shard_numel: split: elements of every rank's shard, ``ceil(numel / world_size)``;
        blocked(B): ``B * ceil(numel / (world_size * B))``; whole: ``numel``, what the
        owner stores (the other ranks store nothing).
      padding: split: zero elements appended to the flat tensor,
        ``world_size * shard_numel - numel`` (between 0 and ``world_size - 1``; blocked(B):
        a multiple of ``B`` below ``world_size * B``); whole: 0.
      placement: ``"split"``, ``"whole"`` or ``"blocked(B)"`` (see the module note).
      owner: the rank that stores a whole param; -1 for a split one.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    shard_numel: int
    padding: int
    placement: str = "split"
    owner: int = -1

    @property
    def padded_numel(self) -> int:
        return self.numel + self.padding

    @property
    def block(self) -> int:
        """``B`` of a ``"blocked(B)"`` param (its chunks are whole blocks of ``B``); 0 otherwise."""
        return block_of(self.placement)

    @property
    def is_whole(self) -> bool:
        """True for a ``"whole"`` param (all of it on rank ``owner``)."""
        return self.placement == "whole"

    def holds(self, rank: int) -> bool:
        """Whether rank ``rank`` stores anything of this param (split: every rank; whole: the owner)."""
        return not self.is_whole or rank == self.owner

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        """The shape of what rank ``rank`` stores: ``(shard_numel,)`` for a split param, the
        full ``shape`` on a whole param's owner, ``None`` on the other ranks."""
        if not self.is_whole:
            return (self.shard_numel,)
        return self.shape if rank == self.owner else None

    def stored_numel(self, rank: int) -> int:
        """Elements rank ``rank`` stores for this param, padding included."""
        if not self.is_whole:
            return self.shard_numel
        return self.numel if rank == self.owner else 0

    def owned_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, stop)`` range of *real* (unpadded) flat elements rank ``rank`` owns."""
        if self.is_whole:
            return (0, self.numel) if rank == self.owner else (self.numel, self.numel)
        start = min(rank * self.shard_numel, self.numel)
        stop = min((rank + 1) * self.shard_numel, self.numel)
        return start, stop


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """For each named parameter its shape, dtype and per-rank slice; a pure value.

    Build it with :func:`make_layout`. Parameter order is the order the caller gave
    (``model.named_parameters()`` order); it is part of the fingerprint, so ranks that
    list the same parameters in different orders are told so instead of exchanging
    mismatched shards.

    Equality and hashing go through ``fingerprint`` (a hex digest of world size, names,
    shapes and dtypes), so a layout can key caches cheaply.
    """

    world_size: int
    params: tuple[ParamSpec, ...]
    fingerprint: str = field(repr=False)
    _index: Mapping[str, int] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        _register(self)

    def __reduce__(self) -> tuple[object, ...]:  # through __init__, so an unpickled layout is registered too
        return (ShardLayout, (self.world_size, self.params, self.fingerprint, dict(self._index)))

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardLayout) and other.fingerprint == self.fingerprint

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def __getitem__(self, name: str) -> ParamSpec:
        return self.params[self._index[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.params)

    @property
    def numel(self) -> int:
        """Ψ: real elements over all parameters."""
        return sum(p.numel for p in self.params)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shards over all split parameters, padding included."""
        return sum(p.shard_numel for p in self.params if not p.is_whole)

    def stored_numel(self, rank: int) -> int:
        """Elements rank ``rank`` stores over all parameters (split shards with their
        padding, plus the whole params it owns): its share of master and optimizer state."""
        return sum(p.stored_numel(rank) for p in self.params)

    @property
    def owners(self) -> Mapping[str, int]:
        """name -> owner rank, for the whole params (layout order)."""
        return MappingProxyType({p.name: p.owner for p in self.params if p.is_whole})

    @property
    def has_whole(self) -> bool:
        """True if some param is placed whole."""
        return any(p.is_whole for p in self.params)

    @property
    def fingerprint_int(self) -> int:
        """The fingerprint as a non-negative int64, for comparing over a collective."""
        return int(self.fingerprint[:15], 16)


#: Every live layout of this process by fingerprint (see :func:`layout_by_fingerprint`): a
#: weak reference to each, since equal layouts are separate objects that die separately.
_BY_FINGERPRINT: dict[str, list[weakref.ref[ShardLayout]]] = {}


def _register(layout: ShardLayout) -> None:
    fingerprint = layout.fingerprint

    def forget(ref: weakref.ref[ShardLayout]) -> None:
        refs = _BY_FINGERPRINT.get(fingerprint, [])
        if ref in refs:
            refs.remove(ref)
        if not refs:
            _BY_FINGERPRINT.pop(fingerprint, None)

    _BY_FINGERPRINT.setdefault(fingerprint, []).append(weakref.ref(layout, forget))


def layout_by_fingerprint(fingerprint: str) -> ShardLayout | None:
    """A layout of this process with ``fingerprint`` (any: equal fingerprints, equal layouts), or ``None``.

    A compiled step's constants carry the fingerprint, one string, instead of a description
    of every param (tracing such a tuple costs per param): the tables computed at trace
    time (:mod:`zerofn._offsets`), the opaque bucket nodes and the checks' error messages
    look the layout up here. Any live layout with it serves, whichever was made first.
    """
    for ref in _BY_FINGERPRINT.get(fingerprint, ()):
        layout = ref()
        if layout is not None:
            return layout
    return None


def live_layout(fingerprint: str) -> ShardLayout:
    """:func:`layout_by_fingerprint` where the layout must exist: in what a compiled step runs
    at trace time (its constants) and in its opaque nodes, whose step holds the layout."""
    layout = layout_by_fingerprint(fingerprint)
    assert layout is not None, "zerofn: a compiled step's layout is alive while it traces and runs"
    return layout


#: Padded elements per bucket (16 MiB in float32; DDP's buckets are 25 MiB). Every collective
#: costs a fixed overhead beside its bytes (on gloo a large one), so fewer, larger buckets move
#: the same bytes in less time; the figures are in docs/functional-loop.md.
DEFAULT_BUCKET_NUMEL = 2**22

PLACEMENTS = ("split", "whole", "blocked(B)")


def blocked(block: int) -> str:
    """The placement string of a param split in whole blocks of ``block`` elements.

    Examples:
      >>> blocked(256)
      'blocked(256)'
    """
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"blocked(B): B must be a positive int, got {block!r}")
    return f"blocked({block})"


def block_of(placement: str) -> int:
    """``B`` of ``"blocked(B)"``; 0 for ``"split"`` and ``"whole"``; ``ValueError`` for anything else.

    Examples:
      >>> block_of("blocked(128)"), block_of("split")
      (128, 0)
    """
    if placement in ("split", "whole"):
        return 0
    if isinstance(placement, str) and placement.startswith("blocked(") and placement.endswith(")"):
        digits = placement[len("blocked(") : -1]
        if digits.isdigit() and int(digits) > 0 and blocked(int(digits)) == placement:
            return int(digits)
    raise ValueError(f"placement must be 'split', 'whole' or 'blocked(B)' with B a positive int, got {placement!r}")


def plan_owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """The owner of each whole param: largest first to the rank storing the fewest elements.

    Args:
      sizes: name -> numel of the whole params, in layout order (ties keep this order).
      world_size: number of ranks.

    Returns:
      name -> owner rank in ``range(world_size)``, in ``sizes``' order. Deterministic: a
      pure function of the sizes, their order and the world size, so every rank computes
      the same plan without communicating. No rank ends with more than
      ``sum(sizes) / world_size + max(sizes)`` elements (Graham's bound).

    Examples:
      >>> plan_owners({"a": 6, "b": 4, "c": 3, "d": 3}, 2)
      {'a': 0, 'b': 1, 'c': 1, 'd': 0}
    """
    names = list(sizes)
    order = sorted(range(len(names)), key=lambda i: (-sizes[names[i]], i))
    load = [0] * world_size
    owner: dict[str, int] = {}
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[names[i]] = r
        load[r] += sizes[names[i]]
    return {n: owner[n] for n in names}


def make_layout(
    params: Mapping[str, torch.Tensor | ParamSpec],
    world_size: int,
    *,
    placement: Mapping[str, str] | None = None,
) -> ShardLayout:
    """The shard layout of ``params`` over ``world_size`` ranks.

    Args:
      params: name -> tensor (only shape and dtype are read; any device, even ``meta``).
      world_size: number of ranks that share the shards, >= 1.
      placement: name -> ``"split"``, ``"whole"`` or ``"blocked(B)"`` (:func:`blocked`);
        names not listed are split. Whole params get owners from :func:`plan_owners`.

    Returns:
      A ``ShardLayout``; a pure function of names, shapes, dtypes, placements and
      ``world_size``. The fingerprint covers the placements, block sizes and owners.

    Raises:
      ValueError: an unknown placement, or a ``"blocked(B)"`` param whose ``numel`` is not a
        multiple of ``B`` (its blocks would not be whole), naming the param and its shape.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    placement = dict(placement or {})
    unknown = [n for n in placement if n not in params]
    if unknown:
        raise KeyError(f"make_layout: placement names params that are not there: {unknown}")
    bad = {}
    for n, p in placement.items():
        try:
            block_of(p)
        except ValueError:
            bad[n] = p
    if bad:
        raise ValueError(f"make_layout: placement must be 'split', 'whole' or 'blocked(B)', got {bad}")
    sizes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in params.items():
        shapes[name] = tuple(int(d) for d in t.shape)
        numel = 1
        for d in shapes[name]:
            numel *= d
        sizes[name] = numel
    owners = plan_owners({n: sizes[n] for n in params if placement.get(n) == "whole"}, world_size)
    specs = []
    for name, t in params.items():
        numel = sizes[name]
        block = block_of(placement.get(name, "split"))
        if name in owners:
            specs.append(ParamSpec(name, shapes[name], t.dtype, numel, numel, 0, "whole", owners[name]))
        elif block:
            if numel % block:
                raise ValueError(
                    f"make_layout: param {name!r} (shape {shapes[name]}, {numel} elements) cannot be placed "
                    f"blocked({block}): its numel is not a multiple of {block}; place it 'split'"
                )
            shard = block * -(-numel // (world_size * block))
            specs.append(
                ParamSpec(name, shapes[name], t.dtype, numel, shard, shard * world_size - numel, blocked(block))
            )
        else:
            shard = -(-numel // world_size)
            specs.append(ParamSpec(name, shapes[name], t.dtype, numel, shard, shard * world_size - numel))
    key: tuple = (world_size, [(s.name, s.shape, str(s.dtype)) for s in specs])
    if owners:  # an all-split layout keeps the fingerprint it always had
        key = (*key, [(s.name, s.placement, s.owner) for s in specs if s.is_whole])
    if any(s.block for s in specs):  # and so does a layout without blocked params
        key = (*key, [(s.name, s.placement) for s in specs if s.block])
    digest = hashlib.sha256(repr(key).encode()).hexdigest()
    index = {s.name: i for i, s in enumerate(specs)}  # a plain dict: torch.compile traces lookups in it
    return ShardLayout(world_size, tuple(specs), digest[:32], index)
