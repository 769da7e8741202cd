"""``ZeroOptimizer`` over torch.optim.Muon, Adafactor and ``[Muon, AdamW]`` (whole params)
through the facade's other features, on real gloo ranks:

* **fp16 with dynamic loss scaling** (fp32 masters) and **bf16**, stage 1 and 2, with and
  without **CPU offload**: bitwise equal, at 1 and 2 ranks, to a reference built from
  independent parts, as in ``tests/test_precision_parity.py``: a DDP model in the working
  dtype whose communication hook reduces as zerofn does (scale by 1/N in the gradient
  dtype, sum, cast back), the same torch optimizers over fp32 copies of the params
  (masters), a step skipped when the averaged gradient is not finite, ColossalAI's scaler
  rules (``ReferenceScaler``), and the working params set to the rounded masters after
  each step. Bitwise is what the arithmetic allows there: a sum of two addends does not
  depend on the order, 1/N and 1/S are powers of two, and Muon / Adafactor run their
  own torch code on the whole fp32 master on its owner rank. The fp16 runs overflow and
  skip steps (the scaler grows every 3 good steps from 2^15), so skipping is exercised.
* **hybrid groups** (4 ranks as 2 shard groups x 2 replicas; ``sub_dp_size=2`` and an
  explicit ``replicate_group``): bitwise equal to DDP over all four ranks when both sides
  sum in float64 on the wire (``communication_dtype=torch.float64``, and a DDP hook that
  does the same): four float32 addends then sum exactly, so the order (DDP's ring, or
  zerofn's shard group then replicas) cannot show; each whole param is held by exactly
  one rank of each shard group.
* **sharded DCP checkpoints** (``save_checkpoint`` / ``load_checkpoint``) of a facade over
  Muon, Adafactor and ``[Muon, AdamW]``: the loaded state dict equals the saved one
  bitwise (torch format, masters, step, every wrapped optimizer's hyperparameters), at the
  same and at another world size (owners move), and the steps after the load are bitwise
  those of an uninterrupted run; the loss scale of fp16 training comes back too.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import get_world
from helpers import (
    WHOLE_ADAFACTOR,
    WHOLE_MUON,
    WHOLE_RECIPES,
    assert_trees_equal,
    batches,
    ddp_reference,
    gate_used,
    seeded,
    whole_model,
    whole_torch_optimizers,
)
from test_precision import ReferenceScaler

import zerofn as zf

STEPS = 9
BUCKET = 64  # several buckets, split and whole
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)  # eps: see tests/test_precision_parity.py
# Grows every 3 good steps from 2^15 to 2^16, where fp16 losses of about 1 overflow: skipped steps.
SCALER = dict(
    initial_scale=2.0**15,
    min_scale=1.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=3,
    hysteresis=2,
    max_scale=2.0**24,
)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _torch_optimizers(recipe: str, named: list[tuple[str, torch.Tensor]]) -> list[torch.optim.Optimizer]:
    return whole_torch_optimizers(recipe, named, adamw=ADAMW)  # this file's AdamW (eps 1e-3)


def _wrap(opts: list[torch.optim.Optimizer]) -> Any:
    return opts if len(opts) > 1 else opts[0]


def _masters(state_dict: Any, order: list[str]) -> dict[str, torch.Tensor]:
    """name -> full fp32 master (in ``order``), from the facade's (list of) torch-format state dicts."""
    out: dict[str, torch.Tensor] = {}
    for part in state_dict if isinstance(state_dict, list) else [state_dict]:
        out.update(part["zerofn"]["master"])
    assert sorted(out) == sorted(order)
    return {n: out[n] for n in order}


# --------------------------------------------------------------------------- the reference


def cast_hook(comm_dtype, bucket):  # unannotated on purpose: DDP checks the annotations' objects
    """DDP communication hook: scale by 1/N in the gradient dtype, cast to ``comm_dtype``, sum, cast back."""
    buf = bucket.buffer()
    wire = buf.mul(1.0 / dist.get_world_size())
    if comm_dtype is not None:
        wire = wire.to(comm_dtype)
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def back(f):
        return f.value()[0].to(buf.dtype)

    return fut.then(back)


