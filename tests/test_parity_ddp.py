"""Parity: the functional ZeRO loop against DistributedDataParallel + torch.optim.

Every rank trains ``helpers.Net`` for ``STEPS`` steps twice from the same start, on the
same per-rank batches:

* zerofn: ``torch.func.grad`` of a ``torch.func.functional_call`` loss, then
  ``reduce_grads`` (stage 1 and stage 2) -> ``step_shards`` -> ``gather_params``;
* reference: ``DistributedDataParallel(find_unused_parameters=True)``, ``loss.backward()``,
  clipping when clipping, ``torch.optim``.

The model covers the corners: no param's numel divides 2, 3 or 4 (all padded), ``gate`` is
dropped every third step (its grads are *missing* from the dict; DDP sees it unused), and
``unused`` never gets a gradient (its grads are ``None``).

Every comparison of the logic is bitwise, at every world size, because both sides do the
same arithmetic on the same bits:

* the wire (``helpers.exact_wire``): at 1 and 2 ranks the default fp32 wire, the one users
  keep: at 1 rank there is no sum, at 2 ranks each element is ``g0 * 0.5 + g1 * 0.5``
  (DDP divides by 2, zerofn multiplies by 0.5: both exact) and a sum of two addends does
  not depend on the order. At 3 and 4 ranks gloo adds an element's addends in an order
  that depends on its offset in the flat buffer, and DDP's buckets and zerofn's rank-major
  rows put it at different offsets, so fp32 sums differ in the last bit (and AdamW's eps
  1e-8 turns that into an lr-sized step of a near-zero element). There both sides use a
  float64 wire (zerofn ``comm_dtype=torch.float64``, DDP ``helpers.float64_wire_hook``):
  each rank scales its fp32 gradient by the same 0-d fp32 1/N, and a sum of three or four
  fp32 numbers is exact in float64 in any order, so both round the same exact sum back
  to fp32 once.
* clipping: zerofn computes the norm in float64 over shards and the coefficient in Python
  floats; the reference clips the same way (``helpers.clip_in_float64``; torch's
  ``clip_grad_norm_`` rounds both in float32). The two float64 norms may differ in their
  last bit (another order of the sum of squares), which changes the float32 coefficient
  only if it lies within one float64 ulp of a float32 rounding boundary: a chance of
  about 2**-29 a step, 48 steps a configuration.
* the optimizers are torch's own element-wise kernels (zerofn's on a shard, torch's on the
  whole tensor: float32 kernels give the same bits).

What users run at 3 and 4 ranks, the fp32 wire, is checked apart: SGD for a few steps,
where a last-bit difference stays a last-bit difference, against the error-analysis bound
``helpers.fp32_wire_sgd_bound`` (so many ulps a step, so many steps; the same on every
machine).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import get_world
from helpers import (
    IN_FEATURES,
    OUT_FEATURES,
    Net,
    assert_trees_equal,
    batches,
    ddp_reference,
    exact_wire,
    fp32_wire_sgd_bound,
    functional_reference,
    gate_used,
    max_rel_diff,
    mse,
    seeded,
    tensor_rel_diff,
)
from torch.func import functional_call, grad

import zerofn as zf

pytestmark = pytest.mark.numerics

STEPS = 24
BUCKET = 64  # small, so several buckets are used and a.weight (91 elements) travels alone
MAX_NORM = 0.05  # below the gradient norm of every step here, so clipping really acts
LR = {"sgd": 0.05, "adamw": 1e-2}
SGD = dict(lr=LR["sgd"], momentum=0.9, weight_decay=0.01)
POLICIES = {"default": zf.CommPolicy(), "byte_optimal": zf.CommPolicy.byte_optimal()}
# The fp32 wire at 3 and 4 ranks: SGD for this many steps (the bound doubles a step).
FP32_WIRE_STEPS = 6


def _optimizers(name, named_params):
    """(zerofn optimizer, torch optimizer over ``named_params``) with the same hyperparameters.

    ``"adamw_groups"`` adds per-group hyperparameters: biases without weight decay (chosen
    by a predicate) and a larger lr for ``b.weight`` (chosen by name), as torch param groups.
    """
    named_params = list(named_params)
    params = [p for _, p in named_params]
    if name == "sgd":
        return zf.optim.sgd(**SGD), torch.optim.SGD(params, **SGD)
    kw = dict(lr=LR["adamw"], weight_decay=0.1)
    if name == "adamw":
        return zf.optim.adamw(**kw), torch.optim.AdamW(params, **kw)
    assert name == "adamw_groups", name
    groups = [
        {"params": lambda n: n.endswith("bias"), "weight_decay": 0.0},
        {"params": ["b.weight"], "lr": 3 * LR["adamw"]},
    ]
    torch_groups = [{"params": [], **{k: v for k, v in g.items() if k != "params"}} for g in groups]
    torch_groups.append({"params": []})
    for n, p in named_params:
        i = 0 if n.endswith("bias") else 1 if n == "b.weight" else 2
        torch_groups[i]["params"].append(p)
    return zf.optim.adamw(**kw, param_groups=groups), torch.optim.AdamW(torch_groups, **kw)


def _loss(model, params, x, y, use_gate):
    return ((functional_call(model, params, (x,), {"use_gate": use_gate}) - y) ** 2).mean()


def _train_zero(model, opt, stage, clip, policy, *, wire, steps=STEPS):
    """The functional loop on the ``wire`` (``comm_dtype``).

    Returns the final params, how many steps were clipped, and the largest local gradient
    element of any rank and step (for the fp32 wire's bound).
    """
    rank = dist.get_rank()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = zf.shard_params(params, opt)
    clipped, grad_max = 0, 0.0
    for step, (x, y) in enumerate(batches(rank, steps)):
        use_gate = gate_used(step)
        grads = dict(grad(functools.partial(_loss, model))(params, x, y, use_gate))
        grads["unused.weight"] = grads["unused.bias"] = None  # never in the forward
        if not use_gate:  # layer drop: no gradient this step
            del grads["gate.weight"], grads["gate.bias"]
        grad_max = max(grad_max, *(float(g.abs().max()) for g in grads.values() if g is not None))
        shards = zf.reduce_grads(
            grads, state.layout, stage=stage, bucket_numel=BUCKET, comm_policy=policy, comm_dtype=wire
        )
        state, info = zf.step_shards(state, shards, max_norm=MAX_NORM if clip else None)
        assert not info.skipped
        clipped += info.clip_coef < 1.0
        params = zf.gather_params(state, bucket_numel=BUCKET, comm_policy=policy)
    largest = torch.tensor(grad_max, dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return params, clipped, float(largest)


def _no_grad(step):
    """The params without a gradient at ``step``: ``unused`` always, ``gate`` when dropped."""
    return ["unused.weight", "unused.bias", *([] if gate_used(step) else ["gate.weight", "gate.bias"])]


def _torch_optimizer(opt_name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return _optimizers(opt_name, model.named_parameters())[1]


def _reference_options(clip: bool) -> dict:
    """What both references are trained with: the exact wire and zerofn's float64 clipping."""
    clip_options = dict(clip=MAX_NORM, clip_dtype=torch.float64) if clip else {}
    return dict(steps=STEPS, wire=exact_wire(dist.get_world_size()), **clip_options)


_DDP_TWINS: dict[tuple, dict[str, torch.Tensor]] = {}


def _ddp_twin(opt_name: str, clip: bool) -> dict[str, torch.Tensor]:
    """DDP's params, once per rank process: the communication policy changes zerofn's
    collectives, not DDP's."""
    key = (dist.get_world_size(), opt_name, clip)
    if key not in _DDP_TWINS:
        torch.manual_seed(seeded(0))
        make_optimizer = functools.partial(_torch_optimizer, opt_name)
        data = batches(dist.get_rank(), STEPS)
        _DDP_TWINS[key] = ddp_reference(Net(), make_optimizer, data, **_reference_options(clip))["params"]
    return _DDP_TWINS[key]


def _train_both(opt_name, clip, policy_name):
    """On every rank: zerofn stage 1, zerofn stage 2, DDP and the torch.func reference from the same model."""
    torch.manual_seed(seeded(0))
    model = Net()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"initial": initial, "clipped": {}}
    wire = exact_wire(dist.get_world_size())
    for stage in (1, 2):
        opt, _ = _optimizers(opt_name, [("x", torch.zeros(1, requires_grad=True))])
        out[stage], out["clipped"][stage], _ = _train_zero(model, opt, stage, clip, POLICIES[policy_name], wire=wire)
    out["ddp"] = _ddp_twin(opt_name, clip)
    rank = dist.get_rank()
    make_optimizer = functools.partial(_torch_optimizer, opt_name)
    out["func"] = functional_reference(
        model, make_optimizer, batches(rank, STEPS), no_grad=_no_grad, **_reference_options(clip)
    )["params"]
    return out


