"""Bytes sent per step and gradient bytes held per rank: the facade (stage 1 and 2) vs DDP.

    python -m benchmarks.comm_memory                 # N = 2 and 4, an 8-layer 256-wide MLP

For each N it trains one step of the same model under DDP and under ZeroOptimizer at stage
1 and 2 (both comm policies) and prints, per rank:

* bytes sent per step, counted by ``zf.count_bytes()`` for zerofn, and DDP's ring
  all-reduce volume 2(N-1)/N·Ψ·b (its all-reduce runs in C++, out of reach of a counter);
* peak gradient bytes during backward, sampled in post-accumulate-grad hooks registered
  after the facade's: ``ZeroOptimizer.grad_bytes()`` (``p.grad`` + accumulators + buckets
  in flight + shards), and for DDP the ``p.grad`` tensors plus its flat bucket copies.

Exact counts, not timings: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn

import zerofn as zf
from zerofn.testing import World


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def _measure(stage: int, policy: str, bucket: int) -> dict[str, int]:
    model = _model()
    psi = sum(p.numel() for p in model.parameters())
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(dist.get_rank()))
    if stage == 0:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket * 4 / 2**20)
        peak = [0]

        def sample_ddp(_: torch.Tensor) -> None:
            held = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
            peak[0] = max(peak[0], held + psi * 4)  # DDP keeps a flat bucket copy of every gradient

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(sample_ddp)
        ddp(x).square().mean().backward()
        n = dist.get_world_size()
        return {"bytes_sent": 2 * (n - 1) * psi * 4 // n, "peak_grad_bytes": peak[0], "psi": psi}
    pol = zf.CommPolicy.byte_optimal() if policy == "byte_optimal" else zf.CommPolicy()
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters()), partition_grad=stage == 2, reduce_bucket_size=bucket, comm_policy=pol
    )
    peak = [0]

    def sample(_: torch.Tensor) -> None:
        peak[0] = max(peak[0], opt.grad_bytes())

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sample)
    with zf.count_bytes() as counter:
        opt.backward(model(x).square().mean())
        peak[0] = max(peak[0], opt.grad_bytes())
        opt.step()
    return {"bytes_sent": counter.bytes_sent, "peak_grad_bytes": peak[0], "psi": psi, **counter.by_collective}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bucket", type=int, default=256 * 256 + 256, help="elements per bucket (one layer)")
    args = parser.parse_args()
    rows = []
    for n in args.world_sizes:
        with World(n) as world:
            for stage, policy in [(0, "-"), (1, "default"), (2, "default"), (2, "byte_optimal")]:
                res = world.run(_measure, stage, policy, args.bucket)[0]
                rows.append({"N": n, "system": "DDP" if stage == 0 else f"stage {stage} ({policy})", **res})
    print("| N | system | bytes sent / rank / step | vs 2(N-1)/N·Ψ·4 | peak gradient bytes / rank | vs DDP |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ddp = next(d for d in rows if d["N"] == r["N"] and d["system"] == "DDP")
        optimal = 2 * (r["N"] - 1) * r["psi"] * 4 // r["N"]
        print(
            f"| {r['N']} | {r['system']} | {r['bytes_sent']:,} | {r['bytes_sent'] / optimal:.3f}x "
            f"| {r['peak_grad_bytes']:,} | {r['peak_grad_bytes'] / ddp['peak_grad_bytes']:.3f}x |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