def _reference(recipe: str, dtype: torch.dtype, comm: torch.dtype | None = None, steps: int = STEPS) -> dict:
    """DDP in the working dtype + the torch optimizers over fp32 masters, skipping non-finite steps."""
    model = copy.deepcopy(whole_model(recipe)).to(dtype)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    ddp.register_comm_hook(comm, cast_hook)
    master = {n: p.detach().float().clone().requires_grad_(True) for n, p in model.named_parameters()}
    opts = _torch_optimizers(recipe, list(master.items()))
    scaler = ReferenceScaler(**SCALER) if dtype == torch.float16 else None
    trace = []
    for step, (x, y) in enumerate(batches(dist.get_rank(), steps)):
        s = scaler.scale if scaler else 1.0
        loss = _loss(ddp(x.to(dtype), gate_used(step)), y.to(dtype))
        (loss * s if s != 1.0 else loss).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        found = any(not bool(torch.isfinite(g).all()) for g in grads.values())
        if scaler:
            scaler.update(found)
        trace.append((s, found))
        if not found:
            for n, g in grads.items():
                master[n].grad = g.float() / s if s != 1.0 else g.float()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(master[n])
        model.zero_grad(set_to_none=True)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "master": {n: m.detach().clone() for n, m in master.items()},
        "trace": trace,
        "scale": scaler.scale if scaler else 1.0,
    }


# --------------------------------------------------------------------------- mixed precision and offload


def _facade_mixed(recipe: str, dtype: torch.dtype, stage: int, offload: bool) -> dict:
    model = whole_model(recipe)  # fp32: forced_dtype casts it
    opts = _torch_optimizers(recipe, list(model.named_parameters()))
    zo = zf.ZeroOptimizer(
        _wrap(opts),
        forced_dtype=dtype,
        cpu_offload=offload,
        partition_grad=stage == 2,
        overlap_communication=stage == 2,
        reduce_bucket_size=BUCKET,
        module=model,
        **SCALER,
    )
    trace, devices = [], set()
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        scale = zo.loss_scale
        zo.backward(_loss(model(x.to(dtype), gate_used(step)), y.to(dtype)))
        zo.step()
        zo.zero_grad()
        trace.append((scale, bool(zo.last_step_info.skipped)))
        held = [*zo.state.master.values(), *(t for t in _tensors(zo.state.opt_state))]
        devices |= {str(t.device) for t in held}
    whole_held = {n: tuple(t.shape) for n, t in zo.state.master.items() if zo.state.layout[n].placement == "whole"}
    full = zo.state_dict()
    zo.close()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "master": _masters(full, [n for n, _ in model.named_parameters()]),
        "trace": trace,
        "scale": zo.loss_scale,
        "devices": devices,
        "offload": zo.precision.cpu_offload,
        "whole_held": whole_held,
    }


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


MIXED = [
    (dtype, stage, offload)
    for dtype in (torch.float16, torch.bfloat16)
    for stage, offload in ((1, False), (2, False), (1, True), (2, True))
]


