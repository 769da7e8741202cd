# %% [markdown]
# # 9. The compressed gradient wire: one byte per element, and nothing lost, only delayed
#
# A ZeRO step reduces every gradient: each rank ends with the mean over ranks of its own
# shard. In float32 a byte-optimal reduce-scatter hands `(N - 1) * S * 4` bytes per rank
# to the network (`S` elements per shard). `zf.CompressedWire()` sends the chunks a rank
# does not own as **int8 codes with one fp32 scale per block of 256 elements**,
# `1 + 4/256` bytes per element, in one `all_to_all_single`; the owner dequantizes and
# adds the `N` chunks in float32 in rank order, its own chunk unquantized.
#
# Quantizing loses something every step. **Error feedback** keeps what was lost (the
# *residual*) and adds it to the same chunk at the next step, so the sum of what was
# sent over `T` steps is the sum of the true gradients less the last residual.
#
# This notebook: one vector quantized and its proven error bound; the residual and the
# telescoping sum on one process; a compressed `reduce_grads` on 2 gloo ranks next to the
# float32 wire on the same gradients; and the curves of the training run in
# `benchmarks/results/cpu-compressed-wire.json`.

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import zerofn as zf
from zerofn._wire._quant import WireFormat, dequantize, error_bound, quantize
from zerofn.testing import World

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})

# %% [markdown]
# ## One vector, quantized
#
# Per block of 256 elements: `scale = absmax / 127`, code `round(x / scale)` in
# `[-127, 127]`, dequantized `code * scale`. Every step is one correctly rounded float32
# operation, so the error has a proven bound per element (`zerofn/_wire/_quant.py`
# derives it): `|x - deq| <= s (1/2 + 2**-24) + 2**-22 |x|`, half a step of the block's
# grid plus a few roundings. A block with one large element has a coarse grid: the bound
# is per block, which is why the blocks are small.

# %%
fmt = WireFormat("int8", 256)
gen = torch.Generator().manual_seed(0)
x = torch.randn(1000, generator=gen) * torch.logspace(-3, 0, 1000)  # magnitudes over 3 decades
codes, scales = quantize(x, fmt)
deq = dequantize(codes, scales, fmt)
err = (x.double() - deq.double()).abs()
bound = error_bound(x, fmt)
print(f"{x.numel()} elements: {codes.numel()} code bytes + {scales.numel()} scales = {fmt.nbytes(x.numel())} bytes")
print(f"(float32: {4 * x.numel()} bytes)")
for b in range(scales.numel()):
    blk = slice(256 * b, 256 * (b + 1))
    print(
        f"block {b}: scale {scales[b]:.2e}, largest error {err[blk].max():.2e}, "
        f"its bound {bound[blk].max():.2e}, largest |x| {x[blk].abs().max():.2e}"
    )
assert bool((err <= bound).all())

# %% [markdown]
# ## The residual, and why the mean survives
#
# One rank, one chunk, `T` steps of a gradient `g_t` with a small mean under larger
# noise. With error feedback the rank sends `c_t = g_t + e_{t-1}` quantized and keeps
# `e_t = c_t - deq(c_t)`, which is exact in float32. Summing `deq(c_t) = c_t - e_t` over
# the steps, the residuals telescope:
#
# `sum_t deq_t = sum_t g_t - e_T` (plus the rounding of each float32 add `g_t + e_{t-1}`).
#
# Without error feedback the losses add up instead: `sum_t deq(g_t) - sum_t g_t` is a sum
# of `T` errors, each up to half a grid step.

# %%
T = 200
torch.manual_seed(1)
mean = 1e-3 * torch.randn(512)
e = torch.zeros(512)
sum_g = torch.zeros(512, dtype=torch.float64)
sum_ef = torch.zeros(512, dtype=torch.float64)
sum_plain = torch.zeros(512, dtype=torch.float64)
rounding = torch.zeros(512, dtype=torch.float64)
drift_ef, drift_plain = [], []
for _ in range(T):
    g = mean + 0.05 * torch.randn(512)
    c = g + e  # one float32 add: the only rounding outside the quantizer
    rounding += 2.0**-24 * c.double().abs()
    d = dequantize(*quantize(c, fmt), fmt)
    e = c - d  # exact
    sum_g += g.double()
    sum_ef += d.double()
    sum_plain += dequantize(*quantize(g, fmt), fmt).double()
    drift_ef.append(float((sum_ef - sum_g).abs().max()))
    drift_plain.append(float((sum_plain - sum_g).abs().max()))

gap = (sum_ef - (sum_g - e.double())).abs()
print(
    f"after {T} steps: largest |sum deq - sum g| with error feedback {drift_ef[-1]:.2e}, without {drift_plain[-1]:.2e}"
)
print(f"largest |e_T| {e.abs().max():.2e}; largest |sum deq - (sum g - e_T)| {gap.max():.2e}")
print(f"(held to the float32 adds' rounding, at most {rounding.max():.2e})")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(drift_plain, label="int8, no error feedback")
ax.plot(drift_ef, label="int8 + error feedback")
ax.set_xlabel("step t")
ax.set_ylabel("largest |sum of what was sent - sum of g|")
ax.set_yscale("log")
ax.legend()
plt.show()
assert bool((gap <= rounding * (1 + 2.0**-20) + 1e-9).all())
assert drift_ef[-1] <= float(e.abs().max()) + float(rounding.max()) + 1e-9

