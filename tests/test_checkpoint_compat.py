"""Checkpoints written by earlier zerofn releases still load.

``tests/data/v1_adamw_n2`` was written by :func:`write_fixture` below with zerofn at
commit 3c097a1 (the single-module ``zerofn/checkpoint.py``, format version 1), at world
size 2: an AdamW state after two steps, the model's weights and one buffer. It is loaded
here at world sizes 1 and 2 and compared with plain ``torch.optim.AdamW`` driven by the
same gradients (identical on every rank, so their mean is exact: the arithmetic is torch's).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from conftest import get_world
from helpers import tensor_rel_diff

import zerofn as zf

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "v1_adamw_n2")
SHAPES = {"w": (3, 4), "b": (5,)}
STEPS = 2


# The fixture on disk was written from these seeds, so the seed knob (ZEROFN_TEST_SEED)
# must not move them: the run that continues it has to be the run that wrote it.
def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def write_fixture(path: str) -> None:
    """On every rank of a world of 2: the run the fixture holds (kept to document it)."""
    params = _params()
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2, weight_decay=0.1))
    for step in range(STEPS):
        state, _ = zf.step_shards(state, zf.reduce_grads(_grads(step), state.layout))
    zf.checkpoint.save(path, state, params=zf.gather_params(state), buffers={"running": torch.arange(3.0)})


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The same run on plain torch.optim.AdamW: (params, per-param state)."""
    params = {n: p.clone().requires_grad_(True) for n, p in _params().items()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        for n, g in _grads(step).items():
            params[n].grad = g
        opt.step()
    return {n: p.detach() for n, p in params.items()}, {n: opt.state[p] for n, p in params.items()}


def _load_fixture(path: str) -> dict[str, Any]:
    """Load the fixture on this rank; the largest relative differences from the reference, and the
    dtypes of the loaded state's numbers (the file holds Python numbers; the state 0-d tensors)."""
    model = {n: torch.zeros(s) for n, s in SHAPES.items()}
    buffers = {"running": torch.zeros(3)}
    state = zf.checkpoint.load(path, model, params_out=model, buffers_out=buffers)
    full = zf.checkpoint.full_state_dict(state)
    ref_params, ref_state = _reference()
    names = full["zerofn"]["names"]
    out = {"step": float(state.step), "buffer": float((buffers["running"] - torch.arange(3.0)).abs().max())}
    numbers = (state.step, *state.loss_scale)
    out["numbers"] = [(str(t.dtype), t.dim()) if isinstance(t, torch.Tensor) else type(t).__name__ for t in numbers]
    for i, n in enumerate(names):
        out[f"param/{n}"] = tensor_rel_diff(model[n], ref_params[n])
        out[f"master/{n}"] = tensor_rel_diff(full["zerofn"]["master"][n], ref_params[n])
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{key}/{n}"] = tensor_rel_diff(full["state"][i][key], ref_state[n][key])
    return out


def test_a_version_1_checkpoint_from_before_the_package_loads_at_any_world_size(tmp_path):
    # Loading needs a writable copy: zerofn manages the path as a symlink to a directory.
    target = tmp_path / "v1.old"
    shutil.copytree(FIXTURE, target)
    os.symlink(target.name, tmp_path / "v1")
    for n in (1, 2):
        for diffs in get_world(n).run(_load_fixture, str(tmp_path / "v1")):
            assert diffs.pop("step") == STEPS
            assert diffs.pop("numbers") == [
                ("torch.int64", 0),
                ("torch.float64", 0),
                ("torch.int64", 0),
                ("torch.int64", 0),
            ]
            assert all(d <= 1e-6 for d in diffs.values()), diffs
