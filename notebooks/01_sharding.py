# %% [markdown]
# # 1. Sharding: who owns which element
#
# Data-parallel training keeps a full copy of the model on every one of the *N* ranks,
# and with it a full copy of the optimizer state: for AdamW with float32 master weights
# that is 12 bytes per parameter on *every* rank. ZeRO's first idea is that this state
# does not need to be replicated: each rank keeps and updates only 1/N of it, and the
# ranks exchange what they need.
#
# That needs a rule for who owns which element. zerofn uses the simplest one
# ("shard evenly"):
#
# 1. flatten each parameter to 1-D,
# 2. zero-pad it at the end to a multiple of *N*,
# 3. cut it into *N* equal chunks: rank *r* owns chunk *r* **of every parameter**.
#
# So every rank holds `ceil(numel / N)` elements of each parameter, and padding (between
# 0 and N − 1 zeros) sits in the last ranks' chunks. This notebook writes the rule in
# plain Python, compares it with what zerofn computes, draws it for N = 1 … 4, then
# shards and gathers real tensors on 3 gloo ranks and property-tests the round trip.

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from hypothesis import given, settings
from matplotlib.patches import Patch, Rectangle

import zerofn as zf
from zerofn.testing import World
from zerofn.testing import strategies as zst

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})


# %% [markdown]
# ## The rule in plain Python
#
# This is the reference the rest of the notebook is checked against: ten lines, no
# zerofn.


