"""State as DDP keeps it, against DDP + the same torch optimizer on real gloo ranks.

Every rank builds its model from its own seed (``torch.manual_seed(seeded(100 + rank))``, as
scripts that seed per rank for data augmentation do), the model has BatchNorm buffers, and
each test runs DDP and the facade side by side in the same process on the same batches,
comparing params and buffers after every operation:

* construction: every rank starts from rank 0's params and buffers (DDP's broadcast);
  the functional path checks the ranks' values (``RankMismatchError``) or syncs them;
* buffers: rank 0's broadcast before each training forward (``broadcast_buffers``), saved
  and restored by checkpoints;
* gradients never zeroed carry into the next step as DDP's do;
* user writes before a checkpoint are in the checkpoint;
* a collective entry point called on some ranks only fails in bounded time.

Tolerance: bitwise. At N = 1, 2 on the default fp32 wire (the mean of two gradients does
not depend on the order of the sum); at N = 3, 4 on a float64 wire on both sides
(``helpers.exact_wire``: the facade's ``communication_dtype=torch.float64``, DDP's
``helpers.float64_wire_hook``), where the sum of N fp32 addends is exact in any order.
The default fp32 wire at N = 3, 4 is checked with SGD against the error-analysis bound
``helpers.fp32_wire_sgd_bound``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import get_world
from helpers import bits, exact_wire, float64_wire_hook, fp32_wire_sgd_bound, max_rel_diff, seeded
from hypothesis import given, settings
from hypothesis import strategies as st

import zerofn as zf


class BNNet(nn.Module):
    """Two linear layers around a BatchNorm1d: params and buffers (float running stats, an int64 counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def _seeded_model() -> BNNet:
    """A BNNet seeded per rank (different initial weights on every rank, as DDP scripts allow)."""
    torch.manual_seed(seeded(100 + dist.get_rank()))
    return BNNet()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seeded(1000 * step + dist.get_rank()))
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def _states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest relative difference over every entry (ints compared exactly: any difference is inf)."""
    worst = 0.0
    for n, x in a.items():
        y = b[n]
        if not x.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(x, y) else float("inf"))
            continue
        scale = y.abs().max().item() or 1.0
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def _equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if not torch.equal(bits(a[n]), bits(b[n]))]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _twins(stage: int, **options: Any) -> tuple[nn.Module, Any, nn.Module, zf.ZeroOptimizer]:
    """(DDP model, its AdamW, the facade's model, the facade), each built from this rank's own seed.

    ``communication_dtype=torch.float64`` in ``options`` puts DDP on the same float64 wire
    (``helpers.float64_wire_hook``), the pair bitwise at any world size (tests/helpers.py,
    "the exact wire").
    """
    ref = _seeded_model()
    ddp = nn.parallel.DistributedDataParallel(ref)
    if options.get("communication_dtype") is not None:
        assert options["communication_dtype"] == torch.float64
        ddp.register_comm_hook(None, float64_wire_hook)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    model = _seeded_model()
    zopt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        partition_grad=stage == 2,
        module=model,
        reduce_bucket_size=64,
        **options,
    )
    return ddp, ref_opt, model, zopt


def _train_step(model: nn.Module, opt: Any, step: int, *, zero: bool = True) -> None:
    x, y = _batch(step)
    if zero:
        opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def _seeded_per_rank_run(stage: int, steps: int) -> dict[str, Any]:
    """DDP and the facade from per-rank seeds, on the exact wire: which params and buffers
    differ in any bit after construction and after each step, and how far training moved them."""
    ddp, ref_opt, model, zopt = _twins(stage, communication_dtype=exact_wire(dist.get_world_size()))
    initial = _params(ddp.module)
    out: dict[str, Any] = {"init": _equal_bits(_states(ddp.module), _states(model)), "differ": []}
    for step in range(steps):
        _train_step(ddp, ref_opt, step)
        _train_step(model, zopt, step)
        out["differ"].append(_equal_bits(_states(ddp.module), _states(model)))
    out["moved"] = max_rel_diff(_params(ddp.module), initial)
    zopt.close()
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_per_rank_seeded_batchnorm_model_trains_as_ddp(n, stage):
    """Params and buffers bitwise DDP's on every rank after construction and after each of 3 steps.

    Why exact: construction and the buffers are broadcasts of rank 0's values on both sides
    (DDP's ``broadcast_buffers`` and the facade's, before each training forward), which copy
    bits; every rank then runs the same forward on the same values and batch. The mean
    gradient is DDP's bit for bit on the exact wire (``helpers.exact_wire``: fp32 at
    N <= 2, where a sum of two addends does not depend on its order; float64 from N = 3 on
    both sides, where the sum of N fp32 addends is exact in any order), and the same torch
    AdamW steps on the same bits. Any difference is a logic error.
    """
    results = get_world(n).run(_seeded_per_rank_run, stage, 3)
    for rank, r in enumerate(results):
        assert r["init"] == [], f"rank {rank}: construction left {r['init']} different from DDP's (rank 0's)"
        for step, differ in enumerate(r["differ"]):
            assert differ == [], f"rank {rank}: {differ} differ from DDP after step {step}"
        assert r["moved"] > 1e-3, f"rank {rank}: training moved the params by {r['moved']:.3g} only"


def _seeded_per_rank_sgd_over_fp32(stage: int, steps: int, lr: float, momentum: float) -> dict[str, Any]:
    """DDP and the facade from per-rank seeds, SGD with momentum over the default fp32 wire:
    the largest params difference and the bound's inputs (the largest gradient element
    either side held, the largest param element)."""
    ref = _seeded_model()
    ddp = nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    model = _seeded_model()
    zopt = zf.ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        partition_grad=stage == 2,
        module=model,
        reduce_bucket_size=64,
    )
    initial = _params(ddp.module)
    grad_max = 0.0
    for step in range(steps):
        _train_step(ddp, ref_opt, step)
        grad_max = max([grad_max, *(p.grad.abs().max().item() for p in ddp.parameters())])
        _train_step(model, zopt, step)
    theirs, ours = _params(ddp.module), _params(model)
    param_max = max(t.abs().max().item() for t in [*theirs.values(), *initial.values()])
    out = {
        "diff": max_rel_diff(ours, theirs),
        "moved": max_rel_diff(theirs, initial),
        "grad_max": grad_max,
        "param_max": param_max,
        "counter": _equal_bits({"n": ddp.module.bn.num_batches_tracked}, {"n": model.bn.num_batches_tracked}),
    }
    zopt.close()
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("n", [3, 4])
def test_per_rank_seeded_batchnorm_model_over_the_fp32_wire_stays_within_the_sgd_bound(n, stage):
    """The default fp32 wire at N = 3, 4, what users run: within ``helpers.fp32_wire_sgd_bound``.

    The two sides add an element's N addends in other orders there (gloo's order depends
    on the element's offset in the flat buffer), so the mean gradients differ in last bits.
    SGD does not amplify them (no division by a small second moment), and 3 steps of
    lr 0.05 leave the bound ``2**3 * 3 * (2 (N + 1) u lr G / ((1 - momentum) P) + 2u)``
    (derived at ``fp32_wire_sgd_bound``; ``G`` the largest gradient element, ``P`` the
    largest param element of the run), below 1e-5 here, where a logic error (a wrong mean,
    a missed buffer broadcast feeding other statistics into the forward) moves params by
    ``lr * G`` a step, orders of magnitude more.
    """
    steps, lr, momentum = 3, 0.05, 0.9
    for rank, r in enumerate(get_world(n).run(_seeded_per_rank_sgd_over_fp32, stage, steps, lr, momentum)):
        bound = fp32_wire_sgd_bound(
            steps=steps, world=n, lr=lr, momentum=momentum, grad_max=r["grad_max"], param_max=r["param_max"]
        )
        assert r["diff"] <= bound, f"rank {rank}: {r['diff']:.3g} against DDP over fp32, bound {bound:.3g}"
        assert r["counter"] == [], f"rank {rank}: num_batches_tracked differs from DDP's"
        assert r["moved"] > 100 * bound, f"rank {rank}: training moved the params by {r['moved']:.3g} only"


def _functional_start() -> dict[str, Any]:
    """shard_params over per-rank params: the default check raises; sync=True and broadcast_params agree."""
    model = _seeded_model()
    params = dict(model.named_parameters())
    out: dict[str, Any] = {}
    try:
        zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    except zf.RankMismatchError as e:
        out["error"] = str(e)
    before = {n: p.detach().clone() for n, p in params.items()}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), sync=True)
    out["unchanged"] = _equal_bits(before, {n: p.detach() for n, p in params.items()}) == []
    out["gathered"] = zf.gather_params(state)
    from zerofn import _comm_setup

    _comm_setup.BROADCAST_NUMEL, numel = 7, _comm_setup.BROADCAST_NUMEL  # several flat buffers (and one param alone)
    try:
        synced = zf.broadcast_params(params, out=params)  # into the model, in place
    finally:
        _comm_setup.BROADCAST_NUMEL = numel
    out["model"] = _states(model)
    out["same_tensors"] = all(synced[n] is params[n] for n in params)
    out["checks"] = zf.shard_params(params, zf.optim.adamw(lr=1e-2)).step == 0  # agrees now: no error
    return out


def test_functional_start_checks_values_or_syncs_them():
    results = get_world(2).run(_functional_start)
    for r in results:
        assert "param 'a.weight' holds different values on rank 0 and rank 1" in r["error"], r.get("error")
        assert "zf.broadcast_params(params, group)" in r["error"] and "sync=True" in r["error"]
        assert r["unchanged"] and r["same_tensors"] and r["checks"]
    torch.manual_seed(seeded(100))
    rank0 = _states(BNNet())
    for r in results:
        assert _equal_bits(r["gathered"], rank0) == []
        assert _equal_bits(r["model"], rank0) == []  # buffers were not in params: BNNet's initial buffers alike


def _pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(seeded(7))
    return BNNet().state_dict()


def _edit(model: nn.Module, edit: str) -> None:
    if edit == "load":
        model.load_state_dict(_pretrained())
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.1, 0.1)


def _writes_then_checkpoint(stage: int, edit: str, path: str) -> list[str]:
    """Weights written, then a checkpoint saved and loaded (or a state-dict round trip), then a step, as DDP."""
    ddp, ref_opt, model, zopt = _twins(stage)
    for step in range(2):
        _train_step(ddp, ref_opt, step)
        _train_step(model, zopt, step)
    _edit(ddp.module, edit)
    _edit(model, edit)
    if path:
        zopt.save_checkpoint(path)
        zopt.load_checkpoint(path)
    else:
        zopt.load_state_dict(zopt.state_dict())
        ref_opt.load_state_dict(ref_opt.state_dict())
    _train_step(ddp, ref_opt, 2)
    _train_step(model, zopt, 2)
    zopt.close()
    return _equal_bits(_states(ddp.module), _states(model))


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("edit", ["load", "clamp"])
def test_weights_written_before_a_checkpoint_are_in_it(tmp_path, stage, edit):
    """model.load_state_dict / in-place clamp, then save and load (or state-dict round trip), then a step: as DDP."""
    for path in (str(tmp_path / "ckpt"), ""):
        for rank, differ in enumerate(get_world(2).run(_writes_then_checkpoint, stage, edit, path)):
            assert differ == [], f"rank {rank} ({'checkpoint' if path else 'state_dict'}): {differ} differ from DDP"


def _without_zero_grad(stage: int, overlap: bool, how: str) -> dict[str, Any]:
    """4 steps with no zero_grad (``how="none"``), or with model.zero_grad() / zero_grad(set_to_none=False)."""
    ddp, ref_opt, model, zopt = _twins(stage, overlap_communication=overlap)
    out: dict[str, Any] = {"error": None}
    for step in range(4):
        for m, opt in ((ddp, ref_opt), (model, zopt)):
            if how == "model":
                (m.module if m is ddp else m).zero_grad()
            elif how == "keep":
                opt.zero_grad(set_to_none=False)
            x, y = _batch(step)
            loss = ((m(x) - y) ** 2).mean()
            try:
                zopt.backward(loss) if opt is zopt and step % 2 else loss.backward()
            except RuntimeError as e:
                out["error"] = out["error"] or str(e)
                out.setdefault("step", step)
                zopt.zero_grad()  # what the message says: zero, run forward and backward again
                ((m(x) - y) ** 2).mean().backward()
            opt.step()
    out["differ"] = _equal_bits(_states(ddp.module), _states(model))
    zopt.close()
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_gradients_not_zeroed_carry_as_ddp_or_raise(stage, overlap):
    """Stage 1: the sum of every gradient since the last zeroing, bitwise DDP's; stage 2: every rank raises."""
    world = get_world(2)
    for rank, r in enumerate(world.run(_without_zero_grad, stage, overlap, "none")):
        if stage == 1:
            assert r["error"] is None and r["differ"] == [], (rank, r)
        else:
            assert r["step"] == 1 and "backward after step() without zero_grad()" in r["error"], (rank, r)
            assert "optimizer.zero_grad()" in r["error"] and "stage 2" in r["error"]
    for how in ("model", "keep"):
        for rank, r in enumerate(world.run(_without_zero_grad, stage, overlap, how)):
            assert r["error"] is None and r["differ"] == [], (how, rank, r)


