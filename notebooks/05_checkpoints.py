# %% [markdown]
# # 5. Checkpoints: save at 2 ranks, resume at 3
#
# Every rank holds only its chunk of the master weights and optimizer state, so a
# checkpoint is naturally written by all ranks together, each its own chunk. The catch is
# resuming at another world size: rank *r* of 3 owns different elements than rank *r* of
# 2 did. zerofn's checkpoints are therefore *world-size free*: each chunk is saved as a
# piece of the unpadded, flattened parameter (a DTensor with `Shard(0)` placement,
# written by `torch.distributed.checkpoint`), and at load time each new rank reads
# exactly the pieces that overlap the elements it now owns.
#
# This notebook shows the resharding in plain Python, trains on 2 gloo ranks and saves,
# loads the checkpoint on 3 ranks, keeps training, and checks that the result equals a
# run that never stopped. Then it kills a rank of a run that reads a data set, resumes on 3
# ranks, and checks that the data stream and the loss curve go on where they stopped.

# %%
import json
import os
import random
import shutil
import signal
import tempfile
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchdata.stateful_dataloader import StatefulDataLoader

import zerofn as zf
from zerofn.data import GlobalBatchSampler
from zerofn.testing import World, WorldError

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})

# %% [markdown]
# ## Resharding in plain Python
#
# Take one parameter of 10 elements. At N = 2 rank 0 owns elements 0-4 and rank 1 owns
# 5-9. At N = 3 each rank owns 4 (with 2 elements of padding on rank 2). Resharding is
# "unshard with the old *N*, shard with the new one"; the loader does the same without
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
# N = 2, 32 each at N = 3), so every world size computes the mean gradient of the
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
world2 = World(2)
before = world2.run(first_run, model, path)  # (its processes are used again in the last section)

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


world3 = World(3)
after = world3.run(resume, model, path)  # (its processes are used again in the last section)
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

# %% [markdown]
# ## Killed, and resumed at another world size, on the same data stream
#
# The batches above are a function of the step. A real run reads a data set through a
# `DataLoader`, and where it is in the data set is state too. `zerofn.data.GlobalBatchSampler`
# makes that position world-size free: epoch *e* is one seeded permutation of the data set,
# global step *s* is its slice [sB, (s+1)B) at every world size, and rank *r* of *N* takes
# the *r*-th of *N* contiguous parts. Its state is the position (epoch, step), the same on
# every rank; in torchdata's `StatefulDataLoader` it travels in `extra={"loader": loader}`
# with the rest of the checkpoint.
#
# Two ranks train with the facade and save every 5 steps. After step 13, rank 1 is
# SIGKILLed: a crash, nothing flushed, nothing saved. Three ranks (the processes of the
# section above, which keep nothing of this run) then resume from the newest *committed*
# checkpoint, step 10, and train to step 24. Every rank writes the
# samples and the loss of each step to a log, which is all that survives of the killed run.

# %%
DATA_LEN, DATA_BATCH, EVERY, KILL_AT, END = 120, 24, 5, 13, 24  # 5 steps per epoch; 24 = 12 x 2 = 8 x 3


def committed(run_dir):
    """The committed checkpoints (symlinks step-NNN -> step-NNN.<token>/), oldest first."""
    return sorted(os.path.join(run_dir, n) for n in os.listdir(run_dir) if os.path.islink(os.path.join(run_dir, n)))