def _mixed_all(recipe: str) -> list[tuple[dict, dict]]:
    refs = {dtype: _reference(recipe, dtype, comm=dtype) for dtype in (torch.float16, torch.bfloat16)}
    return [(_facade_mixed(recipe, dtype, stage, offload), refs[dtype]) for dtype, stage, offload in MIXED]


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
@pytest.mark.parametrize("n", [1, 2], ids=["N1", "N2"])
def test_fp16_loss_scaling_bf16_and_cpu_offload_bitwise_equal_to_the_ddp_fp32_master_reference(n, recipe):
    results = get_world(n).run(_mixed_all, recipe)
    for rank_results in results:
        for (dtype, stage, offload), (ours, ref) in zip(MIXED, rank_results, strict=True):
            label = f"N={n} {recipe} {dtype} stage{stage} offload={offload}"
            assert all(p.dtype == dtype for p in ours["params"].values()), label
            assert_trees_equal(ours["params"], ref["params"])
            assert_trees_equal(ours["master"], ref["master"])  # fp32, torch's updates on the whole masters
            assert all(t.dtype == torch.float32 for t in ours["master"].values()), label
            assert ours["trace"] == ref["trace"], label  # same scales, same skipped steps
            assert ours["scale"] == ref["scale"], label
            skipped = sum(s for _, s in ours["trace"])
            if dtype == torch.float16:
                assert skipped >= 1 and ours["scale"] < SCALER["max_scale"], label  # the scaler did overflow
            else:
                assert skipped == 0 and ours["scale"] == 1.0, label
            assert ours["offload"] == offload, label
            assert ours["devices"] == {"cpu"}, label
            # Whole masters are full-shaped on their owner.
            for name, shape in ours["whole_held"].items():
                assert shape == tuple(ref["master"][name].shape), (label, name)
    # Each whole param is held by exactly one rank.
    for i in range(len(MIXED)):
        held = [name for r in results for name in r[i][0]["whole_held"]]
        assert len(held) == len(set(held)) > 0


# --------------------------------------------------------------------------- hybrid groups

_GROUPS: dict[str, tuple[Any, Any]] = {}


def _strided_groups() -> tuple[Any, Any]:
    """Shard groups {0,2} {1,3}, replicas {0,1} {2,3} (as tests/test_hybrid.py), built once."""
    if "strided" not in _GROUPS:
        shards = [[0, 2], [1, 3]]
        replicas = [list(r) for r in zip(*shards, strict=True)]
        made = {tuple(r): dist.new_group(r) for r in [*shards, *replicas]}  # same order on every rank
        me = dist.get_rank()
        shard = next(made[tuple(r)] for r in shards if me in r)
        replicate = next(made[tuple(r)] for r in replicas if me in r)
        _GROUPS["strided"] = (shard, replicate)
    return _GROUPS["strided"]


def _facade_hybrid(recipe: str, how: str, stage: int) -> dict:
    model = whole_model(recipe)
    opts = _torch_optimizers(recipe, list(model.named_parameters()))
    if how == "sub_dp_size":  # shard groups {0,1} {2,3}, replicas {0,2} {1,3}
        groups: dict[str, Any] = {"sub_dp_size": 2}
    else:
        shard, replicate = _strided_groups()
        groups = {"dp_process_group": shard, "replicate_group": replicate}
    zo = zf.ZeroOptimizer(
        _wrap(opts),
        partition_grad=stage == 2,
        overlap_communication=stage == 2,
        communication_dtype=torch.float64,
        reduce_bucket_size=BUCKET,
        module=model,
        **groups,
    )
    assert zo.state.layout.world_size == 2
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        zo.backward(_loss(model(x, gate_used(step)), y))
        zo.step()
        zo.zero_grad()
    whole = sorted(n for n in zo.state.master if zo.state.layout[n].placement == "whole")
    zo.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "whole": whole}


def _hybrid_all(recipe: str) -> tuple[list[tuple[str, int, dict]], dict]:
    ref = _reference(recipe, torch.float32, comm=torch.float64)
    ours = [(how, stage, _facade_hybrid(recipe, how, stage)) for how, stage in (("sub_dp_size", 2), ("groups", 1))]
    return ours, ref


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
def test_hybrid_groups_bitwise_equal_to_ddp_over_all_four_ranks_with_a_float64_wire(recipe):
    results = get_world(4).run(_hybrid_all, recipe)
    for ours, ref in results:
        assert ref["trace"] == [(1.0, False)] * STEPS
        for how, stage, got in ours:
            assert not torch.equal(got["params"]["a.weight"], whole_model(recipe).a.weight), (how, stage)
            assert_trees_equal(got["params"], ref["params"])
    # Each whole param is held by one rank of each shard group, so twice in all.
    shard_groups = {"sub_dp_size": [[0, 1], [2, 3]], "groups": [[0, 2], [1, 3]]}
    for k, (how, _, _) in enumerate(results[0][0]):
        for members in shard_groups[how]:
            held = [n for r in members for n in results[r][0][k][2]["whole"]]
            assert len(held) == len(set(held)) > 0, (how, held)
            assert set(held) == {n for n, p in whole_model(recipe).named_parameters() if _is_whole(recipe, n, p)}


