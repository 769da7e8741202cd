"""Checkpoints move between the GPU and the CPU: saved from CUDA state, loaded on the CPU and back.

A run trains on the GPU (one rank, NCCL) and saves; a CPU pool (gloo, one rank and two
ranks: the load reshards 1 -> 2) loads it and must hold exactly the saved state (every
master, moment and step, bit for bit, and the model weights), continues training on the
CPU and saves; the GPU pool loads that back, again bit for bit, with the state on the GPU.
Both formats: the sharded checkpoint (``zf.checkpoint.save`` / ``load``, the facade's
``save_checkpoint`` / ``load_checkpoint``) and the torch-format full state dict
(``ZeroOptimizer.state_dict()`` written with ``torch.save``, read back with
``load_state_dict``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gpucheck import ADAMW, BUCKET, base_model, device_here, get_world, on_cpu, requires_device
from helpers import assert_bitwise_equal, batches, gate_used
from torch.func import functional_call, grad

import zerofn as zf

pytestmark = requires_device

STEPS = 4


def _assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Nested dicts/lists with bitwise-equal tensors (dtype, shape, bytes) and equal leaves."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert_bitwise_equal(actual, expected, where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), (where, list(actual), list(expected))
        for k, v in expected.items():
            _assert_same(actual[k], v, f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, (where, actual, expected)


# --------------------------------------------------------------------------- functional API, sharded checkpoints


def _fit(state: zf.ZeroState, params: dict, model: torch.nn.Module, device: torch.device) -> tuple[Any, dict]:
    def loss(p: dict, x: torch.Tensor, y: torch.Tensor, use_gate: bool) -> torch.Tensor:
        return ((functional_call(model, p, (x,), {"use_gate": use_gate}) - y) ** 2).mean()

    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        use_gate = gate_used(step)
        grads = dict(grad(loss)(params, x.to(device), y.to(device), use_gate))
        for name in list(grads):  # no gradient this step, as autograd would leave it
            if name.startswith("unused.") or (name.startswith("gate.") and not use_gate):
                del grads[name]
        shards = zf.reduce_grads(grads, state.layout, bucket_numel=BUCKET)
        state, info = zf.step_shards(state, shards)
        assert not info.skipped
        params = zf.gather_params(state, bucket_numel=BUCKET)
    return state, params


def _fresh(device: str) -> tuple[torch.nn.Module, dict, torch.device]:
    dev = device_here(device)
    model = copy.deepcopy(base_model()).to(dev)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}, dev


def train_and_save(device: str, path: str) -> dict:
    """Train ``STEPS`` steps from the start on this pool's device, save; the full state (CPU)."""
    model, params, dev = _fresh(device)
    state, params = _fit(zf.shard_params(params, zf.optim.adamw(**ADAMW)), params, model, dev)
    zf.checkpoint.save(path, state, params=params)
    return on_cpu({"full": zf.checkpoint.full_state_dict(state), "params": params})


def load_continue_save(device: str, path: str, then_save: str | None) -> dict:
    """Load ``path`` here (any world size), report the loaded state, train on, save to ``then_save``."""
    model, params, dev = _fresh(device)
    with torch.no_grad():
        for p in params.values():
            p.zero_()  # the weights must come from the checkpoint
    state = zf.checkpoint.load(path, params, optimizer=zf.optim.adamw(**ADAMW), params_out=params)
    loaded = {
        "full": zf.checkpoint.full_state_dict(state),
        "params": {n: p.clone() for n, p in params.items()},
        "state_devices": sorted({str(t.device) for t in state.master.values()}),
    }
    if then_save is not None:
        state, params = _fit(state, params, model, dev)
        zf.checkpoint.save(then_save, state, params=params)
        loaded["after"] = {"full": zf.checkpoint.full_state_dict(state), "params": params}
    return on_cpu(loaded)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu-ckpt")


