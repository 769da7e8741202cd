"""Checkpoints on real gloo ranks: round trips, resume, resharding N -> M, interop, crashes.

Bitwise throughout. Round trips and resume at the same world size recompute nothing
that could differ. Continuing at another world size M, or in plain torch, is compared
with plain ``torch.optim.AdamW`` continuing the saved full state dict on the same
gradients (``_torch_continues``, in a one-rank process with the ranks' kernel settings):
M ranks' gradients of their rows of the global batch, averaged with zerofn's arithmetic
on the exact wire (``helpers.exact_wire``: each scaled by the fp32 factor 1/M, summed
exactly in float64, rounded to fp32 once; the functional loop reduces with
``comm_dtype=exact_wire(M)``), so the order of the sum cannot matter and torch's AdamW
takes the same bits as zerofn's.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Net, assert_trees_equal, batches, exact_wire, max_rel_diff, seeded
from hypothesis import given
from hypothesis import strategies as st

import zerofn as zf
from zerofn import checkpoint as ck
from zerofn.testing.strategies import param_dicts


def assert_state_dicts_equal(a: Any, b: Any, where: str = "sd") -> None:
    """Nested dicts/lists/tensors equal, tensors bitwise (dtype, shape, bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_state_dicts_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_dicts_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# --------------------------------------------------------------------------- full state dicts


def _trained_full_round_trip(params: dict[str, torch.Tensor], kind: str, steps: int) -> tuple[dict, dict]:
    fopt = zf.optim.adamw(lr=1e-2) if kind == "adamw" else zf.optim.sgd(lr=1e-2, momentum=0.9)
    state = zf.shard_params(params, fopt)
    gen = torch.Generator().manual_seed(seeded(dist.get_rank()))
    for step in range(steps):
        # The first param gets no gradient in odd steps: state exists for some params only.
        grads = {
            n: torch.randn(p.shape, generator=gen).to(p.dtype)
            for i, (n, p) in enumerate(params.items())
            if not (i == 0 and step % 2)
        }
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))
    full = ck.full_state_dict(state)
    again = ck.full_state_dict(ck.shard_state_dict(full, params))
    return full, again


@given(
    params=param_dicts(dtypes=(torch.float32,), max_params=4),
    n=st.integers(1, 4),
    kind=st.sampled_from(["adamw", "sgd"]),
    steps=st.integers(0, 3),
)
def test_full_state_dict_round_trip_is_bitwise_with_padding(worlds, params, n, kind, steps):
    for full, again in worlds[n].run(_trained_full_round_trip, params, kind, steps):
        assert_state_dicts_equal(again, full)
        # Unpadded, param-shaped, on the CPU, as torch keeps it.
        for idx, entry in full["state"].items():
            name = full["zerofn"]["names"][idx]
            for key, value in entry.items():
                if key != "step":
                    assert value.shape == params[name].shape and value.device.type == "cpu"


# --------------------------------------------------------------------------- interop with torch.optim


def _global_batches(steps: int, batch: int = 12):
    """The same global batch sequence for every world size; rank r takes rows r::N."""
    gen = torch.Generator().manual_seed(seeded(7))
    for _ in range(steps):
        yield torch.randn(batch, 7, generator=gen), torch.randn(batch, 5, generator=gen)


def _rank_grads(model: Net, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, rank: int, n: int):
    """Rank ``rank`` of ``n``'s gradient on its rows ``rank::n`` of the global batch ``(x, y)``.

    Its squared errors over the global element count, times ``n``: the mean over ranks is
    then the gradient of the global mean loss. ``unused`` (no part in the forward, where
    torch.func gives zeros and autograd None) is left out, as torch.optim skips it.
    """
    x, y = x[rank::n], y[rank::n]

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (x,))
        return ((out - y) ** 2).sum() * (n / 60.0)

    grads = torch.func.grad(loss_fn)(params)
    return {name: g for name, g in grads.items() if not name.startswith("unused.")}


def _functional_steps(state: zf.ZeroState, model: Net, steps: int, skip: int = 0) -> zf.ZeroState:
    """``steps`` steps of the global batch sequence after the first ``skip``, on the exact wire."""
    rank, n = dist.get_rank(), dist.get_world_size()
    params = zf.gather_params(state)
    for i, (x, y) in enumerate(_global_batches(skip + steps)):
        if i < skip:
            continue
        grads = _rank_grads(model, params, x, y, rank, n)
        state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout, comm_dtype=exact_wire(n)))
        params = zf.gather_params(state)
    return state


