"""Hybrid layouts: shard within one group, replicate across another (4 ranks as 2 x 2).

Gradients are averaged over all four ranks (reduce-scatter inside the shard group, then
an all-reduce of the shard across its replicas), shards are exchanged only inside a shard
group, and the global norm is the norm of the mean gradient: every replica holds the same
reduced shards, so the norm over one shard group already is the global one (no adding of
per-group norms).

Bitwise against DDP over all four ranks. zerofn's arithmetic for the mean (``pack_grads``,
then ``sum_over_replicas`` in ``reduce_grads`` and in the facade's reducer): each rank
scales its fp32 gradient once by ``1 / (N * R) = 1/4`` (exact: a power of two), the shard
group sums on the wire, the replicas add their rows *on the wire too* (the row is cast
back to fp32 only after the second sum), then one rounding. So:

* on a float64 wire (``comm_dtype=torch.float64``), four fp32 addends scaled by 1/4 sum
  exactly in float64 however they are grouped (two partial sums, then their sum: each
  exact, see "the exact wire" in ``tests/helpers.py``), and the single rounding to fp32 is
  that of DDP's mean on a float64 wire over all four ranks (``ddp_reference(...,
  wire=torch.float64)``, which scales by the same 1/4): bitwise;
* on the default fp32 wire, zerofn computes ``fl(fl(a + b) + fl(c + d))`` with ``{a, b}``
  the shard group's addends: each sum has two addends, so its order cannot matter, and a
  DDP communication hook that sums over the shard group and then over the replicate group
  (``_two_level_hook``, zerofn's grouping) gives the same bits.

Clipping: the reference clips with zerofn's arithmetic (``clip_dtype=torch.float64``); the
float64 norms may differ in their last bits (other summation order: at most the bound in
``_NORM_REL``), which changes the fp32 clip coefficient with a chance of about 2**-29 per
clipped step.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Net, assert_trees_equal, batches, clip_in_float64, ddp_reference, max_rel_diff, mse, seeded

import zerofn as zf
from zerofn import checkpoint as ck

_GROUPS: dict[str, tuple[Any, Any]] = {}

#: Net's element count: the float64 norms sum this many squares.
_NET_NUMEL = 7 * 13 + 13 + 13 * 13 + 13 + 13 * 5 + 5 + 5 * 3 + 3
#: Two float64 norms of the same fp32 gradients summed in different orders: each sum of n
#: squares is within (n + 1) float64 ulps (2**-53 relative each) of the exact one, the square
#: root halves that and rounds once more: relative difference <= (n + 3) * 2**-53.
_NORM_REL = (_NET_NUMEL + 3) * 2.0**-53


def _groups(arrangement: str) -> tuple[Any, Any]:
    """(shard group, replicate group) of this rank; built once per arrangement on every rank.

    "contiguous": shard groups {0,1} {2,3}, replicas {0,2} {1,3} (what ``sub_dp_size=2`` builds);
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


def _two_level_hook(groups, bucket):  # unannotated: DDP compares annotations with objects
    """A DDP communication hook with zerofn's hybrid grouping on the fp32 wire: the bucket
    divided by the world size, summed over the shard group, then over the replicate group.

    ``groups``: (shard group, replicate group). Collectives: two ``all_reduce`` of the
    bucket, the first blocking (DDP launches buckets in the same order on every rank).
    """
    shard, replicate = groups
    buffer = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buffer, group=shard)
    return dist.all_reduce(buffer, group=replicate, async_op=True).get_future().then(lambda f: f.value()[0])


def _hybrid_vs_ddp(arrangement: str, kind: str, clip: float, stage: int) -> dict[str, Any]:
    """zerofn's functional loop on the hybrid layout and DDP over all four ranks, both on a
    float64 wire (module docstring: exact)."""
    shard, replicate = _groups(arrangement)
    torch.manual_seed(seeded(0))
    model = Net()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    def make_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        if kind == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    ref = ddp_reference(
        model,
        make_optimizer,
        batches(dist.get_rank(), 12),
        steps=12,
        use_gate=None,
        clip=clip or None,
        clip_dtype=torch.float64,
        wire=torch.float64,
    )
    fopt = zf.optim.adamw(lr=1e-2, weight_decay=0.1) if kind == "adamw" else zf.optim.sgd(lr=0.05, momentum=0.9)
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = zf.shard_params(params, fopt, shard)
    norms = []
    for x, y in batches(dist.get_rank(), 12):

        def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

        grads = {n: g for n, g in torch.func.grad(loss_fn)(params).items() if not n.startswith("unused.")}
        shards = zf.reduce_grads(
            grads, state.layout, shard, stage, 100, replicate_group=replicate, comm_dtype=torch.float64
        )
        state, info = zf.step_shards(state, shards, shard, clip or None)
        params = zf.gather_params(state, shard)
        norms.append(info.grad_norm)
    if clip:  # (ours, DDP's) per step
        norms = list(zip(norms, ref["norms"], strict=True))
    return {"ref": ref["params"], "initial": initial, "norms": norms, "params": dict(params)}


