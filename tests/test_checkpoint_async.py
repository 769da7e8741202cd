"""Checkpoints saved in the background: staged at the call, written while training goes on.

The writes are held (or failed) by wrapping DCP's file writer in the rank processes, so
each test knows the write had not started when the state changed, and no test relies on
timing for what it checks.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Net, assert_bitwise_equal, batches, seeded

import zerofn as zf
from zerofn import checkpoint as ck


@contextlib.contextmanager
def _writes_held(gate: threading.Event, fail_on_rank: int | None = None) -> Iterator[None]:
    """DCP's file writes on this rank wait for ``gate`` (or, on ``fail_on_rank``, raise)."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._FileSystemWriter.write_data
    rank = dist.get_rank()

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        assert threading.current_thread() is not threading.main_thread()  # the write runs in the background
        gate.wait(60)
        if rank == fail_on_rank:
            raise OSError(f"no space left on device (test, rank {rank})")
        return original(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        yield
    finally:
        filesystem._FileSystemWriter.write_data = original  # type: ignore[method-assign]


def _facade() -> tuple[Net, zf.ZeroOptimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True, module=model)
    return model, opt, list(batches(dist.get_rank(), 6))


def _train(model: Net, opt: zf.ZeroOptimizer, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in data:
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()


# --------------------------------------------------------------------------- the #144657 trap


class _Counter:
    """A user's Stateful object (``extra=``)."""

    def __init__(self) -> None:
        self.seen = [0]

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen = list(sd["seen"])


def _sync_then_async_then_change_everything(sync_path: str, async_path: str) -> dict[str, Any]:
    model, opt, data = _facade()
    _train(model, opt, data[:3])
    counter = _Counter()
    opt.save_checkpoint(sync_path, extra={"counter": counter})
    gate = threading.Event()
    with _writes_held(gate):
        handle = opt.save_checkpoint(async_path, extra={"counter": counter}, async_save=True)
        assert isinstance(handle, ck.PendingCheckpoint)
        # Everything the checkpoint holds changes in place before a byte is written.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for t in opt.state.master.values():
                t.add_(1.0)
            for field in ("exp_avg", "exp_avg_sq", "step"):
                for t in getattr(opt.state.opt_state, field).values():
                    t.add_(1.0)
        counter.seen.append(1)  # the extra object, in place, and the RNG move on too
        torch.rand(3)
        _train(model, opt, data[3:])  # and the steps after it
        written_early = handle.done()
        gate.set()
        committed = handle.wait()
    return {"committed": committed, "now": os.path.realpath(async_path), "early": written_early}


def _contents(target: str, out: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every tensor of a checkpoint (full, unsharded) and its zerofn.json without the file list."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(target, out)
    with open(os.path.join(target, ck.META_FILE)) as f:
        meta = json.load(f)
    meta.pop("files")
    return torch.load(out, weights_only=True), meta


def test_an_async_checkpoint_equals_a_sync_one_though_everything_changed_right_after_the_call(tmp_path):
    from conftest import get_world

    sync_path, async_path = str(tmp_path / "sync"), str(tmp_path / "async")
    results = get_world(2).run(_sync_then_async_then_change_everything, sync_path, async_path)
    assert [r["early"] for r in results] == [False, False]  # the write waited for the gate
    assert results[0]["committed"] == results[1]["committed"] == results[0]["now"]
    sync_tensors, sync_meta = _contents(os.path.realpath(sync_path), str(tmp_path / "sync.pt"))
    async_tensors, async_meta = _contents(os.path.realpath(async_path), str(tmp_path / "async.pt"))
    assert async_meta == sync_meta
    assert sync_meta["extras"] == {"counter": True}
    for rank in (0, 1):  # the extras and the RNG as they were at the call
        file = f"extras.{rank}.pt"
        sync_extras = torch.load(os.path.join(os.path.realpath(sync_path), file), weights_only=False)
        async_extras = torch.load(os.path.join(os.path.realpath(async_path), file), weights_only=False)
        assert async_extras["extra"] == sync_extras["extra"] == {"counter": {"seen": [0]}}
        assert torch.equal(async_extras["rng"]["torch"], sync_extras["rng"]["torch"])
    assert sorted(async_tensors) == sorted(sync_tensors)
    assert any(k.startswith("model/") for k in sync_tensors) and any(k.startswith("optim/") for k in sync_tensors)
    for key, value in sync_tensors.items():
        assert_bitwise_equal(async_tensors[key], value, key)


# --------------------------------------------------------------------------- order, wait, failure, close


def _one_at_a_time_and_failures(path: str) -> dict[str, Any]:
    model, opt, data = _facade()
    _train(model, opt, data[:2])
    out: dict[str, Any] = {}
    gate = threading.Event()
    with _writes_held(gate):
        first = opt.save_checkpoint(path, async_save=True)
        threading.Timer(0.5, gate.set).start()
        begun = time.monotonic()
        second = opt.save_checkpoint(path, async_save=True)  # waits for the first
        out["waited_s"] = time.monotonic() - begun
        out["first_done"] = first.done()
    out["first"], out["second"] = first.wait(), second.wait()
    out["second_is_committed"] = os.path.realpath(path) == out["second"]
    committed = out["second"]

    # A write that fails on rank 1: every rank's wait() raises, each time; nothing moves.
    gate = threading.Event()
    gate.set()
    with _writes_held(gate, fail_on_rank=1):
        failed = opt.save_checkpoint(path, async_save=True)
        errors = []
        for _ in range(2):
            with pytest.raises(ck.CheckpointError) as info:
                failed.wait()
            errors.append(str(info.value))
    out["errors"] = errors
    out["failed_target_left"] = os.path.exists(failed.target)
    out["after_failure"] = os.path.realpath(path) == committed
    _train(model, opt, data[2:3])
    opt.load_checkpoint(path)  # the previous checkpoint loads
    out["loaded_step"] = opt.state.step

    # A failure nobody waited for is raised by the next save, which does not start.
    with _writes_held(gate, fail_on_rank=1):
        opt.save_checkpoint(path, async_save=True)
        with pytest.raises(ck.CheckpointError, match="failed \\(rank 1: OSError"):
            opt.save_checkpoint(path)
    out["after_unseen"] = os.path.realpath(path) == committed

    # A rank that cannot stage (out of CPU memory) makes every rank raise at the call.
    from torch.distributed.checkpoint.staging import DefaultStager

    original_stage = DefaultStager.stage

    def stage(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1:
            raise MemoryError("cannot allocate (test)")
        return original_stage(self, state_dict, **kwargs)

    DefaultStager.stage = stage  # type: ignore[method-assign]
    try:
        with pytest.raises(ck.CheckpointError, match=r"staging .* failed \(rank 1: MemoryError: cannot allocate"):
            opt.save_checkpoint(path, async_save=True)
    finally:
        DefaultStager.stage = original_stage  # type: ignore[method-assign]
    out["after_staging"] = os.path.realpath(path) == committed

    # Garbage collection of another facade never waits for the save in flight: it may run in
    # any thread, the writer's own included, which would then wait for itself.
    gate = threading.Event()
    with _writes_held(gate):
        held = opt.save_checkpoint(path, async_save=True)
        other = zf.ZeroOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1))
        del other
        gc.collect()
        out["collected_before_the_write"] = not held.done()
        gate.set()
        held.wait()

    # close() waits for the save in flight.
    gate = threading.Event()
    with _writes_held(gate):
        last = opt.save_checkpoint(path, async_save=True)
        threading.Timer(0.3, gate.set).start()
        opt.close()
        out["closed_done"] = last.done()
    out["last"] = last.wait()
    return out


def test_the_next_save_waits_wait_returns_the_commit_and_a_failure_reaches_every_rank(tmp_path):
    from conftest import get_world

    path = str(tmp_path / "ckpt")
    results = get_world(2).run(_one_at_a_time_and_failures, path)
    for rank, r in enumerate(results):
        assert r["waited_s"] >= 0.4 and r["first_done"], rank
        assert r["first"] != r["second"] and r["second_is_committed"], rank
        assert all("failed (rank 1: OSError: no space left on device" in e for e in r["errors"]), r["errors"]
        assert all(f"{path} still points at the previous checkpoint" in e for e in r["errors"])
        assert not r["failed_target_left"] and r["after_failure"] and r["after_unseen"], rank
        assert r["after_staging"], rank
        assert r["loaded_step"] == 2
        assert r["collected_before_the_write"], rank
        assert r["closed_done"] and r["last"] == os.path.realpath(path), rank
    assert results[0]["last"] == results[1]["last"]


# --------------------------------------------------------------------------- SIGKILL mid-write


_KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    from torch.distributed.checkpoint import filesystem
    import zerofn as zf
    from zerofn import checkpoint as ck
    path, flag = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + flag + ".store", rank=0, world_size=1)
    state = zf.shard_params({"w": torch.ones(5)}, zf.optim.sgd(lr=0.1))
    ck.save(path, state, params={"w": torch.ones(5)})
    original = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):  # half the files are written, then the process is killed
        result = original(self, plan, planner)
        result.wait()
        open(flag, "w").close()
        time.sleep(600)

    filesystem._FileSystemWriter.write_data = write_data
    state, _ = zf.step_shards(state, {"w": torch.ones(5)})
    handle = ck.save(path, state, params={"w": torch.zeros(5)}, async_save=True)
    print("training goes on", flush=True)
    handle.wait()
    """
)


def _load_w(path: str) -> tuple[int, list[float]]:
    w = {"w": torch.zeros(5)}
    state = ck.load(path, w, params_out=w)
    return state.step, w["w"].tolist()


def test_sigkill_during_the_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    from conftest import get_world

    path, flag = str(tmp_path / "ckpt"), str(tmp_path / "flag")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_WRITE, path, flag], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(flag):
            assert proc.poll() is None, "the saving process ended early"
            assert time.monotonic() < deadline, "the background write never started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, background threads and all
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert "training goes on" in out  # save() had returned while the write was under way
    leftovers = sorted(f for f in os.listdir(tmp_path) if f.startswith("ckpt."))
    assert len(leftovers) == 2  # the committed target and the half-written one
    assert get_world(1).run(_load_w, path)[0] == (0, [1.0] * 5)


_EXITS_MID_WRITE = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    from torch.distributed.checkpoint import filesystem
    import zerofn as zf
    from zerofn import checkpoint as ck
    path, store = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    state = zf.shard_params({"w": torch.ones(5)}, zf.optim.sgd(lr=0.1))
    ck.save(path, state, params={"w": torch.ones(5)})
    original = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):  # still writing when the script ends
        time.sleep(0.5)
        return original(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data
    state, _ = zf.step_shards(state, {"w": torch.ones(5)})
    print(ck.save(path, state, params={"w": torch.zeros(5)}, async_save=True).target, flush=True)
    """
)


