# %% [markdown]
# # 4. Mixed precision: loss scaling and the wire dtype
#
# float16 halves the bytes of params, gradients and communication, but it has only 5
# exponent bits: values above 65504 become `inf`, and gradients below about 6 ·
# 10⁻⁸ become 0. *Loss scaling* multiplies the loss by a scale *s* before backward,
# so every gradient is *s* times larger and clears the underflow; the optimizer divides
# by *s* again. If *s* is too large, some gradient overflows to `inf`: the step is
# skipped on **every** rank and *s* shrinks. After a run of good steps *s* grows again.
# That rule is a small state machine, and zerofn keeps it pure: `scaler.update(state,
# found_overflow) -> state`, with the overflow flag agreed by all ranks in one
# all-reduce inside `step_shards`.
#
# This notebook writes the rule in plain Python and checks zerofn's scaler against it,
# trains in float16 on 2 gloo ranks with overflows injected on one rank and plots the
# scale, measures what the communication dtype does to bytes and to the error of the
# mean gradient, and checks the float16 run against an unsharded float32 reference.

# %%
import copy
import math

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerofn as zf
from zerofn.testing import World

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})


# %% [markdown]
# ## The dynamic loss scaler in plain Python
#
# State (s, g, h): the scale, good steps since the last growth or overflow, and the
# hysteresis countdown. An overflow resets *g* and counts *h* down; the overflow that
# finds h ≤ 1 halves *s*. `growth_interval` good steps in a row double *s* and
# refill *h*.


# %%
def reference_update(scale, good, left, overflow, *, interval, hysteresis, factor=2.0):
    if overflow:
        return (scale / factor if left <= 1 else scale), 0, max(left - 1, 0)
    if good + 1 == interval:
        return scale * factor, 0, hysteresis
    return scale, good + 1, left


scaler = zf.DynamicLossScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
pattern = [False, False, False, True, False, True, True, False, False, False, True]
ours, ref = scaler.init(), tuple(scaler.init())
print(f"start        {ours}")
for overflow in pattern:
    ours = scaler.update(ours, overflow)
    ref = reference_update(*ref, overflow, interval=3, hysteresis=2)
    print(f"overflow={overflow!s:5}  {ours}")
    assert tuple(ours) == ref

# %% [markdown]
# The first overflow at step 3 is absorbed by hysteresis; the next two halve the scale
# (hysteresis is refilled only when the scale *grows*).
#
# ## float16 training on 2 gloo ranks, with injected overflows
#
# The policy `PrecisionPolicy.for_dtype(torch.float16)` says: float16 working params
# and gradients, float32 master shards and optimizer state, a dynamic loss scaler. The
# loop is notebook 3's, plus `zf.scale_loss` before backward. At a few steps one rank
# replaces one element of its local gradient with `inf`, as a real overflow would. Only
# that rank sees it; `step_shards` all-reduces the flag with the gradient norm, so both
# ranks skip and both back off. The scale also finds its own ceiling: once it is large
# enough, the scaled loss itself overflows float16.

# %%
POLICY = zf.PrecisionPolicy.for_dtype(
    torch.float16, loss_scaler=zf.DynamicLossScaler(initial_scale=2.0**15, growth_interval=8, hysteresis=2)
)
INJECT = {1: {20, 21, 40}, 0: {55}}  # rank -> steps where that rank's gradient gets an inf
STEPS = 70

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 8, generator=g)
    return x, torch.sin(x[:, :4].sum(dim=1, keepdim=True))


def train_fp16(model, steps, inject):
    rank = dist.get_rank()
    params = {k: v.detach().half() for k, v in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=POLICY)
    history = []
    for step in range(steps):
        x, y = (t.half() for t in batch(rank, step))
        scale = state.loss_scale  # the scale these gradients will carry

        def scaled_loss(p, x=x, y=y, scale=scale):
            loss = F.mse_loss(torch.func.functional_call(model, p, (x,)), y)
            return zf.scale_loss(loss, scale), loss.detach()

        grads, loss = torch.func.grad(scaled_loss, has_aux=True)(params)
        if step in inject.get(rank, ()):
            w = grads["2.weight"].clone()
            w[0, 0] = math.inf
            grads = {**grads, "2.weight": w}
        local_overflow = not all(bool(torch.isfinite(g).all()) for g in grads.values())
        gshards = zf.reduce_grads(grads, state.layout, precision=state.precision)
        state, info = zf.step_shards(state, gshards)
        params = zf.gather_params(state)
        history.append(
            {"scale": scale.scale, "local_overflow": local_overflow, "skipped": info.skipped, "loss": loss.item()}
        )
    return history, params, state.step