def _facade_of(model: nn.Module, stage: int) -> zf.ZeroOptimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return zf.ZeroOptimizer(opt, partition_grad=stage == 2, module=model, reduce_bucket_size=64)


def _save_load_continue(stage: int, fmt: str, path: str) -> dict[str, Any]:
    """2 steps, save, 2 more; a fresh model (other seed) loads and does the same 2: bitwise, buffers included."""
    model = _seeded_model()
    zopt = _facade_of(model, stage)
    for step in range(2):
        _train_step(model, zopt, step)
    if fmt == "full":  # every rank gathers it, rank 0 saves it, every rank reads rank 0's file
        sd = zopt.state_dict()
        if dist.get_rank() == 0:
            torch.save(sd, path)
        dist.barrier()
        sd = torch.load(path, weights_only=False)
    else:
        zopt.save_checkpoint(path)
    saved_buffers = {n: b.clone() for n, b in zf.checkpoint.persistent_buffers(model).items()}
    for step in (2, 3):
        _train_step(model, zopt, step)
    torch.manual_seed(seeded(999 + dist.get_rank()))
    fresh = BNNet()
    fopt = _facade_of(fresh, stage)
    if fmt == "full":
        fresh.load_state_dict({n: p for n, p in sd["zerofn"]["master"].items()}, strict=False)
        fopt.load_state_dict(sd)
    else:
        fopt.load_checkpoint(path)
    loaded = dict(zf.checkpoint.persistent_buffers(fresh))
    torch.distributed.broadcast_object_list(box := [saved_buffers], src=0)
    out = {"loaded_rank0": _equal_bits({n: b.clone() for n, b in loaded.items()}, box[0])}
    for step in (2, 3):
        _train_step(fresh, fopt, step)
    out["differ"] = _equal_bits(_states(model), _states(fresh))
    zopt.close()
    fopt.close()
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_save_load_continue_is_bitwise_a_run_that_never_stopped_buffers_included(tmp_path, stage, fmt):
    for rank, r in enumerate(get_world(2).run(_save_load_continue, stage, fmt, str(tmp_path / "ckpt"))):
        assert r["loaded_rank0"] == [], f"rank {rank}: loaded buffers are not rank 0's saved ones: {r}"
        assert r["differ"] == [], f"rank {rank}: {r['differ']} differ from the run that never stopped"