@pytest.mark.numerics
@pytest.mark.parametrize("arrangement", ["contiguous", "strided"])
@pytest.mark.parametrize(("kind", "clip", "stage"), [("adamw", 0.0, 2), ("adamw", 0.05, 1), ("sgd", 0.05, 2)])
def test_hybrid_2x2_matches_ddp_over_all_four_ranks(worlds, arrangement, kind, clip, stage):
    """Bitwise: a float64 wire on both sides (module docstring)."""
    results = worlds[4].run(_hybrid_vs_ddp, arrangement, kind, clip, stage)
    for res in results:
        assert max_rel_diff(res["ref"], res["initial"]) > 1e-3  # training moved the params
        assert_trees_equal(res["params"], res["ref"])
        if clip:  # the global norm is DDP's norm over all ranks, not a sum of group norms
            for ours, theirs in res["norms"]:
                assert abs(ours - theirs) <= _NORM_REL * theirs, (ours, theirs)
    for res in results[1:]:  # replicas and shard groups all end with the same params
        assert_trees_equal(res["params"], results[0]["params"])


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


FACADE_STEPS, FACADE_CLIP = 10, 0.05


def _ddp_two_level(model: torch.nn.Module, groups: tuple[Any, Any]) -> dict[str, torch.Tensor]:
    """DDP + AdamW over all four ranks on the fp32 wire, the mean summed in zerofn's hybrid
    grouping (``_two_level_hook`` over ``groups``), clipped with zerofn's arithmetic:
    ``ddp_reference``'s loop (no layer drop), its params after ``FACADE_STEPS`` steps."""
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ddp.register_comm_hook(groups, _two_level_hook)
    opt = _adamw(ddp.module)
    for x, y in batches(dist.get_rank(), FACADE_STEPS):
        opt.zero_grad(set_to_none=True)
        mse(ddp(x), y).backward()
        clip_in_float64(ddp.module.parameters(), FACADE_CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _facade_hybrid_vs_ddp(how: str, overlap: bool) -> dict[str, Any]:
    """The facade in a hybrid layout and DDP over all four ranks (AdamW, clipping), on
    both wires: float64 (against ``ddp_reference(..., wire=torch.float64)``) and the
    default fp32 (against ``_ddp_two_level``, zerofn's grouping of the sum)."""
    if how == "sub_dp_size":  # ZeroOptimizer's hybrid keyword: ranks {0,1} and {2,3} shard, {0,2} and {1,3} replicate
        groups: dict[str, Any] = {"sub_dp_size": 2}
        arrangement = "contiguous"
    else:
        shard, replicate = _groups("strided")
        groups = {"dp_process_group": shard, "replicate_group": replicate}
        arrangement = "strided"
    out: dict[str, Any] = {}
    for wire in (torch.float64, None):
        torch.manual_seed(seeded(0))
        model = Net()
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        if wire is not None:
            ref = ddp_reference(
                model,
                _adamw,
                batches(dist.get_rank(), FACADE_STEPS),
                steps=FACADE_STEPS,
                use_gate=None,
                clip=FACADE_CLIP,
                clip_dtype=torch.float64,
                wire=wire,
            )["params"]
        else:
            ref = _ddp_two_level(model, _groups(arrangement))
        zopt = zf.ZeroOptimizer(
            _adamw(model),
            partition_grad=True,
            overlap_communication=overlap,
            clip_grad_norm=FACADE_CLIP,
            reduce_bucket_size=100,
            communication_dtype=wire,
            module=model,
            **groups,
        )
        assert zopt.state.layout.world_size == 2
        for x, y in batches(dist.get_rank(), FACADE_STEPS):
            zopt.backward(mse(model(x), y))
            zopt.step()
            zopt.zero_grad()
        zopt.close()
        mine = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["fp32" if wire is None else "float64"] = mine, ref, initial
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("how", ["sub_dp_size", "replicate_group"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_facade_in_a_hybrid_layout_matches_ddp(worlds, how, overlap):
    """Bitwise on both wires: float64 against DDP's float64 mean over all four ranks, fp32
    against DDP summing in zerofn's grouping (module docstring)."""
    for res in worlds[4].run(_facade_hybrid_vs_ddp, how, overlap):
        for wire, (mine, ref, initial) in res.items():
            assert max_rel_diff(ref, initial) > 1e-3, wire  # training moved the params
            try:
                assert_trees_equal(mine, ref)
            except AssertionError as e:
                raise AssertionError(f"{how} overlap={overlap}, {wire} wire: {e}") from None
