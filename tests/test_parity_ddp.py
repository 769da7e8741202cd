"""Parity: the functional ZeRO loop against DistributedDataParallel + torch.optim.

Every rank trains ``helpers.Net`` for ``STEPS`` steps twice from the same start, on the
same per-rank batches:

* zerofn: ``torch.func.grad`` of a ``torch.func.functional_call`` loss, then
  ``reduce_grads`` (stage 1 and stage 2) -> ``step_shards`` -> ``gather_params``;
* reference: ``DistributedDataParallel(find_unused_parameters=True)``, ``loss.backward()``,
  ``torch.nn.utils.clip_grad_norm_`` when clipping, ``torch.optim``.

The model covers the corners: no param's numel divides 2, 3 or 4 (all padded), ``gate`` is
dropped every third step (its grads are *missing* from the dict; DDP sees it unused), and
``unused`` never gets a gradient (its grads are ``None``).

Tolerances (fp32), with ``max_rel_diff`` = max over tensors of ``max|a-b| / max|b|``:

* 1e-6 everywhere (the fp32 tolerance), or, where this machine's own noise floor is
  above it, ``helpers.FLOOR_FACTOR`` times that floor: DDP against DDP with other last
  bits in its averaged gradients (``helpers.FLOOR_VARIANTS``, and float64 clipping when
  clipping), measured in the same run at 3 and 4 ranks and whenever clipping. AdamW with
  eps 1e-8 turns a last-bit difference of a near-zero mean gradient into a different
  update of that element, so how far the last bits travel depends on the machine.
* bitwise at 1 and 2 ranks without clipping. The optimizer kernels are torch's own and
  element-wise, and the mean gradient has the same bits: at 1 rank there is no sum; at 2
  ranks each element is ``g0 * 0.5 + g1 * 0.5`` (DDP divides by 2, zerofn multiplies by
  0.5: both exact) and a sum of two addends does not depend on the order.
* not bitwise at 3 and 4 ranks: gloo's all-reduce adds the three or four addends of an
  element in an order that depends on where the element sits in the flat buffer (which
  chunk of the ring), and an element sits at different offsets in DDP's bucket and in
  zerofn's rank-major bucket; float addition is not associative. (At 3 ranks the
  pre-scaling rounds too, and DDP's divide-by-3 and zerofn's multiply-by-1/3 can round
  differently.)
* not bitwise with clipping: torch computes the total norm and the clip coefficient in
  float32 (``torch._foreach_norm``), zerofn computes the norm in float64 over shards (as
  the seed does), so the coefficient can differ in the last bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import (
    Net,
    assert_floor_is_noise,
    assert_trees_equal,
    assert_within_floor,
    batches,
    ddp_noise_floor,
    ddp_reference,
    functional_reference,
    gate_used,
    max_rel_diff,
    seeded,
)
from torch.func import functional_call, grad

import zerofn as zf

pytestmark = pytest.mark.numerics

STEPS = 24
BUCKET = 64  # small, so several buckets are used and a.weight (91 elements) travels alone
MAX_NORM = 0.05  # below the gradient norm of every step here, so clipping really acts
LR = {"sgd": 0.05, "adamw": 1e-2}
POLICIES = {"default": zf.CommPolicy(), "byte_optimal": zf.CommPolicy.byte_optimal()}


def _optimizers(name, named_params):
    """(zerofn optimizer, torch optimizer over ``named_params``) with the same hyperparameters.

    ``"adamw_groups"`` adds per-group hyperparameters: biases without weight decay (chosen
    by a predicate) and a larger lr for ``b.weight`` (chosen by name), as torch param groups.
    """
    named_params = list(named_params)
    params = [p for _, p in named_params]
    if name == "sgd":
        kw = dict(lr=LR["sgd"], momentum=0.9, weight_decay=0.01)
        return zf.optim.sgd(**kw), torch.optim.SGD(params, **kw)
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


def _train_zero(model, opt, stage, clip, policy):
    """The functional loop. Returns the final params and how many steps were clipped."""
    rank = dist.get_rank()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = zf.shard_params(params, opt)
    clipped = 0
    for step, (x, y) in enumerate(batches(rank, STEPS)):
        use_gate = gate_used(step)
        grads = dict(grad(functools.partial(_loss, model))(params, x, y, use_gate))
        grads["unused.weight"] = grads["unused.bias"] = None  # never in the forward
        if not use_gate:  # layer drop: no gradient this step
            del grads["gate.weight"], grads["gate.bias"]
        shards = zf.reduce_grads(grads, state.layout, stage=stage, bucket_numel=BUCKET, comm_policy=policy)
        state, info = zf.step_shards(state, shards, max_norm=MAX_NORM if clip else None)
        assert not info.skipped
        clipped += info.clip_coef < 1.0
        params = zf.gather_params(state, bucket_numel=BUCKET, comm_policy=policy)
    return params, clipped


def _no_grad(step):
    """The params without a gradient at ``step``: ``unused`` always, ``gate`` when dropped."""
    return ["unused.weight", "unused.bias", *([] if gate_used(step) else ["gate.weight", "gate.bias"])]


def _torch_optimizer(opt_name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return _optimizers(opt_name, model.named_parameters())[1]


_DDP_TWINS: dict[tuple, tuple[dict[str, torch.Tensor], float]] = {}


def _ddp_twin(opt_name: str, clip: bool) -> tuple[dict[str, torch.Tensor], float]:
    """DDP's params and this machine's noise floor, once per rank process: the
    communication policy changes zerofn's collectives, not DDP's."""
    key = (dist.get_world_size(), opt_name, clip)
    if key not in _DDP_TWINS:
        torch.manual_seed(seeded(0))
        model = Net()
        make_optimizer = functools.partial(_torch_optimizer, opt_name)
        data = functools.partial(batches, dist.get_rank(), STEPS)
        options = dict(steps=STEPS, clip=MAX_NORM if clip else None)
        ddp = ddp_reference(model, make_optimizer, data(), **options)["params"]
        _DDP_TWINS[key] = ddp, ddp_noise_floor(model, make_optimizer, data, ddp, **options)
    return _DDP_TWINS[key]


def _train_both(opt_name, clip, policy_name):
    """On every rank: zerofn stage 1, zerofn stage 2, DDP and the torch.func reference from the same model."""
    torch.manual_seed(seeded(0))
    model = Net()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"initial": initial, "clipped": {}}
    for stage in (1, 2):
        opt, _ = _optimizers(opt_name, [("x", torch.zeros(1, requires_grad=True))])
        out[stage], out["clipped"][stage] = _train_zero(model, opt, stage, clip, POLICIES[policy_name])
    out["ddp"], out["floor"] = _ddp_twin(opt_name, clip)
    rank = dist.get_rank()
    make_optimizer = functools.partial(_torch_optimizer, opt_name)
    clip_at = MAX_NORM if clip else None
    out["func"] = functional_reference(
        model, make_optimizer, batches(rank, STEPS), steps=STEPS, clip=clip_at, no_grad=_no_grad
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


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_both_stages_match_ddp_within_1e_6_or_the_measured_floor(world, opt_name, clip):
    results = _results(world.world_size, opt_name, clip)
    ref, floor = results[0]["ddp"], results[0]["floor"]
    assert_floor_is_noise(floor, ref, results[0]["initial"])
    for stage in (1, 2):
        _assert_identical_on_every_rank(results, stage)
        assert_within_floor(results[0][stage], ref, floor, rel=1e-6, what=f"stage {stage}")
        # The check is not vacuous: training moved every param that got gradients.
        for name, p in ref.items():
            moved = not torch.equal(p, results[0]["initial"][name])
            assert moved == (not name.startswith("unused")), name
        clipped = results[0]["clipped"][stage]
        assert clipped == (STEPS if clip else 0), f"stage {stage}: {clipped} of {STEPS} steps clipped"


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_both_stages_are_bitwise_equal_to_ddp_at_one_and_two_ranks_without_clipping(n, opt_name):
    results = _results(n, opt_name, False)
    for r in results:
        assert_trees_equal(r[1], r["ddp"])
        assert_trees_equal(r[2], r["ddp"])


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_stage_1_and_stage_2_give_bitwise_equal_params(world, opt_name, clip):
    # Under the default policy gloo realises both stages' reduction as an all-reduce; the
    # byte-optimal test below is where stage 2 takes the reduce-scatter path.
    for r in _results(world.world_size, opt_name, clip):
        assert_trees_equal(r[2], r[1])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_byte_optimal_policy_matches_ddp_within_1e_6_or_the_measured_floor(world, opt_name):
    results = _results(world.world_size, opt_name, True, "byte_optimal")
    floor = results[0]["floor"]
    for stage in (1, 2):
        _assert_identical_on_every_rank(results, stage)
        assert_within_floor(results[0][stage], results[0]["ddp"], floor, rel=1e-6, what=f"stage {stage}")
    # Here stage 2 really reduce-scatters while stage 1 all-reduces. With two addends per
    # element the order cannot matter, so up to 2 ranks the two stages agree bitwise.
    if world.world_size <= 2:
        assert_trees_equal(results[0][2], results[0][1])
    else:  # two zerofn runs whose sums differ in order: the same floor as against DDP
        assert_within_floor(results[0][2], results[0][1], floor, rel=1e-6, what="stage 2 against stage 1")


def test_param_groups_match_ddp_with_torch_param_groups(world):
    results = _results(world.world_size, "adamw_groups", False)
    for stage in (1, 2):
        _assert_identical_on_every_rank(results, stage)
        if world.world_size <= 2:
            assert_trees_equal(results[0][stage], results[0]["ddp"])
        else:
            floor = results[0]["floor"]
            assert_within_floor(results[0][stage], results[0]["ddp"], floor, rel=1e-6, what=f"stage {stage}")
    # The groups changed the result: it differs from plain AdamW.
    plain = _results(world.world_size, "adamw", False)[0][2]
    assert max_rel_diff(results[0][2], plain) > 1e-3


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_the_torch_func_reference_is_bitwise_equal_to_ddp_at_one_and_two_ranks(n, opt_name):
    # The two references of ``helpers`` are one loop: grad + all-reduce mean is what DDP does.
    for clip in (False, True):
        for r in _results(n, opt_name, clip):
            assert_trees_equal(r["func"], r["ddp"])
