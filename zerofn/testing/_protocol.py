"""What crosses the pipe between a :class:`~zerofn.testing.World` and its workers, and the errors made of it.

One pipe per rank, one message per frame (``send_bytes``/``recv_bytes``):

* worker -> parent, once at start: :data:`READY`, or a failure reply (the ``init`` hook raised);
* parent -> worker, per run: :func:`request` (the parent's ``sys.path`` and the pickled
  ``(fn, args, kwargs)``); an empty frame asks the worker to leave;
* worker -> parent, per run: :func:`reply` of ``("ok", result)`` or of :func:`failure_reply`.

Functions, arguments and results travel with cloudpickle when it is installed (a function
defined in a notebook or a test reaches the workers by value), else with pickle (the
function must then be importable). Tensors travel as plain pickled copies.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any

try:  # cloudpickle carries functions by value (notebooks, closures); optional.
    import cloudpickle as pickler
except ImportError:  # pragma: no cover - exercised only without the test extra
    pickler = pickle  # type: ignore[assignment]

__all__ = ["READY", "RankFailure", "WorldError", "failure_reply", "pickler", "reply", "request"]

READY = b"ready"


class RankFailure:
    """What one rank raised: the exception (if it could be pickled) and its traceback text."""

    def __init__(self, rank: int, exc: BaseException | None, type_name: str, message: str, tb: str) -> None:
        self.rank = rank
        self.exc = exc
        self.type_name = type_name
        self.message = message
        self.traceback = tb

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, {self.type_name}: {self.message})"


class WorldError(RuntimeError):
    """One or more ranks failed in ``World.run`` (or in the ``init`` hook at start).

    Attributes:
      failures: rank -> :class:`RankFailure`, for the ranks that failed.
      restarted: the pool was restarted (or, for an ``init`` failure, closed) because its
        ranks may be out of step: whatever the functions had built in the workers is gone.
        False when every rank failed alike and the pool kept its processes.
    """

    def __init__(self, failures: dict[int, RankFailure], note: str = "", *, restarted: bool = False) -> None:
        self.failures = failures
        self.restarted = restarted
        parts = [f"{len(failures)} rank(s) failed{note}:"]
        for rank, f in sorted(failures.items()):
            parts.append(f"--- rank {rank}: {f.type_name}: {f.message}\n{f.traceback}")
        super().__init__("\n".join(parts))


def failure_reply(exc: BaseException) -> tuple[str, tuple[BaseException | None, str, str, str]]:
    """``("err", (exception or None, type name, message, traceback))`` for the parent; call it
    inside the ``except`` block (the traceback is the one being handled)."""
    tb = traceback.format_exc()
    try:
        pickler.dumps(exc)
        carried: BaseException | None = exc
    except Exception:
        carried = None
    return ("err", (carried, type(exc).__name__, str(exc), tb))


def request(path: list[str], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """One run's frame: the caller's ``sys.path`` (plain pickle) around the pickled call."""
    return pickle.dumps((path, pickler.dumps((fn, args, kwargs))))


def reply(value: tuple[str, Any]) -> bytes:
    """A worker's answer, or the reason it could not be pickled."""
    try:
        return pickler.dumps(value)
    except Exception as exc:
        why = ("err", (None, type(exc).__name__, f"result could not be pickled: {exc}", traceback.format_exc()))
        return pickler.dumps(why)
