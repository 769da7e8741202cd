"""DDP gradient idioms under ZeroOptimizer, against DDP + torch.optim on real gloo ranks.

What a ported DDP script does with gradients between ``backward`` and ``step`` either
behaves as with DDP or stops on every rank with a message naming the facade's way:

* stage 1: ``p.grad`` holds the averaged gradient as DDP leaves it (plain
  ``loss.backward()`` or ``opt.backward(loss)``, overlap on and off, ``no_sync``
  accumulation, layer drop), so ``torch.nn.utils.clip_grad_norm_``, ``GradScaler``
  (``unscale_``, ``step``, ``update``) and edits of ``p.grad`` train as with DDP;
* stage 2: ``opt.clip_grad_norm_`` clips as torch's function does; torch's
  ``clip_grad_norm_`` / ``clip_grad_value_`` / ``GradScaler`` on the model's params raise
  :class:`ShardedGradError` on every rank and change nothing;
* ``get_grad_norm()`` between backward and step is the current gradients' norm, after
  step the last step's; under fp16 loss scaling it is the true (unscaled) norm.

Tolerances: the params are bitwise DDP's at every N. At N = 2 on the default fp32 wire
(both multiply by 1/2 before summing; a sum of two numbers does not depend on its order);
at N = 3 (and the 2 x 2 hybrid) on a float64 wire on both sides (``helpers.exact_wire``:
the facade's ``communication_dtype=torch.float64``, DDP's ``helpers.float64_wire_hook``),
where the sum of N fp32 addends is exact in any order. Then ``p.grad`` is DDP's bit for
bit, torch's own clipping on it gives the same bits on both sides, and the same torch
AdamW steps follow. Where the facade clips (``opt.clip_grad_norm_``, ``clip_grad_norm=``)
it computes the norm in float64 and the coefficient in Python floats: DDP's side clips
with that arithmetic (``helpers.clip_in_float64``). The two float64 norms add the same
squares in other orders and may differ in their last bit, which changes the fp32
coefficient only when it lies within that bit of an fp32 rounding boundary: a chance of
about 2**-29 a step. The norms themselves are compared with torch's float32 norm to 1e-6
relative (``PARITY``): fp32 norms of a few hundred elements, not amplified by anything.
Where the facade sums the means of two synced backwards and DDP averages the summed local
gradients, the reference is DDP summing the two means by hand (zerofn's order), bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import (
    Net,
    Snapshot,
    assert_trees_equal,
    batches,
    clip_in_float64,
    exact_wire,
    float64_wire_hook,
    gate_used,
    max_rel_diff,
    seeded,
)

import zerofn as zf
from zerofn.facade._reducer import ShardedGrad, ShardedGradError

PARITY = 1e-6
STEPS = 5
MAX_NORM = 0.1  # below the gradient norm of Net on these batches: every step clips


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _pair(stage: int, overlap: bool, **options: Any) -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
    """The same Net under the facade and under DDP, AdamW on both, on the exact wire.

    ``helpers.exact_wire``: fp32 at N <= 2; float64 from N = 3, the facade's
    ``communication_dtype`` and DDP's ``float64_wire_hook`` (exact in any summation order).
    """
    torch.manual_seed(seeded(0))
    model = Net()
    wire = exact_wire(dist.get_world_size())
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    if wire is not None:
        ddp.register_comm_hook(None, float64_wire_hook)
    topt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    zopt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        partition_grad=stage == 2,
        overlap_communication=overlap,
        reduce_bucket_size=64,
        module=model,
        communication_dtype=wire,
        **options,
    )
    return model, zopt, topt, ddp


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _moved(model: nn.Module) -> float:
    """How far training moved ``model``'s params from ``_pair``'s start (seed-0 Net)."""
    torch.manual_seed(seeded(0))
    return max_rel_diff(_named(model), _named(Net()))


def _torch_norm(module: nn.Module) -> float:
    """torch's float32 total 2-norm of ``module``'s gradients (``clip_grad_norm_``'s), clipping nothing."""
    return float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None]))


def _grad_diffs(model: nn.Module, ddp: Any) -> dict[str, Any]:
    """Per param: None where both have no gradient, else max|facade - DDP| / max|DDP| (inf if one is None)."""
    out: dict[str, Any] = {}
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            out[name] = None if p.grad is None and q.grad is None else math.inf
        else:
            assert type(p.grad) is torch.Tensor and p.grad.dtype == q.grad.dtype
            out[name] = max_rel_diff({"g": p.grad}, {"g": q.grad})
    return out


