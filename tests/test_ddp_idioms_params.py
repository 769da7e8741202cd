"""Params are the user's: torch idioms that write params, and porting mistakes, against DDP + torch.optim.

Each idiom runs on real gloo ranks at N = 2 and 3, stage 1 and 2, with and without
``overlap_allgather`` (the option that changes when params are written), next to DDP +
the same torch optimizer on the same data, doing the same thing to its model.

Tolerance: bitwise at every N. At N = 2 on the default fp32 wire (the mean of two
gradients does not depend on the order of the sum); at N = 3 on a float64 wire on both
sides (``helpers.exact_wire``: the facade's ``communication_dtype=torch.float64``,
``helpers.ddp_reference(..., wire=torch.float64)``), where the sum of N fp32 addends is
exact in any order. A param the user wrote is taken exactly on both sides, so any
difference is a logic error (a write lost, applied twice or too late).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import Net, assert_trees_equal, batches, ddp_reference, exact_wire, max_rel_diff, seeded

import zerofn as zf
from zerofn.facade._guards import ParamsChangedError

STEPS = 5
CONFIGS = [
    {"stage": 1, "overlap_allgather": False},
    {"stage": 2, "overlap_allgather": False},
    {"stage": 1, "overlap_allgather": True},
    {"stage": 2, "overlap_allgather": True},
]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(seeded(1))
    sd = Net().state_dict()
    sd["a.weight"][0, 0] = 7.0
    return sd


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _torch_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _pair(cfg: dict[str, Any], **extra: Any) -> tuple[nn.Module, zf.ZeroOptimizer]:
    """Net (seed 0) under the facade; ``helpers.ddp_reference`` of a seed-0 Net is its DDP twin."""
    torch.manual_seed(seeded(0))
    model = Net()
    zopt = zf.ZeroOptimizer(
        _torch_adamw(model),
        partition_grad=cfg["stage"] == 2,
        overlap_allgather=cfg["overlap_allgather"],
        reduce_bucket_size=64,
        module=model,
        **extra,
    )
    return model, zopt


def _edit_and_train(cfg: dict[str, Any], edit: str) -> dict[str, Any]:
    """Train both; before step 0 and after step 2, ``edit`` the params of both models alike."""
    torch.manual_seed(seeded(0))
    initial = Net()
    wire = exact_wire(dist.get_world_size())
    model, zopt = _pair(cfg, communication_dtype=wire)
    found: list[list[str]] = []

    def apply(m: nn.Module, is_zero: bool) -> None:
        if edit == "load":
            m.load_state_dict(_pretrained())
        elif edit == "copy_":
            with torch.no_grad():
                m.a.weight.copy_(torch.full_like(m.a.weight, 0.25))
                m.b.bias.mul_(-2.0)
        elif edit == "data":  # through p.data: no version counter moves; the explicit check finds it
            m.a.weight.data.mul_(0.5)
            if is_zero:
                found.append(zopt.check_params())

    options: dict[str, Any] = dict(
        steps=STEPS, use_gate=None, before_step=lambda m, step: apply(m, False) if step in (0, 3) else None
    )
    ref = ddp_reference(initial, _torch_adamw, batches(dist.get_rank(), STEPS), wire=wire, **options)
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        if step in (0, 3):
            apply(model, True)  # overlap_allgather: no wait_params(); the write waits for the gather first
        zopt.backward(_loss(model, x, y))
        zopt.step()
        zopt.zero_grad()
    zopt.wait_params()
    moved = max_rel_diff(ref["params"], _named(initial))
    return {"zero": _named(model), "ref": ref["params"], "moved": moved, "found": found}


def _edit_matrix(edit: str) -> list[dict[str, Any]]:
    return [_edit_and_train(cfg, edit) for cfg in CONFIGS]


@pytest.mark.numerics
@pytest.mark.parametrize("edit", ["load", "copy_", "data"])
@pytest.mark.parametrize("n", [2, 3])
def test_params_written_between_steps_are_trained_as_with_ddp(worlds, n, edit):
    """Writes before step 0 and step 3, then 5 AdamW steps: bitwise DDP's on the exact wire.

    Why exact: both sides take the written values as they are, the mean gradient is DDP's
    bit for bit on ``exact_wire(n)`` (fp32 at N = 2, float64 at N = 3), and the same torch
    AdamW steps on the same bits.
    """
    results = worlds[n].run(_edit_matrix, edit)
    for rank_results in results:
        for cfg, res in zip(CONFIGS, rank_results, strict=True):
            assert_trees_equal(res["zero"], res["ref"])
            assert res["moved"] > 1e-3, (cfg, res["moved"])  # training moved the params
            if edit == "data":
                # The p.data write is found by the explicit check, on every rank alike.
                assert res["found"] == [["a.weight"], ["a.weight"]], cfg
    for rank_results in results[1:]:
        for mine, first in zip(rank_results, results[0], strict=True):
            assert_trees_equal(mine["zero"], first["zero"])


def _weights_loaded_after_building(cfg: dict[str, Any]) -> dict[str, Any]:
    """The issue's script: SGD lr 0, load pretrained weights after building the optimizer, one step."""
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        partition_grad=cfg["stage"] == 2,
        overlap_allgather=cfg["overlap_allgather"],
        module=model,
    )
    pretrained = _pretrained()
    model.load_state_dict(pretrained)
    x, y = next(batches(dist.get_rank(), 1))
    opt.backward(_loss(model, x, y))
    opt.step()
    opt.zero_grad()
    opt.wait_params()
    return {"weight00": model.a.weight[0, 0].item(), "params": _named(model), "pretrained": pretrained}


