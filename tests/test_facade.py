"""ZeroOptimizer against DDP + the same torch optimizer, on real gloo ranks.

Bitwise at every world size: the facade and DDP (``helpers.ddp_reference``) train the same
Net from the same data, and their params must have the same bits. What makes that exact:

* the mean gradient: each rank scales its fp32 gradient by the same fp32 factor 1/N on both
  sides. At N = 1 and 2 the default fp32 wire then sums one or two addends (a sum of two
  does not depend on the order), so DDP's default all-reduce has zerofn's bits. At N = 3
  and 4 gloo adds an element's three or four addends in an order that depends on where the
  element lies in the flat buffer (DDP's buckets and zerofn's rank-major rows put it at
  different offsets), so both sides sum on a float64 wire (``helpers.exact_wire``:
  ``communication_dtype=torch.float64`` against ``ddp_reference(..., wire=torch.float64)``):
  three or four fp32 numbers sum exactly in float64, in any order, and are rounded to fp32
  once (see "the exact wire" in ``tests/helpers.py``);
* clipping: zerofn takes the norm in float64 and the coefficient in Python floats; the
  reference clips with the same arithmetic (``clip_dtype=torch.float64``). The two float64
  norms may differ in their last bit (another summation order), which changes the fp32
  coefficient only if the exact one lies within that bit of an fp32 rounding boundary: a
  chance of about 2**-29 per clipped step;
* the optimizer and schedulers: the same torch code on the same bits.

The default fp32 wire at 3 and 4 ranks, what users run, is checked once more for SGD over a
few steps against the error-analysis bound ``helpers.fp32_wire_sgd_bound``.
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
    assert_bitwise_equal,
    assert_trees_equal,
    batches,
    ddp_reference,
    exact_wire,
    float64_wire_hook,
    fp32_wire_sgd_bound,
    gate_used,
    max_rel_diff,
    mse,
    seeded,
)

import zerofn as zf
from zerofn.buckets import plan_buckets
from zerofn.facade._reducer import ShardedGrad

STEPS = 21
#: The SGD configuration's weight lr (the largest of its groups) and momentum, for the fp32-wire bound.
SGD_LR, SGD_MOMENTUM = 1e-2, 0.9


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
        return torch.optim.SGD(groups, lr=SGD_LR, momentum=SGD_MOMENTUM, weight_decay=0.01)
    cls = getattr(torch.optim, kind)
    for g in groups:
        g.pop("weight_decay", None)
    return cls(groups, lr=1e-3)


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


_DDP_TWINS: dict[tuple, dict[str, torch.Tensor]] = {}


def _make_scheduler(scheduler: str | None, steps: int) -> Any:
    if scheduler == "step":
        return functools.partial(torch.optim.lr_scheduler.StepLR, step_size=4, gamma=0.5)
    if scheduler == "onecycle":
        return functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=2e-2, total_steps=steps)
    return None


def _ddp_twin(
    kind: str, clip: float, accumulate: int, scheduler: str | None, steps: int, wire: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """DDP's params (``helpers.ddp_reference``) for one configuration, computed once per rank
    process (the facade's stage, overlap and bucket size do not change what DDP does).

    ``wire``: DDP's (and the facade's) wire, ``None`` for the default fp32 one. Clipping uses
    zerofn's arithmetic (a float64 norm, the coefficient in Python floats).
    """
    key = (dist.get_world_size(), kind, clip, accumulate, scheduler, steps, wire)
    if key not in _DDP_TWINS:
        torch.manual_seed(seeded(0))
        _DDP_TWINS[key] = ddp_reference(
            Net(),
            functools.partial(_torch_optimizer, kind),
            batches(dist.get_rank(), steps * accumulate),
            steps=steps,
            accumulate=accumulate,
            clip=clip or None,
            clip_dtype=torch.float64,
            scheduler=_make_scheduler(scheduler, steps),
            wire=wire,
        )["params"]
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
    wire: Any = "exact",
) -> dict[str, Any]:
    """Train the same Net under the facade and under DDP (``helpers.ddp_reference``) on this rank's batches.

    ``wire``: ``"exact"`` (``helpers.exact_wire``: fp32 up to 2 ranks, float64 from 3), or
    the wire dtype itself (``None``: the default fp32 wire), the same on both sides.
    """
    wire = exact_wire(dist.get_world_size()) if wire == "exact" else wire
    ref = _ddp_twin(kind, clip, accumulate, scheduler, steps, wire)
    torch.manual_seed(seeded(0))
    model = Net()
    initial = _named(model)
    make_scheduler = _make_scheduler(scheduler, steps)
    zopt = zf.ZeroOptimizer(
        _torch_optimizer(kind, model),
        partition_grad=stage == 2,
        overlap_communication=overlap,
        clip_grad_norm=clip,
        reduce_bucket_size=bucket,
        communication_dtype=wire,
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
    return {"zero": _named(model), "ref": ref, "initial": initial, "no_sync_bytes": no_sync_bytes}


def _assert_parity(res: dict[str, Any], what: Any) -> None:
    """The facade's params have DDP's bits, and training moved them (the check is not vacuous)."""
    assert max_rel_diff(res["ref"], res["initial"]) > 1e-3, f"{what}: training did not move the params"
    try:
        assert_trees_equal(res["zero"], res["ref"])
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def _train_matrix(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_train_pair(**cfg) for cfg in configs]


@pytest.mark.numerics
def test_facade_matches_ddp_for_both_stages_with_and_without_overlap_and_clipping(world):
    """Bitwise at every N: the exact wire (fp32 up to 2 ranks, float64 from 3) on both
    sides, clipping with zerofn's float64 norm in the reference too (module docstring)."""
    configs = [{"stage": s, "overlap": o, "clip": c} for s in (1, 2) for o in (False, True) for c in (0.0, 0.05)]
    results = world.run(_train_matrix, configs)
    for rank_results in results:
        for cfg, res in zip(configs, rank_results, strict=True):
            _assert_parity(res, cfg)
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
    """Bitwise at every N (exact wire): both sides add the three micro-batches' local
    gradients in fp32 in the same order before the one reduction of the step."""
    configs = [{"stage": s, "overlap": o, "accumulate": 3, "steps": 8} for s in (1, 2) for o in (False, True)]
    for rank_results in world.run(_train_matrix, configs):
        for cfg, res in zip(configs, rank_results, strict=True):
            assert res["no_sync_bytes"] == 0, cfg
            _assert_parity(res, cfg)


