"""Saving in the background: the tensors are copied now, the files written while training goes on.

A background save (``save(..., async_save=True)``) runs in three parts:

1. **Staging, before the call returns** (this thread): every tensor the checkpoint holds
   is copied into CPU memory by DCP's :class:`~torch.distributed.checkpoint.staging.DefaultStager`
   (pinned memory and a non-blocking copy on CUDA). A ``step`` or an in-place edit of the
   params or the optimizer state right after the call does not reach the checkpoint
   (pytorch/pytorch#144657 was DCP skipping this copy for CPU tensors). The ranks then
   agree that every rank staged (one scalar all-reduce over the side group, below), so a rank
   that could not stage makes every rank raise at once, before anything is in flight.
   DTensors are staged as their local shards and rewrapped (DCP's stager cannot copy a
   DTensor whose local shard is a view).
2. **Writing, in the background**: ``torch.distributed.checkpoint.async_save`` writes
   the staged copy from DCP's own thread (``AsyncCheckpointerType.THREAD``). Its
   collectives (the save plan, the final gather of the write results) run on a **side
   group**: a gloo group over the same ranks, created at the first background save of a
   group (:func:`zerofn._comm_dcp.side_group`), so they never interleave with the training
   loop's collectives on the sharding group (gloo matches collectives by order, per
   group: two threads on one group would deadlock or mix their data).
3. **Committing, when the write completes** (a finishing thread per save): the ranks
   learn each other's verdict over the side group; only if every rank wrote its files
   does rank 0 write ``zerofn.json`` (sizes and SHA-256 of every file) and repoint the
   symlink. A failed write commits nothing: the symlink keeps the previous checkpoint,
   the partial directory is removed, and every rank's handle raises the failure.

In a hybrid layout the writing shard group saves as above; each writer broadcasts to its
replicas (over the replicate group's side group) the directory and the staging verdict
at the call, then the outcome, so a replica's handle completes or fails with the commit.

One background save per sharding group is in flight at a time: any next save, load or
shutdown on that group (or :meth:`PendingCheckpoint.wait`) waits for it first. A failure
nobody has seen yet is raised by the next save, load, ``wait()`` or
``ZeroOptimizer.close()``; at interpreter exit the finishing threads are joined (Python
joins non-daemon threads before ``atexit``) and a failure nobody saw is printed to
stderr with the path that stayed committed. Never leave a background save in flight
across ``dist.destroy_process_group()``: call ``wait()`` (or ``ZeroOptimizer.close()``)
first, or its collectives fail and nothing is committed.
"""

from __future__ import annotations

import atexit
import copy
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _comm_dcp as comm_dcp
from zerofn import _comm_setup as comm_setup
from zerofn._comm import Group
from zerofn.checkpoint._errors import CheckpointError
from zerofn.checkpoint._format import commit, write_meta

__all__ = ["PendingCheckpoint", "replica", "save", "side_groups", "stage", "start", "wait_in_flight"]


class PendingCheckpoint:
    """A checkpoint being written in the background (from ``save(..., async_save=True)``).

    ``path`` is the checkpoint path (the symlink) and ``target`` the directory this save
    writes; ``path`` points at ``target`` only once every rank's files and ``zerofn.json``
    are complete. ``staged_bytes``: the CPU memory of this rank's staged copy (kept, while
    the tensors it copies live, for the next save to copy into); 0 on a replica of a
    hybrid layout, which stages nothing.
    """

    def __init__(self, path: str, target: str, staged_bytes: int, group_key: Any) -> None:
        self.path = path
        self.target = target
        self.staged_bytes = staged_bytes
        self._group_key = group_key
        self._future: Future[str] = Future()
        self._seen = False  # a failure was raised to the caller at least once

    def done(self) -> bool:
        """Whether the background work (write, then commit or failure) has finished. No collectives."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the write and the commit; return the committed directory (``target``).

        Raises :class:`~zerofn.checkpoint.CheckpointError` if any rank's write (or rank 0's
        commit) failed, on every rank alike (the ranks exchanged their verdicts in the
        background), each time it is called; ``path`` then still points at the previous
        checkpoint. ``TimeoutError`` if ``timeout`` seconds pass first. Not a collective
        (the background threads of all ranks did the talking).
        """
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._seen = True
            raise

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else ("failed" if self._future.exception() else "committed")
        return f"PendingCheckpoint({self.path!r} -> {self.target!r}, {state})"


