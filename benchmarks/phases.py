"""Where a step's time goes: wall and CPU time per phase, DDP against the zerofn facade.

A lighter companion to ``benchmarks.run``: one pool of N gloo ranks, systems built once and
run in interleaved blocks, and for every step the wall time of the slowest rank plus each
rank's *process CPU time* (``time.process_time``: all its threads, gloo's communication
threads and the kernel's loopback copies included), for the whole step and for forward,
backward and optimizer separately. On a machine where the ranks have no spare cores the
CPU time is what a step costs; the wall time adds waiting and other tenants' load::

    python -m benchmarks.phases                                  # transformer, N=2
    python -m benchmarks.phases --systems ddp-fused zerofn-s2-overlap-ag --rounds 6

To compare two revisions, run it in a worktree of each (``git worktree add /tmp/old REV``,
then ``cd /tmp/old && python -m benchmarks.phases``), one after the other on a quiet
machine: the facade is a package now, so one revision's ``ZeroOptimizer`` cannot be loaded
beside another's in the same processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SYSTEMS = ("ddp-fused", "ddp-foreach", "zerofn-s2", "zerofn-s2-overlap", "zerofn-s2-overlap-ag")
_BUILT: dict[str, Any] = {}


def _setup(model_name: str, names: list[str]) -> None:
    import torch
    import torch.distributed as dist

    import zerofn as zf
    from benchmarks import models

    torch.set_num_threads(1)
    cfg = models.model_config(model_name)
    device = torch.device("cpu")
    batches = models.make_batches(cfg, 0, dist.get_rank(), 8, device)
    loss_fn = models.loss_fn(cfg)

    def clock() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    for name in names:
        model = models.build_model(cfg, 0, device)
        if name.startswith("ddp"):
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            kind = {"fused": True} if name == "ddp-fused" else {"foreach": True}
            topt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01, **kind)

            def step(x: Any, y: Any, ddp: Any = ddp, opt: Any = topt) -> list[tuple[float, float]]:
                marks = [clock()]
                loss = loss_fn(ddp(x), y)
                marks.append(clock())
                loss.backward()
                marks.append(clock())
                opt.step()
                opt.zero_grad()
                marks.append(clock())
                return marks

            _BUILT[name] = (step, batches, None)
            continue
        topt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        kwargs: dict[str, Any] = {
            "partition_grad": name.startswith("zerofn-s2"),
            "overlap_communication": "overlap" in name,
            "module": model,
        }
        if name.endswith("-ag"):
            kwargs["overlap_allgather"] = True
        zopt = zf.ZeroOptimizer(topt, **kwargs)

        def zstep(x: Any, y: Any, model: Any = model, opt: Any = zopt) -> list[tuple[float, float]]:
            marks = [clock()]
            loss = loss_fn(model(x), y)
            marks.append(clock())
            opt.backward(loss)
            marks.append(clock())
            opt.step()
            opt.zero_grad()
            marks.append(clock())
            return marks

        _BUILT[name] = (zstep, batches, zopt)


def _block(name: str, steps: int) -> list[list[tuple[float, float]]]:
    import torch.distributed as dist

    step, batches, opt = _BUILT[name]
    step(*batches[0])  # untimed: completes what the previous block of this system left
    dist.barrier()
    out = [step(*batches[(i + 1) % len(batches)]) for i in range(steps)]
    if opt is not None and hasattr(opt, "wait_params"):
        opt.wait_params()  # overlap_allgather: not beside another system's block
    return out


def main(argv: list[str] | None = None) -> None:
    from benchmarks import phases  # by module name: the pool pickles functions by reference
    from zerofn.testing import World

    p = argparse.ArgumentParser(prog="python -m benchmarks.phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer", choices=("transformer", "mlp-small", "mlp-large"))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    names = list(args.systems)
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    steps: dict[str, list[list[list[tuple[float, float]]]]] = {n: [] for n in names}
    with World(args.world_size, threads=1, timeout=120.0) as pool:
        pool.run(phases._setup, args.model, names)
        for name in names:
            pool.run(phases._block, name, 1)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                per_rank = pool.run(phases._block, name, args.steps)
                steps[name].extend(list(zip(*per_rank, strict=True)))
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    print(f"# {args.model}, N={args.world_size}, gloo, 1 thread per rank; load average {load0} -> {load1}")
    print("# medians over steps; wall = slowest rank; cpu = process CPU time per rank (mean of ranks), ms")
    head = f"{'system':26} {'wall':>7} {'wall min':>8} {'cpu':>7}"
    print(head + "".join(f" {ph + ' wall':>9} {ph + ' cpu':>8}" for ph in ("fwd", "bwd", "opt")))
    for name in names:
        rows = steps[name]

        def med(f: Any, rows: list[Any] = rows) -> float:
            return statistics.median(f(step) for step in rows) * 1e3

        wall = [max(m[3][0] - m[0][0] for m in step) for step in rows]
        line = (
            f"{name:26} {statistics.median(wall) * 1e3:7.1f} {min(wall) * 1e3:8.1f} "
            f"{med(lambda s: statistics.fmean(m[3][1] - m[0][1] for m in s)):7.1f}"
        )
        for i in range(3):
            w = med(lambda s, i=i: max(m[i + 1][0] - m[i][0] for m in s))
            c = med(lambda s, i=i: statistics.fmean(m[i + 1][1] - m[i][1] for m in s))
            line += f" {w:9.1f} {c:8.1f}"
        print(line)


if __name__ == "__main__":
    main()