# --------------------------------------------------------------------------- stage 1: p.grad as DDP's


def _inspect_and_clip_with_torch(overlap: bool, plain: bool, accumulate: int) -> dict[str, Any]:
    """Stage 1, the DDP script unchanged: backward, read p.grad, torch's clip_grad_norm_, step."""
    model, zopt, topt, ddp = _pair(1, overlap)
    data = batches(dist.get_rank(), STEPS * accumulate)
    diffs, norms = [], []
    for step in range(STEPS):
        use_gate = gate_used(step)
        for micro in range(accumulate):
            x, y = next(data)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else zopt.no_sync():
                loss = _loss(model(x, use_gate), y)
                loss.backward() if plain else zopt.backward(loss)
            with contextlib.nullcontext() if last else ddp.no_sync():
                _loss(ddp(x, use_gate), y).backward()
        diffs.append(_grad_diffs(model, ddp))
        ours = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        theirs = torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        norms.append((float(ours), float(theirs)))
        diffs.append(_grad_diffs(model, ddp))  # the clipped gradients, which step applies
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
    return {"diffs": diffs, "norms": norms, "zero": _named(model), "ref": _named(ddp.module), "moved": _moved(model)}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_stage1_p_grad_is_ddps_and_torch_clipping_trains_as_with_ddp(worlds, n, overlap):
    """Stage 1: torch's clip_grad_norm_ on the model between backward and step clips, as with DDP.

    Bitwise at N = 2 and 3 (the exact wire): ``p.grad`` is DDP's bit for bit before and
    after torch's clipping (the same function on the same bits gives the same norm and
    coefficient), and so are the params after 5 AdamW steps.
    """
    configs = [(plain, accumulate) for plain in (False, True) for accumulate in (1, 3)]
    for plain, accumulate in configs:
        label = f"N={n} overlap={overlap} plain={plain} accumulate={accumulate}"
        for res in worlds[n].run(_inspect_and_clip_with_torch, overlap, plain, accumulate):
            for step_diffs in res["diffs"]:
                assert step_diffs["unused.weight"] is None and step_diffs["unused.bias"] is None, label
                worst = max(d for d in step_diffs.values() if d is not None)
                assert worst == 0.0, label
            for ours, theirs in res["norms"]:
                assert ours > MAX_NORM and ours == theirs, label
            assert_trees_equal(res["zero"], res["ref"])
            assert res["moved"] > 1e-3, label


def _torch_clipping_between_backward_and_step(stage: int, overlap: bool) -> dict[str, Any]:
    """A DDP script's torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1) between backward and step, 4 steps."""
    model, zopt, topt, ddp = _pair(stage, overlap)
    for x, y in batches(dist.get_rank(), 4):
        zopt.backward(_loss(model(x), y))
        try:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
        except ShardedGradError as e:
            return {"error": str(e)}
        _loss(ddp(x), y).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.1))
        assert norm == ref_norm, (norm, ref_norm)  # torch's function on bitwise-equal gradients
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
    return {"zero": _named(model), "ref": _named(ddp.module), "moved": _moved(model), "error": None}


@pytest.mark.parametrize("n", [2, 3])
def test_torch_clipping_between_backward_and_step_clips_or_says_how(worlds, n):
    """torch's clip_grad_norm_ on the model clips as with DDP at stage 1; at stage 2 it raises, naming the facade's.

    Stage 1 bitwise at N = 2 and 3 (the exact wire; torch's clipping on equal bits).
    """
    for stage in (1, 2):
        for overlap in (False, True):
            for res in worlds[n].run(_torch_clipping_between_backward_and_step, stage, overlap):
                if stage == 1:
                    assert res["error"] is None
                    assert_trees_equal(res["zero"], res["ref"])
                    assert res["moved"] > 1e-3, f"N={n} overlap={overlap}"
                else:
                    assert "opt.clip_grad_norm_(max_norm)" in res["error"]


