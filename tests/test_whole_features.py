"""Whole params through the rest of zerofn's features, on real gloo ranks: the whole path
is the split path's arithmetic on other rows, so an element-wise optimizer (AdamW) gives
the same bits with its params placed whole as with them split.

The comparison wire is float64 (``comm_dtype``): the sum of three or four float32 addends
is then exact and so independent of where an element sits in the flat buffer (whole and
split params sit at different offsets, and gloo's addition order depends on the offset),
which makes the comparison bitwise at every world size. At 1 and 2 ranks the usual wire
gives the same bits too (one addend, or two in either order): covered with bfloat16
params and float32 masters.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import Net, assert_trees_equal, batches, gate_used, seeded
from torch.func import functional_call, grad

import zerofn as zf

STEPS = 6


def _loss(params, x, y, use_gate):
    return ((functional_call(Net(), params, (x,), {"use_gate": use_gate}) - y) ** 2).mean()


def _train(placement, *, stage=2, precision=None, comm_dtype=torch.float64, hybrid=False, max_norm=None):
    """AdamW on Net with layer drop and a never-used layer; returns the gathered params."""
    torch.manual_seed(seeded(0))
    params = {n: p.detach().clone() for n, p in Net().named_parameters()}
    group, replicas = zf._comm_setup.grid_groups(None, 2) if hybrid else (None, None)
    if precision is not None:
        params = {n: p.to(precision.param_dtype) for n, p in params.items()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), group, precision=precision, placement=placement)
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        use = gate_used(step)
        full = {n: p.float() for n, p in params.items()}
        g = {n: t.to(params[n].dtype) for n, t in grad(functools.partial(_loss))(full, x, y, use).items()}
        g["unused.weight"] = g["unused.bias"] = None
        if not use:
            g = {n: t for n, t in g.items() if not n.startswith("gate.")}
        shards = zf.reduce_grads(
            g,
            state.layout,
            group,
            stage=stage,
            bucket_numel=48,
            comm_dtype=comm_dtype,
            precision=state.precision,
            replicate_group=replicas,
        )
        state, info = zf.step_shards(state, shards, group, max_norm=max_norm)
        params = zf.gather_params(state, group, bucket_numel=48)
    return params, {n: tuple(t.shape) for n, t in state.master.items()}, info.grad_norm


def _matrices_whole(name, p):
    return "whole" if p.ndim == 2 else "split"


def _split_and_whole(**kw):
    return _train(None, **kw), _train(_matrices_whole, **kw)


@pytest.mark.parametrize("stage", [1, 2])
def test_adamw_whole_equals_adamw_split_bitwise(world, stage):
    results = world.run(_split_and_whole, stage=stage)
    for (split, _, norm_s), (whole, _, norm_w) in results:
        assert_trees_equal(whole, split)
        assert norm_w == pytest.approx(norm_s, rel=1e-12)  # one norm, summed over other partitions
    held_matrices = [n for _, (_, held, _) in results for n, s in held.items() if len(s) == 2]
    assert sorted(held_matrices) == ["a.weight", "b.weight", "gate.weight", "unused.weight"]  # once each


def test_whole_with_clipping_clips_the_same_steps_as_split(world):
    for (split, _, _), (whole, _, _) in world.run(_split_and_whole, max_norm=0.05):
        # The clip coefficient comes from the float64 norm, summed over other partitions
        # (its last bit may differ); the params agree to float32 rounding.
        for k in split:
            torch.testing.assert_close(whole[k], split[k], rtol=1e-6, atol=1e-7)


def test_hybrid_whole_equals_hybrid_split_bitwise():
    # 4 ranks: shard groups {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}.
    for (split, _, _), (whole, _, _) in get_world(4).run(_split_and_whole, hybrid=True):
        assert_trees_equal(whole, split)


def test_cpu_offload_of_whole_params_equals_no_offload(world):
    offload = zf.PrecisionPolicy(state_device="cpu", mixed_dtypes="keep")
    for (a, _, _), (b, _, _) in zip(
        world.run(_train, _matrices_whole), world.run(_train, _matrices_whole, precision=offload), strict=True
    ):
        assert_trees_equal(b, a)


@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_bf16_params_with_fp32_masters_whole_equals_split(n):
    bf16 = zf.PrecisionPolicy.for_dtype(torch.bfloat16)
    for (split, _, _), (whole, _, _) in get_world(n).run(_split_and_whole, precision=bf16, comm_dtype=None):
        assert_trees_equal(whole, split)
        assert all(t.dtype == torch.bfloat16 for t in whole.values())


def _master_dtypes_bf16():
    bf16 = zf.PrecisionPolicy.for_dtype(torch.bfloat16)
    params = {"w": torch.randn(5, 4).bfloat16(), "b": torch.randn(4).bfloat16()}
    state = zf.shard_params(params, zf.optim.adamw(), precision=bf16, placement={"w": "whole"})
    return {k: (tuple(t.shape), t.dtype) for k, t in state.master.items()}


def test_a_whole_master_is_full_shaped_float32_on_its_owner_only():
    results = get_world(2).run(_master_dtypes_bf16)
    owners = [r for r, m in enumerate(results) if "w" in m]
    assert len(owners) == 1
    assert results[owners[0]]["w"] == ((5, 4), torch.float32)
    assert all(m["b"] == ((2,), torch.float32) for m in results)


def _wrong_whole_grad(kind):
    params = {"w": torch.zeros(5, 4), "b": torch.zeros(3)}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), placement={"w": "whole"})
    shards = dict(zf.reduce_grads({"w": torch.ones(5, 4), "b": torch.ones(3)}, state.layout))
    owner = state.layout["w"].owner
    if dist.get_rank() == (1 - owner if kind == "not_owner" else owner):
        shards["w"] = torch.ones(5, 4) if kind == "not_owner" else torch.ones(20)
    with pytest.raises((ValueError, zf.RankMismatchError)) as info:
        zf.step_shards(state, shards)
    return type(info.value).__name__, str(info.value)


@pytest.mark.parametrize("kind", ["not_owner", "flat"])
def test_a_bad_whole_gradient_raises_on_every_rank_before_any_change(kind):
    results = get_world(2).run(_wrong_whole_grad, kind)
    kinds = sorted(k for k, _ in results)
    assert kinds == ["RankMismatchError", "ValueError"], results
    message = next(m for k, m in results if k == "ValueError")
    if kind == "not_owner":
        assert "whole param 'w'" in message and "which rank" in message
    else:
        assert "has shape (20,), expected (5, 4)" in message