_cache: dict[tuple, list] = {}


def _results(n, opt_name, clip, policy_name="default"):
    """Per-rank results of ``_train_both`` on ``n`` ranks, computed once per session."""
    key = (n, opt_name, clip, policy_name)
    if key not in _cache:
        _cache[key] = get_world(n).run(_train_both, opt_name, clip, policy_name)
    return _cache[key]


def _assert_identical_on_every_rank(results, which):
    for r in results[1:]:
        assert_trees_equal(r[which], results[0][which])


def _assert_moved(result):
    """The check is not vacuous: training moved every param that got gradients."""
    for name, p in result["ddp"].items():
        moved = not torch.equal(p, result["initial"][name])
        assert moved == (not name.startswith("unused")), name


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_both_stages_are_bitwise_equal_to_ddp_on_the_exact_wire(world, opt_name, clip):
    # Exact: the same mean-gradient bits on both sides (fp32 wire at N <= 2, float64 at
    # N >= 3), the same float64 clipping, torch's element-wise optimizer kernels.
    results = _results(world.world_size, opt_name, clip)
    _assert_moved(results[0])
    for stage in (1, 2):
        _assert_identical_on_every_rank(results, stage)
        for r in results:
            assert_trees_equal(r[stage], r["ddp"])
        clipped = results[0]["clipped"][stage]
        assert clipped == (STEPS if clip else 0), f"stage {stage}: {clipped} of {STEPS} steps clipped"


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_both_stages_are_bitwise_equal_to_plain_ddp_at_one_and_two_ranks_without_clipping(n, opt_name):
    # The default users keep: the fp32 wire and DDP's own all-reduce (exact_wire is None
    # here), no comm hook; one addend or two, so the order of the sum cannot matter.
    assert exact_wire(n) is None
    results = _results(n, opt_name, False)
    for r in results:
        assert_trees_equal(r[1], r["ddp"])
        assert_trees_equal(r[2], r["ddp"])


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_stage_1_and_stage_2_give_bitwise_equal_params(world, opt_name, clip):
    # Under the default policy gloo realises both stages' reduction as an all-reduce of
    # the same rows (the same order of every sum); the byte-optimal test below is where
    # stage 2 takes the reduce-scatter path.
    for r in _results(world.world_size, opt_name, clip):
        assert_trees_equal(r[2], r[1])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_byte_optimal_policy_is_bitwise_equal_to_ddp_on_the_exact_wire(world, opt_name):
    # Here stage 2 really reduce-scatters while stage 1 all-reduces: two collectives whose
    # sums may add an element's addends in different orders. Two addends (N <= 2) do not
    # depend on the order, and three or four fp32 addends sum exactly in float64 (N >= 3):
    # both stages give DDP's bits, clipped in float64 as zerofn clips.
    results = _results(world.world_size, opt_name, True, "byte_optimal")
    for stage in (1, 2):
        _assert_identical_on_every_rank(results, stage)
        assert_trees_equal(results[0][stage], results[0]["ddp"])
    assert_trees_equal(results[0][2], results[0][1])
    assert results[0]["clipped"][1] == results[0]["clipped"][2] == STEPS


