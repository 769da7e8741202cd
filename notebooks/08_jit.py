# %% [markdown]
# # 8. jit the step: one compiled graph, every collective in it
#
# The functional loop is four pure calls. `torch.compile(step, fullgraph=True)` traces the
# whole step, gradient, reduction, update and gather, into **one graph**, the way
# `jax.jit` traces a step: no graph break (`fullgraph=True` would make one an error), and
# the collectives inside it. Under tracing zerofn's communication module issues torch's
# *functional* collectives (`_c10d_functional.all_reduce`, `broadcast`, ... each followed by
# `wait_tensor`), which the compiler keeps in the graph; eagerly it calls c10d as always.
#
# What a compiled step needs (the guide: `docs/jit.md`): the state's numbers as tensors
# (`shard_params` makes the step count and loss scale 0-d tensors), a learning rate that
# changes as a 0-d tensor updated in place, and the skip decision as tensor math (zerofn
# does that).
#
# This notebook, on 2 gloo ranks: the collectives of the compiled graph, in order; how
# often it compiles over 12 steps of a schedule; the bits against the eager loop; and the
# time, compiled against eager.

# %%
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import zerofn as zf
from zerofn.testing import World

torch.set_num_threads(1)

# %% [markdown]
# ## The step, eager and compiled
#
# Every rank runs the function below: the README's loop (`torch.func.grad`,
# `reduce_grads`, `step_shards` with clipping, `gather_params`), first eagerly, then
# compiled with `aot_eager` (eager mode's aten kernels, replayed from the graph, so the
# bits can be compared) through a backend that also keeps the aten graph it was given,
# to read its collectives. `error_on_recompile` turns any recompile into an error.


# %%
def graph_keeper(kept):
    """``aot_eager`` that also appends the forward aten graph to ``kept``."""

    def forward(gm, example_inputs):
        kept.append(gm)
        return make_boxed_func(gm.forward)  # what aot_eager returns: the graph, run as is

    return aot_autograd(fw_compiler=forward)


def eager_and_compiled(steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = torch.tensor(1e-2, dtype=torch.float64)  # a schedule writes it in place
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [torch.randn(4, 8, generator=gen) for _ in range(steps)]

    def loss_fn(p, x):
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), x.sum(dim=1, keepdim=True))

    def step(state, params, x):
        grads = torch.func.grad(loss_fn)(params, x)
        gshards = zf.reduce_grads(grads, state.layout, stage=2)
        state, info = zf.step_shards(state, gshards, max_norm=1.0)
        return state, zf.gather_params(state), info.grad_norm

    def train(fn):
        state = zf.shard_params(params, zf.optim.adamw(lr=lr))
        p, times, norms = params, [], []
        for i, x in enumerate(data):
            lr.fill_(1e-2 * 0.95**i)
            t0 = time.perf_counter()
            state, p, norm = fn(state, p, x)
            times.append(time.perf_counter() - t0)
            norms.append(float(norm))
        return p, times, norms

    eager_p, eager_t, eager_norms = train(step)
    kept = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # By name: this function travels to the ranks by value, and cloudpickle cannot copy the config module.
    dynamo_config = getattr(torch._dynamo, "config")  # noqa: B009
    with dynamo_config.patch(error_on_recompile=True):
        comp_p, comp_t, comp_norms = train(torch.compile(step, fullgraph=True, backend=graph_keeper(kept)))
    ops = [str(node.target) for node in kept[0].graph.nodes if node.op == "call_function"]
    return {
        "ops": ops,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "bitwise": all(torch.equal(eager_p[n], comp_p[n]) for n in eager_p) and eager_norms == comp_norms,
        "eager_ms": sorted(eager_t)[len(eager_t) // 2] * 1e3,
        "compiled_ms": sorted(comp_t[1:])[len(comp_t[1:]) // 2] * 1e3,
        "first_call_s": comp_t[0],
    }


STEPS = 12
world = World(2)
ranks = world.run(eager_and_compiled, STEPS)
world.close()

# %% [markdown]
# ## The collectives of the graph
#
# The aten graph of rank 0, filtered to its communication and to zerofn's verdict nodes:
# `zerofn.verdict` reads a collective's result on the host every time the graph runs and
# raises the eager error on every rank if some rank rejected its input (a validation that
# eagerly runs before the collectives; under compile its local part runs once per trace,
# on static shapes and names).

# %%
ops = ranks[0]["ops"]
comm = [op for op in ops if "_c10d_functional" in op or "zerofn" in op]
print(f"{len(ops)} aten calls in the graph, {len(comm)} of them communication or verdicts:")
for op in comm:
    print("  ", op)

# %% [markdown]
# In order: the rank-agreement `all_gather` of `reduce_grads` (names, shapes, settings and
# each rank's verdict on its input) and its verdict; the bucket's `all_to_all_single` and
# the adds of the rows it brought, in rank order (gloo's realisation of the reduce-scatter;
# NCCL's would be `reduce_scatter_tensor`); the scalars of `step_shards` (squared norm,
# overflow flag, input verdict; on gloo an `all_gather`, added in rank order) and their
# verdict; and one `broadcast` per rank (gloo's all-gather; the step's scalars have
# confirmed every rank's layout, so the gather needs no agreement of its own). Every one is
# waited on inside the graph by a `wait_tensor`: the small ones at once, a bucket's where
# the bucket pipeline settles it, as eagerly, so the broadcasts of a bucket (and the next
# bucket's collective, on a model of several buckets) are in flight together. A second
# `wait_tensor` of a result already waited on costs nothing.
#
# ## Compile count, bits and time

# %%
for r, got in enumerate(ranks):
    print(
        f"rank {r}: graphs compiled {got['graphs']}, bitwise equal to eager {got['bitwise']}, "
        f"first call (compile) {got['first_call_s']:.1f} s, step {got['compiled_ms']:.2f} ms "
        f"compiled vs {got['eager_ms']:.2f} ms eager"
    )

# %% [markdown]
# One graph for 12 steps of a changing learning rate (it is a tensor input, not a
# constant), and the same bits as the eager loop. The times above are a dozen steps on
# whatever machine ran this notebook, so read them as an order of magnitude: a step of this
# tiny model is a few milliseconds either way. What the compiled step saves and costs:
# `aot_eager` still runs every aten op of the graph from Python, one by one, as eager mode
# does, but without zerofn's Python around them (checks, bucket planning, per-tensor
# loops: traced once); it adds the compiled function's own wrapper (guards on every input
# tensor, the state flattened into the graph's inputs); and the compile costs seconds,
# once. On a GPU the graph also makes inductor's fused kernels and CUDA graphs (one launch
# for the whole step) possible. The benchmark's `zerofn-fn-compiled` on the bigger models
# and the profile of where its time goes are in `docs/jit.md`.

# %%
assert all(got["graphs"] == 1 and got["bitwise"] for got in ranks)
assert sum("all_to_all" in op for op in comm) == 1 and sum("all_gather" in op for op in comm) == 2
assert sum("broadcast" in op for op in comm) == 2
launched = [i for i, op in enumerate(comm) if "_c10d_functional" in op and "wait_tensor" not in op]
waits = [i for i, op in enumerate(comm) if "wait_tensor" in op]
assert all(any(w > i for w in waits) for i in launched)  # each collective waited on, inside the graph
casts = [i for i, op in enumerate(comm) if "broadcast" in op]
assert not any(casts[0] < w < casts[-1] for w in waits)  # the bucket's broadcasts in flight together
