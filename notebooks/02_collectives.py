# %% [markdown]
# # 2. Collectives: all-reduce, reduce-scatter, all-gather
#
# A ZeRO step needs the ranks to talk twice: once to average the gradients (each rank
# computed its own from its own batch) and once to rebuild the full parameters after
# each rank updated its shard. Three *collectives* do all the work:
#
# | collective | every rank starts with | every rank ends with |
# |---|---|---|
# | all-reduce | a tensor xᵣ | the sum Σᵣ xᵣ |
# | reduce-scatter | a tensor xᵣ cut into *N* chunks | chunk *r* of the sum |
# | all-gather | a chunk cᵣ | all chunks, concatenated |
#
# DDP averages gradients with one all-reduce. ZeRO stage 2 replaces it with a
# reduce-scatter (each rank only needs the mean gradient of the elements it owns) and an
# all-gather of the updated params. This notebook defines the three in plain Python on
# lists of per-rank tensors, runs them on 3 real gloo ranks, and counts the bytes every
# rank sends in a ZeRO step against DDP, with zerofn's own counter `zf.count_bytes()`.

# %%
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerofn as zf
from zerofn.testing import World

torch.set_num_threads(1)
N = 3


# %% [markdown]
# ## Reference semantics in plain Python
#
# A "rank" here is just an index into a list: `xs[r]` is what rank `r` holds. Each
# function returns the list of what every rank holds afterwards.


