"""Mixed precision end to end on real gloo ranks: fp16 and bf16 against DDP references.

The references
--------------
zerofn is checked against plain-torch training that follows ColossalAI's definition of
mixed precision, built from independent parts (DDP, torch.optim, a few lines of loss
scaling) and sharing nothing with zerofn but the scaler *rules* (``ReferenceScaler`` in
``test_precision``: a transliteration of ColossalAI's, not zerofn's scaler):

* **working-dtype reference** (``master_weights=False``): a DDP model in the working
  dtype (``model.to(fp16)``) and a torch optimizer over those fp16/bf16 params: it
  updates the low-precision weights directly, its state in the same dtype.
* **fp32-master reference** (``master_weights=True``): the same DDP model in the working
  dtype runs forward and backward; an fp32 copy of every param (the working params at
  the start, so both sides round identically) is what ``torch.optim.AdamW`` updates, with
  the gradients cast to fp32; after each step the working params are the fp32 masters
  rounded to the working dtype (``p.copy_(master)``).

Why the forward runs on a working-dtype model rather than on an fp32 model whose weights
are rounded to the working dtype for the forward: with rounded weights in an fp32
forward, activations and gradients would carry fp32 precision, and the comparison would
measure how far fp16/bf16 training is from fp32 training (a property of the number
formats, about 1e-2 here), not whether zerofn implements mixed precision correctly. A
working-dtype forward makes the local gradients bit-identical on both sides, so every
remaining difference comes from zerofn's own steps (reduce, scale, unscale, clip,
update, round).

Both references reduce through a DDP communication hook that does what ColossalAI's
reduction does: multiply the bucket by ``1/N`` in the gradient dtype, cast it to the
communication dtype, all-reduce, cast back. Loss scaling: ``(loss * S).backward()``; a
step whose averaged gradients hold ``inf``/``nan`` (the same on every rank after the
all-reduce) is skipped and fed to the scaler; otherwise gradients are multiplied by the
one coefficient ``1 / (S * c)``, ``c = (||g||/S + 1e-6) / max_norm`` when clipping
acts, else ``1 / S``, with the norm in float64.

Why every comparison is bitwise
-------------------------------
At every world size, for both dtypes, both stages, with and without master weights and
clipping, zerofn's params and masters are the reference's bits:

* the local gradients are the same bits (the same working-dtype forward of the same params);
* the mean: at 1 and 2 ranks whatever the wire, one addend or two, and a sum of two does
  not depend on the order. At 3 and 4 ranks gloo adds an element's addends in an order
  that depends on its offset in the buffer, and an element sits at different offsets in
  DDP's bucket and in zerofn's rank-major bucket; in fp16/bf16 each addition rounds. So
  there both sides use a float64 wire (``helpers.exact_wire``): three or four fp16, bf16
  or fp32 addends sum exactly in float64 in any order, rounded back once. The
  low-precision wires at 3 and 4 ranks are checked on one reduction against the error
  bound of a sum (``test_low_precision_wires_sum_within_their_error_bound``);
* ``1/N`` is the same fp32 factor on both sides and ``1/S`` a power of two;
* clipping: both sides use ColossalAI's formula on float64 norms, which may differ in the
  last bit (another order of the sum of squares); that changes the coefficient's rounding
  to float32 (or fp16/bf16) only within one float64 ulp of a boundary, about 2**-29 a step;
* the optimizers are torch's own. float32 kernels give the same bits on a shard as on the
  whole tensor, so the fp32 masters are stepped whole. Without master weights they are
  not: torch's CPU kernels for fp16/bf16 ``add_(other, alpha=...)`` round differently in
  the vectorised body of a loop and in its scalar tail (``p[:85].add_(b[:85],
  alpha=-0.05)`` differs from ``p.add_(b, alpha=-0.05)[:85]`` in about 1.4% of random
  bf16 elements), so the working-dtype reference steps every param in ``N`` pieces of the
  shards' size, and each element sits where it sits on its owner.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import Net, Snapshot, assert_trees_equal, batches, exact_wire, gate_used, seeded
from test_precision import ReferenceScaler
from torch.func import functional_call, grad

import zerofn as zf
from zerofn.precision import DynamicLossScaler, MixedDtypeError, NoLossScaling, NonFiniteGradError, PrecisionPolicy

pytestmark = pytest.mark.numerics

STEPS = 12
BUCKET = 128  # a few buckets per step
# AdamW updates the fp32 masters (eps 1e-3: with the default 1e-8 an element whose mean
# gradient is ~0 moves by +-lr depending on the sign one rounding of its sum gives it,
# and one ulp of a 3-rank sum decides a whole update). Without master weights the
# optimizer runs in the working dtype; there SGD with momentum, what pure low-precision
# training uses: fp16 AdamW state underflows (v = 1e-3 g^2 is subnormal for |g| < 1e-2,
# eps 1e-8 is 0 in fp16) and diverges on every side alike.
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)
SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
MAX_NORM = 0.05  # below every step's gradient norm here: clipping acts on every step
# Grows every 3 good steps from 2^13: it reaches 2^16, where fp16 losses of about 1
# overflow, so every fp16 run below has overflowing, skipped steps and a backoff.
SCALER = dict(
    initial_scale=2.0**13,
    min_scale=1.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=3,
    hysteresis=2,
    max_scale=2.0**24,
)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- models and helpers


class MixedNet(nn.Module):
    """A bf16 body with an fp32 LayerNorm, as mixed-dtype models keep their norms."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.b = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor, use_gate: bool = True) -> torch.Tensor:
        del use_gate
        h = torch.tanh(self.a(x))
        h = self.norm(h.float()).to(h.dtype)
        return self.b(h)


def _base(cfg: dict) -> nn.Module:
    torch.manual_seed(seeded(0))
    return MixedNet() if cfg.get("model") == "mixed" else Net()


