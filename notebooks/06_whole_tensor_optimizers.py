# %% [markdown]
# # 6. Whole-tensor optimizers: Muon and Adafactor, sharded by owner
#
# ZeRO cuts every parameter into *N* equal flat chunks, one per rank, and each rank
# updates its chunk. That is exact for element-wise optimizers (SGD, Adam, AdamW): the
# update of an element reads only that element. `torch.optim.Muon` is different: it
# orthogonalises each weight matrix as a whole (a Newton-Schulz iteration on G Gᵀ),
# and `torch.optim.Adafactor` keeps one statistic per row and one per column and scales
# every step by the RMS of the whole param. On a chunk they compute something else.
#
# zerofn therefore gives each param a *placement*: **split** (one chunk per rank) or
# **whole** (the param lives entirely on one *owner* rank, where the torch class runs on
# it unchanged). This notebook shows why a chunk is not enough, draws the owner plan,
# trains Muon for the hidden matrices and AdamW for the rest on 2 gloo ranks against DDP,
# and measures the state each rank holds.

# %%
import copy

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call, grad

import zerofn as zf
from zerofn.testing import World

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})

# %% [markdown]
# ## Muon on a chunk is not Muon
#
# One Muon step on an 8 × 6 matrix, whole, and the same step on its two halves of
# 4 rows each (what two ranks would hold if the matrix were split by rows; zerofn's flat
# chunks are worse still: 1-D, which Muon refuses outright).

# %%
torch.manual_seed(0)
w0, g = torch.randn(8, 6), torch.randn(8, 6)


def muon_step(w, g):
    p = nn.Parameter(w.clone())
    p.grad = g.clone()
    torch.optim.Muon([p], lr=0.1, momentum=0.0).step()
    return p.detach()


whole = muon_step(w0, g)
halves = torch.cat([muon_step(w0[:4], g[:4]), muon_step(w0[4:], g[4:])])
print("update on the whole matrix, row 0:", (whole - w0)[0].numpy().round(4))
print("update on two halves,       row 0:", (halves - w0)[0].numpy().round(4))
print(f"max |difference| / max |update| = {((whole - halves).abs().max() / (whole - w0).abs().max()).item():.2f}")
assert not torch.allclose(whole, halves, rtol=1e-2)

# %% [markdown]
# ## The owner plan
#
# The optimizer says which params it needs whole (`Optimizer.placement`); zerofn assigns
# owners largest first to the rank storing the fewest elements so far. It is a pure
# function of names, shapes, dtypes and *N*, so every rank computes the same plan without
# talking, and it is part of the layout's fingerprint. The bars are what each rank
# stores: the split params' chunks (grey) and its whole params (one colour each).

# %%
shapes = {"embed": (64, 16), "head": (16, 64)}
for b in range(3):
    shapes |= {f"blocks.{b}.attn": (16, 48), f"blocks.{b}.proj": (16, 16), f"blocks.{b}.mlp": (16, 64)}
    shapes |= {f"blocks.{b}.bias": (64,), f"blocks.{b}.norm": (16,)}
meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}


def is_hidden(name):
    return name.startswith("blocks.") and len(shapes[name]) == 2


muon_adamw = zf.optim.partition(
    [(is_hidden, zf.torch_optim.from_torch(torch.optim.Muon, lr=0.02)), (lambda n: True, zf.optim.adamw(lr=1e-3))]
)
placement = zf.stages.resolve_placement(meta, muon_adamw)
fig, axes = plt.subplots(1, 2, figsize=(8, 2.6))
for ax, n in zip(axes, (2, 4), strict=True):
    layout = zf.make_layout(meta, n, placement=placement)
    for r in range(n):
        bottom = sum(s.shard_numel for s in layout.params if not s.is_whole)
        ax.bar(r, bottom, color="0.8")
        for i, s in enumerate(s for s in layout.params if s.is_whole and s.owner == r):
            ax.bar(r, s.numel, bottom=bottom, color=f"C{i % 10}", edgecolor="w")
            bottom += s.numel
    ax.axhline(layout.numel / n, color="k", ls=":", lw=1)
    ax.set(title=f"N = {n}", xlabel="rank", ylabel="elements stored", xticks=range(n))
