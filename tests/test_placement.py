"""Placement: split and whole params in one layout, the owner plan, and whole params
moving through the bucket engine (shard -> reduce -> gather) on real gloo ranks.

Hypothesis draws param dicts, placements and world sizes; the owner plan is checked to
cover every whole param exactly once, to be identical on every rank (fingerprints compared
across real ranks) and to respect Graham's bound; shard -> gather is bitwise for any mix.
The padding a whole bucket costs on the wire is measured on the benchmark transformer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import get_world
from helpers import assert_bitwise_equal, seeded
from hypothesis import given
from hypothesis import strategies as st

import zerofn as zf
from zerofn.buckets import bucket_plan, pack_grads, pack_shards, plan_buckets, split_row, unpack_rows
from zerofn.layout import make_layout, plan_owners
from zerofn.testing import strategies as zst

BUCKETS = [1, 5, 16, 64, 2**20]


@st.composite
def placed_params(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A param dict and a placement per param (any mix of split and whole)."""
    params = draw(zst.param_dicts())
    placement = {n: draw(st.sampled_from(["split", "whole"])) for n in params}
    return params, placement


def _loads(layout: zf.ShardLayout) -> list[int]:
    return [layout.stored_numel(r) for r in range(layout.world_size)]


# --------------------------------------------------------------------------- pure layout


@given(pp=placed_params(), n=zst.world_sizes())
def test_owner_plan_covers_every_whole_param_once_and_respects_grahams_bound(pp, n):
    params, placement = pp
    layout = make_layout(params, n, placement=placement)
    whole = [s for s in layout.params if s.is_whole]
    assert [s.name for s in whole] == [k for k, v in placement.items() if v == "whole"]
    for s in layout.params:
        held = [r for r in range(n) if s.holds(r)]
        assert held == ([s.owner] if s.is_whole else list(range(n))), s.name
    # Every element stored once (whole) or once per padded chunk (split).
    padded_psi = sum(s.numel + s.padding for s in layout.params)
    assert sum(_loads(layout)) == padded_psi
    largest = max((s.numel for s in whole), default=0)
    assert max(_loads(layout)) <= padded_psi / n + largest


@given(pp=placed_params(), n=zst.world_sizes(), bucket_numel=st.sampled_from(BUCKETS))
def test_buckets_carry_every_nonempty_param_once_and_their_plans_fit(pp, n, bucket_numel):
    params, placement = pp
    layout = make_layout(params, n, placement=placement)
    buckets = plan_buckets(layout, bucket_numel)
    names = [m for b in buckets for m in b.names]
    assert sorted(names) == sorted(s.name for s in layout.params if s.numel)
    for b in buckets:
        plan = bucket_plan(layout, b)  # asserts: no overlap, rows filled exactly
        assert len({layout[m].dtype for m in b.names}) == 1
        assert all(m.owner < 0 for m in plan.members) or all(m.owner >= 0 for m in plan.members)


def test_all_split_placement_keeps_the_fingerprint_and_buckets_of_the_seed_layout():
    params = {"a": torch.zeros(7, 3), "b": torch.zeros(5)}
    plain = make_layout(params, 3)
    explicit = make_layout(params, 3, placement={"a": "split", "b": "split"})
    assert plain.fingerprint == explicit.fingerprint
    assert plan_buckets(plain, 16) == plan_buckets(explicit, 16)
    assert make_layout(params, 3, placement={"a": "whole"}).fingerprint != plain.fingerprint


