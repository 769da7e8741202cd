"""zerofn.testing.World: a pool of real gloo ranks that runs functions on all of them.

Results come back per rank, exceptions come back with their tracebacks, and a pool whose
ranks fell out of step (one rank raised alone, a worker died) is restarted and works.
"""

from __future__ import annotations

import os
import random
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import seeded

from zerofn.testing import RankFailure, World, WorldError, plugin


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"N{n}")
def multi_world(request):
    """World sizes where one rank can fail alone."""
    return get_world(request.param)


def _whoami(offset, *, scale):
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), os.environ["RANK"], offset + scale * float(total)


def _all_reduce_ones():
    t = torch.ones(3)
    dist.all_reduce(t)
    return t


def test_run_returns_one_result_per_rank_in_rank_order(world):
    n = world.world_size
    results = world.run(_whoami, 1.0, scale=2.0)
    expected_sum = 1.0 + 2.0 * n * (n - 1) / 2
    assert results == [(r, n, str(r), expected_sum) for r in range(n)]


def _raise_everywhere():
    raise ValueError(f"bad input on rank {dist.get_rank()}")


def test_exceptions_come_back_with_their_tracebacks(world):
    n, restarts = world.world_size, world.restarts
    with pytest.raises(WorldError) as info:
        world.run(_raise_everywhere)
    assert sorted(info.value.failures) == list(range(n))
    for rank, failure in info.value.failures.items():
        assert failure.type_name == "ValueError"
        assert failure.message == f"bad input on rank {rank}"
        assert "_raise_everywhere" in failure.traceback and "ValueError" in failure.traceback
        assert f"--- rank {rank}: ValueError: bad input on rank {rank}" in str(info.value)
    # Every rank failed alike: the group is still in step and was not restarted, and the error says so.
    assert world.restarts == restarts
    assert info.value.restarted is False
    assert all(torch.equal(t, torch.full((3,), float(n))) for t in world.run(_all_reduce_ones))


def test_return_exceptions_gives_each_rank_its_failure(world):
    results = world.run(_raise_everywhere, return_exceptions=True)
    for rank, r in enumerate(results):
        assert isinstance(r, RankFailure) and r.rank == rank
        assert isinstance(r.exc, ValueError) and str(r.exc) == f"bad input on rank {rank}"


def _raise_on_last_rank():
    if dist.get_rank() == dist.get_world_size() - 1:
        raise RuntimeError("only the last rank fails")
    return "fine"


def test_a_rank_that_raises_alone_restarts_the_pool_which_then_works(multi_world):
    n, restarts = multi_world.world_size, multi_world.restarts
    with pytest.raises(WorldError, match=r"1 rank\(s\) failed \(pool restarted\)") as info:
        multi_world.run(_raise_on_last_rank)
    assert list(info.value.failures) == [n - 1]
    assert info.value.failures[n - 1].type_name == "RuntimeError"
    assert "only the last rank fails" in info.value.failures[n - 1].message
    assert multi_world.restarts == restarts + 1
    assert info.value.restarted is True
    assert all(torch.equal(t, torch.full((3,), float(n))) for t in multi_world.run(_all_reduce_ones))


def _die_on_last_rank():
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(3)
    return "alive"


def test_a_worker_that_dies_is_reported_not_hung_and_replaced(world):
    n, restarts = world.world_size, world.restarts
    with pytest.raises(WorldError) as info:
        world.run(_die_on_last_rank)
    assert list(info.value.failures) == [n - 1]
    failure = info.value.failures[n - 1]
    assert failure.type_name == "WorkerDied"
    assert "exit code 3" in failure.message
    assert world.restarts == restarts + 1
    assert info.value.restarted is True
    assert all(torch.equal(t, torch.full((3,), float(n))) for t in world.run(_all_reduce_ones))


def test_closures_and_lambdas_travel_by_value(world):
    factor = 7  # captured by value: the workers cannot import this test's locals

    def times_rank(x):
        return factor * x * dist.get_rank()

    n = world.world_size
    assert world.run(times_rank, 2) == [14 * r for r in range(n)]
    assert world.run(lambda: dist.get_world_size() + factor) == [n + factor] * n


def _unpicklable():
    return threading.Lock()


def test_a_result_that_cannot_be_pickled_is_reported(world):
    results = world.run(_unpicklable, return_exceptions=True)
    for r in results:
        assert isinstance(r, RankFailure)
        assert "result could not be pickled" in r.message


def _stuck_in_a_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return "returned"


