"""zerofn.lightning: ZeroStrategy in Lightning Fabric, on real gloo ranks, against Lightning's own "ddp".

Every rank function builds its ``Fabric`` inside a worker of the session's ``World`` pool
(which set ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` as torchrun does, and whose process
group Fabric finds initialized), so the processes start once for the whole file.

Bitwise by construction: at 2 ranks an fp32 mean does not depend on the order of the sum;
at 3 zerofn sends gradients as float64 (``communication_dtype``) and Lightning's DDP
through ``helpers.float64_wire_hook`` (see the "exact wire" section of tests/helpers.py).
Clipping on the DDP side uses ``helpers.clip_in_float64`` (zerofn's arithmetic: the norm in
float64), where torch's ``clip_grad_norm_`` rounds the norm in float32: the comparison then
checks logic, not one rounding.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import assert_bitwise_equal, clip_in_float64, float64_wire_hook, mse, seeded

L = pytest.importorskip("lightning")

from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision  # noqa: E402

import zerofn as zf  # noqa: E402
from zerofn.lightning import ZeroStrategy  # noqa: E402

STEPS = 3
ACCUMULATE = 2
CLIP = 0.05


def _model() -> nn.Module:
    torch.manual_seed(seeded(31) + dist.get_rank())  # different on each rank: setup must broadcast rank 0's
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 5))


def _data(steps: int, accumulate: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seeded(100) + dist.get_rank())
    return [(torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)) for _ in range(steps * accumulate)]


def _fabric(strategy, precision="32-true", plugins=None) -> L.Fabric:
    kw = {"precision": precision} if plugins is None else {"plugins": plugins}
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, **kw)
    fabric.launch()
    return fabric


def _setup(fabric: L.Fabric, *, wire64: bool = False):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    model, opt = fabric.setup(model, opt)
    if wire64:  # Lightning's DDP side of the exact wire
        model._forward_module.register_comm_hook(None, float64_wire_hook)
    return model, opt, sched


def _train(fabric, model, opt, sched, data, *, steps, accumulate=ACCUMULATE, clip=CLIP, start=0):
    """The user's Fabric loop: accumulation under no_backward_sync, clipping, a scheduler."""
    zero = isinstance(fabric.strategy, ZeroStrategy)
    losses, sent = [], []
    for step in range(start, start + steps):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            with zf.count_bytes() as counter, fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = mse(model(x), y)
                fabric.backward(loss)
            losses.append(float(loss.detach()))
            sent.append(counter.bytes_sent)
        if clip:
            if zero:
                fabric.clip_gradients(model, opt, max_norm=clip)
            else:
                clip_in_float64(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
    if zero:  # zerofn's bytes per micro-batch: none under no_backward_sync, the reduction after the last
        assert [b > 0 for b in sent] == [(i + 1) % accumulate == 0 for i in range(len(sent))], sent
    return losses


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _parity(stages, precisions):
    """Train with ZeroStrategy (each stage, precision) and with Lightning's ddp; return both per case."""
    n = dist.get_world_size()
    wire = torch.float64 if n > 2 else None
    out = {}
    data = _data(STEPS, ACCUMULATE)
    for precision in precisions:
        ddp = _fabric("ddp", precision)
        model, opt, sched = _setup(ddp, wire64=wire is not None)
        ref_losses = _train(ddp, model, opt, sched, data, steps=STEPS)
        ref = (_params(model), ref_losses, _state_bytes(dict(opt.optimizer.state)))
        for stage in stages:
            fabric = _fabric(ZeroStrategy(stage=stage, communication_dtype=wire), precision)
            model, opt, sched = _setup(fabric)
            zero = fabric.strategy.optimizers[0]
            losses = _train(fabric, model, opt, sched, data, steps=STEPS)
            state_bytes = _state_bytes(zero.state.opt_state)  # AdamW's moments, this rank's shards
            out[(stage, precision)] = (_params(model), losses, ref, state_bytes, sched.get_last_lr())
            fabric.strategy.teardown()
    return out


def _state_bytes(tree) -> int:
    """Bytes of the tensors in ``tree``, each storage once (zerofn's names are views of flat buffers)."""
    import torch.utils._pytree as pytree

    seen = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.numerics
@pytest.mark.parametrize("n", [2, 3], ids=lambda n: f"N{n}")
def test_fabric_loop_trains_bitwise_like_lightning_ddp(zerofn_world, n):
    precisions = ["32-true", "bf16-mixed"] if n == 2 else ["32-true"]
    results = zerofn_world(n).run(_parity, [1, 2], precisions)
    for rank, per_case in enumerate(results):
        for (stage, precision), (params, losses, ref, moments, _) in per_case.items():
            ref_params, ref_losses, ref_moments = ref
            what = f"rank {rank} stage {stage} {precision}"
            assert losses == ref_losses, what
            for name in ref_params:
                assert_bitwise_equal(params[name], ref_params[name], f"{what} {name}")
            # AdamW's moments: 1/N of DDP's on each rank, up to the padding (< N elements per param and moment).
            assert 0 <= moments * n - ref_moments <= 2 * 4 * n * len(ref_params), (what, moments, ref_moments)
    # Every rank ends with the same weights (rank 0's at setup, then the same updates).
    for rank in range(1, n):
        for name, p in results[0][(2, "32-true")][0].items():
            assert_bitwise_equal(results[rank][(2, "32-true")][0][name], p, f"rank {rank} vs 0 {name}")


def _clip_value_at_stage_1():
    data = _data(2, 1)
    out = []
    for strategy in ("ddp", ZeroStrategy(stage=1)):
        fabric = _fabric(strategy)
        model, opt, _ = _setup(fabric)
        for x, y in data:
            fabric.backward(mse(model(x), y))
            fabric.clip_gradients(model, opt, clip_val=0.01)  # the averaged gradient, element by element
            opt.step()
            opt.zero_grad()
        out.append(_params(model))
    return out


def test_clip_by_value_at_stage_1_is_bitwise_lightning_ddps(zerofn_world):
    for rank, (ref, params) in enumerate(zerofn_world(2).run(_clip_value_at_stage_1)):
        for name in ref:
            assert_bitwise_equal(params[name], ref[name], f"rank {rank} {name}")


# ----------------------------------------------------------------------------- fp16


def _fp16_overflow_on_one_rank():
    fabric = _fabric(
        ZeroStrategy(stage=2, initial_scale=2.0**10, hysteresis=1), plugins=MixedPrecision("16-mixed", "cpu")
    )
    assert fabric.strategy.precision.scaler is None  # Lightning's GradScaler replaced by zerofn's loss scaler
    model, opt, _ = _setup(fabric)
    zero = fabric.strategy.optimizers[0]
    data = _data(3, 1)
    scales, skipped, after = [], [], []
    for step, (x, y) in enumerate(data):
        if step == 1 and dist.get_rank() == 1:
            x = x * float("inf")  # an overflow on rank 1 only
        before = _params(model)
        fabric.backward(mse(model(x), y))
        opt.step()
        opt.zero_grad()
        scales.append(zero.loss_scale)
        skipped.append(zero.last_step_info.skipped)
        after.append(all(torch.equal(before[k], v) for k, v in _params(model).items()))
    return scales, skipped, after, _params(model)


def test_fp16_mixed_overflow_on_one_rank_skips_on_every_rank(zerofn_world):
    results = zerofn_world(2).run(_fp16_overflow_on_one_rank)
    for scales, skipped, unchanged, _ in results:
        assert skipped == [False, True, False]
        assert unchanged == [False, True, False]
        assert scales == [2.0**10, 2.0**9, 2.0**9]
    for name, p in results[0][3].items():
        assert_bitwise_equal(results[1][3][name], p, name)


def _bf16_true():
    fabric = _fabric(ZeroStrategy(stage=2), precision="bf16-true")
    model, opt, sched = _setup(fabric)
    zero = fabric.strategy.optimizers[0]
    _train(fabric, model, opt, sched, _data(2, ACCUMULATE), steps=2)
    masters = {t.dtype for t in zero.state.master.values()}
    return _params(model), masters


def test_bf16_true_trains_bfloat16_params_from_float32_masters_alike_on_every_rank(zerofn_world):
    (p0, m0), (p1, m1) = zerofn_world(2).run(_bf16_true)
    assert m0 == m1 == {torch.float32}
    for name, p in p0.items():
        assert p.dtype == torch.bfloat16, name
        assert_bitwise_equal(p1[name], p, name)


# ----------------------------------------------------------------------------- checkpoints


def _save_resume(tmp: str, state_dict_type: str):
    data = _data(4, ACCUMULATE)
    wire = torch.float64 if dist.get_world_size() > 2 else None
    strategy = lambda: ZeroStrategy(communication_dtype=wire, state_dict_type=state_dict_type)  # noqa: E731
    # A run that never stopped.
    fabric = _fabric(strategy())
    model, opt, sched = _setup(fabric)
    _train(fabric, model, opt, sched, data, steps=4)
    straight = _params(model)
    # Two steps, saved, thrown away.
    fabric = _fabric(strategy())
    model, opt, sched = _setup(fabric)
    _train(fabric, model, opt, sched, data, steps=2)
    path = os.path.join(tmp, f"ckpt-{state_dict_type}")
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 2})
    fabric.strategy.teardown()
    # A fresh start from other weights, resumed from the checkpoint.
    fabric = _fabric(strategy())
    model, opt, sched = _setup(fabric)
    g = torch.Generator().manual_seed(
        seeded(999)
    )  # the same other weights on every rank (a rank's own would be refused)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == 2 and remainder == {}
    _train(fabric, model, opt, sched, data, steps=2, start=state["step"])
    return straight, _params(model), os.path.isdir(path)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_save_stop_resume_is_bitwise_a_run_that_never_stopped(zerofn_world, tmp_path, state_dict_type):
    for rank, (straight, resumed, is_dir) in enumerate(
        zerofn_world(2).run(_save_resume, str(tmp_path), state_dict_type)
    ):
        assert is_dir == (state_dict_type == "sharded")
        for name in straight:
            assert_bitwise_equal(resumed[name], straight[name], f"rank {rank} {name}")