# %%
def all_reduce(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    total = sum(xs[1:], xs[0].clone())
    return [total.clone() for _ in xs]


def reduce_scatter(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    total = sum(xs[1:], xs[0].clone())
    return list(total.chunk(len(xs)))  # rank r keeps chunk r of the sum


def all_gather(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    full = torch.cat(chunks)
    return [full.clone() for _ in chunks]


# The smallest example. Integer values, so every sum is exact in any order of addition.
xs = [torch.arange(6.0) + 10 * r for r in range(N)]
for r in range(N):
    print(f"rank {r}: x = {xs[r].tolist()}")
print("all_reduce    ->", [t.tolist() for t in all_reduce(xs)])
print("reduce_scatter->", [t.tolist() for t in reduce_scatter(xs)])
print("all_gather(reduce_scatter) ->", [t.tolist() for t in all_gather(reduce_scatter(xs))])

# The identity behind ZeRO stage 2: an all-reduce IS a reduce-scatter followed by an all-gather.
for a, b in zip(all_reduce(xs), all_gather(reduce_scatter(xs)), strict=True):
    assert torch.equal(a, b)

# %% [markdown]
# A ring implementation makes that identity its algorithm, and it is why the textbook
# cost is what it is: in a reduce-scatter of *M* elements of *b* bytes each rank sends
# (N−1)/N·M·b bytes, the same for an all-gather, and twice that for an
# all-reduce.
#
# ## The same on 3 real gloo ranks
#
# zerofn moves every bucket through the pieces of `zf.buckets`, the same pieces for the
# functional stages, the `ZeroOptimizer` facade and checkpoints. Its two collectives work
# on a bucket's *rank-major* buffer of shape `(N, S)`: `launch_reduce` leaves rank `r`
# with the sum of row `r` (a reduce-scatter, or an all-reduce that keeps its own row;
# with `whole=True` the all-reduce keeps every row), and `launch_gather` gives every rank
# all rows (an all-gather, or one broadcast per rank). Both return a pending handle:
# `.wait()` gives the result, so a caller can overlap the collective with other work.
# Each call inside `zf.count_bytes()` adds what this rank sent to the counter. Here the
# bucket holds one 6-element tensor `x`, so its rows are `x.view(N, 2)`.

# %%
world = World(N)


def collectives_on_this_rank():
    rank = dist.get_rank()
    x = torch.arange(6.0) + 10 * rank  # the same x_r as above
    layout = zf.make_layout({"x": x}, N)  # one bucket of one tensor: rows (N, 2)
    (bucket,) = zf.buckets.plan_buckets(layout, 2**20)
    out = {"before": x}
    with zf.count_bytes() as sent:
        rows = x.view(N, -1).clone()  # the reduce sums into its rows: give it a copy
        out["all_reduce"] = zf.buckets.launch_reduce(rows, layout, bucket, None, "all_reduce", whole=True).wait()
        out["all_reduce"] = out["all_reduce"].reshape(-1)
        rows = x.view(N, -1).clone()
        out["reduce_scatter"] = zf.buckets.launch_reduce(rows, layout, bucket, None, "reduce_scatter").wait()
        out["all_gather"] = zf.buckets.launch_gather(out["reduce_scatter"], None, "all_gather").wait().reshape(-1)
    out["bytes"] = dict(sent.by_collective)
    return out


ranks = world.run(collectives_on_this_rank)
for r, got in enumerate(ranks):
    print(f"rank {r}: before {got['before'].tolist()}")
    print(f"        after all_reduce     {got['all_reduce'].tolist()}")
    print(f"        after reduce_scatter {got['reduce_scatter'].tolist()}")
    print(f"        after all_gather     {got['all_gather'].tolist()}")
    print(f"        bytes sent           {got['bytes']}")

# %% [markdown]
# Equal to the plain-Python reference on every rank, and the bytes are the ring
# formula: 6 float32 elements, so 2/3 · 6 · 4 = 16 bytes for a
# reduce-scatter or an all-gather, 32 for an all-reduce.

# %%
for r, got in enumerate(ranks):
    assert torch.equal(got["all_reduce"], all_reduce(xs)[r])
    assert torch.equal(got["reduce_scatter"], reduce_scatter(xs)[r])
    assert torch.equal(got["all_gather"], all_gather(reduce_scatter(xs))[r])
    assert got["bytes"] == {"all_reduce": 32, "reduce_scatter": 16, "all_gather": 16}
print("gloo == reference on every rank; bytes == ring formula")

# %% [markdown]
# ## Bytes per rank in one training step: DDP, ZeRO stage 1, ZeRO stage 2
#
# A small MLP, Ψ parameters, float32 (b = 4). Each rank computes its local
# gradients, then runs one ZeRO step inside `zf.count_bytes()`:
# `reduce_grads` -> `step_shards` -> `gather_params`.
#
# * **DDP** all-reduces every gradient: 2(N−1)/N·Ψ·b. To count it with the same
#   counter we issue that very all-reduce with `zf.buckets.launch_reduce`.
# * **Stage 1** all-reduces too (every rank receives the whole mean gradient and keeps
#   only its shards), then all-gathers the params: 3(N−1)/N·Ψ·b.
# * **Stage 2** reduce-scatters instead: 2(N−1)/N·Ψ·b, what DDP sends, while
#   holding 1/N of the optimizer state. That is `CommPolicy.byte_optimal()`. On gloo
#   the default policy sends the same bytes another way: an all-to-all hands each rank
#   its row of every rank's bucket (the owner adds the N rows in rank order), and each
#   rank broadcasts its row of the params; gloo runs those in one step each, where its
#   reduce-scatter and all-gather take several. On NCCL the default *is* the
#   reduce-scatter + all-gather pair.
#
# Small extras: `check` is the rank-agreement all-gather that runs before any shard is
# exchanged (so a mismatch raises instead of hanging), `scalars` the one collective of
# the global gradient norm and the overflow flag (on gloo an all-gather, each rank adding
# the N rows in rank order). The layer sizes are multiples of *N*,
# so no parameter needs padding and Ψ is exact (zerofn pads each parameter to a
# multiple of *N*, and the padding travels too).

# %%
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.Tanh(), torch.nn.Linear(96, 12))


def step_bytes(model):
    """One ZeRO step per configuration on this rank: bytes sent, by collective; and the grad shards."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    torch.manual_seed(dist.get_rank())  # each rank its own batch
    x, y = torch.randn(8, 24), torch.randint(0, 12, (8,))
    grads = torch.func.grad(lambda p: F.cross_entropy(torch.func.functional_call(model, p, (x,)), y))(params)
    report = {}
    configs = {
        "stage 1": (1, None),
        "stage 2 (gloo default)": (2, None),
        "stage 2 (byte-optimal)": (2, zf.CommPolicy.byte_optimal()),
    }
    for label, (stage, policy) in configs.items():
        state = zf.shard_params(params, zf.optim.adamw(lr=1e-3))
        with zf.count_bytes() as sent:
            gshards = zf.reduce_grads(grads, state.layout, stage=stage, comm_policy=policy)
            state, _ = zf.step_shards(state, gshards)
            zf.gather_params(state, comm_policy=policy)
        report[label] = dict(sent.by_collective)
    # DDP: one all-reduce of all gradients (flattened, viewed as N rows: one bucket).
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    flat_layout = zf.make_layout({"all": flat}, N)
    (bucket,) = zf.buckets.plan_buckets(flat_layout, flat.numel())
    with zf.count_bytes() as sent:
        zf.buckets.launch_reduce(flat.view(N, -1), flat_layout, bucket, None, "all_reduce", whole=True).wait()
    report["DDP"] = dict(sent.by_collective)
    return report, dict(grads), dict(gshards), state.layout


ranks = world.run(step_bytes, model)
report, _, _, layout = ranks[0]
psi, b = layout.numel, 4
assert N * layout.shard_numel == psi  # no padding
print(f"Ψ = {psi:,} parameters, N = {N} ranks, b = {b} bytes (float32)")
ring = (N - 1) / N * psi * b  # one reduce-scatter or one all-gather of all params
formula = {"DDP": 2 * ring, "stage 1": 3 * ring, "stage 2 (gloo default)": 2 * ring, "stage 2 (byte-optimal)": 2 * ring}
print(f"{'bytes per rank':24s}{'reduce':>22s}{'gather':>19s}{'check+scalars':>15s}{'total':>8s}{'formula':>8s}")
for label in ("DDP", "stage 1", "stage 2 (gloo default)", "stage 2 (byte-optimal)"):
    by = report[label]
    cells = [f"{k} {v:,}" for k, v in by.items() if k not in ("check", "scalars")] + ["-"]
    extras = by.get("check", 0) + by.get("scalars", 0)
    print(
        f"{label:24s}{cells[0]:>22s}{cells[1]:>19s}{extras:>15,}{sum(by.values()):>8,}{formula[label]:>8,.0f}"
        f"  = {formula[label] / ring:.0f}·(N-1)/N·Ψ·b"
    )
# Every rank sends the same amount (the collectives are symmetric).
assert all(r[0] == report for r in ranks)

# %% [markdown]
# ## The claims, checked
#
# 1. The bucket traffic of each configuration is exactly the formula, to the byte; and
#    stage 2 sends exactly what DDP sends, with either policy.
# 2. What stage 2 hands the optimizer on rank *r* is chunk *r* of the *unsharded* mean
#    gradient, computed here in one process from all ranks' local gradients.

# %%
for label, by in report.items():
    assert sum(v for k, v in by.items() if k not in ("check", "scalars")) == formula[label], label
for label in ("stage 2 (gloo default)", "stage 2 (byte-optimal)"):
    assert sum(v for k, v in report[label].items() if k not in ("check", "scalars")) == sum(report["DDP"].values())

local_grads = [r[1] for r in ranks]
for name in layout.names:
    unsharded_mean = sum(g[name] for g in local_grads) / N
    for rank, (_, _, gshards, _) in enumerate(ranks):
        start, stop = layout[name].owned_range(rank)
        # Close, not bitwise: zerofn multiplies by 1/N before the sum (as DDP does), we divide after.
        torch.testing.assert_close(gshards[name][: stop - start], unsharded_mean.reshape(-1)[start:stop])
        assert not gshards[name][stop - start :].any()  # the padding stays zero
print("bytes == formula for every configuration; stage 2 sends what DDP sends; shards == unsharded mean gradient")

# %%
world.close()  # stop the worker processes
