"""Where every element of every parameter lives: the shard layout and the bucket plan.

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

Everything here is a pure function of (names, shapes, dtypes, world size): no tensors, no
communication. Two ranks with equal layouts have equal ``fingerprint`` strings.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = ["Bucket", "ParamSpec", "ShardLayout", "make_layout"]


@dataclass(frozen=True)
class ParamSpec:
    """Static description of one parameter and how it is cut into shards.

    Attributes:
      name: the parameter's name, as in ``model.named_parameters()``.
      shape: the full shape.
      dtype: the full parameter's (working) dtype.
      numel: elements of the full tensor.
      shard_numel: elements of every rank's shard, ``ceil(numel / world_size)``.
      padding: zero elements appended to the flat tensor,
        ``world_size * shard_numel - numel`` (between 0 and ``world_size - 1``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    shard_numel: int
    padding: int

    @property
    def padded_numel(self) -> int:
        return self.numel + self.padding

    def owned_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, stop)`` range of *real* (unpadded) flat elements rank ``rank`` owns."""
        start = min(rank * self.shard_numel, self.numel)
        stop = min((rank + 1) * self.shard_numel, self.numel)
        return start, stop


@dataclass(frozen=True)
class Bucket:
    """Parameters that travel together in one collective.

    Attributes:
      names: parameter names, in layout order.
      offsets: where each parameter's shard starts inside a rank's row of the bucket.
      shard_numel: elements of one rank's row (sum of the members' ``shard_numel``).
    """

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    shard_numel: int


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
        """Elements of one rank's shards over all parameters, padding included."""
        return sum(p.shard_numel for p in self.params)

    @property
    def fingerprint_int(self) -> int:
        """The fingerprint as a non-negative int64, for comparing over a collective."""
        return int(self.fingerprint[:15], 16)

    def buckets(self, bucket_numel: int, names: Iterable[str] | None = None) -> tuple[Bucket, ...]:
        """The rank-major bucket plan for ``names`` (default: all params), in layout order.

        Parameters join a bucket in layout order until the next one would take the
        bucket's padded size (``world_size * shard_numel``) past ``bucket_numel`` or has
        another dtype (a bucket is one flat buffer); a parameter larger than
        ``bucket_numel`` travels alone. Empty parameters
        (``numel == 0``) have nothing to send and are left out of every bucket.
        Cached per (layout, names, bucket_numel).
        """
        if bucket_numel <= 0:
            raise ValueError(f"bucket_numel must be a positive number of elements, got {bucket_numel}")
        if names is None:
            wanted = self.names
        else:
            chosen = set(names)  # once: `names` may be a one-shot iterator
            wanted = tuple(n for n in self.names if n in chosen)
        return _plan_buckets(self, wanted, bucket_numel)


@functools.lru_cache(maxsize=256)
def _plan_buckets(layout: ShardLayout, names: tuple[str, ...], bucket_numel: int) -> tuple[Bucket, ...]:
    buckets: list[Bucket] = []
    members: list[str] = []
    offsets: list[int] = []
    row = 0
    for name in names:
        spec = layout[name]
        if spec.numel == 0:
            continue
        too_big = (row + spec.shard_numel) * layout.world_size > bucket_numel
        if members and (too_big or spec.dtype != layout[members[0]].dtype):
            buckets.append(Bucket(tuple(members), tuple(offsets), row))
            members, offsets, row = [], [], 0
        members.append(name)
        offsets.append(row)
        row += spec.shard_numel
    if members:
        buckets.append(Bucket(tuple(members), tuple(offsets), row))
    return tuple(buckets)


def make_layout(params: Mapping[str, torch.Tensor | ParamSpec], world_size: int) -> ShardLayout:
    """The shard layout of ``params`` over ``world_size`` ranks.

    Args:
      params: name -> tensor (only shape and dtype are read; any device, even ``meta``).
      world_size: number of ranks that share the shards, >= 1.

    Returns:
      A ``ShardLayout``; a pure function of names, shapes, dtypes and ``world_size``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    specs = []
    for name, t in params.items():
        shape = tuple(int(d) for d in t.shape)
        numel = 1
        for d in shape:
            numel *= d
        shard = -(-numel // world_size)
        specs.append(ParamSpec(name, shape, t.dtype, numel, shard, shard * world_size - numel))
    digest = hashlib.sha256(repr((world_size, [(s.name, s.shape, str(s.dtype)) for s in specs])).encode()).hexdigest()
    index = MappingProxyType({s.name: i for i, s in enumerate(specs)})
    return ShardLayout(world_size, tuple(specs), digest[:32], index)
