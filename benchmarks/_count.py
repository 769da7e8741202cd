"""Count the bytes each rank sends through ``torch.distributed``'s Python collectives.

:func:`install` replaces the collective functions of ``torch.distributed`` (and of
``torch.distributed.distributed_c10d``) with thin wrappers, once per process and before
any library binds them. While a :func:`counting` block is active, every outermost call
adds the bytes this rank sends under the textbook algorithm of that collective (the same
convention as :func:`zerofn.count_bytes`'s own counter):

==========================================  ============================================
collective                                   bytes this rank sends
==========================================  ============================================
``all_reduce`` (and ``_coalesced``)         2(N-1)/N · numel · b            (ring)
``all_gather`` / ``all_gather_single``      (N-1) · numel(input) · b        (ring)
``reduce_scatter`` / ``_single``            (N-1) · numel(output) · b       (ring)
``broadcast``                               (N-1) · numel · b on the root, 0 elsewhere
``reduce``                                  numel · b off the root, 0 on it
``all_to_all_single``                       (N-1)/N · numel(input) · b
==========================================  ============================================

What it cannot see: collectives issued from C++, above all DDP's gradient all-reduce (the
``Reducer`` calls the process group directly). For those the report states the
theoretical volume of the algorithm instead, and says so.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Counter", "counting", "install"]

_local = threading.local()
_installed = False


class Counter:
    """Bytes sent and calls, total and per collective name."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.calls = 0
        self.by_collective: dict[str, int] = {}

    def add(self, name: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.calls += 1
        self.by_collective[name] = self.by_collective.get(name, 0) + nbytes


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count the bytes of every Python-level collective this thread issues inside the block."""
    counter = Counter()
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(counter)
    try:
        yield counter
    finally:
        stack.remove(counter)


def _nbytes(t: Any) -> int:
    local = getattr(t, "_local_tensor", t)  # DTensor: what this rank holds
    return local.numel() * local.element_size()


def _sizes(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _is_root(a: dict[str, Any], src_key: str, group_key: str) -> bool:
    import torch.distributed as dist

    group = a.get("group")
    if a.get(group_key) is not None:
        return dist.get_rank(group) == a[group_key]
    return dist.get_rank() == a.get(src_key)


def _cost(name: str, a: dict[str, Any]) -> int:
    n, _ = _sizes(a.get("group"))
    if n <= 1:
        return 0
    if name == "all_reduce":
        return 2 * (n - 1) * _nbytes(a["tensor"]) // n
    if name == "all_reduce_coalesced":
        return sum(2 * (n - 1) * _nbytes(t) // n for t in a["tensors"])
    if name == "all_gather":
        return (n - 1) * _nbytes(a["tensor"])
    if name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        return (n - 1) * _nbytes(a["input_tensor"])
    if name == "reduce_scatter":
        return (n - 1) * _nbytes(a["output"])
    if name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        return (n - 1) * _nbytes(a["output"])
    if name == "broadcast":
        return (n - 1) * _nbytes(a["tensor"]) if _is_root(a, "src", "group_src") else 0
    if name == "reduce":
        return 0 if _is_root(a, "dst", "group_dst") else _nbytes(a["tensor"])
    if name == "all_to_all_single":
        return (n - 1) * _nbytes(a["input"]) // n
    return 0


_NAMES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "all_to_all_single",
)


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_local, "stack", None)
        depth = getattr(_local, "depth", 0)
        if stack and depth == 0:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            nbytes = _cost(name, dict(bound.arguments))
            for counter in stack:
                counter.add(name, nbytes)
        _local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = depth

    wrapper.__benchmark_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def install() -> None:
    """Wrap the collectives (idempotent). Call before importing libraries that bind them."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in _NAMES:
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        wrapped = _wrap(name, orig)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is orig:
            setattr(dist, name, wrapped)
    _installed = True
