"""The compressed wire in ``value_and_reduced_grads`` and ``ZeroOptimizer``, on real gloo ranks at 1 to 3.

``value_and_reduced_grads`` with ``residual=`` must give ``reduce_grads``'s shards and next
residual bit for bit; ``ZeroOptimizer(precision=PrecisionPolicy(wire=...))`` must give the
functional loop's params (``reduce_grads`` + ``step_shards`` + ``gather_params`` with the
same wire) bit for bit over several steps, ``no_sync`` accumulation included (which leaves
the residual alone), keep the residual on a skipped step, and send its buckets over the
all-to-all; what either cannot serve must stop every rank before any bucket is sent.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import assert_bitwise_equal
from torch import nn

import zerofn as zf
from zerofn._wire._bucket import bucket_bytes, wire_plan
from zerofn.buckets import plan_buckets
from zerofn.testing import RankFailure

WIRE = zf.CompressedWire(kind="int8", block=64, min_numel=16)
BUCKET = 1024  # several buckets, each with compressed (matrices) and float32 (bias) columns


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 5))


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(6, 12, generator=g) * (1 + rank), torch.randn(6, 5, generator=g)


def _loss_fn(model: nn.Module):
    def loss_fn(p, x, y):
        return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

    return loss_fn


# ------------------------------------------------------------------ value_and_reduced_grads


def _vrg_matches_reduce_grads(steps: int) -> int:
    rank = dist.get_rank()
    model = _model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = zf.PrecisionPolicy(wire=WIRE)
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), precision=policy, bucket_numel=BUCKET)
    assert len(state.residual) > 1
    loss_fn = _loss_fn(model)
    for step in range(steps):
        full = zf.gather_params(state)
        x, y = _batch(rank, step)
        grads = torch.func.grad(loss_fn)(full, x, y)
        want, want_residual = zf.reduce_grads(
            grads, state.layout, precision=state.precision, bucket_numel=BUCKET, residual=state.residual
        )
        vrg = zf.value_and_reduced_grads(
            loss_fn, state.layout, precision=state.precision, bucket_numel=BUCKET, residual=state.residual
        )
        loss, (shards, residual) = vrg(full, x, y)
        assert torch.equal(loss, loss_fn(full, x, y))
        for name in want:
            assert_bitwise_equal(shards[name], want[name], f"rank {rank} step {step}: {name}")
        for i, (got, ref) in enumerate(zip(residual, want_residual, strict=True)):
            assert_bitwise_equal(got, ref, f"rank {rank} step {step}: residual {i}")
        state, info = zf.step_shards(state, shards, residual=residual)
        assert not info.skipped
    return sum(int(r.abs().max() > 0) for r in state.residual if r.numel())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_value_and_reduced_grads_gives_reduce_grads_shards_and_residual_bit_for_bit(n):
    for nonzero in get_world(n).run(_vrg_matches_reduce_grads, 3):
        assert nonzero > 0 if n > 1 else nonzero == 0


# ------------------------------------------------------------------ ZeroOptimizer

_STEPS, _ACCUMULATE = 4, (1, 3, 1, 2)  # steps 1 and 3 accumulate micro-batches under no_sync


def _functional_twin(model: nn.Module, policy: zf.PrecisionPolicy):
    """The functional loop on ``model``'s twin: p.grad summed over micro-batches by autograd, as the facade's."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=policy, bucket_numel=BUCKET)

    def step(state, micro_batches):
        full = zf.gather_params(state)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(full[n])
                p.grad = None
        for x, y in micro_batches:
            ((model(x) - y) ** 2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        shards, residual = zf.reduce_grads(
            grads, state.layout, precision=state.precision, bucket_numel=BUCKET, residual=state.residual
        )
        return zf.step_shards(state, shards, residual=residual)

    return state, step


def _facade_matches_the_functional_loop(overlap: bool) -> list[dict[str, int]]:
    rank, n = dist.get_rank(), dist.get_world_size()
    policy = zf.PrecisionPolicy(wire=WIRE)
    model, twin = _model(), _model()
    opt = zf.ZeroOptimizer(
        model.named_parameters(),
        zf.optim.adamw(lr=1e-2),
        partition_grad=True,
        precision=policy,
        reduce_bucket_size=BUCKET,
        overlap_communication=overlap,
        module=model,
    )
    state, functional_step = _functional_twin(twin, policy)
    buckets = plan_buckets(state.layout, BUCKET)
    want_bytes = sum(bucket_bytes(wire_plan(state.layout, b, WIRE), n, WIRE) for b in buckets)
    out = []
    for step in range(_STEPS):
        micro_batches = [_batch(rank, step, m) for m in range(_ACCUMULATE[step])]
        before = [r.clone() for r in opt.state.residual]
        accumulated = 0
        for m, (x, y) in enumerate(micro_batches):
            last = m == len(micro_batches) - 1
            with zf.count_bytes() as counter:
                if last:
                    opt.backward(((model(x) - y) ** 2).mean())
                else:
                    with opt.no_sync():
                        opt.backward(((model(x) - y) ** 2).mean())
                    accumulated += counter.bytes_sent
        assert all(torch.equal(a, b) for a, b in zip(opt.state.residual, before, strict=True)), "backward stepped it"
        opt.step()
        opt.zero_grad()
        state, info = functional_step(state, micro_batches)
        assert not info.skipped and not opt.last_step_info.skipped
        want = zf.gather_params(state)
        for name, p in model.named_parameters():
            assert_bitwise_equal(p.detach(), want[name], f"rank {rank} step {step}: {name}")
        for i, (got, ref) in enumerate(zip(opt.state.residual, state.residual, strict=True)):
            assert_bitwise_equal(got, ref, f"rank {rank} step {step}: residual {i}")
        sent = dict(counter.by_collective)
        out.append({"no_sync": accumulated, "all_to_all": sent.get("all_to_all", 0), "want": want_bytes})
        assert "reduce_scatter" not in sent and "all_reduce" not in sent, sent
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_facade_over_the_wire_equals_the_functional_loop_bit_for_bit(n, overlap):
    for per_rank in get_world(n).run(_facade_matches_the_functional_loop, overlap):
        for step in per_rank:
            assert step["no_sync"] == 0, step
            assert step["all_to_all"] == step["want"] and (step["want"] > 0) == (n > 1), step


def _facade_skips_and_keeps_the_residual(bad_value: float) -> dict[str, object]:
    rank = dist.get_rank()
    scaler = zf.DynamicLossScaler(initial_scale=2.0**10, hysteresis=1)
    model = _model()
    opt = zf.ZeroOptimizer(
        model.named_parameters(),
        zf.optim.sgd(lr=0.1),
        partition_grad=True,
        precision=zf.PrecisionPolicy(wire=WIRE, loss_scaler=scaler),
        reduce_bucket_size=BUCKET,
        module=model,
    )
    x, y = _batch(rank, 0)
    opt.backward(((model(x) - y) ** 2).mean())
    opt.step()
    opt.zero_grad()
    before = [r.clone() for r in opt.state.residual]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _batch(rank, 1)
    if rank == 1:
        x[2, 3] = bad_value  # only rank 1 overflows
    opt.backward(((model(x) - y) ** 2).mean())
    opt.step()
    opt.zero_grad()
    return {
        "skipped": opt.last_step_info.skipped,
        "scale": opt.loss_scale,
        "residual halved": all(torch.equal(a, b * 0.5) for a, b in zip(opt.state.residual, before, strict=True)),
        "params kept": all(torch.equal(p, params[n]) for n, p in model.named_parameters()),
    }


@pytest.mark.parametrize("bad_value", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_skipped_facade_step_keeps_the_residual_in_the_new_scales_units(bad_value):
    for got in get_world(2).run(_facade_skips_and_keeps_the_residual, bad_value):
        assert got == {"skipped": True, "scale": 512.0, "residual halved": True, "params kept": True}


# ------------------------------------------------------------------ refusals


def _refused(case: str) -> str:
    rank = dist.get_rank()
    model = _model()
    policy = zf.PrecisionPolicy(wire=WIRE)
    kwargs: dict[str, object] = {"partition_grad": True, "precision": policy, "module": model}
    state = zf.shard_params(dict(model.named_parameters()), zf.optim.sgd(lr=0.1), precision=policy)
    full = zf.gather_params(state)
    with zf.count_bytes() as counter:
        try:
            if case == "vrg whole":
                params = {n: p.detach() for n, p in model.named_parameters()}
                layout = zf.make_layout(params, dist.get_world_size(), placement={"0.weight": "whole"})
                vrg = zf.value_and_reduced_grads(_loss_fn(model), layout, precision=policy)
                vrg(params, *_batch(rank, 0))
            elif case == "vrg no residual":
                zf.value_and_reduced_grads(_loss_fn(model), state.layout, precision=policy)(full, *_batch(rank, 0))
            else:
                kwargs |= {
                    "stage 1": {"partition_grad": False},
                    "compile": {"compile": True},
                    "hybrid": {"sub_dp_size": 2},
                }[case]
                zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), **kwargs)
        finally:
            assert set(counter.by_collective) <= {"check"}, counter.by_collective
    return "no error"