# The save in flight per sharding group (its side group's key), and every handle whose
# failure nobody has seen: reported at interpreter exit.
_IN_FLIGHT: dict[Any, PendingCheckpoint] = {}
_ALL: list[PendingCheckpoint] = []
_LOCK = threading.Lock()


def wait_in_flight(group: Group = None) -> None:
    """Wait for the background save in flight on ``group``, if any.

    Raises its :class:`~zerofn.checkpoint.CheckpointError` if it failed and nobody has
    seen that failure yet (on every rank alike); it is then forgotten, so the next call
    proceeds. Not a collective.
    """
    with _LOCK:
        handles = [h for h in [_IN_FLIGHT.get(comm_dcp.group_key(group))] if h is not None]
    failure: BaseException | None = None
    for handle in handles:
        try:
            handle._future.result()
        except BaseException as e:
            if not handle._seen and failure is None:
                failure = e
            handle._seen = True
        with _LOCK:
            if _IN_FLIGHT.get(handle._group_key) is handle:
                del _IN_FLIGHT[handle._group_key]
    if failure is not None:
        raise failure


# One stager per (group, device type): its cache of staged storages (keyed by the source
# storages, weakly) is reused by the group's next save, which starts after this one's write.
_STAGERS: dict[tuple[Any, str], Any] = {}


def _stager(key: Any, device_type: str) -> Any:
    """DCP's default stager for ``device_type``: plain CPU copies (pinned, non-blocking on CUDA)."""
    if (key, device_type) not in _STAGERS:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        accel = device_type != "cpu" and torch.accelerator.is_available()
        _STAGERS[key, device_type] = DefaultStager(
            StagingOptions(
                use_pinned_memory=accel, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=accel
            )
        )
    return _STAGERS[key, device_type]


