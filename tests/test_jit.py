"""jit: the README's functional step under ``torch.compile(fullgraph=True)``, one graph, bitwise equal to eager.

The step is the README's loop (``torch.func.grad``, ``reduce_grads``, ``step_shards``,
``gather_params``) with the state as ``shard_params`` makes it (its step count and loss
scale are 0-d tensors) and the learning rate a 0-d tensor a schedule updates in place.
``fullgraph=True`` makes any graph break an error, and
``torch._dynamo.config.error_on_recompile`` makes any recompile one, so every step after
the first runs the one graph compiled first.

Tolerances: ``backend="aot_eager"`` runs the same aten kernels as eager mode, and the
compiled step computes its scalars (norm, unscale-and-clip coefficient, loss scale,
Adam's bias corrections and step size) by the same IEEE float64 operations eager mode
applies to Python floats, so the compiled loop is asserted bitwise equal to the eager
loop, params, master shards, norms and loss-scale trajectory.

Compiling is slow on the CPU (seconds to tens of seconds per graph), so the tests are
few: each compiles one step once and runs every assertion on it. They are not in the
``numerics`` set: both sides of every comparison run on the same ranks' kernels, so no
noise floor is involved (at 3 ranks those are torch's portable kernels, tests/conftest.py).
"""

from __future__ import annotations

import itertools
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import get_world
from helpers import seeded

import zerofn as zf
from zerofn import _traced

STEPS = 20  # the schedule changes lr at every step: 20 steps show one graph serving them all


def _model(fp16: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seeded(0))
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 1))
    if fp16:
        model = model.half()
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _batches(steps: int, fp16: bool, overflow_at: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seeded(1 + rank))
    out = []
    for i in range(steps):
        x = torch.randn(4, 6, generator=g)
        y = x.sum(dim=1, keepdim=True)
        if i == overflow_at and rank == 1:  # an overflow on one rank only
            x[0, 0] = float("inf")
        out.append((x.half(), y.half()) if fp16 else (x, y))
    return out


