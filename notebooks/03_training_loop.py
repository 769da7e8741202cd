# %% [markdown]
# # 3. The training loop, and what it saves
#
# One ZeRO step is four pure functions (each returns new values and changes nothing it
# is given):
#
# ```
# params --shard_params--> state                  once, no communication
# grads  --reduce_grads--> grad shards            mean over ranks, only this rank's chunk
# state, grad shards --step_shards--> state       the optimizer, on this rank's chunk only
# state  --gather_params--> params                full params again, equal on every rank
# ```
#
# Why is this exact, and not an approximation of data-parallel training? Because AdamW
# (like SGD and Adam) is *element-wise*: element *i* of the new params depends only on
# element *i* of the params, the gradient and the optimizer state. So *N* ranks can each
# update their own chunk and concatenate. This notebook shows that in plain Python,
# trains a model with the functional loop on 2 real gloo ranks next to DDP (the same
# loss curve, the same params), and measures the memory per rank of DDP, ZeRO stage 1
# and stage 2 at N = 1, 2, 4 against the formula from the ZeRO paper.

# %%
import copy

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofn as zf
from zerofn.testing import World

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch at `step`: a fixed smooth target, different samples on every rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 8, generator=g)
    return x, torch.sin(x[:, :4].sum(dim=1, keepdim=True))


def loss_fn(params, x, y):
    loss = F.mse_loss(torch.func.functional_call(model, params, (x,)), y)
    return loss, loss.detach()  # (what to differentiate, what to report)


grad_fn = torch.func.grad(loss_fn, has_aux=True)  # -> (dict of grads shaped like params, loss)


# %% [markdown]
# ## One ZeRO step in plain Python
#
# Two simulated ranks in this process, the reference collectives of notebook 2 written
# inline, and zerofn's functional AdamW (`zf.optim.adamw`: pure `init` / `update`, no
# process group needed). The sharded step must equal one AdamW step on the full tensors.


# %%
def chunk(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Notebook 1's rule: chunk r of t flattened and zero-padded to a multiple of n."""
    flat = t.reshape(-1)
    s = -(-flat.numel() // n)
    return torch.cat([flat, flat.new_zeros(n * s - flat.numel())])[r * s : (r + 1) * s]


def reference_zero_step(params, local_grads, opt, opt_states):
    """One ZeRO step over len(local_grads) simulated ranks; returns new full params and states."""
    n = len(local_grads)
    mean = {k: sum(g[k] for g in local_grads) / n for k in params}  # reduce (every rank needs its chunk)
    shards = []
    for r in range(n):  # each rank: AdamW on its own chunk only
        p_r = {k: chunk(v, n, r) for k, v in params.items()}
        g_r = {k: chunk(v, n, r) for k, v in mean.items()}
        p_r, opt_states[r] = opt.update(g_r, opt_states[r], p_r)
        shards.append(p_r)
    full = {k: torch.cat([s[k] for s in shards])[: v.numel()].reshape(v.shape) for k, v in params.items()}  # gather
    return full, opt_states


opt = zf.optim.adamw(lr=1e-2)
params0 = {k: v.detach() for k, v in model.named_parameters()}
local_grads = [grad_fn(params0, *batch(r, 0))[0] for r in range(2)]
opt_states = [opt.init({k: chunk(v, 2, r) for k, v in params0.items()}) for r in range(2)]
sharded, _ = reference_zero_step(params0, local_grads, opt, opt_states)

mean = {k: (local_grads[0][k] + local_grads[1][k]) / 2 for k in params0}
unsharded, _ = opt.update(mean, opt.init(params0), params0)  # one process, full tensors
for k in params0:
    assert torch.equal(sharded[k], unsharded[k]), k
print("2 simulated ranks, each updating half of every tensor == one AdamW step on the full tensors (bitwise)")

# %% [markdown]
# ## The functional loop on 2 real gloo ranks, next to DDP
#
# Every rank runs the function below. It trains with zerofn's four functions, then
# trains a fresh copy of the same model with `DistributedDataParallel` +
# `torch.optim.AdamW` on exactly the same per-rank batches, and returns both.


# %%
def train_both(model, steps):
    rank = dist.get_rank()
    params = {k: v.detach() for k, v in model.named_parameters()}  # the same on every rank
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))  # this rank's 1/N of master + AdamW state
    before = {k: tuple(v.shape) for k, v in state.master.items()}
    zero_losses = []
    for step in range(steps):
        grads, loss = grad_fn(params, *batch(rank, step))  # local, full
        gshards = zf.reduce_grads(grads, state.layout, stage=2)  # mean over ranks, this rank's chunk
        state, _ = zf.step_shards(state, gshards)  # AdamW on this rank's chunk (and a StepInfo)
        params = zf.gather_params(state)  # full, equal on every rank
        zero_losses.append(loss.item())

    ddp_model = copy.deepcopy(model)
    ddp = DDP(ddp_model)
    torch_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2)
    ddp_losses = []
    for step in range(steps):
        x, y = batch(rank, step)
        loss = F.mse_loss(ddp(x), y)
        torch_opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here
        torch_opt.step()  # every rank updates every element
        ddp_losses.append(loss.item())
    ddp_params = {k: v.detach() for k, v in ddp_model.named_parameters()}
    return {
        "shard shapes": before,
        "master norm": {k: round(v.norm().item(), 4) for k, v in state.master.items()},
        "zero": (zero_losses, params),
        "ddp": (ddp_losses, ddp_params),
        "state bytes": state.nbytes,
        "ddp optimizer bytes": sum(t.numel() * t.element_size() for s in torch_opt.state.values() for t in s.values()),
    }


