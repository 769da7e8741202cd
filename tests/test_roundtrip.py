"""Round trip: ``gather_params(shard_params(p)) == p`` bitwise on real gloo ranks.

Hypothesis draws the param dict (0-d, empty, numel < world size, odd sizes, four dtypes),
the world size (1-4), the bucket size and the collective realisation; the dict is sent to
every rank with ``World.run`` and the ranks' results are compared in the test process.
"""

from __future__ import annotations

import torch
from helpers import assert_bitwise_equal, assert_trees_equal, seeded
from hypothesis import given
from hypothesis import strategies as st

import zerofn as zf
from zerofn.testing import strategies as zst

POLICIES = {"default": zf.CommPolicy(), "byte_optimal": zf.CommPolicy.byte_optimal()}


def _roundtrip(params, bucket_numel, policy_name, master_dtype=torch.float32):
    """On each rank: shard, then gather. Returns the gathered params and this rank's shards."""
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), master_dtype=master_dtype)
    gathered = zf.gather_params(state, bucket_numel=bucket_numel, comm_policy=POLICIES[policy_name])
    return gathered, dict(state.master)


def _padded_chunks(t, n, dtype):
    """The reference shard rule: flatten, zero-pad to a multiple of n, split in n chunks."""
    flat = t.detach().reshape(-1).to(dtype)
    shard = -(-flat.numel() // n)
    padded = torch.zeros(shard * n, dtype=dtype)
    padded[: flat.numel()] = flat
    return list(padded.split(shard)) if shard else [padded] * n


@given(
    params=zst.param_dicts(),
    n=zst.world_sizes(),
    bucket_numel=st.sampled_from([1, 5, 16, 64, 2**20]),
    policy=st.sampled_from(sorted(POLICIES)),
)
def test_gather_of_shard_returns_the_params_bitwise_on_every_rank(worlds, params, n, bucket_numel, policy):
    results = worlds[n].run(_roundtrip, params, bucket_numel, policy)
    for rank, (gathered, _) in enumerate(results):
        assert list(gathered) == list(params), f"rank {rank}: names or order changed"
        for name, p in params.items():
            assert_bitwise_equal(gathered[name], p, f"rank {rank} {name!r}")


@given(params=zst.param_dicts(), n=zst.world_sizes())
def test_rank_r_holds_chunk_r_of_every_padded_param(worlds, params, n):
    results = worlds[n].run(_roundtrip, params, 2**20, "default")
    for name, p in params.items():
        # float32 masters by default; a float64 param keeps a float64 one (never narrower)
        chunks = _padded_chunks(p, n, torch.float64 if p.dtype == torch.float64 else torch.float32)
        for rank, (_, master) in enumerate(results):
            assert_bitwise_equal(master[name], chunks[rank], f"rank {rank} shard of {name!r}")


def test_corner_shapes_round_trip_at_every_world_size(world):
    params = {
        "scalar": torch.tensor(-2.5),
        "empty": torch.empty(0, 3),
        "tiny": torch.tensor([1.0, -1.0]),
        "odd": torch.arange(91, dtype=torch.float32).reshape(7, 13) / 8,
        "half": torch.arange(5, dtype=torch.float16),
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    }
    for bucket_numel in (1, 8, 2**20):
        for gathered, _ in world.run(_roundtrip, params, bucket_numel, "default"):
            assert_trees_equal(gathered, params)


def test_float64_params_round_trip_bitwise_with_float64_master(world):
    params = {"w": torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(seeded(0)))}
    for gathered, master in world.run(_roundtrip, params, 16, "byte_optimal", torch.float64):
        assert_trees_equal(gathered, params)
        assert master["w"].dtype == torch.float64
