"""Where a warm compiled step's time goes, beside the donated eager loop, in one pool.

For ``zerofn-fn-donated`` and ``zerofn-fn-compiled`` (``benchmarks/systems.py``) on the
same ranks: the warm-up (the compiled system's compile, once), the median of ``--steps``
timed steps, then cProfile (by own time) and torch.profiler (by self CPU time) of
``--steps`` more, on rank 0::

    python -m benchmarks.jit_profile --model mlp-small --quick     # 34 tensors: minutes
    python -m benchmarks.jit_profile --model mlp-small             # 1028 tensors: the compile is long

What to read in it (``docs/jit.md``, "Time"): the compiled region's own Python time (the
graph replays every aten op from Python), the count of aten calls per step, the guard
check (``TorchDynamo Cache Lookup``) and the collectives.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from typing import Any

SYSTEMS = ("zerofn-fn-donated", "zerofn-fn-compiled")


def _job(model_name: str, quick: bool, steps: int, names: tuple[str, ...] = SYSTEMS) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import models, systems

    cfg = models.model_config(model_name, quick=quick)
    systems.setup(cfg, 0, 8, "fused")
    out: dict[str, Any] = {}
    for name in names:
        systems.build(name)
        t0 = time.perf_counter()
        systems.run_block(name, 0, 2)
        out[f"{name}: warm-up (the compile, once), s"] = time.perf_counter() - t0
        times = systems.run_block(name, steps)["times"]
        out[f"{name}: median step, ms"] = sorted(times)[len(times) // 2] * 1e3
        prof = cProfile.Profile()
        prof.enable()
        systems.run_block(name, steps)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out[f"{name}: cProfile, by own time"] = buf.getvalue()
        with profile(activities=[ProfilerActivity.CPU]) as tp:
            systems.run_block(name, steps)
        out[f"{name}: torch.profiler, by self CPU"] = tp.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25
        )
        systems.drop(name)
    return out


def main(argv: list[str] | None = None) -> None:
    from zerofn.testing import World

    p = argparse.ArgumentParser(prog="python -m benchmarks.jit_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp-small", choices=("transformer", "mlp-small", "mlp-large"))
    p.add_argument("--quick", action="store_true", help="the model's --quick config")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), help="systems of benchmarks/systems.py to profile")
    args = p.parse_args(argv)
    os.environ["ZEROFN_BENCH_WARM_COMPILE"] = "0"  # one compile (the ranks inherit it)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    with World(args.world_size, timeout=3600.0, run_timeout=7200.0) as world:
        res = world.run(_job, args.model, args.quick, args.steps, tuple(args.systems))[0]
    print(f"# {args.model}{' --quick' if args.quick else ''}, N = {args.world_size}, rank 0; load at start {load}")
    for key, value in res.items():
        print(f"## {key}\n{value}\n")


if __name__ == "__main__":
    main()