def test_param_groups_are_bitwise_equal_to_ddp_with_torch_param_groups(world):
    # Exact for the reasons of the first test: the groups only choose per-element hyperparameters.
    results = _results(world.world_size, "adamw_groups", False)
    for stage in (1, 2):
        _assert_identical_on_every_rank(results, stage)
        assert_trees_equal(results[0][stage], results[0]["ddp"])
    # The groups changed the result: it differs from plain AdamW.
    plain = _results(world.world_size, "adamw", False)[0][2]
    assert max_rel_diff(results[0][2], plain) > 1e-3


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_the_torch_func_reference_is_bitwise_equal_to_ddp(world, opt_name):
    # The two references of ``helpers`` are one loop: grad + all-reduce mean is what DDP
    # does. On the exact wire a sum does not depend on DDP's buckets or the per-param
    # all-reduce of the torch.func loop; both clip with ``clip_in_float64``.
    for clip in (False, True):
        for r in _results(world.world_size, opt_name, clip):
            assert_trees_equal(r["func"], r["ddp"])


# --------------------------------------------------------------------------- the fp32 wire


def _train_fp32_wire():
    """zerofn stage 1 and 2 and plain DDP, SGD for ``FP32_WIRE_STEPS`` steps, all on the
    fp32 wire (DDP's own all-reduce, zerofn's default ``comm_dtype``)."""
    torch.manual_seed(seeded(0))
    model = Net()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"initial": initial, "grad_max": 0.0}
    for stage in (1, 2):
        params, _, grad_max = _train_zero(
            model, zf.optim.sgd(**SGD), stage, False, POLICIES["default"], wire=None, steps=FP32_WIRE_STEPS
        )
        out[stage], out["grad_max"] = params, max(out["grad_max"], grad_max)
    make_optimizer = functools.partial(_torch_optimizer, "sgd")
    out["ddp"] = ddp_reference(model, make_optimizer, batches(dist.get_rank(), FP32_WIRE_STEPS), steps=FP32_WIRE_STEPS)[
        "params"
    ]
    return out