world = World(2)
(h0, params0, taken0), (h1, params1, taken1) = world.run(train_fp16, model, STEPS, INJECT)

for step in (18, 19, 20, 21, 22, 40, 41):
    a, b = h0[step], h1[step]
    print(
        f"step {step}: scale {a['scale']:>6.0f} | inf in local grads: rank 0 {a['local_overflow']!s:5} "
        f"rank 1 {b['local_overflow']!s:5} | skipped: rank 0 {a['skipped']!s:5} rank 1 {b['skipped']!s:5} "
        f"| next scale {h0[step + 1]['scale']:>6.0f} on both"
    )
print(f"steps taken: rank 0 {taken0}, rank 1 {taken1} of {STEPS}")

# %% [markdown]
# Rank 0 saw no `inf` at steps 20, 21 and 40 and skipped all the same. At 18 and 19 the
# scaled loss itself overflowed (a real overflow, on both ranks): the first was absorbed
# by hysteresis, the second halved the scale. Hysteresis is refilled only when the scale
# grows, so the injected overflows at 20 and 21 halve it at once; at 40, after a growth,
# the overflow is absorbed and only the step is skipped. Both ranks kept identical
# scales throughout, and the plain-Python scaler replayed on the agreed flags gives the
# same trajectory.

# %%
skipped = [e["skipped"] for e in h0]
assert skipped == [e["skipped"] for e in h1] and [e["scale"] for e in h0] == [e["scale"] for e in h1]
assert all(skipped[s] for steps in INJECT.values() for s in steps)  # every injected overflow skipped the step
state = (2.0**15, 0, 2)
for step, flag in enumerate(skipped):
    assert h0[step]["scale"] == state[0], step
    state = reference_update(*state, flag, interval=8, hysteresis=2)
assert taken0 == taken1 == STEPS - sum(skipped)

injected = sorted(s for steps in INJECT.values() for s in steps)
natural = [s for s in range(STEPS) if skipped[s] and s not in injected]
fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(9, 2.8))
ax_s.step(range(STEPS), [math.log2(e["scale"]) for e in h0], where="post", color="C0")
ax_s.plot(injected, [math.log2(h0[s]["scale"]) for s in injected], "x", color="C3", ms=8, label="injected inf")
ax_s.plot(natural, [math.log2(h0[s]["scale"]) for s in natural], "o", mfc="none", color="C1", label="real overflow")
ax_s.set(xlabel="step", ylabel="log2(loss scale)", title="loss scale on both ranks (skipped steps marked)")
ax_s.legend(fontsize=8)
ax_l.plot([(a["loss"] + b["loss"]) / 2 for a, b in zip(h0, h1, strict=True)], color="C2")
ax_l.set(xlabel="step", ylabel="loss (fp16, mean over ranks)", title="training goes on")
fig.tight_layout()
plt.show()


# %% [markdown]
# ## What the communication dtype does: bytes and error
#
# `reduce_grads(..., comm_dtype=...)` casts the gradients to the wire dtype (after
# multiplying by 1/N, so the sum cannot overflow), reduces, and casts back. Half the
# bytes for float16 or bfloat16 on the wire; the price is rounding, twice (the cast and
# the sum), each at most the unit roundoff *u* relative: 2⁻¹¹ for float16 (11
# significant bits), 2⁻⁸ for bfloat16 (8 bits, but float32's range), 2⁻²⁴ for
# float32. Here float32 gradients, each rank's local ones, against the exact mean
# computed in float64 in this process.