def test_a_collective_that_cannot_finish_times_out_instead_of_hanging():
    with World(2, timeout=5.0) as world:
        results = world.run(_stuck_in_a_collective, return_exceptions=True)
        assert results[1] == "returned"
        assert isinstance(results[0], RankFailure)
        assert world.restarts == 1
        assert world.run(_whoami, 0.0, scale=1.0) == [(0, 2, "0", 1.0), (1, 2, "1", 1.0)]


def test_world_needs_at_least_one_rank():
    with pytest.raises(ValueError, match="at least one rank"):
        World(0)


# --------------------------------------------------------------------------- backend, device, init hook


def _placement_seen():
    return dist.get_backend(), os.environ["LOCAL_RANK"], os.environ["MASTER_PORT"]


def test_the_default_world_is_gloo_on_the_cpu(world):
    assert (world.backend, world.device) == ("gloo", "cpu")
    assert repr(world) == f"World({world.world_size}, backend='gloo', device='cpu')"
    seen = world.run(_placement_seen)
    assert [s[:2] for s in seen] == [("gloo", str(r)) for r in range(world.world_size)]
    assert len({s[2] for s in seen}) == 1  # every rank names the same store, as under torchrun


def _variable_seen(name):
    return os.environ.get(name), os.getpid(), os.getppid()


def test_workers_see_the_environment_of_the_moment_their_pool_starts(monkeypatch):
    # Workers are forked from a fork server that took the environment of its own start;
    # a variable set since then must still reach the workers of a pool started after it.
    with World(2) as first:
        first.run(_variable_seen, "PATH")  # the fork server runs by now, whoever started it
        monkeypatch.setenv("ZEROFN_TEST_WORLD_VARIABLE", "set after the first pool")
        with World(2) as second:
            seen = second.run(_variable_seen, "ZEROFN_TEST_WORLD_VARIABLE")
    assert [value for value, _, _ in seen] == ["set after the first pool"] * 2
    assert all(parent != os.getpid() for _, _, parent in seen)  # forked by the server, not by pytest


def _kernels():
    return os.environ.get("ATEN_CPU_CAPABILITY"), torch.backends.cpu.get_cpu_capability()


