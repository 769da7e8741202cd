"""A pool's worker process: how it is started, how it joins its group, and how it serves runs.

Workers are forked from a fork server that imported torch and zerofn once, where the
platform has one (Linux, macOS), else spawned (:func:`worker_context`). Each joins its own
process group, runs the pool's ``init`` hook, records its torch state
(:class:`~zerofn.testing._rank_state.RankState`) and then serves runs
(:mod:`~zerofn.testing._protocol`) until asked to leave, restoring that state before each.
It leaves with ``os._exit`` after flushing, which sidesteps a known abort ("terminate
called without an active exception") in gloo's interpreter teardown without hiding crashes
that happen while a function runs.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
from datetime import timedelta
from typing import Any

from zerofn.testing import _protocol
from zerofn.testing._rank_state import RankState

__all__ = ["HOST", "STACK_SIGNAL", "worker_context", "worker_main"]

HOST = "127.0.0.1"
#: The signal a hung worker dumps its Python stack on (POSIX only; elsewhere hangs come
#: back without a stack).
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)

# What the fork server imports once, so that a worker forked from it starts with them loaded:
# torch and zerofn (whose import, torch's included, is seconds of CPU per worker), and
# dynamo, which zerofn leaves to the first compiled step (over a second more per worker).
_PRELOAD = ["torch", "torch.distributed", "zerofn", "torch._dynamo"]


def worker_context() -> Any:
    """How workers are started: forked from a fork server that has imported torch and zerofn, where
    the platform has one (Linux, macOS), else spawned.

    A spawned worker imports torch and zerofn itself, seconds of CPU per rank; a pool that
    restarts (a test of failures, a notebook that opens a pool per cell) pays it every
    time. The fork server imports them once per process and forks every later worker
    from that state (no thread or process group exists there), so each worker
    still starts clean: it joins its own group and runs ``init`` as a spawned one would.
    The worker takes the parent's environment of the moment it starts (:func:`worker_main`).
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the server starts; a server already running (started by this process's
    # own code for something else) keeps what it was started with, which is still correct.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def worker_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Any,
    timeout_s: float,
    threads: int,
    backend: str,
    device: str,
    init_payload: bytes | None,
    stack_path: str | None,
    environ: dict[str, str],
) -> None:
    """Entry point of a worker process: join the group, run ``init``, then serve ``run`` requests.

    ``stack_path``: where this worker writes its Python stack (every thread) when the
    parent sends ``SIGUSR1`` because a run did not finish in time. ``environ``: the
    parent's environment when it started the pool, which a forked worker would otherwise
    not see (it inherits the fork server's, fixed when that server started).
    """
    os.environ.clear()
    os.environ.update(environ)
    if stack_path is not None and STACK_SIGNAL is not None:
        # Kept open for the process's life: faulthandler writes to its file descriptor from
        # the signal handler, even while the main thread is blocked inside a C++ collective.
        stack_file = open(stack_path, "w")
        faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        # What torchrun sets too; libraries that read them (DeepSpeed, FSDP utilities)
        # find the store every rank already uses.
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    _join_group(rank, world_size, port, timeout_s, backend, device)
    state: RankState | None = None
    try:
        if init_payload is not None:
            pickle.loads(init_payload)()
        state = RankState()  # what every run starts from: the pool's settings, init's included
        conn.send_bytes(_protocol.READY)
    except BaseException as exc:  # the parent raises it from start(); nothing is served
        conn.send_bytes(_protocol.pickler.dumps(_protocol.failure_reply(exc)))
    if state is not None:
        _serve(conn, state)
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _join_group(rank: int, world_size: int, port: int, timeout_s: float, backend: str, device: str) -> None:
    import torch
    import torch.distributed as dist

    options: dict[str, Any] = {}
    if device == "cuda":
        # Before the group exists: NCCL binds its communicator to the current device, and
        # rank r of a World larger than the GPU count shares GPU r % count (gloo only).
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        if backend == "nccl":
            options["device_id"] = torch.device("cuda", index)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **options
    )


def _serve(conn: Any, state: RankState) -> None:
    """Answer run requests until the parent closes the pipe or sends the empty frame."""
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:
            return
        if not request:
            return
        try:
            state.restore()  # whatever an earlier run left in torch's settings and generators
            parent_path, payload = pickle.loads(request)
            # Folders the parent put on sys.path since this worker started (pytest adds each
            # test module's folder as it imports it): a function pickled by reference to such
            # a module must be importable here too.
            sys.path.extend(p for p in parent_path if p not in sys.path)
            fn, args, kwargs = pickle.loads(payload)
            answer: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # report everything, KeyboardInterrupt included
            answer = _protocol.failure_reply(exc)
        conn.send_bytes(_protocol.reply(answer))