def stage(state_dict: dict[str, Any], group: Group = None) -> tuple[dict[str, Any], int]:
    """A CPU copy of a DCP state dict, and the bytes of CPU memory the copy holds.

    Plain tensors are copied by DCP's ``DefaultStager`` (a view is copied with the whole
    storage it lives in, once per storage); a DTensor is staged as its local shard and
    rewrapped with the same placements, shape and stride, on a CPU mesh over the same
    ranks. Non-tensor values are
    kept as they are (they are immutable here: ints, strings). No collectives.
    """
    from torch.distributed.tensor import DTensor

    plain: dict[str, torch.Tensor] = {}
    specs: dict[str, DTensor] = {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            plain[key], specs[key] = value.to_local(), value
        elif isinstance(value, torch.Tensor):
            plain[key] = value
    device_type = next((t.device.type for t in plain.values() if t.device.type != "cpu"), "cpu")
    staged = _stager(comm_dcp.group_key(group), device_type).stage(plain)
    seen: set[int] = set()
    nbytes = 0
    for t in staged.values():
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            nbytes += storage.nbytes()
    out = dict(state_dict)
    for key, value in staged.items():
        like = specs.get(key)
        if like is None:
            out[key] = value
            continue
        # A DTensor on an accelerator's mesh would move its local shard back onto the device:
        # the staged shard gets a CPU mesh over the same ranks (the side group's, same order).
        mesh = like.device_mesh if like.device_mesh.device_type == "cpu" else _cpu_mesh(group)
        out[key] = DTensor.from_local(
            value, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    return out, nbytes


_CPU_MESHES: dict[Any, Any] = {}


def _cpu_mesh(group: Group) -> Any:
    """A CPU ``DeviceMesh`` over ``group``'s ranks in group order (on its gloo side group)."""
    key = comm_dcp.group_key(group)
    if key not in _CPU_MESHES:
        _CPU_MESHES[key] = comm_dcp.device_mesh(comm_dcp.side_group(group), "cpu")
    return _CPU_MESHES[key]


def _why(error: BaseException, rank: int) -> str:
    """What failed, by rank: DCP's ``CheckpointException`` lists every failing rank's own error."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(error.failures.items()))
    return f"rank {rank}: {type(error).__name__}: {error}"


def start(
    path: str,
    target: str,
    staged: dict[str, Any],
    staged_bytes: int,
    group: Group,
    commit: Callable[[], None],
    *,
    abandon: Callable[[], None],
    describe: Callable[[str], BaseException],
    also_write: Callable[[], None] | None = None,
    replicas: Any = None,
) -> PendingCheckpoint:
    """Write ``staged`` (from :func:`stage`) to ``target`` in the background; return its handle.

    ``also_write`` (this rank's extras file) runs in the background beside DCP's write,
    and counts as part of it. ``commit`` runs on group rank 0 once every rank's files are
    written (it writes
    ``zerofn.json`` and repoints ``path``); ``abandon`` on group rank 0 when a rank failed
    (removes the partial ``target``). ``describe(text)`` makes the error every rank's
    handle raises. Collectives (all on the side group, from background threads): DCP's
    save plan and write-result gathers, then one object all-gather of the write verdicts
    and one object broadcast of the commit's verdict; with ``replicas`` (the replicate
    group's side group), one more broadcast of it to this rank's replicas (:func:`replica`).
    """
    side = comm_dcp.side_group(group)
    rank = comm.group_rank(group)
    handle = PendingCheckpoint(path, target, staged_bytes, comm_dcp.group_key(group))

    # Called here, in the caller's thread: at interpreter exit Python stops executors from
    # taking new work before it joins the threads, so a write must be submitted by now.
    upload = comm_dcp.dcp_async_save(staged, target, side)

    def finish() -> None:
        try:
            try:
                if also_write is not None:
                    also_write()
                upload.result()
                mine: str | None = None
            except BaseException as e:
                mine = _why(e, rank)
            verdicts = comm_setup.all_gather_objects(mine, side)
            bad = next((why for why in verdicts if why is not None), None)
            if rank == 0:  # commits, or removes the partial directory, before the others hear of it
                if bad is None:
                    try:
                        commit()
                    except BaseException as e:
                        bad = _why(e, rank)
                if bad is not None:
                    abandon()
            bad = comm_setup.broadcast_object(bad, side)
            error = None if bad is None else describe(str(bad))
            if replicas is not None:  # this rank's replicas learn the outcome
                comm_setup.broadcast_object(None if error is None else str(error), replicas)
            if error is not None:
                raise error
            handle._future.set_result(target)
        except BaseException as e:
            handle._future.set_exception(e)

    _launch(handle, finish)
    return handle


@atexit.register
def _report_unseen_failures() -> None:
    """At exit (after Python joined the finishing threads): print every failure nobody saw."""
    for handle in _ALL:
        if handle.done() and not handle._seen and handle._future.exception() is not None:
            print(
                f"zerofn: a background checkpoint save FAILED and was never waited for: {handle._future.exception()}",
                file=sys.stderr,
                flush=True,
            )


def save(
    path: str,
    target: str,
    sd: dict[str, Any],
    group: Group,
    meta: dict[str, Any],
    *,
    has_model: bool,
    write_extras: Callable[[], None] | None = None,
    replicate_group: Group = None,
) -> PendingCheckpoint:
    """The background half of :func:`zerofn.checkpoint.save` (``async_save=True``): stage ``sd`` now, write it and
    commit ``meta`` (``zerofn.json`` without its file list) to ``target`` in the background.
    ``write_extras`` writes this rank's extras file (captured by the caller) in the background
    too, before the commit. With ``replicate_group`` (this rank is its rank 0, a writer),
    the replicas learn the directory and the staging verdict now, and the outcome when it
    is known (:func:`replica`).

    Each model weight (``model/<name>``, replicated on every rank) is staged and written
    by one rank only (:func:`_writers`) instead of being staged by every rank and
    deduplicated by DCP's planner: the same checkpoint, about ``1/N`` of the model's
    staging memory per rank.

    Collectives before it returns (this thread): one scalar all-reduce of the staging
    verdicts on the side group (the first time for ``group``, the side group's creation);
    the rest runs in the background (:func:`start`).
    """
    rank = comm.group_rank(group)
    if has_model:
        writer = _writers({k: v for k, v in sd.items() if k.startswith("model/")}, comm.group_size(group))
        sd = {k: v for k, v in sd.items() if writer.get(k, rank) == rank}
    meta = copy.deepcopy(meta)  # the values of now (a step or a loss scale kept as a tensor moves on)
    try:
        staged, nbytes = stage(sd, group)
        mine: str | None = None
    except Exception as e:  # e.g. out of memory on one rank: every rank raises, nothing is in flight
        mine = f"rank {rank}: {type(e).__name__}: {e}"
    # Every rank's verdict before anything is in flight, on the side group: no background
    # thread uses it now (this group's previous save is complete), and it is gloo, so the flag
    # is a CPU tensor whatever the training backend is.
    side = comm_dcp.side_group(group)
    error = None
    if comm.all_reduce_scalars(torch.tensor([float(mine is not None)]), "max", side).item():
        bad = [why for why in comm_setup.all_gather_objects(mine, side) if why is not None]
        error = CheckpointError(
            f"{path}: staging the checkpoint in CPU memory failed ({'; '.join(bad)}), so no rank saved; "
            f"{path} still points at the previous checkpoint"
        )
    replicas = None if replicate_group is None else comm_dcp.side_group(replicate_group)
    if replicas is not None:
        comm_setup.broadcast_object((target, None if error is None else str(error)), replicas)
    if error is not None:
        raise error

    def commit_meta() -> None:
        write_meta(target, meta)
        commit(path, target)

    def describe(text: str) -> BaseException:
        return CheckpointError(
            f"the background save to {path} ({target}) failed ({text}). Nothing of it was committed: {path} "
            "still points at the previous checkpoint"
        )

    return start(
        path,
        target,
        staged,
        nbytes,
        group,
        commit_meta,
        abandon=lambda: shutil.rmtree(target, True),
        describe=describe,
        also_write=write_extras,
        replicas=replicas,
    )


def side_groups(group: Group, replicate_group: Group) -> None:
    """Make the side groups a background save uses, in the same order on every rank of the
    world (the shard group's, then the replicate group's): group creation is collective
    among each group's members, and their names depend on how many groups each made."""
    comm_dcp.side_group(group)
    if replicate_group is not None:
        comm_dcp.side_group(replicate_group)


def replica(path: str, group: Group, replicate_group: Group) -> PendingCheckpoint:
    """A replica's part of a background save in a hybrid layout: its writer (rank 0 of
    ``replicate_group``) writes the same shards; this handle completes with its commit.

    Raises :class:`CheckpointError` at once when the writers could not stage. Collectives
    (on the replicate group's side group): one object broadcast now (the directory and
    the staging verdict), one in the background (the outcome).
    """
    replicas = comm_dcp.side_group(replicate_group)
    target, staging_error = comm_setup.broadcast_object(None, replicas)  # type: ignore[misc]
    if staging_error is not None:
        raise CheckpointError(staging_error)
    handle = PendingCheckpoint(path, target, 0, comm_dcp.group_key(group))

    def finish() -> None:
        try:
            error = comm_setup.broadcast_object(None, replicas)
            if error is not None:
                raise CheckpointError(error)
            handle._future.set_result(target)
        except BaseException as e:
            handle._future.set_exception(e)

    _launch(handle, finish)
    return handle


def _launch(handle: PendingCheckpoint, finish: Callable[[], None]) -> None:
    """Register ``handle`` as its group's save in flight and run ``finish`` in a new thread.

    Not a daemon: at interpreter exit Python joins it, so a write in flight completes (or
    fails) before the process ends, instead of being cut off half-written.
    """
    with _LOCK:
        _IN_FLIGHT[handle._group_key] = handle
        _ALL[:] = [h for h in _ALL if not h.done() or (h._future.exception() is not None and not h._seen)]
        _ALL.append(handle)
    threading.Thread(target=finish, name=f"zerofn-checkpoint-commit-{handle.target}", daemon=False).start()


def _writers(model: dict[str, torch.Tensor], n: int) -> dict[str, int]:
    """Which rank stages and writes each model weight: the largest first, each to the rank
    with the fewest bytes so far (ties: the lower rank). The same on every rank (the
    weights are replicated: same names, shapes, dtypes)."""
    load = [0] * n
    out: dict[str, int] = {}
    for key in sorted(model, key=lambda k: (-model[k].numel() * model[k].element_size(), k)):
        r = min(range(n), key=lambda i: (load[i], i))
        out[key] = r
        load[r] += model[key].numel() * model[key].element_size()
    return out