def _edit_p_grad() -> dict[str, Any]:
    """Stage 1: step applies what the user left in p.grad: scaled, replaced, set to None."""
    model, zopt, topt, ddp = _pair(1, False)
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        zopt.backward(_loss(model(x), y))
        _loss(ddp(x), y).backward()
        for m in (model, ddp.module):
            with torch.no_grad():
                m.a.weight.grad.mul_(0.5)  # in place
                m.b.weight.grad = m.b.weight.grad.clamp(-0.01, 0.01)  # a new tensor
                if step % 2:
                    m.a.bias.grad = None  # left out of this step
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
    return {"zero": _named(model), "ref": _named(ddp.module)}


def test_stage1_step_uses_what_the_user_left_in_p_grad(worlds):
    for res in worlds[2].run(_edit_p_grad):
        assert_trees_equal(res["zero"], res["ref"])


def _precision_accumulation(stage_overlap: tuple[int, bool]) -> dict[str, Any]:
    """bf16 params, float32 accumulation under no_sync: p.grad after the closing backward.

    The reference is ColossalAI's reduction of the float32 sums: ``acc * (1/N)`` rounded to
    bf16 (the wire), all-reduced, the p.grad DDP would hold for such a wire.
    """
    _, overlap = stage_overlap
    torch.manual_seed(seeded(0))
    model = Net()
    ref = copy.deepcopy(model).to(torch.bfloat16)
    zopt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        forced_dtype=torch.bfloat16,
        overlap_communication=overlap,
        reduce_bucket_size=64,
        module=model,
    )
    n = dist.get_world_size()
    acc: dict[str, torch.Tensor] = {}
    for micro, (x, y) in enumerate(batches(dist.get_rank(), 3)):
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        with contextlib.nullcontext() if micro == 2 else zopt.no_sync():
            zopt.backward(_loss(model(x, micro != 2), y))  # gate: no gradient in the closing micro-step
        _loss(ref(x, micro != 2), y).backward()
        for k, p in ref.named_parameters():
            if p.grad is not None:
                acc[k] = p.grad.float() if k not in acc else acc[k].add_(p.grad)
                p.grad = None
    expected = {}
    for k, a in acc.items():
        wire = a.mul(1.0 / n).to(torch.bfloat16)
        dist.all_reduce(wire)
        expected[k] = wire
    got = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return {"got": got, "expected": expected, "accum": dict(zopt._reducer.accum)}


@pytest.mark.parametrize("overlap", [False, True])
def test_stage1_p_grad_after_float32_accumulation_holds_the_reduced_bf16_gradient(worlds, overlap):
    """Layer drop in the closing micro-step included: the accumulated gate gradient is averaged too."""
    for res in worlds[2].run(_precision_accumulation, (1, overlap)):
        assert res["accum"] == {}
        assert_trees_equal(res["got"], res["expected"])
        assert set(res["got"]) == {"a.weight", "a.bias", "gate.weight", "gate.bias", "b.weight", "b.bias"}


# --------------------------------------------------------------------------- clip_grad_norm_ of the facade


def _clip_with_the_facade(stage: int, overlap: bool) -> dict[str, Any]:
    """``opt.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on DDP's gradients."""
    model, zopt, topt, ddp = _pair(stage, overlap)
    norms = []
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        zopt.backward(_loss(model(x, gate_used(step)), y))
        _loss(ddp(x, gate_used(step)), y).backward()
        ours = zopt.clip_grad_norm_(MAX_NORM)
        theirs = _torch_norm(ddp.module)  # torch's float32 norm, for the norm's check
        clip_in_float64(ddp.parameters(), MAX_NORM)  # the facade's arithmetic, for bitwise params
        norms.append((ours, theirs))
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
    return {"norms": norms, "zero": _named(model), "ref": _named(ddp.module), "moved": _moved(model)}


@pytest.mark.parametrize("n", [2, 3])
def test_the_facades_clip_grad_norm_matches_torchs_at_both_stages(worlds, n):
    """opt.clip_grad_norm_ clips as torch's function does, at stage 1 and at stage 2.

    The norm within 1e-6 of torch's float32 one; the params bitwise DDP's clipped with the
    facade's float64 arithmetic (``clip_in_float64``), on the exact wire: the coefficient
    could differ only if the two float64 norms (other summation orders) straddle an fp32
    rounding boundary, a chance of about 2**-29 a step.
    """
    for stage in (1, 2):
        for overlap in (False, True):
            label = f"N={n} stage={stage} overlap={overlap}"
            for res in worlds[n].run(_clip_with_the_facade, stage, overlap):
                for ours, theirs in res["norms"]:
                    assert isinstance(ours, torch.Tensor) and ours.dim() == 0 and ours.dtype == torch.float32
                    assert float(ours) > MAX_NORM and abs(float(ours) - theirs) <= PARITY * theirs, label
                assert_trees_equal(res["zero"], res["ref"])
                assert res["moved"] > 1e-3, label


