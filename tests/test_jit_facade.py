"""jit, the facade: ``ZeroOptimizer(compile=...)`` runs the step after backward as one graph, bitwise eager.

Each test trains the same tiny model twice on the same rank pool, once with the eager
facade and once with ``compile="aot_eager"``, doing the same things in the same order,
and compares params, master shards and every step's (norm, skipped, clip coefficient,
loss scale) bitwise. The compiled run has ``torch._dynamo.config.error_on_recompile``
set and counts dynamo's graphs: one graph, compiled at the first step, serves every step
(an LR scheduler, a hand-edited learning rate, a moving loss scale and step count are
tensors read by the graph).

Tolerances: ``backend="aot_eager"`` runs eager mode's aten kernels and the compiled
step computes its scalars by the same float64 operations as eagerly (``docs/jit.md``), so
equality is bitwise. Not in the ``numerics`` rerun: both sides run on one machine's kernels.

Compiling costs seconds per world size on the CPU, so the tests are two: one mixed
configuration per world size, and the drop-in idioms at N = 2, on the same configuration
as N = 2's parity run, so that the compiled graph of the first is reused by the second
(facades alike share their compiled step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import seeded

import zerofn as zf

BACKEND = "aot_eager"

# N -> (stage, fp16, clip_grad_norm, micro-batches per step, steps, step with an overflow on rank 1)
CONFIGS = {
    1: (1, False, 0.5, 2, 4, -1),
    2: (2, True, 0.5, 1, 100, 2),  # 100 steps: a scheduler and a loss scale moving, one graph
    3: (1, True, 0.0, 2, 4, 1),
    4: (2, False, 0.5, 2, 4, -1),
}


def _facade(n: int, compile_: bool | str) -> tuple[torch.nn.Module, zf.ZeroOptimizer]:
    stage, fp16, clip, _, _, _ = CONFIGS[n]
    torch.manual_seed(seeded(0))
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))  # pads at N = 2, 3, 4
    if fp16:
        model = model.half()
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        module=model,
        partition_grad=stage == 2,
        clip_grad_norm=clip,
        initial_scale=2.0**10,
        growth_interval=3,
        compile=compile_,
    )
    return model, opt


def _batch(model: torch.nn.Module, gen: torch.Generator, overflow: bool) -> torch.Tensor:
    """A micro-batch's loss (an overflow: an inf in the input)."""
    x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen)
    if overflow:
        x[0, 0] = float("inf")
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def _snapshot(model: torch.nn.Module, opt: zf.ZeroOptimizer) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "master": {n: t.clone() for n, t in opt.state.master.items()},
        "step": opt.state.step,
    }


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def _compare(eager: dict[str, Any], compiled: dict[str, Any]) -> dict[str, Any]:
    return {
        "params_equal": _bitwise(eager["params"], compiled["params"]),
        "master_equal": _bitwise(eager["master"], compiled["master"]),
        "trace_equal": eager["trace"] == compiled["trace"],
        "steps": (eager["step"], compiled["step"]),
        "trace": compiled["trace"],
        "graphs": compiled["graphs"],
    }


def _train(n: int, compile_: bool | str) -> dict[str, Any]:
    """CONFIGS[n]'s loop under an LR scheduler; each step's (norm, skipped, clip coefficient, loss scale)."""
    _, _, _, micro, steps, overflow_at = CONFIGS[n]
    model, opt = _facade(n, compile_)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.98**i)
    gen = torch.Generator().manual_seed(seeded(1 + dist.get_rank()))
    trace = []
    for i in range(steps):
        for m in range(micro):
            bad = i == overflow_at and dist.get_rank() == 1 and m == 0
            if m < micro - 1:
                with opt.no_sync():
                    opt.backward(_batch(model, gen, bad))
            else:
                opt.backward(_batch(model, gen, bad))
        opt.step()
        opt.zero_grad()
        sched.step()
        info = opt.last_step_info
        trace.append((info.grad_norm, info.skipped, info.clip_coef, opt.loss_scale))
    return {**_snapshot(model, opt), "trace": trace}