def _old_and_mismatched_checkpoints(path: str) -> dict[str, Any]:
    """A checkpoint without buffers loads and leaves them; one whose buffers do not fit fails, changing nothing."""
    model = _seeded_model()
    zopt = _facade_of(model, 2)
    _train_step(model, zopt, 0)
    # As checkpoints were written before buffers were saved: the functional save without buffers=.
    zf.checkpoint.save(path + "_old", zopt.state, params=dict(model.named_parameters()))
    zopt.close()
    out: dict[str, Any] = {}
    fresh = _seeded_model()
    fopt = _facade_of(fresh, 2)
    before = _states(fresh)
    fopt.load_checkpoint(path + "_old")
    after = _states(fresh)
    out["buffers_kept"] = _equal_bits({n: before[n] for n in ("bn.running_mean", "bn.num_batches_tracked")}, after)
    out["params_loaded"] = _equal_bits(dict(model.named_parameters()), dict(fresh.named_parameters())) == []
    fopt.save_checkpoint(path)
    fresh.register_buffer("extra", torch.zeros(2))  # the model now has a buffer the checkpoint lacks
    master = {n: t.clone() for n, t in fopt.state.master.items()}
    try:
        fopt.load_checkpoint(path)
    except zf.CheckpointError as e:
        out["error"] = str(e)
    out["unchanged"] = _equal_bits(after, _states(fresh)) == [] and _equal_bits(master, dict(fopt.state.master)) == []
    fopt.close()
    return out