def _torch_continues(
    sd: dict[str, Any], params: dict[str, torch.Tensor], skip: int, steps: int, world: int
) -> dict[str, Any]:
    """Plain torch AdamW continuing ``sd`` from ``params`` on the gradients ``world`` ranks form.

    Run on ``reference_world(world)``: one rank with the thread and kernel settings of the
    ranks it stands for, so each rank's gradient here has that rank's bits. Each step:
    every rank's ``_rank_grads``, scaled
    by the 0-d fp32 factor 1/world as zerofn's ``pack_grads`` scales them, summed in
    float64 (exact in any order for N <= 4 fp32 addends; at one or two ranks the fp32
    wire's single rounding of the exact sum, the same bits) and rounded to fp32 once: the
    mean zerofn's ``reduce_grads`` forms on ``exact_wire(world)``. Returns the params,
    torch's state dict and the lr the state dict set.
    """
    torch.manual_seed(seeded(0))
    model = Net()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # hyperparameters come from the state dict
    opt.load_state_dict(copy.deepcopy(sd))  # torch keeps (and updates) the tensors it is given
    lr = opt.param_groups[0]["lr"]
    factor = torch.tensor(1.0 / world, dtype=torch.float32)
    for i, (x, y) in enumerate(_global_batches(skip + steps)):
        if i < skip:
            continue
        now = {name: p.detach() for name, p in model.named_parameters()}
        per_rank = [_rank_grads(model, now, x, y, r, world) for r in range(world)]
        opt.zero_grad()
        for name, p in model.named_parameters():
            if name in per_rank[0]:
                p.grad = sum((g[name] * factor).double() for g in per_rank).float()
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "sd": opt.state_dict(), "lr": lr}


def _zerofn_then_full(steps: int) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    state = zf.shard_params(dict(model.named_parameters()), zf.optim.adamw(lr=1e-2, weight_decay=0.1))
    state = _functional_steps(state, model, steps)
    return ck.full_state_dict(state)


def _continue_from_torch(torch_sd: dict[str, Any], params: dict[str, torch.Tensor], skip: int, steps: int):
    torch.manual_seed(seeded(0))
    model = Net()
    state = ck.shard_state_dict(torch_sd, params, optimizer=zf.optim.adamw())
    state = _functional_steps(state, model, steps, skip=skip)
    return zf.gather_params(state)


def test_zerofn_state_dict_continues_in_torch_adamw_and_back():
    """zerofn's full state dict continues in plain torch AdamW, and torch's back in zerofn: bitwise.

    Both directions on the same gradients (``_torch_continues``: the mean zerofn forms on
    the exact wire), so torch's AdamW and zerofn's take the same bits: any difference is
    a state dict that lost or misplaced something (a moment, the step count, an lr).
    """
    from conftest import get_world, reference_world

    full = get_world(2).run(_zerofn_then_full, 5)[0]
    names = full["zerofn"]["names"]
    masters = {n: full["zerofn"]["master"][n] for n in names}
    # Plain torch: the master weights become the params, the state loads as is.
    torch_run = reference_world(2).run(_torch_continues, full, masters, 5, 5, 2)[0]
    assert torch_run["lr"] == 1e-2
    # zerofn continuing itself, for comparison.
    reference = get_world(2).run(_continue_from_torch, full, masters, 5, 5)[0]
    assert_trees_equal(torch_run["params"], reference)
    # And back: torch's own state dict (no zerofn entry) sharded over 3 ranks, against torch
    # continuing by itself on 3 ranks' gradients.
    assert "zerofn" not in torch_run["sd"]
    zerofn_continued = get_world(3).run(_continue_from_torch, torch_run["sd"], torch_run["params"], 10, 3)
    torch_continued = reference_world(3).run(_torch_continues, torch_run["sd"], torch_run["params"], 10, 3, 3)[0]
    for params in zerofn_continued:
        assert_trees_equal(params, torch_continued["params"])
    assert max_rel_diff(torch_continued["params"], torch_run["params"]) > 1e-3  # the 3 steps trained


# --------------------------------------------------------------------------- resharding matrix