def _clip_arguments() -> dict[str, Any]:
    model, zopt, _, _ = _pair(2, False)
    out: dict[str, Any] = {"empty": float(zopt.clip_grad_norm_(1.0))}  # nothing held: 0, as torch
    x, y = next(batches(dist.get_rank(), 1))
    zopt.backward(_loss(model(x), y))
    before = zopt.get_grad_norm()
    out["inf_norm"] = float(zopt.clip_grad_norm_(1e9, norm_type=math.inf))
    out["unclipped"] = zopt.get_grad_norm() == before  # a large max_norm changes nothing
    for bad in ({"max_norm": -1.0}, {"max_norm": 1.0, "norm_type": 1.0}):
        try:
            zopt.clip_grad_norm_(**bad)
        except ValueError as e:
            out.setdefault("errors", []).append(str(e))
    zopt.zero_grad()
    zopt.backward(_loss(model(x), y) * float("inf"))
    try:
        zopt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    except RuntimeError as e:
        out["nonfinite"] = str(e)
    out["nonfinite_norm"] = float(zopt.clip_grad_norm_(1.0))
    return out


def test_clip_grad_norm_arguments_nothing_held_and_nonfinite_norms(worlds):
    for res in worlds[2].run(_clip_arguments):
        assert res["empty"] == 0.0
        assert res["unclipped"] and res["inf_norm"] > 0
        assert len(res["errors"]) == 2 and "max_norm" in res["errors"][0] and "norm_type" in res["errors"][1]
        assert "non-finite" in res["nonfinite"]
        assert math.isnan(res["nonfinite_norm"]) or math.isinf(res["nonfinite_norm"])


# --------------------------------------------------------------------------- get_grad_norm


def _grad_norm_before_and_after(stage: int, overlap: bool) -> dict[str, Any]:
    model, zopt, topt, ddp = _pair(stage, overlap, clip_grad_norm=MAX_NORM)
    rows = []
    for step, (x, y) in enumerate(batches(dist.get_rank(), 3)):
        zopt.backward(_loss(model(x, gate_used(step)), y))
        _loss(ddp(x, gate_used(step)), y).backward()
        before = zopt.get_grad_norm()  # a collective: every rank calls it
        again = zopt.get_grad_norm()
        theirs = _torch_norm(ddp.module)  # torch's float32 norm, for the norm's check
        clip_in_float64(ddp.parameters(), MAX_NORM)  # what clip_grad_norm= does in step
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
        rows.append((before, again, theirs, zopt.get_grad_norm(), zopt.last_step_info.grad_norm))
    return {"rows": rows, "zero": _named(model), "ref": _named(ddp.module), "moved": _moved(model)}


@pytest.mark.parametrize("n", [2, 3])
def test_get_grad_norm_is_the_current_norm_before_step_and_the_last_steps_after(worlds, n):
    """The norms to 1e-6 of torch's float32 norm; the params bitwise DDP's clipped with the
    facade's float64 arithmetic (``clip_in_float64``) on the exact wire (a coefficient flip
    between the two float64 norms' orders: about 2**-29 a step)."""
    for stage in (1, 2):
        for overlap in (False, True):
            for res in worlds[n].run(_grad_norm_before_and_after, stage, overlap):
                for before, again, theirs, after, info in res["rows"]:
                    assert before == again  # reading it changes nothing
                    assert abs(before - theirs) <= PARITY * theirs
                    assert after == info == before  # the step clipped exactly the gradients measured
                assert_trees_equal(res["zero"], res["ref"])
                assert res["moved"] > 1e-3, f"N={n} stage={stage} overlap={overlap}"