def test_checkpoints_without_buffers_load_and_mismatched_buffers_fail_on_every_rank(tmp_path):
    for r in get_world(2).run(_old_and_mismatched_checkpoints, str(tmp_path / "ckpt")):
        assert r["buffers_kept"] == [] and r["params_loaded"], r
        assert "buffers do not match the model's" in r.get("error", ""), r
        assert r["unchanged"], r


ENTRY_CALLS = ["state_dict", "save_checkpoint", "load_checkpoint", "load_state_dict", "check_params"]


def _called_on_rank_0_only(path: str) -> dict[str, Any]:
    """Each collective entry point on rank 0 only, with a 0.5 s entry_timeout: each fails in bounded time, saying why.

    Each call gets its own facade over its own group (a failed wait leaves its group unusable),
    so the pool's default group stays intact.
    """
    import time

    facades = {}
    for call in ENTRY_CALLS:
        model = _seeded_model()
        group = dist.new_group([0, 1])
        zopt = zf.ZeroOptimizer(
            torch.optim.AdamW(model.parameters()), module=model, entry_timeout=0.5, dp_process_group=group
        )
        _train_step(model, zopt, 0)
        facades[call] = zopt
    facades["load_checkpoint"].save_checkpoint(path)  # every rank: the checkpoint the load below reads
    out: dict[str, Any] = {}
    if dist.get_rank() != 0:
        return out
    actions = {
        "state_dict": facades["state_dict"].state_dict,
        "save_checkpoint": lambda: facades["save_checkpoint"].save_checkpoint(path),
        "load_checkpoint": lambda: facades["load_checkpoint"].load_checkpoint(path),
        "load_state_dict": lambda: facades["load_state_dict"].load_state_dict({}),
        "check_params": facades["check_params"].check_params,
    }
    for call in ENTRY_CALLS:
        start = time.monotonic()
        try:
            actions[call]()
            out[call] = {"error": None}
        except zf.NotJoinedError as e:
            out[call] = {"error": str(e), "missing": e.missing}
        out[call]["seconds"] = time.monotonic() - start
    return out