def test_a_script_that_ends_with_a_write_in_flight_commits_it_before_the_process_exits(tmp_path):
    from conftest import get_world

    path = str(tmp_path / "ckpt")
    done = subprocess.run(
        [sys.executable, "-c", _EXITS_MID_WRITE, path, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert os.path.realpath(path) == done.stdout.strip()  # the background save, committed at exit
    assert get_world(1).run(_load_w, path)[0] == (1, [0.0] * 5)


# --------------------------------------------------------------------------- whole params, hybrid layouts


def _whole_async_round_trip(path: str) -> tuple[Any, Any]:
    from test_whole_checkpoint import _initial, _load_and_dump, _optimizer, _steps

    params = _initial()
    state, params = _steps(zf.shard_params(params, _optimizer("muon_adamw")), params, 0, 3)
    assert state.layout.has_whole
    full = ck.full_state_dict(state, bucket_numel=64)
    ck.save(path, state, params=params, async_save=True).wait()
    return full, _load_and_dump("muon_adamw", None, path)[0]


def test_whole_params_save_in_the_background(tmp_path):
    from conftest import get_world
    from test_whole_checkpoint import _assert_state_dicts_equal

    for saved, loaded in get_world(2).run(_whole_async_round_trip, str(tmp_path / "whole")):
        _assert_state_dicts_equal(loaded, saved)


def _hybrid_async_save(path: str) -> dict[str, Any]:
    from test_hybrid import _groups

    shard, replicate = _groups("strided")
    torch.manual_seed(seeded(0))
    model = Net()
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), shard)
    x, y = next(batches(dist.get_rank(), 1))
    grads = torch.func.grad(lambda p: ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean())(params)
    state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout, shard, replicate_group=replicate), shard)
    params = zf.gather_params(state, shard)
    handle = ck.save(path, state, shard, params=params, replicate_group=replicate, async_save=True)
    return {"full": ck.full_state_dict(state, shard), "written": handle.wait(), "now": os.path.realpath(path)}


def test_a_hybrid_layout_saves_in_the_background_and_every_replica_learns_the_commit(tmp_path):
    from conftest import get_world
    from test_hybrid import _plain_load

    path = str(tmp_path / "hybrid")
    saved = get_world(4).run(_hybrid_async_save, path)
    assert [s["written"] for s in saved] == [s["now"] for s in saved] == [os.path.realpath(path)] * 4
    for loaded in get_world(2).run(_plain_load, path):
        for key in ("state", "param_groups"):
            assert repr(loaded[key]) == repr(saved[0]["full"][key])
        for name, t in loaded["zerofn"]["master"].items():
            assert torch.equal(t, saved[0]["full"]["zerofn"]["master"][name])
