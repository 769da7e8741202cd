"""jit: the README's functional step under ``torch.compile(fullgraph=True)``, one graph, bitwise equal to eager.

The step is the README's loop (``torch.func.grad``, ``reduce_grads``, ``step_shards``,
``gather_params``) with the state in its tensor form (``state.as_tensors()``) and the
learning rate a 0-d tensor a schedule updates in place. ``fullgraph=True`` makes any graph
break an error, and ``torch._dynamo.config.error_on_recompile`` makes any recompile one,
so every step after the first runs the one graph compiled first.

Tolerances: ``backend="aot_eager"`` runs the same aten kernels as eager mode, and the
compiled step computes its scalars (norm, unscale-and-clip coefficient, loss scale,
Adam's bias corrections and step size) by the same IEEE float64 operations eager mode
applies to Python floats, so the compiled loop is asserted bitwise equal to the eager
loop, params, master shards, norms and loss-scale trajectory.

Compiling is slow on the CPU (seconds to tens of seconds per graph), so the tests are
few: each compiles one step once and runs every assertion on it. They are not in the
``numerics`` set that ``make test`` reruns under another kernel family: both sides of every
comparison run on the same machine's kernels, so no noise floor is involved (they were
run once under ``ATEN_CPU_CAPABILITY=default`` too, and passed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import get_world

import zerofn as zf

STEPS = 100


def _model(fp16: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 1))
    if fp16:
        model = model.half()
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _batches(steps: int, fp16: bool, overflow_at: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1 + rank)
    out = []
    for i in range(steps):
        x = torch.randn(4, 6, generator=g)
        y = x.sum(dim=1, keepdim=True)
        if i == overflow_at and rank == 1:  # an overflow on one rank only
            x[0, 0] = float("inf")
        out.append((x.half(), y.half()) if fp16 else (x, y))
    return out


def _compiled_against_eager(stage: int, fp16: bool, steps: int, overflow_at: int = -1) -> dict[str, Any]:
    """The eager loop, then the same loop compiled; what differs, and how often dynamo compiled."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, params = _model(fp16)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    scaler = zf.DynamicLossScaler(initial_scale=2.0**10, growth_interval=3)
    precision = zf.PrecisionPolicy(param_dtype=torch.float16, loss_scaler=scaler) if fp16 else None
    start = zf.shard_params(params, zf.optim.adamw(lr=lr, weight_decay=0.1), precision=precision).as_tensors()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = torch.func.grad(lambda p: zf.scale_loss(loss_fn(p, x, y), state.loss_scale))(params)
        gshards = zf.reduce_grads(grads, state.layout, stage=stage, precision=state.precision)
        state, info = zf.step_shards(state, gshards, max_norm=0.5)
        return state, zf.gather_params(state), info

    def run(fn: Any) -> tuple[zf.ZeroState, dict[str, torch.Tensor], list[tuple[float, bool, float]]]:
        state, p, trace = start, params, []
        for i, (x, y) in enumerate(_batches(steps, fp16, overflow_at)):
            lr.fill_(1e-2 * 0.98**i)  # a schedule: the graph reads the tensor, nothing recompiles
            state, p, info = fn(state, p, x, y)
            trace.append((float(info.grad_norm), bool(info.skipped), float(state.loss_scale.scale)))
        return state, p, trace

    eager = run(step)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    (se, pe, te), (sc, pc, tc) = eager, compiled
    return {
        "params_equal": all(torch.equal(pe[n].view(torch.uint8), pc[n].view(torch.uint8)) for n in pe),
        "master_equal": all(torch.equal(se.master[n], sc.master[n]) for n in se.master),
        "trace_equal": te == tc,
        "trace": tc,
        "eager_trace": te,
        "steps": (int(se.step), int(sc.step)),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def test_the_functional_step_compiles_once_and_trains_bitwise_as_eager_for_100_steps_of_a_schedule():
    for rank, out in enumerate(get_world(2).run(_compiled_against_eager, 2, False, STEPS)):
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"], rank
        assert out["graphs"] == 1, out["graphs"]  # one graph, no break; error_on_recompile: no recompile
        assert out["steps"] == (STEPS, STEPS)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_the_compiled_step_is_bitwise_eager_at_other_world_sizes(n):
    for out in get_world(n).run(_compiled_against_eager, 1 if n == 3 else 2, False, 4):
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"]
        assert out["graphs"] == 1


def test_an_fp16_overflow_on_one_rank_skips_on_both_with_the_same_scale_trajectory_compiled():
    results = get_world(2).run(_compiled_against_eager, 1, True, 8, overflow_at=2)
    for out in results:
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"]
        assert out["graphs"] == 1
        assert out["steps"] == (7, 7)  # one of 8 skipped
    assert results[0]["trace"] == results[1]["trace"]
    skipped = [i for i, (_, s, _) in enumerate(results[0]["trace"]) if s]
    scales = [scale for _, _, scale in results[0]["trace"]]
    assert skipped == [2]
    assert scales[2] == scales[1] and max(scales) > scales[0]  # hysteresis absorbed it; growth every 3 good steps


def _errors_compiled_and_eager() -> dict[str, tuple[str, str] | None]:
    """Each bad input once compiled, once eagerly: (type, message) of what this rank raised."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    _, params = _model(False)
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=zf.PrecisionPolicy(nonfinite="raise"))
    good = {n: torch.full_like(p, 0.5) for n, p in params.items()}

    def caught(fn: Any, *args: Any) -> tuple[str, str] | None:
        try:
            fn(*args)
        except Exception as e:  # what the rank raised, to compare compiled with eager
            return type(e).__name__, str(e)
        return None

    def reduce(grads: dict[str, torch.Tensor], layout: zf.ShardLayout) -> Any:
        return zf.reduce_grads(grads, layout)

    def step(state: zf.ZeroState, shards: dict[str, torch.Tensor]) -> Any:
        return zf.step_shards(state.as_tensors(), shards)

    compiled_reduce = torch.compile(reduce, fullgraph=True, backend="aot_eager", dynamic=False)
    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)
    wrong = dict(good, **({"0.weight": torch.ones(3, 3)} if rank == 1 else {}))
    other = dict(params, **({"2.bias": torch.zeros(2)} if rank == 1 else {}))
    desynced = zf.make_layout(other, dist.get_world_size())
    shards = dict(zf.reduce_grads(good, state.layout))
    if rank == 1:
        shards["0.bias"] = torch.full_like(shards["0.bias"], float("nan"))
    out: dict[str, tuple[str, str] | None] = {"works": caught(compiled_reduce, good, state.layout)}
    for name, fn, eager, args in [
        ("wrong_shape", compiled_reduce, reduce, (wrong, state.layout)),
        ("desynced", compiled_reduce, reduce, ({n: torch.ones_like(t) for n, t in other.items()}, desynced)),
        ("nonfinite", compiled_step, step, (state, shards)),
    ]:
        out[name] = caught(fn, *args)
        out[name + "_eager"] = caught(eager, *args)
    torch._dynamo.reset()
    return out


def test_validation_errors_fire_under_compile_on_every_rank_with_the_eager_messages():
    for rank, out in enumerate(get_world(2).run(_errors_compiled_and_eager)):
        assert out["works"] is None
        for name in ("wrong_shape", "desynced", "nonfinite"):
            assert out[name] is not None, (rank, name)
            assert out[name] == out[name + "_eager"], (rank, name, out[name], out[name + "_eager"])
        assert out["wrong_shape"][0] == ("ValueError" if rank == 1 else "RankMismatchError")
        assert "gradient of '0.weight' has shape (3, 3)" in out["wrong_shape"][1]
        assert out["desynced"][0] == "RankMismatchError" and "'2.bias'" in out["desynced"][1]
        assert (
            out["nonfinite"][0] == "NonFiniteGradError"
            and "'0.bias' (in the shards of ranks [1])" in (out["nonfinite"][1])
        )


def _features_compiled_against_eager(steps: int) -> dict[str, Any]:
    """One compiled step with many options at once, against the same step eagerly.

    bf16 params with gradients accumulated in fp32, three params placed whole (on their
    owner ranks), byte-optimal realisations (reduce-scatter and all-gather, the functional
    collectives NCCL would run), small buckets, a caller's staging pool, clipping.
    """
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model(False)[0].bfloat16()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = torch.tensor(1e-2, dtype=torch.float64)
    whole = {"0.weight": "whole", "2.weight": "whole", "2.bias": "whole"}
    precision = zf.PrecisionPolicy(param_dtype=torch.bfloat16)
    start = zf.shard_params(params, zf.optim.adamw(lr=lr), precision=precision, placement=whole).as_tensors()
    policy, pool = zf.CommPolicy.byte_optimal(), zf.buckets.StagingPool()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = {n: g.float() for n, g in torch.func.grad(loss_fn)(params, x, y).items()}  # fp32 accumulation
        gshards = zf.reduce_grads(
            grads, state.layout, precision=state.precision, comm_policy=policy, staging=pool, bucket_numel=64
        )
        state, info = zf.step_shards(state, gshards, max_norm=0.5)
        return state, zf.gather_params(state, comm_policy=policy, staging=pool, bucket_numel=64), info

    def run(fn: Any) -> tuple[zf.ZeroState, dict[str, torch.Tensor]]:
        state, p = start, params
        for i, (x, y) in enumerate(_batches(steps, False, -1)):
            lr.fill_(1e-2 * 0.98**i)
            state, p, _ = fn(state, p, x.bfloat16(), y.bfloat16())
        return state, p

    (se, pe) = run(step)
    with torch._dynamo.config.patch(error_on_recompile=True):
        (sc, pc) = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    return {
        "params_equal": all(torch.equal(pe[n].view(torch.uint8), pc[n].view(torch.uint8)) for n in pe),
        "master_equal": se.master.keys() == sc.master.keys()
        and all(torch.equal(se.master[n], sc.master[n]) for n in se.master),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def test_bf16_accumulation_whole_placements_byte_optimal_collectives_and_staging_compile_bitwise():
    for out in get_world(2).run(_features_compiled_against_eager, 4):
        assert out["params_equal"] and out["master_equal"]
        assert out["graphs"] == 1