def test_collectives_called_on_rank_0_only_fail_in_bounded_time_naming_the_missing_ranks(tmp_path):
    r0, r1 = get_world(2).run(_called_on_rank_0_only, str(tmp_path / "ckpt"))
    assert r1 == {}
    advice = {
        "state_dict": "sd = opt.state_dict()` on every rank, then save on rank 0 only",
        "save_checkpoint": "opt.save_checkpoint(path)` on every rank",
        "load_checkpoint": "opt.load_checkpoint(path)` on every rank",
        "load_state_dict": "on every rank",
        "check_params": "opt.check_params()` on every rank",
    }
    for call in ENTRY_CALLS:
        r = r0[call]
        assert r["error"] is not None and r["seconds"] < 20, (call, r)
        assert f"ZeroOptimizer.{call}: this is a collective, and rank(s) 1 of the group did not call it" in r["error"]
        assert advice[call] in r["error"] and r["missing"] == [1], (call, r)


# --------------------------------------------------------------------------- random op sequences

OPS = ("step", "clipped_step", "no_sync_step", "scheduler", "lr", "load", "clamp", "state_dict", "checkpoint", "eval")
CLIP = 0.05


def _op(name: str, i: int, ddp: Any, ref_opt: Any, ref_sched: Any, model: nn.Module, zopt: Any, zsched: Any) -> None:
    """One operation of a DDP script, done to DDP + torch.optim and to the facade alike."""
    from helpers import clip_in_float64

    x, y = _batch(i)
    if name in ("step", "clipped_step", "no_sync_step"):
        for m, opt in ((ddp, ref_opt), (model, zopt)):
            opt.zero_grad()
            if name == "no_sync_step":  # accumulation: one micro-batch locally, then a synced one
                with m.no_sync() if m is ddp else zopt.no_sync():
                    ((m(x) - y) ** 2).mean().backward()
                x2, y2 = _batch(i + 500)
                ((m(x2) - y2) ** 2).mean().backward()
            else:
                ((m(x) - y) ** 2).mean().backward()
            if name == "clipped_step":  # zerofn's float64 arithmetic on DDP's side (torch's rounds in fp32)
                clip_in_float64(m.parameters(), CLIP) if m is ddp else zopt.clip_grad_norm_(CLIP)
            opt.step()
    elif name == "scheduler":
        ref_sched.step()
        zsched.step()
    elif name == "lr":
        for opt in (ref_opt, zopt):
            for g in opt.param_groups:
                g["lr"] *= 0.5
    elif name in ("load", "clamp"):
        _edit(ddp.module, name)
        _edit(model, name)
    elif name == "state_dict":
        zopt.load_state_dict(zopt.state_dict())
        ref_opt.load_state_dict(ref_opt.state_dict())
    elif name == "checkpoint":  # DDP's: rank 0 saves the model and the optimizer, every rank loads them
        zopt.save_checkpoint(_S_PATH[0])
        zopt.load_checkpoint(_S_PATH[0])
        box = [(ddp.module.state_dict(), ref_opt.state_dict())]
        dist.broadcast_object_list(box, src=0)
        ddp.module.load_state_dict(box[0][0])
        ref_opt.load_state_dict(box[0][1])
    elif name == "eval":
        for m in (ddp, model):
            m.eval()
            with torch.no_grad():
                m(x)
            m.train()


