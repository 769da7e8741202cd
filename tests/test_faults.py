"""Faults: a rank that dies or stalls mid-step makes the others raise, never hang.

These tests use their own small ``World`` with a short process-group timeout, so a
collective that cannot complete fails in seconds; the shared pools are left alone. The
two share that ``World`` (each leaves it restarted, with fresh ranks).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Net, batches, seeded

import zerofn as zf
from zerofn.testing import RankFailure, World

TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def world():
    with World(2, timeout=TIMEOUT_S) as w:
        yield w


def _trained_facade(path: str) -> tuple[Net, zf.ZeroOptimizer]:
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True, module=model)
    data = batches(dist.get_rank(), 3)
    for _ in range(2):
        x, y = next(data)
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
    opt.save_checkpoint(path)
    x, y = next(data)
    opt.backward(((model(x) - y) ** 2).mean())
    return model, opt


def _fail_mid_step(path: str, how: str) -> dict[str, Any]:
    _, opt = _trained_facade(path)
    done = f"{path}.rank0-done"  # rank 0 writes it once its step has raised or returned
    if dist.get_rank() == 1:
        if how == "die":
            os._exit(9)  # gone between backward and step, as a crashed process would be
        # Stalls: never joins the step's collectives, until rank 0 is past them (so no
        # later than its group's timeout, however long that takes on a loaded machine).
        deadline = time.monotonic() + 2 * TIMEOUT_S + 30  # World's own limit for the run
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"outcome": "stalled"}
    try:
        opt.step()
        opt.zero_grad()
    except Exception as e:  # the collective's error, whatever its type
        return {"outcome": "raised", "error": f"{type(e).__name__}: {e}"}
    finally:
        open(done, "w").close()
    return {"outcome": "returned"}


def _load_step(path: str) -> int:
    torch.manual_seed(seeded(1))
    model = Net()
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True, module=model)
    opt.load_checkpoint(path)
    return opt.state.step


def test_a_rank_that_dies_mid_step_makes_the_others_raise_and_the_checkpoint_survives(world, tmp_path):
    path = str(tmp_path / "ckpt")
    restarts = world.restarts
    rank0, rank1 = world.run(_fail_mid_step, path, "die", return_exceptions=True)
    assert isinstance(rank1, RankFailure) and rank1.type_name == "WorkerDied"
    assert "exit code 9" in rank1.message
    # Raised, not hung: World stops waiting for an answer after 2 * TIMEOUT_S + 30 s,
    # so a rank stuck past the group's timeout fails the run (no clock of our own:
    # how long a raise takes depends on the machine's load).
    assert rank0["outcome"] == "raised", rank0
    assert world.restarts == restarts + 1  # the pool replaced the dead rank
    # The checkpoint written before the crash is intact and loads on fresh ranks.
    assert world.run(_load_step, path) == [2, 2]


def test_a_rank_that_stalls_makes_the_others_raise_within_the_timeout(world, tmp_path):
    path = str(tmp_path / "ckpt")
    rank0, rank1 = world.run(_fail_mid_step, path, "stall", return_exceptions=True)
    assert rank1 == {"outcome": "stalled"}
    assert rank0["outcome"] == "raised", rank0  # by the group's timeout: rank 1 never joined
    # Rank 0 caught the timeout itself, so the pool cannot tell its group is broken.
    world.restart()
    assert world.run(_load_step, path) == [2, 2]