# %%
def reference_shard(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Chunk `rank` of `t` flattened and zero-padded to a multiple of `world_size`."""
    flat = t.reshape(-1)
    shard_numel = -(-flat.numel() // world_size)  # ceil(numel / N)
    padded = torch.cat([flat, flat.new_zeros(world_size * shard_numel - flat.numel())])
    return padded[rank * shard_numel : (rank + 1) * shard_numel]


def reference_unshard(shards: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Concatenate the chunks of ranks 0..N-1, drop the padding, restore the shape."""
    return torch.cat(shards)[: math.prod(shape)].reshape(shape)


# The smallest example: a 2x5 weight over 3 ranks. 10 elements -> 4 per rank, 2 of padding.
w = torch.arange(1.0, 11.0).reshape(2, 5)
for r in range(3):
    print(f"rank {r} owns {reference_shard(w, 3, r).tolist()}")
assert torch.equal(reference_unshard([reference_shard(w, 3, r) for r in range(3)], w.shape), w)

# %% [markdown]
# ## What zerofn computes: the `ShardLayout`
#
# `zf.make_layout` is a pure function of names, shapes, dtypes and the world size: no
# tensor data, no process group. For each parameter it records `shard_numel`,
# `padding`, and the range of *real* (unpadded) flat elements each rank owns.

# %%
params = {
    "embed.weight": torch.zeros(4, 3),  # 12 elements
    "block.weight": torch.zeros(2, 5),  # 10
    "block.bias": torch.zeros(5),  # 5
    "scale": torch.zeros(()),  # 1 (a 0-d param)
}
for n in (1, 2, 3, 4):
    layout = zf.make_layout(params, n)
    print(f"N = {n}")
    for spec in layout.params:
        owned = "  ".join(f"r{r}:{list(spec.owned_range(r))}" for r in range(n))
        print(f"  {spec.name:13s} numel {spec.numel:2d}  shard {spec.shard_numel}  pad {spec.padding}  {owned}")
        # The layout agrees with the plain-Python rule, rank by rank.
        for r in range(n):
            start, stop = spec.owned_range(r)
            ref = reference_shard(torch.arange(spec.numel), n, r)
            assert ref.numel() == spec.shard_numel
            assert ref[: stop - start].tolist() == list(range(start, stop))


# %% [markdown]
# ## A picture per world size
#
# Each row is one parameter, flattened; each cell one element, coloured by the rank that
# owns it. Hatched cells are padding. Note the 0-d `scale`: at N = 4 rank 0 owns its
# one element and ranks 1-3 own a padding zero each. Every rank has the same amount of
# work for every parameter, which keeps the collectives simple (equal-sized rows).

# %%
colors = plt.get_cmap("tab10").colors
fig, axes = plt.subplots(4, 1, figsize=(7.5, 5.6), sharex=True)
for ax, n in zip(axes, (1, 2, 3, 4), strict=True):
    layout = zf.make_layout(params, n)
    for row, spec in enumerate(layout.params):
        for e in range(spec.padded_numel):
            pad = e >= spec.numel
            ax.add_patch(
                Rectangle(
                    (e, row),
                    0.92,
                    0.8,
                    facecolor=colors[e // spec.shard_numel],
                    alpha=0.35 if pad else 0.9,
                    hatch="///" if pad else None,
                    edgecolor="white" if not pad else "0.3",
                    linewidth=0.5,
                )
            )
    ax.set_xlim(0, 13)
    ax.set_ylim(-0.2, len(params))
    ax.set_yticks([i + 0.4 for i in range(len(params))], layout.names)
    ax.invert_yaxis()
    ax.set_title(f"N = {n}", loc="left", fontsize=9)
axes[-1].set_xlabel("flat element index (padded)")
handles = [Patch(color=colors[r], label=f"rank {r}") for r in range(4)]
handles.append(Patch(facecolor="white", edgecolor="0.3", hatch="///", label="padding"))
fig.legend(handles=handles, loc="upper right", ncol=5, fontsize=8)
fig.tight_layout(rect=(0, 0, 1, 0.95))
plt.show()

# %% [markdown]
# ## On real ranks: `shard_params` and `gather_params`
#
# `World(3)` starts 3 worker processes, each a real `torch.distributed` gloo rank, and
# runs a function on all of them (functions defined here reach the workers by value,
# through cloudpickle). On every rank `shard_params` keeps this rank's chunk of each
# parameter as a float32 *master shard* (no communication: every rank cuts its own
# chunk out of the full tensor it already has); `gather_params` all-gathers the chunks
# back into full parameters.

# %%
world = World(3)


def shard_then_gather(full_params, group=None):
    """On one rank: the master shards `shard_params` keeps, and the params `gather_params` rebuilds."""
    state = zf.shard_params(full_params, zf.optim.sgd(lr=0.1), group)
    return dict(state.master), zf.gather_params(state, group)


real = {
    "block.weight": torch.arange(1.0, 11.0).reshape(2, 5),
    "block.bias": torch.arange(-1.0, -6.0, -1.0),
    "scale": torch.tensor(0.5),
}
results = world.run(shard_then_gather, real)
print("before, on every rank:      ", {n: p.reshape(-1).tolist() for n, p in real.items()})
for rank, (shards, gathered) in enumerate(results):
    print(f"rank {rank} after shard_params: ", {n: s.tolist() for n, s in shards.items()})
    print(f"rank {rank} after gather_params:", {n: p.reshape(-1).tolist() for n, p in gathered.items()})
    for name, p in real.items():
        assert torch.equal(shards[name], reference_shard(p, 3, rank))
        assert torch.equal(gathered[name], p)

# %% [markdown]
# ## The claim, checked: gather(shard(params)) == params, for any params and any *N*
#
# Hypothesis draws parameter dicts that reach the corners sharding code gets wrong
# (0-d tensors, empty tensors, fewer elements than ranks, odd sizes; float32, float64,
# float16 and bfloat16 mixed in one dict) and a world size n ∈ {1, 2, 3}. The
# first *n* ranks form a process group (process groups are arguments in zerofn, never
# globals), shard, and gather. Every rank must hold exactly the plain-Python reference
# chunk, and every rank must get back the unsharded params bit for bit, dtype included.


# %%
def round_trip_on_first(n, full_params):
    group = dist.new_group(list(range(n)))  # every rank calls new_group, members or not
    if dist.get_rank() >= n:
        return None
    try:
        return shard_then_gather(full_params, group)
    finally:
        dist.destroy_process_group(group)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(full_params=zst.param_dicts(), n=zst.world_sizes(max_size=3))
def gather_of_shard_is_identity(full_params, n):
    for rank, (shards, gathered) in enumerate(world.run(round_trip_on_first, n, full_params)[:n]):
        assert list(gathered) == list(full_params)
        for name, p in full_params.items():
            assert torch.equal(shards[name], reference_shard(p.float(), n, rank)), (rank, name)
            assert gathered[name].dtype == p.dtype and torch.equal(gathered[name], p), (rank, name)


gather_of_shard_is_identity()
print("round trip: 30 random param dicts at N = 1..3, every rank bitwise equal to the unsharded params")

# %%
world.close()  # stop the worker processes