def _is_whole(recipe: str, name: str, p: torch.Tensor) -> bool:
    return recipe != "muon_adamw" or name.endswith("weight")


# --------------------------------------------------------------------------- sharded checkpoints

CKPT_AT = 4  # steps before the save
AFTER = 3  # steps after it


LRS = {"muon": [WHOLE_MUON["lr"]], "adafactor": [WHOLE_ADAFACTOR["lr"]], "muon_adamw": [WHOLE_MUON["lr"], ADAMW["lr"]]}


def _ckpt_facade(recipe: str, shift: bool = False) -> tuple[nn.Module, zf.ZeroOptimizer]:
    """The facade with every lr at 0.5: the uninterrupted run sets the real ones, a load must bring them."""
    model = whole_model(recipe)
    if shift:  # another starting point: the load must bring every value
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    opts = _torch_optimizers(recipe, list(model.named_parameters()))
    for o in opts:
        o.param_groups[0]["lr"] = 0.5
    zo = zf.ZeroOptimizer(
        _wrap(opts), partition_grad=True, overlap_communication=True, reduce_bucket_size=BUCKET, module=model
    )
    return model, zo


def _train_steps(model: nn.Module, zo: zf.ZeroOptimizer, first: int, count: int) -> None:
    data = list(batches(dist.get_rank(), first + count))
    for step in range(first, first + count):
        x, y = data[step]
        zo.backward(_loss(model(x, gate_used(step)), y))
        zo.step()
        zo.zero_grad()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _listed(state_dict: Any) -> list[dict]:
    return state_dict if isinstance(state_dict, list) else [state_dict]


def _trained_to_save(recipe: str) -> tuple[nn.Module, zf.ZeroOptimizer]:
    model, zo = _ckpt_facade(recipe)
    for group, lr in zip(zo.param_groups, LRS[recipe], strict=True):
        group["lr"] = lr
    _train_steps(model, zo, 0, CKPT_AT)
    return model, zo


def _save_and_continue(path: str, recipe: str) -> dict:
    """Uninterrupted: CKPT_AT steps, save, AFTER more steps (the save changes nothing)."""
    model, zo = _trained_to_save(recipe)
    saved = _listed(zo.state_dict())
    at_save = _params(model)
    written = zo.save_checkpoint(path)
    _train_steps(model, zo, CKPT_AT, AFTER)
    out = {"saved": saved, "written": written, "at_save": at_save, "final": _params(model)}
    out["final_state"] = _listed(zo.state_dict())
    zo.close()
    return out


def _load_and_continue(path: str, recipe: str) -> dict:
    model, zo = _ckpt_facade(recipe, shift=True)
    zo.load_checkpoint(path)
    loaded = _listed(zo.state_dict())
    lrs = [g["lr"] for g in zo.param_groups]
    loaded_params = _params(model)
    _train_steps(model, zo, CKPT_AT, AFTER)
    out = {"loaded": loaded, "lrs": lrs, "loaded_params": loaded_params, "final": _params(model)}
    out["final_state"] = _listed(zo.state_dict())
    zo.close()
    return out


def _assert_dicts_equal(a: list[dict], b: list[dict], step: int) -> None:
    assert len(a) == len(b)
    for pa, pb in zip(a, b, strict=True):
        assert pa["param_groups"] == pb["param_groups"]
        assert sorted(pa["state"]) == sorted(pb["state"]) and pa["state"]
        for i in pa["state"]:
            assert_trees_equal(dict(pa["state"][i]), dict(pb["state"][i]))
        assert_trees_equal(pa["zerofn"]["master"], pb["zerofn"]["master"])
        assert pa["zerofn"]["step"] == pb["zerofn"]["step"] == step