_S_PATH: list[str] = [""]


def _sequence(stage: int, ops: list[str], path: str) -> dict[str, Any]:
    """Run ``ops`` on DDP and the facade; after each, params and buffers bitwise: the first op after which they are not.

    At 2 ranks on the default fp32 wire the mean gradient is DDP's bit for bit, and a
    clipped step clips with the same float64 arithmetic on both sides (``clip_in_float64``).
    The two float64 norms add the same squares in other groupings (per tensor, or per
    shard at stage 2) and may differ in the last bit; that changes the fp32 coefficient
    only when it lies within that bit of an fp32 rounding boundary, a chance of about
    2**-29 per clipped step (some 1e-7 over the examples here).
    """
    _S_PATH[0] = path
    ddp, ref_opt, model, zopt = _twins(stage)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    zsched = torch.optim.lr_scheduler.StepLR(zopt, step_size=1, gamma=0.7)
    first: dict[str, Any] = {}
    for i, name in enumerate(ops):  # every rank runs every op (a rank that stopped early would strand the others)
        _op(name, i, ddp, ref_opt, ref_sched, model, zopt, zsched)
        differ = _equal_bits(_states(ddp.module), _states(model))
        if differ and not first:
            first = {"at": i, "op": name, "differ": differ, "diff": _diff(_states(model), _states(ddp.module))}
    zopt.close()
    return first


