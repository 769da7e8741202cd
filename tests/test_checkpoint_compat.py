"""Checkpoints written by earlier zerofn releases still load.

``tests/data/v1_adamw_n2`` was written by :func:`write_fixture` below with zerofn at
commit 3c097a1 (the single-module ``zerofn/checkpoint.py``, format version 1), at world
size 2: an AdamW state after two steps, the model's weights and one buffer. It is loaded
here at world sizes 1 and 2 and compared with plain ``torch.optim.AdamW`` driven by the
same gradients (identical on every rank, so their mean is exact: the arithmetic is torch's).

``tests/data/v2_partition_bf16_n2`` was written by :func:`write_v2_fixture` with zerofn at
commit 291b8ce (the same format version 1, from code that held one tensor per param in
every piece of state), at world size 2:
bfloat16 params from float32 masters under a dynamic loss scaler, SGD with momentum on one
param and AdamW with two param groups on the others (a ``partition``), three steps, one
param of odd length (padding at two ranks). A run that loads it and takes two more steps
must end bitwise where the run that never stopped ends, at world sizes 1 and 2: whatever
changes in how a rank holds its state, the bits it computes from a saved one may not.
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


V2_FIXTURE = os.path.join(os.path.dirname(__file__), "data", "v2_partition_bf16_n2")
V2_SHAPES = {"w": (6, 4), "b": (5,), "odd": (7,)}
V2_SAVED_AT, V2_STEPS = 3, 5


def _v2_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)  # fixed, as the v1 seeds: the fixture was written from them
    return {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in V2_SHAPES.items()}


def _v2_optimizer() -> zf.optim.Optimizer:
    adamw = zf.optim.adamw(
        lr=1e-2, weight_decay=0.1, param_groups=[{"params": ["odd"], "lr": 3e-3, "weight_decay": 0.0}]
    )
    return zf.optim.partition([(["b"], zf.optim.sgd(lr=0.1, momentum=0.9)), (lambda name: True, adamw)])


def _v2_precision() -> zf.PrecisionPolicy:
    scaler = zf.DynamicLossScaler(initial_scale=2.0**8, growth_interval=2)
    return zf.PrecisionPolicy(param_dtype=torch.bfloat16, loss_scaler=scaler)


def _v2_train(state: zf.ZeroState, first: int, last: int) -> zf.ZeroState:
    """Steps ``first`` to ``last - 1``: the same gradients on every rank (their mean at 1 or 2
    ranks is exact), carrying the loss scale as a scaled loss's gradients would."""
    for step in range(first, last):
        gen = torch.Generator().manual_seed(200 + step)
        scale = float(state.loss_scale.scale)  # a power of two: scaling is exact
        grads = {n: (torch.randn(s, generator=gen) * scale).to(torch.bfloat16) for n, s in V2_SHAPES.items()}
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout, precision=state.precision))
    return state


def write_v2_fixture(path: str) -> None:
    """On every rank of a world of 2: the run the v2 fixture holds (kept to document it)."""
    state = zf.shard_params(_v2_params(), _v2_optimizer(), precision=_v2_precision())
    state = _v2_train(state, 0, V2_SAVED_AT)
    zf.checkpoint.save(path, state, params=zf.gather_params(state), buffers={"running": torch.arange(3.0)})


def _bits(state: zf.ZeroState) -> dict[str, Any]:
    """Everything a rank's run ends with, as exact values: the full state dict's tensors
    (a collective), the gathered params, the step count and the loss-scale state."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).view(torch.uint8).clone()

    leaves, _ = torch.utils._pytree.tree_flatten(zf.checkpoint.full_state_dict(state))
    return {
        "full": [raw(t) if isinstance(t, torch.Tensor) else t for t in leaves],
        "params": {n: raw(p) for n, p in zf.gather_params(state).items()},
        "numbers": [float(state.step), *(float(v) for v in state.loss_scale)],
    }


def _resumed_and_uninterrupted(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in V2_SHAPES.items()}
    buffers = {"running": torch.zeros(3)}
    loaded = zf.checkpoint.load(
        path, params, optimizer=_v2_optimizer(), precision=_v2_precision(), params_out=params, buffers_out=buffers
    )
    assert torch.equal(buffers["running"], torch.arange(3.0))
    assert int(loaded.step) == V2_SAVED_AT and float(loaded.loss_scale.scale) == 2.0**9  # grew once, at step 2
    resumed = _v2_train(loaded, V2_SAVED_AT, V2_STEPS)
    never_stopped = _v2_train(zf.shard_params(_v2_params(), _v2_optimizer(), precision=_v2_precision()), 0, V2_STEPS)
    return _bits(resumed), _bits(never_stopped)


def test_a_version_2_checkpoint_resumes_bitwise_as_the_run_that_never_stopped(tmp_path):
    target = tmp_path / "v2.old"
    shutil.copytree(V2_FIXTURE, target)
    os.symlink(target.name, tmp_path / "v2")
    for n in (1, 2):
        for resumed, never_stopped in get_world(n).run(_resumed_and_uninterrupted, str(tmp_path / "v2")):
            assert resumed["numbers"] == never_stopped["numbers"], n
            assert resumed["params"].keys() == never_stopped["params"].keys()
            assert all(torch.equal(resumed["params"][k], never_stopped["params"][k]) for k in resumed["params"]), n
            assert len(resumed["full"]) == len(never_stopped["full"])
            for a, b in zip(resumed["full"], never_stopped["full"], strict=True):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, n
