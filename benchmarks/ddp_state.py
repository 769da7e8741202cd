"""What keeping state as DDP keeps it costs: buffer broadcasts per step, entry waits per call, the start.

    python -m benchmarks.ddp_state                 # N = 2 gloo ranks on this host
    python -m benchmarks.ddp_state --quick         # small models, few steps (a smoke run)

Measured, each on the same ranks in one run, interleaved so that the machine's load falls
on both sides alike (median of ``--reps`` blocks of ``--steps`` steps):

* ``broadcast_buffers``: the facade's step time (stage 2, AdamW, ``module=``) with rank 0's
  buffers broadcast before each training forward (the default) and without
  (``broadcast_buffers=False``), on the benchmark transformer (no buffers: the cost is the
  walk over ``named_buffers()``) and on a small ResNet-style model with BatchNorm;
* ``entry_timeout``: one collective entry point's wait (gloo's monitored barrier,
  ``zerofn._comm_join.join``) per call, and ``state_dict()`` with and without it;
* construction: ``ZeroOptimizer(...)`` with ``init_sync`` (rank 0's params and buffers
  broadcast) and without; ``shard_params``'s default value check (a checksum per param
  and one all-gather of two int64) against ``check=False``.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerofn as zf
from benchmarks.models import build_model, loss_fn, make_batches, model_config
from zerofn import _comm_join as comm_join
from zerofn.testing import World


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, as in a ResNet basic block."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class SmallResNet(nn.Module):
    """A stem, ``blocks`` basic blocks of ``c`` channels with BatchNorm, a linear head (10 classes)."""

    def __init__(self, c: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(c) for _ in range(blocks)])
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _model_and_data(name: str, quick: bool) -> tuple[nn.Module, list[Any], Any]:
    if name == "resnet":
        torch.manual_seed(0)
        model: nn.Module = SmallResNet(16 if quick else 32, 2 if quick else 4)
        g = torch.Generator().manual_seed(dist.get_rank())
        side = 8 if quick else 16
        data = [(torch.randn(8, 3, side, side, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
        return model, data, F.cross_entropy
    cfg = model_config(name, quick=quick)
    return (
        build_model(cfg, 0, torch.device("cpu")),
        make_batches(cfg, 0, dist.get_rank(), 4, torch.device("cpu")),
        loss_fn(cfg),
    )


def _step_times(name: str, steps: int, reps: int, quick: bool) -> dict[str, Any]:
    """Median step time with and without broadcast_buffers, interleaved block by block."""
    runs = {}
    for flag in (True, False):
        model, data, loss = _model_and_data(name, quick)
        opt = zf.ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-4), partition_grad=True, module=model, broadcast_buffers=flag
        )
        runs[flag] = (model, opt, data, loss)
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps + 1):
        for flag in (True, False) if rep % 2 else (False, True):  # each side first in every other block
            model, opt, data, loss = runs[flag]
            dist.barrier()
            start = time.perf_counter()
            for i in range(steps):
                x, y = data[i % len(data)]
                opt.backward(loss(model(x), y))
                opt.step()
                opt.zero_grad()
            if rep:  # the first block warms up
                times[flag].append((time.perf_counter() - start) / steps)
    # The work the option adds to a step, alone: the pre-forward broadcast (a collective).
    sync = runs[True][1]._buffer_sync
    calls = 200
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        sync.sync()
    sync_s = (time.perf_counter() - start) / calls
    buffers = sum(b.numel() * b.element_size() for b in runs[True][0].buffers())
    on, off = statistics.median(times[True]), statistics.median(times[False])
    for _, opt, _, _ in runs.values():
        opt.close()
    return {
        "buffer_bytes": buffers,
        "sync_s": sync_s,
        "step_s_broadcast": on,
        "step_s_off": off,
        "cost_s": on - off,
        "cost_pct": 100 * (on - off) / off,
    }


def _entry_costs(reps: int, quick: bool) -> dict[str, Any]:
    """One monitored-barrier wait, and state_dict() of the MLP with and without the wait."""
    calls = 50 if quick else 500
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        comm_join.join(None, 60.0)
    join_s = (time.perf_counter() - start) / calls
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.barrier()
    barrier_s = (time.perf_counter() - start) / calls
    cfg = model_config("mlp-small", quick=quick)
    out: dict[str, Any] = {"join_s": join_s, "plain_barrier_s": barrier_s}
    for timeout in (300.0, None):
        model = build_model(cfg, 0, torch.device("cpu"))
        opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters()), module=model, entry_timeout=timeout)
        samples = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            opt.state_dict()
            samples.append(time.perf_counter() - start)
        out[f"state_dict_s_{'wait' if timeout else 'off'}"] = statistics.median(samples)
        opt.close()
    return out


def _start_costs(reps: int, quick: bool) -> dict[str, Any]:
    """Construction with and without init_sync; shard_params with and without its value check."""
    cfg = model_config("transformer", quick=quick)
    out: dict[str, Any] = {}
    for sync in (True, False):
        samples = []
        for _ in range(reps):
            model = build_model(cfg, 0, torch.device("cpu"))
            dist.barrier()
            start = time.perf_counter()
            opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters()), module=model, init_sync=sync)
            samples.append(time.perf_counter() - start)
            opt.close()
        out[f"construct_s_{'sync' if sync else 'nosync'}"] = statistics.median(samples)
    params = dict(build_model(cfg, 0, torch.device("cpu")).named_parameters())
    for check in (True, False):
        samples = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            zf.shard_params(params, zf.optim.adamw(), check=check)
            samples.append(time.perf_counter() - start)
        out[f"shard_params_s_{'check' if check else 'nocheck'}"] = statistics.median(samples)
    out["params"] = sum(p.numel() for p in params.values())
    return out


PARTS = ("transformer", "resnet_bn", "entry", "start")


def measure(steps: int, reps: int, quick: bool, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    torch.set_num_threads(1)
    run = {
        "transformer": lambda: _step_times("transformer", steps, reps, quick),
        "resnet_bn": lambda: _step_times("resnet", steps, reps, quick),
        "entry": lambda: _entry_costs(reps, quick),
        "start": lambda: _start_costs(reps, quick),
    }
    return {part: run[part]() for part in parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS))
    args = ap.parse_args()
    with World(args.n, timeout=600.0) as world:
        results = world.run(measure, args.steps, args.reps, args.quick, tuple(args.parts))
    print(json.dumps({"n": args.n, "rank0": results[0]}, indent=1))


if __name__ == "__main__":
    main()
