"""zerofn.flat: the flat layout, the FlatDict's named views, its pytree and packing (pure, in-process)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.utils._pytree as pytree

import zerofn as zf
from zerofn import flat
from zerofn._tree import FrozenDict
from zerofn.buckets import cut_shard, plan_buckets


def _layout(n=3):
    params = {
        "a": torch.empty(5, 4, device="meta"),
        "b": torch.empty(3, dtype=torch.bfloat16, device="meta"),
        "c": torch.empty(7, device="meta"),
        "w": torch.empty(6, 6, device="meta"),
        "e": torch.empty(0, device="meta"),
    }
    return zf.make_layout(params, n, placement={"w": "whole"})


def test_groups_are_per_dtype_in_layout_order_without_alignment_padding():
    layout = _layout(3)
    owner = layout["w"].owner
    fl = flat.flat_layout(layout, owner)
    assert [g.dtype for g in fl.groups] == [torch.float32, torch.bfloat16]
    f32 = fl.groups[0]
    assert f32.names == ("a", "c", "e")
    assert f32.numels == (7, 3, 0) and f32.offsets == (0, 7, 10) and f32.numel == 10
    assert fl.loose == ("w",) and fl.shapes["w"] == (6, 6)
    assert fl.names == ("a", "b", "c", "w", "e")
    other = flat.flat_layout(layout, (owner + 1) % 3)
    assert other.loose == () and "w" not in other.names
    assert flat.flat_layout(layout, owner) is fl  # cached
    assert hash(fl) == hash(flat.flat_layout(_layout(3), owner)) and fl == flat.flat_layout(_layout(3), owner)


def _shards(layout, rank):
    full = {s.name: torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) + 1 for s in layout.params}
    return {s.name: cut_shard(full[s.name], s, rank, dtype=torch.float32) for s in layout.params if s.holds(rank)}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_names_read_views_of_the_buffers_with_the_values_packed(rank):
    layout = _layout(3)
    fl = flat.flat_layout(layout, rank)
    shards = _shards(layout, rank)
    d = flat.pack(fl, shards)
    assert isinstance(d, FrozenDict) and list(d) == list(shards) and len(d) == len(shards)
    for name, t in shards.items():
        assert torch.equal(d[name], t) and d[name].shape == t.shape
        if name != "w":
            assert d[name]._base is not None  # a view
    assert "nope" not in d
    with pytest.raises(KeyError):
        d["nope"]
    # buffers are the shards side by side: concatenation in group order, bit for bit
    assert torch.equal(d.buffers[0], torch.cat([shards["a"], shards["c"], shards["e"]]))
    # padding zero: the last rank's shard of c (7 over 3 -> 3, 3, 1 + 2 zeros)
    if rank == 2:
        assert d["c"].tolist() == [7.0, 0.0, 0.0]


def test_pytree_leaves_are_the_buffers_and_round_trip():
    layout = _layout(3)
    owner = layout["w"].owner
    d = flat.pack(flat.flat_layout(layout, owner), _shards(layout, owner))
    leaves, spec = pytree.tree_flatten(d)
    assert len(leaves) == 3  # two buffers and the loose whole param
    again = pytree.tree_unflatten(leaves, spec)
    assert isinstance(again, flat.FlatDict) and again.flat_layout is d.flat_layout
    doubled = pytree.tree_map(lambda t: t * 2, d)
    assert all(torch.equal(doubled[n], d[n] * 2) for n in d)
    assert pickle.loads(pickle.dumps(d))["a"].tolist() == d["a"].tolist()


def test_a_subset_of_names_leaves_the_others_zero_and_unheld():
    layout = _layout(2)
    fl = flat.flat_layout(layout, 0)
    shards = _shards(layout, 0)
    d = flat.pack(fl, {"c": shards["c"]})
    assert list(d) == ["c"] and "a" not in d and d.buffers[1] is None
    assert torch.equal(d.buffers[0][: layout["a"].shard_numel], torch.zeros(layout["a"].shard_numel))
    assert [p.numel() for p in d.pieces()] == [layout["c"].shard_numel]
    assert not d.holds_all and flat.pack(fl, shards).holds_all


@pytest.mark.parametrize("held", [None, ("c",)])
def test_group_views_are_the_names_views_cut_by_one_split(held):
    layout = _layout(3)
    fl = flat.flat_layout(layout, 1)
    shards = _shards(layout, 1)
    d = flat.pack(fl, shards if held is None else {n: shards[n] for n in held})
    for g, group in enumerate(fl.groups):
        views = d.group_views(g)
        assert list(views) == [n for n in group.names if n in d]
        for name, view in views.items():
            assert view is d[name]  # one view object per name, whichever asked first
            assert torch.equal(view, shards[name]) and view.untyped_storage().data_ptr() == d.buffers[g].data_ptr()
    fresh = flat.pack(fl, shards)
    first = fresh["a"]
    assert fresh.group_views(0)["a"] is first  # a view made before keeps its identity


def test_mappings_read_their_items_values_and_keys_as_dicts_do():
    frozen = FrozenDict({"x": 1, "y": 2})
    assert dict(frozen.items()) == {"x": 1, "y": 2} and list(frozen.values()) == [1, 2]
    assert list(frozen.keys()) == ["x", "y"] and frozen.get("z", 3) == 3 and "x" in frozen
    layout = _layout(2)
    d = flat.pack(flat.flat_layout(layout, 0), {"c": _shards(layout, 0)["c"]})
    assert list(d.keys()) == ["c"] and d.get("a") is None and [n for n, _ in d.items()] == ["c"]
    assert len(list(d.values())) == 1 and d.get("c") is d["c"]


def test_packable_refuses_what_a_buffer_cannot_hold():
    layout = _layout(2)
    fl = flat.flat_layout(layout, 0)
    shards = _shards(layout, 0)
    assert flat.packable(fl, shards)
    assert not flat.packable(fl, {**shards, "a": None})
    assert not flat.packable(fl, {**shards, "a": torch.zeros(3)})  # wrong shape
    assert not flat.packable(fl, {**shards, "c": shards["c"].double()})  # two dtypes in a group
    assert not flat.packable(fl, {"zz": torch.zeros(1)})
    assert not flat.packable(fl, {})


def test_runs_merge_consecutive_names_of_a_group():
    layout = _layout(1)
    fl = flat.flat_layout(layout, 0)
    assert fl.runs(fl.names) == (
        (0, 0, 20, ("a",)),
        (1, 0, 3, ("b",)),
        (0, 20, 27, ("c",)),
        (-1, 0, 0, ("w",)),
        (0, 27, 27, ("e",)),
    )
    assert fl.runs(("a", "c")) == ((0, 0, 27, ("a", "c")),)


def test_a_flatdict_cannot_be_changed():
    layout = _layout(2)
    d = flat.pack(flat.flat_layout(layout, 0), _shards(layout, 0))
    with pytest.raises(AttributeError):
        d.x = 1
    with pytest.raises(TypeError):
        d["a"] = torch.zeros(1)
    with pytest.raises(TypeError):
        flat.FlatDict({"a": torch.zeros(1)})
    new = d.replace({"a": torch.full_like(d["a"], -9.0)})
    assert isinstance(new, flat.FlatDict) and new["a"].eq(-9).all() and not d["a"].eq(-9).any()
    with pytest.raises(ValueError, match=r"FlatDict.replace: \{'a': \(\(3,\), torch.float32\)\} do not fit"):
        d.replace({"a": torch.zeros(3)})  # not the shard's shape: the form never changes quietly


@pytest.mark.parametrize("opt", [zf.optim.adamw(lr=0.1), zf.optim.sgd(lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_an_update_over_flat_shards_takes_per_name_gradients_as_the_same_flatdict(opt):
    """Per-name gradient shards (``None`` for a param without one) given with flat params are
    packed on the params' layout: the update is bitwise the one of the packed FlatDict."""
    layout = _layout(3)
    rank = layout["w"].owner
    fl = flat.flat_layout(layout, rank)
    gen = torch.Generator().manual_seed(3)
    shards = {n: torch.randn(fl.shapes[n], generator=gen).to(layout[n].dtype) for n in fl.names}
    grads = {n: torch.randn(fl.shapes[n], generator=gen).to(layout[n].dtype) for n in fl.names}
    grads["c"] = None  # a param without a gradient this step
    params = flat.pack(fl, shards)
    state = opt.init(params)
    by_name = opt.update(grads, state, params)
    packed = opt.update(flat.pack(fl, {n: g for n, g in grads.items() if g is not None}), state, params)
    assert pytree.tree_structure(by_name) == pytree.tree_structure(packed)
    for a, b in zip(pytree.tree_leaves(by_name), pytree.tree_leaves(packed), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(by_name[0]["c"], shards["c"])  # no gradient: unchanged
    with pytest.raises(ValueError, match=r"gradients of shapes \{'a': \(2,\)\}"):
        opt.update({"a": torch.zeros(2)}, state, params)


def test_hold_like_returns_values_in_the_templates_form():
    """An optimizer that computes per name hands its results back in its inputs' form:
    the template itself for its own views (donated), a FlatDict on its layout for fresh
    plain tensors, a FrozenDict for a per-name template or a value no buffer can hold."""
    layout = _layout(3)
    fl = flat.flat_layout(layout, 0)
    template = flat.pack(fl, {n: torch.ones(fl.shapes[n], dtype=layout[n].dtype) for n in fl.names})
    assert flat.hold_like(template, {n: template[n] for n in template}) is template
    fresh = {n: torch.full_like(template[n], 2.0) for n in template}
    held = flat.hold_like(template, fresh)
    assert isinstance(held, flat.FlatDict) and held.flat_layout is fl
    assert all(torch.equal(held[n], fresh[n]) for n in fresh)
    assert flat.hold_like(template, held) is held
    wrong = {**fresh, "a": torch.zeros(1)}  # not the shard's shape: no buffer can hold it
    for per_name in (flat.hold_like(template, wrong), flat.hold_like(dict(fresh), fresh)):
        assert type(per_name) is FrozenDict
    assert type(flat.hold_like(template, {})) is FrozenDict


@pytest.mark.parametrize("bucket_numel", [1, 8, 4096])
def test_every_split_bucket_spans_its_row_of_one_buffer(bucket_numel):
    """zerofn._offsets owns the offsets: a split bucket's span is one range of one group's
    buffer, exactly its row's length, its columns are the members' group offsets less the
    span's start, the buckets of a group tile it in order, and a whole param's bucket has
    no range."""
    layout = _layout(3)
    for rank in range(3):
        fl = flat.flat_layout(layout, rank)
        ends: dict[int, int] = {}
        for bucket in plan_buckets(layout, bucket_numel):
            if layout[bucket.names[0]].is_whole:
                assert bucket.span is None
                continue
            g, start, stop = bucket.span
            assert [fl.where[n][1] - start for n in bucket.names] == list(bucket.offsets)
            assert stop - start == bucket.shard_numel and start == ends.get(g, 0), (rank, bucket)
            assert fl.runs(bucket.names) == ((g, start, stop, bucket.names),) or bucket.shard_numel == 0
            ends[g] = stop
        assert ends == {g: group.numel for g, group in enumerate(fl.groups) if group.numel}
