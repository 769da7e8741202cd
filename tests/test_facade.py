"""ZeroOptimizer against DDP + the same torch optimizer, on real gloo ranks.

Tolerance: fp32, max relative param difference (``helpers.max_rel_diff``) <= 1e-6 after
20+ steps, or, where this machine's noise floor is above it, ``helpers.FLOOR_FACTOR`` times
the floor measured in the same run (``helpers.ddp_noise_floor``: DDP against DDP with
other last bits in its averaged gradients, at 3+ ranks and with clipping). At N = 1
and 2 without clipping the facade is *bitwise* equal to DDP: both
multiply by 1/N before summing and a sum of two numbers does not depend on order. At N = 3
and 4 gloo's ring adds the ranks' contributions in another order than DDP's bucket does;
with clipping, torch computes the norm in fp32 and zerofn in float64.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import math
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import (
    Net,
    assert_trees_equal,
    assert_within_floor,
    batches,
    ddp_noise_floor,
    ddp_reference,
    gate_used,
    seeded,
)

import zerofn as zf
from zerofn.facade._reducer import ShardedGrad

PARITY = 1e-6
STEPS = 21


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups: weights (decayed, lr from defaults) and biases (own lr, no decay)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": 3e-3, "weight_decay": 0.0}]


def _torch_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    groups = _groups(model)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.01)
    cls = getattr(torch.optim, kind)
    for g in groups:
        g.pop("weight_decay", None)
    return cls(groups, lr=1e-3)


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


_DDP_TWINS: dict[tuple, tuple[dict[str, torch.Tensor], float]] = {}


def _make_scheduler(scheduler: str | None, steps: int) -> Any:
    if scheduler == "step":
        return functools.partial(torch.optim.lr_scheduler.StepLR, step_size=4, gamma=0.5)
    if scheduler == "onecycle":
        return functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=2e-2, total_steps=steps)
    return None


def _ddp_twin(kind: str, clip: float, accumulate: int, scheduler: str | None, steps: int) -> tuple[dict, float]:
    """DDP's params (``helpers.ddp_reference``) and this machine's noise floor for one
    configuration, computed once per rank process: the facade's stage, overlap and bucket
    size do not change what DDP does."""
    key = (dist.get_world_size(), kind, clip, accumulate, scheduler, steps)
    if key not in _DDP_TWINS:
        torch.manual_seed(seeded(0))
        model = Net()
        options = dict(
            steps=steps, accumulate=accumulate, clip=clip or None, scheduler=_make_scheduler(scheduler, steps)
        )
        make_optimizer = functools.partial(_torch_optimizer, kind)
        data = functools.partial(batches, dist.get_rank(), steps * accumulate)
        ref = ddp_reference(model, make_optimizer, data(), **options)["params"]
        _DDP_TWINS[key] = ref, ddp_noise_floor(model, make_optimizer, data, ref, **options)
    return _DDP_TWINS[key]


def _train_pair(
    *,
    stage: int = 2,
    overlap: bool = False,
    clip: float = 0.0,
    kind: str = "adamw",
    accumulate: int = 1,
    scheduler: str | None = None,
    steps: int = STEPS,
    bucket: int = 64,
) -> dict[str, Any]:
    """Train the same Net under the facade and under DDP (``helpers.ddp_reference``) on this rank's batches."""
    ref, floor = _ddp_twin(kind, clip, accumulate, scheduler, steps)
    torch.manual_seed(seeded(0))
    model = Net()
    make_scheduler = _make_scheduler(scheduler, steps)
    zopt = zf.ZeroOptimizer(
        _torch_optimizer(kind, model),
        partition_grad=stage == 2,
        overlap_communication=overlap,
        clip_grad_norm=clip,
        reduce_bucket_size=bucket,
        module=model,
    )
    scheds = [make_scheduler(zopt)] if make_scheduler is not None else []
    data = batches(dist.get_rank(), steps * accumulate)
    no_sync_bytes = 0
    for step in range(steps):
        use_gate = gate_used(step)
        for micro in range(accumulate):
            x, y = next(data)
            last = micro == accumulate - 1
            with zopt.no_sync() if not last else contextlib.nullcontext(), zf.count_bytes() as counter:
                zopt.backward(((model(x, use_gate) - y) ** 2).mean())
            if not last:
                no_sync_bytes += counter.bytes_sent
        zopt.step()
        zopt.zero_grad()
        for s in scheds:
            s.step()
    return {"zero": _named(model), "ref": ref, "floor": floor, "no_sync_bytes": no_sync_bytes}