def test_owner_plan_is_largest_first_to_the_least_loaded_rank():
    assert plan_owners({"a": 6, "b": 4, "c": 3, "d": 3}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    # Ties keep layout order; ties between ranks go to the lowest.
    assert plan_owners({"x": 2, "y": 2, "z": 2}, 3) == {"x": 0, "y": 1, "z": 2}


def test_bad_placements_are_refused_with_the_names():
    params = {"a": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"'split', 'whole' or 'blocked\(B\)'.*'a'"):
        make_layout(params, 2, placement={"a": "rows"})
    with pytest.raises(KeyError, match="nope"):
        make_layout(params, 2, placement={"nope": "whole"})


@given(pp=placed_params(), n=zst.world_sizes(), bucket_numel=st.sampled_from(BUCKETS))
def test_pure_pack_and_unpack_of_mixed_buckets_give_back_the_tensors(pp, n, bucket_numel):
    # The pure pieces alone, every rank simulated: pack each rank's row, stack the rows as
    # an all-gather would, unpack; and grads packed into rows come back as rank r's shards.
    params, placement = pp
    layout = make_layout(params, n, placement=placement)
    masters = [
        {s.name: zf.buckets.cut_shard(params[s.name], s, r) for s in layout.params if s.holds(r)} for r in range(n)
    ]
    for b in plan_buckets(layout, bucket_numel):
        rows = torch.stack([pack_shards(masters[r], layout, b, rank=r) for r in range(n)])
        full = unpack_rows(rows, layout, b)
        for name in b.names:
            assert_bitwise_equal(full[name], params[name].to(full[name].dtype), name)
        packed = pack_grads(params, layout, b)  # 1/N scaling: compare with the scaled tensors
        for r in range(n):
            got = split_row(packed[r], layout, b, set(b.names), dtype=packed.dtype, rank=r)
            for name in b.names:
                spec = layout[name]
                if spec.holds(r):
                    want = zf.buckets.cut_shard(params[name].to(packed.dtype) * (1.0 / n), spec, r)
                    assert_bitwise_equal(got[name], want.to(got[name].dtype), f"rank {r} {name}")
                else:
                    assert name not in got


def test_split_row_and_pack_shards_need_the_rank_for_whole_buckets():
    layout = make_layout({"w": torch.zeros(2, 3)}, 2, placement={"w": "whole"})
    (b,) = plan_buckets(layout, 2**20)
    with pytest.raises(ValueError, match="pass rank="):
        split_row(torch.zeros(b.shard_numel), layout, b, {"w"})
    with pytest.raises(ValueError, match="pass rank="):
        pack_shards({"w": torch.zeros(2, 3)}, layout, b)


# --------------------------------------------------------------------------- real ranks


def _roundtrip(params, placement, bucket_numel):
    """On each rank: shard with the placement, then gather; also the layout's fingerprint."""
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), placement=placement)
    gathered = zf.gather_params(state, bucket_numel=bucket_numel)
    held = {n: tuple(t.shape) for n, t in state.master.items()}
    return gathered, held, state.layout.fingerprint


@given(pp=placed_params(), n=zst.world_sizes(), bucket_numel=st.sampled_from(BUCKETS))
def test_shard_then_gather_is_bitwise_for_any_mix_of_placements(worlds, pp, n, bucket_numel):
    params, placement = pp
    results = worlds[n].run(_roundtrip, params, placement, bucket_numel)
    layout = make_layout(params, n, placement=placement)
    assert len({fp for _, _, fp in results}) == 1  # every rank computed the same plan
    assert results[0][2] == layout.fingerprint
    for rank, (gathered, held, _) in enumerate(results):
        assert list(gathered) == list(params)
        for name, p in params.items():
            assert_bitwise_equal(gathered[name], p, f"rank {rank} {name!r}")
            spec = layout[name]
            assert held.get(name) == spec.local_shape(rank), f"rank {rank} {name!r}"


def _reduce(grads_per_rank, placement, stage):
    import torch.distributed as dist

    rank = dist.get_rank()
    params = {n: torch.zeros_like(g) for n, g in grads_per_rank[0].items()}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), placement=placement)
    return dict(zf.reduce_grads(grads_per_rank[rank], state.layout, stage=stage, bucket_numel=32))


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_leaves_whole_mean_grads_on_their_owner_only(world, stage):
    n = world.world_size
    gen = torch.Generator().manual_seed(seeded(3))
    shapes = {"w": (5, 4), "v": (3, 3), "b": (7,), "e": (0, 2)}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(n)]
    placement = {"w": "whole", "v": "whole", "e": "whole"}
    results = world.run(_reduce, grads, placement, stage)
    layout = make_layout(grads[0], n, placement=placement)
    mean = {k: sum(g[k] * (1.0 / n) for g in grads) for k in shapes}
    for rank, got in enumerate(results):
        for name, spec in ((s.name, s) for s in layout.params):
            if not spec.holds(rank):
                assert name not in got, f"rank {rank} got {name}"
                continue
            want = zf.buckets.cut_shard(mean[name], spec, rank)
            torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ranks_that_disagree_on_placement_get_rank_mismatch_error(n):
    get_world(n).run(_disagree)


def _disagree():
    import torch.distributed as dist

    params = {"w": torch.zeros(4, 4), "b": torch.zeros(3)}
    placement = {"w": "whole"} if dist.get_rank() == 0 else {}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), placement=placement)
    with pytest.raises(zf.RankMismatchError):
        zf.gather_params(state)


# --------------------------------------------------------------------------- benchmark transformer


def _benchmark_transformer() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from models import build_model, model_config
    finally:
        sys.path.pop(0)
    return dict(build_model(model_config("transformer"), 0, torch.device("meta")).named_parameters())