def _prepare(base: nn.Module, cfg: dict) -> nn.Module:
    """A copy in the working dtype (the mixed model keeps its norm in fp32)."""
    model = copy.deepcopy(base).to(cfg["dtype"])
    if cfg.get("model") == "mixed":
        model.norm.float()
    return model


def cast_hook(comm_dtype, bucket):  # unannotated on purpose: DDP checks the annotations' objects
    """DDP communication hook: the mean as ColossalAI reduces (scale by 1/N, cast, sum, cast back)."""
    buf = bucket.buffer()
    wire = buf.mul(1.0 / dist.get_world_size())
    if comm_dtype is not None:
        wire = wire.to(comm_dtype)
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def back(f):
        return f.value()[0].to(buf.dtype)

    return fut.then(back)


def full_master(shards_by_rank: list, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Full master params from every rank's shards (rank r holds chunk r)."""
    out = {}
    for name, shape in shapes.items():
        flat = torch.cat([s[name] for s in shards_by_rank])
        out[name] = flat[: math.prod(shape)].reshape(shape)
    return out


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _policy(cfg: dict) -> PrecisionPolicy:
    dtype = cfg["dtype"]
    scaler = DynamicLossScaler(**SCALER) if dtype == torch.float16 else NoLossScaling()
    changes: dict[str, Any] = dict(comm_dtype=cfg["comm"], master_weights=cfg["mw"], loss_scaler=scaler)
    if cfg.get("model") == "mixed":
        changes.update(param_dtype=None, mixed_dtypes="keep")
    return PrecisionPolicy.for_dtype(dtype, **changes)


def _torch_optimizer(cfg: dict, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **ADAMW) if cfg["mw"] else torch.optim.SGD(params, **SGD)


# --------------------------------------------------------------------------- the three trainers


def _train_facade(base: nn.Module, cfg: dict) -> dict[str, Any]:
    """ZeroOptimizer wrapping a torch optimizer; ``forced_dtype`` casts the fp32 model."""
    dtype = cfg["dtype"]
    if cfg.get("model") == "mixed":
        model = _prepare(base, cfg)
        options: dict[str, Any] = dict(precision=_policy(cfg))
    else:
        model = copy.deepcopy(base)  # fp32: the facade casts it
        options = dict(forced_dtype=dtype, communication_dtype=cfg["comm"], master_weights=cfg["mw"], **SCALER)
    opt = zf.ZeroOptimizer(
        _torch_optimizer(cfg, model.parameters()),
        partition_grad=cfg["stage"] == 2,
        overlap_communication=cfg["stage"] == 2,
        clip_grad_norm=MAX_NORM if cfg["clip"] else 0.0,
        norm_type=cfg["norm_type"],
        reduce_bucket_size=BUCKET,
        module=model,
        **options,
    )
    trace = []
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        scale = opt.loss_scale
        opt.backward(_loss(model(x.to(dtype), gate_used(step)), y.to(dtype)))
        opt.step()
        opt.zero_grad()
        info = opt.last_step_info
        assert opt.get_grad_norm() == info.grad_norm
        trace.append((scale, info.skipped, info.grad_norm, info.clip_coef))
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "master": {n: t.clone() for n, t in opt.state.master.items()},
        "loss_scale": opt.state.loss_scale,
        "step": opt.state.step,
        "trace": trace,
        "layout_dtypes": {s.name: s.dtype for s in opt.state.layout.params},
    }