def test_sharded_checkpoint_from_the_gpu_loads_on_the_cpu_and_back(ckpt_dir: Path) -> None:
    gpu = get_world("nccl1")
    cpu1, cpu2 = get_world("cpu1"), get_world("cpu2")
    from_gpu, from_cpu = str(ckpt_dir / "from-gpu"), str(ckpt_dir / "from-cpu")
    (saved,) = gpu.run(train_and_save, gpu.device, from_gpu)
    assert saved["full"]["zerofn"]["step"] == STEPS
    # One CPU rank (continues and saves) and two (the load reshards 1 -> 2): the saved state exactly.
    (on_cpu1,) = cpu1.run(load_continue_save, "cpu", from_gpu, from_cpu)
    for loaded in [on_cpu1, *cpu2.run(load_continue_save, "cpu", from_gpu, None)]:
        _assert_same(loaded["full"], saved["full"])
        _assert_same(loaded["params"], saved["params"], "params")
        assert loaded["state_devices"] == ["cpu"]
    after = on_cpu1["after"]
    assert after["full"]["zerofn"]["step"] == 2 * STEPS
    # ... and back on the GPU: what the CPU saved, with the state on the GPU's device.
    (back,) = gpu.run(load_continue_save, gpu.device, from_cpu, None)
    _assert_same(back["full"], after["full"])
    _assert_same(back["params"], after["params"], "params")
    assert back["state_devices"] == (["cuda:0"] if gpu.device == "cuda" else ["cpu"])


# --------------------------------------------------------------------------- the facade, both formats


def _facade(device: str) -> tuple[torch.nn.Module, zf.ZeroOptimizer, torch.device]:
    model, _, dev = _fresh(device)
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), **ADAMW),
        partition_grad=True,
        overlap_communication=True,
        reduce_bucket_size=BUCKET,
        module=model,
    )
    return model, opt, dev


def facade_train_and_save(device: str, sharded: str, torch_file: str) -> dict:
    """The facade (stage 2, overlap) trains here and saves both formats; its state dict (CPU)."""
    model, opt, dev = _facade(device)
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        opt.backward(((model(x.to(dev), gate_used(step)) - y.to(dev)) ** 2).mean())
        opt.step()
        opt.zero_grad()
    opt.save_checkpoint(sharded)
    sd = opt.state_dict()
    if dist.get_rank() == 0:
        torch.save(sd, torch_file)
    dist.barrier()
    return on_cpu({"sd": sd, "params": {n: p.detach().clone() for n, p in model.named_parameters()}})


def facade_load(device: str, sharded: str | None, torch_file: str | None) -> dict:
    """A fresh facade here loads one format; its state dict and weights (CPU)."""
    model, opt, _ = _facade(device)
    if sharded is not None:
        opt.load_checkpoint(sharded)
    else:
        opt.load_state_dict(torch.load(torch_file, weights_only=False))
    sd = opt.state_dict()
    return on_cpu({"sd": sd, "params": {n: p.detach().clone() for n, p in model.named_parameters()}})


def test_facade_checkpoints_from_the_gpu_load_into_a_cpu_facade(ckpt_dir: Path) -> None:
    gpu, cpu2 = get_world("nccl1"), get_world("cpu2")
    sharded, torch_file = str(ckpt_dir / "facade-sharded"), str(ckpt_dir / "facade.pt")
    (saved,) = gpu.run(facade_train_and_save, gpu.device, sharded, torch_file)
    assert saved["sd"]["zerofn"]["step"] == STEPS
    for loaded in cpu2.run(facade_load, "cpu", sharded, None):
        _assert_same(loaded["sd"], saved["sd"])
        _assert_same(loaded["params"], saved["params"], "params")  # the weights came along
    for loaded in cpu2.run(facade_load, "cpu", None, torch_file):
        _assert_same(loaded["sd"], saved["sd"])
    (back,) = gpu.run(facade_load, gpu.device, None, torch_file)
    _assert_same(back["sd"], saved["sd"])