def _fp16_norms(stage: int) -> dict[str, Any]:
    """fp16 params with the dynamic loss scaler: the norms users see are the true ones."""
    torch.manual_seed(seeded(0))
    model = Net()
    zopt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        forced_dtype=torch.float16,
        initial_scale=2.0**10,
        partition_grad=stage == 2,
        reduce_bucket_size=64,
        module=model,
    )
    rows = []
    for x, y in batches(dist.get_rank(), 3):
        zopt.backward(_loss(model(x.half()), y.half()))
        scale = zopt.loss_scale
        current = zopt.get_grad_norm()
        clipped = float(zopt.clip_grad_norm_(1e-3))
        grad = zopt.get_param_grad(model.b.weight)
        zopt.step()
        zopt.zero_grad()
        rows.append((scale, current, clipped, zopt.last_step_info.grad_norm, float(grad.float().norm())))
    return {"rows": rows}


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_users_see_the_unscaled_norm_as_after_unscale(worlds, stage):
    for res in worlds[2].run(_fp16_norms, stage):
        for scale, current, clipped, stepped, b_norm in res["rows"]:
            assert scale == 2.0**10
            assert abs(current - clipped) <= PARITY * current  # float32 return value, as torch's
            assert 0 < current < 10  # the true norm, not ~1e3 times it
            assert b_norm <= current  # get_param_grad: the unscaled gradient too
            # The step measured the clipped gradients: about max_norm.
            assert stepped <= 1e-3 * (1 + 1e-2)


# --------------------------------------------------------------------------- GradScaler


def _grad_scaler_stage1(overlap: bool, clip: bool) -> dict[str, Any]:
    """``scaler.scale(loss).backward(); [scaler.unscale_(opt); clip]; scaler.step(opt); scaler.update()``."""
    model, zopt, topt, ddp = _pair(1, overlap)
    scalers = torch.amp.GradScaler("cpu", init_scale=2.0**8), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        for scaler, opt, net in ((scalers[0], zopt, model), (scalers[1], topt, ddp)):
            scaler.scale(_loss(net(x, gate_used(step)), y)).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return {
        "zero": _named(model),
        "ref": _named(ddp.module),
        "scales": [s.get_scale() for s in scalers],
        "moved": _moved(model),
    }


@pytest.mark.parametrize("n", [2, 3])
def test_grad_scaler_at_stage1_trains_as_with_ddp(worlds, n):
    """Bitwise at N = 2 and 3: the scale is a power of two (scaling and unscaling are exact),
    the mean gradient is DDP's on the exact wire, and torch's clipping sees equal bits."""
    for overlap in (False, True):
        for clip in (False, True):
            for res in worlds[n].run(_grad_scaler_stage1, overlap, clip):
                assert res["scales"][0] == res["scales"][1]
                assert_trees_equal(res["zero"], res["ref"])
                assert res["moved"] > 1e-3, f"N={n} overlap={overlap} clip={clip}"


def _torch_on_stage2_grads(overlap: bool) -> dict[str, Any]:
    """Every torch gradient idiom on the model's params at stage 2, after one backward."""
    model, zopt, _, _ = _pair(2, overlap)
    x, y = next(batches(dist.get_rank(), 1))
    idioms = {
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        "clip_grad_value_": lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1.0),
        "norm": lambda: model.a.weight.grad.norm(),
        "print": lambda: repr(model.a.weight.grad),
        "grad_scaler": None,  # below
    }
    scaler = torch.amp.GradScaler("cpu")
    zopt.backward(scaler.scale(_loss(model(x), y)))
    snap = Snapshot({"state": zopt.state, "params": _named(model)})
    shards = {n: t.clone() for n, t in zopt._reducer.shards.items()}
    errors: dict[str, str] = {}
    for name, idiom in idioms.items():
        try:
            idiom() if idiom is not None else scaler.step(zopt)
        except ShardedGradError as e:
            errors[name] = str(e)
    snap.assert_unchanged({"state": zopt.state, "params": _named(model)})
    kept = all(torch.equal(zopt._reducer.shards[n], t) for n, t in shards.items())
    unscale_error = None
    try:
        scaler.unscale_(zopt)
    except ShardedGradError as e:
        unscale_error = str(e)
    placeholders = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    # The facade's way works right after, and the next step trains.
    norm = float(zopt.clip_grad_norm_(1.0))
    zopt.step()
    zopt.zero_grad()
    return {"errors": errors, "kept": kept, "unscale": unscale_error, "placeholders": placeholders, "norm": norm}