STEPS = 60
world = World(2)
ranks = world.run(train_both, model, STEPS)
world.close()  # stop the worker processes; the memory section below starts 4 new ones

for r, got in enumerate(ranks):
    print(f"--- rank {r}")
    print("  holds shards of shape     ", got["shard shapes"])
    print("  after training, |master|: ", got["master norm"])
    print(f"  optimizer state           {got['state bytes']:,} B (DDP: {got['ddp optimizer bytes']:,} B on every rank)")
    print(f"  loss step 0 -> {STEPS - 1}:        {got['zero'][0][0]:.4f} -> {got['zero'][0][-1]:.4f}")

# The loss of the whole step is the mean over ranks (equal batch sizes).
zero_curve = [sum(rk["zero"][0][s] for rk in ranks) / 2 for s in range(STEPS)]
ddp_curve = [sum(rk["ddp"][0][s] for rk in ranks) / 2 for s in range(STEPS)]

# %% [markdown]
# Each rank holds a different half of every tensor (the master norms differ), yet both
# end with the same full params. Next: how much memory that saves.
#
# ## Memory per rank: DDP, stage 1, stage 2 at N = 1, 2, 4
#
# The ZeRO paper counts three kinds of *model state* per rank, with Ψ parameters.
# Here everything is float32 and the optimizer is AdamW:
#
# | | params | gradients | optimizer state | total |
# |---|---|---|---|---|
# | DDP | 4Ψ | 4Ψ | 8Ψ (two moments; the params are the fp32 weights) | 16Ψ |
# | stage 1 | 4Ψ | 4Ψ | 12Ψ/N (fp32 master + two moments, sharded) | 8Ψ + 12Ψ/N |
# | stage 2 | 4Ψ | 4Ψ/N | 12Ψ/N | 4Ψ + 16Ψ/N |
#
# zerofn keeps a float32 master copy even for float32 params (what mixed precision needs),
# so at N = 1 stage 1 holds *more* than DDP; the saving grows with *N*.
#
# Stage 2's gradient saving needs the gradients reduced *while backward runs*, bucket by
# bucket, so the full gradients never exist at once. The functional loop above cannot do
# that (`torch.func.grad` returns all gradients together), so we measure with
# `zf.ZeroOptimizer`, the stateful facade over the same four functions, which reduces
# from gradient hooks. Measured on rank 0 of a group of *N* ranks (one `World(4)`, with
# groups of its first 1, 2 and 4 ranks), on a deeper model with an 8192-element bucket:
#
# * params: the bytes of the model's parameters;
# * gradients: the *peak* of `ZeroOptimizer.grad_bytes()` (local gradients not yet
#   reduced, buckets in flight, reduced shards), sampled each time a gradient lands;
#   for DDP the bytes of `p.grad` (with `gradient_as_bucket_view=True`, so DDP's buckets
#   are those same bytes);
# * optimizer state: `ZeroState.nbytes` (master + AdamW shards), and for DDP the tensors
#   in `torch.optim.AdamW.state`.