# Wire padding measured with the default bucket size (2**22 elements) and 2**20; see
# docs/whole-tensor-optimizers.md.
# Recipes: Adafactor (every param whole), Muon for the blocks' weight matrices + AdamW.
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("recipe", ["adafactor", "muon_adamw"])
def test_whole_buckets_of_the_benchmark_transformer_pad_under_ten_percent_of_psi(n, recipe):
    params = _benchmark_transformer()
    if recipe == "adafactor":
        placement = dict.fromkeys(params, "whole")
    else:
        placement = {k: "whole" for k, p in params.items() if p.ndim == 2 and k.startswith("blocks.")}
    layout = make_layout(params, n, placement=placement)
    psi = layout.numel
    for bucket_numel in (2**20, 2**22):
        wire = sum(n * b.shard_numel for b in plan_buckets(layout, bucket_numel))
        assert (wire - psi) / psi < 0.10, (bucket_numel, wire - psi)
    # At most 0.005 % padding (Adafactor at N=4, 512 elements, both sizes);
    # the state per rank is within one largest whole param of the balanced share Ψ/N.
    for bucket_numel in (2**20, zf.stages.DEFAULT_BUCKET_NUMEL):
        assert (sum(n * b.shard_numel for b in plan_buckets(layout, bucket_numel)) - psi) / psi < 5e-5
    largest = max(s.numel for s in layout.params if s.is_whole)
    assert max(_loads(layout)) <= psi / n + largest


# --------------------------------------------------------------------------- placement from the optimizer


class _Unknown(torch.optim.SGD):
    """A torch optimizer zerofn has never heard of (a subclass is not SGD)."""


def test_optimizers_say_where_their_params_live():
    muon = zf.torch_optim.from_torch(torch.optim.Muon, lr=0.02)
    adafactor = zf.torch_optim.from_torch(torch.optim.Adafactor)
    assert muon.placement("w", (3, 4)) == "whole"
    # Adafactor's step reads the RMS of the whole param and update, 1-D params included.
    assert adafactor.placement("b", (4,)) == "whole"
    assert adafactor.placement("w", (3, 4)) == "whole"
    assert zf.optim.adamw().placement("w", (3, 4)) == "split"
    assert zf.torch_optim.from_torch(torch.optim.Adagrad).placement("w", (3, 4)) == "split"
    both = zf.optim.partition([(["w"], muon), (lambda n: True, zf.optim.adamw())])
    assert both.placement("w", (3, 4)) == "whole" and both.placement("b", (4,)) == "split"


def test_an_unclassifiable_optimizer_is_refused_with_how_to_declare_it():
    with pytest.raises(TypeError, match=r"cannot tell whether _Unknown.*placement='split'.*placement='whole'"):
        zf.torch_optim.from_torch(_Unknown, lr=0.1)
    declared = zf.torch_optim.from_torch(_Unknown, placement="whole", lr=0.1)
    assert declared.placement("w", (2, 2)) == "whole"
    assert zf.torch_optim.from_torch(_Unknown, placement="split", lr=0.1).placement("w", (2, 2)) == "split"
    with pytest.raises(TypeError, match="cannot shard LBFGS"):
        zf.torch_optim.from_torch(torch.optim.LBFGS)


def test_a_whole_tensor_optimizer_is_never_run_on_shards():
    with pytest.raises(ValueError, match="Muon reads whole tensors and cannot run on shards"):
        zf.torch_optim.from_torch(torch.optim.Muon, placement="split")
    params = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    muon = zf.torch_optim.from_torch(torch.optim.Muon)
    with pytest.raises(ValueError, match=r"Muon updates 2-D weight matrices only; param 'b' has shape \(4,\)"):
        zf.stages.resolve_placement(params, muon)
    both = zf.optim.partition([(["w"], muon), (["b"], zf.optim.sgd(lr=0.1))])
    with pytest.raises(ValueError, match=r"param 'w' \(shape \(3, 4\)\) cannot be split"):
        zf.stages.resolve_placement(params, both, {"w": "split"})
    with pytest.raises(KeyError, match="no part selects param 'b'"):
        zf.stages.resolve_placement(params, zf.optim.partition([(["w"], muon)]))


def test_the_override_may_place_whole_what_the_optimizer_would_split():
    params = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    sgd = zf.optim.sgd(lr=0.1)
    assert zf.stages.resolve_placement(params, sgd) == {"w": "split", "b": "split"}
    assert zf.stages.resolve_placement(params, sgd, {"w": "whole"}) == {"w": "whole", "b": "split"}
    by_rule = zf.stages.resolve_placement(params, sgd, lambda name, p: "whole" if p.ndim == 2 else "split")
    assert by_rule == {"w": "whole", "b": "split"}
    with pytest.raises(ValueError, match="not there"):
        zf.stages.resolve_placement(params, sgd, {"x": "whole"})


def test_a_missing_torch_class_names_the_version_that_brings_it(monkeypatch):
    assert zf.torch_optim.torch_class("Muon") is torch.optim.Muon
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(AttributeError, match=r"no torch\.optim\.Muon; it comes with torch 2\.9"):
        zf.torch_optim.torch_class("Muon")
