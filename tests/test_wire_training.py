"""The compressed wire in training, small: the benchmark's byte-level GPT for 25 steps on 2 gloo ranks.

``benchmarks/compressed_wire.py`` trains its model (137,216 params) for 300 steps under the
float32 wire and int8 with and without error feedback; here the same model, corpus and
batches run 25 steps of ``CompressedWire()`` (int8, block 256, error feedback), and at every
step each rank also reduces *the same* local gradients over the float32 wire. Pairing the
two reductions of one gradient is what makes the check exact rather than sampled: the
difference between the compressed mean and the float32 mean is, up to a few float32
roundings, the change of the senders' residuals (derivation in
:func:`test_the_compressed_mean_drifts_from_the_fp32_mean_by_no_more_than_the_last_residual`),
so over the run the differences telescope to the final residual. No tolerance is fitted to
a run. The bytes each rank hands to the reduction per step are held to 0.3x those of a
byte-optimal float32 reduce-scatter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import get_world

import zerofn as zf

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import compressed_wire as cw  # noqa: E402

STEPS = 25
U = 2.0**-24  # float32's unit roundoff


def _train(steps: int) -> dict[str, object]:
    """The benchmark's loop (seed 0) over ``CompressedWire()``, with a float32 reduction of the same grads beside it."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data, _ = cw.corpus()
    train = data[: int(len(data) * 0.9)]
    torch.manual_seed(0)
    model = cw.TinyGPT()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    policy = zf.PrecisionPolicy(wire=zf.CompressedWire())
    state = zf.shard_params(params, zf.optim.adamw(lr=cw.LR), precision=policy)

    def loss_fn(p, x, y):
        loss = F.cross_entropy(torch.func.functional_call(model, p, (x,)).flatten(0, 1), y.flatten())
        return loss, loss.detach()

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    gen = torch.Generator().manual_seed(rank)  # the benchmark's stream at seed 0
    drift = None  # sum over steps of (compressed mean - fp32 mean), float64, this rank's shard
    per_step, sent, fp32_sent, losses = [], [], [], []
    for _ in range(steps):
        x, y = cw._windows(train, torch.randint(0, len(train) - cw.CONTEXT - 1, (cw.BATCH,), generator=gen))
        grads, loss = grad_fn(params, x, y)
        before = max(float(r.abs().max()) for r in state.residual if r.numel())
        with zf.count_bytes() as counter:
            shards, residual = zf.reduce_grads(grads, state.layout, precision=policy, residual=state.residual)
        with zf.count_bytes() as fp32_counter:
            fp32 = zf.reduce_grads(grads, state.layout)
        d = torch.cat([shards[k].double().reshape(-1) - fp32[k].double().reshape(-1) for k in sorted(shards)])
        drift = d if drift is None else drift + d
        per_step.append(
            {
                "A": max(float(g.abs().max()) for g in grads.values()) / n,  # largest |g / N| on this rank
                "E_before": before,
                "E_after": max(float(r.abs().max()) for r in residual if r.numel()),
                "D": float(d.abs().max()),  # this step's largest |compressed - fp32| on this rank's shard
            }
        )
        sent.append(counter.bytes_sent)
        fp32_sent.append(fp32_counter.bytes_sent)
        losses.append(float(loss))
        state, info = zf.step_shards(state, shards, residual=residual)
        assert not info.skipped and all(a is b for a, b in zip(state.residual, residual, strict=True))
        params = zf.gather_params(state)
    return {
        "drift": float(drift.abs().max()),
        "final_residual": max(float(r.abs().max()) for r in state.residual if r.numel()),
        "steps": per_step,
        "sent": sent,
        "fp32_sent": fp32_sent,
        "reduce_scatter": (n - 1) * 4 * sum(s.padded_numel for s in state.layout.params) // n,
        "losses": losses,
    }


