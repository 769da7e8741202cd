"""Fabric + zerofn against Fabric + DDP: the step time of the same Fabric loop, and the state per rank.

    python -m benchmarks.lightning_fabric              # the benchmark transformer, N = 2 gloo ranks
    python -m benchmarks.lightning_fabric --quick      # tiny model, few steps (a smoke run)

Needs the ``lightning`` extra (``pip install -e '.[lightning]'``). On the same ranks in one
run, interleaved so that the machine's load falls on every system alike (median over
``--reps`` blocks of ``--steps`` steps; a block starts after one warm-up step), the loop
``fabric.backward(loss); optimizer.step(); optimizer.zero_grad()`` with AdamW under:

* ``fabric-ddp``: ``Fabric(strategy="ddp")``, Lightning's DistributedDataParallel;
* ``fabric-zerofn-s1`` / ``fabric-zerofn-s2``: ``Fabric(strategy=ZeroStrategy(stage=...))``.

Reported per system: the median step time and its ratio to ``fabric-ddp``; the optimizer
state (AdamW's two moments, plus zerofn's float32 master shards) in bytes per rank; the
largest difference of its losses from ``fabric-ddp``'s (0 at N = 2: the mean of two
addends does not depend on the order of the sum). Prints one JSON object (``--out`` also
writes it to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.models import build_model, loss_fn, make_batches, model_config, param_count
from zerofn.testing import World

SYSTEMS = ("fabric-ddp", "fabric-zerofn-s1", "fabric-zerofn-s2")


def _state_bytes(opt: Any, zero: bool) -> int:
    """This rank's optimizer-state bytes (zerofn: its master and AdamW shards, each flat buffer once)."""
    if not zero:
        return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    import torch.utils._pytree as pytree

    seen, total = set(), 0
    for t in pytree.tree_leaves((opt.state.master, opt.state.opt_state)):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _rank(model_name: str, quick: bool, steps: int, reps: int) -> dict[str, Any]:
    """On every rank: each system's per-step times, losses and state bytes."""
    import lightning as L

    from zerofn.lightning import ZeroStrategy

    cfg = model_config(model_name, quick=quick)
    batches = make_batches(cfg, seed=0, rank=dist.get_rank(), count=8, device=torch.device("cpu"))
    loss_of = loss_fn(cfg)
    runs = {}
    for name in SYSTEMS:
        strategy = "ddp" if name == "fabric-ddp" else ZeroStrategy(stage=int(name[-1]))
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        fabric.launch()
        model = build_model(cfg, seed=0, device=torch.device("cpu"))
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        runs[name] = {"fabric": fabric, "model": model, "opt": opt, "times": [], "losses": [], "i": 0}

    def step(run: dict[str, Any]) -> float:
        x, y = batches[run["i"] % len(batches)]
        run["i"] += 1
        loss = loss_of(run["model"](x), y)
        run["fabric"].backward(loss)
        run["opt"].step()
        run["opt"].zero_grad()
        return float(loss.detach())

    for _ in range(reps):
        for name in SYSTEMS:  # interleaved: the machine's load falls on every system alike
            run = runs[name]
            run["losses"].append(step(run))  # warm-up step of the block (its loss counts)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                run["losses"].append(step(run))
            dist.barrier()
            run["times"].append((time.perf_counter() - start) / steps)
    out = {}
    for name, run in runs.items():
        zero = name != "fabric-ddp"
        opt = run["fabric"].strategy.optimizers[0] if zero else run["opt"].optimizer
        out[name] = {"times": run["times"], "losses": run["losses"], "state_bytes": _state_bytes(opt, zero)}
        if zero:
            run["fabric"].strategy.teardown()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--n", type=int, default=2, help="ranks")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per block (default 10, --quick 2)")
    ap.add_argument("--reps", type=int, default=None, help="blocks per system (default 5, --quick 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.quick else 10)
    reps = args.reps or (1 if args.quick else 5)
    with World(args.n, timeout=600.0) as world:
        per_rank = world.run(_rank, args.model, args.quick, steps, reps)
    cfg = model_config(args.model, quick=args.quick)
    psi, tensors = param_count(build_model(cfg, seed=0, device=torch.device("cpu")))
    result: dict[str, Any] = {"model": args.model, "n": args.n, "params": psi, "tensors": tensors}
    result["note"], result["load_average"] = args.note, os.getloadavg()
    result["steps"], result["reps"], result["systems"] = steps, reps, {}
    ddp = per_rank[0]["fabric-ddp"]
    ddp_median = statistics.median(ddp["times"])
    for name in SYSTEMS:
        median = statistics.median(per_rank[0][name]["times"])
        loss_diff = max(
            abs(a - b) for r in per_rank for a, b in zip(r[name]["losses"], r["fabric-ddp"]["losses"], strict=True)
        )
        result["systems"][name] = {
            "median_step_s": median,
            "vs_ddp": median / ddp_median,
            "state_bytes_per_rank": max(r[name]["state_bytes"] for r in per_rank),
            "max_loss_diff_vs_ddp": loss_diff,
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
