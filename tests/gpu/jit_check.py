"""The compiled functional step on the GPU: NCCL, inductor, and CUDA graphs (``scripts/gpu-check``'s ``jit`` part).

Started by ``scripts/gpu-check`` (part ``jit``) as::

    python tests/gpu/jit_check.py --device cuda --out OUT/jit.json
    python tests/gpu/jit_check.py --device cpu --backends aot_eager --out OUT/jit.json   # the dry run

On each pool (``nccl1``: one rank over NCCL; ``shared2``: two ranks sharing the GPU through
gloo, so that the graph holds real collectives; in the dry run both are gloo on the CPU)
the README's step (``torch.func.grad``, ``reduce_grads``, ``step_shards`` with clipping,
``gather_params``; AdamW with a tensor lr that a schedule changes, the state as tensors)
runs ``STEPS`` steps eagerly, then compiled with ``fullgraph=True`` under each backend:

* ``aot_eager``: must be bitwise the eager loop, in one graph that never recompiles
  (``error_on_recompile``); on ``nccl1`` a failure here fails the part (on ``shared2``,
  gloo's functional collectives over CUDA tensors, it is reported);
* ``inductor``: its largest relative difference to eager, reported (generated kernels
  round differently, ``docs/jit.md``);
* ``reduce-overhead`` (inductor with CUDA graphs): tried, guarded: whatever it raises is
  reported in the results and does not fail the part (CUDA only; the dry run records it
  as skipped).

For each: the first call's time (the compile), the median step time eagerly and compiled,
and the graph count. Results go to ``--out`` (JSON) and one line per (pool, backend) on
stdout. Exit status 0 when ``nccl1``'s ``aot_eager`` run was bitwise and compiled once on
every rank, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for entry in (HERE, HERE.parent, HERE.parent.parent):  # tests/gpu, tests (helpers), the repo (zerofn)
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zerofn as zf  # noqa: E402

STEPS = 6
BACKENDS = ("aot_eager", "inductor", "reduce-overhead")
POOL_NAMES = ("nccl1", "shared2")


def _compiled_step(device_kind: str, backends: list[str], steps: int) -> dict[str, Any]:
    """On each rank: the eager loop, then each backend's compiled loop; the differences and times."""
    from gpucheck import device_here

    device = device_here(device_kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [torch.randn(8, 16, generator=gen).to(device) for _ in range(steps)]
    lr = torch.tensor(1e-2, dtype=torch.float64, device=device)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), x[:, :4].tanh())

    def step(state: zf.ZeroState, p: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        grads = torch.func.grad(loss_fn)(p, x)
        shards = zf.reduce_grads(grads, state.layout, precision=state.precision)
        state, info = zf.step_shards(state, shards, max_norm=1.0)
        return state, zf.gather_params(state), info.grad_norm

    def train(fn: Any) -> tuple[dict[str, torch.Tensor], list[float], float, list[float]]:
        state = zf.shard_params(params, zf.optim.adamw(lr=lr, weight_decay=0.1))
        p, norms, times = params, [], []
        for i, x in enumerate(data):
            lr.fill_(1e-2 * 0.9**i)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            state, p, norm = fn(state, p, x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            norms.append(float(norm))
        return {n: t.detach().cpu() for n, t in p.items()}, norms, times[0], times[1:]

    eager_p, eager_norms, _, eager_times = train(step)
    out: dict[str, Any] = {"device": str(device), "eager_ms": statistics.median(eager_times) * 1e3, "backends": {}}
    for backend in backends:
        res: dict[str, Any] = {}
        out["backends"][backend] = res
        if backend == "reduce-overhead" and device.type != "cuda":
            res["status"] = "skipped: CUDA graphs need CUDA"
            continue
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        kw: dict[str, Any] = {"mode": "reduce-overhead"} if backend == "reduce-overhead" else {"backend": backend}
        try:
            with torch._dynamo.config.patch(error_on_recompile=backend == "aot_eager"):
                got_p, norms, first, times = train(torch.compile(step, fullgraph=True, **kw))
        except Exception as e:  # reported, not fatal except for aot_eager (the part's verdict)
            res["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
            res["traceback"] = traceback.format_exc()[-4000:]
            continue
        worst = 0.0
        for n, t in eager_p.items():
            scale = float(t.double().abs().max()) or 1.0
            worst = max(worst, float((got_p[n].double() - t.double()).abs().max()) / scale)
        res.update(
            status="ok",
            bitwise=all(torch.equal(got_p[n], eager_p[n]) for n in eager_p) and norms == eager_norms,
            max_rel_diff=worst,
            first_call_s=first,
            compiled_ms=statistics.median(times) * 1e3,
            graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
        )
    torch._dynamo.reset()
    return out


def main(argv: list[str] | None = None) -> int:
    from gpucheck import get_world

    p = argparse.ArgumentParser(prog="tests/gpu/jit_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--pools", nargs="+", choices=POOL_NAMES, default=list(POOL_NAMES))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    import gpucheck
    import jit_check

    if args.device != gpucheck.DEVICE:
        print(f"set ZEROFN_GPU_CHECK_DEVICE={args.device} (the pools follow it); it is {gpucheck.DEVICE}")
        return 2
    results: dict[str, Any] = {}
    ok = True
    for pool in args.pools:
        try:
            kind = "cpu" if gpucheck.DEVICE == "cpu" else gpucheck.POOLS[pool][2]
            # By reference (the ranks import this module), not as __main__'s function by value.
            per_rank = get_world(pool).run(jit_check._compiled_step, kind, args.backends, args.steps)
        except Exception as e:  # a pool that cannot run at all fails the part, with the reason
            results[pool] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"JIT {pool}: error {results[pool]['error'][:300]}", flush=True)
            ok = False
            continue
        results[pool] = per_rank[0] | {"ranks": len(per_rank)}
        for backend, res in per_rank[0]["backends"].items():
            line = f"JIT {pool} {backend}: {res['status']}"
            if res["status"] == "ok":
                line += (
                    f", bitwise={res['bitwise']}, max rel diff {res['max_rel_diff']:.2e}, graphs {res['graphs']}, "
                    f"first call {res['first_call_s']:.1f}s, step {res['compiled_ms']:.2f} ms "
                    f"(eager {per_rank[0]['eager_ms']:.2f} ms)"
                )
            print(line, flush=True)
            if backend == "aot_eager" and pool == "nccl1":  # the verdict; shared2 (gloo on CUDA) is reported
                ranks_ok = all(
                    r["backends"][backend].get("bitwise") and r["backends"][backend].get("graphs") == 1
                    for r in per_rank
                )
                ok = ok and ranks_ok
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
