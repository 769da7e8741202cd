"""CPU offload with CUDA params: the state on the CPU, the model on the GPU, the same training.

``ZeroOptimizer(cpu_offload=True)`` keeps every master shard and optimizer-state tensor on
the CPU while the params and gradients stay on the GPU: each step the gradient shards go
to the host and the updated shards come back, through pinned (page-locked) host buffers
without blocking. Checked at one rank over NCCL, for both stages, overlap and
overlap_allgather, fp32 and bf16, against the same training without offload:

* where everything lives: params on the GPU, every master and optimizer-state tensor on
  the CPU (on the GPU without offload);
* the result: with offload the update runs torch's CPU AdamW kernel instead of its CUDA kernel, and
  the two need not agree in the last bit (FMA contraction, division and square-root
  rounding on the GPU), so the fp32 masters and params are compared with the CPU suite's
  fp32 bound, ``max_rel_diff <= 1e-6``; bf16 params are the masters rounded to bf16, where
  a last-bit difference of a master can move one bf16 rounding: ``<= 2^-7``;
* the copies use pinned host memory: the offloaded run takes pinned blocks from torch's
  caching host allocator, the non-offloaded one takes fewer (CUDA only).
"""

from __future__ import annotations

import pytest
import torch
from gpucheck import DEVICE, cached_run, needs_cuda, requires_device, result
from helpers import assert_trees_close

pytestmark = requires_device

# (dtype, stage, overlap, overlap_allgather)
CONFIGS = [
    (torch.float32, 1, False, False),
    (torch.float32, 2, True, False),
    (torch.float32, 2, True, True),
    (torch.bfloat16, 2, True, False),
]

_cache: dict[str, object] = {}


def _results() -> dict:
    """Every configuration with and without offload, trained once on the one-rank NCCL pool."""
    jobs = {}
    for cfg in CONFIGS:
        dtype, stage, overlap, ag = cfg
        for offload in (False, True):
            kwargs = dict(stage=stage, overlap=overlap, overlap_allgather=ag, cpu_offload=offload)
            jobs[(cfg, offload)] = ("facade", (dtype, False), kwargs)
    return cached_run(_cache, "nccl1", jobs)[0]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-stage{c[1]}-overlap{c[2]}-ag{c[3]}")
def test_offloaded_training_keeps_the_state_on_the_cpu_and_matches_the_gpu_state(cfg):
    results = _results()
    on, off = result(results, (cfg, True)), result(results, (cfg, False))
    device = "cuda:0" if DEVICE == "cuda" else "cpu"
    assert on["param_devices"] == [device] and off["param_devices"] == [device]
    assert on["state_devices"] == ["cpu"] and off["state_devices"] == [device]
    assert_trees_close(on["master"], off["master"], rel=1e-6)
    # bf16 params are the masters rounded: a last-bit difference of a master can move
    # one bf16 rounding (2^-8 relative).
    assert_trees_close(on["params"], off["params"], rel=1e-6 if cfg[0] == torch.float32 else 2.0**-7)


@needs_cuda("pinned host memory")
def test_offload_copies_go_through_pinned_host_memory():
    results = _results()
    for cfg in CONFIGS:
        on, off = result(results, (cfg, True)), result(results, (cfg, False))
        assert on["pinned_requests"] is not None, (
            f"torch {torch.__version__} exposes no pinned-request counter in torch.cuda.host_memory_stats()"
        )
        assert on["pinned_requests"] > off["pinned_requests"], (cfg, on["pinned_requests"], off["pinned_requests"])