def run(run_dir, kill_at=None):
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
    g = torch.Generator().manual_seed(7)  # the data set: the same on every rank
    x = torch.randn(DATA_LEN, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.sin(x[:, :4].sum(dim=1, keepdim=True)), torch.arange(DATA_LEN))
    sampler = GlobalBatchSampler(DATA_LEN, DATA_BATCH, seed=0)  # this rank's part of each global batch
    loader = StatefulDataLoader(data, batch_sampler=sampler, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = zf.ZeroOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), module=net)
    progress = Progress()
    extra = {"loader": loader, "progress": progress}
    if committed(run_dir):
        opt.load_checkpoint(committed(run_dir)[-1], extra=extra)  # weights, shards, data position, counter
    world, rank = dist.get_world_size(), dist.get_rank()
    with open(os.path.join(run_dir, f"log-{world}-{rank}.jsonl"), "a") as log:
        while progress.steps < END:
            for xb, yb, index in loader:  # the rest of the current epoch
                loss = F.mse_loss(net(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
                progress.steps, progress.samples = progress.steps + 1, progress.samples + DATA_BATCH
                mean = loss.detach().clone()
                dist.all_reduce(mean)  # the loss of the global batch
                line = {"step": progress.steps, "samples": index.tolist(), "loss": mean.item() / world}
                log.write(json.dumps(line) + "\n")
                log.flush()
                if progress.steps % EVERY == 0:
                    opt.save_checkpoint(os.path.join(run_dir, f"step-{progress.steps:03d}"), extra=extra)
                if progress.steps == kill_at and rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                if progress.steps == END:
                    break


run_dir = tempfile.mkdtemp(prefix="zerofn-nb05-run-")
try:
    world2.run(run, run_dir, KILL_AT)
except WorldError as e:  # after a death the pool stops its processes
    print(f"2 ranks: rank 1 {e.failures[1].message}; rank 0 {e.failures[0].type_name} (its peer is gone)")
newest = os.path.basename(committed(run_dir)[-1])
world3.run(run, run_dir)
world3.close()  # stop the 3 worker processes


def read_log(world_size):
    """step -> (the global batch: the ranks' samples in rank order, the loss)."""
    ranks = []
    for r in range(world_size):
        with open(os.path.join(run_dir, f"log-{world_size}-{r}.jsonl")) as f:
            ranks.append({e["step"]: e for e in map(json.loads, f)})
    steps = sorted(set.intersection(*(set(rank) for rank in ranks)))
    return {s: ([i for rank in ranks for i in rank[s]["samples"]], ranks[0][s]["loss"]) for s in steps}


two, three = read_log(2), read_log(3)
shutil.rmtree(run_dir)
print(f"2 ranks trained steps {min(two)}-{max(two)}; newest committed checkpoint: {newest}")
print(f"3 ranks resumed from it and trained steps {min(three)}-{max(three)}")
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.plot(list(two), [loss for _, loss in two.values()], lw=4, color="0.75", label="2 ranks, killed after step 13")
ax.plot(list(three), [loss for _, loss in three.values()], color="C3", label="3 ranks, resumed from step 10")
ax.axvline(10.5, color="k", ls=":", lw=1)
ax.set(xlabel="step", ylabel="loss (global batch)")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The stream, checked
#
# 1. The 3 ranks started on exactly the next sample: their global batch at step *s* (their
#    three parts, in rank order) is the sampler's global step *s*, the same the 2 ranks
#    trained on. Steps 11 to 13, done by the killed run after its last checkpoint, were
#    done again on the same samples; no sample was skipped or seen twice in any epoch.
# 2. The loss curve continues: on the redone steps the 3 ranks' losses are the 2 ranks',
#    to float32 rounding (3 partial sums instead of 2, as above). Each point is the loss of
#    that step's own 24 samples, so the curve jumps from batch to batch.

# %%
stream = GlobalBatchSampler(DATA_LEN, DATA_BATCH, seed=0, rank=0, world_size=1)  # the definition, at one rank
for log in (two, three):
    for s, (samples, _) in log.items():
        assert samples == stream.global_batch_indices(*divmod(s - 1, stream.steps_per_epoch)), s
assert newest == "step-010" and min(three) == 11 and max(two) == KILL_AT and max(three) == END
effective = {**{s: b for s, (b, _) in two.items() if s <= 10}, **{s: b for s, (b, _) in three.items()}}
for epoch in range(END // stream.steps_per_epoch):
    seen = [i for s in range(epoch * 5 + 1, epoch * 5 + 6) for i in effective[s]]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 5 * DATA_BATCH  # each sample once
redone = range(11, KILL_AT + 1)
torch.testing.assert_close(
    torch.tensor([three[s][1] for s in redone]), torch.tensor([two[s][1] for s in redone]), rtol=1e-5, atol=1e-6
)
print("steps 11-13 at 3 ranks: the samples and (to rounding) the losses of the killed 2-rank run")