# %%
BUCKET = 8192  # elements per reduce bucket: one 64x64 layer (and its bias) per bucket

torch.manual_seed(0)
deep = torch.nn.Sequential(
    *[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())], torch.nn.Linear(64, 1)
)
PSI = sum(p.numel() for p in deep.parameters())


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_on_this_rank(n, model):
    """Bytes of params, peak gradients and optimizer state on this rank, in a group of the first n ranks."""
    group = dist.new_group(list(range(n)))  # every rank calls new_group, members or not
    if dist.get_rank() >= n:
        return None
    torch.manual_seed(dist.get_rank())
    x, y = torch.randn(16, 64), torch.randn(16, 1)
    out = {}

    m = copy.deepcopy(model)
    ddp = DDP(m, process_group=group, gradient_as_bucket_view=True)
    torch_opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    F.mse_loss(ddp(x), y).backward()
    torch_opt.step()
    opt_state = [t for s in torch_opt.state.values() for t in s.values()]
    out["DDP"] = (nbytes(m.parameters()), nbytes(p.grad for p in m.parameters()), nbytes(opt_state))

    for stage in (1, 2):
        m = copy.deepcopy(model)
        peak, zopt = [0], []

        def sample(_param, peak=peak, zopt=zopt):
            peak[0] = max(peak[0], zopt[0].grad_bytes())

        # Registered before the facade's own hooks, so each sample sees the gradient that just landed.
        hooks = [p.register_post_accumulate_grad_hook(sample) for p in m.parameters()]
        zopt.append(
            zf.ZeroOptimizer(
                m.named_parameters(),
                zf.optim.adamw(lr=1e-3),
                partition_grad=stage == 2,
                reduce_bucket_size=BUCKET,
                dp_process_group=group,
            )
        )
        zopt[0].backward(F.mse_loss(m(x), y))
        peak[0] = max(peak[0], zopt[0].grad_bytes())
        zopt[0].step()
        out[f"stage {stage}"] = (nbytes(m.parameters()), peak[0], zopt[0].state.nbytes)
        for h in hooks:
            h.remove()
        zopt[0].close()
    dist.destroy_process_group(group)
    return out


world = World(4)
measured = {n: world.run(memory_on_this_rank, n, deep)[0] for n in (1, 2, 4)}
world.close()  # stop the worker processes


def formula(kind: str, n: int) -> tuple[float, float, float]:
    """The ZeRO paper's bytes per rank (params, gradients, optimizer state), float32 + AdamW."""
    return {
        "DDP": (4 * PSI, 4 * PSI, 8 * PSI),
        "stage 1": (4 * PSI, 4 * PSI, 12 * PSI / n),
        "stage 2": (4 * PSI, 4 * PSI / n, 12 * PSI / n),
    }[kind]


print(f"Ψ = {PSI:,} parameters; bytes per rank, measured (formula)")
print(f"{'':10s}{'params':>20s}{'gradients':>20s}{'optimizer':>20s}{'total':>22s}")
for n, kinds in measured.items():
    for kind, got in kinds.items():
        want = formula(kind, n)
        cells = "".join(f"{g:>10,} ({w:>7,.0f})" for g, w in zip(got, want, strict=True))
        print(f"N={n} {kind:7s}{cells}{sum(got):>11,} ({sum(want):>8,.0f})")

