"""One bucket's compressed reduction with error feedback (``zerofn._wire._bucket.launch_compressed``).

The bucket here is one member, every column compressed, so the reduction is a compressed
reduce-scatter of a rank's ``(N * S,)`` gradient (the columns the wire leaves raw are
tested through the stages, tests/test_wire_reduce.py, as are the stages' refusals).

* the telescoping identity of error feedback, exact in float64 on a dyadic grid: over
  ``T`` steps, what was applied sums to the true mean gradients minus the mean of the
  final residuals, with the residuals nonzero;
* on real gloo ranks (N = 1, 2, 3, 4), several steps feeding back the residual equal,
  bitwise, a single-process reference that quantizes the same way and adds in rank order;
  the inputs are not written;
* the bytes: ``bytes_sent`` is what ``count_bytes()`` records, and int8 at block 256 sends
  at most 0.3x what zerofn's byte-optimal fp32 reduce-scatter records for the same shard;
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import reference_world
from helpers import Snapshot, assert_bitwise_equal, seeded

import zerofn as zf
from zerofn._comm import sum_rows
from zerofn._wire._bucket import WirePlan, launch_compressed
from zerofn._wire._quant import KINDS, WireFormat, dequantize, quantize


def compressed_reduce_scatter(
    flat: torch.Tensor, residual: torch.Tensor | None, fmt: WireFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over ranks of this rank's chunk of ``(N * S,)`` float32 ``flat``, with the
    ``((N - 1) * S,)`` residual (``None``: zeros) fed back; returns ``(shard, new_residual)``."""
    n = dist.get_world_size()
    s = flat.numel() // n
    plan = WirePlan(compressed=((0, s),), raw=(), order=((True, 0, s),), c=s, r=0)
    fed = torch.zeros(n - 1, s) if residual is None else residual.view(n - 1, s)
    pending, new_residual = launch_compressed(flat.view(n, s), plan, fmt, fed, None)
    return pending.wait() / n, new_residual.reshape(-1)


def bytes_sent(s: int, n: int, fmt: WireFormat) -> int:
    """What one rank hands to the all-to-all for an ``S``-element shard: codes and scales of ``N - 1`` chunks."""
    return (n - 1) * fmt.nbytes(s)


# --------------------------------------------------------------------------- the telescoping identity


def _qdq(c: torch.Tensor, fmt: WireFormat) -> torch.Tensor:
    """dequantize(quantize(c)) for a float64 ``c`` on the dyadic grid, where float32 is exact."""
    c32 = c.to(torch.float32)
    assert torch.equal(c32.double(), c), "the grid must be exact in float32"
    payload, scales = quantize(c32, fmt)
    return dequantize(payload, scales, fmt).double()