@pytest.mark.numerics
@pytest.mark.parametrize("scheduler", ["step", "onecycle"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_torch_lr_scheduler_drives_the_facade_like_plain_torch(worlds, scheduler, kind):
    """Bitwise at 3 ranks (float64 wire): the scheduler writes the same lr floats into
    both optimizers' groups, and the mean gradients have the same bits."""
    for res in worlds[3].run(_train_pair, kind=kind, scheduler=scheduler, steps=12):
        _assert_parity(res, (kind, scheduler))


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam"])
def test_generic_path_optimizers_match_torch(worlds, kind):
    """Bitwise at 2 (fp32 wire) and 3 ranks (float64 wire): the generic path runs torch's
    own step on the shards, elementwise, so each element sees DDP's arithmetic."""
    for n in (2, 3):
        for res in worlds[n].run(_train_pair, kind=kind, stage=2, overlap=True, steps=12):
            _assert_parity(res, (n, kind))


#: Steps of the fp32-wire check: few, since the error-analysis bound doubles a step.
FP32_WIRE_STEPS = 6


_GRAD_MAX: dict[int, float] = {}


def _grad_max() -> float:
    """The largest local gradient element of the fp32-wire SGD run (over ranks, steps and
    elements: ``grad_max`` of the bound), once per world size.

    Read on DDP's trajectory before each step (``torch.func.grad`` at the module's params,
    nothing of DDP's state touched).
    """
    n = dist.get_world_size()
    if n not in _GRAD_MAX:
        data = list(batches(dist.get_rank(), FP32_WIRE_STEPS))
        grad_max = torch.zeros((), dtype=torch.float64)

        def record(module: nn.Module, step: int) -> None:
            params = {name: p.detach() for name, p in module.named_parameters()}
            x, y = data[step]

            def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
                return mse(torch.func.functional_call(module, p, (x, gate_used(step))), y)

            for g in torch.func.grad(loss)(params).values():
                grad_max.copy_(torch.maximum(grad_max, g.abs().max().double()))

        torch.manual_seed(seeded(0))
        sgd = functools.partial(_torch_optimizer, "sgd")
        ddp_reference(Net(), sgd, iter(data), steps=FP32_WIRE_STEPS, before_step=record)
        dist.all_reduce(grad_max, op=dist.ReduceOp.MAX)
        _GRAD_MAX[n] = float(grad_max)
    return _GRAD_MAX[n]


def _fp32_wire_pair(stage: int) -> dict[str, Any]:
    """The facade and DDP on their default fp32 wires (SGD), and the run's ``grad_max``."""
    res = _train_pair(kind="sgd", stage=stage, overlap=stage == 2, steps=FP32_WIRE_STEPS, wire=None)
    return {**res, "grad_max": _grad_max()}


@pytest.mark.numerics
@pytest.mark.parametrize("n", [3, 4])
def test_the_default_fp32_wire_stays_within_the_error_bound_of_ddp(worlds, n):
    """The fp32 wire users run, at 3 and 4 ranks where its sum's order shows: SGD (momentum
    0.9, no amplification of last bits) for ``FP32_WIRE_STEPS`` steps, stage 1 and 2, within
    ``helpers.fp32_wire_sgd_bound`` of DDP.

    The bound comes from the arithmetic (each side's mean within (N + 1) ulps of the exact
    mean, carried through momentum and the updates, doubling a step), with the largest lr,
    the run's largest local gradient element, and as ``param_max`` the smallest of the
    params' own scales (``max_rel_diff`` is relative to each tensor's largest element), so
    it holds for every tensor. It is far below what one wrong step moves (checked too).
    """
    for stage in (1, 2):
        for res in worlds[n].run(_fp32_wire_pair, stage):
            scale = min(t.abs().max().item() for t in res["ref"].values())
            bound = fp32_wire_sgd_bound(
                steps=FP32_WIRE_STEPS,
                world=n,
                lr=SGD_LR,
                momentum=SGD_MOMENTUM,
                grad_max=res["grad_max"],
                param_max=scale,
            )
            moved = max_rel_diff(res["ref"], res["initial"])
            assert bound < 0.05 * moved, f"the bound {bound:.3g} cannot tell a run that moved {moved:.3g}"
            diff = max_rel_diff(res["zero"], res["ref"])
            assert diff <= bound, f"stage {stage}: {diff:.3g} against DDP on the fp32 wire, bound {bound:.3g}"


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
        "buckets": [(b.names, b.shard_numel) for b in plan_buckets(layout, bucket)],
        "reduced": [
            b.shard_numel for b in plan_buckets(layout, bucket) if not set(b.names) <= {"unused.weight", "unused.bias"}
        ],
    }


@pytest.mark.parametrize("policy", ["default", "byte_optimal"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_counted_bytes_equal_the_formula_of_the_realisation_in_use(worlds, n, policy):
    """Per step and rank: reduce + gather bucket bytes exactly; O(1) extras separately.

    With S = a bucket's row (its params' shard_numel summed), b = 4 bytes:
    all-reduce 2(N-1)S·b, reduce-scatter (N-1)S·b, all-to-all (N-1)S·b, all-gather
    (N-1)S·b, N broadcasts (each rank the root of one) (N-1)S·b. Stage 2 thus sends
    2(N-1)/N · Ψ_padded · b with either policy; stage 1 3(N-1)/N · Ψ_padded · b.
    """
    bucket = 200
    for stage in (1, 2):
        for res in worlds[n].run(_count_step_bytes, policy, stage, bucket):
            reduced = sum(res["reduced"])  # buckets with a gradient (`unused` is skipped)
            gathered = sum(s for _, s in res["buckets"])
            by = res["by"]
            reduce_key = "all_reduce" if stage == 1 else "all_to_all" if policy == "default" else "reduce_scatter"
            assert by[reduce_key] == (2 if stage == 1 else 1) * (n - 1) * reduced * 4
            assert not {"all_reduce", "all_to_all", "reduce_scatter"} - {reduce_key} & set(by)
            gather_key = "all_gather" if policy == "byte_optimal" else "broadcast"
            assert by[gather_key] == (n - 1) * gathered * 4
            # O(1): 3 float64 (norm, non-finite flag, input verdict) and the 20 that confirm the
            # layout and bucket size, all-gathered on gloo whatever the policy; the small agreement checks.
            assert by["scalars"] == (n - 1) * (3 + 20) * 8
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


def _param_grad_vs_ddp() -> list[tuple[str, torch.Tensor | None, torch.Tensor | None]]:
    """``get_param_grad`` of each param after one backward, next to DDP's ``p.grad``, both
    on the exact wire (``helpers.exact_wire``)."""
    wire = exact_wire(dist.get_world_size())
    torch.manual_seed(seeded(0))
    model = Net()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    if wire is not None:
        ref.register_comm_hook(None, float64_wire_hook)
    opt = zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), partition_grad=True, communication_dtype=wire)
    x, y = next(batches(dist.get_rank(), 1))
    opt.backward(((model(x) - y) ** 2).mean())
    ((ref(x) - y) ** 2).mean().backward()
    out = []
    for (name, p), q in zip(model.named_parameters(), ref.module.parameters(), strict=True):
        # The facade keeps shards only: p.grad holds a placeholder without values (None
        # where no gradient arrived), on which torch's functions raise.
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or type(p.grad) is ShardedGrad
        out.append((name, opt.get_param_grad(p), q.grad))
    return out


def test_get_param_grad_gathers_the_mean_gradient(world):
    """Bitwise at every N: the gathered mean is the reduced shards' bits, and the exact
    wire gives DDP's (fp32 up to 2 ranks, float64 from 3: module docstring)."""
    for grads in world.run(_param_grad_vs_ddp):
        assert any(ref is None for _, _, ref in grads)  # `unused`: no gradient on either side
        for name, mine, ref in grads:
            if ref is None:
                assert mine is None, name
            else:
                assert ref.abs().max() > 0, name
                assert_bitwise_equal(mine, ref, name)


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