def _train_functional(base: nn.Module, cfg: dict) -> dict[str, Any]:
    """The functional loop: torch.func grads of the scaled loss, the four stage functions."""
    dtype = cfg["dtype"]
    model = _prepare(base, cfg)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    fopt = zf.optim.adamw(**ADAMW) if cfg["mw"] else zf.optim.sgd(**SGD)
    state = zf.shard_params(params, fopt, precision=_policy(cfg))

    def scaled_loss(params, x, y, use_gate, loss_scale):
        out = functional_call(model, params, (x,), {"use_gate": use_gate})
        return zf.scale_loss(_loss(out, y), loss_scale)

    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        use_gate = gate_used(step)
        grads = dict(grad(scaled_loss)(params, x.to(dtype), y.to(dtype), use_gate, state.loss_scale))
        for name in list(grads):  # what autograd leaves as None in the model: no gradient
            if name.startswith("unused.") or (name.startswith("gate.") and not use_gate):
                del grads[name]
        shards = zf.reduce_grads(
            grads, state.layout, stage=cfg["stage"], bucket_numel=BUCKET, precision=state.precision
        )
        max_norm = MAX_NORM if cfg["clip"] else None
        state, info = zf.step_shards(state, shards, max_norm=max_norm, norm_type=cfg["norm_type"])
        if not info.skipped:
            params = zf.gather_params(state, bucket_numel=BUCKET)
    return {"params": params, "master": dict(state.master), "loss_scale": state.loss_scale, "step": state.step}


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``t`` flattened, zero-padded to ``n`` equal chunks of ``ceil(numel / n)``: the
    pieces a split param's shards have (rank r holds chunk r), as new tensors."""
    c = -(-t.numel() // n)
    flat = torch.cat([t.detach().reshape(-1), t.new_zeros(n * c - t.numel())])
    return [piece.clone() for piece in flat.split(c)]


def _train_reference(base: nn.Module, cfg: dict) -> dict[str, Any]:
    """DDP in the working dtype + a torch optimizer on fp32 masters (mw) or on the params.

    Without master weights torch's SGD steps each param as ``N`` chunks of the shards'
    size (``_chunks``): torch's fp16/bf16 ``add_(other, alpha=...)`` rounds differently in
    the vectorised body of its loop and in the scalar tail, so an element's update depends
    on where it sits in the tensor it is stepped in; stepped in pieces of the shards' size,
    every element sits where it sits on its owner. (float32 kernels do not depend on it:
    the fp32 masters are stepped whole.)
    """
    dtype, mw, n = cfg["dtype"], cfg["mw"], dist.get_world_size()
    model = _prepare(base, cfg)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    ddp.register_comm_hook(cfg["comm"], cast_hook)
    if mw:
        master = {k: p.detach().float().clone().requires_grad_(True) for k, p in model.named_parameters()}
        topt = _torch_optimizer(cfg, master.values())
    else:
        pieces = {k: [c.requires_grad_(True) for c in _chunks(p, n)] for k, p in model.named_parameters()}
        topt = _torch_optimizer(cfg, [c for cs in pieces.values() for c in cs])
    scaler = ReferenceScaler(**SCALER) if dtype == torch.float16 else None
    trace = []
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        s = scaler.scale if scaler else 1.0
        loss = _loss(ddp(x.to(dtype), gate_used(step)), y.to(dtype))
        (loss * s if s != 1.0 else loss).backward()
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        found = any(not bool(torch.isfinite(g).all()) for g in grads.values())
        if scaler:
            scaler.update(found)
        if found:
            trace.append((s, True, math.inf, 1.0))
            model.zero_grad(set_to_none=True)
            continue
        if cfg["norm_type"] == 2.0:
            norm = math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads.values()))
        else:
            norm = max(float(g.abs().max()) for g in grads.values())
        true = norm / s
        # ColossalAI's one multiplier that unscales and clips: 1 / (S * c) with c the true
        # norm's excess over max_norm when clipping acts, else 1 / S.
        excess = (true + 1e-6) / MAX_NORM
        coef = 1.0 / (s * excess if cfg["clip"] and excess > 1 else s)
        clip = min(1.0, MAX_NORM / (true + 1e-6)) if cfg["clip"] else 1.0
        for k, g in grads.items():
            if mw:
                master[k].grad = g.float() * coef if coef != 1.0 else g.float()
                continue
            for piece, gc in zip(pieces[k], _chunks(g, n), strict=True):
                piece.grad = gc.mul_(coef) if coef != 1.0 else gc
        topt.step()
        topt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, p in model.named_parameters():
                new = master[k] if mw else torch.cat(pieces[k])[: p.numel()].view(p.shape)
                p.copy_(new)
        trace.append((s, False, true, clip))
    out = {"params": {k: p.detach().clone() for k, p in model.named_parameters()}, "trace": trace}
    if mw:
        out["master"] = {k: m.detach().clone() for k, m in master.items()}
    return out


def _train_all(configs: list[dict]) -> list[dict]:
    out = []
    for cfg in configs:
        base = _base(cfg)
        out.append(
            {
                "facade": _train_facade(base, cfg),
                "functional": _train_functional(base, cfg),
                "ref": _train_reference(base, cfg),
            }
        )
    return out


def _configs(dtype_name: str, n: int) -> list[dict]:
    """The configurations trained at ``n`` ranks.

    At 3 and 4 ranks every wire is float64 (``exact_wire``): three or four fp16/bf16/fp32
    addends sum exactly in float64 in any order, so zerofn's rows and DDP's buckets give
    the same mean; the configurations that differ only in their wire are then one, trained
    once. (What a low-precision wire does at 3 and 4 ranks is checked on one reduction,
    against its error bound, in ``test_low_precision_wires_sum_within_their_error_bound``.)
    """
    dtype = DTYPES[dtype_name]
    configs = []
    for mw in (True, False):
        # Stage 1 (no hooks, reduce_grads) with the working dtype on the wire; stage 2 (hooks,
        # overlapped buckets) with every communication dtype.
        configs.append(dict(dtype=dtype, stage=1, mw=mw, comm=dtype, clip=False, norm_type=2.0))
        for comm in (torch.float32, torch.float16, torch.bfloat16):
            configs.append(dict(dtype=dtype, stage=2, mw=mw, comm=comm, clip=False, norm_type=2.0))
    # Clipping after unscaling, both norm types.
    for stage, mw, norm_type in ((1, True, 2.0), (2, False, 2.0), (2, True, math.inf)):
        configs.append(dict(dtype=dtype, stage=stage, mw=mw, comm=dtype, clip=True, norm_type=norm_type))
    if dtype == torch.bfloat16:  # fp32 norms in a bf16 model, kept by the policy
        configs.append(dict(dtype=dtype, stage=2, mw=True, comm=None, clip=False, norm_type=2.0, model="mixed"))
    if exact_wire(n) is None:
        return configs
    unique: list[dict] = []
    for cfg in configs:
        cfg = {**cfg, "comm": exact_wire(n)}
        if cfg not in unique:
            unique.append(cfg)
    return unique