@pytest.mark.parametrize("n", [2, 3])
def test_torch_gradient_idioms_at_stage2_raise_on_every_rank_and_change_nothing(worlds, n):
    """Each idiom says what to write instead; GradScaler names the facade's loss scaling, not torch's assertion."""
    for overlap in (False, True):
        for res in worlds[n].run(_torch_on_stage2_grads, overlap):
            assert set(res["errors"]) == {"clip_grad_norm_", "clip_grad_value_", "norm", "print", "grad_scaler"}
            for name in ("clip_grad_norm_", "clip_grad_value_", "norm", "print"):
                assert "opt.clip_grad_norm_(max_norm)" in res["errors"][name], name
                assert "opt.get_param_grad(p)" in res["errors"][name], name
                assert "partition_grad=False" in res["errors"][name], name
            for msg in (res["errors"]["grad_scaler"], res["unscale"]):
                assert "GradScaler" in msg and "opt.backward(loss)" in msg and "loss scaling" in msg
                assert "No inf checks" not in msg
            assert res["kept"]
            assert res["placeholders"]["a.weight"] == "ShardedGrad"
            assert res["placeholders"]["unused.weight"] == "NoneType"
            assert res["norm"] > 0


def _grad_scaler_at_stage2() -> dict[str, Any]:
    """torch's GradScaler driving a stage-2 facade, as a DDP + AMP script writes it."""
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True)
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(batches(dist.get_rank(), 1))
    before = _named(model)
    scaler.scale(_loss(model(x), y)).backward()
    try:
        scaler.step(opt)
        scaler.update()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "params": _named(model), "before": before}
    return {"type": None}


def test_grad_scaler_at_stage2_says_what_to_write_instead(worlds):
    for res in worlds[2].run(_grad_scaler_at_stage2):
        assert res["type"] == "ShardedGradError"
        assert "facade's own loss scaling" in res["message"] and "opt.backward(loss)" in res["message"]
        assert_trees_equal(res["params"], res["before"])


def _ddp_micro(ddp: Any, x: torch.Tensor, y: torch.Tensor, step: int, micro: int, held: dict[str, Any]) -> None:
    """DDP's side of micro-step ``micro`` of synced, no_sync, synced, summing the two means
    as the facade does (zerofn's order), where DDP itself would average ``mean + g1 + g2``.

    Micro 0 (synced) leaves DDP's mean of ``g0`` in ``p.grad``; micro 1 keeps it aside in
    ``held`` and clears ``p.grad``, so micro 1 (``no_sync``) and micro 2 (synced) leave
    DDP's mean of the local ``g1 + g2``; after micro 2 ``p.grad`` is the sum of the two
    means, one fp32 addition. On the exact wire each mean is the facade's bit for bit.
    """
    module = ddp.module
    if micro == 1:
        held.update({n: p.grad for n, p in module.named_parameters()})
        for p in module.parameters():
            p.grad = None
    with contextlib.nullcontext() if micro != 1 else ddp.no_sync():
        _loss(ddp(x, gate_used(step)), y).backward()
    if micro == 2:
        for n, p in module.named_parameters():
            first = held.pop(n)
            if first is not None:
                p.grad = first if p.grad is None else first + p.grad


# --------------------------------------------------------------------------- the placeholder


def _accumulate_over_placeholders(overlap: bool) -> dict[str, Any]:
    """Stage 2: two backwards before one step, and no_sync after a synced backward.

    Autograd never accumulates into the placeholder (it would raise: a 0-stride tensor
    cannot be written in place): the facade clears it first and sums the means.
    """
    model, zopt, topt, ddp = _pair(2, overlap)
    data = batches(dist.get_rank(), 3 * STEPS)
    ph = None
    held: dict[str, Any] = {}
    for step in range(STEPS):
        for micro in range(3):
            x, y = next(data)
            sync = micro != 1  # synced, no_sync, synced
            with contextlib.nullcontext() if sync else zopt.no_sync():
                zopt.backward(_loss(model(x, gate_used(step)), y))
            if ph is None:
                ph = model.a.weight.grad
            _ddp_micro(ddp, x, y, step, micro, held)
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
    with torch._C.DisableTorchFunctionSubclass():
        intact = ph.stride() == (0, 0) and float(ph[0, 0]) == 0.0 and ph._version == 0
    return {
        "zero": _named(model),
        "ref": _named(ddp.module),
        "intact": intact,
        "kind": type(ph).__name__,
        "moved": _moved(model),
    }