def _compiled_against_eager(
    stage: int, fp16: bool, steps: int, overflow_at: int = -1, fused: bool | None = None, donate: bool = False
) -> dict[str, Any]:
    """The eager loop, then the same loop compiled; what differs, how often dynamo compiled,
    and the ops of the graph dynamo traced (``ops``: target -> count). ``donate``: the
    step donates its state (each run starts from its own copy)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, params = _model(fp16)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    scaler = zf.DynamicLossScaler(initial_scale=2.0**10, growth_interval=3)
    precision = zf.PrecisionPolicy(param_dtype=torch.float16, loss_scaler=scaler) if fp16 else None
    start = zf.shard_params(params, zf.optim.adamw(lr=lr, weight_decay=0.1, fused=fused), precision=precision)
    ops: dict[str, int] = {}

    def recording(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        ops.clear()  # the graph that runs: dynamo may restart its analysis after a first call here
        for node in gm.graph.nodes:
            if node.op == "call_function":
                ops[str(node.target)] = ops.get(str(node.target), 0) + 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = torch.func.grad(lambda p: zf.scale_loss(loss_fn(p, x, y), state.loss_scale))(params)
        gshards = zf.reduce_grads(grads, state.layout, stage=stage, precision=state.precision)
        state, info = zf.step_shards(state, gshards, max_norm=0.5, donate=donate)
        return state, zf.gather_params(state), info

    def run(fn: Any) -> tuple[zf.ZeroState, dict[str, torch.Tensor], list[tuple[float, bool, float]]]:
        state, p, trace = pytree.tree_map(torch.clone, start) if donate else start, params, []
        for i, (x, y) in enumerate(_batches(steps, fp16, overflow_at)):
            lr.fill_(1e-2 * 0.98**i)  # a schedule: the graph reads the tensor, nothing recompiles
            state, p, info = fn(state, p, x, y)
            trace.append((float(info.grad_norm), bool(info.skipped), float(state.loss_scale.scale)))
        return state, p, trace

    eager = run(step)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(torch.compile(step, fullgraph=True, backend=recording))
    torch._dynamo.reset()
    (se, pe, te), (sc, pc, tc) = eager, compiled
    moments = zip(pytree.tree_leaves(se.opt_state), pytree.tree_leaves(sc.opt_state), strict=True)
    return {
        "params_equal": all(torch.equal(pe[n].view(torch.uint8), pc[n].view(torch.uint8)) for n in pe),
        "master_equal": all(torch.equal(se.master[n], sc.master[n]) for n in se.master),
        "opt_state_equal": all(torch.equal(a, b) for a, b in moments),
        "trace_equal": te == tc,
        "trace": tc,
        "eager_trace": te,
        "steps": (int(se.step), int(sc.step)),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "ops": ops,
    }


def test_zerofn_marks_constant_results_exactly_as_torch_compiler_does():
    # zerofn sets the marker itself so that its import does not import dynamo; a torch
    # whose decorator did more (or other) would make the compiled checks differ.
    def by_torch() -> None: ...

    def by_zerofn() -> None: ...

    assert torch.compiler.assume_constant_result(by_torch) is by_torch
    assert _traced.constant_result(by_zerofn) is by_zerofn
    assert vars(by_torch) == vars(by_zerofn) == {"_dynamo_marked_constant": True}


def test_the_functional_step_compiles_once_and_trains_bitwise_as_eager_for_20_steps_of_a_schedule():
    for rank, out in enumerate(get_world(2).run(_compiled_against_eager, 2, False, STEPS)):
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"], rank
        assert out["graphs"] == 1, out["graphs"]  # one graph, no break; error_on_recompile: no recompile
        assert out["steps"] == (STEPS, STEPS)


def test_an_fp16_overflow_on_one_rank_skips_on_both_with_the_same_scale_trajectory_compiled():
    # Donated: the single-tensor rule cannot skip in place, so Optimizer.update steps copies
    # and selects the given values back.
    results = get_world(2).run(_compiled_against_eager, 1, True, 8, overflow_at=2, donate=True)
    for out in results:
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"]
        assert out["graphs"] == 1
        assert out["steps"] == (7, 7)  # one of 8 skipped
    assert results[0]["trace"] == results[1]["trace"]
    skipped = [i for i, (_, s, _) in enumerate(results[0]["trace"]) if s]
    scales = [scale for _, _, scale in results[0]["trace"]]
    assert skipped == [2]
    assert scales[2] == scales[1] and max(scales) > scales[0]  # hysteresis absorbed it; growth every 3 good steps


README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_loop() -> tuple[str, str]:
    """The README's functional loop: the code before ``for step in range(20):`` and the loop's body, as written."""
    block = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert block is not None
    setup, body = block.group(1).split("for step in range(20):\n")
    return setup, textwrap.dedent(body)


def _readme_loop_compiled_against_eager(steps: int) -> dict[str, Any]:
    """The README's setup, then its loop body as a step function run eagerly and compiled, from the same seed."""
    setup, body = _readme_loop()
    code = "def readme_step(state, params):\n" + textwrap.indent(body, "    ") + "    return state, params, info\n"
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    scope: dict[str, Any] = {"__name__": "readme"}
    exec(setup + code, scope)  # the setup: model, params, state from shard_params (no as_tensors), grad_fn
    start, params, rank_seed = scope["state"], scope["params"], 1 + dist.get_rank()

    def run(fn: Any) -> tuple[zf.ZeroState, dict[str, torch.Tensor], list[tuple[float, bool, float]]]:
        torch.manual_seed(rank_seed)  # as the README seeds the batches
        state, p, trace = start, params, []
        for _ in range(steps):
            state, p, info = fn(state, p)
            trace.append((float(info.grad_norm), bool(info.skipped), float(info.clip_coef)))
        return state, p, trace

    (se, pe, te) = run(scope["readme_step"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        (sc, pc, tc) = run(torch.compile(scope["readme_step"], fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    return {
        "params_equal": all(torch.equal(pe[n], pc[n]) for n in pe),
        "master_equal": all(torch.equal(se.master[n], sc.master[n]) for n in se.master),
        "trace_equal": te == tc,
        "clipped": any(c < 1.0 for _, _, c in te),
        "steps": (int(se.step), int(sc.step)),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def test_fused_adamw_compiles_as_one_op_of_torchs_kernel_and_skips_an_overflow_as_eager():
    # torch's fused kernel runs in the graph as the opaque zerofn::fused_adam_ (one call per
    # step: one param group, one flat buffer of masters), the kernel the eager step calls, so
    # the bits are the eager ones; the overflow on rank 1 reaches the kernel as its found_inf.
    results = get_world(2).run(_compiled_against_eager, 1, True, 8, overflow_at=2, fused=True)
    for rank, out in enumerate(results):
        assert out["params_equal"] and out["master_equal"] and out["opt_state_equal"], rank
        assert out["trace_equal"], (rank, out["trace"], out["eager_trace"])
        assert [skipped for _, skipped, _ in out["trace"]] == [False, False, True] + [False] * 5
        assert out["steps"] == (7, 7)
        assert out["graphs"] == 1
        assert out["ops"].get("zerofn.fused_adam_.default") == 1, out["ops"]
        assert not any(name.startswith("aten.where") for name in out["ops"]), out["ops"]  # no select: the kernel skips
    assert results[0]["trace"] == results[1]["trace"]


def test_the_readme_loop_as_written_compiles_fullgraph_and_trains_bitwise_as_eager():
    for rank, out in enumerate(get_world(2).run(_readme_loop_compiled_against_eager, 20)):
        assert out["params_equal"] and out["master_equal"] and out["trace_equal"], rank
        assert out["graphs"] == 1, out["graphs"]
        assert out["steps"] == (20, 20)


def _shard_params_numbers() -> list[tuple[str, str, tuple[int, ...], str]]:
    _, params = _model(False)
    scaler = zf.DynamicLossScaler(initial_scale=2.0**10)
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=zf.PrecisionPolicy(loss_scaler=scaler))
    numbers = {"step": state.step, **state.loss_scale._asdict()}
    return [(k, str(v.dtype), tuple(v.shape), str(v.device)) for k, v in numbers.items()] + [
        ("values", repr((int(state.step), *(v.item() for v in state.loss_scale))), (), str(state.work_device))
    ]


def test_shard_params_makes_the_step_count_and_loss_scale_0d_tensors_on_the_params_device():
    for out in get_world(2).run(_shard_params_numbers):
        assert out == [
            ("step", "torch.int64", (), "cpu"),
            ("scale", "torch.float64", (), "cpu"),
            ("growth_tracker", "torch.int64", (), "cpu"),
            ("hysteresis_left", "torch.int64", (), "cpu"),
            ("values", repr((0, 1024.0, 0, 2)), (), "cpu"),
        ]


def _two_steps_compiled() -> dict[str, bool]:
    """Two models of different shapes through one step function, each compiled in turn (no reset
    between them); whether each compiled step's params equal the eager step's.

    The second compile of the same code with other shapes is where dynamo's automatic dynamic
    shapes turn the layout's ints into symbols; the validation's trace-time description must
    still be constants.
    """
    torch._dynamo.reset()

    def step(state: zf.ZeroState, grads: dict[str, torch.Tensor]) -> Any:
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout), max_norm=0.5)
        return state, zf.gather_params(state)

    out = {}
    for width in (10, 7):
        torch.manual_seed(seeded(width))
        model = torch.nn.Sequential(torch.nn.Linear(width - 4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
        grads = {n: torch.randn(p.shape) for n, p in params.items()}
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        eager, again = step(state, grads)[1], compiled(state, grads)[1]
        out[f"width{width}"] = all(torch.equal(eager[n], again[n]) for n in params)
    torch._dynamo.reset()
    return out


def test_two_different_steps_compile_and_run_in_one_process():
    for out in get_world(1).run(_two_steps_compiled):
        assert out == {"width10": True, "width7": True}


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
        return zf.step_shards(state, shards)

    def gather(state: zf.ZeroState, out: dict[str, torch.Tensor]) -> Any:
        return zf.gather_params(state, out=out)

    compiled_reduce = torch.compile(reduce, fullgraph=True, backend="aot_eager", dynamic=False)
    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)
    compiled_gather = torch.compile(gather, fullgraph=True, backend="aot_eager", dynamic=False)
    # A compiled step checks names, shapes and dtypes at trace time on their static metadata.
    unknown = dict(good, **({"extra.weight": torch.ones(2)} if rank == 1 else {}))
    bad_out = {n: p.detach().clone() for n, p in params.items()}
    bad_out["2.bias"] = bad_out["2.bias"].double()
    wrong = dict(good, **({"0.weight": torch.ones(3, 3)} if rank == 1 else {}))
    other = dict(params, **({"2.bias": torch.zeros(2)} if rank == 1 else {}))
    desynced = zf.make_layout(other, dist.get_world_size())
    shards = dict(zf.reduce_grads(good, state.layout))
    flat_shards = zf.reduce_grads(good, state.layout)  # a FlatDict: the handler cuts its runs by name
    if rank == 1:
        shards["0.bias"] = torch.full_like(shards["0.bias"], float("nan"))
        flat_shards["0.bias"].fill_(float("nan"))  # a view of its flat buffer
    out: dict[str, tuple[str, str] | None] = {"works": caught(compiled_reduce, good, state.layout)}
    # The same layout and reduction, but the last rank's state gathers in other buckets: the
    # step's scalar all-reduce says so, eagerly on the host and compiled in its verdict node.
    other_buckets = state.replace(bucket_numel=state.bucket_numel // 2) if rank == 1 else state
    for name, fn, eager, args in [
        ("wrong_shape", compiled_reduce, reduce, (wrong, state.layout)),
        ("unknown", compiled_reduce, reduce, (unknown, state.layout)),
        ("bad_out", compiled_gather, gather, (state, bad_out)),
        ("desynced", compiled_reduce, reduce, ({n: torch.ones_like(t) for n, t in other.items()}, desynced)),
        ("nonfinite", compiled_step, step, (state, shards)),
        ("nonfinite_flat", compiled_step, step, (state, flat_shards)),
        ("other_buckets", compiled_step, step, (other_buckets, zf.reduce_grads(good, state.layout))),
    ]:
        out[name] = caught(fn, *args)
        out[name + "_eager"] = caught(eager, *args)
    torch._dynamo.reset()
    return out


def test_validation_errors_fire_under_compile_on_every_rank_with_the_eager_messages():
    for rank, out in enumerate(get_world(2).run(_errors_compiled_and_eager)):
        assert out["works"] is None
        # A gather checks ``out`` before any collective and raises on the rank alone, uncaught in
        # the graph: dynamo reports it as Unsupported, quoting the eager message.
        assert out["bad_out_eager"][0] == "ValueError" and out["bad_out_eager"][1] in out["bad_out"][1]
        assert "out['2.bias'] has shape (1,) dtype torch.float64" in out["bad_out_eager"][1]
        for name in ("wrong_shape", "unknown", "desynced", "nonfinite", "nonfinite_flat", "other_buckets"):
            assert out[name] is not None, (rank, name)
            assert out[name] == out[name + "_eager"], (rank, name, out[name], out[name + "_eager"])
        assert out["wrong_shape"][0] == ("ValueError" if rank == 1 else "RankMismatchError")
        assert "gradient of '0.weight' has shape (3, 3)" in out["wrong_shape"][1]
        assert out["unknown"][0] == ("KeyError" if rank == 1 else "RankMismatchError")
        assert "extra.weight" in out["unknown"][1]
        assert out["desynced"][0] == "RankMismatchError" and "'2.bias'" in out["desynced"][1]
        for name in ("nonfinite", "nonfinite_flat"):
            assert out[name][0] == "NonFiniteGradError" and "'0.bias' (in the shards of ranks [1])" in out[name][1]
        assert out["other_buckets"][0] == "RankMismatchError" and "bucket_numel" in out["other_buckets"][1]


def _agreements_in_one_compiled_step() -> dict[str, int]:
    """The collectives a compiled functional step's graph holds, by kind (one graph, traced with
    a backend that counts the functional collectives and then runs the graph as traced)."""
    torch._dynamo.reset()
    model, params = _model(False)
    state = zf.shard_params(params, zf.optim.adamw(lr=torch.tensor(1e-2, dtype=torch.float64)))
    counts: dict[str, int] = {}

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        del example_inputs
        for node in gm.graph.nodes:
            name = str(node.target)
            for kind in ("all_gather_into_tensor", "all_to_all_single", "all_reduce", "broadcast"):
                if node.op == "call_function" and kind in name and "wait" not in name:
                    counts[kind] = counts.get(kind, 0) + 1
        return gm.forward

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = torch.func.grad(loss_fn)(params, x, y)
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout), max_norm=1.0)
        return state, zf.gather_params(state)

    x, y = _batches(1, False, -1)[0]
    torch.compile(step, fullgraph=True, backend=counting)(state, params, x, y)
    torch._dynamo.reset()
    return counts


def test_a_compiled_step_runs_one_agreement_shared_by_its_stages():
    """The step's scalar all-reduce confirms the layout and bucket size for the gather in the
    same graph, so the graph holds one agreement all-gather (``reduce_grads``'), one bucket
    reduction, the scalars' collective and one broadcast per rank: an eager step's collectives."""
    for counts in get_world(2).run(_agreements_in_one_compiled_step):
        # gloo: the scalars are all-gathered (and added in rank order), the bucket is an all-to-all.
        assert counts == {"all_gather_into_tensor": 2, "all_to_all_single": 1, "broadcast": 2}, counts


def _bucket_collectives_in_graph_order() -> dict[str, Any]:
    """A compiled step of several buckets, traced: what feeds each packed bucket, and the
    graph-order positions of the bucket collectives' launches and waits."""
    torch._dynamo.reset()
    model, params = _model(False)
    state = zf.shard_params(params, zf.optim.adamw(lr=torch.tensor(1e-2, dtype=torch.float64)), bucket_numel=16)
    seen: dict[str, Any] = {"pack_after": [], "launch": {}, "wait": {}}

    def recording(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        del example_inputs
        for i, node in enumerate(gm.graph.nodes):
            target = str(node.target)
            if "zerofn.pack_rows" in target:
                after = node.args[4] if len(node.args) > 4 else node.kwargs.get("after")
                seen["pack_after"].append(None if after is None else (str(after.target), after.args[2]))
            elif "_c10d_functional" in target and ("all_reduce" in target or "broadcast" in target):
                seen["launch"][node.name] = i
            elif "wait_tensor" in target and node.args[0].name not in seen["wait"]:
                seen["wait"][node.args[0].name] = i  # the first wait of each collective
        return gm.forward

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = torch.func.grad(loss_fn)(params, x, y)
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout, bucket_numel=16))
        return state, zf.gather_params(state, bucket_numel=16)

    x, y = _batches(1, False, -1)[0]
    torch.compile(step, fullgraph=True, backend=recording)(state, params, x, y)
    torch._dynamo.reset()
    return seen


def test_bucket_collectives_follow_the_agreement_verdict_and_stay_in_flight_together():
    """Under compile the rank agreement's verdict feeds every packed bucket, so no compiler
    can send a bucket before it (a rank with another layout raises, none hangs); and the
    graph launches each bucket's collective before it waits on the previous one, as the eager
    pipeline keeps two in flight (``functional_collectives`` would wait on each at once)."""
    for seen in get_world(2).run(_bucket_collectives_in_graph_order):
        assert len(seen["pack_after"]) >= 3, seen  # several buckets
        assert all(a == ("zerofn.verdict", "ranks_agree") for a in seen["pack_after"]), seen["pack_after"]
        launches = sorted(seen["launch"].items(), key=lambda kv: kv[1])
        bucket_launches = [(name, i) for name, i in launches if name in seen["wait"]]
        overlapped = [a for (a, _), (_, j) in itertools.pairwise(bucket_launches) if seen["wait"][a] > j]
        assert len(overlapped) >= 2, (launches, seen["wait"])  # reduce and gather both pipeline


def _gradient_sized_multiplies() -> dict[str, int]:
    """Multiplies over a whole gradient buffer in a compiled ``step_shards`` (dynamo's graph),
    for an fp32 state (``NoLossScaling``) without and with clipping, and an fp16 one (a
    ``StaticLossScaler``) without clipping. The optimizer is torch's fused AdamW, one opaque
    op, so every such multiply is the step's unscale-and-clip coefficient."""
    torch._dynamo.reset()
    out = {}
    static = zf.PrecisionPolicy.for_dtype(torch.float16, loss_scaler=zf.StaticLossScaler(8.0))
    for label, dtype, policy, max_norm in (
        ("fp32", torch.float32, None, None),
        ("fp32_clip", torch.float32, None, 1.0),
        ("fp16_static", torch.float16, static, None),
    ):
        _, params = _model(False)
        params = {n: p.to(dtype) for n, p in params.items()}
        opt = zf.optim.adamw(lr=torch.tensor(1e-2, dtype=torch.float64), fused=True)
        state = zf.shard_params(params, opt, precision=policy)
        shards = zf.reduce_grads({n: torch.ones_like(p) for n, p in params.items()}, state.layout)
        numel = {b.numel() for b in state.master.buffers if b is not None}
        count = 0

        def counting(gm: torch.fx.GraphModule, example_inputs: Any, sizes: set[int] = numel) -> Any:
            nonlocal count
            del example_inputs
            for node in gm.graph.nodes:
                value = node.meta.get("example_value")
                if "mul" in str(node.target) and isinstance(value, torch.Tensor) and value.numel() in sizes:
                    count += 1
            return gm.forward

        def step_fn(s: zf.ZeroState, g: Any, m: float | None = max_norm) -> Any:
            return zf.step_shards(s, g, max_norm=m)

        step = torch.compile(step_fn, fullgraph=True, backend=counting)
        step(state, shards)
        out[label] = count
        torch._dynamo.reset()
    return out


def test_a_compiled_step_multiplies_the_gradients_only_when_it_unscales_or_clips():
    """``NoLossScaling``'s scale is 1 by definition, so without clipping the coefficient is a
    constant 1 and the compiled step spends no pass over the gradients on it, as eagerly; a
    loss scale or a max norm makes it one multiply per flat buffer."""
    for out in get_world(1).run(_gradient_sized_multiplies):
        assert out == {"fp32": 0, "fp32_clip": 1, "fp16_static": 1}, out


def _restarts_of_a_step_with_a_tensor_lr() -> dict[str, Any]:
    """The restart reasons dynamo recorded compiling the README's step (lr a 0-d float64 tensor
    a schedule updates in place), and whether a changed lr reaches the compiled step."""
    torch._dynamo.reset()
    model, params = _model(False)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    state = zf.shard_params(params, zf.optim.adamw(lr=lr, fused=True))

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = torch.func.grad(loss_fn)(params, x, y)
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))
        return state, zf.gather_params(state)

    x, y = _batches(1, False, -1)[0]
    before = len(torch._dynamo.utils.get_compilation_metrics())
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    lr.fill_(0.0)  # a step at lr 0 leaves the params as they were: the graph reads the tensor's value
    _, same = compiled(state, params, x, y)
    lr.fill_(1e-2)
    _, moved = compiled(state, params, x, y)
    metrics = torch._dynamo.utils.get_compilation_metrics()[before:]
    torch._dynamo.reset()
    return {
        "restarts": sorted(r for m in metrics for r in (m.restart_reasons or ())),
        "compiles": len(metrics),
        "lr_zero_kept": all(torch.equal(same[n], params[n]) for n in params),
        "lr_read": any(not torch.equal(moved[n], params[n]) for n in params),
    }