def _save_at_two(tmp: str) -> None:
    fabric = _fabric(ZeroStrategy())
    model, opt, sched = _setup(fabric)
    _train(fabric, model, opt, sched, _data(2, ACCUMULATE), steps=2)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 2}
    fabric.save(os.path.join(tmp, "sharded"), state)
    fabric.strategy.state_dict_type = "full"
    fabric.save(os.path.join(tmp, "full.pt"), state)  # torch's format: what Lightning's ddp loads


def _resume_at_three(tmp: str):
    """zerofn resumes the sharded checkpoint at 3 ranks; Lightning's ddp the torch-format one; both train on."""
    data = _data(4, ACCUMULATE)
    out = {}
    for name, strategy, path in [
        ("zerofn", ZeroStrategy(communication_dtype=torch.float64), "sharded"),
        ("ddp", "ddp", "full.pt"),
    ]:
        fabric = _fabric(strategy)
        model, opt, sched = _setup(fabric, wire64=name == "ddp")
        state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
        fabric.load(os.path.join(tmp, path), state, weights_only=False)
        _train(fabric, model, opt, sched, data, steps=2, start=state["step"])
        out[name] = (_params(model), state["step"], sched.get_last_lr())
    return out


def test_resume_at_another_world_size_is_bitwise_ddp_resumed_there(zerofn_world, tmp_path):
    zerofn_world(2).run(_save_at_two, str(tmp_path))
    for rank, out in enumerate(zerofn_world(3).run(_resume_at_three, str(tmp_path))):
        (params, step, lr), (ref_params, ref_step, ref_lr) = out["zerofn"], out["ddp"]
        assert step == ref_step == 2 and lr == ref_lr
        for name in ref_params:
            assert_bitwise_equal(params[name], ref_params[name], f"rank {rank} {name}")


