"""The bad-input table of docs/bad_input.md, row by row, on two real gloo ranks.

The test reads the table: for each row id it builds that input on every rank, calls zerofn,
and checks the raised type and that the message contains the documented text. A row in
the docs without a case here (or the reverse) fails the test.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import re
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import Net, batches, ddp_reference, max_rel_diff, seeded

import zerofn as zf

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bad_input.md"


def _documented() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| (\w+) \| .* \| `(\w+)` \| `(.+)` \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seeded(0))
    return {"a.weight": torch.randn(13, 7, generator=gen), "a.bias": torch.randn(13, generator=gen)}


def _facade(model: nn.Module, **kw: object) -> zf.ZeroOptimizer:
    return zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), module=model, **kw)


def _case(row: str) -> Callable[[], object]:
    """The call that must raise for ``row``; run on every rank."""
    params = _params()
    if row == "non_float":
        return lambda: zf.shard_params({**params, "steps": torch.zeros(3, dtype=torch.int64)}, zf.optim.sgd())
    if row == "devices":
        return lambda: zf.shard_params({**params, "meta.w": torch.empty(3, device="meta")}, zf.optim.sgd())
    if row == "tied":
        return lambda: zf.shard_params({"emb": params["a.weight"], "head": params["a.weight"]}, zf.optim.sgd())
    if row == "empty":
        return lambda: zf.shard_params({}, zf.optim.sgd())
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    grads = {n: torch.ones_like(p) for n, p in params.items()}
    if row == "grad_shape":
        return lambda: zf.reduce_grads({**grads, "a.weight": torch.ones(7, 13)}, state.layout)
    if row == "grad_dtype":
        return lambda: zf.reduce_grads({**grads, "a.bias": torch.ones(13, dtype=torch.float64)}, state.layout)
    if row == "grad_unknown":
        return lambda: zf.reduce_grads({**grads, "c.weight": torch.ones(2)}, state.layout)
    if row == "stage":
        return lambda: zf.reduce_grads(grads, state.layout, stage=3)
    if row == "negative_lr":
        return lambda: zf.optim.adamw(lr=-1.0)
    if row == "betas":
        return lambda: zf.optim.adam(betas=(0.9, 1.0))
    if row == "not_member":
        solo = dist.new_group([0])  # every rank creates it; rank 1 is not in it
        if dist.get_rank() == 0:
            return lambda: None  # a member: nothing wrong here
        return lambda: zf.shard_params(params, zf.optim.sgd(), solo)
    torch.manual_seed(seeded(0))
    model = Net()
    if row == "step_first":
        return _facade(model).step
    if row == "bucket":
        return lambda: _facade(model, reduce_bucket_size=0)
    if row == "lbfgs":
        return lambda: zf.ZeroOptimizer(torch.optim.LBFGS(model.parameters()))
    if row == "nan_lr":
        opt = _facade(model)
        x, y = next(batches(dist.get_rank(), 1))
        opt.backward(((model(x) - y) ** 2).mean())
        opt.param_groups[0]["lr"] = math.nan
        return opt.step
    if row == "other_model":
        sd = _other_model_sd()
        opt = _facade(model)
        return lambda: opt.load_state_dict(sd)
    if row == "other_optimizer":
        sd = _facade(Net()).state_dict()
        opt = zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=model)
        return lambda: opt.load_state_dict(sd)
    raise KeyError(row)


def _other_model_sd() -> dict:
    """The state dict of a model whose ``a`` layer is (13, 8) instead of Net's (13, 7)."""
    torch.manual_seed(seeded(0))
    other = Net()
    other.a = nn.Linear(8, 13)
    return _facade(other).state_dict()


def _raise_on_every_rank(row: str) -> tuple[str, str]:
    before = {n: p.clone() for n, p in _params().items()}
    call = _case(row)
    try:
        call()
    except Exception as e:
        assert all(torch.equal(before[n], p) for n, p in _params().items())
        return type(e).__name__, str(e)
    return "no error", ""


def test_every_documented_row_has_a_case_and_every_case_is_documented():
    cases = {
        "non_float",
        "devices",
        "tied",
        "empty",
        "grad_shape",
        "grad_dtype",
        "grad_unknown",
        "step_first",
        "other_model",
        "other_optimizer",
        "negative_lr",
        "nan_lr",
        "betas",
        "lbfgs",
        "bucket",
        "stage",
        "not_member",
    }
    assert set(_documented()) == cases


@pytest.mark.parametrize("row", sorted(_documented()))
def test_bad_input_gets_the_documented_error_on_every_rank(worlds, row):
    kind, text = _documented()[row]
    for rank, (got_kind, message) in enumerate(worlds[2].run(_raise_on_every_rank, row)):
        if row == "not_member" and rank == 0:
            assert got_kind == "no error"  # rank 0 is in the group; only rank 1 has the bad input
            continue
        assert got_kind == kind, (row, rank, got_kind, message)
        assert text in message, (row, rank, message)


# --------------------------------------------------------------------------- not an error


def _tiny_params_vs_ddp() -> float:
    torch.manual_seed(seeded(0))
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 3))  # params of 1, 1, 3 and 3 elements

    def data() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seeded(dist.get_rank()))
        while True:
            yield torch.randn(4, 1, generator=gen), torch.randn(4, 3, generator=gen)

    ref = ddp_reference(model, lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), data(), steps=5, use_gate=None)
    zopt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), partition_grad=True)
    for x, y in itertools.islice(data(), 5):
        zopt.backward(((model(x) - y) ** 2).mean())
        zopt.step()
        zopt.zero_grad()
    mine = {n: p.detach() for n, p in model.named_parameters()}
    return max_rel_diff(mine, ref["params"])


def test_a_world_bigger_than_every_param_still_trains_on_every_rank(worlds):
    for diff in worlds[4].run(_tiny_params_vs_ddp):
        assert diff <= 1e-6


def test_gather_destinations_are_checked_name_by_name_when_one_is_wrong():
    """``validate_out`` (gather_params' ``out=``): right destinations pass (one comparison of
    two lists); a missing, reshaped, recast or strided one raises naming the param."""
    from zerofn._checks import validate_out  # the check itself: no process group needed

    params = {"a": torch.zeros(4, 6), "b": torch.zeros(5), "c": torch.zeros(3, 2, dtype=torch.float64)}
    layout = zf.make_layout(params, 2)
    validate_out({n: torch.empty_like(p) for n, p in params.items()}, layout, "gather_params")
    bad = {
        "missing": ({"a": params["a"], "c": params["c"]}, KeyError, "out has no tensor for param 'b'"),
        "shape": ({**params, "a": torch.zeros(6, 4)}, ValueError, r"out\['a'\] has shape \(6, 4\)"),
        "dtype": ({**params, "c": torch.zeros(3, 2)}, ValueError, r"out\['c'\] has shape \(3, 2\) dtype torch.float32"),
        "strided": ({**params, "a": torch.zeros(6, 4).t()}, ValueError, r"out\['a'\] .* contiguous=False"),
    }
    for out, error, message in bad.values():
        with pytest.raises(error, match=message):
            validate_out(out, layout, "gather_params")
