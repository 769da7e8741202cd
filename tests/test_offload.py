"""CPU offload: master shards and optimizer state live on the policy's state device.

``PrecisionPolicy(state_device="cpu")`` (the facade's ``cpu_offload=True``) keeps every
master shard and optimizer-state tensor on the CPU: ``step_shards`` moves the gradient
shards there before the update and ``gather_params`` moves the updated shards back to the
params' device. On CUDA the copies go through pinned buffers without blocking; this
machine has no accelerator, so the params' device *is* the CPU and offload runs the same
code with nothing to move. What is checked here, then:

* offloaded training is bitwise equal to the same training without offload (functional
  API and facade, fp16 with loss scaling and bf16, both stages, world sizes 1 to 4), and
  every master and optimizer-state tensor is on the CPU, the gathered params on the
  params' device;
* placement is real, not a no-op: with ``state_device="meta"`` (a device the computation
  never uses) shard and step put every master and state tensor there, and the update runs
  there: AdamW's kernel refuses gradients on another device, so the gradient shards did
  move before the update (the gather back needs data, which meta tensors lack);
* the copy each pair of devices gets (``zerofn._placement.copy_kind``): pinned and
  non-blocking between CUDA and the CPU, none between equal devices.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from helpers import Net, assert_trees_equal, batches, gate_used, seeded
from torch.func import functional_call, grad

import zerofn as zf
from zerofn import _placement
from zerofn.precision import DynamicLossScaler, PrecisionPolicy

STEPS = 6
BUCKET = 128


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _loss(params, model, x, y, use_gate, loss_scale):
    out = functional_call(model, params, (x,), {"use_gate": use_gate})
    return zf.scale_loss(((out - y) ** 2).mean(), loss_scale)


def _functional(dtype: torch.dtype, stage: int, offload: bool) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net().to(dtype)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    scaler = DynamicLossScaler(initial_scale=2.0**14, growth_interval=2) if dtype == torch.float16 else None
    policy = PrecisionPolicy.for_dtype(dtype, state_device="cpu" if offload else None)
    if scaler is not None:
        policy = policy.replace(loss_scaler=scaler)
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=policy)
    state_devices, param_devices, skipped = set(), set(), 0
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        use_gate = gate_used(step)
        g = dict(grad(_loss)(params, model, x.to(dtype), y.to(dtype), use_gate, state.loss_scale))
        del g["unused.weight"], g["unused.bias"]
        if not use_gate:
            del g["gate.weight"], g["gate.bias"]
        shards = zf.reduce_grads(g, state.layout, stage=stage, bucket_numel=BUCKET, precision=state.precision)
        state, info = zf.step_shards(state, shards, max_norm=0.5)
        skipped += info.skipped
        state_devices |= {str(t.device) for t in _tensors((state.master, state.opt_state))}
        params = zf.gather_params(state, bucket_numel=BUCKET)
        param_devices |= {str(t.device) for t in params.values()}
    return {
        "params": params,
        "state": _tensors((state.master, state.opt_state)),
        "loss_scale": state.loss_scale,
        "step": state.step,
        "skipped": skipped,
        "state_devices": state_devices,
        "param_devices": param_devices,
        "recorded": (state.precision.state_device, state.param_device, str(state.state_device), str(state.work_device)),
    }


def _facade(dtype: torch.dtype, stage: int, offload: bool) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        forced_dtype=dtype,
        cpu_offload=offload,
        partition_grad=stage == 2,
        overlap_communication=stage == 2,
        clip_grad_norm=0.5,
        initial_scale=2.0**14,
        growth_interval=2,
        reduce_bucket_size=BUCKET,
        module=model,
    )
    state_devices = set()
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        opt.backward(((model(x.to(dtype), gate_used(step)) - y.to(dtype)) ** 2).mean())
        opt.step()
        opt.zero_grad()
        state_devices |= {str(t.device) for t in _tensors((opt.state.master, opt.state.opt_state))}
    return {
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "state": _tensors((opt.state.master, opt.state.opt_state)),
        "loss_scale": opt.state.loss_scale,
        "step": opt.state.step,
        "state_devices": state_devices,
        "param_devices": {str(p.device) for p in model.parameters()},
        "cpu_offload": opt.precision.cpu_offload,
    }


CONFIGS = [(dtype, stage) for dtype in (torch.float16, torch.bfloat16) for stage in (1, 2)]


def _both(api: str) -> list[dict[str, Any]]:
    train = _functional if api == "functional" else _facade
    return [{"off": train(d, s, True), "on_device": train(d, s, False)} for d, s in CONFIGS]


@pytest.mark.parametrize("api", ["functional", "facade"])
def test_offload_is_bitwise_equal_to_no_offload_and_keeps_the_state_on_the_cpu(world, api):
    results = world.run(_both, api)
    for rank_results in results:
        for (dtype, stage), r in zip(CONFIGS, rank_results, strict=True):
            label = f"N={world.world_size} {api} {dtype} stage{stage}"
            off, ref = r["off"], r["on_device"]
            assert_trees_equal(off["params"], ref["params"])
            assert len(off["state"]) == len(ref["state"]) > 0
            for a, b in zip(off["state"], ref["state"], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), label
            assert off["loss_scale"] == ref["loss_scale"] and off["step"] == ref["step"], label
            assert off["state_devices"] == {"cpu"}, label
            assert off["param_devices"] == {"cpu"}, label
            assert all(p.dtype == dtype for p in off["params"].values()), label
            if api == "functional":
                assert off["recorded"] == ("cpu", "cpu", "cpu", "cpu"), label
                assert ref["recorded"] == (None, "cpu", "cpu", "cpu"), label
                if dtype == torch.float16:
                    assert off["skipped"] == ref["skipped"]
            else:
                assert off["cpu_offload"] and not ref["cpu_offload"], label


def _state_on_meta() -> dict[str, Any]:
    params = {k: p.detach() for k, p in Net().named_parameters()}
    policy = PrecisionPolicy.for_dtype(torch.bfloat16, state_device="meta")
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=policy)
    after_shard = {str(t.device) for t in state.master.values()}
    gen = torch.Generator().manual_seed(seeded(dist.get_rank()))
    grads = {k: torch.randn(p.shape, generator=gen).bfloat16() for k, p in params.items()}
    shards = zf.reduce_grads(grads, state.layout, precision=state.precision)
    new, info = zf.step_shards(state, shards)
    steps = new.opt_state.step  # torch keeps Adam's step counter on the CPU (not fused)
    moments = _tensors((new.master, new.opt_state.exp_avg, new.opt_state.exp_avg_sq))
    return {
        "after_shard": after_shard,
        "after_step": {str(t.device) for t in moments},
        "step_counters": {str(t.device) for t in steps.values()},
        "grad_devices": {str(t.device) for t in shards.values()},
        "info": info,
        "work_device": str(new.work_device),
        "step": new.step,
    }


def test_the_update_runs_on_the_state_device(worlds):
    for r in worlds[2].run(_state_on_meta):
        assert r["after_shard"] == r["after_step"] == {"meta"}
        assert r["step_counters"] == {"cpu"}
        assert r["grad_devices"] == {"cpu"} and r["work_device"] == "cpu"
        assert r["step"] == 1 and not r["info"].skipped and math.isfinite(r["info"].grad_norm)


def test_copy_kinds_between_devices():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _placement.copy_kind(cuda, cpu) == "to_host_pinned"
    assert _placement.copy_kind(cpu, cuda) == "from_host_pinned"
    assert _placement.copy_kind(cpu, cpu) == "none"
    assert _placement.copy_kind(cuda, torch.device("cuda", 0)) == "none"
    assert _placement.copy_kind(cpu, torch.device("meta")) == "plain"


def test_placement_moves_nothing_between_equal_devices_and_copies_otherwise():
    tensors = {"a": torch.arange(3.0), "b": torch.ones(2)}
    same = _placement.to_device(tensors, torch.device("cpu"))
    assert all(same[k] is tensors[k] for k in tensors)
    moved = _placement.to_device(tensors, torch.device("meta"))
    assert all(t.device.type == "meta" and t.shape == tensors[k].shape for k, t in moved.items())
    row = _placement.cat_to([tensors["a"], tensors["b"]], torch.device("cpu"))
    assert torch.equal(row, torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0]))
    assert row.data_ptr() not in (tensors["a"].data_ptr(), tensors["b"].data_ptr())