STATE_KEYS = {
    "muon": [{"momentum_buffer"}],
    "adafactor": [{"step", "row_var", "col_var"}],  # the first param, a.weight, is a matrix: factored
    "muon_adamw": [{"momentum_buffer"}, {"exp_avg", "exp_avg_sq", "step"}],
}


@pytest.mark.parametrize(
    ("recipe", "m"), [("muon", 2), ("adafactor", 2), ("muon_adamw", 2), ("muon_adamw", 3)], ids=str
)
def test_dcp_checkpoint_round_trips_bitwise_and_continues_as_uninterrupted(tmp_path, recipe, m):
    path = str(tmp_path / "ckpt")
    uninterrupted = get_world(2).run(_save_and_continue, path, recipe)
    resumed = get_world(m).run(_load_and_continue, path, recipe)
    first = uninterrupted[0]
    assert [u["written"] for u in uninterrupted] == [first["written"]] * 2
    assert first["saved"][0]["zerofn"]["step"] == CKPT_AT
    # Momentum buffers, Adafactor's factored statistics, AdamW's moments: the round trip carries real state.
    assert [set(part["state"][0]) for part in first["saved"]] == STATE_KEYS[recipe]
    for r in resumed:
        _assert_dicts_equal(r["loaded"], first["saved"], CKPT_AT)  # bitwise: torch format, masters, step
        assert r["lrs"] == LRS[recipe]  # the saved hyperparameters replaced the 0.5 of every wrapped optimizer
        assert_trees_equal(r["loaded_params"], first["at_save"])  # the model weights came with it
        if m == 2:  # the same ranks and data: the steps after it are the same bits
            assert_trees_equal(r["final"], first["final"])
            _assert_dicts_equal(r["final_state"], first["final_state"], CKPT_AT + AFTER)
    assert not torch.equal(first["final"]["a.weight"], first["at_save"]["a.weight"])


def test_fp16_loss_scale_of_whole_params_survives_a_dcp_checkpoint(tmp_path):
    path = str(tmp_path / "fp16")
    uninterrupted, resumed = get_world(2).run(_fp16_checkpoint, path)[0]
    assert uninterrupted["scale"] == resumed["scale"] and uninterrupted["scale"] != SCALER["initial_scale"]
    assert_trees_equal(resumed["params"], uninterrupted["params"])
    assert_trees_equal(resumed["master"], uninterrupted["master"])


def _fp16_facade(shift: bool) -> tuple[nn.Module, zf.ZeroOptimizer]:
    model = whole_model("muon_adamw")
    if shift:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
    opts = _torch_optimizers("muon_adamw", list(model.named_parameters()))
    zo = zf.ZeroOptimizer(
        opts, forced_dtype=torch.float16, partition_grad=True, reduce_bucket_size=BUCKET, module=model, **SCALER
    )
    return model, zo


def _fp16_run(model: nn.Module, zo: zf.ZeroOptimizer, first: int, count: int) -> None:
    data = list(batches(dist.get_rank(), first + count))
    for step in range(first, first + count):
        x, y = data[step]
        zo.backward(_loss(model(x.half(), gate_used(step)), y.half()))
        zo.step()
        zo.zero_grad()


def _fp16_result(model: nn.Module, zo: zf.ZeroOptimizer) -> dict:
    params = _params(model)
    return {"params": params, "master": _masters(zo.state_dict(), list(params)), "scale": zo.loss_scale}


def _fp16_checkpoint(path: str) -> tuple[dict, dict]:
    model, zo = _fp16_facade(False)
    _fp16_run(model, zo, 0, 6)
    zo.save_checkpoint(path)
    _fp16_run(model, zo, 6, 3)
    uninterrupted = _fp16_result(model, zo)
    zo.close()
    model2, zo2 = _fp16_facade(True)
    zo2.load_checkpoint(path)
    _fp16_run(model2, zo2, 6, 3)
    resumed = _fp16_result(model2, zo2)
    zo2.close()
    assert math.isfinite(resumed["scale"])
    return uninterrupted, resumed


