"""The functional loop's gradient phase alone: ``grad_and_value`` + ``reduce_grads`` against
``value_and_reduced_grads`` (the same buckets and bits, each bucket reduced during the
backward), beside ``grad_and_value`` without communication.

A lighter companion to ``benchmarks.run`` that isolates what the overlap hides: one pool of
N gloo ranks, the three calls interleaved (each repetition starts with the next one in
turn, after a barrier), the slowest rank's wall time per call::

    python -m benchmarks.grad_overlap                               # mlp-large, N=2, default buckets
    python -m benchmarks.grad_overlap --bucket-numel 1048576 --reps 100

Only the reductions of the buckets the backward completes before its end can hide: with
two buckets (mlp-large at the default size) one of them; the last one always waits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/grad_overlap.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CALLS = ("grad_and_value + reduce_grads", "value_and_reduced_grads", "grad_and_value alone (no communication)")


def _time_calls(model_name: str, bucket_numel: int | None, reps: int) -> dict[str, list[float]]:
    """On each rank: the three calls, interleaved, ``reps`` times each; seconds per call."""
    import torch
    import torch.distributed as dist

    import zerofn as zf
    from benchmarks import models

    torch.set_num_threads(1)
    cfg = models.model_config(model_name)
    model = models.build_model(cfg, 0, torch.device("cpu"))
    for p in model.parameters():
        p.requires_grad_(False)  # the gradients are taken with respect to the dict passed in
    params = {n: p.detach() for n, p in model.named_parameters()}
    layout = zf.make_layout(params, dist.get_world_size())
    loss = models.loss_fn(cfg)
    x, y = models.make_batches(cfg, 0, dist.get_rank(), 1, torch.device("cpu"))[0]
    bucket = {} if bucket_numel is None else {"bucket_numel": bucket_numel}

    def loss_of(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss(torch.func.functional_call(model, p, (x,)), y)

    grad_and_value = torch.func.grad_and_value(loss_of)
    pool = zf.buckets.StagingPool()
    overlapped = zf.value_and_reduced_grads(loss_of, layout, staging=zf.buckets.StagingPool(), **bucket)

    def composed() -> Any:
        grads, _ = grad_and_value(params, x, y)
        return zf.reduce_grads(grads, layout, staging=pool, **bucket)

    fns = (composed, lambda: overlapped(params, x, y), lambda: grad_and_value(params, x, y))
    calls = list(zip(CALLS, fns, strict=True))
    for _, call in calls * 3:  # warm-up
        call()
    times: dict[str, list[float]] = {name: [] for name in CALLS}
    for i in range(reps):
        for name, call in calls[i % 3 :] + calls[: i % 3]:
            dist.barrier()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    from zerofn.testing import World

    p = argparse.ArgumentParser(prog="python -m benchmarks.grad_overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp-large", choices=("transformer", "mlp-small", "mlp-large"))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--bucket-numel", type=int, default=None, help="default: zerofn's DEFAULT_BUCKET_NUMEL")
    p.add_argument("--reps", type=int, default=60, help="timed calls of each kind")
    args = p.parse_args(argv)
    world = World(args.world_size, timeout=300, run_timeout=3600)
    try:
        per_rank = world.run(_time_calls, args.model, args.bucket_numel, args.reps)
    finally:
        world.close()
    print(f"{args.model}, N = {args.world_size}, bucket_numel {args.bucket_numel or 'default'}, {args.reps} reps")
    print("| call | median ms | p25 ms | min ms |\n|---|---:|---:|---:|")
    for name in CALLS:
        slowest = [max(r[name][i] for r in per_rank) * 1e3 for i in range(args.reps)]
        p25 = statistics.quantiles(slowest, n=4)[0]
        print(f"| {name} | {statistics.median(slowest):.1f} | {p25:.1f} | {min(slowest):.1f} |")


if __name__ == "__main__":
    main()
