"""The compressed wire's residual in both checkpoint formats, on real gloo ranks.

At the saved world size a load restores the residual bit for bit and training goes on as
if never stopped. At another world size the per-element sum of the residual over the
senders (what the next reduced gradient carries extra) is what was saved, exactly on
dyadic values, and each new sender holds ``sum / (M - 1)`` off its own chunk. A
checkpoint without a residual loads as zeros into a state with the wire; a residual
loads into nothing without one; a bad one is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import assert_bitwise_equal

import zerofn as zf
from zerofn import checkpoint as ck
from zerofn.checkpoint._residual import sender_rows
from zerofn.testing import RankFailure

WIRE = zf.CompressedWire(kind="int8", block=64, min_numel=16)
POLICY = zf.PrecisionPolicy(wire=WIRE)
SHAPES = {"w": (37, 50), "b": (37,), "v": (30, 70), "tiny": (3, 4)}  # b and tiny travel as float32
COMPRESSED = ("w", "v")
BUCKET = 1024  # several buckets: the residual is a tuple of them


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _train(state: zf.ZeroState, start: int, steps: int) -> zf.ZeroState:
    rank = dist.get_rank()
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        grads = {n: torch.randn(s, generator=g) * (1 + rank) for n, s in SHAPES.items()}
        wire = {"residual": state.residual} if state.residual else {}  # a state without the wire has none
        out = zf.reduce_grads(grads, state.layout, precision=state.precision, bucket_numel=state.bucket_numel, **wire)
        shards, residual = out if wire else (out, None)
        state, info = zf.step_shards(state, shards, residual=residual)
        assert not info.skipped
    return state


def _fresh(policy: zf.PrecisionPolicy | None = POLICY) -> zf.ZeroState:
    return zf.shard_params(_params(), zf.optim.adamw(lr=1e-2), precision=policy, bucket_numel=BUCKET)


def _assert_states_equal(a: zf.ZeroState, b: zf.ZeroState, what: str) -> None:
    assert len(a.residual) == len(b.residual), what
    for i, (x, y) in enumerate(zip(a.residual, b.residual, strict=True)):
        assert_bitwise_equal(x, y, f"{what}: residual of bucket {i}")
    for name in a.master:
        assert_bitwise_equal(a.master[name], b.master[name], f"{what}: master {name}")


def _same_world_round_trip(path: str) -> None:
    state = _train(_fresh(), 0, 3)
    assert dist.get_world_size() == 1 or any(r.abs().max() > 0 for r in state.residual)
    ck.save(path, state)
    ck.save(path + ".async", state, async_save=True).wait()  # staged with the rest
    full = ck.full_state_dict(state)
    straight = _train(state, 3, 2)
    params = _params()
    loaded = {
        "dcp": ck.load(path, params, precision=POLICY, bucket_numel=BUCKET),
        "async": ck.load(path + ".async", params, precision=POLICY, bucket_numel=BUCKET),
        "torch": ck.shard_state_dict(full, params, precision=POLICY, bucket_numel=BUCKET),
    }
    for kind, again in loaded.items():
        _assert_states_equal(again, state, f"rank {dist.get_rank()} {kind} load")
        _assert_states_equal(_train(again, 3, 2), straight, f"rank {dist.get_rank()} {kind} continued")
    # Another bucket size: the residual follows the new buckets, the same values per param.
    other = ck.load(path, params, precision=POLICY, bucket_numel=4 * BUCKET)
    assert len(other.residual) != len(state.residual)
    for name, row in sender_rows(other).items():
        assert_bitwise_equal(row, sender_rows(state)[name], f"{name} under another bucket_numel")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_at_the_saved_world_size_both_formats_restore_the_residual_bitwise_and_training_goes_on(tmp_path, n):
    get_world(n).run(_same_world_round_trip, str(tmp_path / "ckpt"))


def _dyadic_residual(state: zf.ZeroState) -> zf.ZeroState:
    """Residuals of multiples of ``3 * 2**-10``: their sums and the splits over 1, 2 or 3 new
    senders are exact in float32, so the N -> M rule can be checked with ``==``."""
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    residual = tuple(3 * torch.randint(-100, 101, r.shape, generator=g).float() * 2.0**-10 for r in state.residual)
    return state.replace(residual=residual)


def _save_dyadic(path: str) -> dict[str, torch.Tensor]:
    state = _dyadic_residual(_train(_fresh(), 0, 1))
    ck.save(path, state)
    return ck.full_state_dict(state)


def _load_elsewhere(path: str, full: dict) -> dict[str, object]:
    params = _params()
    out: dict[str, object] = {}
    for kind in ("dcp", "torch"):
        if kind == "dcp":
            state = ck.load(path, params, precision=POLICY, bucket_numel=BUCKET)
        else:
            state = ck.shard_state_dict(full, params, precision=POLICY, bucket_numel=BUCKET)
        like = _fresh()
        assert [r.shape for r in state.residual] == [r.shape for r in like.residual]
        out[kind] = {n: r.clone() for n, r in sender_rows(state).items()}
        _train(state, 1, 1)  # the residual fits the new world's buckets
    out["owned"] = {n: state.layout[n].owned_range(dist.get_rank()) for n in COMPRESSED}
    return out


@pytest.mark.parametrize(("n", "m"), [(2, 3), (3, 2), (2, 4), (3, 1), (1, 2)])
def test_at_another_world_size_each_elements_residual_sum_over_senders_is_kept(tmp_path, n, m):
    path = str(tmp_path / "ckpt")
    full = get_world(n).run(_save_dyadic, path)[0]
    saved = full["zerofn"]["residual"]
    assert sorted(saved) == sorted(COMPRESSED)
    for name in COMPRESSED:
        assert saved[name].shape == (n, torch.Size(SHAPES[name]).numel()) and saved[name].dtype == torch.float32
    per_rank = get_world(m).run(_load_elsewhere, path, full)
    for kind in ("dcp", "torch"):
        for name in COMPRESSED:
            total = saved[name].sum(0)
            if m == 1:  # nothing is sent compressed: the residual is dropped
                assert per_rank[0][kind][name].abs().max() == 0
                continue
            got = sum(r[kind][name] for r in per_rank)
            assert torch.equal(got, total), (kind, name)
            for r in per_rank:
                start, stop = r["owned"][name]
                expected = total / (m - 1)
                expected[start:stop] = 0
                assert torch.equal(r[kind][name], expected), (kind, name)


def _without_and_with(path: str, full_plain: dict, full_wire: dict) -> dict[str, object]:
    params = _params()
    zeros = ck.load(path + ".plain", params, precision=POLICY, bucket_numel=BUCKET)
    zeros_t = ck.shard_state_dict(full_plain, params, precision=POLICY, bucket_numel=BUCKET)
    dropped = ck.load(path + ".wire", params, bucket_numel=BUCKET)
    dropped_t = ck.shard_state_dict(full_wire, params, bucket_numel=BUCKET)
    like = _fresh()
    return {
        "zeros": all(
            len(s.residual) == len(like.residual)
            and all(torch.equal(a, b) for a, b in zip(s.residual, like.residual, strict=True))
            for s in (zeros, zeros_t)
        ),
        "dropped": dropped.residual == () and dropped_t.residual == (),
    }


def _save_both(path: str) -> tuple[dict, dict]:
    plain, wire = _train(_fresh(None), 0, 2), _train(_fresh(), 0, 2)
    ck.save(path + ".plain", plain)
    ck.save(path + ".wire", wire)
    return ck.full_state_dict(plain), ck.full_state_dict(wire)


def test_no_saved_residual_loads_as_zeros_and_a_residual_without_the_wire_is_dropped(tmp_path):
    path = str(tmp_path / "ckpt")
    world = get_world(2)
    full_plain, full_wire = world.run(_save_both, path)[0]
    assert "residual" not in full_plain["zerofn"] and "residual" in full_wire["zerofn"]
    for got in world.run(_without_and_with, path, full_plain, full_wire):
        assert got == {"zeros": True, "dropped": True}


def _refused(full: dict, case: str) -> None:
    bad = {**full, "zerofn": {**full["zerofn"], "residual": dict(full["zerofn"]["residual"])}}
    rows = bad["zerofn"]["residual"]
    if case == "shape":
        rows["w"] = rows["w"][:, :-1]
    elif case == "dtype":
        rows["w"] = rows["w"].double()
    elif case == "unknown":
        rows["nope"] = rows["w"]
    elif case == "senders":
        rows["v"] = torch.cat([rows["v"], rows["v"]])
    kwargs = {"bucket_numel": 0} if case == "bucket_numel" else {"bucket_numel": BUCKET}
    ck.shard_state_dict(bad, _params(), precision=POLICY, **kwargs)


def _full_with_wire() -> dict:
    return ck.full_state_dict(_train(_fresh(), 0, 1))


REFUSALS = {
    "shape": "residual of param 'w' must be float32 (N_saved, 1850)",
    "dtype": "residual of param 'w' must be float32 (N_saved, 1850)",
    "unknown": "residual names param 'nope'",
    "senders": "residual of param 'v' has 4 sender rows, the others 2",
    "bucket_numel": "bucket_numel must be a positive int",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_bad_residual_in_a_full_state_dict_is_refused_naming_the_param_and_shape(case):
    full = get_world(2).run(_full_with_wire)[0]
    for r in get_world(2).run(_refused, full, case, return_exceptions=True):
        assert isinstance(r, RankFailure) and r.type_name.endswith("CheckpointError") and REFUSALS[case] in r.message, r


def _load_bad_bucket(path: str) -> None:
    ck.load(path + ".wire", _params(), precision=POLICY, bucket_numel=-1)


def test_a_sharded_load_with_a_bad_bucket_numel_fails_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    world = get_world(2)
    world.run(_save_both, path)
    for r in world.run(_load_bad_bucket, path, return_exceptions=True):
        assert isinstance(r, RankFailure) and "bucket_numel must be a positive int" in r.message, r