def _assert_parity(res: dict[str, Any], what: Any) -> None:
    assert_within_floor(res["zero"], res["ref"], res["floor"], rel=PARITY, what=str(what))


def _train_matrix(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_train_pair(**cfg) for cfg in configs]


@pytest.mark.numerics
def test_facade_matches_ddp_for_both_stages_with_and_without_overlap_and_clipping(world):
    configs = [{"stage": s, "overlap": o, "clip": c} for s in (1, 2) for o in (False, True) for c in (0.0, 0.05)]
    results = world.run(_train_matrix, configs)
    for rank_results in results:
        for cfg, res in zip(configs, rank_results, strict=True):
            _assert_parity(res, cfg)
            if world.world_size <= 2 and not cfg["clip"]:
                assert_trees_equal(res["zero"], res["ref"])
    # Every rank ends with the same params.
    for rank_results in results[1:]:
        for mine, first in zip(rank_results, results[0], strict=True):
            assert_trees_equal(mine["zero"], first["zero"])
    # Stage 1 / 2 and overlap on / off send identical buffers: bitwise-equal params.
    by_cfg = {tuple(cfg.values()): res["zero"] for cfg, res in zip(configs, results[0], strict=True)}
    for clip in (0.0, 0.05):
        base = by_cfg[(1, False, clip)]
        for stage in (1, 2):
            for overlap in (False, True):
                assert_trees_equal(by_cfg[(stage, overlap, clip)], base)


@pytest.mark.numerics
def test_gradient_accumulation_under_no_sync_matches_ddp_and_sends_nothing(world):
    configs = [{"stage": s, "overlap": o, "accumulate": 3, "steps": 8} for s in (1, 2) for o in (False, True)]
    for rank_results in world.run(_train_matrix, configs):
        for cfg, res in zip(configs, rank_results, strict=True):
            assert res["no_sync_bytes"] == 0, cfg
            _assert_parity(res, cfg)


@pytest.mark.numerics
@pytest.mark.parametrize("scheduler", ["step", "onecycle"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_torch_lr_scheduler_drives_the_facade_like_plain_torch(worlds, scheduler, kind):
    for res in worlds[3].run(_train_pair, kind=kind, scheduler=scheduler, steps=12):
        _assert_parity(res, (kind, scheduler))


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam"])
def test_generic_path_optimizers_match_torch(worlds, kind):
    for n in (2, 3):
        for res in worlds[n].run(_train_pair, kind=kind, stage=2, overlap=True, steps=12):
            _assert_parity(res, (n, kind))


def _functional_vs_torch_constructor() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    outs = []
    for build in ("torch", "functional"):
        torch.manual_seed(seeded(0))
        model = Net()
        if build == "torch":
            opt = zf.ZeroOptimizer(_torch_optimizer("adamw", model), partition_grad=True, module=model)
        else:
            biases = [n for n, _ in model.named_parameters() if n.endswith("bias")]
            fopt = zf.optim.adamw(
                lr=1e-2, weight_decay=0.1, param_groups=[{"params": biases, "lr": 3e-3, "weight_decay": 0.0}]
            )
            opt = zf.ZeroOptimizer(model.named_parameters(), fopt, partition_grad=True)
        for x, y in batches(dist.get_rank(), 6):
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
        outs.append(_named(model))
    return outs[0], outs[1]


def test_named_params_with_a_functional_optimizer_equal_the_wrapped_torch_optimizer(worlds):
    for via_torch, via_functional in worlds[2].run(_functional_vs_torch_constructor):
        assert_trees_equal(via_functional, via_torch)


# --------------------------------------------------------------------------- communication


def _count_step_bytes(policy: str, stage: int, bucket: int) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    pol = zf.CommPolicy.byte_optimal() if policy == "byte_optimal" else zf.CommPolicy()
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters()), partition_grad=stage == 2, reduce_bucket_size=bucket, comm_policy=pol
    )
    x, y = next(batches(dist.get_rank(), 1))
    with zf.count_bytes() as counter:
        # `unused` never gets a gradient: the layer-drop path is in the count too.
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
    layout = opt.state.layout
    return {
        "by": dict(counter.by_collective),
        "buckets": [(b.names, b.shard_numel) for b in layout.buckets(bucket)],
        "reduced": [
            b.shard_numel for b in layout.buckets(bucket) if not set(b.names) <= {"unused.weight", "unused.bias"}
        ],
    }


