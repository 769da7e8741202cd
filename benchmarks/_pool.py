"""A pool of rank processes for the benchmark: gloo on CPU, NCCL on CUDA.

Like :class:`zerofn.testing.World` (persistent ranks, a timeout on every process group,
``os._exit`` after flushing), but the backend and device follow the hardware, so the same
command runs on GPUs, and the collective byte counter (:mod:`benchmarks._count`) is
installed in every rank before anything else imports ``torch.distributed`` users.

Functions travel by reference (pickle): they must be importable module-level functions.
This module imports no torch at the top, so importing it in the parent is cheap.
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

__all__ = ["Pool", "PoolError"]

_HOST = "127.0.0.1"


class PoolError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> (type name, message, traceback)."""

    def __init__(self, failures: dict[int, tuple[str, str, str]], world_size: int) -> None:
        self.failures = failures
        self.world_size = world_size
        parts = [f"{len(failures)} rank(s) failed:"]
        for rank, (kind, msg, tb) in sorted(failures.items()):
            parts.append(f"--- rank {rank}: {kind}: {msg}\n{tb}")
        super().__init__("\n".join(parts))

    @property
    def symmetric(self) -> bool:
        """Every rank failed, with the same exception type (the group is still in step)."""
        kinds = {kind for kind, _, _ in self.failures.values()}
        return len(self.failures) == self.world_size and len(kinds) == 1 and "WorkerDied" not in kinds

    def short(self) -> str:
        kind, msg, _ = next(iter(self.failures.values()))
        return f"{kind}: {msg.splitlines()[0] if msg else ''}"[:300]


def _worker_main(
    rank: int, world_size: int, port: int, conn: Any, backend: str, threads: int, timeout_s: float
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    import torch
    import torch.distributed as dist

    from benchmarks import _count

    _count.install()  # before zerofn, FSDP2 or DeepSpeed bind any collective
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
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
            reply: tuple = ("ok", fn(*args, **kwargs))
        except BaseException as exc:
            reply = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
        try:
            payload = pickle.dumps(reply)
        except Exception as exc:
            payload = pickle.dumps(("err", (type(exc).__name__, f"unpicklable result: {exc}", "")))
        conn.send_bytes(payload)
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class Pool:
    """``world_size`` rank processes in one process group; ``call`` runs a function on all.

    Args:
      world_size: ranks.
      backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank ``r`` on ``cuda:r``).
      threads: intra-op (and inter-op) threads per rank.
      timeout: seconds, for every collective and for start-up.
    """

    def __init__(self, world_size: int, backend: str = "gloo", *, threads: int = 1, timeout: float = 300.0) -> None:
        self.world_size = world_size
        self.backend = backend
        self.threads = threads
        self.timeout = timeout
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None

    def start(self) -> Pool:
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
                args=(rank, self.world_size, self._store.port, child, self.backend, self.threads, self.timeout),
                daemon=True,
                name=f"bench-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        for rank, conn in enumerate(self._conns):
            if not self._wait(rank, conn, self.timeout + 60):
                self.close()
                raise RuntimeError(f"benchmark pool: rank {rank} did not start")
            conn.recv_bytes()
        return self

    def _wait(self, rank: int, conn: Any, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                return True
            if not self._procs[rank].is_alive():
                return conn.poll(0)
        return False

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results by rank. Raises :class:`PoolError`."""
        self.start()
        request = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(request)
        results: list[Any] = [None] * self.world_size
        failures: dict[int, tuple[str, str, str]] = {}
        for rank, conn in enumerate(self._conns):
            if not self._wait(rank, conn, 2 * self.timeout + 60):
                failures[rank] = ("WorkerDied", f"exit code {self._procs[rank].exitcode}", "")
                continue
            status, value = pickle.loads(conn.recv_bytes())
            if status == "ok":
                results[rank] = value
            else:
                failures[rank] = value
        if failures:
            raise PoolError(failures, self.world_size)
        return results

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 15
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
