"""The functional step compiled with inductor against the same step eagerly, per dtype.

``backend="aot_eager"`` runs eager mode's aten kernels, so a compiled step is bitwise the
eager one (``tests/test_jit.py``). Inductor generates its own kernels: it fuses the
element-wise chains (tanh and its backward, the loss, AdamW's update, the casts) into C++
loops that compute in registers and reorder or contract the arithmetic (a fused
multiply-add where eager rounds twice, a reduction in another order, vectorised
transcendental functions), so the last bits differ, and 50 steps of an optimizer carry
them on. This measures by how much, on 2 gloo ranks, and sets it next to:

* the tolerance of the dtype in ``tests/test_precision_parity.py`` (elementwise
  ``|a - b| <= atol + rtol |b|``, zerofn against DDP; the worst ratio is reported, <= 1
  passes) and, for fp32, the functional loop's 1e-6 relative parity bound;
* a noise floor measured in the same run (``tests/helpers.py``'s "one ulp" variant): the
  eager loop again with every averaged gradient element moved by one ulp, against the
  plain eager loop: what a last-bit difference grows to in 50 steps here.

::

    python -m benchmarks.jit_inductor                    # fp32, bf16, fp16; 50 steps, N = 2
    python -m benchmarks.jit_inductor --dtypes fp32 --steps 20
    python -m benchmarks.jit_inductor --facade           # ZeroOptimizer(compile=True) against the eager facade

``--facade`` trains the same model with the facade (stage 2, AdamW, clipping at 1.0, the
dtype's params; fp16 with the dynamic loss scaler) eagerly and with ``compile=True``
(inductor), and reports the same distances and tolerance ratios (no floor column: the
facade's stage-2 gradients cannot be jittered from outside; the functional run's floor
is the same model's).

Inductor compiles for minutes on a small CPU (C++ per kernel); the run prints the
compile time of each dtype.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

DTYPES = ("fp32", "bf16", "fp16")

# (params (rtol, atol), masters (rtol, atol)) of tests/test_precision_parity.py's tolerances();
# fp32: the functional loop's relative parity bound (tests/test_parity_ddp.py).
TOLERANCES = {
    "bf16": ((4e-3, 4e-3), (4e-3, 1e-3)),
    "fp16": ((1e-2, 2.5e-4), (5e-3, 1e-4)),
}
FP32_REL = 1e-6


def _worst_ratio(actual: dict[str, Any], expected: dict[str, Any], rtol: float, atol: float) -> float:
    """max over elements of ``|a - b| / (atol + rtol |b|)`` (<= 1: within the tolerance)."""
    worst = 0.0
    for n, b in expected.items():
        a64, b64 = actual[n].double(), b.double()
        worst = max(worst, float(((a64 - b64).abs() / (atol + rtol * b64.abs())).max()))
    return worst


def _rel(actual: dict[str, Any], expected: dict[str, Any]) -> float:
    """``max|a - b| / max|b|`` over each tensor, the largest (``tests/helpers.max_rel_diff``)."""
    out = 0.0
    for n, b in expected.items():
        a64, b64 = actual[n].double(), b.double()
        scale = float(b64.abs().max()) or 1.0
        out = max(out, float((a64 - b64).abs().max()) / scale)
    return out


def _floor(r: dict[str, Any]) -> str:
    if "floor_rel_params" not in r:
        return "-"
    return f"{r['floor_rel_params']:.2e}; {r['floor_rel_master']:.2e}"


def _run(dtype_name: str, steps: int) -> dict[str, Any]:
    """On each rank: eager, eager with one-ulp gradients, and inductor, ``steps`` steps each."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import zerofn as zf

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(dtype)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    data = []
    for _ in range(steps):
        x = torch.randn(8, 7, generator=gen)
        data.append((x.to(dtype), torch.tanh(x[:, :5] * 2).to(dtype)))
    precision = zf.PrecisionPolicy(param_dtype=dtype) if dtype != torch.float16 else zf.PrecisionPolicy.for_dtype(dtype)
    lr = torch.tensor(1e-2, dtype=torch.float64)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, s: Any) -> torch.Tensor:
        return zf.scale_loss(F.mse_loss(torch.func.functional_call(model, p, (x,)), y), s)

    def step(state: zf.ZeroState, p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, jitter: bool) -> Any:
        grads = torch.func.grad(loss_fn)(p, x, y, state.loss_scale)
        shards = zf.reduce_grads(grads, state.layout, precision=state.precision)
        if jitter:  # the floor: every averaged gradient element one ulp up or down
            shards = {
                n: torch.nextafter(g, torch.where(torch.arange(g.numel()) % 2 == 0, math.inf, -math.inf).to(g.dtype))
                for n, g in shards.items()
            }
        state, _ = zf.step_shards(state, shards, max_norm=1.0)
        return state, zf.gather_params(state)

    def train(fn: Any, jitter: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
        state = zf.shard_params(params, zf.optim.adamw(lr=lr, weight_decay=0.1), precision=precision).as_tensors()
        p, first = params, 0.0
        for i, (x, y) in enumerate(data):
            lr.fill_(1e-2 * 0.99**i)
            t0 = time.perf_counter()
            state, p = fn(state, p, x, y, jitter)
            first = first or time.perf_counter() - t0
        full_master = {n: t.clone() for n, t in state.master.items()}
        return p, full_master, first

    eager_p, eager_m, _ = train(step, False)
    floor_p, floor_m, _ = train(step, True)
    compiled = torch.compile(step, fullgraph=True)  # inductor, torch.compile's default
    ind_p, ind_m, compile_s = train(compiled, False)
    initial_move = _rel(eager_p, params)
    out: dict[str, Any] = {
        "dtype": dtype_name,
        "compile_s": compile_s,
        "inductor_rel_params": _rel(ind_p, eager_p),
        "inductor_rel_master": _rel(ind_m, eager_m),
        "floor_rel_params": _rel(floor_p, eager_p),
        "floor_rel_master": _rel(floor_m, eager_m),
        "trained_rel": initial_move,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }
    if dtype_name in TOLERANCES:
        (prt, pat), (mrt, mat) = TOLERANCES[dtype_name]
        out["inductor_ratio_params"] = _worst_ratio(ind_p, eager_p, prt, pat)
        out["inductor_ratio_master"] = _worst_ratio(ind_m, eager_m, mrt, mat)
    torch._dynamo.reset()
    return out


def _run_facade(dtype_name: str, steps: int) -> dict[str, Any]:
    """On each rank: the eager facade and ``ZeroOptimizer(compile=True)`` (inductor), ``steps`` steps each."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import zerofn as zf

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    data = []
    for _ in range(steps):
        x = torch.randn(8, 7, generator=gen)
        data.append((x.to(dtype), torch.tanh(x[:, :5] * 2)))

    def train(
        compile_: bool,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(dtype)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = zf.ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
            module=model,
            partition_grad=True,
            clip_grad_norm=1.0,
            compile=compile_,
        )
        first = 0.0
        for i, (x, y) in enumerate(data):
            opt.param_groups[0]["lr"] = 1e-2 * 0.99**i
            t0 = time.perf_counter()
            opt.backward(F.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
            first = first or time.perf_counter() - t0
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        masters = {n: t.clone() for n, t in opt.state.master.items()}
        opt.close()
        return params, masters, initial, first

    eager_p, eager_m, initial, _ = train(False)
    ind_p, ind_m, _, compile_s = train(True)
    out: dict[str, Any] = {
        "dtype": dtype_name,
        "compile_s": compile_s,
        "inductor_rel_params": _rel(ind_p, eager_p),
        "inductor_rel_master": _rel(ind_m, eager_m),
        "trained_rel": _rel(eager_p, initial),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }
    if dtype_name in TOLERANCES:
        (prt, pat), (mrt, mat) = TOLERANCES[dtype_name]
        out["inductor_ratio_params"] = _worst_ratio(ind_p, eager_p, prt, pat)
        out["inductor_ratio_master"] = _worst_ratio(ind_m, eager_m, mrt, mat)
    torch._dynamo.reset()
    return out


def main(argv: list[str] | None = None) -> None:
    from zerofn.testing import World

    p = argparse.ArgumentParser(prog="python -m benchmarks.jit_inductor", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--facade", action="store_true", help="ZeroOptimizer(compile=True) against the eager facade")
    args = p.parse_args(argv)
    run, what = (_run_facade, "the facade (stage 2)") if args.facade else (_run, "the functional step")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"# inductor against eager, {what}, N = {args.world_size}, {args.steps} steps; load {load}")
    print(
        "| dtype | inductor vs eager, params (rel) | masters (rel) | worst / tolerance, params; masters | "
        "one-ulp floor, params; masters (rel) | training moved params | graphs | first call (compile), s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with World(args.world_size, timeout=1800.0, run_timeout=3600.0) as world:
        for name in args.dtypes:
            res = world.run(run, name, args.steps)
            r = max(res, key=lambda x: x["inductor_rel_params"])
            ratio = (
                f"{r['inductor_ratio_params']:.3f}; {r['inductor_ratio_master']:.3f}"
                if "inductor_ratio_params" in r
                else f"rel bound {FP32_REL:g}"
            )
            print(
                f"| {name} | {r['inductor_rel_params']:.2e} | {r['inductor_rel_master']:.2e} | {ratio} | "
                f"{_floor(r)} | {r['trained_rel']:.2e} | "
                f"{r['graphs']} | {max(x['compile_s'] for x in res):.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
