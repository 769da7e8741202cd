"""Byte counting: what each rank sends in zerofn's collectives.

``count_bytes()`` is a context manager; every collective issued inside it adds to the
counter the bytes *this rank* sends under the textbook algorithm of the realisation
actually used (ring for all-reduce, reduce-scatter and all-gather; the root sending to
every other rank for broadcast), padding included. Backends may route data differently
inside; the count is what the realisation costs, not a packet capture. Bucket traffic is
keyed by collective (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``,
``"broadcast"``); the O(1) extras are keyed ``"scalars"`` (norm and overflow flag) and
``"check"`` (the rank-agreement all-gather). The collectives themselves
(:mod:`zerofn._comm`) call :func:`record`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["CommCounter", "count_bytes", "record", "ring_share"]


@dataclass(eq=False)  # identity, not value: nested counters are told apart on the stack
class CommCounter:
    """Bytes this rank sent, total and per collective kind, while the counter was active.

    ``calls`` counts zerofn's collective calls, ``calls_by_collective`` per kind: a bucket's
    gather by one broadcast per rank is one call of ``"broadcast"``.
    """

    bytes_sent: int = 0
    by_collective: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    calls_by_collective: dict[str, int] = field(default_factory=dict)

    def add(self, collective: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.by_collective[collective] = self.by_collective.get(collective, 0) + nbytes
        self.calls += 1
        self.calls_by_collective[collective] = self.calls_by_collective.get(collective, 0) + 1


_active = threading.local()


@contextlib.contextmanager
def count_bytes() -> Iterator[CommCounter]:
    """Count the bytes this rank sends in every zerofn collective inside the block.

    Counters nest: an outer counter also sees what an inner one counts.

    Examples:
      >>> with count_bytes() as c:  # doctest: +SKIP
      ...     grads = reduce_grads(g, layout)
      >>> c.bytes_sent  # doctest: +SKIP
    """
    counter = CommCounter()
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(counter)
    try:
        yield counter
    finally:
        stack.remove(counter)


def record(collective: str, nbytes: int) -> None:
    if torch.compiler.is_compiling():  # a compiled step is counted by the compiler's graph, not per call
        return
    for counter in getattr(_active, "stack", ()):
        counter.add(collective, nbytes)


def ring_share(n: int, numel: int, elem: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter or all-gather of ``numel`` elements."""
    return (n - 1) * numel * elem // n
