"""The compressed wire in ``value_and_reduced_grads`` and ``ZeroOptimizer``, on real gloo ranks at 1 to 3.

``value_and_reduced_grads`` with ``residual=`` must give ``reduce_grads``'s shards and next
residual bit for bit; ``ZeroOptimizer(precision=PrecisionPolicy(wire=...))`` must give the
functional loop's params (``reduce_grads`` + ``step_shards`` + ``gather_params`` with the
same wire) bit for bit over several steps, ``no_sync`` accumulation included (which leaves
the residual alone), keep the residual on a skipped step, and send its buckets over the
all-to-all; what either cannot serve must stop every rank before any bucket is sent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import assert_bitwise_equal
from torch import nn

import zerofn as zf

WIRE = zf.CompressedWire(kind="int8", block=64, min_numel=16)
BUCKET = 1024  # several buckets, each with compressed (matrices) and float32 (bias) columns


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 5))


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(6, 12, generator=g) * (1 + rank), torch.randn(6, 5, generator=g)


def _loss_fn(model: nn.Module):
    def loss_fn(p, x, y):
        return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

    return loss_fn


# ------------------------------------------------------------------ value_and_reduced_grads


def _vrg_matches_reduce_grads(steps: int) -> int:
    rank = dist.get_rank()
    model = _model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = zf.PrecisionPolicy(wire=WIRE)
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), precision=policy, bucket_numel=BUCKET)
    assert len(state.residual) > 1
    loss_fn = _loss_fn(model)
    for step in range(steps):
        full = zf.gather_params(state)
        x, y = _batch(rank, step)
        grads = torch.func.grad(loss_fn)(full, x, y)
        want, want_residual = zf.reduce_grads(
            grads, state.layout, precision=state.precision, bucket_numel=BUCKET, residual=state.residual
        )
        vrg = zf.value_and_reduced_grads(
            loss_fn, state.layout, precision=state.precision, bucket_numel=BUCKET, residual=state.residual
        )
        loss, (shards, residual) = vrg(full, x, y)
        assert torch.equal(loss, loss_fn(full, x, y))
        for name in want:
            assert_bitwise_equal(shards[name], want[name], f"rank {rank} step {step}: {name}")
        for i, (got, ref) in enumerate(zip(residual, want_residual, strict=True)):
            assert_bitwise_equal(got, ref, f"rank {rank} step {step}: residual {i}")
        state, info = zf.step_shards(state, shards, residual=residual)
        assert not info.skipped
    return sum(int(r.abs().max() > 0) for r in state.residual if r.numel())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_value_and_reduced_grads_gives_reduce_grads_shards_and_residual_bit_for_bit(n):
    for nonzero in get_world(n).run(_vrg_matches_reduce_grads, 3):
        assert nonzero > 0 if n > 1 else nonzero == 0