@pytest.mark.parametrize("n", [3, 4], ids=["N3", "N4"])
def test_the_fp32_wire_at_three_and_four_ranks_stays_within_the_sgd_error_bound(n):
    # Not bitwise: gloo sums an element's three or four fp32 addends in an order that
    # depends on its offset, and DDP's buckets and zerofn's rows differ. SGD (momentum
    # 0.9) carries a last-bit difference of the mean gradient linearly, so after a few
    # steps the difference is bounded by the error analysis of ``fp32_wire_sgd_bound``:
    # (N + 1) roundings of the mean a side, times lr, kept 1 / (1 - momentum) steps, one
    # ulp of the param a side, at most doubling a step. ``param_max`` is the smallest of
    # the trained tensors' largest elements, max_rel_diff's smallest denominator.
    results = get_world(n).run(_train_fp32_wire)
    r0 = results[0]
    trained = [name for name in r0["ddp"] if not name.startswith("unused")]
    param_max = min(float(r0["ddp"][name].abs().max()) for name in trained)
    bound = fp32_wire_sgd_bound(
        steps=FP32_WIRE_STEPS,
        world=n,
        lr=SGD["lr"],
        momentum=SGD["momentum"],
        grad_max=r0["grad_max"],
        param_max=param_max,
    )
    # A logic error moves a tensor by whole updates: the bound stays far below what
    # training moved the least moved tensor.
    moved = min(tensor_rel_diff(r0["ddp"][name], r0["initial"][name]) for name in trained)
    assert bound < 0.05 * moved, (bound, moved)
    for stage in (1, 2):
        for r in results[1:]:
            assert_trees_equal(r[stage], r0[stage])  # identical on every rank
        diff = max_rel_diff(r0[stage], r0["ddp"])
        assert diff <= bound, f"stage {stage}: {diff:.3g} against DDP, bound {bound:.3g} (moved {moved:.3g})"
        print(f"N={n} stage {stage}: {diff:.3g} against DDP, bound {bound:.3g}, training moved {moved:.3g}")
    _assert_moved(r0)


def _float64_defaults() -> dict[str, object]:
    """On every rank: a float64 model trained by the facade and by the functional loop with
    every default, and by DDP + torch.optim (which keeps float64 throughout)."""
    torch.manual_seed(seeded(0))
    model = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Tanh(), nn.Linear(16, OUT_FEATURES)).double()
    data = [(x.double(), y.double()) for x, y in batches(dist.get_rank(), STEPS)]
    ddp = ddp_reference(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), data, steps=STEPS, use_gate=None)
    facade = copy.deepcopy(model)
    opt = zf.ZeroOptimizer(torch.optim.AdamW(facade.parameters(), lr=1e-2))
    for x, y in data:
        mse(facade(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = zf.shard_params({n: p.detach() for n, p in model.named_parameters()}, zf.optim.adamw(lr=1e-2))
    return {
        "ddp": ddp["params"],
        "facade": {n: p.detach().clone() for n, p in facade.named_parameters()},
        "master_dtypes": {str(t.dtype) for t in [*opt._state.master.values(), *state.master.values()]},
    }


@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_a_float64_model_keeps_float64_masters_and_matches_ddp_bitwise_with_the_defaults(n):
    # torch.optim steps float64 params in float64; a float32 master would round every update.
    for r in get_world(n).run(_float64_defaults):
        assert r["master_dtypes"] == {"torch.float64"}
        assert_trees_equal(r["facade"], r["ddp"])