# %% [markdown]
# ## Through zerofn's stages, on 2 gloo ranks
#
# The functional loop with `PrecisionPolicy(wire=zf.CompressedWire())`: `shard_params`
# makes the residual (`state.residual`, one `(N - 1, c)` float32 tensor per bucket, `c` its
# compressed columns), `reduce_grads(..., residual=state.residual)` returns the shards and
# the next residual, and `step_shards(state, shards, residual=...)` keeps it. Matrices of
# at least 4096 elements travel compressed, vectors and small params as float32. Beside
# each compressed reduction each rank also reduces the same gradients over the float32
# wire: the difference is the change of the sender's residual, up to a few float32
# roundings (`tests/test_wire_training.py` derives the bound checked below).


# %%
def compressed_and_fp32(steps):
    rank, n = dist.get_rank(), dist.get_world_size()
    params = {"w": torch.zeros(128, 64), "b": torch.zeros(64)}
    policy = zf.PrecisionPolicy(wire=zf.CompressedWire())
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), precision=policy)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        before = max(float(r.abs().max()) for r in state.residual)
        with zf.count_bytes() as wire_bytes:
            shards, residual = zf.reduce_grads(grads, state.layout, precision=policy, residual=state.residual)
        with zf.count_bytes() as fp32_bytes:
            fp32 = zf.reduce_grads(grads, state.layout)
        state, _ = zf.step_shards(state, shards, residual=residual)
        out.append(
            {
                "diff w": float((shards["w"] - fp32["w"]).abs().max()),
                "diff b": float((shards["b"] - fp32["b"]).abs().max()),
                "E_before": before,
                "E_after": max(float(r.abs().max()) for r in residual),
                "A": max(float(g.abs().max()) for g in grads.values()) / n,
                "bytes": dict(wire_bytes.by_collective),
                "fp32 bytes": dict(fp32_bytes.by_collective),
            }
        )
    numel = sum(s.padded_numel for s in state.layout.params)
    return out, [tuple(r.shape) for r in state.residual], numel


world = World(2)
ranks = world.run(compressed_and_fp32, 4)
world.close()

# %%
steps, residual_shapes, numel = ranks[0]
print(f"residual per bucket: {residual_shapes} float32 (N - 1 = 1 row, the compressed columns of this rank's chunk)")
print(f"wire bytes per step on rank 0: {steps[0]['bytes']}")
print(f"float32 wire on the same grads: {steps[0]['fp32 bytes']}")
print(f"a byte-optimal fp32 reduce-scatter: (N - 1) / N * 4 * {numel} = {2 * numel} bytes")
for t, s in enumerate(steps):
    print(
        f"step {t}: largest |compressed - fp32| w {s['diff w']:.2e} (residual before {s['E_before']:.2e}, "
        f"after {s['E_after']:.2e}), b {s['diff b']:.1e}"
    )

# %% [markdown]
# The bias travels as float32: the same two addends as the float32 wire, the same bits.
# The matrix differs by at most the residual before plus the residual after (and a few
# roundings). Its codes and scales cost `1 + 4/256` bytes per element against float32's 4:
# the all-to-all hands over a little more than a quarter of a byte-optimal float32
# reduce-scatter's bytes (the bias, sent as float32, is the rest), and about an eighth of
# gloo's float32 all-reduce's, which sends twice the reduce-scatter's bytes.

# %% [markdown]
# ## The training run
#
# `python -m benchmarks.compressed_wire --out benchmarks/results/cpu-compressed-wire`:
# the benchmark's byte-level GPT on this Python's standard-library sources, 300 steps at
# N = 2 and 4 gloo ranks, seeds 0 and 1, under the float32 wire, int8 with error
# feedback and int8 without. The curves below are read from its results file.

# %%
result = json.loads((Path("..") / "benchmarks" / "results" / "cpu-compressed-wire.json").read_text())
sizes = sorted({r["world_size"] for r in result["runs"]})
fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.2), squeeze=False)
styles = {"fp32": "-", "int8+ef": "--", "int8": ":"}
for ax, n in zip(axes[0], sizes, strict=True):
    for r in (r for r in result["runs"] if r["world_size"] == n and r["seed"] == 0):
        s, loss = zip(*r["losses"], strict=True)
        ax.plot(s, loss, styles[r["wire"]], label=f"{r['wire']} (train)")
        s, loss = zip(*r["evals"], strict=True)
        ax.plot(s, loss, styles[r["wire"]], marker="o", markersize=3, alpha=0.6, label=f"{r['wire']} (held-out)")
    ax.set_title(f"N = {n}, seed 0")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.legend(fontsize=7)
plt.show()
print(f"{result['params']:,} params, {result['steps']} steps")
for row in result["summary"]:
    print(
        f"N={row['world_size']} seed={row['seed']} {row['wire']:8s} train {row['train']:.4f} "
        f"({100 * row['train_vs_fp32']:+.2f} % vs fp32), held-out {row['held_out']:.4f} "
        f"({100 * row['held_out_vs_fp32']:+.2f} %), bytes {row['bytes_vs_fp32']:.3f}x the fp32 wire's"
    )

# %% [markdown]
# The three wires' curves lie on top of each other. In this run the final losses of
# int8 with or without error feedback are within a few hundredths of a percent of float32's,
# at 0.133x the float32 wire's bytes. 300 steps of a small model say little about long
# runs, where error feedback is what keeps the mean from drifting (the sums above).

# %%
for t in range(len(steps)):
    # The difference on one rank's shard is the other rank's residual change: maxima over both ranks.
    s = {k: max(per_rank[0][t][k] for per_rank in ranks) for k in ("diff w", "diff b", "E_before", "E_after", "A")}
    assert s["diff b"] == 0.0 and s["diff w"] > 0
    assert s["diff w"] <= s["E_before"] + s["E_after"] + 2.0**-21 * (s["A"] + s["E_before"] + s["E_after"])
    assert all(per_rank[0][t]["bytes"]["all_to_all"] <= 0.3 * 2 * numel for per_rank in ranks)