def _weights_loaded_after_building_matrix() -> list[dict[str, Any]]:
    return [_weights_loaded_after_building(cfg) for cfg in CONFIGS]


@pytest.mark.parametrize("n", [2, 3])
def test_weights_loaded_after_building_the_optimizer_are_kept(worlds, n):
    for rank_results in worlds[n].run(_weights_loaded_after_building_matrix):
        for cfg, res in zip(CONFIGS, rank_results, strict=True):
            assert res["weight00"] == 7.0, cfg
            assert_trees_equal(res["params"], res["pretrained"])


def _bf16_adoption() -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net().to(torch.bfloat16)
    opt = zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), partition_grad=True, module=model)
    x, y = next(batches(dist.get_rank(), 1))
    # A few real steps so the fp32 masters hold more than the bf16 params show.
    opt.param_groups[0]["lr"] = 1e-2
    for _ in range(3):
        opt.backward(_loss(model, x.bfloat16(), y.bfloat16()))
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.0
    before = {n: m.clone() for n, m in opt.state.master.items()}
    # Writing the model's own values back moves every version counter and loses nothing.
    model.load_state_dict(model.state_dict())
    opt.backward(_loss(model, x.bfloat16(), y.bfloat16()))
    opt.step()
    opt.zero_grad()
    kept = all(torch.equal(opt.state.master[n], before[n]) for n in before)
    # A real change: the written bf16 values replace the masters' elements that no longer round to them.
    with torch.no_grad():
        model.a.weight.add_(0.5)
    opt.backward(_loss(model, x.bfloat16(), y.bfloat16()))
    opt.step()
    opt.zero_grad()
    master = opt.state.master["a.weight"]
    spec = opt.state.layout["a.weight"]
    start, stop = spec.owned_range(opt.state.rank)
    part = model.a.weight.detach().reshape(-1)[start:stop]
    return {
        "kept": kept,
        "a_weight_is_param": torch.equal(master[: stop - start], part.float()),
        "others_kept": all(torch.equal(opt.state.master[n], before[n]) for n in before if n != "a.weight"),
        "extra_bits_before": any(not torch.equal(m, m.bfloat16().float()) for m in before.values()),
    }


def test_bf16_params_with_fp32_masters_adopt_written_values_and_keep_the_rest(worlds):
    for res in worlds[2].run(_bf16_adoption):
        assert res["extra_bits_before"]  # the masters held precision the params did not show
        assert res["kept"]  # writing the same values back dropped none of it
        assert res["a_weight_is_param"]  # a written param's master is the written bf16 value
        assert res["others_kept"]  # params nobody wrote keep their masters


def _disagree(how: str) -> dict[str, Any]:
    model, zopt = _pair(CONFIGS[1])
    x, y = next(batches(dist.get_rank(), 1))
    zopt.backward(_loss(model, x, y))
    zopt.step()
    zopt.zero_grad()
    masters = {n: m.clone() for n, m in zopt.state.master.items()}
    if how == "only_rank_0" and dist.get_rank() == 0:
        model.load_state_dict(_pretrained())
    elif how == "different_values":
        with torch.no_grad():
            model.a.bias.fill_(float(dist.get_rank()))
    zopt.backward(_loss(model, x, y))
    try:
        zopt.step()
        zopt.zero_grad()
    except ParamsChangedError as e:
        message = str(e)
    else:
        message = ""
    unchanged = all(torch.equal(zopt.state.master[n], m) for n, m in masters.items())
    # The fix the message names: equal params on every rank, then update_master_params().
    model.load_state_dict(_pretrained())
    zopt.update_master_params()
    zopt.step()  # the gradients of the refused step were kept
    zopt.zero_grad()
    return {"message": message, "unchanged": unchanged, "params": _named(model)}


@pytest.mark.parametrize("how", ["only_rank_0", "different_values"])
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_change_params_differently_all_raise_the_same_error(worlds, n, how):
    results = worlds[n].run(_disagree, how)
    assert results[0]["message"], "no error"
    assert all(r["message"] == results[0]["message"] for r in results)
    assert "update_master_params()" in results[0]["message"]
    assert ("rank 0 changed" if how == "only_rank_0" else "different values into 'a.bias'") in results[0]["message"]
    assert all(r["unchanged"] for r in results)
    for r in results[1:]:
        assert_trees_equal(r["params"], results[0]["params"])