@pytest.mark.numerics
@settings(max_examples=8, deadline=None)
@given(stage=st.sampled_from([1, 2]), ops=st.lists(st.sampled_from(OPS), min_size=3, max_size=8))
def test_random_op_sequences_match_ddp_after_every_op(tmp_path_factory, stage, ops):
    """Any order of a DDP script's operations: the facade equals DDP + the same torch optimizer after each."""
    path = str(tmp_path_factory.mktemp("seq") / "ckpt")
    for rank, r in enumerate(get_world(2).run(_sequence, stage, ["step", *ops], path)):
        assert r == {}, f"rank {rank}, stage {stage}, ops {['step', *ops]}: {r}"


def _hybrid_start(path: str) -> dict[str, Any]:
    """A hybrid facade (2 shard groups of 2) from per-rank seeds; then the functional save/load of buffers."""
    model = _seeded_model()
    zopt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters()), partition_grad=True, module=model, sub_dp_size=2)
    out = {"start": _states(model)}
    with torch.no_grad():
        model.bn.running_mean.fill_(float(dist.get_rank()))  # each rank's own, rank 0's are saved
    buffers = zf.checkpoint.persistent_buffers(model)
    state = zf.shard_params(dict(model.named_parameters()), zf.optim.adamw())  # the params agree now: no error
    zf.checkpoint.save(path, state, params=dict(model.named_parameters()), buffers=buffers)
    with torch.no_grad():
        model.bn.running_mean.fill_(-1.0)
    zf.checkpoint.load(path, dict(model.named_parameters()), buffers_out=buffers)
    out["loaded"] = model.bn.running_mean.clone()
    # The full format: full_state_dict(buffers=) holds this rank's; shard_state_dict(buffers_out=) restores them.
    with torch.no_grad():
        model.bn.running_mean.fill_(float(dist.get_rank()) + 0.5)
    full = zf.checkpoint.full_state_dict(state, buffers=buffers)
    with torch.no_grad():
        model.bn.running_mean.fill_(-1.0)
    zf.checkpoint.shard_state_dict(full, dict(model.named_parameters()), buffers_out=buffers)
    out["full"] = model.bn.running_mean.clone()
    zopt.close()
    return out


def test_hybrid_layouts_start_from_world_rank_0_and_functional_checkpoints_carry_buffers(tmp_path):
    torch.manual_seed(seeded(100))
    rank0 = _states(BNNet())
    for rank, r in enumerate(get_world(4).run(_hybrid_start, str(tmp_path / "ckpt"))):
        assert _equal_bits(r["start"], rank0) == [], f"rank {rank}"
        assert torch.equal(r["loaded"], torch.zeros(8)), f"rank {rank}: {r['loaded']}"
        assert torch.equal(r["full"], torch.full((8,), rank + 0.5)), f"rank {rank}: {r['full']}"


def _fp16_without_zero_grad() -> str | None:
    """Stage 1 under fp16 loss scaling: p.grad is unscaled, the next backward's gradients scaled: it raises."""
    torch.manual_seed(seeded(0))
    model = nn.Linear(6, 3)
    zopt = zf.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), forced_dtype=torch.float16, module=model)
    x, y = _batch(0)
    for _ in range(2):
        try:
            zopt.backward(((model(x.half()) - y.half()).float() ** 2).mean())
        except RuntimeError as e:
            zopt.close()
            return str(e)
        zopt.step()
    zopt.close()
    return None


def test_gradients_not_zeroed_under_loss_scaling_raise_on_every_rank():
    for message in get_world(2).run(_fp16_without_zero_grad):
        assert message is not None and "under loss scaling p.grad holds unscaled gradients" in message, message
