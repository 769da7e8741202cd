"""Global-norm clipping and non-finite gradients in ``step_shards``.

The norm is over the whole mean gradient (every rank's shards), in float64, with one
scalar collective; the reference is ``torch.nn.utils.clip_grad_norm_`` on the full mean
gradient in one process. A non-finite element on any one rank skips the step everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import Snapshot, assert_trees_close, assert_trees_equal, seeded, tensor_rel_diff

import zerofn as zf

LR = 1.0  # plain SGD with lr 1: the new params are exactly params - clipped grad


def _params():
    gen = torch.Generator().manual_seed(seeded(0))
    return {
        "a.weight": torch.randn(13, 7, generator=gen),
        "a.bias": torch.randn(13, generator=gen),
        "scale": torch.randn((), generator=gen),
        "tiny": torch.randn(2, generator=gen),
    }


def _local_grads(rank):
    gen = torch.Generator().manual_seed(seeded(10 + rank))
    return {n: torch.randn(p.shape, generator=gen) for n, p in _params().items()}


# --------------------------------------------------------------------------- clipping


def _clipped_step(max_norm, norm_type):
    params = _params()
    state = zf.shard_params(params, zf.optim.sgd(lr=LR))
    shards = zf.reduce_grads(_local_grads(dist.get_rank()), state.layout, bucket_numel=32)
    state, info = zf.step_shards(state, shards, max_norm=max_norm, norm_type=norm_type)
    return info, zf.gather_params(state, bucket_numel=32)


def _reference(n, max_norm, norm_type):
    """One process: the mean gradient, clip_grad_norm_, then p - lr * g."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in _params().items()}
    for k, p in params.items():
        p.grad = sum(_local_grads(r)[k] / n for r in range(n))
    total = torch.nn.utils.clip_grad_norm_(params.values(), max_norm, norm_type=norm_type)
    return float(total), {k: (p - LR * p.grad).detach() for k, p in params.items()}


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("max_norm", [0.1, 1e3], ids=["clipped", "not-clipped"])
def test_clipping_matches_clip_grad_norm(world, norm_type, max_norm):
    n = world.world_size
    total, expected = _reference(n, max_norm, norm_type)
    for info, params in world.run(_clipped_step, max_norm, norm_type):
        assert not info.skipped
        assert abs(info.grad_norm - total) <= 1e-6 * total
        if max_norm < total:
            assert abs(info.clip_coef - max_norm / (total + 1e-6)) <= 1e-6 * info.clip_coef
        else:
            assert info.clip_coef == 1.0
        assert_trees_close(params, expected, rel=1e-6)


def _peak_gradient():
    """Every rank: gradients 0.5 except b[2] = -3: the mean's largest |element| is exactly 3."""
    params = {"a": torch.zeros(13, 7), "b": torch.zeros(5)}
    state = zf.shard_params(params, zf.optim.sgd(lr=1.0))
    grads = {"a": torch.full((13, 7), 0.5), "b": torch.tensor([0.5, 0.5, -3.0, 0.5, 0.5])}
    shards = zf.reduce_grads(grads, state.layout)
    new_state, info = zf.step_shards(state, shards, max_norm=1.5, norm_type=math.inf)
    return info, zf.gather_params(new_state)


def test_inf_norm_is_the_largest_absolute_element_of_the_mean_gradient(world):
    for info, params in world.run(_peak_gradient):
        assert info.grad_norm == 3.0
        assert info.clip_coef == 1.5 / (3.0 + 1e-6)
        # Clipped by ~1/2 like torch: b[2] moves by +1.5, every other element by -0.25.
        assert tensor_rel_diff(params["b"], torch.tensor([-0.25, -0.25, 1.5, -0.25, -0.25])) <= 1e-6
        assert tensor_rel_diff(params["a"], torch.full((13, 7), -0.25)) <= 1e-6


# --------------------------------------------------------------------------- non-finite


def _nonfinite_on_last_rank(where, value, norm_type, max_norm, donate):
    """Only the last rank sees a non-finite gradient (before or after the reduction)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    params = _params()
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    grads = _local_grads(rank)
    if where == "local" and rank == n - 1:
        grads["a.weight"] = grads["a.weight"].clone()
        grads["a.weight"][12, 6] = value  # the last element: it lands in the last rank's shard
    shards = zf.reduce_grads(grads, state.layout)
    if where == "shard" and rank == n - 1:
        bias = shards["a.bias"].clone()
        bias[0] = value
        shards = {**shards, "a.bias": bias}
    snap = Snapshot((state, shards))
    new_state, info = zf.step_shards(state, shards, max_norm=max_norm, norm_type=norm_type, donate=donate)
    same_object = new_state is state
    snap.assert_unchanged((state, shards), "a skipped step")
    # The group goes on: the next, finite step applies on every rank.
    shards = zf.reduce_grads(_local_grads(rank), state.layout)
    after, info_after = zf.step_shards(state, shards)
    return same_object, info, info_after.skipped, after.step, zf.gather_params(after)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize(
    ("where", "value"),
    [("local", math.inf), ("local", -math.inf), ("local", math.nan), ("shard", math.inf)],
    ids=["local-inf", "local-neg-inf", "local-nan", "shard-inf"],
)
def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(world, where, value, norm_type, donate):
    results = world.run(_nonfinite_on_last_rank, where, value, norm_type, 1.0, donate)
    for same_object, info, skipped_after, step_after, _ in results:
        assert same_object, "a skipped step returns the very same state"
        assert info.skipped
        assert info.grad_norm == math.inf
        assert info.clip_coef == 1.0
        assert not skipped_after and step_after == 1
    for *_, params in results[1:]:
        assert_trees_equal(params, results[0][-1])