def test_autograd_never_accumulates_into_the_stage2_placeholder(worlds):
    """DDP sums the local gradients of the two synced backwards before averaging, the facade
    averages each and sums the means: bitwise DDP summing the two means itself
    (``_ddp_micro``), on the exact wire (each mean DDP's bit for bit, one fp32 addition of
    the two on both sides, then the same AdamW steps)."""
    for n in (2, 3):
        for overlap in (False, True):
            for res in worlds[n].run(_accumulate_over_placeholders, overlap):
                assert res["kind"] == "ShardedGrad" and res["intact"]
                assert_trees_equal(res["zero"], res["ref"])
                assert res["moved"] > 1e-3, f"N={n} overlap={overlap}"


def _gradient_memory(stage: int) -> dict[str, Any]:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    zopt = zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), partition_grad=stage == 2)
    x = torch.randn(4, 64)
    zopt.backward(model(x).square().mean())
    grads = [p.grad for p in model.parameters()]
    with torch._C.DisableTorchFunctionSubclass():  # the placeholder refuses even this otherwise
        storage = {g.untyped_storage().nbytes() for g in grads if isinstance(g, ShardedGrad)}
    return {
        "placeholders": sum(isinstance(g, ShardedGrad) for g in grads),
        "storage": storage,
        "grad_bytes": zopt.grad_bytes(),
        "shards": zopt.state.layout.shard_numel * 4,
        "ddp": sum(p.numel() for p in model.parameters()) * 4,
    }


def test_gradient_memory_is_ddps_at_stage1_and_the_stage2_placeholders_cost_none(worlds):
    """Stage 1 holds full gradients as DDP (nothing else once backward is done); stage 2 its shards only."""
    for res in worlds[2].run(_gradient_memory, 1):
        assert res["placeholders"] == 0 and res["grad_bytes"] == res["ddp"]
    for res in worlds[2].run(_gradient_memory, 2):
        assert res["placeholders"] == 16 and res["storage"] == {4}  # one float32 element per param
        assert res["grad_bytes"] == res["shards"]


def _zero_grad_and_cleared_placeholders() -> dict[str, Any]:
    """``p.grad = None`` after backward leaves the param out of the step, at both stages, as torch."""
    out = {}
    for stage in (1, 2):
        model, zopt, topt, ddp = _pair(stage, False)
        for x, y in batches(dist.get_rank(), 3):
            zopt.backward(_loss(model(x), y))
            _loss(ddp(x), y).backward()
            model.b.weight.grad = None
            ddp.module.b.weight.grad = None
            zopt.step()
            zopt.zero_grad()
            topt.step()
            topt.zero_grad()
        model.zero_grad()  # torch's own zero_grad at stage 2 clears the placeholders
        out[stage] = (_named(model), _named(ddp.module), [p.grad for p in model.parameters()])
    return out


def test_clearing_p_grad_after_backward_leaves_the_param_out_at_both_stages(worlds):
    for res in worlds[2].run(_zero_grad_and_cleared_placeholders):
        for stage in (1, 2):
            zero, ref, grads = res[stage]
            assert_trees_equal(zero, ref)
            assert all(g is None for g in grads)


# --------------------------------------------------------------------------- hybrid


def _hybrid_stage1_p_grad(overlap: bool) -> dict[str, Any]:
    """Stage 1 on 2 x 2 ranks (sub_dp_size=2): p.grad is the mean over all four ranks."""
    model, zopt, topt, ddp = _pair(1, overlap, sub_dp_size=2)
    diffs = []
    for step, (x, y) in enumerate(batches(dist.get_rank(), 3)):
        zopt.backward(_loss(model(x, gate_used(step)), y))
        _loss(ddp(x, gate_used(step)), y).backward()
        diffs.append(_grad_diffs(model, ddp))
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
    return {"diffs": diffs, "zero": _named(model), "ref": _named(ddp.module), "moved": _moved(model)}


