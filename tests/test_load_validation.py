"""Loading a torch-format optimizer state dict: everything is checked before anything changes.

The oracle is torch itself. A state dict (from a plain torch optimizer after one step) is
mutated by hypothesis: keys dropped or added, shapes, dtypes and scalar types changed,
entries moved, param groups regrouped, hyperparameters changed, dropped or made invalid.
torch "accepts" a mutation when ``load_state_dict`` and the next ``step`` both succeed.
Then, on real gloo ranks:

* if zerofn loads it, torch must have accepted it, and one more step gives the same params
  bit for bit (N = 2, fp32, the same batch on both ranks: the mean gradient is exact);
* if zerofn refuses it, the error is a ``CheckpointError`` that names what is wrong, and
  the facade's state (masters, optimizer state, step), its param groups and the model's
  params are bitwise what they were, on every rank.

zerofn may be stricter than torch (an integer ``exp_avg``, a state entry for an index no
group lists), never more lenient: a load that succeeds never fails later.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from helpers import Net, Snapshot, batches, seeded
from hypothesis import given, settings
from hypothesis import strategies as st

import zerofn as zf
from zerofn import checkpoint as ck
from zerofn._state_dict_checks import declared_state, required_hyperparams, state_dict_problem
from zerofn.layout import make_layout

OPTIMIZERS = {
    # fast path (zerofn's own AdamW kernel call) and generic path (torch's class on shards)
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.9),
}


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _two_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    # The same batches on every rank: the mean of N equal gradients is exact at N = 2.
    return list(batches(0, 2))


# --------------------------------------------------------------------------- mutations


def _per_element_keys(entry: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0)


def mutate(sd: dict[str, Any], op: str, i: int, j: int) -> dict[str, Any]:
    """A deep copy of ``sd`` with one mutation; ``i`` and ``j`` pick params and keys."""
    sd = copy.deepcopy(sd)
    state, groups = sd["state"], sd["param_groups"]
    indices = sorted(state)
    index = indices[i % len(indices)]
    entry = state[index]
    keys = sorted(entry)
    per_element = _per_element_keys(entry)
    key = per_element[j % len(per_element)]
    if op == "none":
        pass
    elif op == "drop_key":
        del entry[keys[j % len(keys)]]
    elif op == "extra_key":
        entry["extra"] = torch.zeros_like(entry[key])
    elif op == "flatten":
        entry[key] = entry[key].reshape(-1)
    elif op == "transpose":
        entry[key] = entry[key].reshape(-1).flip(0).reshape(tuple(reversed(entry[key].shape)))
    elif op == "shard":  # what one rank of two holds: the first half, flat
        flat = entry[key].reshape(-1)
        entry[key] = flat[: -(-flat.numel() // 2)].clone()
    elif op in ("float64", "float16", "bfloat16", "int64"):
        entry[key] = entry[key].to(getattr(torch, op))
    elif op == "step_int":
        entry["step"] = int(entry["step"])
    elif op == "step_float":
        entry["step"] = float(entry["step"])
    elif op == "step_1d":
        entry["step"] = torch.as_tensor(entry["step"]).reshape(1)
    elif op == "drop_entry":
        del state[index]
    elif op == "stray_entry":
        state[99] = copy.deepcopy(entry)
    elif op == "swap_entries":
        other = indices[j % len(indices)]
        state[index], state[other] = state[other], state[index]
    elif op == "lr":
        groups[0]["lr"] = 0.003 * (1 + j % 3)
    elif op == "negative_lr":
        groups[0]["lr"] = -0.01
    elif op == "nan_eps":
        groups[0]["eps"] = math.nan
    elif op == "betas_list" and "betas" in groups[0]:
        groups[0]["betas"] = list(groups[0]["betas"])
    elif op == "drop_hp":
        del groups[0][("lr", "eps", "foreach", "maximize", "weight_decay")[j % 5]]
    elif op == "extra_hp":
        groups[0]["note"] = "hello"
    elif op == "split_group":
        params = groups[0]["params"]
        groups[0]["params"] = params[:2]
        groups.append({**{k: v for k, v in groups[0].items() if k != "params"}, "params": params[2:]})
    elif op == "drop_param":
        groups[0]["params"] = groups[0]["params"][:-1]
    elif op == "duplicate_param":
        groups[0]["params"] = [groups[0]["params"][0], *groups[0]["params"][:-1]]
    elif op == "no_state":
        del sd["state"]
    return sd


OPS = [
    "none",
    "drop_key",
    "extra_key",
    "flatten",
    "transpose",
    "shard",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "step_int",
    "step_float",
    "step_1d",
    "drop_entry",
    "stray_entry",
    "swap_entries",
    "lr",
    "negative_lr",
    "nan_eps",
    "betas_list",
    "drop_hp",
    "extra_hp",
    "split_group",
    "drop_param",
    "duplicate_param",
    "no_state",
]


# --------------------------------------------------------------------------- the two sides


def _torch_side(kind: str, mutated: dict[str, Any]) -> dict[str, Any]:
    """Plain torch: one step, load ``mutated``, one more step. Accepted iff nothing raised."""
    first, second = _two_batches()
    torch.manual_seed(seeded(0))
    model = Net()
    opt = OPTIMIZERS[kind](model.parameters())
    _loss(model, first).backward()
    opt.step()
    opt.zero_grad()
    try:
        opt.load_state_dict(copy.deepcopy(mutated))
        _loss(model, second).backward()
        opt.step()
        opt.zero_grad()
    except Exception as e:  # torch's verdict, whatever form it takes
        return {"accepted": False, "why": f"{type(e).__name__}: {e}"}
    return {"accepted": True, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _zerofn_side(kind: str, mutated: dict[str, Any]) -> dict[str, Any]:
    """The facade on this rank: one step, load ``mutated``; then one more step, or check nothing changed."""
    first, second = _two_batches()
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(OPTIMIZERS[kind](model.parameters()), partition_grad=True, module=model)
    opt.backward(_loss(model, first))
    opt.step()
    opt.zero_grad()
    before = Snapshot({"state": opt.state, "params": dict(model.named_parameters())})
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    try:
        opt.load_state_dict(copy.deepcopy(mutated))
    except ck.CheckpointError as e:
        before.assert_unchanged({"state": opt.state, "params": dict(model.named_parameters())}, "after a failed load")
        groups_after = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        assert groups_after == groups_before, "a failed load changed the param groups"
        return {"loaded": False, "why": str(e)}
    opt.backward(_loss(model, second))
    opt.step()
    opt.zero_grad()
    return {"loaded": True, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _valid_state_dict(kind: str) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    opt = OPTIMIZERS[kind](model.parameters())
    _loss(model, _two_batches()[0]).backward()
    opt.step()
    opt.zero_grad()
    return opt.state_dict()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@settings(max_examples=30)
@given(op=st.sampled_from(OPS), i=st.integers(0, 7), j=st.integers(0, 7))
def test_a_mutated_state_dict_loads_as_in_torch_or_fails_before_changing_anything(worlds, kind, op, i, j):
    mutated = mutate(_valid_state_dict(kind), op, i, j)
    oracle = _torch_side(kind, mutated)
    for rank, res in enumerate(worlds[2].run(_zerofn_side, kind, mutated)):
        if res["loaded"]:
            assert oracle["accepted"], f"rank {rank}: zerofn loaded {op!r}, which torch rejects ({oracle['why']})"
            for name, p in oracle["params"].items():
                assert torch.equal(res["params"][name], p), f"rank {rank}: {name!r} differs from torch after {op!r}"
        else:
            assert "cannot load" in res["why"] and len(res["why"]) > 40, res["why"]


def test_the_mutations_cover_both_verdicts(worlds):
    """A check that cannot fail is no check: some mutations load, others are refused."""
    expected = {op: True for op in ("none", "lr", "float64", "drop_entry", "extra_hp", "step_int")}
    expected.update({op: False for op in ("flatten", "shard", "drop_key", "extra_key", "split_group", "no_state")})
    for op, loads in expected.items():
        res = worlds[2].run(_zerofn_side, "adamw", mutate(_valid_state_dict("adamw"), op, 0, 0))
        assert [r["loaded"] for r in res] == [loads, loads], op


# --------------------------------------------------------------------------- the messages


def _another_models_state_dict() -> dict[str, Any]:
    src = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(src.parameters())
    src(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt.state_dict()


def test_another_models_state_dict_names_the_param_and_both_shapes():
    # Linear(4, 2)'s AdamW state, offered to a Linear(3, 3) layout.
    layout = make_layout(dict(torch.nn.Linear(3, 3).named_parameters()), 2)
    problem = state_dict_problem(_another_models_state_dict(), layout, layout.names, zf.optim.adamw(lr=1e-3))
    assert problem is not None
    assert "'weight'" in problem and "(2, 4)" in problem and "(3, 3)" in problem and "another model" in problem


def test_a_shard_shaped_state_says_world_size_and_how_to_reshard():
    sd = _valid_state_dict("adamw")
    layout = make_layout(dict(Net().named_parameters()), 1)
    sd = mutate(sd, "shard", 0, 0)
    problem = state_dict_problem(sd, layout, layout.names, zf.optim.adamw(lr=1e-3))
    assert "one rank's shard (world size 2)" in problem and "full_state_dict" in problem


def test_another_optimizers_state_is_named_as_such():
    layout = make_layout(dict(Net().named_parameters()), 2)
    rmsprop = _valid_state_dict("rmsprop")
    problem = state_dict_problem(rmsprop, layout, layout.names, zf.optim.adamw(lr=1e-3))
    assert "has no 'betas'" in problem and "another optimizer" in problem
    amsgrad = _valid_state_dict("adamw")
    amsgrad["param_groups"][0]["amsgrad"] = True  # AdamW with amsgrad keeps a fourth tensor
    problem = state_dict_problem(amsgrad, layout, layout.names, zf.optim.adamw(lr=1e-3))
    assert "missing 'max_exp_avg_sq'" in problem and "another optimizer or with other options" in problem


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("split_group", "2 param groups, this optimizer 1"),
        ("drop_param", "has 7 params, this optimizer's 8"),
        ("drop_hp", "has no 'lr'"),
        ("negative_lr", "invalid hyperparameters for AdamW"),
        ("int64", "expected a floating dtype"),
        ("step_1d", "must be a number or a 0-d tensor"),
        ("stray_entry", "that no param group lists"),
        ("no_state", "needs 'state' and 'param_groups'"),
    ],
)
def test_each_problem_has_its_message(op, expected):
    layout = make_layout(dict(Net().named_parameters()), 2)
    sd = mutate(_valid_state_dict("adamw"), op, 0, 0)
    problem = state_dict_problem(sd, layout, layout.names, zf.optim.adamw(lr=1e-3), group_sizes=[8])
    assert problem is not None and expected in problem, problem


def test_a_valid_state_dict_has_no_problem():
    layout = make_layout(dict(Net().named_parameters()), 3)
    adamw = zf.optim.adamw(lr=1e-3)
    rmsprop = zf.torch_optim.from_torch(torch.optim.RMSprop, lr=1e-2, momentum=0.9)
    assert state_dict_problem(_valid_state_dict("adamw"), layout, layout.names, adamw, group_sizes=[8]) is None
    assert state_dict_problem(_valid_state_dict("rmsprop"), layout, layout.names, rmsprop, group_sizes=[8]) is None


def test_declared_state_follows_the_options_and_the_shape():
    adamw = declared_state(torch.optim.AdamW, {"lr": 1e-3}, (3, 4))
    assert adamw == {"step": None, "exp_avg": (3, 4), "exp_avg_sq": (3, 4)}
    assert declared_state(torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}, (5,))["max_exp_avg_sq"] == (5,)
    assert declared_state(torch.optim.AdamW, {"lr": 1e-3}, ())["exp_avg"] == ()  # a 0-d param: 0-d state
    assert declared_state(torch.optim.SGD, {"lr": 0.1}, (4,)) == {}
    assert declared_state(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, (4,)) == {"momentum_buffer": (4,)}
    assert declared_state(torch.optim.RMSprop, {"lr": 0.1, "momentum": 0.9, "centered": True}, (2, 2)) == {
        "step": None,
        "square_avg": (2, 2),
        "momentum_buffer": (2, 2),
        "grad_avg": (2, 2),
    }
    # Factored statistics are declared with their own shapes (a matrix's row and column).
    assert declared_state(torch.optim.Adafactor, {"lr": 1e-2}, (6, 4)) == {
        "step": None,
        "row_var": (6, 1),
        "col_var": (1, 4),
    }
    assert declared_state(torch.optim.Adafactor, {"lr": 1e-2}, (4,)) == {"step": None, "variance": (4,)}
    assert {"lr", "betas", "eps", "weight_decay"} == required_hyperparams(torch.optim.Adam)


# --------------------------------------------------------------------------- zerofn format and DCP: nothing changes


def _facade(seed: int = 0) -> tuple[torch.nn.Module, zf.ZeroOptimizer]:
    torch.manual_seed(seeded(seed))
    model = Net()
    opt = zf.ZeroOptimizer(OPTIMIZERS["adamw"](model.parameters()), partition_grad=True, module=model)
    opt.backward(_loss(model, _two_batches()[0]))
    opt.step()
    opt.zero_grad()
    return model, opt


def _observed(model: torch.nn.Module, opt: zf.ZeroOptimizer) -> dict[str, Any]:
    return {"state": opt.state, "params": dict(model.named_parameters())}


def _failed_loads(path: str) -> dict[str, Any]:
    """Loads that must fail on every rank, each leaving the facade and the model bitwise as they were."""
    import os

    import torch.distributed as dist

    model, opt = _facade()
    good_sd = opt.state_dict()
    where = opt.save_checkpoint(path)
    intact = opt.save_checkpoint(path + "_intact")
    rank = dist.get_rank()
    other_model = torch.nn.Linear(3, 3)
    other = zf.ZeroOptimizer(torch.optim.AdamW(other_model.parameters()), partition_grad=True, module=other_model)
    other_model(torch.randn(2, 3)).sum().backward()
    other.step()
    other.zero_grad()
    other_sd = other.state_dict()
    # A corrupt rank file of the sharded checkpoint (same size, other bytes): the SHA-256 check.
    if rank == 0:
        victim = sorted(f for f in os.listdir(where) if f.endswith(".distcp"))[0]
        with open(os.path.join(where, victim), "r+b") as f:
            f.seek(10)
            f.write(b"\x00\x01\x02\x03")
    dist.barrier()
    cases = {
        "zerofn_other_model": lambda: opt.load_state_dict(other_sd),
        "zerofn_only_rank_1_bad": lambda: opt.load_state_dict(other_sd if rank == 1 else good_sd),
        "dcp_corrupt": lambda: opt.load_checkpoint(where),
        "dcp_only_rank_0_missing": lambda: opt.load_checkpoint(intact + ".nowhere" if rank == 0 else intact),
    }
    out: dict[str, Any] = {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    for name, load in cases.items():
        before = Snapshot(_observed(model, opt))
        try:
            load()
        except ck.CheckpointError as e:
            out[name] = str(e)
        else:
            out[name] = ""
        before.assert_unchanged(_observed(model, opt), f"{name}: after a failed load")
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups, name
    # After all that the facade still trains (nothing was left half-loaded).
    opt.backward(_loss(model, _two_batches()[1]))
    opt.step()
    opt.zero_grad()
    return out


def test_zerofn_format_and_dcp_loads_that_fail_change_nothing_and_fail_on_every_rank(worlds, tmp_path):
    results = worlds[2].run(_failed_loads, str(tmp_path / "ck"))
    for name in ("zerofn_other_model", "zerofn_only_rank_1_bad", "dcp_corrupt", "dcp_only_rank_0_missing"):
        assert all(r[name] for r in results), f"{name}: some rank did not raise: {[r[name] for r in results]}"
    assert "has no param 'a.weight'" in results[0]["zerofn_other_model"]
    assert "rank 1 of the group could not load it" in results[0]["zerofn_only_rank_1_bad"]
    assert "SHA-256" in results[1]["dcp_corrupt"]
    assert "rank 0 of the group could not load it" in results[1]["dcp_only_rank_0_missing"]
    assert "no checkpoint at" in results[0]["dcp_only_rank_0_missing"]