def _label(cfg: dict) -> str:
    comm = str(cfg["comm"]).replace("torch.", "")
    return (
        f"{str(cfg['dtype']).replace('torch.', '')} stage{cfg['stage']} mw={cfg['mw']} comm={comm} "
        f"clip={cfg['clip']} norm={cfg['norm_type']} {cfg.get('model', 'net')}"
    )


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_facade_and_functional_loop_are_bitwise_equal_to_the_ddp_references(world, dtype_name):
    # Exact at every world size: the local gradients are the same bits (a working-dtype
    # forward of the same params); the mean is too (one or two addends in any order at
    # N <= 2, whatever the wire; float64 wires at N >= 3, see _configs); 1/S and 1/N are
    # the same factors; the coefficient is ColossalAI's formula on both sides from float64
    # norms that differ at most in their last bit (which changes the float32 or
    # fp16/bf16 multiplier only within one float64 ulp of a rounding boundary: about
    # 2**-29 a step); float32 kernels give the same bits on a shard as on the whole
    # tensor, and the working-dtype SGD of the reference steps the shards' pieces.
    n = world.world_size
    configs = _configs(dtype_name, n)
    results = world.run(_train_all, configs)
    for i, cfg in enumerate(configs):
        label = f"N={n} {_label(cfg)}"
        per_rank = [r[i] for r in results]
        facade, ref = per_rank[0]["facade"], per_rank[0]["ref"]
        # Every rank ends with the same params; the functional loop with the facade's bits.
        for r in per_rank:
            assert_trees_equal(r["facade"]["params"], facade["params"])
            assert_trees_equal(r["functional"]["params"], r["facade"]["params"])
            assert_trees_equal(r["functional"]["master"], r["facade"]["master"])
            assert r["functional"]["loss_scale"] == r["facade"]["loss_scale"] == facade["loss_scale"]
            assert r["functional"]["step"] == r["facade"]["step"] == facade["step"]
        # The same steps skipped, under the same loss scales, as the reference.
        assert [t[:2] for t in facade["trace"]] == [t[:2] for t in ref["trace"]], label
        skipped = sum(t[1] for t in facade["trace"])
        assert facade["step"] == STEPS - skipped, label
        if cfg["dtype"] == torch.float16:
            assert 2 <= skipped <= 3, f"{label}: {skipped} skipped steps"  # the scaler overflowed and backed off
            assert facade["loss_scale"].scale == 2.0**15
        else:
            assert skipped == 0 and facade["loss_scale"] == zf.LossScaleState(1.0, 0, 0), label
        # get_grad_norm / info.grad_norm is the true (unscaled) norm, the reference's ||g|| / S:
        # float64 norms of the same gradient bits, equal but for float64 rounding (the max
        # of the inf-norm is exact).
        for (_, sk, norm, coef), (_, _, rnorm, rcoef) in zip(facade["trace"], ref["trace"], strict=True):
            if not sk:
                assert norm == pytest.approx(rnorm, rel=1e-12, abs=0.0), (label, norm, rnorm)
                assert (coef < 1.0) == cfg["clip"] and (rcoef < 1.0) == cfg["clip"], label
        shapes = {name: tuple(p.shape) for name, p in ref["params"].items()}
        master = full_master([r["facade"]["master"] for r in per_rank], shapes)
        assert all(bool(torch.isfinite(p).all()) for p in facade["params"].values()), label
        assert_trees_equal(facade["params"], ref["params"])
        if cfg["mw"]:
            assert all(t.dtype == torch.float32 for t in master.values()), label
            assert_trees_equal(master, ref["master"])
        else:
            assert all(master[k].dtype == v.dtype for k, v in ref["params"].items()), label
        # Not vacuous: training moved the params.
        initial = _prepare(_base(cfg), cfg)
        assert any(not torch.equal(p, facade["params"][k]) for k, p in initial.named_parameters()), label
        if cfg.get("model") == "mixed":
            dtypes = facade["layout_dtypes"]
            assert dtypes["norm.weight"] == dtypes["norm.bias"] == torch.float32
            assert dtypes["a.weight"] == dtypes["b.bias"] == torch.bfloat16


# --------------------------------------------------------------------------- overflow on one rank


