# %% [markdown]
# # 7. Low-bit optimizer state: the same blocks, and the same bits, at every world size
#
# ZeRO divides AdamW's state by *N*, but each rank still keeps two fp32 moments: 8 bytes
# per element of its chunk. torchao's `AdamW8bit`, `AdamW4bit` and `AdamWFp8` keep the
# moments *block-wise quantized*: one code per element (1 byte; half a byte for 4-bit)
# and one fp32 scale, the block's largest magnitude, per block of *B* elements.
#
# A block's scale depends on every element of the block. So when a rank's chunk starts in
# the middle of a block, the blocks, the scales and the numbers change with *N*. zerofn
# places each quantized param **blocked(B)**: every chunk is a whole number of blocks,
# B⌈n/(NB)⌉ elements, so block *k* is elements [kB, (k+1)B) at every *N*.
# This notebook shows the difference, draws the blocks, measures the memory per rank, and
# checks on 2 gloo ranks that zerofn's result equals the plain torchao optimizer's.

# %%
import unittest.mock

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torchao.optim
from torchao.optim.subclass_8bit import OptimState8bit

import zerofn as zf
from zerofn import lowbit
from zerofn.buckets import cut_shard
from zerofn.layout import make_layout
from zerofn.testing import World

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})

# %% [markdown]
# ## Blocks that move with *N* change the numbers
#
# A second moment of 1024 elements in blocks of B = 256, quantized by torchao's own
# 8-bit state tensor. Whole: 4 blocks. Cut into 3 chunks of ⌈1024/3⌉ = 342
# elements (the plain even split), each padded to whole blocks of its own: the blocks now
# start at 0, 342 and 684, and most elements get another scale.


# %%
def roundtrip(x):
    """x quantized to torchao's 8-bit state (blocks of 256) and back."""
    state = OptimState8bit.zeros(x.shape, signed=False, block_size=256)
    state.copy_(x)
    return state.dequantize()


torch.manual_seed(0)
v = torch.rand(1024) ** 4  # a second moment: non-negative, a few large values
whole = roundtrip(v)
chunks = []
for r in range(3):
    part = v[r * 342 : (r + 1) * 342]
    padded = torch.cat([part, part.new_zeros(512 - part.numel())])
    chunks.append(roundtrip(padded)[: part.numel()])
unaligned = torch.cat(chunks)
print(f"elements whose quantized value changed with 3 unaligned chunks: {(whole != unaligned).sum().item()} of 1024")
aligned = torch.cat([roundtrip(v[r * 512 : (r + 1) * 512]) for r in range(2)])  # blocked(256) at N=2: 2 blocks each
print(f"with chunks of whole blocks (N=2): {(whole != aligned).sum().item()} changed")
assert not torch.equal(whole, unaligned) and torch.equal(whole, aligned)

# %% [markdown]
# ## The blocked placement
#
# The optimizer decides from the param's *global* size (torchao's own rule, applied to
# the whole param instead of a rank's piece): `numel >= 4096` and `numel % B == 0` is
# quantized and placed `blocked(B)`; anything else keeps fp32 state and the plain split.
# The placement is part of the layout's fingerprint, which every rank checks. Below, a
# param of 10 blocks at N = 1 … 4: each colour is one block, each row one rank; the
# hatched cells are padding (whole blocks of zeros past the end).

# %%
opt = zf.optim.adamw8bit(lr=1e-3)
for name, shape in {"w": (64, 64), "bias": (64,), "odd": (100, 65)}.items():
    print(f"{name} {shape}: {opt.placement(name, shape)}")
numel, B = 10 * 256, 256
fig, axes = plt.subplots(4, 1, figsize=(8, 4.2), sharex=True)
cmap = plt.get_cmap("tab10")
for ax, n in zip(axes, (1, 2, 3, 4), strict=True):
    spec = make_layout({"w": torch.empty(numel, device="meta")}, n, placement={"w": "blocked(256)"})["w"]
    per_rank = spec.shard_numel // B
    for r in range(n):
        for j in range(per_rank):
            k = r * per_rank + j  # the global block index: the same block at every N
            pad = k * B >= numel
            ax.barh(r, 1, left=k, color="white" if pad else cmap(k % 10), edgecolor="black", hatch="//" if pad else "")
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.invert_yaxis()
    ax.set_ylabel(f"N={n}", rotation=0, labelpad=25)
    ax.set_title(f"N={n}: chunk {spec.shard_numel} = {per_rank} blocks, padding {spec.padding}", fontsize=8)