@pytest.mark.parametrize("policy", ["default", "byte_optimal"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_counted_bytes_equal_the_formula_of_the_realisation_in_use(worlds, n, policy):
    """Per step and rank: reduce + gather bucket bytes exactly; O(1) extras separately.

    With S = a bucket's row (its params' shard_numel summed), b = 4 bytes:
    all-reduce 2(N-1)S·b, reduce-scatter (N-1)S·b, all-gather (N-1)S·b, N broadcasts
    (each rank the root of one) (N-1)S·b. The byte-optimal pair thus sends
    2(N-1)/N · Ψ_padded · b, the gloo default 3(N-1)/N · Ψ_padded · b.
    """
    bucket = 200
    for stage in (1, 2):
        for res in worlds[n].run(_count_step_bytes, policy, stage, bucket):
            reduced = sum(res["reduced"])  # buckets with a gradient (`unused` is skipped)
            gathered = sum(s for _, s in res["buckets"])
            by = res["by"]
            if stage == 1 or policy == "default":
                assert by["all_reduce"] == 2 * (n - 1) * reduced * 4
                assert "reduce_scatter" not in by
            else:
                assert by["reduce_scatter"] == (n - 1) * reduced * 4
                assert "all_reduce" not in by
            gather_key = "all_gather" if policy == "byte_optimal" else "broadcast"
            assert by[gather_key] == (n - 1) * gathered * 4
            # O(1): one all-reduce of 3 float64 (norm, non-finite flag, input verdict), and
            # the small agreement checks.
            assert by["scalars"] == 2 * ((n - 1) * 3 * 8 // n)
            assert by["check"] < 1024


def _grad_memory(stage: int, overlap: bool, bucket: int) -> dict[str, int]:
    torch.manual_seed(seeded(0))
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    opt = zf.ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        partition_grad=stage == 2,
        overlap_communication=overlap,
        reduce_bucket_size=bucket,
    )
    peak = [0]

    def sample(_: torch.Tensor) -> None:
        peak[0] = max(peak[0], opt.grad_bytes())

    # Registered after the facade's hooks, so each sample sees what the facade kept.
    handles = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters()]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seeded(dist.get_rank())))
    opt.backward(model(x).square().mean())
    peak[0] = max(peak[0], opt.grad_bytes())
    for h in handles:
        h.remove()
    psi = sum(p.numel() for p in model.parameters())
    return {"peak": peak[0], "ddp": psi * 4, "shards": opt.state.layout.shard_numel * 4, "after": opt.grad_bytes()}