def _write_while_pending() -> dict[str, Any]:
    """A write through a view made before ``step`` (the guard sees the param, not its aliases)."""
    model, zopt = _pair(CONFIGS[3])
    x, y = next(batches(dist.get_rank(), 1))
    row = model.a.weight[0]  # a view, taken before the step
    zopt.backward(_loss(model, x, y))
    zopt.step()  # gathers launched, written by the next forward
    zopt.zero_grad()
    with torch.no_grad():
        row.mul_(0.5)  # made to the values from before the step
    zopt.backward(_loss(model, x, y))
    try:
        zopt.step()
        zopt.zero_grad()
    except ParamsChangedError as e:
        message = str(e)
    else:
        return {"message": ""}
    # The way out the message names: keep the params as they are now, step again.
    kept = model.a.weight.detach().clone()
    zopt.update_master_params()
    zopt.step()  # the refused step's gradients were kept
    zopt.zero_grad()
    zopt.wait_params()
    return {"message": message, "trained_from_kept": not torch.equal(model.a.weight, kept)}


def test_a_write_through_an_old_view_while_the_gather_is_pending_raises_on_every_rank_with_the_fix(worlds):
    results = worlds[2].run(_write_while_pending)
    assert results[0]["message"] and all(r["message"] == results[0]["message"] for r in results)
    assert "'a.weight'" in results[0]["message"] and "wait_params()" in results[0]["message"]
    assert all(r["trained_from_kept"] for r in results)


# --------------------------------------------------------------------------- porting mistakes


def _mistake(kind: str, stage: int) -> str:
    torch.manual_seed(seeded(0))
    model = Net()
    if kind == "ddp_module":
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        try:
            zf.ZeroOptimizer(torch.optim.AdamW(ddp.parameters()), module=ddp)
        except ValueError as e:
            return str(e)
        return ""
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters()), partition_grad=stage == 2, module=model)
    if kind == "state_lookup":
        try:
            opt.state[model.a.weight]["exp_avg"]
        except TypeError as e:
            return str(e)
        return ""
    if kind == "to_float64":
        model.to(torch.float64)
    elif kind == "new_parameter":
        model.a.weight = nn.Parameter(torch.zeros_like(model.a.weight))
    elif kind == "new_module":
        model.b = nn.Linear(13, 5)
    x, y = next(batches(dist.get_rank(), 1))
    dtype = next(model.parameters()).dtype
    try:  # found by backward, before any of its collectives (or by step, for a loss.backward() user)
        opt.backward(_loss(model, x.to(dtype), y.to(dtype)))
    except ParamsChangedError as e:
        message = str(e)
    else:
        return ""
    if stage == 2:  # its gradient hooks reduce inside loss.backward(): ZeroOptimizer.backward is the way there
        return message
    _loss(model, x.to(dtype), y.to(dtype)).backward()  # plain torch backward at stage 1: step finds it alike
    try:
        opt.step()
        opt.zero_grad()
    except ParamsChangedError as e:
        return message + " | " + str(e)
    return ""


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("ddp_module", "module=model.module"),
        ("state_lookup", "state_dict()['state']"),
        ("to_float64", "Move or cast the model first, then build the ZeroOptimizer"),
        ("new_parameter", "'a.weight' of module= is no longer the parameter"),
        ("new_module", "'b' of module= is no longer the submodule"),
    ],
)
@pytest.mark.parametrize("n", [2, 3])
def test_porting_mistakes_fail_at_once_with_the_fix(worlds, n, kind, expected):
    for stage in (1, 2):
        messages = worlds[n].run(_mistake, kind, stage)
        assert expected in messages[0], messages[0]
        assert all(m == messages[0] for m in messages)
        if kind not in ("ddp_module", "state_lookup") and stage == 1:
            assert messages[0].count(expected) == 2, messages[0]  # backward and step both say it


# --------------------------------------------------------------------------- save_checkpoint on replicas


def _hybrid_round_trip(path: str) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True, sub_dp_size=2, module=model
    )
    x, y = next(batches(dist.get_rank(), 1))
    opt.backward(_loss(model, x, y))
    opt.step()
    opt.zero_grad()
    before = _named(model)
    where = opt.save_checkpoint(path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.load_checkpoint(where)  # the returned directory, on every rank (replicas included)
    return {"where": where, "restored": _named(model), "before": before}


def test_save_checkpoint_returns_the_committed_directory_on_every_rank_of_a_hybrid_layout(worlds, tmp_path):
    import os

    path = str(tmp_path / "ck")
    results = worlds[4].run(_hybrid_round_trip, path)
    assert all(r["where"] == os.path.realpath(path) for r in results)
    for r in results:
        assert_trees_equal(r["restored"], r["before"])
