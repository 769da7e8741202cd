"""Hybrid layouts: shard within one group, replicate across another (4 ranks as 2 x 2).

Gradients are averaged over all four ranks (reduce-scatter inside the shard group, then
an all-reduce of the shard across its replicas), shards are exchanged only inside a shard
group, and the global norm is the norm of the mean gradient: every replica holds the same
reduced shards, so the norm over one shard group already is the global one (no adding of
per-group norms). Tolerance: max relative param difference <= 1e-6 against DDP over all
four ranks (fp32; the two-level sum adds in another order than DDP's ring), or, where
this machine's noise floor is above it, ``helpers.FLOOR_FACTOR`` times the floor measured
in the same run (``helpers.ddp_noise_floor``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Net, assert_within_floor, batches, ddp_noise_floor, ddp_reference, max_rel_diff, seeded

import zerofn as zf
from zerofn import checkpoint as ck

PARITY = 1e-6
_GROUPS: dict[str, tuple[Any, Any]] = {}


def _groups(arrangement: str) -> tuple[Any, Any]:
    """(shard group, replicate group) of this rank; built once per arrangement on every rank.

    "contiguous": shard groups {0,1} {2,3}, replicas {0,2} {1,3};
    "strided":    shard groups {0,2} {1,3}, replicas {0,1} {2,3}.
    """
    if arrangement not in _GROUPS:
        shards = [[0, 1], [2, 3]] if arrangement == "contiguous" else [[0, 2], [1, 3]]
        replicas = [list(r) for r in zip(*shards, strict=True)]
        made = {tuple(r): dist.new_group(r) for r in [*shards, *replicas]}  # same order on every rank
        me = dist.get_rank()
        shard = next(made[tuple(r)] for r in shards if me in r)
        replicate = next(made[tuple(r)] for r in replicas if me in r)
        _GROUPS[arrangement] = (shard, replicate)
    return _GROUPS[arrangement]


def _hybrid_vs_ddp(arrangement: str, kind: str, clip: float, stage: int) -> dict[str, Any]:
    shard, replicate = _groups(arrangement)
    torch.manual_seed(seeded(0))
    model = Net()

    def make_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        if kind == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    data = functools.partial(batches, dist.get_rank(), 12)
    ref = ddp_reference(model, make_optimizer, data(), steps=12, use_gate=None, clip=clip or None)
    floor = ddp_noise_floor(model, make_optimizer, data, ref["params"], steps=12, use_gate=None, clip=clip or None)
    fopt = zf.optim.adamw(lr=1e-2, weight_decay=0.1) if kind == "adamw" else zf.optim.sgd(lr=0.05, momentum=0.9)
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = zf.shard_params(params, fopt, shard)
    norms = []
    for x, y in batches(dist.get_rank(), 12):

        def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

        grads = {n: g for n, g in torch.func.grad(loss_fn)(params).items() if not n.startswith("unused.")}
        shards = zf.reduce_grads(grads, state.layout, shard, stage, 100, replicate_group=replicate)
        state, info = zf.step_shards(state, shards, shard, clip or None)
        params = zf.gather_params(state, shard)
        norms.append(info.grad_norm)
    if clip:  # (ours, DDP's) per step
        norms = list(zip(norms, ref["norms"], strict=True))
    return {"ref": ref["params"], "floor": floor, "norms": norms, "params": params}


@pytest.mark.numerics
@pytest.mark.parametrize("arrangement", ["contiguous", "strided"])
@pytest.mark.parametrize(("kind", "clip", "stage"), [("adamw", 0.0, 2), ("adamw", 0.05, 1), ("sgd", 0.05, 2)])
def test_hybrid_2x2_matches_ddp_over_all_four_ranks(worlds, arrangement, kind, clip, stage):
    results = worlds[4].run(_hybrid_vs_ddp, arrangement, kind, clip, stage)
    for res in results:
        what = f"{kind} clip={clip} stage {stage}"
        assert_within_floor(res["params"], res["ref"], res["floor"], rel=PARITY, what=what)
        if clip:  # the global norm is DDP's norm over all ranks, not a sum of group norms
            for ours, theirs in res["norms"]:
                assert abs(ours - theirs) <= 1e-6 * theirs
    for res in results[1:]:  # replicas and shard groups all end with the same params
        assert max_rel_diff(res["params"], results[0]["params"]) == 0.0


def _hybrid_save(path: str) -> dict[str, Any]:
    shard, replicate = _groups("strided")
    torch.manual_seed(seeded(0))
    model = Net()
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), shard)
    for x, y in batches(dist.get_rank(), 3):
        grads = torch.func.grad(lambda p, x=x, y=y: ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean())(
            params
        )
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout, shard, replicate_group=replicate), shard)
        params = zf.gather_params(state, shard)
    written = ck.save(path, state, shard, params=params, replicate_group=replicate)
    return {"full": ck.full_state_dict(state, shard), "written": written}


def _plain_load(path: str) -> dict[str, Any]:
    torch.manual_seed(seeded(1))
    params = {n: p.detach().clone() for n, p in Net().named_parameters()}
    return ck.full_state_dict(ck.load(path, params, params_out=params))


def test_a_hybrid_checkpoint_loads_at_other_layouts(worlds, tmp_path):
    path = str(tmp_path / "hybrid")
    saved = worlds[4].run(_hybrid_save, path)
    # Shard group {0, 2} wrote; every rank, replicas included, gets the committed directory.
    assert [s["written"] for s in saved] == [os.path.realpath(path)] * 4
    for m in (1, 3, 4):
        for loaded in worlds[m].run(_plain_load, path):
            for key in ("state", "param_groups"):
                assert repr(loaded[key]) == repr(saved[0]["full"][key])
            for name, t in loaded["zerofn"]["master"].items():
                assert torch.equal(t, saved[0]["full"]["zerofn"]["master"][name])


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _facade_hybrid_vs_ddp(how: str, overlap: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    torch.manual_seed(seeded(0))
    model = Net()
    options: dict[str, Any] = dict(steps=10, use_gate=None, clip=0.05)
    data = functools.partial(batches, dist.get_rank(), 10)
    ref = ddp_reference(model, _adamw, data(), **options)
    floor = ddp_noise_floor(model, _adamw, data, ref["params"], **options)
    if how == "sub_dp_size":  # the seed's option: ranks {0,1} and {2,3} shard, {0,2} and {1,3} replicate
        groups: dict[str, Any] = {"sub_dp_size": 2}
    else:
        shard, replicate = _groups("strided")
        groups = {"dp_process_group": shard, "replicate_group": replicate}
    zopt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        partition_grad=True,
        overlap_communication=overlap,
        clip_grad_norm=0.05,
        reduce_bucket_size=100,
        module=model,
        **groups,
    )
    assert zopt.state.layout.world_size == 2
    for x, y in batches(dist.get_rank(), 10):
        zopt.backward(((model(x) - y) ** 2).mean())
        zopt.step()
        zopt.zero_grad()
    mine = {n: p.detach() for n, p in model.named_parameters()}
    return mine, ref["params"], floor


@pytest.mark.numerics
@pytest.mark.parametrize("how", ["sub_dp_size", "replicate_group"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_facade_in_a_hybrid_layout_matches_ddp(worlds, how, overlap):
    for mine, ref, floor in worlds[4].run(_facade_hybrid_vs_ddp, how, overlap):
        assert_within_floor(mine, ref, floor, rel=PARITY, what=f"{how} overlap={overlap}")