@pytest.mark.parametrize("n", [2, 4])
def test_stage2_holds_about_one_nth_of_the_gradients_plus_a_bucket(worlds, n):
    bucket = 64 * 64 + 64  # one layer per bucket
    for overlap in (False, True):
        for res in worlds[n].run(_grad_memory, 2, overlap, bucket):
            # While backward runs: the shards reduced so far, the layer whose gradient just
            # landed (its bucket is launched and freed inside the same hook), one bucket
            # buffer of N * S elements in flight.
            assert res["peak"] <= res["shards"] + 2 * bucket * 4 * (1 if not overlap else 2)
            assert res["peak"] < res["ddp"]
            # After backward only this rank's shards remain: exactly 1/N (padded).
            assert res["after"] == res["shards"]


# --------------------------------------------------------------------------- the rest of the API


def _param_grad_vs_ddp() -> float:
    torch.manual_seed(seeded(0))
    model = Net()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    opt = zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), partition_grad=True)
    x, y = next(batches(dist.get_rank(), 1))
    opt.backward(((model(x) - y) ** 2).mean())
    ((ref(x) - y) ** 2).mean().backward()
    worst = 0.0
    for p, q in zip(model.parameters(), ref.module.parameters(), strict=True):
        g = opt.get_param_grad(p)
        # The facade keeps shards only: p.grad holds a placeholder without values (None
        # where no gradient arrived), on which torch's functions raise.
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or type(p.grad) is ShardedGrad
        if q.grad is None:
            assert g is None
            continue
        worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max()).item())
    return worst


def test_get_param_grad_gathers_the_mean_gradient(world):
    for worst in world.run(_param_grad_vs_ddp):
        assert worst <= PARITY


def _misc_api() -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    model.a.requires_grad_(False)
    frozen = model.a.weight.detach().clone()
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), module=model)
    out: dict[str, Any] = {"names": list(opt.state.master), "repr": repr(opt)}
    try:
        opt.step()
        opt.zero_grad()
    except RuntimeError as e:
        out["step_first"] = str(e)
    x, y = next(batches(dist.get_rank(), 1))
    opt.backward(((model(x) - y) ** 2).mean())
    opt.step()
    opt.zero_grad()
    out["frozen_unchanged"] = torch.equal(model.a.weight, frozen)
    out["norm"] = opt.get_grad_norm()
    w2m = opt.get_working_to_master_map()
    m2w = opt.get_master_to_working_map()
    out["maps"] = all(m2w[id(w2m[id(p)])] is p for p in model.parameters() if p.requires_grad)
    # Editing the model's weights and re-reading them makes the next gather return them.
    with torch.no_grad():
        model.b.weight.fill_(0.25)
    opt.update_master_params(model)
    full = zf.gather_params(opt.state)
    out["reread"] = bool((full["b.weight"] == 0.25).all())
    return out


def test_facade_api_frozen_params_maps_norm_and_update_master_params(worlds):
    for res in worlds[2].run(_misc_api):
        assert res["names"] == ["gate.weight", "gate.bias", "b.weight", "b.bias", "unused.weight", "unused.bias"]
        assert "no gradients since the last step" in res["step_first"]
        assert res["frozen_unchanged"]
        assert res["norm"] is not None and math.isfinite(res["norm"]) and res["norm"] > 0
        assert res["maps"] and res["reread"]
        assert res["repr"].startswith("ZeroOptimizer(stage=1, optimizer=adamw")


def _no_leaks() -> dict[str, int]:
    model = Net()
    refs = []
    for _ in range(20):
        opt = zf.ZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), partition_grad=True, overlap_communication=True
        )
        refs.append(weakref.ref(opt))
        del opt
    gc.collect()
    hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    return {"alive": sum(r() is not None for r in refs), "hooks": hooks}


def test_dropped_facades_leave_no_hooks_or_objects_behind(worlds):
    for res in worlds[2].run(_no_leaks):
        assert res == {"alive": 0, "hooks": 0}


def test_whole_tensor_optimizers_are_refused_with_the_reason():
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="cannot shard LBFGS: it needs a closure"):
        zf.ZeroOptimizer(torch.optim.LBFGS([p]))
    with pytest.raises(TypeError, match="named params and a zerofn optimizer"):
        zf.ZeroOptimizer([("p", p)])