def test_the_compressed_mean_drifts_from_the_fp32_mean_by_no_more_than_the_last_residual():
    """Over 25 steps the compressed means sum to the float32 means of the same gradients, less the final residual.

    At N = 2, for an element of rank j's shard that travels compressed, with ``x = g / 2``
    the sender's packed gradient (exact), ``e`` its residual before the step and ``e'`` after,
    ``own`` the owner's own packed element, ``u = 2**-24``:

    * the sender quantizes ``c = fl(x + e) = x + e + r1``, ``|r1| <= u |x + e|``;
    * it keeps ``e' = c - deq`` (exact in float32: zerofn._wire._quant), so ``deq = c - e'``;
    * the owner adds ``comp = fl(own + deq) = own + deq + r2``, ``|r2| <= u |own + deq|``;
    * the float32 wire gives ``fp = fl(own + x) = own + x + r3``, ``|r3| <= u |own + x|``.

    So ``comp - fp = e - e' + r1 + r2 - r3``. With ``A`` the largest ``|g / 2|`` on either
    rank and ``E``, ``E'`` the largest residual before and after on either rank,
    ``|r1 + r2 - r3| <= u (5A + 2E + E') + O(u**2) <= 2**-21 (A + E + E')`` (``8u = 2**-21``).
    Elements that travel as float32 give ``comp = fp`` (one add of the same two addends).
    Summed over the steps, the residuals telescope (``e_0 = 0``)::

        |sum_t (comp_t - fp_t)| <= E_T + sum_t 2**-21 (A_t + E_{t-1} + E_t)

    plus the float64 roundings of the test's own sum (``2**-45 sum_t D_t`` covers them for
    T <= 256, ``D_t`` the step's largest difference) and ``2**-140`` a step for a halving
    ``g / 2`` that lands among float32's subnormals. Per step, the same argument bounds
    ``D_t <= E_{t-1} + E_t + 2**-21 (A_t + E_{t-1} + E_t)``. Without error feedback the sum
    would grow with T; with it, the mean is only delayed, which is what this checks.
    """
    ranks = get_world(2).run(_train, STEPS)
    steps = [{k: max(r["steps"][t][k] for r in ranks) for k in ("A", "E_before", "E_after", "D")} for t in range(STEPS)]
    rounding = sum(2.0**-21 * (s["A"] + s["E_before"] + s["E_after"]) + 2.0**-140 for s in steps)
    for t, s in enumerate(steps):
        assert (
            s["D"] <= s["E_before"] + s["E_after"] + 2.0**-21 * (s["A"] + s["E_before"] + s["E_after"]) + 2.0**-140
        ), (
            t,
            s,
        )
    final = max(r["final_residual"] for r in ranks)
    bound = final + rounding + 2.0**-45 * sum(s["D"] for s in steps)
    drift = max(r["drift"] for r in ranks)
    assert drift <= bound, (drift, bound)
    # Not vacuous: the wire did lose something every step, and the sum of the per-step
    # differences is far above what the telescoped sum is held to.
    assert all(s["D"] > 0 and s["E_after"] > 0 for s in steps)
    assert sum(s["D"] for s in steps) > 2 * bound
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank on its own batches


def test_the_compressed_run_sends_under_three_tenths_of_a_byte_optimal_fp32_reduce_scatter():
    """``zf.count_bytes()`` around each step's ``reduce_grads``: every byte of it (the all-to-all of codes, scales
    and the float32 columns, and the rank-agreement check) at most 0.3x ``(N - 1) / N * 4`` bytes per padded
    param element, what a byte-optimal float32 reduce-scatter sends; the same every step."""
    for r in get_world(2).run(_train, 3):
        assert len(set(r["sent"])) == 1 and 0 < r["sent"][0] <= 0.3 * r["reduce_scatter"], r
        assert r["sent"][0] < 0.3 * r["fp32_sent"][0]  # gloo's float32 wire (an all-reduce) sends more still
