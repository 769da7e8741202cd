# %% [markdown]
# # 5. Checkpoints: save at 2 ranks, resume at 3
#
# Every rank holds only its chunk of the master weights and optimizer state, so a
# checkpoint is naturally written by all ranks together, each its own chunk. The catch is
# resuming at another world size: rank $r$ of 3 owns different elements than rank $r$ of
# 2 did. zerofn's checkpoints are therefore *world-size free*: each chunk is saved as a
# piece of the unpadded, flattened parameter (a DTensor with `Shard(0)` placement,
# written by `torch.distributed.checkpoint`), and at load time each new rank reads
# exactly the pieces that overlap the elements it now owns.
#
# This notebook shows the resharding in plain Python, trains on 2 gloo ranks and saves,
# loads the checkpoint on 3 ranks, keeps training, and checks that the result equals a
# run that never stopped.

# %%
import os
import random
import shutil
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerofn as zf
from zerofn.testing import World

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})

# %% [markdown]
# ## Resharding in plain Python
#
# Take one parameter of 10 elements. At $N = 2$ rank 0 owns elements 0-4 and rank 1 owns
# 5-9. At $N = 3$ each rank owns 4 (with 2 elements of padding on rank 2). Resharding is
# "unshard with the old $N$, shard with the new one"; the loader does the same without
# ever building the full tensor, by reading only the overlapping ranges.


# %%
def shard(t, n, r):
    flat = t.reshape(-1)
    s = -(-flat.numel() // n)
    return torch.cat([flat, flat.new_zeros(n * s - flat.numel())])[r * s : (r + 1) * s]


def reshard(shards, numel, new_n):
    full = torch.cat(shards)[:numel]  # unshard (drop the old padding)
    return [shard(full, new_n, r) for r in range(new_n)]


w = torch.arange(10.0)
old = [shard(w, 2, r) for r in range(2)]
new = reshard(old, w.numel(), 3)
print("saved by 2 ranks:", [t.tolist() for t in old])
print("loaded by 3 ranks:", [t.tolist() for t in new])
old_spec, new_spec = zf.make_layout({"w": w}, 2)["w"], zf.make_layout({"w": w}, 3)["w"]
for r in range(3):
    a, b = new_spec.owned_range(r)
    reads = [
        f"{list(range(max(a, lo), min(b, hi)))} from old rank {q}'s file"
        for q in range(2)
        for lo, hi in [old_spec.owned_range(q)]
        if max(a, lo) < min(b, hi)
    ]
    print(f"new rank {r} owns elements [{a}, {b}) and reads " + " and ".join(reads))
    assert torch.equal(new[r], shard(w, 3, r))

# %% [markdown]
# ## Train on 2 ranks, save, and keep going
#
# Each step uses a global batch of 96 samples, split evenly over the ranks (48 each at
# $N = 2$, 32 each at $N = 3$), so every world size computes the mean gradient of the
# same 96 samples. At step 20 the ranks save: `zf.checkpoint.save(path, state, params=...)`
# writes every rank's shards and the model weights, checksums every file, and commits by
# atomically pointing the symlink `path` at the new directory.
#
# Because a `ZeroState` is an immutable value, the same function then simply keeps
# training from the state it just saved: that is the run that never stopped.
#
# The save also carries the rest of the training state: `extra={"progress": progress}`
# takes any object with `state_dict()` / `load_state_dict()` (an LR scheduler, a data
# loader, this counter), and every rank's random generators (torch, Python's `random`,
# NumPy's) are saved by default. Here every rank seeds them alike, as a run that draws the
# same noise on every rank would.

# %%
GLOBAL_BATCH, SAVE_AT, STEPS = 96, 20, 40

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
)


def batch(step):
    """This rank's part of the global batch of `step`."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True))
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    mine = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    return x[mine], y[mine]


def train(state, params, start, stop):
    """Steps start..stop-1 of the functional loop (notebook 3); returns the new state, params and losses."""

    def loss_fn(p, x, y):
        loss = F.mse_loss(torch.func.functional_call(model, p, (x,)), y)
        return loss, loss.detach()

    losses = []
    for step in range(start, stop):
        grads, loss = torch.func.grad(loss_fn, has_aux=True)(params, *batch(step))
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))
        params = zf.gather_params(state)
        loss = loss.clone()
        dist.all_reduce(loss)  # the loss of the whole global batch: the mean over ranks
        losses.append(loss.item() / dist.get_world_size())
    return state, params, losses


class Progress:
    """The user's own state: steps and samples done (the same on every rank)."""

    def __init__(self):
        self.steps, self.samples = 0, 0

    def state_dict(self):
        return {"steps": self.steps, "samples": self.samples}

    def load_state_dict(self, state):
        self.steps, self.samples = state["steps"], state["samples"]