# %% [markdown]
# ## The picture
#
# Left: the loss of the functional ZeRO loop and of DDP on the same batches (the curves
# lie on top of each other). Right: memory per rank, stacked by kind; the black ticks are
# the formula.

# %% tags=["readme-figure"]
kinds = ("DDP", "stage 1", "stage 2")
parts = ("params", "gradients", "optimizer state")
colors = ("#9bb7d4", "#f4b183", "#a9d18e")
fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [1, 1.4]})
ax_loss.plot(ddp_curve, lw=4, color="0.8", label="DDP + torch.optim.AdamW")
ax_loss.plot(zero_curve, lw=1.2, color="C3", label="zerofn stage 2 (functional loop)")
ax_loss.set(xlabel="step", ylabel="loss (mean over 2 ranks)", title="2 gloo ranks: the same loss curve")
ax_loss.legend(fontsize=8)
for i, n in enumerate((1, 2, 4)):
    for j, kind in enumerate(kinds):
        x = i * 4 + j
        bottom = 0
        for value, color in zip(measured[n][kind], colors, strict=True):
            ax_mem.bar(x, value / 1024, bottom=bottom / 1024, color=color, width=0.85)
            bottom += value
        ax_mem.plot([x - 0.42, x + 0.42], [sum(formula(kind, n)) / 1024] * 2, color="k", lw=1.5)
ax_mem.set_xticks([i * 4 + j for i in range(3) for j in range(3)], ["DDP", "stage\n1", "stage\n2"] * 3, fontsize=7)
for i, n in enumerate((1, 2, 4)):
    ax_mem.text(i * 4 + 1, -0.2, f"N = {n}", transform=ax_mem.get_xaxis_transform(), ha="center")
ax_mem.set(ylabel="KiB per rank", title=f"memory per rank (Ψ = {PSI:,}, fp32, AdamW)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors] + [plt.Line2D([], [], color="k")]
ax_mem.legend(handles, [*parts, "formula"], fontsize=8, ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The claims, checked
#
# 1. On 2 ranks the functional ZeRO loop and DDP + `torch.optim.AdamW` produce the same
#    losses and the same params, bit for bit (at 2 ranks the mean gradient is added in
#    the same order; at 3 or more the order differs and they agree to rounding).
# 2. Params and optimizer state per rank are the formula (up to AdamW's per-parameter
#    `step` counters, 4 bytes each, and the padding); gradients are the formula for DDP
#    and stage 1, and for stage 2 the formula plus at most one bucket of local gradients
#    waiting to be reduced.

# %%
for r, got in enumerate(ranks):
    zero_losses, zero_params = got["zero"]
    ddp_losses, ddp_params = got["ddp"]
    assert zero_losses == ddp_losses, f"rank {r}: losses differ"
    for k in ddp_params:
        assert torch.equal(zero_params[k], ddp_params[k]), f"rank {r}: {k} differs from DDP"
assert zero_curve[-1] < 0.5 * zero_curve[0]  # and it did learn

n_params = len(list(deep.parameters()))
for n, kinds_measured in measured.items():
    for kind, (params_b, grads_b, opt_b) in kinds_measured.items():
        want_params, want_grads, want_opt = formula(kind, n)
        padding = 4 * 3 * (n - 1) * n_params  # at most n-1 zeros per param, in master + 2 moments
        assert params_b == want_params
        assert want_opt <= opt_b - 4 * n_params <= want_opt + padding, (n, kind)  # minus the step counters
        one_bucket = 4 * BUCKET if kind == "stage 2" else 0
        assert want_grads <= grads_b <= want_grads + one_bucket + 4 * (n - 1) * n_params, (n, kind)
print("ZeRO == DDP bitwise on 2 ranks; measured memory == formula (stage 2 gradients: + at most one bucket)")
