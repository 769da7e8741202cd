"""The training state beside the optimizer's: ``extra=`` objects and every rank's RNG.

Round trip at N = 2 through the facade (an LR scheduler and a counter, RNG-driven data,
so the run after a load is bitwise the run after the save); all or nothing (a save with a
non-Stateful object on one rank; a load with a missing or unknown key, or a
``load_state_dict`` that raises on one rank: every rank raises, nothing changed, the
checkpoint still the last good one); the N -> M rule (rank-invariant extras and RNG
restore, per-rank ones do not).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import get_world
from helpers import seeded

import zerofn as zf


class Counter:
    """A user's stateful object (the Stateful protocol); on ``fail_on`` ranks it refuses to go back."""

    def __init__(self, value: int = 0, fail_on: tuple[int, ...] = ()) -> None:
        self.value, self.fail_on = value, fail_on

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        going_back = state["value"] < self.value
        self.value = state["value"]  # changed before it fails: the load must put it back
        if dist.get_rank() in self.fail_on and going_back:
            raise ValueError("this counter refuses to go back")


def _draws() -> list[float]:
    """One draw from each generator a checkpoint keeps."""
    return [torch.rand(()).item(), random.random(), float(np.random.rand())]


def _setup(seed: int) -> tuple[torch.nn.Module, zf.ZeroOptimizer, Any]:
    torch.manual_seed(seeded(0))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True, module=model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    torch.manual_seed(seeded(seed))  # per-rank generators: each rank draws its own data
    random.seed(seeded(seed))
    np.random.seed(seeded(seed))
    return model, opt, sched


def _train(model: torch.nn.Module, opt: zf.ZeroOptimizer, sched: Any, counter: Counter, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 6) + random.random() + float(np.random.rand())  # every generator feeds the data
        F.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        counter.value += 1


def _snapshot(model: torch.nn.Module, sched: Any, counter: Counter) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "sched": sched.state_dict(),
        "counter": counter.value,
    }


def _round_trip(path: str) -> dict[str, Any]:
    model, opt, sched = _setup(seed=10 + dist.get_rank())
    counter = Counter()
    _train(model, opt, sched, counter, 3)
    opt.save_checkpoint(path, extra={"sched": sched, "counter": counter})
    saved = _snapshot(model, sched, counter)
    draws_after_save = _draws()
    _train(model, opt, sched, counter, 2)  # the run that never stopped
    never_stopped = _snapshot(model, sched, counter)
    opt.load_checkpoint(path, extra={"sched": sched, "counter": counter})
    loaded = _snapshot(model, sched, counter)
    lr_after_load = opt.param_groups[0]["lr"]
    draws_after_load = _draws()
    # The draws above moved the generators as the ones after the save did: the same run again.
    _train(model, opt, sched, counter, 2)
    return {
        "saved": saved,
        "loaded": loaded,
        "lr_after_load": lr_after_load,
        "draws": (draws_after_save, draws_after_load),
        "never_stopped": never_stopped,
        "resumed": _snapshot(model, sched, counter),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["sched"] == b["sched"] and a["counter"] == b["counter"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def test_extras_and_rng_restore_at_the_same_world_size_and_the_run_continues_bitwise(tmp_path):
    results = get_world(2).run(_round_trip, str(tmp_path / "ckpt"))
    for r in results:
        _assert_same(r["loaded"], r["saved"])
        assert r["loaded"]["counter"] == 3 and r["loaded"]["sched"]["last_epoch"] == 3
        assert r["lr_after_load"] == 1e-2 * 0.5  # StepLR halved it once in 3 steps; the optimizer agrees
        after_save, after_load = r["draws"]
        assert after_load == after_save
        _assert_same(r["resumed"], r["never_stopped"])
    assert results[0]["draws"][0] != results[1]["draws"][0]  # the ranks' generators differ, each restored


def _all_or_nothing(path: str) -> dict[str, str]:
    model, opt, sched = _setup(seed=20 + dist.get_rank())
    counter = Counter(fail_on=(1,))
    _train(model, opt, sched, counter, 2)
    opt.save_checkpoint(path, extra={"sched": sched, "counter": counter})
    _train(model, opt, sched, counter, 1)
    before = _snapshot(model, sched, counter)
    rng_before = torch.get_rng_state()
    errors = {}
    # A save with an object that is not Stateful (on one rank only) raises on every rank and writes nothing.
    with pytest.raises(zf.CheckpointError) as info:
        opt.save_checkpoint(path, extra={"sched": sched, "counter": object() if dist.get_rank() == 1 else counter})
    errors["save"] = str(info.value)
    for case, extra in {
        "missing": {"sched": sched, "counter": counter, "loader": Counter()},
        "unknown": {"sched": sched},
        "raises": {"sched": sched, "counter": counter},
    }.items():
        with pytest.raises(zf.CheckpointError) as info:
            opt.load_checkpoint(path, extra=extra)
        errors[case] = str(info.value)
        _assert_same(_snapshot(model, sched, counter), before)
        assert torch.equal(torch.get_rng_state(), rng_before)
        assert opt.state_dict()["zerofn"]["step"] == 3
    return errors


def test_a_load_with_other_extras_or_a_failing_extra_raises_on_every_rank_and_changes_nothing(tmp_path):
    for rank, errors in enumerate(get_world(2).run(_all_or_nothing, str(tmp_path / "ckpt"))):
        assert "rank 1 could not save its extras" in errors["save"] and "no state_dict()" in errors["save"]
        assert "holds no extra 'loader'" in errors["missing"]
        assert "holds extra 'counter', which extra= does not name" in errors["unknown"]
        if rank == 1:
            assert "extra['counter'].load_state_dict failed" in errors["raises"], errors["raises"]
        else:
            assert "rank 1 could not load its extras, so no rank did" in errors["raises"], errors["raises"]


def _save_functional(path: str, same_seed: bool) -> list[float]:
    state = zf.shard_params({"w": torch.ones(5)}, zf.optim.sgd(lr=0.1))
    seed = 5 if same_seed else 5 + dist.get_rank()
    torch.manual_seed(seeded(seed))
    random.seed(seeded(seed))
    np.random.seed(seeded(seed))
    extra = {"shared": Counter(7), "per_rank": Counter(dist.get_rank())}
    zf.checkpoint.save(path, state, extra=extra)
    return _draws()


def _load_at_another_world_size(path: str, same_seed: bool) -> dict[str, Any]:
    like = {"w": torch.zeros(5)}
    torch.manual_seed(seeded(99))
    with pytest.raises(zf.CheckpointError) as info:
        zf.checkpoint.load(path, like, extra={"shared": Counter(), "per_rank": Counter()})
    shared = Counter()
    rng_before = torch.get_rng_state()
    zf.checkpoint.load(path, like, extra={"shared": shared})
    restored = not torch.equal(torch.get_rng_state(), rng_before)
    return {"error": str(info.value), "shared": shared.value, "rng_restored": restored, "draws": _draws()}


@pytest.mark.parametrize("same_seed", [False, True], ids=["rng_per_rank", "rng_alike"])
def test_at_another_world_size_only_state_that_was_the_same_on_every_rank_restores(tmp_path, same_seed):
    path = str(tmp_path / "ckpt")
    draws = get_world(2).run(_save_functional, path, same_seed)
    (out,) = get_world(1).run(_load_at_another_world_size, path, same_seed)
    assert "extra 'per_rank' differed between the 2 ranks" in out["error"] and "world size 2, not 1" in out["error"]
    assert out["shared"] == 7
    assert out["rng_restored"] == same_seed
    if same_seed:
        assert out["draws"] == draws[0] == draws[1]