def _whole_state_on_meta() -> dict:
    """Offload is real for whole params too: with ``state_device="meta"`` the whole masters,
    Muon's momentum and AdamW's moments live there, and Muon's update runs there."""
    params = {n: p.detach() for n, p in whole_model("muon_adamw").named_parameters()}
    muon = zf.torch_optim.from_torch(torch.optim.Muon, **WHOLE_MUON)
    fopt = zf.optim.partition([(lambda n: n.endswith("weight"), muon), (lambda n: True, zf.optim.adamw(**ADAMW))])
    policy = zf.PrecisionPolicy.for_dtype(torch.bfloat16, state_device="meta")
    state = zf.shard_params({n: p.bfloat16() for n, p in params.items()}, fopt, precision=policy)
    gen = torch.Generator().manual_seed(seeded(dist.get_rank()))
    grads = {n: torch.randn(p.shape, generator=gen).bfloat16() for n, p in params.items()}
    new, info = zf.step_shards(state, zf.reduce_grads(grads, state.layout, precision=state.precision))
    tensors = [t for t in _tensors((new.master, new.opt_state)) if t.dim() > 0]
    whole = {n: (str(t.device), tuple(t.shape)) for n, t in new.master.items() if new.layout[n].is_whole}
    return {"devices": {str(t.device) for t in tensors}, "whole": whole, "step": new.step, "skipped": info.skipped}


def test_whole_masters_and_their_state_live_on_the_state_device():
    results = get_world(2).run(_whole_state_on_meta)
    for r in results:
        assert r["devices"] == {"meta"} and r["step"] == 1 and not r["skipped"], r
        assert all(device == "meta" and len(shape) == 2 for device, shape in r["whole"].values()), r
    held = sorted(n for r in results for n in r["whole"])
    assert held == sorted(n for n, _ in whole_model("muon_adamw").named_parameters() if n.endswith("weight"))


# --------------------------------------------------------------------------- prefetch and gradient inspection


def _facade_inspected(recipe: str, stage: int, prefetch: bool) -> dict:
    """Every step the gradients read through the facade before ``step``; ``prefetch``: overlap_allgather."""
    model = whole_model(recipe)
    zo = zf.ZeroOptimizer(
        _wrap(_torch_optimizers(recipe, list(model.named_parameters()))),
        partition_grad=stage == 2,
        overlap_communication=stage == 2,
        overlap_allgather=prefetch,
        reduce_bucket_size=BUCKET,
        module=model,
    )
    grads, norms = [], []
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        zo.backward(_loss(model(x, gate_used(step)), y))  # the forward wrote the gathered params
        grads.append({n: zo.get_param_grad(p) for n, p in model.named_parameters()})  # collective at stage 2
        norms.append(zo.get_grad_norm())
        zo.step()
        zo.zero_grad()
    zo.wait_params()
    zo.close()
    return {"params": _params(model), "grads": grads, "norms": norms}


def _ddp_inspected(recipe: str) -> dict:
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(whole_model(recipe)), find_unused_parameters=True)
    opts = _torch_optimizers(recipe, list(ddp.module.named_parameters()))
    grads, norms = [], []
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        _loss(ddp(x, gate_used(step)), y).backward()
        named = list(ddp.module.named_parameters())
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in named})
        present = [p.grad for _, p in named if p.grad is not None]
        norms.append(math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in present)))
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return {"params": _params(ddp.module), "grads": grads, "norms": norms}


def _inspected_all(recipe: str, prefetch: bool) -> tuple[dict, dict, dict]:
    return _facade_inspected(recipe, 1, prefetch), _facade_inspected(recipe, 2, prefetch), _ddp_inspected(recipe)