def _error_feedback_reference(grads: torch.Tensor, fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme in float64, one process: ``grads`` is ``(T, N, N, S)`` (step, rank, chunk).

    Returns ``(applied, residuals)``: ``(T, N, S)`` the sum over ranks of what chunk ``j``
    received at each step (own chunk unquantized), and ``(N, N, S)`` the final residuals
    (zero for a rank's own chunk, which never travels).
    """
    steps, n, _, s = grads.shape
    residuals = torch.zeros(n, n, s, dtype=torch.float64)
    applied = torch.zeros(steps, n, s, dtype=torch.float64)
    for t in range(steps):
        for i in range(n):
            for j in range(n):
                if i == j:
                    applied[t, j] += grads[t, i, j]
                    continue
                c = grads[t, i, j] + residuals[i, j]
                sent = _qdq(c, fmt)
                residuals[i, j] = c - sent
                applied[t, j] += sent
    return applied, residuals


def _dyadic_grads(steps: int, n: int, s: int, fmt: WireFormat, seed: int) -> torch.Tensor:
    """``(T, N, N, S)`` float64 gradients on which every quantization step is exact arithmetic.

    Each block has one element pinned at ``+-fmax * 2**k`` (so its scale is exactly
    ``2**k`` and its code exact, residual 0); the others are multiples of ``2**(k-8)`` of
    magnitude at most ``fmax/2 * 2**k``, so ``|g + residual|`` stays below the pin (the
    residual is at most half a code step, below ``fmax/2``) and the scale stays ``2**k``.
    Codes of grid values land on the grid, and every sum stays within float32's 24 bits.
    """
    gen = torch.Generator().manual_seed(seed)
    nb = s // fmt.block
    half = int(fmt.fmax / 2 * 2**8)
    g = torch.randint(-half, half + 1, (steps, n, n, nb, fmt.block), generator=gen).double() * 2.0**-8
    sign = torch.randint(0, 2, (steps, n, n, nb), generator=gen).double() * 2 - 1
    g[..., 0] = sign * fmt.fmax
    k = torch.randint(-3, 4, (n, n, nb), generator=gen).double()  # the same block exponent every step
    return (g * torch.exp2(k).unsqueeze(-1)).reshape(steps, n, n, s)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_error_feedback_telescopes_exactly_on_a_dyadic_grid(kind, n):
    fmt = WireFormat(kind, 8)
    steps, s = 6, 32
    grads = _dyadic_grads(steps, n, s, fmt, seeded(100 + n))
    applied, residuals = _error_feedback_reference(grads, fmt)
    # The premise: every scale is the exact power of two the pin sets, at every step.
    for t in range(steps):
        for i in range(n):
            for j in range(n):
                _, scales = quantize(grads[t, i, j].float(), fmt)
                assert torch.equal(scales.double(), grads[t, i, j].view(-1, 8)[:, 0].abs() / fmt.fmax)
    if n > 1:
        assert residuals.abs().sum() > 0, "the residuals must carry something for the identity to mean anything"
    final = residuals.sum(dim=0)  # (N, S): chunk j's residuals over the ranks that send it
    true_sum = grads.sum(dim=(0, 1))  # (N, S): sum over steps and ranks of chunk j
    assert torch.equal(applied.sum(dim=0), true_sum - final)
    if n & (n - 1) == 0:  # dividing by a power of two is exact too: the identity in means
        assert torch.equal((applied / n).sum(dim=0), true_sum / n - final / n)
    # What one step applied differs from that step's true mean (the identity is not trivial).
    assert n == 1 or not torch.equal(applied[0], grads[0].sum(dim=0))


# --------------------------------------------------------------------------- on real ranks

S_PER_RANK = 37  # two whole blocks of 16 and a partial one of 5
BLOCK = 16


def _grads(step: int, rank: int, n: int, s: int) -> torch.Tensor:
    """Rank ``rank``'s ``(N * S,)`` float32 gradient at ``step``: block magnitudes from 2**-30
    to 2**30, mixed signs, and a zero block in every chunk."""
    gen = torch.Generator().manual_seed(seeded(1000 * step + 10 * rank + n))
    mags = torch.exp2(torch.randint(-30, 31, (n, -(-s // BLOCK)), generator=gen).double())
    mags[:, 1] = 0.0
    g = torch.randn(n, s, generator=gen, dtype=torch.float64) * mags.repeat_interleave(BLOCK, dim=1)[:, :s]
    return g.to(torch.float32).reshape(-1)


def _run_steps(kind: str, steps: int, s: int) -> dict[str, Any]:
    n, rank = dist.get_world_size(), dist.get_rank()
    fmt = WireFormat(kind, BLOCK)
    residual = None
    shards, residuals, counted = [], [], []
    for t in range(steps):
        flat = _grads(t, rank, n, s)
        snap = Snapshot((flat, residual))
        with zf.count_bytes() as counter:
            shard, new_residual = compressed_reduce_scatter(flat, residual, fmt)
        snap.assert_unchanged((flat, residual), f"rank {rank} step {t}")
        assert shard.data_ptr() != flat.data_ptr()
        counted.append((counter.bytes_sent, dict(counter.by_collective)))
        shards.append(shard)
        residuals.append(new_residual)
        residual = new_residual
    return {"shards": shards, "residuals": residuals, "counted": counted}


def _reference_steps(kind: str, steps: int, s: int, n: int) -> dict[str, Any]:
    """Every rank's results in one process, chunk by chunk with the public quantize/dequantize."""
    fmt = WireFormat(kind, BLOCK)
    # residual[i][j]: rank i's, for chunk j; zeros at first, added as the stage adds them.
    residual = [[torch.zeros(s) for _ in range(n)] for _ in range(n)]
    shards = [[] for _ in range(n)]
    residuals = [[] for _ in range(n)]
    for t in range(steps):
        chunks = [_grads(t, i, n, s).view(n, s) for i in range(n)]
        received = [[None] * n for _ in range(n)]  # received[j][i]: what rank j got from rank i
        for i in range(n):
            for j in range(n):
                if i == j:
                    received[j][i] = chunks[i][j]
                    continue
                c = chunks[i][j] + residual[i][j]
                sent = dequantize(*quantize(c, fmt), fmt)
                residual[i][j] = c - sent
                received[j][i] = sent
            residuals[i].append(torch.cat([residual[i][j] for j in range(n) if j != i] or [torch.zeros(0)]))
        for j in range(n):
            total = received[j][0]
            for i in range(1, n):
                total = total + received[j][i]  # rank order, float32, one add at a time
            shards[j].append(total / n)
    return {"shards": shards, "residuals": residuals}


@pytest.mark.numerics
@pytest.mark.parametrize("kind", KINDS)
def test_steps_with_feedback_equal_a_single_process_reference_bitwise(world, kind):
    n, steps = world.world_size, 4
    got = world.run(_run_steps, kind, steps, S_PER_RANK)
    want = reference_world(n).run(_reference_steps, kind, steps, S_PER_RANK, n)[0]
    fmt = WireFormat(kind, BLOCK)
    for rank, res in enumerate(got):
        for t in range(steps):
            assert_bitwise_equal(res["shards"][t], want["shards"][rank][t], f"rank {rank} step {t} shard")
            assert_bitwise_equal(res["residuals"][t], want["residuals"][rank][t], f"rank {rank} step {t} residual")
            assert res["counted"][t][0] == bytes_sent(S_PER_RANK, n, fmt)
        assert n == 1 or res["residuals"][-1].abs().sum() > 0
    # Every rank's shard is its own slice: rank j's result is not rank 0's.
    assert n == 1 or not torch.equal(got[0]["shards"][0], got[1]["shards"][0])


def _bytes_against_fp32(kind: str, block: int, s: int) -> dict[str, Any]:
    n = dist.get_world_size()
    fmt = WireFormat(kind, block)
    flat = torch.randn(n * s, generator=torch.Generator().manual_seed(seeded(dist.get_rank())))
    with zf.count_bytes() as wire:
        compressed_reduce_scatter(flat, None, fmt)
    with zf.count_bytes() as fp32:  # zerofn's byte-optimal fp32 realisation of the same reduction
        sum_rows(flat.view(n, s).clone(), None, "reduce_scatter").wait()
    return {"wire": (wire.bytes_sent, wire.by_collective, wire.calls), "fp32": fp32.bytes_sent}


@pytest.mark.parametrize(("kind", "block", "s"), [("int8", 256, 1000), ("int8", 256, 4096), ("fp8_e4m3", 7, 50)])
def test_bytes_sent_is_what_count_bytes_records_and_int8_is_under_a_third_of_fp32(world, kind, block, s):
    n = world.world_size
    fmt = WireFormat(kind, block)
    want = bytes_sent(s, n, fmt)
    assert want == (n - 1) * (s + 4 * -(-s // block))
    for res in world.run(_bytes_against_fp32, kind, block, s):
        nbytes, by_collective, calls = res["wire"]
        assert nbytes == want
        assert by_collective == ({"all_to_all": want} if n > 1 else {}) and calls == (n > 1)
        assert res["fp32"] == (n - 1) * s * 4  # the byte-optimal fp32 reduce-scatter
        if kind == "int8" and n > 1:
            assert nbytes <= 0.3 * res["fp32"], f"N={n}: {nbytes} / {res['fp32']} = {nbytes / res['fp32']:.3f}"


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("s", [256, 1000, 4096, 2**20])
def test_int8_at_block_256_is_at_most_three_tenths_of_an_fp32_reduce_scatter(n, s):
    ratio = bytes_sent(s, n, WireFormat("int8", 256)) / ((n - 1) * s * 4)
    assert ratio <= 0.3
    assert ratio >= 0.25 + 1 / 256  # codes (1/4 of fp32) plus one fp32 scale per 256 elements


def _empty_shards(kind: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    with zf.count_bytes() as counter:
        shard, residual = compressed_reduce_scatter(torch.zeros(0), None, WireFormat(kind, 8))
    return tuple(shard.shape), tuple(residual.shape), counter.bytes_sent


def test_empty_shards(world):
    for res in world.run(_empty_shards, "int8"):
        assert res == ((0,), (0,), 0)