def seed_everything(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def first_run(model, path):
    seed_everything(1234)  # alike on every rank
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    state, params, losses = train(state, params, 0, SAVE_AT)
    progress = Progress()
    progress.steps, progress.samples = SAVE_AT, SAVE_AT * GLOBAL_BATCH
    zf.checkpoint.save(path, state, params=params, extra={"progress": progress})  # and the RNG
    noise = torch.rand(3)  # the next draw after the save
    saved = zf.checkpoint.full_state_dict(state)  # the whole state, gathered: for the check at the end
    _, final, more = train(state, params, SAVE_AT, STEPS)  # the run that never stopped
    shapes = {k: tuple(v.shape) for k, v in state.master.items()}
    return {"shapes": shapes, "saved": saved, "losses": losses + more, "final": final, "noise": noise}


ckpt_dir = tempfile.mkdtemp(prefix="zerofn-nb05-")
path = os.path.join(ckpt_dir, "ckpt")
world = World(2)
before = world.run(first_run, model, path)
world.close()  # stop the 2 worker processes

for r, got in enumerate(before):
    print(f"rank {r} of 2 saved master shards of shape {got['shapes']}")
target = os.path.realpath(path)
token = os.path.basename(target).removeprefix("ckpt.")
print(f"\nckpt -> ckpt.<token>/   (a symlink; the token is {len(token)} random hex digits, new at every save)")
for name in sorted(os.listdir(target)):
    print(f"  {name:14s} {os.path.getsize(os.path.join(target, name)):>7,} B")

# %% [markdown]
# Two `.distcp` files, one per saving rank (the model weights are the same on every rank,
# so DCP writes them once, in one of the files), DCP's `.metadata` (which element ranges
# each file holds), one `extras.<rank>.pt` per rank (its extras and RNG states), and
# `zerofn.json`: the names, shapes and dtypes, the optimizer and its hyperparameters, the
# step count, the loss-scale state, which extras were the same on every rank, and every
# file's size and SHA-256, which `load` verifies before reading a tensor.
#
# ## Resume on 3 ranks
#
# A fresh `World(3)`: three new processes that know nothing but the model's shapes.
# `zf.checkpoint.load` builds the 3-rank layout, reads the overlapping pieces, and fills
# the model weights in place (`params_out`); the optimizer and its hyperparameters come
# from the checkpoint. `extra=` names the saved extras: `progress` was the same on every
# rank, so it restores at any world size, and so do the generators, seeded alike (seeded
# per rank, they would restore only at 2 ranks: see the guide "Resuming anywhere").


# %%
def resume(model, path):
    like = {k: v.detach() for k, v in model.named_parameters()}  # names, shapes, dtypes
    params = {k: torch.full_like(v, float("nan")) for k, v in like.items()}  # overwritten by the load
    seed_everything(dist.get_rank())  # whatever this process drew before: the load replaces it
    progress = Progress()
    state = zf.checkpoint.load(path, like, params_out=params, extra={"progress": progress})
    noise = torch.rand(3)  # the next draw after the load
    loaded = zf.checkpoint.full_state_dict(state)
    shapes = {k: tuple(v.shape) for k, v in state.master.items()}
    state, final, losses = train(state, params, SAVE_AT, STEPS)
    return {
        "shapes": shapes,
        "loaded": loaded,
        "losses": losses,
        "final": final,
        "step": state.step,
        "progress": progress.state_dict(),
        "noise": noise,
    }


world = World(3)
after = world.run(resume, model, path)
world.close()  # stop the 3 worker processes
shutil.rmtree(ckpt_dir)

for r, got in enumerate(after):
    print(f"rank {r} of 3 loaded master shards of shape {got['shapes']}, trained on to step {got['step']}")

never_stopped = before[0]["losses"]
resumed = before[0]["losses"][:SAVE_AT] + after[0]["losses"]
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.plot(never_stopped, lw=4, color="0.8", label="2 ranks, never stopped")
ax.plot(range(SAVE_AT, STEPS), after[0]["losses"], color="C3", label="saved at 2 ranks, resumed at 3")
ax.axvline(SAVE_AT - 0.5, color="k", ls=":", lw=1)
ax.set(xlabel="step", ylabel="loss (global batch)")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The claims, checked
#
# 1. Nothing is lost: the state loaded at 3 ranks, gathered into the world-size-free
#    full state dict (`torch.optim.AdamW`'s format plus zerofn's master weights), is bit
#    for bit the state saved at 2 ranks.
#    The extras and the generators are the ones saved: the next random draw on each of the 3
#    ranks is the draw that followed the save.
# 2. Training on from it gives the run that never stopped: the same losses and params, to
#    float32 rounding. Not bitwise, and for a reason that has nothing to do with the
#    checkpoint: at 3 ranks the mean gradient is summed from 3 partial sums instead of 2,
#    and floating-point addition is not associative.


# %%
def hyperparams(state_dict):
    # zerofn.json stores betas as a JSON list; compare values, not tuple-vs-list.
    return [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in state_dict["param_groups"]]


def assert_same_state(saved, loaded):
    assert hyperparams(saved) == hyperparams(loaded)
    assert saved["zerofn"]["step"] == loaded["zerofn"]["step"] == SAVE_AT
    for name, master in saved["zerofn"]["master"].items():
        assert torch.equal(master, loaded["zerofn"]["master"][name]), name
    assert saved["state"].keys() == loaded["state"].keys()
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, loaded["state"][index][key]), (index, key)


for got in after:
    assert_same_state(before[0]["saved"], got["loaded"])
    assert got["progress"] == {"steps": SAVE_AT, "samples": SAVE_AT * GLOBAL_BATCH}
    assert torch.equal(got["noise"], before[0]["noise"])  # the draw after the load is the draw after the save
print("progress restored on 3 ranks:", after[0]["progress"], "; next draw", after[0]["noise"].tolist())
for got in after[1:]:
    assert all(torch.equal(got["final"][k], after[0]["final"][k]) for k in got["final"])  # ranks agree

final_2, final_3 = before[0]["final"], after[0]["final"]
diff = max(((final_3[k] - final_2[k]).abs().max() / final_2[k].abs().max()).item() for k in final_2)
print(f"resumed at 3 vs never stopped at 2: max relative param difference {diff:.1e} after {STEPS} steps")
for k in final_2:
    torch.testing.assert_close(final_3[k], final_2[k], rtol=1e-5, atol=1e-6)
torch.testing.assert_close(torch.tensor(resumed), torch.tensor(never_stopped), rtol=1e-5, atol=1e-6)
