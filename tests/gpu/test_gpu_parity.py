"""One GPU, one rank, NCCL: the facade and the functional loop against single-GPU torch.optim.

Every configuration trains ``helpers.Net`` (padded params, layer drop, a never-used layer)
for ``STEPS`` steps with AdamW from the same start on the same batches, and is compared
with plain ``torch.optim.AdamW`` on the same GPU (no zerofn, no DDP):

* the facade (``zf.ZeroOptimizer``): stage 1 and 2, overlap on and off, overlap_allgather,
  fp32 and bf16 (``forced_dtype``: bf16 forward and backward, fp32 masters), clipping;
* the functional loop (``reduce_grads`` -> ``step_shards`` -> ``gather_params``): stage 1
  and 2, fp32 and bf16 params with fp32 master shards, clipping.

Tolerances:

* without clipping, bitwise. At one rank there is no sum and the 1/N factor is 1; the
  optimizer kernels are torch's own (the same ``foreach``/``fused`` choice on the same
  device) and element-wise, so a flat shard gets the bits the param-shaped tensor gets;
  the bf16 reference updates fp32 copies of the bf16 params with the gradients cast to
  fp32 and rounds them back, which is what fp32 masters do.
* with clipping, fp32: ``max_rel_diff <= 1e-6``; bf16: elementwise ``rtol = atol = 4e-3``
  on the params and ``rtol 4e-3, atol 1e-3`` on the masters. torch computes the total
  norm and the clip coefficient in float32, zerofn the norm in float64, so the coefficient
  may differ in its last bit: every gradient scaled by the same factor within an ulp of
  the other side's, which AdamW's scale-free update does not amplify, and bf16 rounds it on.
"""

from __future__ import annotations

import pytest
import torch
from gpucheck import DEVICE, cached_run, requires_device, result
from helpers import assert_trees_close, assert_trees_equal

pytestmark = requires_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_TOL = {"params": (4e-3, 4e-3), "master": (4e-3, 1e-3)}  # (rtol, atol)

# (dtype, stage, overlap, overlap_allgather)
FACADE = [
    ("fp32", 1, False, False),
    ("fp32", 1, True, False),
    ("fp32", 2, False, False),
    ("fp32", 2, True, False),
    ("fp32", 2, True, True),
    ("bf16", 1, False, False),
    ("bf16", 2, True, False),
    ("bf16", 2, True, True),
]
FACADE_CLIPPED = [("fp32", 1, False, False), ("fp32", 2, True, True), ("bf16", 2, True, False)]
FUNCTIONAL = [("fp32", 1), ("fp32", 2), ("bf16", 2)]
FUNCTIONAL_CLIPPED = [("fp32", 2), ("bf16", 1)]


def _facade_key(cfg: tuple, clip: bool) -> str:
    dtype, stage, overlap, ag = cfg
    return f"facade {dtype} stage{stage}{' overlap' if overlap else ''}{' overlap_allgather' if ag else ''}" + (
        " clip" if clip else ""
    )


def _functional_key(cfg: tuple, clip: bool) -> str:
    return f"functional {cfg[0]} stage{cfg[1]}" + (" clip" if clip else "")


def _jobs() -> dict[str, tuple[str, tuple, dict]]:
    jobs: dict[str, tuple[str, tuple, dict]] = {}
    for name, dtype in DTYPES.items():
        for clip in (False, True):
            jobs[f"torch {name}" + (" clip" if clip else "")] = ("torch", (dtype, clip), {})
    for clip, configs in ((False, FACADE), (True, FACADE_CLIPPED)):
        for cfg in configs:
            dtype, stage, overlap, ag = cfg
            kwargs = dict(stage=stage, overlap=overlap, overlap_allgather=ag)
            jobs[_facade_key(cfg, clip)] = ("facade", (DTYPES[dtype], clip), kwargs)
    for clip, configs in ((False, FUNCTIONAL), (True, FUNCTIONAL_CLIPPED)):
        for cfg in configs:
            jobs[_functional_key(cfg, clip)] = ("functional", (DTYPES[cfg[0]], clip), dict(stage=cfg[1]))
    return jobs


_cache: dict[str, object] = {}


def _results() -> dict:
    """Every configuration and reference, trained once per session on the one-rank NCCL pool."""
    return cached_run(_cache, "nccl1", _jobs())[0]


def _assert_matches_torch(got: dict, dtype: str, clip: bool, what: str) -> None:
    ref = result(_results(), f"torch {dtype}" + (" clip" if clip else ""))
    for part in ("params", "master"):
        if not clip:
            assert_trees_equal(got[part], ref[part])
        elif dtype == "fp32":
            assert_trees_close(got[part], ref[part], rel=1e-6)
        else:
            rtol, atol = BF16_TOL[part]
            assert list(got[part]) == list(ref[part])
            for name, expected in ref[part].items():
                label = f"{what} {part} {name}"
                torch.testing.assert_close(
                    got[part][name], expected, rtol=rtol, atol=atol, msg=lambda m, label=label: f"{label}: {m}"
                )


def test_the_reference_trains_every_used_param_on_the_device():
    # Not vacuous: the reference moved every param that gets gradients, and only those,
    # and clipping changed the outcome.
    from gpucheck import base_model

    results = _results()
    for name, dtype in DTYPES.items():
        ref, clipped = result(results, f"torch {name}"), result(results, f"torch {name} clip")
        start = {n: p.detach().to(dtype) for n, p in base_model().named_parameters()}
        assert list(ref["params"]) == list(start)
        for n, p in ref["params"].items():
            unused = n.startswith("unused.")
            assert torch.equal(p, start[n]) == unused, (name, n)
            assert torch.equal(clipped["params"][n], p) == unused, (name, n)


FACADE_CASES = [(cfg, False) for cfg in FACADE] + [(cfg, True) for cfg in FACADE_CLIPPED]
FUNCTIONAL_CASES = [(cfg, False) for cfg in FUNCTIONAL] + [(cfg, True) for cfg in FUNCTIONAL_CLIPPED]


@pytest.mark.parametrize(("cfg", "clip"), FACADE_CASES, ids=[_facade_key(*c).replace(" ", "-") for c in FACADE_CASES])
def test_facade_matches_single_gpu_torch_optim(cfg, clip):
    key = _facade_key(cfg, clip)
    got = result(_results(), key)
    _assert_matches_torch(got, cfg[0], clip, key)
    expected_device = "cuda:0" if DEVICE == "cuda" else "cpu"
    assert got["param_devices"] == [expected_device] and got["state_devices"] == [expected_device], key


@pytest.mark.parametrize(
    ("cfg", "clip"), FUNCTIONAL_CASES, ids=[_functional_key(*c).replace(" ", "-") for c in FUNCTIONAL_CASES]
)
def test_functional_loop_matches_single_gpu_torch_optim(cfg, clip):
    key = _functional_key(cfg, clip)
    _assert_matches_torch(result(_results(), key), cfg[0], clip, key)
