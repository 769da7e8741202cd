"""Ranks agree on the layout, or every rank raises RankMismatchError before any exchange.

A mismatch found inside a bucket collective would hang or silently sum the wrong
elements, so ``reduce_grads`` and ``gather_params`` compare fingerprints (and the set of
params with gradients, and their settings) first. These tests make the *last* rank
disagree and check that every rank raises the same clear error, that no bucket
collective was issued, that no input changed, and that the group works afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import Snapshot, assert_trees_equal
from hypothesis import given

import zerofn as zf
from zerofn.testing import RankFailure
from zerofn.testing import strategies as zst

BUCKET = 64
BUCKET_COLLECTIVES = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"N{n}")
def multi_world(request):
    """World sizes where ranks can disagree."""
    return get_world(request.param)


def _params(variant=None):
    params = {
        "a.weight": torch.ones(13, 7),
        "a.bias": torch.ones(13),
        "b.weight": torch.ones(5, 13),
        "b.bias": torch.ones(5),
    }
    if variant == "shape":
        params["b.weight"] = torch.ones(13, 5)
    elif variant == "numel":
        params["b.weight"] = torch.ones(5, 12)
    elif variant == "dtype":
        params["a.bias"] = torch.ones(13, dtype=torch.float64)
    elif variant == "name":
        params["a.b"] = params.pop("a.bias")
    elif variant == "order":
        params = dict(reversed(params.items()))
    return params


def _fingerprint(params):
    return zf.shard_params(params, zf.optim.sgd(lr=0.1)).layout.fingerprint


@given(params=zst.param_dicts(), n=zst.world_sizes())
def test_layout_fingerprints_are_equal_across_ranks(worlds, params, n):
    fingerprints = worlds[n].run(_fingerprint, params)
    assert fingerprints == [zf.make_layout(params, n).fingerprint] * n


LAYOUT_CASES = ["shape", "numel", "dtype", "name", "order"]
SETTING_CASES = ["present", "stage", "bucket_numel", "gather_bucket_numel"]


def _disagree(case):
    """Every rank but the last does the normal thing; the last disagrees as ``case`` says."""
    odd = dist.get_rank() == dist.get_world_size() - 1
    params = _params(case if odd else None)
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    grads = {n: torch.full_like(p, 0.5) for n, p in params.items()}
    if odd and case == "present":
        del grads["b.bias"]
    stage = 1 if odd and case == "stage" else 2
    bucket = BUCKET // 2 if odd and case in ("bucket_numel", "gather_bucket_numel") else BUCKET
    snap = Snapshot((params, grads, state))
    with zf.count_bytes() as counter:
        try:
            if case == "gather_bucket_numel":
                zf.gather_params(state, bucket_numel=bucket)
            else:
                zf.reduce_grads(grads, state.layout, stage=stage, bucket_numel=bucket)
        finally:
            snap.assert_unchanged((params, grads, state), "inputs after the mismatch")
            # Only the agreement check's one tiny collective went out: no bucket was exchanged.
            assert not set(counter.by_collective) & BUCKET_COLLECTIVES, counter.by_collective
            assert counter.calls == 1, counter.by_collective
    return "no error"


EXPECTED = {
    # case: substrings the message must contain ({last} is the disagreeing rank)
    "shape": ["'b.weight'", "rank 0 has shape (5, 13)", "rank {last} has shape (13, 5)"],
    "numel": ["'b.weight'", "rank 0 has shape (5, 13)", "rank {last} has shape (5, 12)"],
    "dtype": ["'a.bias'", "torch.float32", "rank {last}", "torch.float64"],
    "name": ["'a.b'", "'a.bias'", "rank 0", "rank {last}"],
    "order": ["Rank 0 and rank {last} list the same params in a different order", "'a.weight' vs 'b.bias'"],
    "present": ["'b.bias'", "gradient on ranks {others}", "none on ranks [{last}]"],
    "stage": ["stage: rank 0 has 2, rank {last} has 1"],
    "bucket_numel": ["bucket_numel: rank 0 has 64, rank {last} has 32"],
    "gather_bucket_numel": ["gather_params", "bucket_numel: rank 0 has 64, rank {last} has 32"],
}


def _normal_step():
    params = _params()
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    grads = {n: torch.full_like(p, 0.5 + dist.get_rank()) for n, p in params.items()}
    shards = zf.reduce_grads(grads, state.layout, bucket_numel=BUCKET)
    state, info = zf.step_shards(state, shards)
    return zf.gather_params(state, bucket_numel=BUCKET), info


@pytest.mark.parametrize("case", LAYOUT_CASES + SETTING_CASES)
def test_disagreeing_ranks_all_raise_rank_mismatch_before_any_exchange(multi_world, case):
    n = multi_world.world_size
    restarts = multi_world.restarts
    results = multi_world.run(_disagree, case, return_exceptions=True)
    last, others = n - 1, list(range(n - 1))
    for rank, r in enumerate(results):
        assert isinstance(r, RankFailure), f"rank {rank} did not raise: {r!r}"
        assert r.type_name == "RankMismatchError", f"rank {rank}: {r.type_name}: {r.message}\n{r.traceback}"
        assert isinstance(r.exc, zf.RankMismatchError)
        assert "before any shard was exchanged" in r.message
        for part in EXPECTED[case]:
            assert part.format(last=last, others=others) in r.message, (rank, r.message)
    assert len({r.message for r in results}) == 1, "every rank explains the same mismatch"
    # Every rank failed alike, so the pool was not restarted, and the group still works.
    assert multi_world.restarts == restarts
    after = multi_world.run(_normal_step)
    for params, info in after:
        assert_trees_equal(params, after[0][0])
        assert not info.skipped and info.grad_norm > 0


def _none_or_missing():
    """Rank 0 passes ``None`` for b.bias, the others leave it out: the same thing."""
    params = _params()
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1))
    grads = {n: torch.full_like(p, 1.0 + dist.get_rank()) for n, p in params.items()}
    if dist.get_rank() == 0:
        grads["b.bias"] = None
    else:
        del grads["b.bias"]
    return list(zf.reduce_grads(grads, state.layout, bucket_numel=BUCKET))


def test_none_and_missing_gradients_agree_across_ranks(world):
    names = ["a.weight", "a.bias", "b.weight"]
    assert world.run(_none_or_missing) == [names] * world.world_size


# --------------------------------------------------------------------------- one rank's bad input


def _one_rank_rejects(stage_fn: str) -> str:
    """Rank 1 alone passes a bad input; every rank must raise, none may wait in a collective."""
    params = {"w": torch.ones(6), "b": torch.ones(3)}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1))
    bad = dist.get_rank() == 1
    try:
        if stage_fn == "reduce_grads":
            grads = {"w": torch.ones(5 if bad else 6), "b": torch.ones(3)}  # wrong shape on rank 1 only
            zf.reduce_grads(grads, state.layout)
        else:
            shards = zf.reduce_grads({"w": torch.ones(6), "b": torch.ones(3)}, state.layout)
            if bad:
                shards = {"w": torch.ones(99), "b": shards["b"]}
            zf.step_shards(state, shards)
    except (ValueError, zf.RankMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("stage_fn", ["reduce_grads", "step_shards"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_bad_input_on_one_rank_makes_every_rank_raise_at_once(worlds, n, stage_fn):
    # Nobody waited for a peer: a rank left in a collective would raise gloo's timeout
    # error, not the RankMismatchError naming rank 1 (no clock: it depends on the load).
    messages = worlds[n].run(_one_rank_rejects, stage_fn)
    assert messages[1].startswith("ValueError") and "rank 1" in messages[1]
    for r, m in enumerate(messages):
        if r != 1:
            assert m.startswith("RankMismatchError") and "rank 1 rejected its input" in m, m
    # Every rank left the call cleanly: the same group carries on with a normal step.
    restarts = worlds[n].restarts
    assert worlds[n].run(_one_plain_step) == [1] * n
    assert worlds[n].restarts == restarts


def _one_plain_step() -> int:
    state = zf.shard_params({"w": torch.ones(6)}, zf.optim.sgd(lr=0.1))
    state, _ = zf.step_shards(state, zf.reduce_grads({"w": torch.ones(6)}, state.layout))
    return state.step


# --------------------------------------------------------------------------- the step confirms the gather


def _step_then_gather(case: str) -> str:
    """The last rank steps a state of another layout (``"layout"``) or bucket size (``"bucket"``):
    ``step_shards`` must make every rank raise, since the gather after it skips its agreement."""
    odd = dist.get_rank() == dist.get_world_size() - 1
    params = _params("shape" if odd and case == "layout" else None)
    bucket = BUCKET // 2 if odd and case == "bucket" else BUCKET
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), bucket_numel=bucket, check=False)
    fl = zf.flat.flat_layout(state.layout, state.rank)
    shards = zf.flat.pack(fl, {n: torch.ones_like(state.master[n]) for n in state.master})
    snap = Snapshot(state)
    with zf.count_bytes() as counter:
        try:
            zf.step_shards(state, shards)
        finally:
            snap.assert_unchanged(state, "the state after the mismatch")
            assert not set(counter.by_collective) & BUCKET_COLLECTIVES, counter.by_collective
    return "no error"


@pytest.mark.parametrize("case", ["layout", "bucket"])
def test_step_shards_confirms_every_ranks_layout_and_bucket_size_for_the_gather(multi_world, case):
    n = multi_world.world_size
    results = multi_world.run(_step_then_gather, case, return_exceptions=True)
    bucket = f"bucket_numel: rank 0 has {BUCKET}, rank {n - 1} has {BUCKET // 2}"
    expected = "'b.weight'" if case == "layout" else bucket
    for rank, r in enumerate(results):
        assert isinstance(r, RankFailure) and r.type_name == "RankMismatchError", (rank, r)
        assert "step_shards" in r.message and expected in r.message, (rank, r.message)
    assert len({r.message for r in results}) == 1
    for _, info in multi_world.run(_normal_step):
        assert not info.skipped and info.grad_norm > 0


def _confirmation() -> dict[str, object]:
    state = zf.shard_params(_params(), zf.optim.sgd(lr=0.1))
    grads = {n: torch.full_like(p, 0.5) for n, p in _params().items()}
    stepped, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))
    rebuilt = torch.utils._pytree.tree_map(lambda t: t, stepped)
    return {
        "fresh": state.agreed_in,
        "stepped": stepped.agreed_in,
        "same layout": stepped.replace(step=stepped.step).agreed_in,
        "other bucket size": stepped.replace(bucket_numel=BUCKET).agreed_in,
        "rebuilt from its leaves": rebuilt.agreed_in,
    }


def test_only_a_state_the_step_confirmed_skips_the_gathers_agreement(world):
    for got in world.run(_confirmation):
        assert got == {
            "fresh": None,
            "stepped": "",  # the default group
            "same layout": "",
            "other bucket size": None,
            "rebuilt from its leaves": None,
        }
