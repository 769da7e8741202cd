"""Background checkpoint saves against blocking ones: how long the training loop stops.

    python -m benchmarks.async_checkpoint /tmp/ckpt                 # transformer, N=2, 40 steps, a save every 10
    python -m benchmarks.async_checkpoint /tmp/ckpt --quick         # tiny model, seconds

Each mode (``sync``, then ``async``) starts its own gloo ranks, trains the ~10M-parameter
decoder-only transformer of the benchmarks with ``ZeroOptimizer`` over AdamW (stage 2)
and calls ``save_checkpoint`` every ``--every`` steps (model weights included). Per rank
it records, for every save, the seconds ``save_checkpoint`` blocked the loop and (async)
the seconds until the write was committed; for every step, its time and whether a
background write was in flight. It prints, on rank 0's figures (the ranks wait for each
other in every step and save):

- the median blocking time of a save, sync and async, and their ratio (target <= 20 %);
- the median step time with no write in flight and with one in flight (async mode);
- the staging memory: the bytes of CPU memory each rank's staged copy holds;
- the load average before and after (the machine may be shared: read the figures with it).

``--json PATH`` writes everything (per save, per step, per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import zerofn as zf
from benchmarks.models import build_model, loss_fn, make_batches, model_config
from zerofn.testing import World


def _run(mode: str, path: str, steps: int, every: int, quick: bool) -> dict[str, Any]:
    cfg = model_config("transformer", quick=quick)
    model = build_model(cfg, 0, torch.device("cpu"))
    loss = loss_fn(cfg)
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), partition_grad=True, module=model)
    data = make_batches(cfg, 0, dist.get_rank(), 8, torch.device("cpu"))
    saves: list[dict[str, Any]] = []
    step_s: list[float] = []
    in_flight: list[bool] = []
    pending: list[tuple[Any, float, dict[str, Any]]] = []
    for i in range(steps):
        x, y = data[i % len(data)]
        flying = any(not h.done() for h, _, _ in pending)
        begun = time.perf_counter()
        opt.backward(loss(model(x), y))
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - begun)
        in_flight.append(flying)
        for entry in list(pending):  # note when a background write finished (polled once per step)
            if entry[0].done():
                entry[2]["committed_after_s"] = time.perf_counter() - entry[1]
                pending.remove(entry)
        if (i + 1) % every == 0:
            dist.barrier()  # every rank enters the save together: the time is the save's own
            begun = time.perf_counter()
            out = opt.save_checkpoint(path, async_save=mode == "async")
            blocked = time.perf_counter() - begun
            record: dict[str, Any] = {"step": i + 1, "blocked_s": blocked}
            if mode == "async":
                record["staged_bytes"] = out.staged_bytes  # type: ignore[union-attr]
                pending.append((out, begun, record))
            saves.append(record)
    opt.close()  # waits for the last write
    numel = sum(p.numel() for p in model.parameters())
    return {"saves": saves, "step_s": step_s, "in_flight": in_flight, "params": numel}


def _summary(sync: list[dict[str, Any]], asyn: list[dict[str, Any]]) -> dict[str, Any]:
    r0s, r0a = sync[0], asyn[0]
    sync_block = statistics.median(s["blocked_s"] for s in r0s["saves"])
    async_block = statistics.median(s["blocked_s"] for s in r0a["saves"])
    idle = [t for t, f in zip(r0a["step_s"], r0a["in_flight"], strict=True) if not f]
    busy = [t for t, f in zip(r0a["step_s"], r0a["in_flight"], strict=True) if f]
    committed = [s["committed_after_s"] for s in r0a["saves"] if "committed_after_s" in s]
    return {
        "params": r0s["params"],
        "saves": len(r0s["saves"]),
        "sync_blocked_s": sync_block,
        "async_blocked_s": async_block,
        "ratio": async_block / sync_block,
        "step_s_no_write": statistics.median(idle) if idle else float("nan"),
        "step_s_write_in_flight": statistics.median(busy) if busy else float("nan"),
        "steps_with_write_in_flight": len(busy),
        "async_committed_after_s": statistics.median(committed) if committed else float("nan"),
        "staged_bytes_per_rank": [r["saves"][-1]["staged_bytes"] for r in asyn],
    }


def _remove(path: str) -> None:
    """A previous run's checkpoint at ``path``: the symlink and its directories."""
    folder, name = os.path.split(os.path.abspath(path))
    for entry in os.listdir(folder):
        full = os.path.join(folder, entry)
        if entry == name and os.path.islink(full):
            os.remove(full)
        elif entry.startswith(name + ".") and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="checkpoint path (a symlink zerofn manages; removed first)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="the tiny transformer (smoke run)")
    parser.add_argument("--json", help="write every figure (per save, per step, per rank) here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = {}
    for mode in ("sync", "async"):
        _remove(args.path)
        with World(args.world_size) as world:
            results[mode] = world.run(_run, mode, args.path, args.steps, args.every, args.quick)
    load_after = os.getloadavg()
    s = _summary(results["sync"], results["async"])
    print(
        f"transformer Ψ={s['params']:,}, N={args.world_size}, {args.steps} steps, a save every {args.every} "
        f"({s['saves']} saves per mode); load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
        f"on {os.cpu_count()} CPUs"
    )
    print("| figure (rank 0, median) | value |")
    print("|---|---|")
    print(f"| save_checkpoint blocks the loop, sync | {s['sync_blocked_s'] * 1e3:.0f} ms |")
    print(f"| save_checkpoint blocks the loop, async | {s['async_blocked_s'] * 1e3:.0f} ms |")
    print(f"| async / sync | {100 * s['ratio']:.1f} % (target <= 20 %) |")
    print(f"| step time, no write in flight | {s['step_s_no_write'] * 1e3:.0f} ms |")
    print(
        f"| step time, a write in flight | {s['step_s_write_in_flight'] * 1e3:.0f} ms "
        f"({s['steps_with_write_in_flight']} steps) |"
    )
    print(f"| async: call to commit (seen at the next step's end) | {s['async_committed_after_s'] * 1e3:.0f} ms |")
    print(f"| staging memory per rank | {', '.join(f'{b:,} B' for b in s['staged_bytes_per_rank'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": s, "load": [load_before, load_after], "raw": results}, f, indent=1)


if __name__ == "__main__":
    main()
