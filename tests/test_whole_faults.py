"""Rank desync with whole params: one rank that builds or steps differently makes every
rank raise, and none hangs.

A rank that wraps other optimizers (so other params are placed whole), passes another
placement override, or builds another model has another layout: ``ZeroOptimizer``'s
construction compares the layouts' fingerprints (which cover placements and owners) in one
all-gather, and every rank raises :class:`~zerofn.RankMismatchError` before any shard is
exchanged. A rank that passes a bad whole-param gradient to ``step_shards`` raises its own
error, the others a ``RankMismatchError`` naming it; a non-finite whole gradient on its
owner makes every rank skip the step, or raise ``NonFiniteGradError`` naming the param with
``nonfinite="raise"``, the state unchanged everywhere.

These tests use their own small ``World`` with a short process-group timeout (as
``tests/test_faults.py`` does), so a rank left waiting in a collective would fail in
seconds, not hang the suite. That no rank waited shows in what they raise, not in a
clock: a rank that had waited for a peer would raise gloo's timeout error, not zerofn's
``RankMismatchError`` naming the cause (the time taken depends on the machine's load).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import get_world
from helpers import IN_FEATURES, OUT_FEATURES, Net, Snapshot, batches, seeded

import zerofn as zf
from zerofn.precision import NonFiniteGradError
from zerofn.testing import World

TIMEOUT_S = 6.0
MUON = dict(lr=0.02, momentum=0.95)
ADAMW = dict(lr=1e-2)


@pytest.fixture(scope="module")
def world():
    with World(2, timeout=TIMEOUT_S) as w:
        yield w


def _raised(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on this rank: what it raised (type, message)."""
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


