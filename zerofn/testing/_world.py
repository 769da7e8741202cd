"""``World``: a persistent pool of real gloo ranks for tests, notebooks and demos.

Starting a process and initialising a process group costs seconds; a property test runs
hundreds of examples. ``World(n)`` starts ``n`` worker processes once, each a real
``torch.distributed`` rank of one gloo group, and then runs any function on all of them
as often as needed::

    with World(3) as world:
        results = world.run(fn, arg)      # fn(arg) on ranks 0, 1, 2 -> [r0, r1, r2]

Functions and results travel with cloudpickle when it is installed (so a function
defined in a notebook or a test reaches the workers by value), else with pickle (the
function must then be importable). Tensors travel as plain pickled copies.

Robustness, by design:

* every process group gets a timeout, so a collective that cannot complete becomes an
  error on the ranks stuck in it instead of a hang;
* a rank that raises sends its exception back; ``run`` raises :class:`WorldError` with
  every failing rank's traceback (or returns the exceptions with ``return_exceptions``);
* if ranks failed differently (some raised, others did not or raised something else),
  their group may be out of step, so the pool is restarted before the next run;
* a worker that dies is reported as such (with its exit code) and the pool restarted;
* a function that catches a collective's error itself (a timeout, a lost peer) hides
  from the pool that its group is broken: call ``restart()`` before the next run;
* workers leave with ``os._exit`` after flushing, which sidesteps a known abort
  ("terminate called without an active exception") in gloo's interpreter teardown
  without hiding crashes that happen while a function runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

try:  # cloudpickle carries functions by value (notebooks, closures); optional.
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - exercised only without the test extra
    _pickler = pickle  # type: ignore[assignment]

__all__ = ["RankFailure", "World", "WorldError"]

_HOST = "127.0.0.1"


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
    """One or more ranks failed in ``World.run``; ``failures`` maps rank -> RankFailure."""

    def __init__(self, failures: dict[int, RankFailure], note: str = "") -> None:
        self.failures = failures
        parts = [f"{len(failures)} rank(s) failed{note}:"]
        for rank, f in sorted(failures.items()):
            parts.append(f"--- rank {rank}: {f.type_name}: {f.message}\n{f.traceback}")
        super().__init__("\n".join(parts))


def _worker_main(rank: int, world_size: int, port: int, conn: Any, timeout_s: float, threads: int) -> None:
    """Entry point of a worker process: join the group, then serve ``run`` requests."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    conn.send_bytes(b"ready")
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:
            break
        if not request:
            break
        try:
            fn, args, kwargs = pickle.loads(request)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # report everything, KeyboardInterrupt included
            tb = traceback.format_exc()
            try:
                _pickler.dumps(exc)
                carried: BaseException | None = exc
            except Exception:
                carried = None
            reply = ("err", (carried, type(exc).__name__, str(exc), tb))
        try:
            payload = _pickler.dumps(reply)
        except Exception as exc:
            payload = _pickler.dumps(
                ("err", (None, type(exc).__name__, f"result could not be pickled: {exc}", traceback.format_exc()))
            )
        conn.send_bytes(payload)
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class World:
    """A pool of ``world_size`` real gloo ranks that runs functions on all of them.

    Args:
      world_size: number of ranks (processes), >= 1.
      timeout: seconds; the process-group timeout (a collective that cannot finish
        raises after this) and the start-up limit.
      threads: intra-op threads per rank (``torch.set_num_threads``); 1 keeps ranks
        from fighting over a small machine's cores.

    The pool starts lazily on the first ``run`` and is closed by ``close()`` or the
    ``with`` block. Workers see a normal default process group (``dist.get_rank()``,
    ``dist.new_group`` ...) and ``RANK`` / ``WORLD_SIZE`` in their environment.
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0, threads: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"World needs at least one rank, got world_size={world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.threads = threads
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self.restarts = 0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> World:
        if self._procs:
            return self
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore(
            _HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout)
        )
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self._store.port, child, self.timeout, self.threads),
                daemon=True,
                name=f"zerofn-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        for rank, conn in enumerate(self._conns):
            ready = self._wait_readable(rank, conn, self.timeout + 30)
            try:
                if ready:
                    conn.recv_bytes()
            except EOFError:
                ready = False
            if not ready:
                code = self._procs[rank].exitcode
                self.close()
                why = f"exited with code {code}" if code is not None else f"did not start within {self.timeout + 30}s"
                raise RuntimeError(
                    f"World({self.world_size}): rank {rank} {why} before joining the process group; its "
                    "stderr above says why (when run from a script, guard it with `if __name__ == '__main__':`)"
                )
        return self

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None

    def restart(self) -> None:
        self.close()
        self.restarts += 1
        self.start()

    def __enter__(self) -> World:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running -----------------------------------------------------------------------

    def _wait_readable(self, rank: int, conn: Any, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                return True
            if not self._procs[rank].is_alive():
                return conn.poll(0)
        return False

    def run(self, fn: Callable[..., Any], *args: Any, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank at once; return the results by rank.

        Raises :class:`WorldError` if any rank raised (unless ``return_exceptions``:
        then a failing rank's entry is its :class:`RankFailure`), or if a worker died.
        """
        self.start()
        request = _pickler.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(request)
        results: list[Any] = [None] * self.world_size
        failures: dict[int, RankFailure] = {}
        died = False
        for rank, conn in enumerate(self._conns):
            # A stuck collective raises after `timeout` on the rank itself; allow for that.
            if not self._wait_readable(rank, conn, 2 * self.timeout + 30):
                code = self._procs[rank].exitcode
                what = "died" if code is not None else "did not answer"
                failures[rank] = RankFailure(rank, None, "WorkerDied", f"worker {what} (exit code {code})", "")
                died = True
                continue
            try:
                reply = conn.recv_bytes()
            except (EOFError, OSError):
                # A dead worker's pipe polls readable (EOF) and then has nothing to read.
                self._procs[rank].join(5)
                code = self._procs[rank].exitcode
                failures[rank] = RankFailure(rank, None, "WorkerDied", f"worker died (exit code {code})", "")
                died = True
                continue
            status, value = pickle.loads(reply)
            if status == "ok":
                results[rank] = value
            else:
                failures[rank] = RankFailure(rank, *value)
        symmetric = len(failures) == self.world_size and len({f.type_name for f in failures.values()}) == 1
        if died or (failures and not symmetric):
            self.restart()  # the group may be out of step; start the next run from a clean one
        if failures and not return_exceptions:
            raise WorldError(failures, " (pool restarted)" if died or not symmetric else "")
        for rank, failure in failures.items():
            results[rank] = failure
        return results