# %%
def reduce_with_wire_dtypes(model):
    x, y = batch(dist.get_rank(), 0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    grads = torch.func.grad(lambda p: F.mse_loss(torch.func.functional_call(model, p, (x,)), y))(params)
    layout = zf.make_layout(params, dist.get_world_size())
    out = {}
    for wire in (torch.float32, torch.bfloat16, torch.float16):
        with zf.count_bytes() as sent:
            shards = zf.reduce_grads(grads, layout, comm_dtype=wire)
        out[wire] = (sent.by_collective, dict(shards))
    return dict(grads), out


ranks = world.run(reduce_with_wire_dtypes, model)
world.close()  # stop the worker processes

layout = zf.make_layout(dict(model.named_parameters()), 2)
exact = {k: (ranks[0][0][k].double() + ranks[1][0][k].double()) / 2 for k in layout.names}
scale = max(v.abs().max().item() for v in exact.values())
wire_report = {}
for wire in (torch.float32, torch.bfloat16, torch.float16):
    worst = 0.0
    for r, (_, out) in enumerate(ranks):
        for k in layout.names:
            start, stop = layout[k].owned_range(r)
            err = out[wire][1][k][: stop - start].double() - exact[k].reshape(-1)[start:stop]
            worst = max(worst, err.abs().max().item() / scale if err.numel() else 0.0)
    sent = ranks[0][1][wire][0]
    wire_report[wire] = (sent["all_to_all"], worst)  # gloo's reduce: an all-to-all
    name = str(wire).removeprefix("torch.")
    print(f"wire {name:9s} reduce bytes/rank {sent['all_to_all']:>7,}   max error / max |mean grad| {worst:.1e}")

fig, (ax_b, ax_e) = plt.subplots(1, 2, figsize=(7, 2.2))
names = [str(w).removeprefix("torch.") for w in wire_report]
ax_b.barh(names, [b for b, _ in wire_report.values()], color="C0")
ax_b.set(xlabel="bytes sent per rank (reduce)")
ax_e.barh(names, [e for _, e in wire_report.values()], color="C3")
ax_e.plot([2 * 2.0**-24, 2 * 2.0**-8, 2 * 2.0**-11], names, "k|", ms=14, label="2u")
ax_e.set(xscale="log", xlabel="max error / max |mean gradient|")
ax_e.legend(fontsize=8, loc="lower right")
fig.tight_layout()
plt.show()


# %% [markdown]
# ## The claims, checked
#
# 1. A 16-bit wire sends exactly half the bytes of float32, and the error of every wire
#    dtype stays within its two roundings, 2u relative to the largest mean gradient.
# 2. The float16 run, overflows and all, follows an unsharded float32 reference: one
#    process, the two ranks' batches together, `torch.optim.AdamW`, skipping the steps
#    the float16 run skipped. They differ by float16 rounding only.

# %%
bytes32 = wire_report[torch.float32][0]
assert wire_report[torch.bfloat16][0] * 2 == bytes32 == wire_report[torch.float16][0] * 2
unit_roundoff = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}
for wire, (_, err) in wire_report.items():
    assert err <= 2 * unit_roundoff[wire], (wire, err)

reference = copy.deepcopy(model)  # float32, the same initial weights
torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
ref_losses = []
for step in range(STEPS):
    x = torch.cat([batch(r, step)[0] for r in range(2)])
    y = torch.cat([batch(r, step)[1] for r in range(2)])
    loss = F.mse_loss(reference(x), y)
    ref_losses.append(loss.item())
    if skipped[step]:
        continue  # the float16 run skipped this step on every rank
    torch_opt.zero_grad()
    loss.backward()
    torch_opt.step()
fp16_losses = [(a["loss"] + b["loss"]) / 2 for a, b in zip(h0, h1, strict=True)]
worst_loss = max(abs(a - b) / b for a, b in zip(fp16_losses, ref_losses, strict=True) if math.isfinite(a))
worst_param = max(
    ((params0[k].double() - p.detach().double()).abs().max() / p.detach().abs().max()).item()
    for k, p in reference.named_parameters()
)
print(f"float16 ZeRO vs float32 unsharded: loss within {worst_loss:.1e} (relative), params within {worst_param:.1e}")
assert all(torch.equal(params0[k], params1[k]) for k in params0)  # both ranks hold the same params
assert worst_loss < 1e-2 and worst_param < 1e-2
