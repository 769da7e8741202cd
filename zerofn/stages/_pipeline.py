"""What every bucketed path shares: the bucket size, the one in-flight pipeline, the option checks.

``reduce_grads``, ``gather_params``, ``value_and_reduced_grads`` and the facade's gradient
hooks launch one collective per bucket and settle them through :class:`InFlight`, oldest
first, with at most :data:`MAX_IN_FLIGHT` pending while the next bucket is packed.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from zerofn._comm import Pending
from zerofn.buckets import StagingPool
from zerofn.layout import DEFAULT_BUCKET_NUMEL as DEFAULT_BUCKET_NUMEL  # the bucket plan's own default
from zerofn.precision import PrecisionPolicy

#: Bucket collectives a path keeps pending while it packs the next bucket or settles the
#: last: each holds up to :data:`BUFFERS_PER_BUCKET` ``(N, S)`` staging buffers, so this
#: bounds a pipeline's extra memory at that many per bucket for ``MAX_IN_FLIGHT + 1``
#: buckets (the one being packed).
MAX_IN_FLIGHT = 2

#: Staging buffers one bucket in flight may hold: the rows it sends and, with the
#: all-to-all reduce, the rows it receives. ``StagingPool()``'s default ``keep`` is a full
#: pipeline's: ``BUFFERS_PER_BUCKET * (MAX_IN_FLIGHT + 1)``.
BUFFERS_PER_BUCKET = 2

T = TypeVar("T")


class InFlight(Generic[T]):
    """The launched bucket collectives of one pass, settled oldest first.

    Every rank launches and settles in the same order, so a settle that runs a blocking
    collective of its own (the replicas' sum of a hybrid layout) interleaves alike on
    every rank. Settling a finished bucket early (:meth:`settle_finished`) depends on
    timing, so only paths whose settle runs no collective use it.

    Args:
      settle: ``settle(item, pending)`` finishes one bucket (waits on ``pending``).
      pool: the staging pool the buckets' buffers come from: at most ``MAX_IN_FLIGHT``
        stay pending after :meth:`push`, fewer when the pool keeps fewer buffers than a
        full pipeline takes (``keep // BUFFERS_PER_BUCKET - 1``: the one being packed is
        the last), so that every buffer goes back into the pool and the next pass reuses
        it. A pool of ``BUFFERS_PER_BUCKET`` buffers makes the pass synchronous.
    """

    def __init__(self, settle: Callable[[T, Pending], None], pool: StagingPool) -> None:
        self._settle = settle
        self._depth = max(0, min(MAX_IN_FLIGHT, pool.keep // BUFFERS_PER_BUCKET - 1))
        self._queue: collections.deque[tuple[T, Pending]] = collections.deque()

    def push(self, item: T, pending: Pending) -> None:
        """One more launched bucket; settles the oldest while more than ``depth`` are pending."""
        self._queue.append((item, pending))
        self.settle(self._depth)

    def settle(self, keep: int = 0) -> None:
        """Settle the oldest buckets until at most ``keep`` are pending (``0``: all of them)."""
        while len(self._queue) > keep:
            self._settle(*self._queue.popleft())

    def settle_finished(self) -> None:
        """Settle the oldest buckets whose collective has finished, in order (timing decides how many)."""
        while self._queue and self._queue[0][1].done():
            self._settle(*self._queue.popleft())

    def __iter__(self) -> Iterator[T]:
        return (item for item, _ in self._queue)

    def __len__(self) -> int:
        return len(self._queue)


def pipeline_pool(depth: int = MAX_IN_FLIGHT, min_numel: int = 0) -> StagingPool:
    """A staging pool that keeps the buffers of a pipeline ``depth`` buckets deep (0: synchronous)."""
    return StagingPool(keep=BUFFERS_PER_BUCKET * (depth + 1), min_numel=min_numel)


def check_bucket_numel(bucket_numel: Any, where: str) -> None:
    """A bucket size is a positive int of elements (not a bool); raises ``ValueError`` (no collective)."""
    if not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or bucket_numel <= 0:
        raise ValueError(f"{where}: bucket_numel must be a positive int (elements), got {bucket_numel!r}")


def _check_staging(staging: object, where: str) -> None:
    if staging is not None and not isinstance(staging, StagingPool):
        raise TypeError(f"{where}: staging must be a zerofn.buckets.StagingPool or None, got {type(staging).__name__}")


def check_reduce_options(stage: Any, bucket_numel: Any, precision: Any, staging: Any, where: str) -> None:
    """The options ``reduce_grads`` and ``value_and_reduced_grads`` share, checked alike (raises, no collective)."""
    if stage not in (1, 2):
        raise ValueError(f"{where}: stage must be 1 or 2, got {stage!r}")
    check_bucket_numel(bucket_numel, where)
    if precision is not None and not isinstance(precision, PrecisionPolicy):
        raise TypeError(
            f"{where}: precision must be a zerofn.PrecisionPolicy (state.precision) or None, "
            f"got {type(precision).__name__}"
        )
    _check_staging(staging, where)