def test_a_step_with_a_tensor_lr_compiles_in_one_trace_and_reads_the_lr_it_holds():
    """A 0-d float64 CPU tensor input gets a Python-float symbol from dynamo that the graph never
    uses, and dynamo then restarts the whole trace to specialize it (a first compile traced
    twice); the optimizer hands the compiled step a view of the lr instead, so the step is
    traced once, and the graph still reads the lr's current value."""
    for out in get_world(2).run(_restarts_of_a_step_with_a_tensor_lr):
        assert out == {"restarts": [], "compiles": 1, "lr_zero_kept": True, "lr_read": True}, out


def _gather_of_many_params_compiled() -> dict[str, Any]:
    """``gather_params`` of a bucket of more params than one unpack node writes, compiled: the
    params against the eager gather's, and the unpack nodes of the graph."""
    from zerofn.stages._gather_params import UNPACK_MEMBERS

    torch._dynamo.reset()
    torch.manual_seed(seeded(7))
    params = {f"p{i}": torch.randn(2 + i % 5, 1 + i % 2) for i in range(2 * UNPACK_MEMBERS + 7)}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1))
    nodes = 0

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        nonlocal nodes
        del example_inputs
        nodes += sum(1 for node in gm.graph.nodes if "unpack_rows" in str(node.target))
        return gm.forward

    eager = zf.gather_params(state)
    compiled = torch.compile(lambda s: zf.gather_params(s), fullgraph=True, backend=counting)(state)
    torch._dynamo.reset()
    return {"equal": all(torch.equal(eager[n], compiled[n]) for n in params), "nodes": nodes}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_compiled_gather_unpacks_a_bucket_of_many_params_in_nodes_of_at_most_64(n):
    """One bucket of 135 params, gathered (one broadcast per rank on gloo, the rows apart; at N = 1
    the row itself): three unpack nodes of at most 64 params each, the eager gather's bits."""
    for out in get_world(n).run(_gather_of_many_params_compiled):
        assert out == {"equal": True, "nodes": 3}, out


