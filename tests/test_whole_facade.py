"""``ZeroOptimizer`` over torch.optim.Muon, torch.optim.Adafactor and ``[Muon, AdamW]``,
against DistributedDataParallel + the same torch optimizers, on real gloo ranks.

The facade maps the wrapped optimizers onto the functional path of
``tests/test_whole_parity.py`` (Muon and Adafactor place their params whole, a list is a
``zf.optim.partition``), so the same models, data and tolerances apply:

* at 1 and 2 ranks, bitwise: stage 1 and 2, overlap on and off, ``no_sync``
  accumulation against DDP's ``no_sync``, clipping (``clip_grad_norm=`` and
  ``opt.clip_grad_norm_``) against DDP clipping with zerofn's float64 coefficient, and an
  LR scheduler on the wrapped Muon against the same scheduler on DDP's Muon;
* at 3 and 4 ranks with a float64 wire on both sides (``communication_dtype=torch.float64``,
  and a DDP communication hook that sums in float64): bitwise, stage 1 and 2. Three or
  four float32 addends then sum exactly, so the order of the sum (DDP's buckets, zerofn's
  rank-major rows) cannot show: what is left to differ is zerofn's own arithmetic. With
  a float32 wire the sums differ in the last bit and Muon's bfloat16 Newton-Schulz can
  turn that into a 1e-2 difference on one machine and none on another (see
  ``tests/test_whole_parity.py``, which judges the functional path against the noise
  floor measured over 24 steps); over these 9 steps a bitwise check is the one that
  holds on every machine.

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


def _clip_as_zerofn(params: list[nn.Parameter], max_norm: float) -> None:
    """Clip with zerofn's arithmetic: the norm in float64, ``1 / max(1, (norm + 1e-6) / max_norm)``."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    coef = 1.0 / max(1.0, (float(norm) + 1e-6) / max_norm)
    if coef != 1.0:
        for g in grads:
            g.mul_(coef)


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


def _wire64_hook(state, bucket):  # unannotated on purpose: DDP checks the annotations' objects
    """DDP communication hook: the mean with the sum in float64 (``g / N`` rounded once to float32)."""
    del state
    buf = bucket.buffer()
    wire = buf.mul(1.0 / dist.get_world_size()).double()
    return dist.all_reduce(wire, async_op=True).get_future().then(lambda f: f.value()[0].to(buf.dtype))


def _train_ddp(
    recipe, *, accumulate=False, clip64=False, schedule=False, bucket_cap_mb=None, grad_edit=None, wire64=False
):
    """DDP + the torch optimizers: params, the optimizers' state dicts, their lrs."""
    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(whole_model(recipe)), find_unused_parameters=True, **kw)
    if wire64:
        ddp.register_comm_hook(None, _wire64_hook)
    opts, scheds = _wrapped(recipe, ddp.module, schedule)
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        for o in opts:
            o.zero_grad(set_to_none=True)
        micro = _micro(x, y, accumulate)
        for i, (xm, ym) in enumerate(micro):
            with ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                ((ddp(xm, use_gate=gate_used(step)) - ym) ** 2).mean().backward()
        if grad_edit is not None:  # a floor variant: other last bits in the averaged gradients
            grad_edit(ddp.module)
        if clip64:
            _clip_as_zerofn(list(ddp.parameters()), MAX_NORM)
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
    out = {}
    for name, zkw, dkw in CONFIGS:
        out[name] = _train_facade(recipe, **zkw), _train_ddp(recipe, **dkw)
    return out


def _states_equal(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for mine, plain in zip(ours, theirs, strict=True):
        assert set(mine["state"]) == set(plain["state"])
        for index, entry in plain["state"].items():
            assert_trees_equal(mine["state"][index], entry)
        assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in plain["param_groups"]]
        assert [g["lr"] for g in mine["param_groups"]] == [g["lr"] for g in plain["param_groups"]]


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_bitwise_equal_to_ddp_with_the_same_torch_optimizers_at_one_and_two_ranks(n, recipe):
    for rank_result in get_world(n).run(_run_bitwise, recipe):
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


def _run_wide(recipe):
    """The facade at stage 1 and 2 and DDP, both with a float64 wire."""
    wide = {stage: _train_facade(recipe, stage, overlap=stage == 2, wire=torch.float64) for stage in (1, 2)}
    return wide, _train_ddp(recipe, wire64=True)


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [3, 4], ids=["N3", "N4"])
def test_bitwise_equal_to_ddp_at_three_and_four_ranks_with_a_float64_wire(n, recipe):
    results = get_world(n).run(_run_wide, recipe)
    for wide, (ddp64, ddp64_state, ddp64_lrs) in results:
        assert not torch.equal(ddp64["a.weight"], whole_model(recipe).a.weight.detach())
        for stage in (1, 2):
            # Three or four float32 addends sum exactly in float64 on both sides, and
            # zerofn gives DDP's bits.
            params, state, lrs = wide[stage]
            assert_trees_equal(params, ddp64)
            _states_equal(state, ddp64_state)
            assert lrs == ddp64_lrs


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