# ----------------------------------------------------------------------------- misuse


def _misuse():
    errors = {}

    def refused(what, fn):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            errors[what] = f"{type(e).__name__}: {e}"
        else:
            errors[what] = None

    def two_optimizers():
        fabric = _fabric(ZeroStrategy())
        model = _model()
        fabric.setup(
            model, torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)
        )

    def ddp_wrapped():
        fabric = _fabric(ZeroStrategy())
        model = nn.parallel.DistributedDataParallel(_model())
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def own_grad_scaler():
        _fabric(
            ZeroStrategy(),
            plugins=MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0)),
        )

    def fp16_true():
        _fabric(ZeroStrategy(), plugins=HalfPrecision("16-true"))

    def fp64():
        _fabric(ZeroStrategy(), precision="64-true")

    def optimizer_alone():
        fabric = _fabric(ZeroStrategy())
        model = fabric.setup_module(_model())
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))

    def clip_value_at_stage_2():
        fabric = _fabric(ZeroStrategy(stage=2))
        model, opt, _ = _setup(fabric)
        fabric.backward(mse(model(torch.ones(2, 7)), torch.zeros(2, 5)))
        fabric.clip_gradients(model, opt, clip_val=0.1)

    for what, fn in list(locals().items()):
        if callable(fn) and what not in ("refused", "errors"):
            refused(what, fn)
    return errors


def test_misuse_is_refused_at_setup_with_a_message(zerofn_world):
    for errors in zerofn_world(2).run(_misuse):
        assert "zerofn shards one optimizer per model" in errors["two_optimizers"]
        assert "pass the bare model" in errors["ddp_wrapped"]
        assert "GradScaler decides on each rank alone" in errors["own_grad_scaler"]
        assert "initial_scale=" in errors["own_grad_scaler"]
        assert "'16-true'" in errors["fp16_true"] and "Write precision='16-mixed'" in errors["fp16_true"]
        assert "'64-true'" in errors["fp64"]
        assert "setup_module_and_optimizers" in errors["optimizer_alone"]
        assert "at stage 2 a rank holds only its shards" in errors["clip_value_at_stage_2"]


# ----------------------------------------------------------------------------- registry and extra


def test_registered_by_name_with_facade_defaults():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert STRATEGY_REGISTRY.get("zerofn").stage == 2
    assert STRATEGY_REGISTRY.get("zerofn_stage_1").stage == 1
    assert ZeroStrategy().stage == 2 and ZeroStrategy().state_dict_type == "sharded"
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        ZeroStrategy(stage=3)


def test_import_without_lightning_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "zerofn.lightning" or m.startswith("zerofn.lightning.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning.fabric", None)  # what an environment without Lightning sees
    with pytest.raises(ImportError, match=r"pip install 'zerofn\[lightning\]'"):
        importlib.import_module("zerofn.lightning")