fig.tight_layout()
plt.show()
layout = zf.make_layout(meta, 2, placement=placement)
print("owners at N = 2:", dict(layout.owners))
largest = max(s.numel for s in layout.params if s.is_whole)
for n in (2, 4):
    lay = zf.make_layout(meta, n, placement=placement)
    loads = [lay.stored_numel(r) for r in range(n)]
    print(f"N = {n}: stored per rank {loads}, balanced share {lay.numel / n:.0f}, largest whole param {largest}")
    assert max(loads) <= sum(s.numel + s.padding for s in lay.params) / n + largest  # the documented bound

# %% [markdown]
# ## Muon + AdamW on 2 ranks against DDP
#
# The functional loop is unchanged: `reduce_grads` leaves each owner the full-shape mean
# gradient of its whole params (and every rank its chunk of the split ones), `step_shards`
# runs Muon on the owners' matrices and AdamW on the chunks, with one global norm that
# counts every param once, and `gather_params` rebuilds every param on every rank. The
# reference is `DistributedDataParallel` with a plain `torch.optim.Muon` and
# `torch.optim.AdamW` on the same data.

# %%
STEPS = 10


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def hidden_matrix(name):
    return name == "hidden.weight"


def batch(step):
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def train_both(model):
    opt = zf.optim.partition(
        [
            (hidden_matrix, zf.torch_optim.from_torch(torch.optim.Muon, lr=0.02)),
            (lambda n: True, zf.optim.adamw(lr=1e-2)),
        ]
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = zf.shard_params(params, opt)
    held = {k: tuple(v.shape) for k, v in state.master.items()}

    def loss_fn(p, x, y):
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    for step in range(STEPS):
        shards = zf.reduce_grads(dict(grad(loss_fn)(params, *batch(step))), state.layout)
        state, info = zf.step_shards(state, shards)
        params = zf.gather_params(state)

    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    named = list(ddp.module.named_parameters())
    torch_opts = [
        torch.optim.Muon([p for k, p in named if hidden_matrix(k)], lr=0.02),
        torch.optim.AdamW([p for k, p in named if not hidden_matrix(k)], lr=1e-2),
    ]
    for step in range(STEPS):
        x, y = batch(step)
        for o in torch_opts:
            o.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        for o in torch_opts:
            o.step()
    reference = {k: p.detach().clone() for k, p in named}
    return {"held": held, "zerofn": params, "ddp": reference, "nbytes": state.nbytes, "norm": info.grad_norm}


torch.manual_seed(0)
model = Net()
world = World(2)
results = world.run(train_both, model)
world.close()  # stop the 2 worker processes
for r, got in enumerate(results):
    print(f"rank {r} holds {got['held']}")

# %% [markdown]
# Rank 0 and rank 1 each hold 1-D chunks of the AdamW params; the Muon matrix
# `hidden.weight` is held, in its full shape, by its owner only.
#
# ## Memory per rank
#
# The state a rank holds (master weights plus optimizer state, `ZeroState.nbytes`)
# against the balanced share (the total over ranks, divided by *N*). With whole params a
# rank may hold up to one largest whole param (its master and its state) more than the
# share; in this tiny model that one matrix is a third of all parameters, so the owner
# carries visibly more. In the benchmark transformer (10.5M parameters, the benchmarks page's
# table) the ranks end within 0.4 % of each other.

# %%
share = sum(got["nbytes"] for got in results) / 2
largest_bytes = 2 * 4 * 16 * 16  # hidden.weight: fp32 master + Muon's momentum buffer
for r, got in enumerate(results):
    print(f"rank {r}: {got['nbytes']} state bytes; balanced share {share:.0f}, bound {share + largest_bytes:.0f}")
    assert got["nbytes"] <= share + largest_bytes

# %% [markdown]
# ## The claims, checked
#
# 1. Every rank ends with the same params, and they are bit for bit DDP's with the same
#    torch optimizers: at 2 ranks the mean gradient has DDP's bits (two addends, in either
#    order), and the torch classes run unchanged on what each rank holds.
# 2. Muon's matrix lives on exactly one rank.

# %%
for got in results:
    for k, ref in got["ddp"].items():
        assert torch.equal(got["zerofn"][k], ref), k
    assert got["norm"] == results[0]["norm"]
owners = [r for r, got in enumerate(results) if "hidden.weight" in got["held"]]
assert len(owners) == 1 and results[owners[0]]["held"]["hidden.weight"] == (16, 16)
print(f"bitwise equal to DDP + torch.optim.Muon/AdamW after {STEPS} steps; hidden.weight owned by rank {owners[0]}")
