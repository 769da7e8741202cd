"""Which collectives one training step sends, counted call by call (docs/design.md, "What one
step sends").

A step of the facade is at the minimum a ZeRO step needs: one small rank-agreement
all-gather (before any bucket, so ranks with other layouts raise instead of sending other
sizes), one reduction per bucket, one scalar all-reduce (norm and verdicts) and one gather
per bucket. The functional loop reaches the same minimum: ``reduce_grads`` agrees, and the
state ``step_shards`` returns was confirmed in its scalar all-reduce, so ``gather_params`` on
the state's buckets (``bucket_numel`` omitted or the state's own) sends no agreement; given
another ``bucket_numel``, the gather agrees on it. A group of one sends nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import zerofn as zf
from zerofn.buckets import plan_buckets

BUCKET = 160  # elements: the model below makes three buckets
OTHER_BUCKET = 4096  # a gather bucket size of its own: one bucket


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _counted_steps() -> dict[str, tuple[int, dict[str, int]]]:
    """On every rank: the buckets and the calls per collective of the second step of each loop."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out: dict[str, tuple[int, dict[str, int]]] = {}
    for stage in (1, 2):
        for overlap in (False, True):
            model = _model()
            opt = zf.ZeroOptimizer(
                torch.optim.AdamW(model.parameters()),
                partition_grad=stage == 2,
                reduce_bucket_size=BUCKET,
                overlap_communication=overlap,
            )
            for _ in range(2):
                with zf.count_bytes() as counter:
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
            out[f"facade stage {stage} overlap {overlap}"] = (
                len(plan_buckets(opt.state.layout, BUCKET)),
                counter.calls_by_collective,
            )
    model = _model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(), bucket_numel=BUCKET)
    grad_fn = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square().mean())
    for gather_bucket in (None, BUCKET, OTHER_BUCKET):
        with zf.count_bytes() as counter:
            shards = zf.reduce_grads(grad_fn(params), state.layout, bucket_numel=BUCKET)
            state, _ = zf.step_shards(state, shards, max_norm=1.0)
            params = zf.gather_params(state, bucket_numel=gather_bucket)
        out[f"functional gather bucket_numel={gather_bucket}"] = (
            len(plan_buckets(state.layout, BUCKET)),
            counter.calls_by_collective,
        )
    out["gather buckets"] = (len(plan_buckets(state.layout, OTHER_BUCKET)), {})
    return out


def test_a_step_sends_one_agreement_one_collective_per_bucket_each_way_and_one_scalar_all_reduce(world):
    n = world.world_size
    for per_rank in world.run(_counted_steps):
        other_buckets, _ = per_rank.pop("gather buckets")
        assert other_buckets == 1
        for loop, (buckets, calls) in per_rank.items():
            assert buckets == 3, loop
            if n == 1:
                assert calls == {}, loop
                continue
            # gloo's default realisations: all_to_all to reduce (stage 1: all_reduce), one
            # broadcast per rank to gather. A bucket size other than the state's is agreed on by
            # the gather itself.
            other = loop == f"functional gather bucket_numel={OTHER_BUCKET}"
            expected = {
                "check": 2 if other else 1,
                "all_reduce" if "stage 1" in loop else "all_to_all": buckets,
                "scalars": 1,
                "broadcast": other_buckets if other else buckets,
            }
            assert calls == expected, loop