def _inf_on_last_rank(api: str, variant: str) -> dict[str, Any]:
    """One good step, then only the last rank's b.bias gradient gets an inf: every rank skips.

    ``variant``: ``"pure"`` / ``"donate"`` for the functional API, ``"stage1"`` / ``"stage2"``
    (hooks and overlap) for the facade, which always donates.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    scaler = dict(initial_scale=2.0**10, hysteresis=1, growth_interval=100)
    torch.manual_seed(seeded(0))
    model = Net().half()
    data = batches(rank, 2)
    x, y = next(data)
    if api == "functional":
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        policy = PrecisionPolicy.for_dtype(torch.float16, loss_scaler=DynamicLossScaler(**scaler))
        state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=policy)

        def grads_for(x, y):
            def loss(p):
                return zf.scale_loss(_loss(functional_call(model, p, (x.half(),)), y.half()), state.loss_scale)

            g = dict(grad(loss)(params))
            del g["unused.weight"], g["unused.bias"]
            return g

        state, info = zf.step_shards(state, zf.reduce_grads(grads_for(x, y), state.layout, precision=state.precision))
        assert not info.skipped
        x, y = next(data)
        g = grads_for(x, y)
        if rank == n - 1:
            g["b.bias"] = g["b.bias"].index_fill(0, torch.tensor([0]), math.inf)
        shards = zf.reduce_grads(g, state.layout, precision=state.precision)
        local_bad = zf.precision.nonfinite_grad_names(shards)
        before = Snapshot((state.master, state.opt_state))
        new, info = zf.step_shards(state, shards, donate=variant == "donate")
        before.assert_unchanged((new.master, new.opt_state), "master and optimizer state after the skip")
        assert new.master is state.master and new.opt_state is state.opt_state
        return {"info": info, "loss_scale": new.loss_scale, "step": new.step, "local_bad": local_bad}
    stage2 = variant == "stage2"
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=stage2, overlap_communication=stage2, **scaler
    )
    opt.backward(_loss(model(x.half()), y.half()))
    opt.step()
    opt.zero_grad()
    x, y = next(data)
    params_before = {k: p.detach().clone() for k, p in model.named_parameters()}
    before = Snapshot((opt.state.master, opt.state.opt_state))
    hook = model.b.bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf)) if rank == n - 1 else None
    opt.backward(_loss(model(x.half()), y.half()))
    if hook is not None:
        hook.remove()
    opt.step()
    opt.zero_grad()
    before.assert_unchanged((opt.state.master, opt.state.opt_state), "master and optimizer state after the skip")
    assert_trees_equal({k: p.detach() for k, p in model.named_parameters()}, params_before)
    return {"info": opt.last_step_info, "loss_scale": opt.state.loss_scale, "step": opt.state.step, "local_bad": None}


@pytest.mark.parametrize(
    ("api", "variant"), [("functional", "pure"), ("functional", "donate"), ("facade", "stage1"), ("facade", "stage2")]
)
def test_an_inf_on_one_rank_skips_the_step_and_backs_off_the_scale_on_every_rank(world, api, variant):
    results = world.run(_inf_on_last_rank, api, variant)
    for r in results:
        assert r["info"].skipped and r["info"].grad_norm == math.inf
        assert r["step"] == 1  # the first, good step only
        # 1024 -> 512: hysteresis 1 backs off at the first overflow; the tracker (1 after
        # the good step) is reset. The same state on every rank.
        assert r["loss_scale"] == zf.LossScaleState(512.0, 0, 0)
    if api == "functional":
        # The inf lands in b.bias[0], rank 0's shard after the reduction; the other ranks
        # hold finite shards and still skip: the decision is global.
        assert results[0]["local_bad"] == ["b.bias"]
        assert all(r["local_bad"] == [] for r in results[1:])


# --------------------------------------------------------------------------- NaN in bf16


def _bf16_loss(params, model, x, y):
    return _loss(functional_call(model, params, (x.bfloat16(),)), y.bfloat16())


def _nan_in_bf16(api: str, nonfinite: str) -> dict[str, Any]:
    """The last rank's a.weight gradient gets a NaN in the second step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seeded(0))
    model = Net()
    data = batches(rank, 3)
    out: dict[str, Any] = {}
    if api == "functional":
        model = model.to(torch.bfloat16)
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        state = zf.shard_params(
            params, zf.optim.adamw(lr=1e-2), precision=PrecisionPolicy.for_dtype(torch.bfloat16, nonfinite=nonfinite)
        )
        for step, (x, y) in enumerate(data):
            g = dict(grad(_bf16_loss)(params, model, x, y))
            del g["unused.weight"], g["unused.bias"]
            if step == 1 and rank == n - 1:
                g["a.weight"] = g["a.weight"].index_fill(1, torch.tensor([3]), math.nan)
            shards = zf.reduce_grads(g, state.layout, precision=state.precision)
            try:
                new, info = zf.step_shards(state, shards)
            except NonFiniteGradError as e:
                out["error"] = str(e)
                continue  # the state is unchanged and usable
            out.setdefault("skipped", []).append(info.skipped)
            if info.skipped:
                assert new is state  # nothing to advance without loss scaling
            state = new
            params = zf.gather_params(state)
        out.update(step=state.step, params=params)
        return out
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), forced_dtype=torch.bfloat16, nonfinite=nonfinite, module=model
    )
    for step, (x, y) in enumerate(data):
        opt.zero_grad()  # also after a refused step: its gradients are still in p.grad, as with DDP
        hook = None
        if step == 1 and rank == n - 1:
            hook = model.a.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([3]), math.nan))
        opt.backward(_loss(model(x.bfloat16()), y.bfloat16()))
        if hook is not None:
            hook.remove()
        try:
            opt.step()
        except NonFiniteGradError as e:
            out["error"] = str(e)
            continue
        out.setdefault("skipped", []).append(opt.last_step_info.skipped)
    out.update(step=opt.state.step, params={k: p.detach().clone() for k, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
@pytest.mark.parametrize("api", ["functional", "facade"])
def test_a_nan_gradient_in_bf16_is_skipped_or_raised_as_configured(world, api, nonfinite):
    results = world.run(_nan_in_bf16, api, nonfinite)
    for rank, r in enumerate(results):
        assert r["step"] == 2, (rank, r.get("skipped"))  # steps 0 and 2 applied, step 1 not
        assert all(bool(torch.isfinite(p).all()) for p in r["params"].values())
        if nonfinite == "skip":
            assert r["skipped"] == [False, True, False] and "error" not in r
        else:
            assert r["skipped"] == [False, False]
            # Every rank raises, naming the param and where its non-finite shard lives.
            assert f"step_shards on rank {rank}: gradients of these params hold inf or nan: 'a.weight'" in r["error"]
            assert "nonfinite='raise'" in r["error"]
        assert_trees_equal(r["params"], results[0]["params"])


# --------------------------------------------------------------------------- accumulation


def _accumulate(stage: int, overlap: bool, accum_dtype: Any) -> dict[str, Any]:
    """bf16 params, 4 micro-batches per step under no_sync, against a hand-made reference.

    The reference accumulates the micro-batch gradients of a plain bf16 model in
    ``accum_dtype`` (float32: ``acc += p.grad`` in float32; None: p.grad in bf16 as autograd
    sums it), then reduces each as ColossalAI does (``acc * (1/N)``, bf16 on the wire, summed,
    cast back) and steps AdamW on fp32 masters. Layer drop inside the window: ``gate`` misses
    some micro-batches, the closing one included in step 2 (its accumulated gradient is then
    reduced by ``step()``). The wire is bf16 (the working dtype) up to 2 ranks, float64 from
    3 on (``exact_wire``) on both sides, so the mean has the same bits on both.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype, micro, steps = torch.bfloat16, 4, 3
    wire = exact_wire(n) or dtype
    torch.manual_seed(seeded(0))
    base = Net()
    model = copy.deepcopy(base)
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), **ADAMW),
        forced_dtype=dtype,
        grad_accum_dtype=accum_dtype,
        communication_dtype=exact_wire(n),
        partition_grad=stage == 2,
        overlap_communication=overlap,
        reduce_bucket_size=BUCKET,
        module=model,
    )
    ref = copy.deepcopy(base).to(dtype)
    master = {k: p.detach().float().clone().requires_grad_(True) for k, p in ref.named_parameters()}
    ropt = torch.optim.AdamW(master.values(), **ADAMW)
    data = batches(rank, steps * micro)
    no_sync_bytes, accum_seen = 0, []
    for step in range(steps):
        acc: dict[str, torch.Tensor] = {}
        for m in range(micro):
            x, y = next(data)
            use_gate = gate_used(step * micro + m)
            last = m == micro - 1
            with opt.no_sync() if not last else contextlib.nullcontext(), zf.count_bytes() as counter:
                opt.backward(_loss(model(x.to(dtype), use_gate), y.to(dtype)))
            if not last:
                no_sync_bytes += counter.bytes_sent
                held = {k: (t.dtype, t.numel()) for k, t in opt._reducer.accum.items()}
                grads = {k: p.grad.dtype for k, p in model.named_parameters() if p.grad is not None}
                accum_seen.append((held, grads, opt.grad_bytes()))
            _loss(ref(x.to(dtype), use_gate), y.to(dtype)).backward()
            if accum_dtype is not None:
                for k, p in ref.named_parameters():
                    if p.grad is not None:
                        acc[k] = p.grad.float() if k not in acc else acc[k].add_(p.grad)
                        p.grad = None
        if accum_dtype is None:
            acc = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
        for k, a in acc.items():
            mean = a.mul(1.0 / n).to(wire)
            dist.all_reduce(mean)
            master[k].grad = mean.to(a.dtype).float()
        ropt.step()
        ropt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, p in ref.named_parameters():
                p.copy_(master[k])
        opt.step()
        opt.zero_grad()
    return {
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "ref": {k: p.detach().clone() for k, p in ref.named_parameters()},
        "master": {k: t.clone() for k, t in opt.state.master.items()},
        "ref_master": {k: t.detach().clone() for k, t in master.items()},
        "no_sync_bytes": no_sync_bytes,
        "accum_seen": accum_seen,
    }


ACCUM_CONFIGS = [(1, False, "auto"), (2, True, "auto"), (2, False, None)]


def _accumulate_all() -> list[dict[str, Any]]:
    return [_accumulate(*c) for c in ACCUM_CONFIGS]


def test_no_sync_accumulates_in_float32_and_matches_the_reference(world):
    # Bitwise at every world size: the same micro-batch gradients (a bf16 forward of the
    # same params), accumulated in the same dtype in the same order; the mean of the same
    # bits (two bf16 addends in either order at N <= 2, an exact float64 sum at N >= 3);
    # AdamW's float32 kernels on a shard as on the whole master.
    n = world.world_size
    results = world.run(_accumulate_all)
    numel = {k: p.numel() for k, p in Net().named_parameters()}
    for i, (stage, overlap, accum) in enumerate(ACCUM_CONFIGS):
        label = f"N={n} stage{stage} overlap={overlap} accum={accum}"
        res = [r[i] for r in results]
        r0 = res[0]
        assert r0["no_sync_bytes"] == 0, label
        for held, grads, nbytes in r0["accum_seen"]:
            if accum == "auto":
                # Each micro-batch's p.grad went into a float32 accumulator at once.
                assert grads == {} and held and all(d == torch.float32 for d, _ in held.values()), label
                assert nbytes == sum(4 * numel[k] for k in held), label  # Ψ·4 bytes held
            else:
                assert held == {} and grads and set(grads.values()) == {torch.bfloat16}, label
                assert nbytes == sum(2 * numel[k] for k in grads), label
        for r in res:
            assert_trees_equal(r["params"], r0["params"])
        shapes = {k: tuple(t.shape) for k, t in r0["ref"].items()}
        master = full_master([r["master"] for r in res], shapes)
        assert_trees_equal(r0["params"], r0["ref"])
        assert_trees_equal(master, r0["ref_master"])
    # The accumulation dtype matters: float32 and bf16 accumulation give different params.
    assert any(not torch.equal(results[0][0]["params"][k], results[0][2]["params"][k]) for k in results[0][0]["params"])


# --------------------------------------------------------------------------- reduce_grads dtypes


def _reduce_dtypes() -> dict[str, Any]:
    rank = dist.get_rank()
    params = {"w": torch.zeros(7, 13, dtype=torch.bfloat16), "b": torch.zeros(13, dtype=torch.bfloat16)}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), precision=PrecisionPolicy.for_dtype(torch.bfloat16))
    gen = torch.Generator().manual_seed(seeded(rank))
    acc = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}  # float32 accumulators
    out: dict[str, Any] = {}
    for comm in (None, torch.float32):
        with zf.count_bytes() as c:
            shards = zf.reduce_grads(acc, state.layout, stage=1, comm_dtype=comm, precision=state.precision)
        out[str(comm)] = ({k: v.clone() for k, v in shards.items()}, c.by_collective.get("all_reduce", 0))
    try:
        zf.reduce_grads({"w": acc["w"], "b": acc["b"].bfloat16()}, state.layout, precision=state.precision)
    except ValueError as e:
        out["mixed_error"] = str(e)
    out["acc"] = acc
    return out


def test_reduce_grads_takes_float32_accumulators_sends_the_wire_dtype_and_casts_back(worlds):
    n = 2
    results = worlds[n].run(_reduce_dtypes)
    layout = zf.make_layout(
        {"w": torch.zeros(7, 13, dtype=torch.bfloat16), "b": torch.zeros(13, dtype=torch.bfloat16)}, n
    )
    for rank, r in enumerate(results):
        default, default_bytes = r["None"]
        wide, wide_bytes = r["torch.float32"]
        assert all(t.dtype == torch.float32 for t in (*default.values(), *wide.values()))
        assert wide_bytes == 2 * default_bytes > 0  # bf16 (the working dtype) on the wire by default
        for k in ("w", "b"):
            # The mean as ColossalAI computes it: acc * (1/N) per rank, cast to the wire, summed.
            for shards, wire in ((default, torch.bfloat16), (wide, torch.float32)):
                total = sum((res["acc"][k] * (1.0 / n)).to(wire) for res in results).to(torch.float32)
                spec = layout[k]
                start, stop = spec.owned_range(rank)
                assert torch.equal(shards[k][: stop - start], total.reshape(-1)[start:stop]), (k, wire)
        assert "params of one bucket have gradients in different dtypes" in r["mixed_error"]
        assert "'w': torch.float32" in r["mixed_error"] and "'b': torch.bfloat16" in r["mixed_error"]


LOW_WIRES = (torch.bfloat16, torch.float16)


def _low_wire_sums() -> dict[str, Any]:
    """One ``reduce_grads`` of float32 gradients over each low-precision wire (and fp32, for its bytes)."""
    torch.manual_seed(seeded(0))
    params = {k: p.detach() for k, p in Net().named_parameters()}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1))
    gen = torch.Generator().manual_seed(seeded(10 + dist.get_rank()))
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    out: dict[str, Any] = {"grads": grads}
    for wire in (*LOW_WIRES, torch.float32):
        with zf.count_bytes() as c:
            shards = zf.reduce_grads(grads, state.layout, bucket_numel=BUCKET, comm_dtype=wire)
        out[str(wire)] = ({k: v.clone() for k, v in shards.items()}, c.by_collective.get("all_to_all", 0))
    return out


@pytest.mark.parametrize("n", [3, 4], ids=["N3", "N4"])
def test_low_precision_wires_sum_within_their_error_bound(worlds, n):
    r"""At 3 and 4 ranks a bf16 or fp16 wire is not exact, so one reduction is checked
    against the error bound of a sum, fixed by the arithmetic.

    Each rank puts :math:`b_i` = ``(g_i * (1/N)).to(wire)`` on the wire (computed here as
    zerofn computes it: the same bits), and the owner adds the :math:`N` addends in the wire
    dtype (gloo's default realisation: in rank order; the bound holds for any order). Any
    order of the :math:`N - 1` additions, each rounding once
    (relative error at most the wire's unit roundoff :math:`u`, 2^-8 for bf16, 2^-11 for
    fp16, or half a subnormal spacing :math:`\eta/2` in absolute terms), leaves
    :math:`|\hat s - s| \le \gamma_{N-1} \sum_i |b_i| + (N - 1)\,\eta / 2` with
    :math:`\gamma_k = k u / (1 - k u)` and :math:`s` the exact sum (float64 holds it: a
    sum of four bf16/fp16 numbers of the range here is exact). Casting back to float32 is
    exact. A wrong mean (a missing rank, a wrong factor, another element) is off by a
    whole addend, about :math:`|s|`.
    """
    results = worlds[n].run(_low_wire_sums)
    layout = zf.make_layout({k: p.detach() for k, p in Net().named_parameters()}, n)
    for wire in LOW_WIRES:
        finfo = torch.finfo(wire)
        u = finfo.eps / 2
        gamma = (n - 1) * u / (1 - (n - 1) * u)
        eta = finfo.smallest_normal * finfo.eps  # the subnormal spacing
        rounded, worst = False, 0.0
        for rank, r in enumerate(results):
            shards, nbytes = r[str(wire)]
            assert 2 * nbytes == r[str(torch.float32)][1] > 0, wire  # two bytes an element on the wire
            for k, shard in shards.items():
                addends = torch.stack([(res["grads"][k] * (1.0 / n)).to(wire).double() for res in results])
                exact, size = addends.sum(0).reshape(-1), addends.abs().sum(0).reshape(-1)
                start, stop = layout[k].owned_range(rank)
                got = shard[: stop - start].double()
                err = (got - exact[start:stop]).abs()
                bound = gamma * size[start:stop] + (n - 1) * eta / 2
                assert bool((err <= bound).all()), (wire, k, float((err / bound).max()))
                rounded |= bool((got != exact[start:stop]).any())
                worst = max(worst, float((err / bound).max())) if err.numel() else worst
        assert rounded, f"{wire}: no sum rounded: the wire was not {wire}"
        print(f"N={n} {wire}: the largest error is {worst:.2f} of the bound")


# --------------------------------------------------------------------------- state and purity


def _fp16_purity(donate: bool) -> bool:
    rank = dist.get_rank()
    torch.manual_seed(seeded(0))
    params = {k: p.detach().half() for k, p in Net().named_parameters()}
    snap = Snapshot(params)
    policy = PrecisionPolicy.for_dtype(
        torch.float16, loss_scaler=DynamicLossScaler(initial_scale=2.0**14, growth_interval=2)
    )
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), precision=policy)
    snap.assert_unchanged(params, "shard_params")
    assert state.precision is policy and state.loss_scale == zf.LossScaleState(2.0**14, 0, 2)
    assert all(t.dtype == torch.float32 for t in state.master.values())
    assert all(s.dtype == torch.float16 for s in state.layout.params)
    gen = torch.Generator().manual_seed(seeded(rank))
    for step in range(4):
        grads = {k: (torch.randn(p.shape, generator=gen) * 64).half() for k, p in params.items()}
        if step == 2:
            grads["a.bias"][0] = math.inf
        snap = Snapshot(grads)
        shards = zf.reduce_grads(grads, state.layout, precision=state.precision)
        snap.assert_unchanged(grads, "reduce_grads")
        copy_state = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
        copy_shards = {k: v.clone() for k, v in shards.items()}
        snap = Snapshot((state, shards))
        pure, info = zf.step_shards(state, shards, max_norm=1.0)
        snap.assert_unchanged((state, shards), "step_shards")
        if donate:
            donated, dinfo = zf.step_shards(copy_state, copy_shards, max_norm=1.0, donate=True)
            assert dinfo == info and donated.loss_scale == pure.loss_scale and donated.step == pure.step
            assert_trees_equal(donated.master, pure.master)
        assert info.skipped == (step == 2)
        state = pure
        snap = Snapshot(state)
        full = zf.gather_params(state)
        snap.assert_unchanged(state, "gather_params")
        assert all(full[k].dtype == torch.float16 for k in full)
    # 2^14: good, good (grows to 2^15: interval 2), overflow (hysteresis 2 absorbs), good.
    assert state.loss_scale == zf.LossScaleState(2.0**15, 1, 1) and state.step == 3
    return True


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_stage_functions_stay_pure_under_fp16_loss_scaling(world, donate):
    assert world.run(_fp16_purity, donate) == [True] * world.world_size


def _master_weights_off() -> dict[str, Any]:
    torch.manual_seed(seeded(0))  # the same weights on every rank, whatever the pool ran before
    params = {k: p.detach() for k, p in Net().named_parameters()}
    policy = PrecisionPolicy.for_dtype(torch.bfloat16, master_weights=False)
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), precision=policy)
    full = zf.gather_params(state)
    return {
        "master": {k: t.dtype for k, t in state.master.items()},
        "full": {k: t.dtype for k, t in full.items()},
        "rounded": all(torch.equal(full[k], p.bfloat16()) for k, p in params.items()),
        "nbytes": state.nbytes,
        "fp32_nbytes": zf.shard_params(
            params, zf.optim.sgd(lr=0.1), precision=policy.replace(master_weights=True)
        ).nbytes,
    }


def test_forced_dtype_rounds_the_params_and_master_weights_off_keeps_working_dtype_shards(worlds):
    for r in worlds[2].run(_master_weights_off):
        assert set(r["master"].values()) == set(r["full"].values()) == {torch.bfloat16}
        assert r["rounded"]  # fp32 params given, bf16 forced: the gather is the params rounded to bf16
        assert 2 * r["nbytes"] == r["fp32_nbytes"]


# --------------------------------------------------------------------------- facade options


def _facade(model: nn.Module, **kwargs: Any) -> zf.ZeroOptimizer:
    return zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_mixed_dtypes_raise_naming_the_params_unless_the_policy_says_how():
    model = Net().to(torch.bfloat16)
    model.b.float()
    before = {k: (p.dtype, p.detach().clone()) for k, p in model.named_parameters()}
    with pytest.raises(MixedDtypeError) as err:
        _facade(model, module=model)
    msg = str(err.value)
    assert msg.startswith("ZeroOptimizer: params have mixed dtypes")
    assert "torch.float32: 'b.weight', 'b.bias'" in msg and "'a.weight'" in msg
    assert "forced_dtype=<dtype>" in msg and "mixed_dtypes='keep'" in msg
    # Nothing was cast or changed by the failed call.
    assert all(p.dtype == before[k][0] and torch.equal(p, before[k][1]) for k, p in model.named_parameters())


def test_facade_option_conflicts_raise_before_anything_changes():
    model = Net().half()
    with pytest.raises(ValueError, match="nonfinite='raise' needs bf16 or fp32 params"):
        _facade(model, nonfinite="raise")
    with pytest.raises(TypeError, match=r"got precision=PrecisionPolicy\(\.\.\.\) and also communication_dtype"):
        _facade(model, precision=PrecisionPolicy.for_dtype(torch.float16), communication_dtype=torch.float32)
    with pytest.raises(ValueError, match="nonfinite must be 'skip' or 'raise'"):
        _facade(model, nonfinite="ignore")
    with pytest.raises(ValueError, match="DynamicLossScaler: growth_factor must be > 1"):
        _facade(model, growth_factor=1.0)
    assert all(p.dtype == torch.float16 for p in model.parameters())


def _facade_policies() -> dict[str, Any]:
    out = {}
    model = Net()
    opt = _facade(
        model, forced_dtype=torch.float16, initial_scale=2.0**8, growth_interval=7, hysteresis=3, max_scale=2.0**20
    )
    out["fp16"] = (opt.precision, opt.loss_scale, {p.dtype for p in model.parameters()})
    opt = _facade(
        Net().bfloat16(), communication_dtype=torch.float32, cpu_offload=True, master_weights=False, nonfinite="raise"
    )
    out["bf16"] = (opt.precision, opt.loss_scale, {t.device.type for t in opt.state.master.values()})
    return out


def test_facade_builds_the_policy_from_the_seed_options(worlds):
    fp16, bf16 = worlds[1].run(_facade_policies)[0].values()
    policy, scale, dtypes = fp16
    assert dtypes == {torch.float16} and scale == 256.0
    assert policy.loss_scaler == DynamicLossScaler(
        initial_scale=2.0**8,
        min_scale=1,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=7,
        hysteresis=3,
        max_scale=2.0**20,
    )
    assert policy.param_dtype == torch.float16 and policy.master_weights and policy.grad_accum_dtype == "auto"
    policy, scale, devices = bf16
    assert policy.loss_scaler == NoLossScaling() and scale == 1.0
    assert policy.comm_dtype == torch.float32 and policy.state_device == "cpu" and devices == {"cpu"}
    assert not policy.master_weights and policy.nonfinite == "raise"


def _disagreeing_precision() -> Any:
    model = Net()
    comm = torch.bfloat16 if dist.get_rank() == dist.get_world_size() - 1 else None
    try:
        _facade(model, forced_dtype=torch.bfloat16, communication_dtype=comm)
    except zf.RankMismatchError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_precision_options_all_raise(worlds):
    for message in worlds[2].run(_disagreeing_precision):
        assert "ranks disagree before any shard was exchanged" in message and "precision" in message
