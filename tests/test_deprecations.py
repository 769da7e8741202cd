"""Renamed keywords and attributes keep working for one release, with a warning naming the new name.

One word per concept: ``precision=`` for a PrecisionPolicy, ``comm_policy=`` for a
CommPolicy. Each old spelling gives the same result as the new one and warns
(``DeprecationWarning``); giving both is a ``TypeError``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from helpers import assert_trees_equal, seeded

import zerofn as zf
from zerofn import checkpoint


def _old_names(path: str) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = zf.optim.sgd(lr=0.1)
    precision = zf.PrecisionPolicy(mixed_dtypes="keep")
    comm_policy = zf.CommPolicy.byte_optimal()
    state = zf.shard_params(params, opt, precision=precision)
    warned: dict[str, str] = {}
    same: dict[str, bool] = {}

    def old(label: str, fn: Any) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
        messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        warned[label] = messages[0] if len(messages) == 1 else f"{len(messages)} warnings: {messages}"
        return out

    old_state = old("shard_params(policy=)", lambda: zf.shard_params(params, opt, policy=precision))
    same["shard_params"] = old_state.precision is precision and all(
        torch.equal(old_state.master[n], state.master[n]) for n in params
    )
    new_shards = zf.reduce_grads(grads, state.layout, comm_policy=comm_policy)
    old_shards = old("reduce_grads(policy=)", lambda: zf.reduce_grads(grads, state.layout, policy=comm_policy))
    assert_trees_equal(old_shards, new_shards)
    new_params = zf.gather_params(state, comm_policy=comm_policy)
    old_params = old("gather_params(policy=)", lambda: zf.gather_params(state, policy=comm_policy))
    assert_trees_equal(old_params, new_params)
    same["ZeroState.policy"] = old("ZeroState.policy", lambda: state.policy) is precision
    replaced = old("ZeroState.replace(policy=)", lambda: state.replace(policy=zf.PrecisionPolicy()))
    same["replace"] = replaced.precision == zf.PrecisionPolicy()
    full = checkpoint.full_state_dict(state)
    loaded = old("shard_state_dict(policy=)", lambda: checkpoint.shard_state_dict(full, params, policy=precision))
    same["shard_state_dict"] = loaded.precision is precision
    checkpoint.save(path, state)
    loaded = old("load(policy=)", lambda: checkpoint.load(path, params, policy=precision))
    same["load"] = loaded.precision is precision
    both: dict[str, str] = {}
    for label, fn in {
        "shard_params": lambda: zf.shard_params(params, opt, policy=precision, precision=precision),
        "reduce_grads": lambda: zf.reduce_grads(grads, state.layout, policy=comm_policy, comm_policy=comm_policy),
        "gather_params": lambda: zf.gather_params(state, policy=comm_policy, comm_policy=comm_policy),
    }.items():
        try:
            fn()
            both[label] = ""
        except TypeError as e:
            both[label] = str(e)
    return {"warned": warned, "same": same, "both": both}


def test_old_keyword_names_warn_with_the_new_name_and_give_the_same_result(worlds, tmp_path):
    (res,) = worlds[1].run(_old_names, str(tmp_path / "ckpt"))
    new_name = {
        "shard_params(policy=)": "precision=",
        "reduce_grads(policy=)": "comm_policy=",
        "gather_params(policy=)": "comm_policy=",
        "ZeroState.policy": "ZeroState.precision",
        "ZeroState.replace(policy=)": "precision=",
        "shard_state_dict(policy=)": "precision=",
        "load(policy=)": "precision=",
    }
    assert set(res["warned"]) == set(new_name)
    for label, message in res["warned"].items():
        assert "deprecated" in message and new_name[label] in message, (label, message)
    assert all(res["same"].values()), res["same"]
    for label, message in res["both"].items():
        assert "got both policy= and" in message, (label, message)