def _save_after(path: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    state = zf.shard_params(dict(model.named_parameters()), zf.optim.adamw(lr=1e-2, weight_decay=0.1))
    state = _functional_steps(state, model, steps)
    ck.save(path, state, params=zf.gather_params(state))
    return ck.full_state_dict(state)


def _load_and_continue(path: str, skip: int, steps: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    torch.manual_seed(seeded(1))  # different init: everything must come from the checkpoint
    model = Net()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = ck.load(path, weights, params_out=weights)
    loaded = ck.full_state_dict(state)
    assert torch.equal(zf.gather_params(state)["a.weight"], weights["a.weight"])
    state = _functional_steps(state, model, steps, skip=skip)
    return loaded, zf.gather_params(state)


def _never_stopped(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seeded(0))
    model = Net()
    state = zf.shard_params(dict(model.named_parameters()), zf.optim.adamw(lr=1e-2, weight_decay=0.1))
    return zf.gather_params(_functional_steps(state, model, steps))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_save_at_n_load_at_every_m_equals_the_saved_state_and_keeps_training(worlds, tmp_path, n):
    """Saved at N, loaded at every M: the state equal to the saved one bitwise, and 4 more
    steps bitwise plain torch AdamW continuing the saved state on M ranks' gradients
    (``_torch_continues``); at M = N also bitwise the run that never stopped (the same
    arithmetic in the same order)."""
    from conftest import reference_world

    path = str(tmp_path / f"ckpt_n{n}")
    saved = worlds[n].run(_save_after, path, 4)[0]
    reference = worlds[n].run(_never_stopped, 8)[0]
    masters = dict(saved["zerofn"]["master"])
    for m in (1, 2, 3, 4):
        continued = reference_world(m).run(_torch_continues, saved, masters, 4, 4, m)[0]["params"]
        assert max_rel_diff(continued, masters) > 1e-3, f"N={n} -> M={m}: the 4 steps did not train"
        for loaded, params in worlds[m].run(_load_and_continue, path, 4, 4):
            assert_state_dicts_equal(loaded, saved, f"N={n} -> M={m}")
            assert_trees_equal(params, continued)
            if m == n:
                assert_trees_equal(params, reference)


# --------------------------------------------------------------------------- resume through the facade


def _facade_run(path: str, phase: str, steps: int, dtype: str = "float32") -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net().to(getattr(torch, dtype))
    # fp16: the dynamic loss scaler grows every 3 good steps, so its state moves while we train.
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        partition_grad=True,
        module=model,
        initial_scale=2.0**10,
        growth_interval=3,
    )
    data = [(x.to(model.a.weight.dtype), y.to(model.a.weight.dtype)) for x, y in batches(dist.get_rank(), 10)]
    start = 0
    if phase == "resume":
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # the checkpoint must bring the weights back
        opt.load_checkpoint(path)
        start = 5
    for x, y in data[start : start + steps]:
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
    if phase == "first":
        opt.save_checkpoint(path)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "sd": opt.state_dict(),
        "step": opt.state.step,
        "loss_scale": tuple(opt.state.loss_scale),
    }


@pytest.mark.parametrize(("n", "dtype"), [(2, "float32"), (3, "float32"), (2, "float16")])
def test_resume_after_a_killed_run_is_bitwise_equal_to_never_stopping(worlds, tmp_path, n, dtype):
    """Exact on the default fp32 wire at N = 2 and 3: the resumed run repeats the straight
    run's arithmetic at the same world size, in the same order, from the saved bits."""
    path = str(tmp_path / "resume")
    straight = worlds[n].run(_facade_run, path, "straight", 10, dtype)
    worlds[n].run(_facade_run, path, "first", 5, dtype)
    worlds[n].restart()  # the ranks die; only the checkpoint survives
    resumed = worlds[n].run(_facade_run, path, "resume", 5, dtype)
    for a, b in zip(resumed, straight, strict=True):
        assert a["step"] == b["step"] == 10
        assert a["loss_scale"] == b["loss_scale"]
        assert_trees_equal(a["params"], b["params"])
        assert_state_dicts_equal(a["sd"], b["sd"])
    if dtype == "float16":
        assert straight[0]["loss_scale"][0] > 2.0**10  # the scaler did move


def _facade_state_dict_api(max_shard: int) -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    model = Net()
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), module=model)
    x, y = next(batches(dist.get_rank(), 1))
    opt.backward(((model(x) - y) ** 2).mean())  # `unused` gets no grad: it has no state
    opt.step()
    opt.zero_grad()
    sd = opt.state_dict()
    blocks = list(opt.state_dict_shard(max_shard))
    other = Net()
    twin = zf.ZeroOptimizer(torch.optim.AdamW(other.parameters(), lr=0.5), module=other)
    twin.load_state_dict(sd)
    return {"sd": sd, "blocks": blocks, "twin": twin.state_dict(), "lr": twin.param_groups[0]["lr"]}


def test_facade_state_dict_round_trip_and_size_bounded_blocks(worlds):
    for res in worlds[3].run(_facade_state_dict_api, 150):
        sd = res["sd"]
        assert sorted(sd["state"]) == [0, 1, 2, 3, 4, 5]  # 6 of 8 params have state; unused.* do not
        merged: dict[int, Any] = {}
        for block, size in res["blocks"]:
            assert size == sum(v.numel() for e in block.values() for v in e.values() if v.dim() > 0)
            assert size <= 150 or len(block) == 1
            merged.update(block)
        assert_state_dicts_equal(merged, sd["state"])
        assert res["lr"] == 1e-2
        twin = res["twin"]
        twin["zerofn"].pop("master")  # the twin's masters came from the state dict too; compare the rest
        sd["zerofn"].pop("master")
        assert_state_dicts_equal(twin, sd)


# --------------------------------------------------------------------------- crashes and corruption


_KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    import zerofn as zf
    from zerofn import checkpoint as ck
    from zerofn.checkpoint import _dcp
    path, flag = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + flag + ".store", rank=0, world_size=1)
    state = zf.shard_params({"w": torch.ones(5)}, zf.optim.sgd(lr=0.1))
    ck.save(path, state, params={"w": torch.ones(5)})

    def hang():  # every file of the second save is on disk; the commit has not happened
        open(flag, "w").close()
        time.sleep(600)

    _dcp._before_commit = hang
    state, _ = zf.step_shards(state, {"w": torch.ones(5)})
    ck.save(path, state, params={"w": torch.zeros(5)})
    """
)


def test_a_save_killed_before_commit_leaves_the_previous_checkpoint_loadable(tmp_path):
    path, flag = str(tmp_path / "ckpt"), str(tmp_path / "flag")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, path, flag])
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(flag):
            assert proc.poll() is None, "the saving process ended early"
            assert time.monotonic() < deadline, "the saving process never reached the commit"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    from conftest import get_world

    leftovers = [f for f in os.listdir(tmp_path) if f.startswith("ckpt.")]
    assert len(leftovers) == 2  # the committed target and the uncommitted second one
    state = get_world(1).run(_load_w, path)[0]
    assert state == (0, [1.0] * 5)


def _load_w(path: str) -> tuple[int, list[float]]:
    weights = {"w": torch.full((5,), 9.0)}
    state = ck.load(path, weights, params_out=weights)
    return state.step, weights["w"].tolist()


def _try_load(path: str, shape: tuple[int, ...], kind: str) -> str:
    params = {"a.weight": torch.zeros(shape)} | {n: p.detach() for n, p in Net().named_parameters() if n != "a.weight"}
    fopt = zf.optim.sgd() if kind == "sgd" else None
    try:
        ck.load(path, params, optimizer=fopt)
    except ck.CheckpointError as e:
        return str(e)
    return "loaded"


def test_corrupt_missing_and_mismatched_checkpoints_raise_clear_errors(worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    worlds[2].run(_save_after, path, 2)
    good = (13, 7)
    assert worlds[2].run(_try_load, path, good, "adamw") == ["loaded", "loaded"]
    # A model that does not fit, and a different optimizer type.
    msgs = worlds[2].run(_try_load, path, (13, 8), "adamw")
    assert all("param 'a.weight': the checkpoint has shape (13, 7)" in m for m in msgs)
    msgs = worlds[2].run(_try_load, path, good, "sgd")
    assert all("holds adamw state, but the optimizer is sgd" in m for m in msgs)
    target = os.path.realpath(path)
    rank_file = os.path.join(target, "__1_0.distcp")
    with open(rank_file, "rb") as f:
        blob = f.read()
    # A flipped byte: same size, wrong hash.
    with open(rank_file, "wb") as f:
        f.write(blob[:-1] + bytes([blob[-1] ^ 0xFF]))
    assert all("does not match its SHA-256" in m for m in worlds[2].run(_try_load, path, good, "adamw"))
    # Truncated.
    with open(rank_file, "wb") as f:
        f.write(blob[: len(blob) // 2])
    assert all("truncated" in m for m in worlds[2].run(_try_load, path, good, "adamw"))
    # Missing.
    os.remove(rank_file)
    assert all("__1_0.distcp is missing" in m for m in worlds[2].run(_try_load, path, good, "adamw"))
    # Not a checkpoint at all.
    os.remove(os.path.join(target, "zerofn.json"))
    assert all("not a zerofn checkpoint" in m for m in worlds[2].run(_try_load, path, good, "adamw"))


# --------------------------------------------------------------------------- format version


def _versions() -> dict[str, Any]:
    torch.manual_seed(seeded(0))
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
    grads = {n: torch.randn_like(p) for n, p in params.items()}
    state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))
    full = ck.full_state_dict(state)
    older = copy.deepcopy(full)
    del older["zerofn"]["version"]  # written before the entry carried a version
    from_older = ck.shard_state_dict(older, params)
    newer = copy.deepcopy(full)
    newer["zerofn"]["version"] = ck.FORMAT_VERSION + 1
    try:
        ck.shard_state_dict(newer, params)
        refused = ""
    except zf.CheckpointError as e:
        refused = str(e)
    return {
        "version": full["zerofn"]["version"],
        "same": ck.full_state_dict(from_older),
        "full": full,
        "refused": refused,
    }


def test_the_zerofn_entry_carries_a_format_version_and_an_unknown_one_is_refused(worlds):
    for res in worlds[2].run(_versions):
        assert res["version"] == ck.FORMAT_VERSION
        assert_state_dicts_equal(res["same"], res["full"])  # no version: read as the first format
        assert f"format version {ck.FORMAT_VERSION + 1}" in res["refused"], res["refused"]
