"""``ZeroOptimizer`` over torch.optim.Muon, torch.optim.Adafactor and ``[Muon, AdamW]``,
against DistributedDataParallel + the same torch optimizers, on real gloo ranks.

The facade maps the wrapped optimizers onto the functional path of
``tests/test_whole_parity.py`` (Muon and Adafactor place their params whole, a list is a
``zf.optim.partition``), so the same models, data and tolerances apply:

* at 1 and 2 ranks, bitwise: stage 1 and 2, overlap on and off, ``no_sync``
  accumulation against DDP's ``no_sync``, clipping (``clip_grad_norm=`` and
  ``opt.clip_grad_norm_``) against DDP clipping with zerofn's float64 coefficient, and an
  LR scheduler on the wrapped Muon against the same scheduler on DDP's Muon;
* at 3 and 4 ranks the same configurations with a float64 wire on both sides
  (``communication_dtype=torch.float64`` and ``helpers.float64_wire_hook`` on DDP):
  bitwise. Three or four fp32 addends then sum exactly in float64 and are rounded to fp32
  once, so the order of the sum (DDP's buckets, zerofn's rank-major rows) cannot show,
  and Muon's bfloat16 Newton-Schulz and AdamW get the same bits on both sides: any
  difference is zerofn's own arithmetic. (On the fp32 wire the sums differ in the last bit, which Muon's bfloat16
  Newton-Schulz can turn into a 1e-2 difference: no comparison is made there.)

Bitwise everywhere also needs the clipping coefficient exact: the DDP side clips with
zerofn's arithmetic (``helpers.clip_in_float64``: the norm in float64, the coefficient in
Python floats); the two float64 norms may differ in their last bit (other summation order),
which changes the fp32 coefficient with a chance of about 2**-29 per step.

The state dicts are torch's: each dict of ``state_dict()`` equals, bitwise, the state of
the plain torch optimizer that trained next to DDP, and loads into it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import get_world
from helpers import (
    WHOLE_ADAFACTOR,
    WHOLE_ADAMW,
    WHOLE_MUON,
    WHOLE_RECIPES,
    assert_trees_equal,
    batches,
    clip_in_float64,
    exact_wire,
    float64_wire_hook,
    gate_used,
    whole_model,
    whole_torch_optimizers,
)

import zerofn as zf

pytestmark = pytest.mark.numerics

STEPS = 9  # three layer drops
BUCKET = 64  # small: several buckets, split and whole
MAX_NORM = 0.05  # below every step's gradient norm here: clipping acts


def _micro(x: torch.Tensor, y: torch.Tensor, accumulate: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[:4], y[:4]), (x[4:], y[4:])] if accumulate else [(x, y)]


def _decay(step: int) -> float:
    return 0.8**step


def _wrapped(recipe: str, model: nn.Module, schedule: bool) -> tuple[list[torch.optim.Optimizer], list]:
    opts = whole_torch_optimizers(recipe, list(model.named_parameters()))
    scheds = [torch.optim.lr_scheduler.LambdaLR(opts[0], _decay)] if schedule else []
    return opts, scheds


def _train_facade(recipe, stage, *, overlap=False, accumulate=False, clip=None, schedule=False, wire=None):
    """Train with ZeroOptimizer over the torch optimizers; ``clip``: None, "option" or "method"."""
    model = whole_model(recipe)
    opts, scheds = _wrapped(recipe, model, schedule)
    zo = zf.ZeroOptimizer(
        opts if len(opts) > 1 else opts[0],
        partition_grad=stage == 2,
        overlap_communication=overlap,
        reduce_bucket_size=BUCKET,
        clip_grad_norm=MAX_NORM if clip == "option" else 0.0,
        communication_dtype=wire,
        module=model,
    )
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        micro = _micro(x, y, accumulate)
        for i, (xm, ym) in enumerate(micro):
            with zo.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                zo.backward(((model(xm, use_gate=gate_used(step)) - ym) ** 2).mean())
        if clip == "method":
            zo.clip_grad_norm_(MAX_NORM)
        zo.step()
        zo.zero_grad()
        for s in scheds:
            s.step()
    state = zo.state_dict()
    zo.close()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, state if isinstance(state, list) else [state], [g["lr"] for o in opts for g in o.param_groups]


def _train_ddp(recipe, *, accumulate=False, clip64=False, schedule=False, wire64=False):
    """DDP + the torch optimizers: params, the optimizers' state dicts, their lrs.

    ``clip64``: clip with zerofn's arithmetic (``helpers.clip_in_float64``); ``wire64``: the
    mean on a float64 wire (``helpers.float64_wire_hook``).
    """
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(whole_model(recipe)), find_unused_parameters=True)
    if wire64:
        ddp.register_comm_hook(None, float64_wire_hook)
    opts, scheds = _wrapped(recipe, ddp.module, schedule)
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        for o in opts:
            o.zero_grad(set_to_none=True)
        micro = _micro(x, y, accumulate)
        for i, (xm, ym) in enumerate(micro):
            with ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                ((ddp(xm, use_gate=gate_used(step)) - ym) ** 2).mean().backward()
        if clip64:
            clip_in_float64(ddp.parameters(), MAX_NORM)
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return params, [o.state_dict() for o in opts], [g["lr"] for o in opts for g in o.param_groups]


# (name, facade options, DDP options): every facade run next to the DDP run it must equal.
CONFIGS = [
    ("stage1", dict(stage=1), {}),
    ("stage2_overlap", dict(stage=2, overlap=True), {}),
    ("stage1_overlap_no_sync", dict(stage=1, overlap=True, accumulate=True), dict(accumulate=True)),
    ("stage2_no_sync", dict(stage=2, accumulate=True), dict(accumulate=True)),
    ("stage1_clip_option", dict(stage=1, clip="option"), dict(clip64=True)),
    ("stage2_overlap_clip_method", dict(stage=2, overlap=True, clip="method"), dict(clip64=True)),
    ("stage2_scheduler", dict(stage=2, schedule=True), dict(schedule=True)),
]


def _run_bitwise(recipe):
    """Every config of ``CONFIGS``: the facade next to DDP, both on the exact wire
    (``helpers.exact_wire``: the default fp32 one up to 2 ranks, float64 from 3)."""
    wire = exact_wire(dist.get_world_size())
    out = {}
    for name, zkw, dkw in CONFIGS:
        out[name] = _train_facade(recipe, **zkw, wire=wire), _train_ddp(recipe, **dkw, wire64=wire is not None)
    return out


def _states_equal(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for mine, plain in zip(ours, theirs, strict=True):
        assert set(mine["state"]) == set(plain["state"])
        for index, entry in plain["state"].items():
            assert_trees_equal(mine["state"][index], entry)
        assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in plain["param_groups"]]
        assert [g["lr"] for g in mine["param_groups"]] == [g["lr"] for g in plain["param_groups"]]


def _check_bitwise(rank_result, recipe):
    for name, ((params, state, lrs), (ddp_params, ddp_state, ddp_lrs)) in rank_result.items():
        assert not torch.equal(params["a.weight"], whole_model(recipe).a.weight.detach()), name
        assert_trees_equal(params, ddp_params)
        _states_equal(state, ddp_state)  # torch's format, torch's values
        assert lrs == ddp_lrs, name
    sched_lrs = rank_result["stage2_scheduler"][0][2]  # the scheduler drove its own optimizer's groups only
    first = WHOLE_ADAFACTOR if recipe == "adafactor" else WHOLE_MUON
    assert sched_lrs[0] == pytest.approx(first["lr"] * _decay(STEPS))
    if recipe == "muon_adamw":
        assert sched_lrs[-1] == WHOLE_ADAMW["lr"]


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_bitwise_equal_to_ddp_with_the_same_torch_optimizers_at_one_and_two_ranks(n, recipe):
    """Bitwise on the default fp32 wire: one or two addends per element sum to the same bits
    in any order, and DDP clips with zerofn's float64 arithmetic (module docstring)."""
    for rank_result in get_world(n).run(_run_bitwise, recipe):
        _check_bitwise(rank_result, recipe)


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [3, 4], ids=["N3", "N4"])
def test_bitwise_equal_to_ddp_at_three_and_four_ranks_with_a_float64_wire(n, recipe):
    """Bitwise on a float64 wire on both sides, every config of the 1- and 2-rank test:
    three or four fp32 addends sum exactly in any order, then one rounding to fp32, and
    DDP clips with zerofn's float64 arithmetic (module docstring)."""
    for rank_result in get_world(n).run(_run_bitwise, recipe):
        _check_bitwise(rank_result, recipe)


