"""Save and load time and memory of a sharded checkpoint, one phase per process.

    /usr/bin/time -v python -m benchmarks.checkpoint_io save /tmp/ckpt --world-size 2
    /usr/bin/time -v python -m benchmarks.checkpoint_io load /tmp/ckpt --world-size 2

Each phase starts its own gloo ranks, builds the ~10M-parameter decoder-only transformer
of the benchmarks with AdamW state after one step, and either saves it with
``zf.checkpoint.save`` (model weights included) or loads it with ``zf.checkpoint.load``.
It prints the phase's wall time on rank 0 and every rank's peak RSS (VmHWM); run it under
``/usr/bin/time -v`` for the whole-process figures.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import zerofn as zf
from benchmarks.models import build_model, model_config
from zerofn.testing import World


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _phase(phase: str, path: str) -> dict[str, float]:
    model = build_model(model_config("transformer"), 0, torch.device("cpu"))
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-3))
    grads = {n: torch.full_like(p, 1e-3) for n, p in params.items()}
    state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))
    dist.barrier()
    start = time.perf_counter()
    if phase == "save":
        zf.checkpoint.save(path, state, params=zf.gather_params(state))
    else:
        loaded = zf.checkpoint.load(path, params, params_out=params)
        assert loaded.step == 1
    dist.barrier()
    return {"seconds": time.perf_counter() - start, "peak_rss_mib": _peak_rss_mib(), "psi": float(state.layout.numel)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["save", "load"])
    parser.add_argument("path")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    with World(args.world_size) as world:
        results = world.run(_phase, args.phase, args.path)
    print(
        f"{args.phase} at N={args.world_size}, Ψ={int(results[0]['psi']):,}: {results[0]['seconds']:.2f} s; "
        "peak RSS per rank (MiB): " + ", ".join(f"{r['peak_rss_mib']:.0f}" for r in results)
    )


if __name__ == "__main__":
    main()