REFUSALS = {
    "stage 1": "pass partition_grad=True",
    "compile": "pass compile=False",
    "hybrid": "drop sub_dp_size and replicate_group",
    "vrg whole": "'0.weight' is placed whole",
    "vrg no residual": "pass residual=state.residual",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_the_wire_cannot_serve_here_stops_every_rank_before_any_bucket(case):
    results = get_world(2).run(_refused, case, return_exceptions=True)
    for rank, r in enumerate(results):
        assert isinstance(r, RankFailure), (rank, r)
        assert REFUSALS[case] in r.message or "rejected its input" in r.message, (rank, r.message)
    assert any(REFUSALS[case] in r.message for r in results)


# ------------------------------------------------------------------ Lightning's options


def _strategy_options_build_a_wired_facade(fp16_mixed: bool) -> dict[str, object]:
    from zerofn.lightning import ZeroOptions

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    options = ZeroOptions(communication_wire=WIRE)
    kwargs = options.facade_kwargs(fp16_mixed=fp16_mixed, who="ZeroStrategy", params=params)
    opt = zf.ZeroOptimizer(optimizer, module=model, partition_grad=True, init_sync=True, **kwargs)
    x, y = _batch(dist.get_rank(), 0)
    with zf.count_bytes() as counter:
        opt.backward(((model(x) - y) ** 2).mean())
    opt.step()
    return {
        "wire": opt.state.precision.wire,
        "scaler": type(opt.state.precision.loss_scaler).__name__,
        "all_to_all": counter.by_collective.get("all_to_all", 0) > 0,
    }


@pytest.mark.parametrize("fp16_mixed", [False, True], ids=["32-true", "16-mixed"])
def test_the_lightning_strategies_options_pass_the_wire_to_the_facade(fp16_mixed):
    scaler = "DynamicLossScaler" if fp16_mixed else "NoLossScaling"
    for got in get_world(2).run(_strategy_options_build_a_wired_facade, fp16_mixed):
        assert got == {"wire": WIRE, "scaler": scaler, "all_to_all": True}


def test_the_lightning_options_refuse_a_wire_they_cannot_serve_when_built():
    from zerofn.lightning import ZeroOptions, ZeroStrategy

    assert ZeroStrategy(communication_wire=WIRE).options.communication_wire == WIRE
    with pytest.raises(ValueError, match="drop communication_dtype"):
        ZeroOptions(communication_wire=WIRE, communication_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="use stage=2"):
        ZeroOptions(communication_wire=WIRE, stage=1)
    with pytest.raises(TypeError, match=r"must be a zerofn\.CompressedWire"):
        ZeroOptions(communication_wire=torch.int8)


# ------------------------------------------------------------------ the facade's checkpoints


def _facade(model: nn.Module) -> zf.ZeroOptimizer:
    return zf.ZeroOptimizer(
        model.named_parameters(),
        zf.optim.adamw(lr=1e-2),
        partition_grad=True,
        precision=zf.PrecisionPolicy(wire=WIRE),
        reduce_bucket_size=BUCKET,
        module=model,
    )


def _facade_steps(opt: zf.ZeroOptimizer, model: nn.Module, steps: range) -> None:
    rank = dist.get_rank()
    for step in steps:
        x, y = _batch(rank, step)
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()


def _facade_resumes_with_its_residual(path: str, how: str) -> None:
    rank = dist.get_rank()
    model = _model()
    opt = _facade(model)
    _facade_steps(opt, model, range(2))
    saved = opt.state_dict() if how == "state_dict" else opt.save_checkpoint(path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # as a torch loop saves the model
    _facade_steps(opt, model, range(2, 4))  # the unbroken run
    assert any(r.abs().max() > 0 for r in opt.state.residual if r.numel()), "the residual must not be trivial"
    fresh = _model()
    again = _facade(fresh)
    if how == "state_dict":
        fresh.load_state_dict(weights)
        again.load_state_dict(saved)
    else:
        again.load_checkpoint(path)
    _facade_steps(again, fresh, range(2, 4))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert_bitwise_equal(q.detach(), p.detach(), f"rank {rank}: {name} after the resumed steps")
    for i, (got, want) in enumerate(zip(again.state.residual, opt.state.residual, strict=True)):
        assert_bitwise_equal(got, want, f"rank {rank}: residual {i} after the resumed steps")


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
@pytest.mark.parametrize("n", [2, 3])
def test_the_facade_resumes_with_its_residual_bitwise_from_either_format(tmp_path, n, how):
    get_world(n).run(_facade_resumes_with_its_residual, str(tmp_path / "ckpt"), how)
