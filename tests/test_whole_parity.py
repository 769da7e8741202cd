"""Parity: whole-tensor optimizers (torch.optim.Muon, torch.optim.Adafactor, Muon + AdamW)
through the functional ZeRO loop against DistributedDataParallel + the same torch optimizers.

Every rank trains from the same start on the same per-rank batches:

* zerofn: ``reduce_grads`` (stage 1 and 2) -> ``step_shards`` -> ``gather_params``, with
  :func:`zerofn.torch_optim.from_torch` driving the torch class on what each rank holds
  (whole matrices on their owners for Muon/Adafactor, 1-D shards for AdamW), combined by
  :func:`zerofn.optim.partition` for Muon + AdamW;
* reference: ``DistributedDataParallel(find_unused_parameters=True)`` and the torch
  optimizers on the full params (``torch.nn.utils.clip_grad_norm_`` when clipping,
  ``no_sync`` for accumulation).

The model has the usual corners: ``gate`` dropped every third step (missing grads),
``unused`` never in the forward (``None`` grads), nothing divisible by 2, 3 or 4.

Every comparison is bitwise, at every world size, because both sides run the same
arithmetic on the same bits:

* the mean gradient (``helpers.exact_wire``): at 1 and 2 ranks the default fp32 wire, the
  one users keep (one addend, or two in either order); at 3 and 4 ranks a float64 wire on
  both sides (zerofn ``comm_dtype=torch.float64``, DDP ``helpers.float64_wire_hook``):
  each rank scales its fp32 gradient by the same 0-d fp32 1/N, three or four fp32 addends
  sum exactly in float64 in any order, and both round the exact sum to fp32 once. On the
  fp32 wire at 3 and 4 ranks gloo adds an element's addends in an order that depends on
  its offset in the flat buffer, and zerofn's rows place elements elsewhere than DDP's
  buckets, so some mean-gradient elements differ in the last bit; ``torch.optim.Muon``
  casts the momentum to bfloat16 for its Newton-Schulz iterations, where a last-bit
  difference that crosses a bfloat16 rounding boundary becomes a 2^-8 relative change
  spread over the whole matrix: an amplifier whose output depends on the machine's
  kernels. With identical mean-gradient bits Muon runs on identical inputs.
* the optimizers: the torch class runs unchanged on the full tensor on its owner (Muon,
  Adafactor), AdamW's float32 kernels are element-wise (a shard gives the whole tensor's
  bits).
* clipping: zerofn computes the norm in float64 and the coefficient in Python floats; the
  reference clips the same way (``clip_dtype=torch.float64``; torch's ``clip_grad_norm_``
  rounds both in float32, and against it zerofn differs by exactly what the two DDP
  clippings differ by). The two float64 norms may differ in their last bit (another
  order of the sum of squares), which flips the float32 coefficient only within one
  float64 ulp of a float32 rounding boundary: a chance of about 2**-29 a step.

The fp32 wire at 3 and 4 ranks, where no amplifier acts, is checked against its error
bound in ``tests/test_parity_ddp.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import (
    WHOLE_ADAFACTOR,
    WHOLE_ADAMW,
    WHOLE_MUON,
    WHOLE_RECIPES,
    assert_trees_equal,
    batches,
    ddp_reference,
    exact_wire,
    gate_used,
    is_matrix,
    max_rel_diff,
    seeded,
    whole_model,
    whole_torch_optimizers,
)
from torch.func import functional_call, grad

import zerofn as zf
from zerofn.testing import World

pytestmark = pytest.mark.numerics

STEPS = 24
BUCKET = 64  # small: several buckets, split and whole
MAX_NORM = 0.05  # below every step's gradient norm here: clipping acts


def _zero_optimizer(recipe: str) -> zf.optim.Optimizer:
    muon = zf.torch_optim.from_torch(torch.optim.Muon, **WHOLE_MUON)
    if recipe == "muon":
        return muon
    if recipe == "adafactor":
        return zf.torch_optim.from_torch(torch.optim.Adafactor, **WHOLE_ADAFACTOR)
    return zf.optim.partition([(is_matrix, muon), (lambda n: True, zf.optim.adamw(**WHOLE_ADAMW))])


def _loss(model, params, x, y, use_gate):
    return ((functional_call(model, params, (x,), {"use_gate": use_gate}) - y) ** 2).mean()


def _micro(x, y, accumulate):
    return [(x[:4], y[:4]), (x[4:], y[4:])] if accumulate else [(x, y)]


def _train_zero(recipe, stage, clip, accumulate):
    """The functional loop on the exact wire (``comm_dtype=exact_wire(N)``)."""
    rank = dist.get_rank()
    wire = exact_wire(dist.get_world_size())
    model = whole_model(recipe)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = zf.shard_params(params, _zero_optimizer(recipe))
    clipped = 0
    for step, (x, y) in enumerate(batches(rank, STEPS)):
        use_gate = gate_used(step)
        grads: dict = {}
        for xm, ym in _micro(x, y, accumulate):  # summed over micro-batches, as .grad accumulates
            g = grad(functools.partial(_loss, model))(params, xm, ym, use_gate)
            grads = {n: grads[n] + t if n in grads else t for n, t in g.items()}
        grads["unused.weight"] = None
        if "unused.bias" in grads:
            grads["unused.bias"] = None
        if not use_gate:
            grads = {n: t for n, t in grads.items() if not n.startswith("gate.")}
        shards = zf.reduce_grads(grads, state.layout, stage=stage, bucket_numel=BUCKET, comm_dtype=wire)
        state, info = zf.step_shards(state, shards, max_norm=MAX_NORM if clip else None)
        assert not info.skipped
        clipped += info.clip_coef < 1.0
        params = zf.gather_params(state, bucket_numel=BUCKET)
    return params, clipped, dict(state.layout.owners)


def _train_ddp(recipe, clip, accumulate, clip64=False):
    """DDP on the exact wire (``helpers.float64_wire_hook`` at N >= 3)."""
    micro = (m for x, y in batches(dist.get_rank(), STEPS) for m in _micro(x, y, accumulate))
    return ddp_reference(
        whole_model(recipe),
        lambda m: whole_torch_optimizers(recipe, list(m.named_parameters())),
        micro,
        steps=STEPS,
        accumulate=2 if accumulate else 1,
        clip=MAX_NORM if clip else None,
        clip_dtype=torch.float64 if clip64 else torch.float32,
        wire=exact_wire(dist.get_world_size()),
    )["params"]


def _train_all(recipe, clip, accumulate):
    out = {"initial": {n: p.detach().clone() for n, p in whole_model(recipe).named_parameters()}, "clipped": {}}
    for stage in (1, 2):
        out[stage], out["clipped"][stage], out["owners"] = _train_zero(recipe, stage, clip, accumulate)
    out["ddp"] = _train_ddp(recipe, clip, accumulate)
    if clip:  # DDP clipping with zerofn's float64 arithmetic (the last bits of the coefficient)
        out["ddp_clip64"] = _train_ddp(recipe, clip, accumulate, clip64=True)
    return out


_cache: dict[tuple, list] = {}


def _results(n, recipe, clip, accumulate=False):
    key = (n, recipe, clip, accumulate)
    if key not in _cache:
        _cache[key] = get_world(n).run(_train_all, recipe, clip, accumulate)
    return _cache[key]


def _check_moved(result):
    for name, p in result["ddp"].items():
        moved = not torch.equal(p, result["initial"][name])
        assert moved == (not name.startswith("unused")), name


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_bitwise_equal_to_ddp_at_one_and_two_ranks_without_clipping(n, recipe):
    # The default fp32 wire and DDP's own all-reduce (exact_wire is None here): one addend
    # or two, so the mean gradient has DDP's bits.
    assert exact_wire(n) is None
    results = _results(n, recipe, False)
    _check_moved(results[0])
    for r in results:
        assert_trees_equal(r[1], r["ddp"])
        assert_trees_equal(r[2], r["ddp"])
    if n == 2:  # whole params really are spread over both ranks
        assert set(results[0]["owners"].values()) == {0, 1}


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_accumulation_is_bitwise_equal_to_ddp_no_sync_at_one_and_two_ranks(n, recipe):
    # Exact as above: both sides sum the two micro-batch gradients locally in the same
    # order, then reduce the sum once.
    for r in _results(n, recipe, False, accumulate=True):
        assert_trees_equal(r[1], r["ddp"])
        assert_trees_equal(r[2], r["ddp"])


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
def test_bitwise_equal_to_ddp_at_three_and_four_ranks_on_the_float64_wire_stage_1_and_2_clip_on_and_off(recipe):
    # Exact: three or four fp32 addends sum exactly in float64 on both sides, so the mean
    # gradient has the same bits, and Muon's bfloat16 Newton-Schulz, Adafactor and AdamW
    # run on the same inputs; with clipping both sides clip in float64.
    for n in (3, 4):
        assert exact_wire(n) == torch.float64
        for clip in (False, True):
            results = _results(n, recipe, clip)
            r0 = results[0]
            _check_moved(r0)
            assert len(set(r0["owners"].values())) > 1  # whole params spread over the ranks
            reference = r0["ddp_clip64"] if clip else r0["ddp"]
            for stage in (1, 2):
                for r in results:
                    assert_trees_equal(r[stage], r0[stage])  # identical on every rank
                    assert_trees_equal(r[stage], reference)
                assert r0["clipped"][stage] == (STEPS if clip else 0)


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_clipping_is_bitwise_equal_to_ddp_clipping_in_float64_and_clips_every_step(n, recipe):
    # torch's clip_grad_norm_ computes the coefficient in float32, zerofn (as ColossalAI) in
    # float64: against DDP clipping with zerofn's arithmetic the result is bitwise; against
    # torch's clipping it differs by exactly what the two DDP clippings differ by.
    for r in _results(n, recipe, True):
        for stage in (1, 2):
            assert_trees_equal(r[stage], r["ddp_clip64"])
            assert max_rel_diff(r[stage], r["ddp"]) == max_rel_diff(r["ddp_clip64"], r["ddp"])
            assert r["clipped"][stage] == STEPS


def _leave_float64_as_the_default_dtype():
    """What an earlier run on a pool's rank may leave behind: another default dtype."""
    torch.set_default_dtype(torch.float64)


