"""No stage function changes its inputs; ``donate=True`` may reuse storage, same bits.

Checks run on the ranks themselves (a tensor's ``_version`` does not survive pickling):
each rank snapshots every input (``helpers.Snapshot``: versions, bytes, pytree
structure), calls a stage, and asserts the snapshot still matches. A failed assertion on
a rank comes back as a ``WorldError`` carrying that rank's traceback.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import Snapshot, assert_trees_equal, seeded

import zerofn as zf

BUCKET = 16


def _params():
    gen = torch.Generator().manual_seed(seeded(0))
    return {
        "a.weight": torch.randn(7, 13, generator=gen),
        "a.bias": torch.randn(13, generator=gen),
        "scalar": torch.randn((), generator=gen),
        "empty": torch.empty(0, 4),
        "tiny": torch.randn(2, generator=gen),
        "low": torch.randn(3, 3, generator=gen).to(torch.bfloat16),
        "nograd": torch.randn(5, generator=gen),
    }


def _grads(params, rank):
    """This rank's full grads; "nograd" gets ``None`` and "tiny" is missing (layer drop)."""
    gen = torch.Generator().manual_seed(seeded(100 + rank))
    grads = {n: torch.randn(p.shape, generator=gen).to(p.dtype) for n, p in params.items()}
    grads["nograd"] = None
    del grads["tiny"]
    return grads


def _storages(tree):
    return {
        t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.numel()
    }


def _check_every_stage_is_pure(opt_name, stage, max_norm):
    import torch.distributed as dist

    opt = {"sgd": zf.optim.sgd(lr=0.1, momentum=0.9, nesterov=True), "adamw": zf.optim.adamw(lr=1e-2)}[opt_name]
    params = _params()
    snap = Snapshot(params)
    state = zf.shard_params(params, opt)
    snap.assert_unchanged(params, "shard_params(params)")
    assert not _storages(state) & _storages(params), "shard_params: the state aliases the params"

    for _ in range(2):  # the second step runs on optimizer state that is no longer fresh
        grads = _grads(params, dist.get_rank())
        snap = Snapshot(grads)
        shards = zf.reduce_grads(grads, state.layout, stage=stage, bucket_numel=BUCKET)
        snap.assert_unchanged(grads, "reduce_grads(grads)")
        assert not _storages(shards) & _storages(grads), "reduce_grads: shards alias the grads"

        snap = Snapshot((state, shards))
        new_state, info = zf.step_shards(state, shards, max_norm=max_norm)
        snap.assert_unchanged((state, shards), "step_shards(state, shards)")
        assert new_state is not state and new_state.step == state.step + 1 and not info.skipped

        snap = Snapshot(new_state)
        params = zf.gather_params(new_state, bucket_numel=BUCKET)
        snap.assert_unchanged(new_state, "gather_params(state)")
        assert not _storages(params) & _storages(new_state), "gather_params: params alias the state"
        state = new_state
    return info.clip_coef


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("max_norm", [None, 1e-3], ids=["noclip", "clip"])
def test_no_stage_function_changes_its_inputs(world, opt_name, stage, max_norm):
    coefs = world.run(_check_every_stage_is_pure, opt_name, stage, max_norm)
    # With clipping the scaled-gradient path really ran (the threshold is tiny).
    assert all((c < 1.0) == (max_norm is not None) for c in coefs)


def _donate_matches_pure(max_norm):
    import torch.distributed as dist

    params = _params()
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2, amsgrad=True))
    rank = dist.get_rank()
    for _ in range(3):
        shards = zf.reduce_grads(_grads(params, rank), state.layout, bucket_numel=BUCKET)
        copy_state = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
        copy_shards = {n: s.clone() for n, s in shards.items()}
        pure, pure_info = zf.step_shards(state, shards, max_norm=max_norm)
        ptrs = {n: t.data_ptr() for n, t in copy_state.master.items() if t.numel()}
        donated, donated_info = zf.step_shards(copy_state, copy_shards, max_norm=max_norm, donate=True)
        assert donated_info == pure_info
        assert_trees_equal(donated.master, pure.master)
        for field in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_trees_equal(getattr(donated.opt_state, field), getattr(pure.opt_state, field))
        reused = {n for n, p in ptrs.items() if donated.master[n].data_ptr() == p}
        assert reused == set(ptrs), f"donate=True reused only {sorted(reused)} of {sorted(ptrs)}"
        state = pure
        params = zf.gather_params(state, bucket_numel=BUCKET)
    return True


@pytest.mark.parametrize("max_norm", [None, 1e-3], ids=["noclip", "clip"])
def test_donated_step_reuses_storage_and_gives_the_same_bits(world, max_norm):
    assert world.run(_donate_matches_pure, max_norm) == [True] * world.world_size


def _staging_matches_fresh(stage, how):
    import torch.distributed as dist

    # broadcast pairs with gloo's default all-reduce; all_gather with reduce_scatter (byte-optimal)
    policy = zf.CommPolicy(reduce="reduce_scatter" if how == "all_gather" else "all_reduce", gather=how)
    params = _params()
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    pool = zf.buckets.StagingPool()
    rank = dist.get_rank()
    for _ in range(3):  # the pool's buffers hold the last step's bytes from the second step on
        grads = _grads(params, rank)
        snap = Snapshot(grads)
        fresh = zf.reduce_grads(grads, state.layout, stage=stage, bucket_numel=BUCKET, comm_policy=policy)
        pooled = zf.reduce_grads(
            grads, state.layout, stage=stage, bucket_numel=BUCKET, comm_policy=policy, staging=pool
        )
        snap.assert_unchanged(grads, "reduce_grads(grads, staging=)")
        assert_trees_equal(dict(pooled), dict(fresh))
        held = _storages(pool.buffers())
        assert held, "reduce_grads(staging=) gave no buffer back to the pool"
        assert not _storages(pooled) & held, "reduce_grads(staging=): shards alias the pool"
        state, _ = zf.step_shards(state, pooled)
        snap = Snapshot(state)
        want = zf.gather_params(state, bucket_numel=BUCKET, comm_policy=policy)
        got = zf.gather_params(state, bucket_numel=BUCKET, comm_policy=policy, staging=pool)
        snap.assert_unchanged(state, "gather_params(state, staging=)")
        assert_trees_equal(got, want)
        assert not _storages(got) & _storages(pool.buffers()), "gather_params(staging=): params alias the pool"
        params = got
    try:
        zf.gather_params(state, staging=[])
    except TypeError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("how", ["broadcast", "all_gather"])
def test_a_staging_pool_gives_the_same_bits_and_nothing_returned_aliases_it(world, stage, how):
    for refused in world.run(_staging_matches_fresh, stage, how):
        assert "staging must be a zerofn.buckets.StagingPool" in refused
