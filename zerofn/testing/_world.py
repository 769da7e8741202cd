"""``World``: a persistent pool of real ``torch.distributed`` ranks for tests, notebooks,
demos and benchmarks.

Starting a process and initialising a process group costs seconds; a property test runs
hundreds of examples. ``World(n)`` starts ``n`` worker processes once, each a real
``torch.distributed`` rank of one process group (gloo on the CPU by default), and then runs
any function on all of them as often as needed::

    with World(3) as world:
        results = world.run(fn, arg)      # fn(arg) on ranks 0, 1, 2 -> [r0, r1, r2]

    # one rank per GPU over NCCL, each worker seeded once after its group is up
    with World(torch.cuda.device_count(), backend="nccl", device="cuda", init=seed_everything) as world:
        ...

On ``device="cuda"`` rank ``r`` makes ``cuda:(r % device_count)`` its current device
before joining the group, so several ranks may share one GPU (through gloo: NCCL refuses
two ranks on one device, and ``World`` says so before starting anything).

Functions and results travel with cloudpickle when it is installed (so a function
defined in a notebook or a test reaches the workers by value), else with pickle (the
function must then be importable). Tensors travel as plain pickled copies. Each run
also brings the workers' ``sys.path`` up to date with the caller's, so a function of a
module imported after the pool started (a test module) can be found by reference.

What a rank keeps between runs: its module globals and imports, and its process group.
What it does not: torch's global settings (threads, default dtype and device,
deterministic mode, matmul precision, grad mode, ...) and the random generators, which
every run finds as the pool left them after ``init`` (:mod:`~zerofn.testing._rank_state`),
so a run's result does not depend on the runs before it.

This module is the parent's side: starting, watching and stopping the workers, and
running a function on them. :mod:`~zerofn.testing._worker` is the worker's side,
:mod:`~zerofn.testing._protocol` what travels between the two.

Robustness, by design:

* every process group gets a timeout, so a collective that cannot complete becomes an
  error on the ranks stuck in it instead of a hang;
* a rank that raises sends its exception back; ``run`` raises :class:`WorldError` with
  every failing rank's traceback (or returns the exceptions with ``return_exceptions``);
* if ranks failed differently (some raised, others did not or raised something else),
  their group may be out of step, so the pool is restarted before the next run;
* a worker that dies is reported as such (with its exit code) and the pool restarted;
* a run that does not finish within ``run_timeout`` is reported rank by rank: the ranks
  that did not answer fail as hung, with the Python stack each was stuck in (dumped by
  :mod:`faulthandler` on ``SIGUSR1`` where the platform has it), and the pool restarted;
* a function that catches a collective's error itself (a timeout, a lost peer) hides
  from the pool that its group is broken: call ``restart()`` before the next run;
* an ``init`` hook that raises on any rank stops the start: ``start`` (and so ``run``)
  raises :class:`WorldError` with the hook's tracebacks and closes the pool;
* workers leave with ``os._exit`` after flushing (:mod:`~zerofn.testing._worker`).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from zerofn.testing import _protocol
from zerofn.testing._protocol import RankFailure, WorldError, pickler
from zerofn.testing._worker import HOST, STACK_SIGNAL, worker_context, worker_main

__all__ = ["RankFailure", "World", "WorldError"]

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
# How long a hung worker gets to write its stack after SIGUSR1 before it is killed.
_STACK_WAIT_S = 2.0


def _check_placement(world_size: int, backend: str, device: str) -> None:
    """Refuse a backend/device pair that cannot start here, before any process is spawned."""
    if backend not in BACKENDS:
        raise ValueError(f"World: backend must be one of {BACKENDS}, got {backend!r}")
    if device not in DEVICES:
        raise ValueError(f"World: device must be one of {DEVICES}, got {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError(
            "World: backend='nccl' moves CUDA tensors only; use World(n, backend='nccl', device='cuda'), "
            "or backend='gloo' for CPU tensors"
        )
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"World(device='cuda', backend={backend!r}): CUDA is not available in this Python "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); use device='cpu' with backend='gloo'"
        )
    gpus = torch.cuda.device_count()
    if backend == "nccl" and world_size > gpus:
        raise ValueError(
            f"World({world_size}, backend='nccl'): NCCL needs one GPU per rank and {gpus} are visible; "
            f"use at most {gpus} ranks, or backend='gloo' with device='cuda' to let ranks share GPUs"
        )


class World:
    """A pool of ``world_size`` real ranks that runs functions on all of them.

    Args:
      world_size: number of ranks (processes), >= 1.
      timeout: seconds; the process-group timeout (a collective that cannot finish
        raises after this) and the start-up limit.
      threads: intra-op threads per rank (``torch.set_num_threads``); 1 keeps ranks
        from fighting over a small machine's cores.
      backend: ``"gloo"`` (CPU tensors, and CUDA tensors through host copies) or
        ``"nccl"`` (CUDA tensors; one GPU per rank).
      device: ``"cpu"``, or ``"cuda"``: rank ``r`` calls
        ``torch.cuda.set_device(r % torch.cuda.device_count())`` before joining the group.
        NCCL needs ``"cuda"``; gloo works with either.
      init: a callable with no arguments, run once in every worker right after its process
        group is up and before any ``run`` (set threads, seed, install a hook, import a
        module); again in the new workers after every restart. It travels like ``run``'s
        functions (cloudpickle when installed), pickled here when the ``World`` is made.
        What it returns is dropped; if it raises on any rank, ``start`` raises
        :class:`WorldError` and the pool is closed. The torch settings and generator
        states it leaves are what every run starts from.
      run_timeout: seconds one ``run`` may take. The ranks that have not answered by
        then fail as ``WorkerHung``, each with the Python stack it was stuck in, and the
        pool is restarted. ``None`` (the default): ``2 * timeout + 30``, time for a
        collective that cannot finish to raise on its own rank first.
      env: environment variables the workers get on top of the caller's environment (as it
        is when the pool starts or restarts), e.g. ``{"ATEN_CPU_CAPABILITY": "default"}`` to
        run the ranks on torch's portable CPU kernels while the caller keeps its own. A
        variable that torch reads only while it is imported has no effect on workers forked
        from the fork server, which imported torch already.

    Raises:
      ValueError: ``world_size < 1``, an unknown backend or device, NCCL without
        ``device="cuda"``, more NCCL ranks than GPUs, or a ``run_timeout`` that is not a
        positive number.
      RuntimeError: ``device="cuda"`` where CUDA is not available.
      TypeError: ``init`` is not callable, or ``env`` holds something but strings.

    The pool starts lazily on the first ``run`` and is closed by ``close()`` or the
    ``with`` block. Workers see a normal default process group (``dist.get_rank()``,
    ``dist.new_group`` ...) and ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
    ``MASTER_ADDR`` / ``MASTER_PORT`` in their environment, as under ``torchrun``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 60.0,
        threads: int = 1,
        backend: str = "gloo",
        device: str = "cpu",
        init: Callable[[], object] | None = None,
        run_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"World needs at least one rank, got world_size={world_size}")
        if run_timeout is not None and not run_timeout > 0:
            raise ValueError(f"World: run_timeout must be a positive number of seconds, got {run_timeout!r}")
        _check_placement(world_size, backend, device)
        if init is not None and not callable(init):
            raise TypeError(f"World: init must be a callable taking no arguments, got {type(init).__name__}")
        self.world_size = world_size
        self.timeout = timeout
        self.threads = threads
        self.backend = backend
        self.device = device
        self.init = init
        self.run_timeout = run_timeout
        self.env = dict(env or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise TypeError(f"World: env maps names to strings, got {env!r}")
        self._init_payload = pickler.dumps(init) if init is not None else None
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._stack_dir: str | None = None
        self.restarts = 0

    def __repr__(self) -> str:
        return f"World({self.world_size}, backend={self.backend!r}, device={self.device!r})"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> World:
        """Spawn the workers, wait until every rank joined the group and ran ``init``."""
        if self._procs:
            return self
        import torch.distributed as dist

        ctx = worker_context()
        self._stack_dir = tempfile.mkdtemp(prefix="zerofn-world-")
        self._store = dist.TCPStore(
            HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout)
        )
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    child,
                    self.timeout,
                    self.threads,
                    self.backend,
                    self.device,
                    self._init_payload,
                    self._stack_path(rank),
                    {**os.environ, **self.env},
                ),
                daemon=True,
                name=f"zerofn-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        failures: dict[int, RankFailure] = {}
        for rank, conn in enumerate(self._conns):
            # The init hook may itself take time (imports, a first collective): allow for it.
            ready = self._wait_readable(rank, conn, 2 * self.timeout + 30)
            message = b""
            try:
                if ready:
                    message = conn.recv_bytes()
            except EOFError:
                ready = False
            if not ready:
                code = self._procs[rank].exitcode
                self.close()
                why = (
                    f"exited with code {code}"
                    if code is not None
                    else f"did not start within {2 * self.timeout + 30:.0f}s"
                )
                raise RuntimeError(
                    f"{self!r}: rank {rank} {why} before joining the process group; its "
                    "stderr above says why (when run from a script, guard it with `if __name__ == '__main__':`)"
                )
            if message != _protocol.READY:
                _, value = pickle.loads(message)
                failures[rank] = RankFailure(rank, *value)
        if failures:
            self.close()
            raise WorldError(failures, " in the init hook (pool closed)", restarted=True)
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
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)
        self._procs, self._conns, self._store, self._stack_dir = [], [], None, None

    def restart(self) -> None:
        self.close()
        self.restarts += 1
        self.start()

    def __enter__(self) -> World:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running -----------------------------------------------------------------------

    def _stack_path(self, rank: int) -> str | None:
        return None if self._stack_dir is None else os.path.join(self._stack_dir, f"rank{rank}.stack")

    def _wait_readable(self, rank: int, conn: Any, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while True:
            if conn.poll(max(0.0, min(0.05, deadline - time.monotonic()))):
                return True
            if not self._procs[rank].is_alive():
                return conn.poll(0)
            if time.monotonic() >= deadline:
                return False

    def _stop_hung(self, ranks: list[int]) -> dict[int, str]:
        """Ask each hung worker for its Python stack (``SIGUSR1``), then kill it; rank -> stack text."""
        paths = {rank: self._stack_path(rank) for rank in ranks}
        sizes = {rank: _file_size(path) for rank, path in paths.items()}
        if STACK_SIGNAL is not None:
            for rank in ranks:
                try:
                    os.kill(self._procs[rank].pid, STACK_SIGNAL)
                except (ProcessLookupError, TypeError):
                    pass
            deadline = time.monotonic() + _STACK_WAIT_S
            # faulthandler writes the whole dump at once; wait until every file grew.
            while time.monotonic() < deadline and any(_file_size(paths[r]) <= sizes[r] for r in ranks):
                time.sleep(0.05)
            time.sleep(0.1)
        stacks = {}
        for rank in ranks:
            self._procs[rank].kill()
            self._procs[rank].join(5)
            stacks[rank] = _read_from(paths[rank], sizes[rank])
        return stacks

    def run(self, fn: Callable[..., Any], *args: Any, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank at once; return the results by rank.

        Raises :class:`WorldError` if any rank raised (unless ``return_exceptions``:
        then a failing rank's entry is its :class:`RankFailure`), if a worker died
        (``WorkerDied``) or if a rank did not finish within ``run_timeout`` (``WorkerHung``,
        with the stack it was stuck in as its traceback). After a death, a hang or
        ranks that failed differently, the pool restarts before the next run.

        Each rank starts ``fn`` from the torch settings and generator states the pool had
        when it became ready, whatever earlier runs changed; module globals persist.
        """
        __tracebackhide__ = True  # pytest: a failure points at the caller's line, not at the pool's code
        self.start()
        request = _protocol.request(list(sys.path), fn, args, kwargs)
        for conn in self._conns:
            conn.send_bytes(request)
        results: list[Any] = [None] * self.world_size
        failures: dict[int, RankFailure] = {}
        died = False
        hung: list[int] = []
        # By default a stuck collective raises after `timeout` on the rank itself; allow for that.
        limit = self.run_timeout if self.run_timeout is not None else 2 * self.timeout + 30
        deadline = time.monotonic() + limit
        for rank, conn in enumerate(self._conns):
            if not self._wait_readable(rank, conn, deadline - time.monotonic()):
                code = self._procs[rank].exitcode
                if code is None:
                    hung.append(rank)
                else:
                    failures[rank] = RankFailure(rank, None, "WorkerDied", f"worker died (exit code {code})", "")
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
        waited = time.monotonic() - (deadline - limit)
        for rank, stack in self._stop_hung(hung).items():
            what = f"did not finish within {limit:g}s (run_timeout); stopped after {waited:.1f}s"
            if stack:
                text = f"Python stack of rank {rank} when it was stopped:\n{stack}"
            elif STACK_SIGNAL is None:
                text = "(no stack: this platform has no SIGUSR1 to ask the worker for one)"
            else:
                text = f"(no stack: rank {rank} wrote none within {_STACK_WAIT_S:g}s of being asked)"
            failures[rank] = RankFailure(rank, None, "WorkerHung", what, text)
        failures = dict(sorted(failures.items()))
        symmetric = len(failures) == self.world_size and len({f.type_name for f in failures.values()}) == 1
        restart = died or bool(failures and not symmetric)
        if restart:
            # The group may be out of step: close it now, and the next run (or start) begins
            # from fresh workers, so a failure is reported without waiting for new processes.
            self.close()
            self.restarts += 1
        if failures and not return_exceptions:
            raise WorldError(failures, " (pool restarted)" if restart else "", restarted=restart)
        for rank, failure in failures.items():
            results[rank] = failure
        return results


def _file_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path is not None else 0
    except OSError:
        return 0


def _read_from(path: str | None, offset: int) -> str:
    """What was written to ``path`` after ``offset`` bytes ("" if nothing or no file)."""
    if path is None:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""
