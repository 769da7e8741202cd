"""The facade's gradient reducer: reused staging buffers, hooks and accumulation.

The facade's steps equal the functional loop (``reduce_grads`` -> ``step_shards`` ->
``gather_params``) bitwise, step after step, reduced shards included: with and without
overlapped reduction, stage 1 from hooks, with a wire dtype other than the gradients' (a
second staging buffer), with float32 accumulation under ``no_sync``, and with members
above the one-pass copy threshold. The staging buffers are reused across steps, bounded,
and freed by ``close()``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CopyTargets, Net, Wide, batches, gate_used, seeded

import zerofn as zf
from zerofn.buckets import plan_buckets
from zerofn.stages._pipeline import BUFFERS_PER_BUCKET, MAX_IN_FLIGHT

STEPS = 7


def _facade_vs_functional(
    stage: int, overlap: bool, wire: str | None, accumulate: int, wide: bool = False
) -> dict[str, Any]:
    """The facade and the functional loop on the same batches, params compared after every step."""
    torch.manual_seed(seeded(0))
    dtype = torch.bfloat16 if accumulate > 1 else torch.float32
    make = Wide if wide else Net
    bucket = 2**17 if wide else 64  # wide: small and large members share buckets
    model = make().to(dtype)
    functional = {n: p.detach().clone() for n, p in model.named_parameters()}
    comm_dtype = getattr(torch, wire) if wire else None
    precision = zf.PrecisionPolicy.for_dtype(dtype).replace(comm_dtype=comm_dtype)
    fopt = zf.optim.adamw(lr=1e-2, weight_decay=0.1)
    opt = zf.ZeroOptimizer(
        model.named_parameters(),
        fopt,
        partition_grad=stage == 2,
        overlap_communication=overlap,
        reduce_bucket_size=bucket,
        precision=precision,
    )
    state = zf.shard_params(functional, fopt, precision=precision)
    data = batches(dist.get_rank(), STEPS * accumulate)
    mismatches = []
    for step in range(STEPS):
        use_gate = gate_used(step)
        grads: dict[str, torch.Tensor] = {}
        for micro in range(accumulate):
            x, y = next(data)
            x, y = x.to(dtype), y.to(dtype)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else opt.no_sync():
                opt.backward(((model(x, use_gate) - y) ** 2).mean())
            params = {n: t.requires_grad_(True) for n, t in functional.items()}
            loss = ((torch.func.functional_call(make().to(dtype), params, (x, use_gate)) - y) ** 2).mean()
            got = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (n, _), g in zip(params.items(), got, strict=True):
                if g is not None:
                    acc = precision.grad_accum_dtype_for(dtype) if accumulate > 1 else dtype
                    grads[n] = g.to(acc) if n not in grads else grads[n] + g.to(acc)
            functional = {n: t.detach() for n, t in functional.items()}
        shards = zf.reduce_grads(grads, state.layout, stage=stage, precision=precision, bucket_numel=bucket)
        # The reduced shards themselves (AdamW would hide a gradient scale error): what step
        # will apply (at stage 1 cut from the averaged p.grad).
        held = opt._reducer.step_grads.peek_step_grads()
        mismatches += [(step, "grad", n) for n in shards if n not in held or not torch.equal(held[n], shards[n])]
        mismatches += [(step, "grad", n) for n in held if n not in shards]
        state, _ = zf.step_shards(state, shards)
        functional = dict(zf.gather_params(state, bucket_numel=bucket))
        opt.step()
        opt.zero_grad()
        mine = {n: p.detach() for n, p in model.named_parameters()}
        mismatches += [(step, n) for n in mine if not torch.equal(mine[n], functional[n])]
    return {"mismatches": mismatches}


@pytest.mark.parametrize(
    ("stage", "overlap", "wire", "accumulate", "wide"),
    [
        (2, False, None, 1, False),
        (2, True, None, 1, False),
        (1, True, "bfloat16", 1, False),
        (2, True, "float16", 1, False),
        (2, True, None, 3, False),
        (2, True, None, 1, True),
        (2, False, "bfloat16", 3, True),
    ],
)
def test_reused_staging_buffers_keep_the_facade_bitwise_equal_to_the_functional_loop(
    world, stage, overlap, wire, accumulate, wide
):
    for res in world.run(_facade_vs_functional, stage, overlap, wire, accumulate, wide):
        assert res["mismatches"] == []


def _staging_reuse(overlap: bool, wire: str | None) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    bucket = 64
    opt = zf.ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        partition_grad=True,
        overlap_communication=overlap,
        reduce_bucket_size=bucket,
        communication_dtype=getattr(torch, wire) if wire else None,
    )
    sizes, ptrs = [], []
    for step, (x, y) in enumerate(batches(dist.get_rank(), 6)):
        opt.backward(((model(x, gate_used(step)) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
        sizes.append(opt.staging_bytes())
        ptrs.append(sorted(b.data_ptr() for b in opt._reducer.staging.buffers()))
    n = opt.state.layout.world_size
    largest = max(b.shard_numel * n for b in plan_buckets(opt.state.layout, bucket))
    opt.close()
    return {"sizes": sizes, "ptrs": ptrs, "largest": largest, "after_close": opt.staging_bytes()}


@pytest.mark.parametrize(("overlap", "wire"), [(False, None), (True, None), (True, "bfloat16")])
def test_staging_buffers_are_reused_across_steps_and_bounded(world, overlap, wire):
    for res in world.run(_staging_reuse, overlap, wire):
        keep = BUFFERS_PER_BUCKET * (MAX_IN_FLIGHT + 1 if overlap else 1)
        dtypes = 2 if wire else 1
        elems = max(res["largest"], 64)
        assert all(0 < size <= dtypes * keep * elems * 4 for size in res["sizes"])
        if not overlap:
            # From the second step on, the same buffers: nothing allocated, nothing dropped.
            # (Overlapped, how many buckets are in flight at once depends on timing.)
            assert res["sizes"][1:] == [res["sizes"][1]] * (len(res["sizes"]) - 1)
            assert all(p == res["ptrs"][1] for p in res["ptrs"][2:])
        assert res["after_close"] == 0


def _facade_copies_into_shards(overlap: bool) -> dict[str, Any]:
    """The copies that wrote into the flat gradient buffers a stage-2 backward leaves for step."""
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), partition_grad=True, overlap_communication=overlap
    )
    counts = []
    for step, (x, y) in enumerate(batches(dist.get_rank(), 3)):
        with CopyTargets() as mode:
            opt.backward(((model(x, gate_used(step)) - y) ** 2).mean())
        counts.append(mode.into(opt._reducer.held.grad_bufs.values()))
        opt.step()
        opt.zero_grad()
    spans = sum(b.span is not None for b in plan_buckets(opt.state.layout, opt.state.bucket_numel))
    return {"copies": counts, "buckets": spans}


@pytest.mark.parametrize("overlap", [False, True])
def test_the_facade_sums_each_bucket_where_its_shards_stay(world, overlap):
    """Stage 2 on gloo: each bucket's all-to-all sum lands in its range of the flat gradient
    buffer that step receives; no copy or clone makes it (one rank: no collective, one copy per bucket)."""
    for res in world.run(_facade_copies_into_shards, overlap):
        expected = 0 if world.world_size > 1 else res["buckets"]
        assert res["buckets"] > 0 and res["copies"] == [expected] * 3, res
