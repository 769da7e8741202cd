"""Two ranks on one GPU through gloo on CUDA tensors: the multi-rank device paths against DDP.

NCCL refuses two ranks on one device, so the one-GPU machine runs two ranks that share
``cuda:0`` over gloo (which moves CUDA tensors through host copies). That exercises what
one rank cannot: real sums of two ranks' gradients, the rank-major buckets, the gathers
and the asynchronous work handles, all on CUDA tensors.

Reference: ``DistributedDataParallel`` on the same GPU over the same group, with
``torch.optim.AdamW``, the same model and per-rank batches. Tolerances as in the CPU suite
(``tests/test_parity_ddp.py``): bitwise without clipping (at two ranks each element is
``g0 / 2 + g1 / 2`` on both sides, exact scalings and a sum of two addends in either
order), ``max_rel_diff <= 1e-6`` with clipping (float32 against float64 norms). Every rank
ends with the same params.
"""

from __future__ import annotations

import pytest
import torch
from gpucheck import DEVICE, cached_run, requires_device, result
from helpers import assert_trees_close, assert_trees_equal

pytestmark = requires_device

# (stage, overlap, overlap_allgather)
FACADE = [(1, False, False), (1, True, False), (2, False, False), (2, True, False), (2, True, True)]
FACADE_CLIPPED = [(2, True, False)]
FUNCTIONAL = [1, 2]
FUNCTIONAL_CLIPPED = [2]

_cache: dict[str, object] = {}


def _results() -> list[dict]:
    """Per-rank results of every configuration and of DDP, trained once on the shared pool."""
    f32 = torch.float32
    jobs = {("ddp", clip): ("torch", (f32, clip), dict(ddp=True)) for clip in (False, True)}
    for clip, configs in ((False, FACADE), (True, FACADE_CLIPPED)):
        for stage, overlap, ag in configs:
            kwargs = dict(stage=stage, overlap=overlap, overlap_allgather=ag)
            jobs[("facade", stage, overlap, ag, clip)] = ("facade", (f32, clip), kwargs)
    for clip, stages in ((False, FUNCTIONAL), (True, FUNCTIONAL_CLIPPED)):
        for stage in stages:
            jobs[("functional", stage, clip)] = ("functional", (f32, clip), dict(stage=stage))
    return cached_run(_cache, "shared2", jobs)


def _assert_matches_ddp(key: tuple, clip: bool) -> None:
    per_rank = _results()
    for results in per_rank:
        got, ref = result(results, key), result(results, ("ddp", clip))
        first = result(per_rank[0], key)
        assert_trees_equal(got["params"], first["params"])  # the same on every rank
        if clip:
            assert_trees_close(got["params"], ref["params"], rel=1e-6)
        else:
            assert_trees_equal(got["params"], ref["params"])
        assert_trees_equal(got["master"], first["master"])


CASES = [(cfg, False) for cfg in FACADE] + [(cfg, True) for cfg in FACADE_CLIPPED]


@pytest.mark.parametrize(("cfg", "clip"), CASES, ids=[f"stage{c[0]}-overlap{c[1]}-ag{c[2]}-clip{k}" for c, k in CASES])
def test_facade_on_two_ranks_sharing_the_gpu_matches_ddp(cfg, clip):
    _assert_matches_ddp(("facade", *cfg, clip), clip)
    device = "cuda:0" if DEVICE == "cuda" else "cpu"
    for results in _results():
        got = result(results, ("facade", *cfg, clip))
        assert got["param_devices"] == [device] and got["state_devices"] == [device]


FN_CASES = [(s, False) for s in FUNCTIONAL] + [(s, True) for s in FUNCTIONAL_CLIPPED]


@pytest.mark.parametrize(("stage", "clip"), FN_CASES, ids=[f"stage{s}-clip{k}" for s, k in FN_CASES])
def test_functional_loop_on_two_ranks_sharing_the_gpu_matches_ddp(stage, clip):
    _assert_matches_ddp(("functional", stage, clip), clip)


def test_ddp_reference_trained_and_ranks_saw_different_data():
    # Not vacuous: DDP moved the params from the start, and clipping changed the outcome.
    from gpucheck import base_model

    results = _results()[0]
    start = {n: p.detach() for n, p in base_model().named_parameters()}
    clipped = result(results, ("ddp", True))
    for n, p in result(results, ("ddp", False))["params"].items():
        unused = n.startswith("unused.")
        assert torch.equal(p, start[n]) == unused, n
        assert torch.equal(clipped["params"][n], p) == unused, n