class Wider(Net):
    """Net with a hidden width of 14 instead of 13: other shapes, the same names."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.a = nn.Linear(IN_FEATURES, 14)
        self.gate = nn.Linear(14, 14)
        self.b = nn.Linear(14, OUT_FEATURES)
        self.unused = nn.Linear(OUT_FEATURES, 3)


def _muon_adamw(model: nn.Module, matrices: str = "muon") -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    weights = [p for n, p in named if n.endswith("weight")]
    first = torch.optim.Muon(weights, **MUON) if matrices == "muon" else torch.optim.Adafactor(weights, lr=0.01)
    return [first, torch.optim.AdamW([p for n, p in named if not n.endswith("weight")], **ADAMW)]


def _build(how: str) -> zf.ZeroOptimizer:
    """Rank 0 builds the usual Muon + AdamW facade; rank 1 does what ``how`` says."""
    odd = dist.get_rank() == 1
    torch.manual_seed(seeded(0))
    model = Wider() if odd and how == "shapes" else Net()
    if odd and how == "adamw_only":  # every param split
        return zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), partition_grad=True, module=model)
    if odd and how == "adafactor":  # the biases whole as well
        opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
        return zf.ZeroOptimizer(opt, partition_grad=True, module=model)
    if odd and how == "adafactor_adamw":  # the same placements as [Muon, AdamW], another update
        return zf.ZeroOptimizer(_muon_adamw(model, "adafactor"), partition_grad=True, module=model)
    if how == "override":  # the functional facade: RMSprop with a placement override
        rule = (lambda n, s: "whole") if odd else (lambda n, s: "whole" if len(s) == 2 else "split")
        fopt = zf.torch_optim.from_torch(torch.optim.RMSprop, placement=rule, lr=1e-2)
        return zf.ZeroOptimizer(model.named_parameters(), fopt, partition_grad=True)
    return zf.ZeroOptimizer(_muon_adamw(model), partition_grad=True, module=model)


def _construct(how: str) -> dict[str, Any]:
    return _raised(lambda: _build(how))


@pytest.mark.parametrize(
    ("how", "why"),
    [
        # A list of optimizers orders the params optimizer by optimizer (Muon's matrices
        # first), one optimizer over the model in model order: the first difference found.
        ("adamw_only", "list the same params in a different order"),
        ("adafactor", "list the same params in a different order"),
        ("override", "fingerprints differ"),  # same params, same order, other placements
        ("shapes", "Param 'a.weight': rank 0 has shape (13, 7)"),
        # Every matrix whole on both ranks, so the layouts agree; the update rules do not.
        ("adafactor_adamw", "Settings differ (optimizer:"),
    ],
)
def test_a_rank_that_builds_other_whole_placements_makes_every_rank_raise(world, how, why):
    results = world.run(_construct, how)
    for r in results:
        assert r["type"] == "RankMismatchError", results
        assert "ZeroOptimizer: ranks disagree before any shard was exchanged" in r["message"]
        assert why in r["message"], r["message"]
    # The pool is healthy afterwards: the same construction on every rank works.
    assert [r["type"] for r in world.run(_construct, "same")] == [None, None]


# --------------------------------------------------------------------------- step_shards


def _whole_state(nonfinite: str = "skip") -> tuple[zf.ZeroState, dict[str, torch.Tensor]]:
    torch.manual_seed(seeded(0))
    params = {"w": torch.randn(5, 4), "v": torch.randn(4, 4), "b": torch.randn(3)}
    muon = zf.torch_optim.from_torch(torch.optim.Muon, **MUON)
    fopt = zf.optim.partition([(lambda n: n in ("w", "v"), muon), (lambda n: True, zf.optim.adamw(**ADAMW))])
    precision = zf.PrecisionPolicy(nonfinite=nonfinite)
    state = zf.shard_params(params, fopt, precision=precision)
    torch.manual_seed(seeded(1))
    grads = {n: torch.randn(p.shape) for n, p in params.items()}
    state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))  # momentum exists
    return state, grads


def _bad_whole_grad(kind: str) -> dict[str, Any]:
    state, grads = _whole_state()
    before = Snapshot((dict(state.master), state.opt_state))
    shards = dict(zf.reduce_grads(grads, state.layout))
    owner = state.layout["w"].owner
    me = dist.get_rank()
    if kind == "transposed" and me == owner:
        shards["w"] = shards["w"].t().contiguous()
    elif kind == "integer" and me == owner:
        shards["w"] = torch.ones(5, 4, dtype=torch.int64)
    elif kind == "unknown" and me == 1:
        shards["w.extra"] = torch.ones(5, 4)
    elif kind == "non_owner_full" and me != owner:
        shards["w"] = torch.ones(5, 4)
    out = _raised(lambda: zf.step_shards(state, shards))
    before.assert_unchanged((dict(state.master), state.opt_state), "state after a refused step")
    out["owner"] = owner
    return out


@pytest.mark.parametrize(
    ("kind", "error", "says"),
    [
        ("transposed", "ValueError", "shard of 'w' has shape (4, 5), expected (5, 4) (the full shape of a whole param"),
        ("integer", "TypeError", "shard of 'w' has dtype torch.int64, not floating"),
        ("unknown", "KeyError", "gradient shard for unknown param 'w.extra'"),
        ("non_owner_full", "ValueError", "got a gradient for whole param 'w' (shape (5, 4)), which rank"),
    ],
)
def test_a_bad_whole_gradient_on_one_rank_makes_every_rank_raise_and_nothing_changes(world, kind, error, says):
    results = world.run(_bad_whole_grad, kind)
    owner = results[0]["owner"]
    culprit = 1 if kind == "unknown" else (1 - owner if kind == "non_owner_full" else owner)
    for rank, r in enumerate(results):
        if rank == culprit:
            assert r["type"] == error and says in r["message"], r
        else:
            assert r["type"] == "RankMismatchError", r
            assert f"rank {culprit}" in r["message"] and says in r["message"], r


def _non_finite_whole_grad(nonfinite: str) -> dict[str, Any]:
    state, grads = _whole_state(nonfinite)
    before = Snapshot((dict(state.master), state.opt_state))
    shards = dict(zf.reduce_grads(grads, state.layout))
    owner = state.layout["w"].owner
    if dist.get_rank() == owner:  # only the owner holds w's gradient: only it can see the NaN
        shards["w"] = shards["w"].clone()
        shards["w"][2, 1] = float("nan")
    result: dict[str, Any] = {}

    def step() -> None:
        new, info = zf.step_shards(state, shards)
        result.update(skipped=info.skipped, step=new.step, same=new.master is state.master)

    out = _raised(step)
    before.assert_unchanged((dict(state.master), state.opt_state), "state after a non-finite step")
    return {**out, **result, "owner": owner, "step_before": state.step}


def test_a_non_finite_whole_gradient_on_its_owner_skips_the_step_on_every_rank(world):
    for r in world.run(_non_finite_whole_grad, "skip"):
        assert r["type"] is None, r
        assert r["skipped"] and r["step"] == r["step_before"] == 1 and r["same"], r


def test_a_non_finite_whole_gradient_raises_on_every_rank_naming_the_param(world):
    results = world.run(_non_finite_whole_grad, "raise")
    for r in results:
        assert r["type"] == NonFiniteGradError.__name__, r
        assert "'w'" in r["message"], r["message"]


# --------------------------------------------------------------------------- the facade's step


def _facade_desync_step() -> dict[str, Any]:
    """One rank's whole params get no gradient in a step where the peers' do (a layer dropped on one rank)."""
    torch.manual_seed(seeded(0))
    model = Net()
    zo = zf.ZeroOptimizer(_muon_adamw(model), partition_grad=False, module=model)
    x, y = next(batches(dist.get_rank(), 1))
    use_gate = dist.get_rank() == 0  # rank 1 skips the gate: its gradient set differs
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step() -> None:
        zo.backward(((model(x, use_gate) - y) ** 2).mean())
        zo.step()
        zo.zero_grad()

    out = _raised(step)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    zo.close()
    return out


def test_a_layer_dropped_on_one_rank_only_makes_every_rank_raise(world):
    results = world.run(_facade_desync_step)
    for r in results:
        assert r["type"] == "RankMismatchError", r
        assert "Param 'gate.bias' has a gradient on ranks [0] but none on ranks [1]" in r["message"], r
        assert r["unchanged"], r


# --------------------------------------------------------------------------- what the layout cannot see


def _rules(first: type[torch.optim.Optimizer]) -> str:
    from zerofn.facade import _options

    torch.manual_seed(seeded(0))
    model = Net()
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if n.endswith("weight")]
    rest = [(n, p) for n, p in named if not n.endswith("weight")]
    opts = [first([p for _, p in mats], lr=0.01), torch.optim.AdamW([p for _, p in rest], **ADAMW)]
    fopt = zf.torch_optim.from_torch_optimizers(opts, [[[n for n, _ in mats]], [[n for n, _ in rest]]])
    layout = zf.shard_params({n: p.detach() for n, p in named}, fopt).layout
    return _options.update_rules(fopt, [n for n, _ in named]), layout


def test_update_rules_tell_apart_optimizers_whose_placements_agree():
    # Muon and Adafactor both place every matrix whole: the same layout, other update rules.
    # ZeroOptimizer's construction compares their hash across ranks (the "adafactor_adamw"
    # case above).
    muon_rules, muon_layout = get_world(1).run(_rules, torch.optim.Muon)[0]
    adafactor_rules, adafactor_layout = get_world(1).run(_rules, torch.optim.Adafactor)[0]
    assert muon_layout == adafactor_layout
    assert muon_rules != adafactor_rules
    assert muon_rules == get_world(1).run(_rules, torch.optim.Muon)[0][0]  # the same on every build
    assert "a.weight:muon:Muon" in muon_rules.splitlines() and "a.bias:adamw:AdamW" in muon_rules.splitlines()
    assert "a.weight:adafactor:Adafactor" in adafactor_rules.splitlines()