def _parity(n: int) -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = _train(n, False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _train(n, BACKEND)
    compiled["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return _compare(eager, compiled)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_compiled_facade_steps_bitwise_as_the_eager_facade_in_one_graph(n):
    _, fp16, _, _, steps, overflow_at = CONFIGS[n]
    results = get_world(n).run(_parity, n)
    for rank, out in enumerate(results):
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"], (rank, out["trace"][:5])
        assert out["graphs"] == 1, out["graphs"]  # one graph; error_on_recompile: it never recompiled
    skipped = [i for i, (_, s, _, _) in enumerate(results[0]["trace"]) if s]
    # An overflow on rank 1 only: every rank skips it (fp16 skips more: the scale grows until one overflows).
    assert overflow_at in skipped if overflow_at >= 0 else skipped == []
    assert all(out["trace"] == results[0]["trace"] and out["steps"] == (steps - len(skipped),) * 2 for out in results)
    if fp16 and steps >= 50:
        scales = [scale for _, _, _, scale in results[0]["trace"]]
        assert len(set(scales)) > 5, scales  # the scale moved (growth every 3 good steps), the graph stayed


def _drop_in(compile_: bool | str) -> dict[str, Any]:
    """N = 2's facade with the idioms a DDP script uses between steps; what happened at each."""
    rank = dist.get_rank()
    model, opt = _facade(2, compile_)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    gen = torch.Generator().manual_seed(seeded(7 + rank))
    trace: list[Any] = []
    saved = None
    for i in range(8):
        if i == 6:
            assert saved is not None
            opt.load_state_dict(saved)  # the optimizer state of step 1, lr 0.05 (StepLR's edits since are undone)
        opt.backward(_batch(model, gen, False))
        norm = opt.clip_grad_norm_(0.3)  # the facade's clip_grad_norm_, before a compiled step
        if i == 1:
            opt.param_groups[0]["lr"] = 0.05  # a hand edit: takes effect, nothing recompiles
            saved = opt.state_dict()
        with torch.no_grad():
            if i == 2:
                model[0].weight.mul_(0.5)  # an in-place write on every rank: the step trains it
            if i == 3:
                model[2].bias.data.copy_(torch.arange(2.0))  # through .data: check_params adopts it
                trace.append(opt.check_params())
            if i == 4:
                if rank == 0:
                    model[0].bias.add_(1.0)  # one rank only: every rank refuses the step
                try:
                    opt.step()
                except zf.ParamsChangedError as e:
                    trace.append(str(e))
                if rank == 1:
                    model[0].bias.add_(1.0)  # now alike: the next step adopts it
        opt.step()
        opt.zero_grad()
        sched.step()
        info = opt.last_step_info
        trace.append((float(norm), info.grad_norm, info.skipped, opt.param_groups[0]["lr"], opt.loss_scale))
    return {**_snapshot(model, opt), "trace": trace}


def _drop_in_compiled_against_eager() -> dict[str, Any]:
    """Without a dynamo reset first: N = 2's parity test compiled this configuration's graph already."""
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager = _drop_in(False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _drop_in(BACKEND)
    compiled["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    return _compare(eager, compiled)


def test_params_written_clip_grad_norm_state_dicts_and_lr_edits_work_as_eagerly_under_compile():
    results = get_world(2).run(_drop_in_compiled_against_eager)
    for rank, out in enumerate(results):
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"], (rank, out["trace"])
        assert out["graphs"] <= 1  # reused from the parity test, or compiled once here
        trace = out["trace"]
        assert trace[3] == ["2.bias"]  # check_params found the .data write on every rank
        assert "rank 0 changed '0.bias' since the last step, rank 1 no param" in trace[5]
        assert [t[3] for t in trace if isinstance(t, tuple)][1] == 0.05 * 0.5  # the edit, then StepLR's gamma


def _refusals() -> dict[str, str]:
    """What each optimizer or option that cannot compile raises at construction."""
    model = torch.nn.Linear(3, 2)
    cases = {
        "adagrad": lambda: zf.ZeroOptimizer(torch.optim.Adagrad(model.parameters()), compile=True),
        "sgd": lambda: zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compile=True),
        "foreach": lambda: zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), foreach=True), compile=True),
        "allgather": lambda: zf.ZeroOptimizer(
            torch.optim.AdamW(model.parameters()), module=model, overlap_allgather=True, compile=True
        ),
        "backend": lambda: zf.ZeroOptimizer(torch.optim.AdamW(model.parameters()), compile=1),
    }
    out = {}
    for name, build in cases.items():
        try:
            build()
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_what_cannot_compile_is_refused_at_construction_saying_what_to_write():
    (out,) = get_world(1).run(_refusals)
    assert "torch.optim.Adagrad runs on zerofn's generic path" in out["adagrad"]
    assert "zerofn.optim.sgd has no traced update" in out["sgd"]
    assert "built with foreach=True" in out["foreach"] and "fused=True is" in out["foreach"]
    for name in ("adagrad", "sgd", "foreach"):
        assert out[name].startswith("TypeError") and "or build the ZeroOptimizer with compile=False" in out[name]
    assert "pass one of overlap_allgather=True and compile=" in out["allgather"]
    assert "compile must be False, True or a torch.compile backend name" in out["backend"]