def test_clipping_parity_does_not_depend_on_what_an_earlier_run_left_on_the_rank():
    # A pool reuses its ranks, so a global torch setting one run changes would reach the
    # next: with float64 left as the default dtype, the model and batches below would be
    # float64 and zerofn's Muon loop no longer bitwise DDP's. The pool puts torch's settings
    # back before every run (zerofn/testing/_rank_state.py), so the verdict of a test does
    # not depend on which tests ran on its pool first.
    with World(1) as world:
        world.run(_leave_float64_as_the_default_dtype)
        (r,) = world.run(_train_all, "muon", True, False)
    for stage in (1, 2):
        assert all(p.dtype == torch.float32 for p in r[stage].values())
        assert_trees_equal(r[stage], r["ddp_clip64"])


def _one_step_norm():
    torch.manual_seed(seeded(1))
    params = {"w": torch.randn(5, 4), "v": torch.randn(3, 3), "b": torch.randn(7)}
    opt = zf.optim.partition(
        [(["w", "v"], zf.torch_optim.from_torch(torch.optim.Muon, lr=0.02)), (["b"], zf.optim.sgd(lr=0.1))]
    )
    state = zf.shard_params(params, opt)
    gen = torch.Generator().manual_seed(seeded(dist.get_rank()))
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    shards = zf.reduce_grads(grads, state.layout, comm_dtype=exact_wire(dist.get_world_size()))
    _, info = zf.step_shards(state, shards)
    return info.grad_norm, grads


def test_global_norm_counts_every_param_once(world):
    # The mean gradient has zerofn's bits: each rank's g * (1/N) (the same fp32 factor),
    # summed exactly in float64 (three or four fp32 addends; zerofn's exact wire at
    # N >= 3, and at N <= 2 the fp32 sum of two addends is that exact sum rounded once),
    # rounded to fp32 once. The norms of both sides are float64 over the same elements and
    # differ only in float64 rounding (other orders of the sum of squares, 2**-53 relative
    # per addition over 36 elements); counting a param twice or not at all is off by 1e-1.
    results = world.run(_one_step_norm)
    n = world.world_size
    mean = {k: sum((r[1][k] * (1.0 / n)).double() for r in results).float() for k in results[0][1]}
    want = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in mean.values()]).double()).item()
    for norm, _ in results:
        assert norm == pytest.approx(want, rel=1e-12)