# overlap_allgather=True with whole params once raised in step ("pack_shards: this bucket
# holds whole params; pass rank="): the prefetcher packed its rows without rank=.
@pytest.mark.parametrize("prefetch", [False, True], ids=["gather_in_step", "overlap_allgather"])
@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
def test_the_gradient_methods_with_whole_params_bitwise_equal_to_ddp(recipe, prefetch):
    for stage1, stage2, ddp in get_world(2).run(_inspected_all, recipe, prefetch):
        for stage, ours in ((1, stage1), (2, stage2)):
            assert_trees_equal(ours["params"], ddp["params"])
            for step, (mine, theirs) in enumerate(zip(ours["grads"], ddp["grads"], strict=True)):
                assert [n for n, g in mine.items() if g is None] == [n for n, g in theirs.items() if g is None]
                assert_trees_equal(
                    {n: g for n, g in mine.items() if g is not None}, {n: g for n, g in theirs.items() if g is not None}
                )
                if not gate_used(step):
                    assert mine["gate.weight"] is None, (stage, step)  # layer drop: no gradient, as DDP
            for ours_norm, ddp_norm in zip(ours["norms"], ddp["norms"], strict=True):
                assert ours_norm == pytest.approx(ddp_norm, rel=1e-12), stage  # float64 sums in another order


# --------------------------------------------------------------------------- the params are the user's


def _write(module: nn.Module, step: int) -> None:
    """The user's writes between steps: a load_state_dict at step 2, an in-place op at step 5."""
    with torch.no_grad():
        if step == 2:
            module.load_state_dict({k: v * 0.5 for k, v in module.state_dict().items()})
        if step == 5:
            module.gate.weight.add_(0.25)  # gate.weight: whole under Muon and Adafactor


def _facade_written(recipe: str, stage: int) -> dict:
    model = whole_model(recipe)
    zo = zf.ZeroOptimizer(
        _wrap(_torch_optimizers(recipe, list(model.named_parameters()))),
        partition_grad=stage == 2,
        reduce_bucket_size=BUCKET,
        module=model,
    )
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        _write(model, step)
        zo.backward(_loss(model(x, gate_used(step)), y))
        zo.step()
        zo.zero_grad()
    zo.close()
    return _params(model)


def _written_all(recipe: str) -> tuple[dict, dict, dict]:
    ref = ddp_reference(
        whole_model(recipe),
        lambda m: _torch_optimizers(recipe, list(m.named_parameters())),
        batches(dist.get_rank(), STEPS),
        steps=STEPS,
        before_step=_write,
    )
    return _facade_written(recipe, 1), _facade_written(recipe, 2), ref["params"]


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
def test_weights_written_between_steps_train_on_with_whole_params_as_with_ddp(recipe):
    for stage1, stage2, ddp in get_world(2).run(_written_all, recipe):
        assert_trees_equal(stage1, ddp)
        assert_trees_equal(stage2, ddp)


def _hybrid_save(path: str) -> dict:
    """[Muon, AdamW] over shard groups {0,2} {1,3} with replicas {0,1} {2,3}: a sharded save."""
    shard, replicate = _strided_groups()
    model = whole_model("muon_adamw")
    zo = zf.ZeroOptimizer(
        _torch_optimizers("muon_adamw", list(model.named_parameters())),
        partition_grad=True,
        reduce_bucket_size=BUCKET,
        module=model,
        dp_process_group=shard,
        replicate_group=replicate,
    )
    _train_steps(model, zo, 0, CKPT_AT)
    full = zo.state_dict()
    written = zo.save_checkpoint(path)
    zo.close()
    return {"full": full, "written": written, "params": _params(model)}


def _plain_load(path: str) -> dict:
    model, zo = _ckpt_facade("muon_adamw", shift=True)
    zo.load_checkpoint(path)
    out = {"full": zo.state_dict(), "params": _params(model)}
    zo.close()
    return out


def test_a_hybrid_checkpoint_of_whole_params_loads_at_other_layouts(tmp_path):
    path = str(tmp_path / "hybrid")
    saved = get_world(4).run(_hybrid_save, path)
    assert len({s["written"] for s in saved}) == 1  # every rank, replicas included, gets the committed directory
    for s in saved[1:]:
        _assert_dicts_equal(s["full"], saved[0]["full"], CKPT_AT)  # replicas and shard groups agree
    for m in (1, 3):
        for loaded in get_world(m).run(_plain_load, path):
            _assert_dicts_equal(loaded["full"], saved[0]["full"], CKPT_AT)
            assert_trees_equal(loaded["params"], saved[0]["params"])