def test_env_reaches_the_workers_only(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    with World(2, env={"ATEN_CPU_CAPABILITY": "default"}) as world:
        assert world.run(_kernels) == [("default", "DEFAULT")] * 2
    assert "ATEN_CPU_CAPABILITY" not in os.environ
    with pytest.raises(TypeError, match="env maps names to strings"):
        World(2, env={"ZEROFN_X": 1})


def test_the_suite_runs_its_pool_of_three_on_the_portable_kernels_and_the_others_on_this_machines(worlds):
    # tests/conftest.py: one pass of the suite sees two kernel families.
    from conftest import PORTABLE_KERNELS_AT

    assert PORTABLE_KERNELS_AT == 3
    native = torch.backends.cpu.get_cpu_capability()
    for n, world in worlds.items():
        seen = world.run(_kernels)
        if n == PORTABLE_KERNELS_AT:
            assert seen == [("default", "DEFAULT")] * n
        else:
            assert seen == [(os.environ.get("ATEN_CPU_CAPABILITY"), native)] * n
    with pytest.raises(RuntimeError, match="call it first"):  # made already: it may not change now
        plugin.pools().set_env(PORTABLE_KERNELS_AT, {})


_INIT_SEEN: dict = {}


def _init_hook(seed):
    """Runs once per worker after the group is up: a collective, a seed, a thread count."""
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    torch.manual_seed(seeded(seed + dist.get_rank()))
    torch.set_num_threads(2)
    _INIT_SEEN.update(pid=os.getpid(), rank=dist.get_rank(), sum=float(total), calls=_INIT_SEEN.get("calls", 0) + 1)


def _init_seen():
    return dict(_INIT_SEEN), os.getpid(), torch.initial_seed(), torch.get_num_threads()


def _raise_on_last_rank_in_init():
    if dist.get_rank() == dist.get_world_size() - 1:
        raise KeyError("missing setting on the last rank")


def test_init_hook_runs_once_on_every_rank_with_the_group_up_and_again_after_a_restart():
    import functools

    n = 2
    with World(n, init=functools.partial(_init_hook, 40)) as world:
        first = world.run(_init_seen)
        for rank, (seen, pid, seed, threads) in enumerate(first):
            assert seen == {"pid": pid, "rank": rank, "sum": n * (n + 1) / 2, "calls": 1}
            assert (seed, threads) == (seeded(40 + rank), 2)
        world.run(_all_reduce_ones)
        assert [r[0]["calls"] for r in world.run(_init_seen)] == [1] * n  # not once per run
        with pytest.raises(WorldError, match=r"\(pool restarted\)") as info:
            world.run(_die_on_last_rank)
        assert info.value.restarted and world.restarts == 1
        after = world.run(_init_seen)
        assert all(seen["pid"] == pid and seen["calls"] == 1 for seen, pid, *_ in after)
        assert {pid for _, pid, *_ in after}.isdisjoint(pid for _, pid, *_ in first)  # new workers, hook rerun


def test_init_hook_closures_travel_by_value_and_a_failing_hook_stops_the_start():
    seed = 1234  # captured by value: the workers cannot import this test's locals
    with World(1, init=lambda: torch.manual_seed(seeded(seed))) as world:
        assert world.run(torch.initial_seed) == [seeded(seed)]
    world = World(2, init=_raise_on_last_rank_in_init)
    with pytest.raises(WorldError, match=r"1 rank\(s\) failed in the init hook \(pool closed\)") as info:
        world.start()
    assert info.value.restarted and list(info.value.failures) == [1]
    failure = info.value.failures[1]
    assert failure.type_name == "KeyError" and "missing setting on the last rank" in failure.message
    assert "_raise_on_last_rank_in_init" in failure.traceback
    assert world._procs == []  # closed: nothing left running


def test_bad_backend_device_and_init_are_refused_before_anything_starts(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of \('gloo', 'nccl'\), got 'mpi'"):
        World(2, backend="mpi")
    with pytest.raises(ValueError, match=r"device must be one of \('cpu', 'cuda'\), got 'cuda:0'"):
        World(2, device="cuda:0")
    with pytest.raises(ValueError, match=r"backend='nccl' moves CUDA tensors only; use World\(n, backend='nccl', dev"):
        World(2, backend="nccl")
    with pytest.raises(TypeError, match="init must be a callable taking no arguments, got int"):
        World(2, init=3)
    # As on a machine without CUDA (this one, or CI), whatever this machine has.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend in ("gloo", "nccl"):
        with pytest.raises(RuntimeError, match=r"CUDA is not available in this Python .*use device='cpu' with"):
            World(1, backend=backend, device="cuda")
    # As on a machine with one GPU: NCCL cannot put two ranks on it, gloo can.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"World\(2, backend='nccl'\): NCCL needs one GPU per rank and 1 are visible"):
        World(2, backend="nccl", device="cuda")
    shared = World(2, backend="gloo", device="cuda")  # constructing starts nothing
    assert (shared.backend, shared.device, shared._procs) == ("gloo", "cuda", [])


# --------------------------------------------------------------------------- what a rank keeps between runs

_MODULE_GLOBAL: dict = {}


def _settings_and_draws():
    """Every global torch setting a pool puts back before a run, and the next draws of each generator."""
    return {
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "fill uninitialized": torch.utils.deterministic.fill_uninitialized_memory,
        "matmul precision": torch.get_float32_matmul_precision(),
        "denormal": float(torch.tensor([1e-40]) * 1.0),
        "mkldnn": torch.backends.mkldnn.enabled,
        "grad": torch.is_grad_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "torch draws": torch.randn(4).tolist(),
        "python draw": random.random(),
    }


def _change_every_setting_and_draw():
    """What a careless run may leave on its rank: every setting switched, every generator advanced."""
    _MODULE_GLOBAL["set by"] = "an earlier run"
    torch.randn(16)
    random.random()
    torch.set_num_threads(3)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.set_float32_matmul_precision("medium")
    torch.set_flush_denormal(True)
    torch.backends.mkldnn.enabled = False
    torch.set_grad_enabled(False)
    with warnings.catch_warnings():  # "Anomaly Detection has been enabled": the point here
        warnings.simplefilter("ignore")
        torch.set_anomaly_enabled(True, True)
    torch.set_autocast_enabled("cpu", True)
    torch.set_autocast_dtype("cpu", torch.float16)
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")


def _module_global():
    return _MODULE_GLOBAL.get("set by")


def test_every_run_starts_from_the_torch_settings_and_generators_of_the_pools_start():
    # Whatever a run leaves in torch's global state is put back before the next run on that
    # rank, so a result does not depend on which runs came first (under pytest-xdist, on how
    # the load spread the tests over the workers). Module globals are kept: that is the pool.
    with World(1, init=lambda: torch.manual_seed(seeded(5))) as world:
        first = world.run(_settings_and_draws)
        world.run(_change_every_setting_and_draw)
        assert world.run(_settings_and_draws) == first
        assert world.run(_module_global) == ["an earlier run"]
    (fresh,) = first
    assert (fresh["threads"], fresh["dtype"], fresh["device"], fresh["grad"]) == (
        1,
        torch.float32,
        torch.device("cpu"),
        True,
    )
    assert fresh["denormal"] > 0 and fresh["deterministic"] == (False, False) and fresh["autocast"][0] is False