axes[-1].set_xlabel("block k of the flat param (elements [256k, 256(k+1)))")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Memory per rank
#
# Masters (fp32) plus both moments, for the benchmark transformer (Ψ = 10.5 M; 35 of its
# 101 tensors are quantized, 99.7 % of the elements), the largest rank at N = 1 … 8:
# the optimizer's own `init` builds each rank's state on the `meta` device (torchao's
# real state tensors, no memory), and `lowbit.state_nbytes` counts their codes, scales
# and code tables. fp32 AdamW: 12 bytes per element; 8-bit and fp8: 4 + 2(1 + 4/256)
# ≈ 6.03; 4-bit: 4 + 2(0.5 + 4/128) ≈ 5.06.

# %%
# The shapes of the benchmark transformer (benchmarks/models.py): vocabulary 8192, d_model 256, 8 blocks, d_ff 1024.
V, D, F, L = 8192, 256, 1024, 8
shapes = {"tok.weight": (V, D), "pos.weight": (32, D)}
for b in range(L):
    for name, shape in {
        "ln1.weight": (D,), "ln1.bias": (D,), "qkv.weight": (3 * D, D), "qkv.bias": (3 * D,),
        "proj.weight": (D, D), "proj.bias": (D,), "ln2.weight": (D,), "ln2.bias": (D,),
        "fc1.weight": (F, D), "fc1.bias": (F,), "fc2.weight": (D, F), "fc2.bias": (D,),
    }.items():  # fmt: skip
        shapes[f"blocks.{b}.{name}"] = shape
shapes |= {"ln_f.weight": (D,), "ln_f.bias": (D,), "head.weight": (V, D)}
params = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
psi = sum(p.numel() for p in params.values())


def state_mib(opt, n):
    layout = make_layout(params, n, placement={k: opt.placement(k, tuple(p.shape)) for k, p in params.items()})
    most = 0
    for r in range(n):
        masters = {s.name: torch.empty(s.local_shape(r), device="meta") for s in layout.params}
        leaves = torch.utils._pytree.tree_leaves((masters, opt.init(masters, layout=layout)))
        most = max(most, sum(lowbit.state_nbytes(t) for t in leaves))
    return most / 2**20


sizes = range(1, 9)
optimizers = {
    "fp32 AdamW": zf.optim.adamw(),
    "8-bit": zf.optim.adamw8bit(),
    "fp8": zf.optim.adamwfp8(),
    "4-bit": zf.optim.adamw4bit(),
}
mib = {name: [state_mib(o, n) for n in sizes] for name, o in optimizers.items()}
for name, row in mib.items():
    print(f"{name:>10}: " + "  ".join(f"N={n}: {m:6.2f}" for n, m in zip(sizes, row, strict=True)) + "  MiB")
fig, ax = plt.subplots(figsize=(6, 3))
for name, row in mib.items():
    ax.plot(list(sizes), row, marker="o", label=name)
ax.set_xlabel("world size N")
ax.set_ylabel("masters + moments per rank (MiB)")
ax.set_yscale("log")
ax.legend()
plt.show()
assert all(m8 < 0.51 * m32 for m8, m32 in zip(mib["8-bit"], mib["fp32 AdamW"], strict=True))

# %% [markdown]
# ## On 2 gloo ranks: the same bits as the plain torchao optimizer
#
# Each rank cuts its gradient shard out of the same global gradient (so the mean
# gradient is the same at every *N*), and `step_shards` runs torchao's update on its
# whole blocks. After 10 steps the gathered params equal, bit for bit, those of the plain
# `torchao.optim.AdamW8bit` on one process (torchao compiles its update; both sides run it
# eagerly here).

# %%
SHAPES = {"w": (64, 64), "b": (64,)}


def data():
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(10)]
    return init, grads


def train_on_ranks():
    init, grads = data()
    state = zf.shard_params(init, zf.optim.adamw8bit(lr=1e-2))
    before = {n: type(t).__name__ for n, t in state.opt_state.exp_avg.items()}
    for g in grads:
        state, _ = zf.step_shards(
            state, {s.name: cut_shard(g[s.name], s, dist.get_rank()) for s in state.layout.params}
        )
    return zf.gather_params(state), before, state.master["w"].shape


world = World(2)
(result, kinds, chunk), _ = world.run(train_on_ranks)
world.close()  # stop the 2 worker processes
print("rank 0 holds", chunk, "of w; its moments:", kinds)

init, grads = data()
plain_params = {n: torch.nn.Parameter(t) for n, t in init.items()}
plain = torchao.optim.AdamW8bit(list(plain_params.values()), lr=1e-2)
with unittest.mock.patch.object(torch, "compile", lambda fn, **kw: fn):  # torchao's update, eagerly
    for g in grads:
        for n, p in plain_params.items():
            p.grad = g[n]
        plain.step()
for n, p in plain_params.items():
    assert torch.equal(result[n], p.detach()), n
print("zerofn at N=2 == plain torchao AdamW8bit, bit for bit")