@pytest.mark.parametrize("overlap", [False, True])
def test_stage1_p_grad_in_a_hybrid_layout_is_the_mean_over_all_ranks(worlds, overlap):
    """``p.grad`` and the params bitwise DDP's over the 4 ranks, on the float64 wire
    (``exact_wire(4)``: the sum of four fp32 addends is exact in float64, whichever
    grouping the shard group and the replicas give it; rounded to fp32 once)."""
    for res in worlds[4].run(_hybrid_stage1_p_grad, overlap):
        for step_diffs in res["diffs"]:
            assert step_diffs["unused.weight"] is None
            assert max(d for d in step_diffs.values() if d is not None) == 0.0
        assert_trees_equal(res["zero"], res["ref"])
        assert res["moved"] > 1e-3, f"overlap={overlap}"


# --------------------------------------------------------------------------- whole params


def _whole_param_grads(stage: int) -> dict[str, Any]:
    """Muon places every param whole on one owner: p.grad (stage 1), get_param_grad and the norm on every rank."""
    torch.manual_seed(seeded(0))
    model = nn.Sequential(nn.Linear(7, 13, bias=False), nn.Tanh(), nn.Linear(13, 5, bias=False))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    muon = zf.torch_optim.from_torch(torch.optim.Muon, lr=1e-2)
    zopt = zf.ZeroOptimizer(model.named_parameters(), muon, partition_grad=stage == 2, reduce_bucket_size=64)
    x, y = next(batches(dist.get_rank(), 1))
    zopt.backward(_loss(model(x), y))
    _loss(ddp(x), y).backward()
    theirs = {n: q.grad for n, q in zip(("0.weight", "2.weight"), ddp.module.parameters(), strict=True)}
    ours = {n: zopt.get_param_grad(p) for n, p in zip(theirs, model.parameters(), strict=True)}
    return {
        "owners": sorted(zopt.state.layout.owners.values()),
        "param_grad": ours,
        "p_grad": {n: p.grad for n, p in zip(theirs, model.parameters(), strict=True)} if stage == 1 else None,
        "ref": theirs,
        "norm": (zopt.get_grad_norm(), float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), math.inf, 2.0))),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_whole_params_show_their_averaged_gradients_on_every_rank(worlds, stage):
    for res in worlds[2].run(_whole_param_grads, stage):
        assert res["owners"] == [0, 1]  # one param on each rank
        assert_trees_equal(res["param_grad"], res["ref"])
        if stage == 1:
            assert_trees_equal(res["p_grad"], res["ref"])
        ours, theirs = res["norm"]
        assert abs(ours - theirs) <= PARITY * theirs


def _backwards_before_step_stage1(overlap: bool) -> dict[str, Any]:
    """Stage 1: synced, no_sync, synced backward before one step; p.grad then holds the sum of the means.

    No ``zopt.zero_grad()``: ``step`` consumes the gradients, so the next backward starts from zero.
    """
    model, zopt, topt, ddp = _pair(1, overlap)
    data = batches(dist.get_rank(), 3 * STEPS)
    worst = 0.0
    held: dict[str, Any] = {}
    for step in range(STEPS):
        for micro in range(3):
            x, y = next(data)
            sync = micro != 1
            with contextlib.nullcontext() if sync else zopt.no_sync():
                zopt.backward(_loss(model(x, gate_used(step)), y))
            _ddp_micro(ddp, x, y, step, micro, held)
        diffs = _grad_diffs(model, ddp)
        worst = max([worst, *(d for d in diffs.values() if d is not None)])
        zopt.step()
        zopt.zero_grad()
        topt.step()
        topt.zero_grad()
    return {"zero": _named(model), "ref": _named(ddp.module), "worst_grad": worst, "moved": _moved(model)}


def test_stage1_backwards_before_one_step_sum_their_means_in_p_grad(worlds):
    """As for the placeholder: DDP averages the summed local gradients, the facade sums the
    means; ``p.grad`` and the params bitwise DDP summing the two means (``_ddp_micro``) on
    the exact wire."""
    for n in (2, 3):
        for overlap in (False, True):
            for res in worlds[n].run(_backwards_before_step_stage1, overlap):
                assert res["worst_grad"] == 0.0, f"N={n} overlap={overlap}"
                assert_trees_equal(res["zero"], res["ref"])
                assert res["moved"] > 1e-3, f"N={n} overlap={overlap}"
