"""Read-only mappings that torch's pytree utilities can walk.

zerofn hands out ``FrozenDict`` wherever state holds a name -> tensor mapping: it cannot
be changed in place, so a ``ZeroState`` really is a value, and it is a registered pytree
node, so ``torch.utils._pytree.tree_map`` (and anything built on it) sees the tensors.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import Any, TypeVar

import torch.utils._pytree as pytree

V = TypeVar("V")

__all__ = ["FrozenDict"]


class FrozenDict(Mapping[str, V]):
    """An immutable ``str -> value`` mapping that keeps insertion order.

    ``replace(**changes)`` and ``FrozenDict({**d, name: v})`` build new mappings; the
    values themselves are shared, never copied.
    """

    __slots__ = ("_data",)
    _data: dict[str, V]

    def __init__(self, data: Mapping[str, V] | Iterable[tuple[str, V]] = ()) -> None:
        object.__setattr__(self, "_data", dict(data))

    def __getitem__(self, key: str) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    # The dict's own (read-only) views and lookups: Mapping's mixins would call __getitem__
    # per key in Python, and a state holds a step count per param.
    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def keys(self) -> KeysView[str]:
        return self._data.keys()

    def values(self) -> ValuesView[V]:
        return self._data.values()

    def items(self) -> ItemsView[str, V]:
        return self._data.items()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is immutable; build a new one instead")

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (self._data,))

    def replace(self, changes: Mapping[str, V]) -> FrozenDict[V]:
        """A new mapping with ``changes`` applied on top of this one."""
        return FrozenDict({**self._data, **changes})


pytree.register_pytree_node(
    FrozenDict,
    lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: FrozenDict(zip(keys, values, strict=True)),
    serialized_type_name="zerofn.FrozenDict",
)