def _round_trip():
    """state_dict() into plain torch optimizers and back, for [Muon, AdamW] at stage 2."""
    model = whole_model("muon_adamw")
    opts, _ = _wrapped("muon_adamw", model, False)
    zo = zf.ZeroOptimizer(opts, partition_grad=True, reduce_bucket_size=BUCKET, module=model)
    for step, (x, y) in enumerate(batches(dist.get_rank(), 4)):
        zo.backward(((model(x, use_gate=gate_used(step)) - y) ** 2).mean())
        zo.step()
        zo.zero_grad()
    saved = zo.state_dict()
    blocks = {key: entry for block, _ in zo.state_dict_shard(max_shard_size=100) for key, entry in block.items()}
    assert blocks.keys() == {(k, i) for k, sd in enumerate(saved) for i in sd["state"]}
    # Plain torch optimizers over the same params in the same order take each dict.
    plain = whole_torch_optimizers(
        "muon_adamw", [(n, nn.Parameter(p.detach().clone())) for n, p in model.named_parameters()]
    )
    for o, sd in zip(plain, saved, strict=True):
        o.load_state_dict(sd)
    plain_dicts = [o.state_dict() for o in plain]
    # A fresh facade loads the plain torch dicts (no zerofn entry: masters from the params).
    opts2, _ = _wrapped("muon_adamw", model, False)
    for o in opts2:  # the saved hyperparameters win, as in torch
        o.param_groups[0]["lr"] = 0.5
    zo2 = zf.ZeroOptimizer(opts2, partition_grad=True, reduce_bucket_size=BUCKET, module=model)
    zo2.load_state_dict(plain_dicts)
    again = zo2.state_dict()
    errors = []
    short = {**plain_dicts[1], "param_groups": [{**plain_dicts[1]["param_groups"][0], "params": [0, 1]}]}
    for wrong in (saved[0], saved[:1], [saved[1], saved[0]], [plain_dicts[0], short]):
        try:
            zo2.load_state_dict(wrong)
        except zf.CheckpointError as e:
            errors.append(str(e))
    zo.close()
    zo2.close()
    return saved, again, [o.param_groups[0]["lr"] for o in opts2], errors


