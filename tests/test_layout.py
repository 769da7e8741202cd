"""ShardLayout: the padding/shard rule, the rank-major bucket plan and the fingerprint.

The layout is pure (no ranks, no tensors touched beyond shape and dtype), so these tests
run in the test process.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zerofn as zf
from zerofn.buckets import plan_buckets
from zerofn.testing import strategies as zst


def _specs(shapes, dtype=torch.float32):
    return {f"p{i}": torch.empty(s, dtype=dtype, device="meta") for i, s in enumerate(shapes)}


# --------------------------------------------------------------------------- shard rule


@given(shape=zst.shapes(), n=zst.world_sizes(8))
def test_every_param_is_padded_to_a_multiple_of_the_world_size(shape, n):
    spec = zf.make_layout({"w": torch.empty(shape, device="meta")}, n)["w"]
    numel = math.prod(shape)
    assert spec.numel == numel
    assert spec.shard_numel == -(-numel // n)
    assert spec.padded_numel == n * spec.shard_numel
    assert 0 <= spec.padding < n if numel else spec.padding == 0
    assert spec.shape == tuple(shape)


@given(shape=zst.shapes(), n=zst.world_sizes(8))
def test_owned_ranges_tile_the_real_elements_in_rank_order(shape, n):
    spec = zf.make_layout({"w": torch.empty(shape, device="meta")}, n)["w"]
    ranges = [spec.owned_range(r) for r in range(n)]
    covered = [i for start, stop in ranges for i in range(start, stop)]
    assert covered == list(range(spec.numel))
    for r, (start, stop) in enumerate(ranges):
        assert start == min(r * spec.shard_numel, spec.numel)
        assert 0 <= stop - start <= spec.shard_numel


def test_zero_dim_param_has_one_element_and_pads_to_the_world_size():
    layout = zf.make_layout({"s": torch.tensor(1.0)}, 4)
    spec = layout["s"]
    assert (spec.shape, spec.numel, spec.shard_numel, spec.padding) == ((), 1, 1, 3)
    assert [spec.owned_range(r) for r in range(4)] == [(0, 1), (1, 1), (1, 1), (1, 1)]


def test_empty_param_has_no_shard_and_no_padding():
    spec = zf.make_layout({"e": torch.empty(3, 0)}, 3)["e"]
    assert (spec.numel, spec.shard_numel, spec.padding) == (0, 0, 0)
    assert [spec.owned_range(r) for r in range(3)] == [(0, 0)] * 3


def test_param_smaller_than_the_world_leaves_later_ranks_only_padding():
    spec = zf.make_layout({"t": torch.empty(2)}, 4)["t"]
    assert (spec.shard_numel, spec.padding) == (1, 2)
    assert [spec.owned_range(r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_layout_totals_sum_over_params():
    layout = zf.make_layout(_specs([(7, 13), (13,), (), (0,)]), 3)
    assert layout.numel == 91 + 13 + 1 + 0
    assert layout.shard_numel == 31 + 5 + 1 + 0
    assert layout.names == ("p0", "p1", "p2", "p3")
    assert len(layout) == 4 and "p2" in layout and "nope" not in layout


def test_world_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        zf.make_layout({"w": torch.empty(3)}, 0)


# --------------------------------------------------------------------------- buckets


@given(
    shapes=st.lists(zst.shapes(max_dims=2, max_side=12), min_size=1, max_size=8),
    n=zst.world_sizes(),
    bucket_numel=st.integers(min_value=1, max_value=200),
)
def test_buckets_respect_size_keep_order_and_hold_every_nonempty_param_once(shapes, n, bucket_numel):
    layout = zf.make_layout(_specs(shapes), n)
    buckets = plan_buckets(layout, bucket_numel)
    flat = [name for b in buckets for name in b.names]
    assert flat == [s.name for s in layout.params if s.numel > 0]
    for b in buckets:
        assert b.names, "no empty buckets"
        sizes = [layout[name].shard_numel for name in b.names]
        assert list(b.offsets) == [sum(sizes[:i]) for i in range(len(sizes))]
        assert b.shard_numel == sum(sizes)
        # A bucket holds more than one param only if they all fit.
        assert len(b.names) == 1 or n * b.shard_numel <= bucket_numel
    for b, nxt in itertools.pairwise(buckets):
        # Greedy: a bucket is closed only because the next param would not fit.
        assert n * (b.shard_numel + layout[nxt.names[0]].shard_numel) > bucket_numel


def test_param_larger_than_a_bucket_travels_alone():
    layout = zf.make_layout(_specs([(3,), (100,), (2,), (2,)]), 2)
    buckets = plan_buckets(layout, 8)
    assert [b.names for b in buckets] == [("p0",), ("p1",), ("p2", "p3")]
    assert buckets[1].shard_numel == 50


def test_bucket_closes_when_the_next_param_would_overflow_it():
    # Padded sizes over 2 ranks: 4, 4, 4 -> a bucket of 8 holds two of them.
    layout = zf.make_layout(_specs([(4,), (3,), (4,)]), 2)
    assert [b.names for b in plan_buckets(layout, 8)] == [("p0", "p1"), ("p2",)]
    assert [b.names for b in plan_buckets(layout, 12)] == [("p0", "p1", "p2")]


def test_buckets_are_dtype_homogeneous():
    params = {
        "a": torch.empty(3, dtype=torch.float32),
        "b": torch.empty(3, dtype=torch.float32),
        "c": torch.empty(3, dtype=torch.bfloat16),
        "d": torch.empty(3, dtype=torch.float32),
    }
    layout = zf.make_layout(params, 2)
    buckets = plan_buckets(layout, 10**6)
    assert [b.names for b in buckets] == [("a", "b"), ("c",), ("d",)]
    for b in buckets:
        assert len({layout[n].dtype for n in b.names}) == 1


def test_buckets_for_a_subset_of_names_keep_layout_order():
    layout = zf.make_layout(_specs([(2,), (2,), (2,), (2,)]), 2)
    buckets = plan_buckets(layout, 10**6, names=["p3", "p1"])
    assert [b.names for b in buckets] == [("p1", "p3")]
    assert buckets[0].offsets == (0, 1)


def test_buckets_accept_names_from_a_one_shot_iterator():
    layout = zf.make_layout(_specs([(2,), (2,), (2,), (2,)]), 2)
    assert plan_buckets(layout, 100, names=iter(["p3", "p1"])) == plan_buckets(layout, 100, names=["p1", "p3"])


def test_empty_params_travel_in_no_bucket():
    layout = zf.make_layout(_specs([(0,), (3, 0), ()]), 3)
    assert [b.names for b in plan_buckets(layout, 100)] == [("p2",)]


@pytest.mark.parametrize("bad", [0, -1])
def test_bucket_numel_must_be_positive(bad):
    layout = zf.make_layout(_specs([(2,)]), 2)
    with pytest.raises(ValueError, match="bucket_numel must be a positive"):
        plan_buckets(layout, bad)


# --------------------------------------------------------------------------- fingerprint


def _fingerprint(params, n):
    return zf.make_layout(params, n).fingerprint


def test_fingerprint_is_stable_across_builds_and_devices():
    a = {"w": torch.zeros(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)}
    b = {
        "w": torch.empty(3, 4, device="meta"),
        "b": torch.empty(4, dtype=torch.bfloat16, device="meta"),
    }
    assert _fingerprint(a, 3) == _fingerprint(a, 3) == _fingerprint(b, 3)
    assert zf.make_layout(a, 3) == zf.make_layout(b, 3)
    assert hash(zf.make_layout(a, 3)) == hash(zf.make_layout(b, 3))
    assert 0 <= zf.make_layout(a, 3).fingerprint_int < 2**63


def test_fingerprint_does_not_depend_on_values():
    assert _fingerprint({"w": torch.zeros(5)}, 2) == _fingerprint({"w": torch.randn(5)}, 2)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"w": torch.zeros(3, 4), "c": torch.zeros(4)}, id="name"),
        pytest.param({"w": torch.zeros(4, 3), "b": torch.zeros(4)}, id="shape"),
        pytest.param({"w": torch.zeros(12), "b": torch.zeros(4)}, id="flattened-shape"),
        pytest.param({"w": torch.zeros(3, 4, dtype=torch.float64), "b": torch.zeros(4)}, id="dtype"),
        pytest.param({"b": torch.zeros(4), "w": torch.zeros(3, 4)}, id="order"),
        pytest.param({"w": torch.zeros(3, 4)}, id="missing-param"),
    ],
)
def test_fingerprint_changes_with_names_shapes_dtypes_and_order(other):
    base = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    assert _fingerprint(base, 2) != _fingerprint(other, 2)
    assert zf.make_layout(base, 2) != zf.make_layout(other, 2)


def test_fingerprint_changes_with_world_size():
    params = {"w": torch.zeros(3, 4)}
    assert len({_fingerprint(params, n) for n in (1, 2, 3, 4)}) == 4


def test_a_layout_is_found_by_its_fingerprint_also_after_a_pickle_round_trip():
    import pickle

    from zerofn._offsets import _traced_plan
    from zerofn.layout import layout_by_fingerprint

    params = {"a": torch.zeros(5, 3), "b": torch.zeros(7)}
    layout = zf.make_layout(params, 3)
    assert layout_by_fingerprint(layout.fingerprint) is layout
    back = pickle.loads(pickle.dumps(layout))
    assert back == layout and back.names == layout.names
    assert layout_by_fingerprint(layout.fingerprint) in (layout, back)
    # What a compiled step reads at trace time is the eager plan.
    assert _traced_plan(layout.fingerprint, None, 8) == plan_buckets(layout, 8)
    assert _traced_plan(layout.fingerprint, ("b",), 64) == plan_buckets(layout, 64, ["b"])


def test_a_fingerprint_finds_a_live_layout_whichever_of_equal_layouts_dies_first():
    # A compiled step looks its layout up by fingerprint (its graph keeps only the string);
    # equal layouts are separate objects (one per facade or state), and any live one serves.
    from zerofn.layout import layout_by_fingerprint  # internal: the registry the compiled nodes read

    params = {"w": torch.empty(5, 3, device="meta"), "b": torch.empty(3, device="meta")}
    for dies in ("first", "last"):
        first, last = zf.make_layout(params, 2), zf.make_layout(params, 2)
        assert first == last and first is not last
        survivor = last if dies == "first" else first
        if dies == "first":
            del first
        else:
            del last
        assert layout_by_fingerprint(survivor.fingerprint) is survivor, dies
        fingerprint = survivor.fingerprint
        del survivor
        if dies == "last":
            del first
        else:
            del last
        assert layout_by_fingerprint(fingerprint) is None  # nothing alive: nothing found