# --------------------------------------------------------------------------- coverage: a mix of features per world size
#
# Each world size compiles one step that combines several of the eager loop's options, so
# four compiles cover them all (compiling is the slow part): ``opt`` the optimizer, ``dtype``
# the params' dtype (fp16 with dynamic loss scaling and an overflow on one rank), ``micro``
# micro-batches whose gradients are summed in float32 before the reduction (accumulation),
# ``donate`` the donated loop (``step_shards(donate=True)``, ``gather_params(out=params)``,
# a ``StagingPool`` for both collectives), ``offload`` the state on ``state_device="cpu"``,
# ``clip`` the max norm, ``comm`` the byte-optimal realisations (reduce-scatter and all-gather,
# the functional collectives NCCL runs) instead of gloo's default; at N = 4 the layout is
# hybrid: sharded over 2 ranks, replicated over 2. Every mix uses small buckets (3 to 6
# per step, so that a bucket's buffer would be reused by a later one).
MIXES: dict[int, dict[str, Any]] = {
    1: {"opt": "sgd_nesterov", "dtype": "fp32", "micro": 2, "donate": True, "offload": False, "stage": 2, "clip": 0.5},
    2: {"opt": "muon_adamw", "dtype": "bf16", "micro": 2, "donate": True, "offload": True, "stage": 2, "clip": 0.5},
    3: {"opt": "sgd", "dtype": "fp16", "micro": 1, "donate": False, "offload": True, "stage": 1, "clip": None},
    4: {"opt": "adamw_fused", "dtype": "fp32", "micro": 1, "donate": True, "offload": False, "stage": 2, "clip": 0.5},
}
BYTE_OPTIMAL = {3, 4}  # world sizes whose mix also uses CommPolicy.byte_optimal()
_HYBRID: list[Any] = []  # (shard group, replicate group) of this rank at N = 4, made once per worker