def test_state_dict_is_a_list_of_torch_dicts_that_load_into_plain_optimizers_and_back():
    for saved, again, lr, errors in get_world(2).run(_round_trip):
        assert len(saved) == 2 and lr == [WHOLE_MUON["lr"], WHOLE_ADAMW["lr"]]
        _states_equal(again, saved)
        for mine, before in zip(again, saved, strict=True):
            assert_trees_equal(mine["zerofn"]["master"], before["zerofn"]["master"])
        assert len(errors) == 4
        assert "wraps 2 optimizers: load_state_dict takes a list of 2 state dicts" in errors[0]
        assert "got a list of 1" in errors[1]
        assert "no param 'a.weight'" in errors[2]  # swapped: the zerofn entry names the first misfit
        assert "state dict [1] has param groups of [2] params, but wrapped optimizer [1] has groups of [4]" in errors[3]


def test_each_param_in_exactly_one_wrapped_optimizer():
    model = whole_model("muon_adamw")
    w, b = model.a.weight, model.a.bias
    rest = [p for n, p in model.named_parameters() if n not in ("a.weight", "a.bias")]
    with pytest.raises(ValueError, match=r"param 'a.weight' is in optimizers\[0\] and optimizers\[1\]"):
        zf.ZeroOptimizer([torch.optim.Muon([w]), torch.optim.AdamW([w, b, *rest])], module=model)
    with pytest.raises(ValueError, match=r"\('a.bias'\); each param must be in exactly one of them"):
        zf.ZeroOptimizer([torch.optim.Muon([w]), torch.optim.AdamW(rest)], module=model)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer instances only, found str"):
        zf.ZeroOptimizer([torch.optim.Muon([w]), "adamw"], module=model)
