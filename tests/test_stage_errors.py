"""Bad inputs to the stage functions raise clear errors and leave every input unchanged.

Each case runs on all ranks with the same bad input (so every rank raises locally, before
any collective). The rank catches the error, checks that its inputs are untouched, and
returns the exception's type and message for the test to inspect.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
from helpers import Snapshot, seeded

import zerofn as zf


def _params():
    gen = torch.Generator().manual_seed(seeded(0))
    return {"a.weight": torch.randn(13, 7, generator=gen), "a.bias": torch.randn(13, generator=gen)}


def _grads(params):
    return {n: torch.ones_like(p) for n, p in params.items()}


def _shard_params_args(case):
    w = torch.randn(4, 4)
    return {
        "int_param": {**_params(), "steps": torch.zeros(3, dtype=torch.int64)},
        "bool_param": {"mask": torch.ones(3, dtype=torch.bool)},
        "tied": {"emb.weight": w, "head.weight": w},
        "empty": {},
        "not_mapping": [torch.ones(3)],
        "not_tensor": {"w": [1.0, 2.0]},
    }[case]


def _call(case):
    """Build the inputs for ``case``, call the stage, check nothing changed, report the error."""
    params = _params()
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    grads = _grads(params)
    n = dist.get_world_size()
    shards = zf.reduce_grads(grads, state.layout)
    if case in ("int_param", "bool_param", "tied", "empty", "not_mapping", "not_tensor"):
        inputs = _shard_params_args(case)

        def call():
            return zf.shard_params(inputs, zf.optim.sgd(lr=0.1))
    elif case.startswith("grad_") or case.startswith("reduce_"):
        layout = state.layout
        kwargs = {}
        if case == "grad_shape":
            grads["a.weight"] = torch.ones(7, 13)
        elif case == "grad_dtype":
            grads["a.bias"] = torch.ones(13, dtype=torch.float64)
        elif case == "grad_unknown":
            grads["c.weight"] = torch.ones(2)
        elif case == "grad_not_mapping":
            grads = list(grads.values())
        elif case == "reduce_stage3":
            kwargs = {"stage": 3}
        elif case == "reduce_stage0":
            kwargs = {"stage": 0}
        elif case == "reduce_bucket0":
            kwargs = {"bucket_numel": 0}
        elif case == "reduce_bucket_negative":
            kwargs = {"bucket_numel": -8}
        elif case == "reduce_other_world_size":
            layout = zf.make_layout(params, n + 1)
        inputs = (grads, layout)

        def call():
            return zf.reduce_grads(grads, layout, **kwargs)
    elif case.startswith("step_"):
        kwargs = {}
        if case == "step_full_grads":
            shards = grads  # full gradients instead of this rank's shards
        elif case == "step_short_shard":
            shards = {**shards, "a.bias": torch.ones(1)}
        elif case == "step_unknown":
            shards = {**shards, "c.weight": torch.ones(1)}
        elif case == "step_norm_type":
            kwargs = {"norm_type": 1.0}
        elif case == "step_max_norm_zero":
            kwargs = {"max_norm": 0.0}
        elif case == "step_max_norm_nan":
            kwargs = {"max_norm": math.nan}
        inputs = (state, shards)

        def call():
            return zf.step_shards(state, shards, **kwargs)
    elif case == "gather_bucket0":
        inputs = state

        def call():
            return zf.gather_params(state, bucket_numel=0)
    else:
        raise AssertionError(f"unknown case {case}")

    snap = Snapshot(inputs)
    try:
        call()
    except Exception as exc:
        snap.assert_unchanged(inputs, f"{case}: inputs")
        # The state is still usable: a normal step goes through afterwards.
        state2, info = zf.step_shards(state, zf.reduce_grads(_grads(params), state.layout))
        assert state2.step == 1 and not info.skipped
        return type(exc).__name__, str(exc)
    return "no error", ""


CASES = {
    # case: (exception type, regex the message must match; {rank} and {n} are filled in)
    "int_param": ("TypeError", r"shard_params: param 'steps' has dtype torch\.int64; only floating-point"),
    "bool_param": ("TypeError", r"param 'mask' has dtype torch\.bool"),
    "tied": ("ValueError", r"params 'emb\.weight' and 'head\.weight' are the same tensor \(tied"),
    "empty": ("ValueError", r"shard_params: params is empty"),
    "not_mapping": ("TypeError", r"params must be a mapping name -> tensor.*got list"),
    "not_tensor": ("TypeError", r"param 'w' is a list, not a torch\.Tensor"),
    "grad_shape": (
        "ValueError",
        r"reduce_grads on rank {rank}: gradient of 'a\.weight' has shape \(7, 13\) dtype "
        r"torch\.float32, but the param has shape \(13, 7\)",
    ),
    "grad_dtype": ("ValueError", r"gradient of 'a\.bias' .*dtype torch\.float64.*dtype torch\.float32"),
    "grad_unknown": ("KeyError", r"rank {rank}: gradients for params the layout does not know: \['c\.weight'\]"),
    "grad_not_mapping": ("TypeError", r"grads must be a mapping"),
    "reduce_stage3": ("ValueError", r"stage must be 1 or 2, got 3"),
    "reduce_stage0": ("ValueError", r"stage must be 1 or 2, got 0"),
    "reduce_bucket0": ("ValueError", r"bucket_numel must be a positive int.*got 0"),
    "reduce_bucket_negative": ("ValueError", r"bucket_numel must be a positive int.*got -8"),
    "reduce_other_world_size": ("ValueError", r"layout was made for {n1} ranks but the group has {n}"),
    "step_full_grads": (
        "ValueError",
        r"step_shards on rank {rank}: shard of 'a\.weight' has shape \(13, 7\), expected \({shard},\).*"
        r"pass the output of reduce_grads",
    ),
    "step_short_shard": ("ValueError", r"shard of 'a\.bias' has shape \(1,\), expected \({bias_shard},\)"),
    "step_unknown": ("KeyError", r"gradient shard for unknown param 'c\.weight'"),
    "step_norm_type": ("ValueError", r"norm_type must be 2\.0 or math\.inf, got 1\.0"),
    "step_max_norm_zero": ("ValueError", r"max_norm must be a positive finite number or None, got 0\.0"),
    "step_max_norm_nan": ("ValueError", r"max_norm must be a positive finite number or None, got nan"),
    "gather_bucket0": ("ValueError", r"gather_params: bucket_numel must be a positive int.*got 0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_a_clear_error_and_changes_nothing(world, case):
    n = world.world_size
    expected_type, pattern = CASES[case]
    for rank, (type_name, message) in enumerate(world.run(_call, case)):
        assert type_name == expected_type, (rank, type_name, message)
        fields = dict(rank=rank, n=n, n1=n + 1, shard=-(-91 // n), bias_shard=-(-13 // n))
        assert re.search(pattern.format(**fields), message), (rank, message)