def _hybrid_groups() -> tuple[Any, Any]:
    """Shard groups {0, 1} {2, 3}, replica groups {0, 2} {1, 3}; created once, on every rank."""
    if not _HYBRID:
        shards, me = [[0, 1], [2, 3]], dist.get_rank()
        made = {tuple(r): dist.new_group(r) for r in [*shards, [0, 2], [1, 3]]}
        _HYBRID.extend([made[(0, 1) if me < 2 else (2, 3)], made[(0, 2) if me % 2 == 0 else (1, 3)]])
    return _HYBRID[0], _HYBRID[1]


def _optimizer(kind: str, lr: torch.Tensor) -> zf.optim.Optimizer:
    if kind == "sgd_nesterov":
        return zf.optim.sgd(lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "sgd":
        return zf.optim.sgd(lr=lr)
    if kind == "muon_adamw":  # Muon's matrices whole on their owners, AdamW's biases split
        muon = zf.torch_optim.from_torch(torch.optim.Muon, lr=0.02)
        adamw = zf.optim.adamw(lr=lr, fused=True)  # torch's fused kernel, through the partition's skip
        return zf.optim.partition([(["0.weight", "2.weight"], muon), (lambda n: True, adamw)])
    return zf.optim.adamw(lr=lr, weight_decay=0.1, fused=kind == "adamw_fused" or None)


def _mix_compiled_against_eager(steps: int) -> dict[str, Any]:
    """This world size's mix (``MIXES``), eagerly and compiled; what differs, and how often dynamo compiled.

    SGD with momentum takes its first step eagerly in both runs (it makes its buffers from
    the first gradient, which the compiled step refuses: ``test_what_cannot_compile...``);
    Muon's buffers are made by ``as_tensors()``.
    """
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mix = MIXES[dist.get_world_size()]
    group, replicas = _hybrid_groups() if dist.get_world_size() == 4 else (None, None)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[mix["dtype"]]
    model, _ = _model(False)
    model = model.to(dtype)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = torch.tensor(1e-2, dtype=torch.float64)
    scaler = zf.DynamicLossScaler(initial_scale=2.0**10, growth_interval=2) if dtype == torch.float16 else None
    precision = zf.PrecisionPolicy(param_dtype=dtype, state_device="cpu" if mix["offload"] else None)
    precision = precision.replace(loss_scaler=scaler) if scaler is not None else precision
    eager_first = mix["opt"] == "sgd_nesterov"  # SGD makes its momentum buffers at the first step
    kw: dict[str, Any] = {"bucket_numel": 16}  # 3 to 6 buckets: the pipeline reuses its buffers
    if dist.get_world_size() in BYTE_OPTIMAL:
        kw["comm_policy"] = zf.CommPolicy.byte_optimal()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, s: Any) -> torch.Tensor:
        return zf.scale_loss(F.mse_loss(torch.func.functional_call(model, p, (x,)), y), s)

    def step(
        state: zf.ZeroState, params: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor, pool: Any
    ) -> Any:
        grads: dict[str, torch.Tensor] = {}
        for x, y in zip(xs, ys, strict=True):  # micro-batches: fp32 gradients, summed
            g = torch.func.grad(loss_fn)(params, x, y, state.loss_scale)
            grads = {n: grads[n] + t.float() if n in grads else t.float() for n, t in g.items()}
        gshards = zf.reduce_grads(
            grads,
            state.layout,
            group,
            mix["stage"],
            precision=state.precision,
            replicate_group=replicas,
            staging=pool,
            **kw,
        )
        state, info = zf.step_shards(state, gshards, group, mix["clip"], donate=mix["donate"])
        out = params if mix["donate"] else None
        return state, zf.gather_params(state, group, out=out, staging=pool, **kw), info

    def run(compiled: bool) -> tuple[zf.ZeroState, dict[str, torch.Tensor], list[tuple[float, bool, float]]]:
        p, trace = {n: t.clone() for n, t in params.items()}, []  # a donated loop writes into its state and params
        state = zf.shard_params(p, _optimizer(mix["opt"], lr), group, precision=precision).as_tensors()
        pool = zf.buckets.StagingPool() if mix["donate"] else None
        fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        for k in range(steps):
            chunk = data[k * mix["micro"] : (k + 1) * mix["micro"]]
            xs, ys = torch.stack([b[0] for b in chunk]).to(dtype), torch.stack([b[1] for b in chunk]).to(dtype)
            lr.fill_(1e-2 * 0.9**k)
            state, p, info = (step if eager_first and k == 0 else fn)(state, p, xs, ys, pool)
            trace.append((float(info.grad_norm), bool(info.skipped), float(state.loss_scale.scale)))
        return state, p, trace

    fp16 = dtype == torch.float16
    data = _batches(steps * mix["micro"], fp16, overflow_at=2 if fp16 else -1)  # an overflow on rank 1
    eager = run(False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(True)
    torch._dynamo.reset()
    (se, pe, te), (sc, pc, tc) = eager, compiled
    leaves = [(a, b) for a, b in zip(pytree.tree_leaves(se.opt_state), pytree.tree_leaves(sc.opt_state), strict=True)]
    return {
        "params_equal": all(torch.equal(pe[n].view(torch.uint8), pc[n].view(torch.uint8)) for n in pe),
        "master_equal": all(torch.equal(se.master[n], sc.master[n]) for n in se.master),
        "opt_state_equal": all(torch.equal(a, b) for a, b in leaves if isinstance(a, torch.Tensor)),
        "trace_equal": te == tc,
        "trace": tc,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "steps": (int(se.step), int(sc.step)),
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_option_of_the_eager_loop_compiles_bitwise_at_each_world_size(n):
    results = get_world(n).run(_mix_compiled_against_eager, 4)
    for rank, out in enumerate(results):
        assert out["params_equal"] and out["master_equal"] and out["opt_state_equal"], (n, rank)
        assert out["trace_equal"], (n, rank, out["trace"])
        assert out["graphs"] == 1, out["graphs"]  # one graph; error_on_recompile: none again
    if MIXES[n]["dtype"] == "fp16":  # the overflow on rank 1 only: every rank skipped step 2
        assert [s for _, s, _ in results[0]["trace"]] == [False, False, True, False]
        assert all(out["trace"] == results[0]["trace"] for out in results)


def _refusals() -> dict[str, tuple[str, str]]:
    """What a compiled ``step_shards`` refuses at trace time: (error type, message) per case."""
    _, params = _model(False)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    out = {}
    cases = {
        "adafactor": zf.torch_optim.from_torch(torch.optim.Adafactor, lr=1e-2),
        "sgd_first_step": zf.optim.sgd(lr=lr, momentum=0.9),
        "adamw8bit": zf.optim.adamw8bit(lr=1e-3),
        "muon_tensor_lr": zf.optim.partition(  # rank 1 owns no Muon param: it refuses too, never waits
            [(["0.weight"], zf.torch_optim.from_torch(torch.optim.Muon, lr=lr)), (lambda n: True, zf.optim.sgd())]
        ),
        "numbers": zf.optim.adamw(lr=lr),  # a state built by hand with Python numbers
    }
    for name, opt in cases.items():
        torch._dynamo.reset()
        state = zf.shard_params(params, opt).as_tensors()
        if name == "numbers":
            state = state.replace(step=0, loss_scale=zf.LossScaleState(1.0, 0, 0))
        shards = zf.reduce_grads({n: torch.ones_like(p) for n, p in params.items()}, state.layout)
        compiled = torch.compile(lambda s, g: zf.step_shards(s, g), fullgraph=True, backend="aot_eager")
        before = {n: t.clone() for n, t in state.master.items()}
        try:
            compiled(state, shards)
        except Exception as e:  # the error dynamo raised while tracing
            out[name] = (type(e).__name__, str(e))
        assert all(torch.equal(before[n], state.master[n]) for n in before)  # nothing was stepped
    torch._dynamo.reset()
    return out


def test_what_cannot_compile_is_refused_at_trace_time_naming_it():
    for out in get_world(2).run(_refusals):
        assert set(out) == {"adafactor", "sgd_first_step", "muon_tensor_lr", "adamw8bit", "numbers"}
        assert all(kind == "Unsupported" for kind, _ in out.values()), out  # dynamo's, raised while tracing
        assert "from_torch(Adafactor) under torch.compile" in out["adafactor"][1]
        assert ".item()" in out["adafactor"][1]
        assert (
            "momentum buffers of ['0.weight', '0.bias', '2.weight', '2.bias'] do not exist"
            in (out["sgd_first_step"][1])
        )
        assert "Run the first step eagerly, then compile the step" in out["sgd_first_step"][1]
        assert "torch.optim.Muon under torch.compile takes a float lr" in out["muon_tensor_lr"][1]
        assert "zerofn.optim.adamw8bit under torch.compile: its state is torchao's" in out["adamw8bit"][1]
        assert "the state's step and loss scale are Python numbers (a state built by hand)" in out["numbers"][1]


# --------------------------------------------------------------------------- two compiled steps in one process
#
# A trainer compiles more than one step: a train step and an eval step, or the two models
# of a GAN. Written once as a function of the model, the steps share their code, so
# dynamo's second compile of that code meets other values of every int read from its
# inputs, and its automatic dynamic shapes (torch's default) make them symbols: the
# offsets of the layouts the state and the gradients carry among them.
#
# Compiled with ``backend="eager"``: the symbols are dynamo's, before any backend, and
# the eager backend runs the graph dynamo traced op by op with eager mode's kernels, so
# the steps are bitwise the eager ones, at the least compile time (inductor compiles each
# of the two steps in tens of seconds here; it was run by hand, see docs/jit.md).


def _model_step(model: torch.nn.Module) -> Any:
    """The README's step for ``model``, small buckets (several per flat group): one code
    object for every model it is made for."""

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = torch.func.grad(lambda p: zf.scale_loss(loss_fn(p, x, y), state.loss_scale))(params)
        gshards = zf.reduce_grads(grads, state.layout, precision=state.precision, bucket_numel=16)
        state, info = zf.step_shards(state, gshards, max_norm=0.5)
        return state, zf.gather_params(state, bucket_numel=16), info

    return step


def _two_models_compiled_against_eager(steps: int, backend: str = "eager") -> dict[str, Any]:
    """Two models' steps compiled one after the other with ``backend`` and run interleaved,
    with no dynamo reset between them; each against the same steps run eagerly.

    The first model's AdamW has two param groups (no weight decay on biases), so its
    update writes several runs of one flat buffer; the second runs SGD.
    """
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lr = torch.tensor(1e-2, dtype=torch.float64)
    torch.manual_seed(seeded(3))
    wide = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 1))
    narrow = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Linear(4, 1))
    no_decay = [{"params": lambda n: n.endswith("bias"), "weight_decay": 0.0}]
    models = {
        "adamw": (wide, zf.optim.adamw(lr=lr, weight_decay=0.1, param_groups=no_decay)),
        "sgd": (narrow, zf.optim.sgd(lr=lr)),
    }
    starts = {}
    for name, (model, opt) in models.items():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        starts[name] = (zf.shard_params(params, opt).as_tensors(), params)
    data = _batches(steps, False, overflow_at=-1)

    def run(fns: dict[str, Any]) -> dict[str, tuple[zf.ZeroState, dict[str, torch.Tensor], list[float]]]:
        now = {name: (state, params, []) for name, (state, params) in starts.items()}
        for k, (x, y) in enumerate(data):
            lr.fill_(1e-2 * 0.9**k)
            for name, fn in fns.items():  # interleaved, as a GAN steps its two models
                state, params, norms = now[name]
                state, params, info = fn(state, params, x, y)
                now[name] = (state, params, [*norms, float(info.grad_norm)])
        return now

    eager = run({name: _model_step(model) for name, (model, _) in models.items()})
    compiled = run(
        {
            name: torch.compile(_model_step(model), fullgraph=True, backend=backend)
            for name, (model, _) in models.items()
        }
    )
    out: dict[str, Any] = {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    for name in models:
        (se, pe, ne), (sc, pc, nc) = eager[name], compiled[name]
        pairs = zip(pytree.tree_leaves(se.opt_state), pytree.tree_leaves(sc.opt_state), strict=True)
        out[name] = {
            "params_equal": all(torch.equal(pe[n], pc[n]) for n in pe),
            "master_equal": all(torch.equal(se.master[n], sc.master[n]) for n in se.master),
            "opt_state_equal": all(torch.equal(a, b) for a, b in pairs if isinstance(a, torch.Tensor)),
            "norms_equal": ne == nc,
            "steps": (int(se.step), int(sc.step)),
        }
        out[name + "_max_diff"] = max(float((pe[n].double() - pc[n].double()).abs().max()) for n in pe)
    torch._dynamo.reset()
    return out


def test_two_models_steps_compiled_one_after_the_other_in_one_process_train_bitwise_as_eager():
    for rank, out in enumerate(get_world(2).run(_two_models_compiled_against_eager, 2)):
        assert out["graphs"] == 2, (rank, out["graphs"])  # one per model; the interleaved calls reuse them
        for name in ("adamw", "sgd"):
            assert out[name] == {
                "params_equal": True,
                "master_equal": True,
                "opt_state_equal": True,
                "norms_equal": True,
                "steps": (2, 2),
            }, (rank, name, out[name])


# --------------------------------------------------------------------------- a donated compiled step that raises


def _donated_step_that_raises(backend: str) -> tuple[str | None, bool]:
    """A compiled ``step_shards(donate=True)`` with fused AdamW (its kernel writes the donated
    state in place) whose verdict raises on every rank (rank 1's state gathers in other
    buckets): what this rank raised, and whether masters and moments kept their values."""
    torch._dynamo.reset()
    _, params = _model(False)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    state = zf.shard_params(params, zf.optim.adamw(lr=lr, fused=True)).as_tensors()
    grads = {n: torch.full_like(p, 0.5) for n, p in params.items()}
    step = torch.compile(lambda s, g: zf.step_shards(s, g, donate=True), fullgraph=True, backend=backend)
    state, _ = step(state, zf.reduce_grads(grads, state.layout))  # compiles; a good step
    other = state.replace(bucket_numel=state.bucket_numel // 2) if dist.get_rank() == 1 else state
    before = [t.clone() for t in pytree.tree_leaves((state.master, state.opt_state))]
    raised = None
    try:
        step(other, zf.reduce_grads(grads, state.layout))
    except Exception as e:  # what the graph's verdict raised
        raised = type(e).__name__
    after = pytree.tree_leaves((state.master, state.opt_state))
    torch._dynamo.reset()
    return raised, all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_donated_compiled_step_that_raises_leaves_the_state_as_it_was(backend):
    # The decision, and so the update, reads the verdict node's output: a rejected step
    # writes nothing into the donated buffers, whatever order a backend gives the nodes.
    assert get_world(2).run(_donated_step_that_raises, backend) == [("RankMismatchError", True)] * 2
