"""The bucket engine (``zerofn.buckets``): the pieces every path moves buckets through.

* pure pieces against plain-Python references of their semantics (the padded flat tensor
  viewed as ``(N, width)`` blocks side by side, scaled by ``rows.mul_(1/(N*R))``), bitwise,
  in every floating dtype and at world sizes 1-4 and 7: small members (batched copies),
  members above the one-pass threshold, padded and unpadded ones, a member smaller than N,
  an absent gradient, an empty param;
* ``out=`` buffers are written and returned; a lone contiguous shard is its own row;
* the communicating pieces on real gloo ranks: a whole reduced bucket unpacked into full
  mean gradients (what DDP leaves in ``p.grad``) equals, on every rank's slice, the shard
  ``reduce_grads`` returns, bitwise, and the mean of all ranks' gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CopyTargets, assert_bitwise_equal, assert_trees_close, assert_trees_equal, seeded

import zerofn as zf
from zerofn import buckets
from zerofn.buckets import Bucket, plan_buckets
from zerofn.layout import make_layout

SHAPES = {
    "a": (5, 3),
    "b": (2,),
    "big": (257, 256),
    "empty": (0, 3),
    "c": (4, 4),
    "bigpad": (65537,),
    "gone": (6,),
}


def _full(n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seeded(n))
    return {k: torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for k, shape in SHAPES.items()}


def _reference_rows(grads: dict[str, Any], layout: Any, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
    """Plain semantics: each member's flat tensor, zero padded, viewed as (N, width), side by side."""
    n = layout.world_size
    blocks = []
    for name in bucket.names:
        spec = layout[name]
        flat = torch.zeros(n * spec.shard_numel, dtype=dtype)
        if grads.get(name) is not None:
            flat[: spec.numel] = grads[name].reshape(-1)
        blocks.append(flat.view(n, spec.shard_numel))
    return torch.cat(blocks, dim=1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("replicas", [1, 3])
def test_pack_grads_is_the_padded_rows_times_the_mean_factor(dtype, n, replicas):
    full = _full(n, dtype)
    grads = {k: v for k, v in full.items() if k != "gone"}
    layout = make_layout(full, n)
    for bucket in plan_buckets(layout, 2**20):
        want = _reference_rows(grads, layout, bucket, dtype)
        want.mul_(1.0 / (n * replicas))  # the functional path's rounding: one mul_ by a Python float
        got = buckets.pack_grads(grads, layout, bucket, replicas=replicas)
        assert_bitwise_equal(got, want, str(bucket.names))
        buf = torch.full((n, bucket.shard_numel), float("nan"), dtype=dtype)
        assert buckets.pack_grads(grads, layout, bucket, replicas=replicas, out=buf) is buf
        assert_bitwise_equal(buf, want, str(bucket.names))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_a_bucket_of_small_members_packs_in_one_call_as_the_padded_rows(n):
    """The chunked path (every member small): 2-D gradients whose rows split N ways go in
    as they are, the others flat (rows that do not split evenly, a transposed gradient)."""
    shapes = {"w": (4 * n, 3), "odd": (2 * n + 1, 5), "t": (6, 2 * n), "b": (7,), "s": (1, 1)}
    gen = torch.Generator().manual_seed(seeded(n))
    grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads["t"] = torch.randn(2 * n, 6, generator=gen).t()  # not contiguous
    layout = make_layout(grads, n)
    (bucket,) = plan_buckets(layout, 2**20)
    assert buckets.bucket_plan(layout, bucket).chunked
    want = _reference_rows(grads, layout, bucket, torch.float32).mul_(1.0 / n)
    assert_bitwise_equal(buckets.pack_grads(grads, layout, bucket), want, "chunked")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("members", [1, 3, 64])
def test_sub_buckets_are_consecutive_column_runs_whose_rows_unpack_as_the_bucket(n, members):
    """A compiled gather unpacks a bucket of many params as sub-buckets (``_offsets.sub_buckets``):
    each a bucket of its own over consecutive columns of the rows, together the bucket's
    members in order, and unpacking each from its columns writes what the whole bucket does."""
    from zerofn._offsets import sub_buckets

    torch.manual_seed(seeded(5))
    full = {f"p{i}": torch.randn(1 + i % 6, 1 + i % 3) for i in range(150)}
    layout = make_layout(full, n)
    for bucket in plan_buckets(layout, 2**20):
        subs = sub_buckets(layout, bucket, members)
        assert [name for sub, _ in subs for name in sub.names] == list(bucket.names)
        assert all(len(sub.names) <= members for sub, _ in subs) or subs == ((bucket, 0),)
        column, start = 0, 0
        for sub, first in subs:
            assert first == column and sub.offsets[0] == 0
            assert tuple(o + first for o in sub.offsets) == bucket.offsets[start : start + len(sub.names)]
            column, start = column + sub.shard_numel, start + len(sub.names)
        assert column == bucket.shard_numel
        rows = _reference_rows(full, layout, bucket, torch.float32)
        mine = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
        for sub, first in subs:
            buckets.unpack_rows(rows[:, first : first + sub.shard_numel], layout, sub, mine)
        for name in bucket.names:
            assert_bitwise_equal(mine[name], full[name], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_unpack_rows_writes_full_tensors_and_split_row_cuts_shards(dtype, n):
    full = _full(n, dtype)
    layout = make_layout(full, n)
    for bucket in plan_buckets(layout, 2**20):
        rows = _reference_rows(full, layout, bucket, dtype)
        mine = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
        written = buckets.unpack_rows(rows, layout, bucket, mine)
        assert list(written) == list(bucket.names)
        for name in bucket.names:
            assert written[name] is mine[name]
            assert_bitwise_equal(mine[name], full[name], name)
        # The same rows as N separate tensors (a compiled gather's broadcasts): the same writes.
        apart = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
        buckets.unpack_rows([r.clone() for r in rows], layout, bucket, apart)
        for name in bucket.names:
            assert_bitwise_equal(apart[name], full[name], f"{name} from separate rows")
        # New tensors in another dtype (a wire row cast back), for some members only.
        some = bucket.names[::2]
        fresh = buckets.unpack_rows(rows, layout, bucket, names=some, dtype=torch.float64)
        assert list(fresh) == list(some)
        for name in some:
            assert_bitwise_equal(fresh[name], full[name].double(), name)
        for r in range(n):
            shards = buckets.split_row(rows[r], layout, bucket, set(bucket.names), dtype=torch.float64)
            for name in bucket.names:
                want = buckets.cut_shard(full[name], layout[name], r, dtype=torch.float64)
                assert_bitwise_equal(shards[name], want, f"{name} rank {r}")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("padded", [True, False])
def test_unpack_targets_made_once_write_the_rows_of_every_later_call(n, padded):
    """The facade's cached views (``unpack_rows(..., targets=)``): each call's rows land in
    full, bitwise, through views made once; with padding, and without (every member's block
    is all of it: the copy sources are the column blocks themselves)."""
    shapes = SHAPES if padded else {"x": (4 * n, 6), "y": (12 * n,), "z": (n, 5)}
    gen = torch.Generator().manual_seed(seeded(n))
    layout = make_layout({k: torch.empty(s) for k, s in shapes.items()}, n)
    for bucket in plan_buckets(layout, 2**20):
        mine = {k: torch.full(s, float("nan")) for k, s in shapes.items()}
        some = bucket.names[1::2]
        targets = buckets.unpack_targets(layout, bucket, mine)
        part = buckets.unpack_targets(layout, bucket, mine, names=some)
        apart = buckets.unpack_targets(layout, bucket, mine, separate=True)
        for _ in range(2):
            full = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
            rows = _reference_rows(full, layout, bucket, torch.float32)
            written = buckets.unpack_rows(rows, layout, bucket, mine, targets=targets)
            assert list(written) == list(bucket.names)
            for name in bucket.names:
                assert written[name] is mine[name]
                assert_bitwise_equal(mine[name], full[name], name)
            again = {k: v * 2 for k, v in full.items()}
            rows = _reference_rows(again, layout, bucket, torch.float32)
            buckets.unpack_rows(list(rows.unbind(0)), layout, bucket, mine, targets=apart)
            for name in bucket.names:
                assert_bitwise_equal(mine[name], again[name], f"{name} from separate rows")
            buckets.unpack_rows(
                _reference_rows(full, layout, bucket, torch.float32), layout, bucket, mine, names=some, targets=part
            )
            for name in bucket.names:
                assert_bitwise_equal(mine[name], (full if name in some else again)[name], f"{name}, some written")


def test_a_pool_keeps_a_buckets_unpack_views_until_a_member_has_new_storage():
    layout = make_layout({k: torch.empty(s) for k, s in SHAPES.items()}, 3)
    pool = buckets.StagingPool()
    out = {k: torch.zeros(s) for k, s in SHAPES.items()}
    bucket = max(plan_buckets(layout, 2**20), key=lambda b: len(b.names))
    kept = pool.unpack_targets(layout, bucket, out)
    assert pool.unpack_targets(layout, bucket, out) is kept  # the same storage: the same views
    name = bucket.names[0]
    out[name] = out[name].clone()  # new storage
    made = pool.unpack_targets(layout, bucket, out)
    assert made is not kept
    full = _full(3, torch.float32)
    buckets.unpack_rows(_reference_rows(full, layout, bucket, torch.float32), layout, bucket, out, targets=made)
    for k in bucket.names:
        assert_bitwise_equal(out[k], full[k], k)
    pool.clear()
    assert pool.unpack_targets(layout, bucket, out) is not made


def _gather_through_a_pool() -> dict[str, Any]:
    """A donated functional loop with a pool (``gather_params(out=, staging=)``), against one
    without: the same params, also after a param got new storage between steps."""
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seeded(11))
    init = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items() if k != "bigpad"}
    runs = []
    for pool in (buckets.StagingPool(), None):
        params = {k: v.clone() for k, v in init.items()}
        state = zf.shard_params(params, zf.optim.adamw(lr=1e-2))
        for step in range(4):
            g = torch.Generator().manual_seed(seeded(100 * step + rank))
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout, bucket_numel=64), donate=True)
            if step == 2:
                params["a"] = params["a"].clone()  # new storage: the kept views of its bucket are stale
            params = zf.gather_params(state, out=params, staging=pool)
        runs.append(params)
    return {"pooled": runs[0], "plain": runs[1], "n": n}


def test_a_gather_into_out_through_a_pool_writes_params_given_new_storage(world):
    for res in world.run(_gather_through_a_pool):
        assert_trees_equal(res["pooled"], res["plain"])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_cut_shard_is_the_owned_range_zero_padded(n):
    full = _full(n, torch.float32)
    layout = make_layout(full, n)
    for spec in layout.params:
        flat = torch.zeros(n * spec.shard_numel)
        flat[: spec.numel] = full[spec.name].reshape(-1)
        for r in range(n):
            want = flat[r * spec.shard_numel : (r + 1) * spec.shard_numel]
            assert_bitwise_equal(buckets.cut_shard(full[spec.name], spec, r), want, spec.name)
            # Rounded to bf16 first, stored in float32 (shard_params' masters of a forced dtype).
            got = buckets.cut_shard(full[spec.name], spec, r, dtype=torch.float32, round_to=torch.bfloat16)
            assert_bitwise_equal(got, want.to(torch.bfloat16).float(), spec.name)


def test_pack_shards_casts_reuses_out_and_sends_a_lone_shard_itself():
    full = _full(3, torch.float32)
    layout = make_layout(full, 3)
    shards = {s.name: buckets.cut_shard(full[s.name], s, 1) for s in layout.params}
    for bucket in plan_buckets(layout, 2**20):
        want = torch.cat([shards[n].to(torch.bfloat16) for n in bucket.names])
        got = buckets.pack_shards(shards, layout, bucket, dtype=torch.bfloat16)
        assert_bitwise_equal(got, want, str(bucket.names))
        if len(bucket.names) > 1:
            out = torch.empty(bucket.shard_numel, dtype=torch.bfloat16)
            assert buckets.pack_shards(shards, layout, bucket, dtype=torch.bfloat16, out=out) is out
            assert_bitwise_equal(out, want)
        else:
            assert buckets.pack_shards(shards, layout, bucket) is shards[bucket.names[0]]
    # Mixed dtypes without a target dtype: promoted exactly, cast back by unpack_rows.
    bucket = plan_buckets(layout, 2**20)[0]
    mixed = {**shards, bucket.names[0]: shards[bucket.names[0]].to(torch.bfloat16)}
    row = buckets.pack_shards(mixed, layout, bucket)
    assert row.dtype == torch.float32
    assert_bitwise_equal(row[: layout[bucket.names[0]].shard_numel].to(torch.bfloat16), mixed[bucket.names[0]])


# --------------------------------------------------------------------------- on ranks


def _full_mean_grads(dtype_name: str, comm_dtype_name: str | None) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    comm_dtype = getattr(torch, comm_dtype_name) if comm_dtype_name else None
    n, rank = dist.get_world_size(), dist.get_rank()
    shapes = {k: v for k, v in SHAPES.items() if k not in ("big", "bigpad")}
    every = []
    for r in range(n):
        gen = torch.Generator().manual_seed(seeded(100 + r))
        every.append({k: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for k, s in shapes.items()})
    grads: dict[str, torch.Tensor | None] = {**every[rank], "gone": None}
    layout = make_layout(every[rank], n)
    present = [k for k, g in grads.items() if g is not None]
    full: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(layout, 40):
        if not set(bucket.names) & set(present):
            continue  # nothing to send (reduce_grads skips it too)
        rows = buckets.pack_grads(grads, layout, bucket)
        summed = buckets.launch_reduce(rows, layout, bucket, None, "all_reduce", comm_dtype=comm_dtype, whole=True)
        full.update(buckets.unpack_rows(summed.wait(), layout, bucket, names=present, dtype=dtype))
    shards = zf.reduce_grads(grads, layout, stage=1, bucket_numel=40, comm_dtype=comm_dtype)
    mine = {k: buckets.cut_shard(full[k], layout[k], rank) for k in shards if layout[k].numel}
    mean = {k: sum(e[k].double() for e in every) / n for k in full}
    try:
        buckets.launch_reduce(rows, layout, bucket, None, "reduce_scatter", whole=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {
        "full": {k: full[k] for k in sorted(full)},
        "mean": {k: mean[k].to(dtype) for k in sorted(full)},
        "mine": mine,
        "shards": {k: shards[k] for k in mine},
        "refused": refused,
    }


@pytest.mark.parametrize(("dtype", "wire"), [("float32", None), ("bfloat16", None), ("float32", "bfloat16")])
def test_a_whole_reduced_bucket_unpacks_into_the_full_mean_gradients(world, dtype, wire):
    for res in world.run(_full_mean_grads, dtype, wire):
        assert "gone" not in res["full"] and "empty" not in res["full"]  # empty params travel in no bucket
        for name, shard in res["shards"].items():  # each rank's slice is reduce_grads' shard
            assert_bitwise_equal(res["mine"][name], shard, name)
        rel = {"float32": 1e-6, "bfloat16": 2e-2}[wire or dtype]
        assert_trees_close(res["full"], res["mean"], rel=rel)
        assert "whole=True" in res["refused"]


def _stacked(rows: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A gather's rows as one new ``(N, S)`` tensor: an all-gather's buffer, or the broadcasts' rows apart."""
    return rows.clone() if isinstance(rows, torch.Tensor) else torch.stack(rows)


def _gathers_into_given_buffers(dtype_name: str) -> dict[str, object]:
    dtype = getattr(torch, dtype_name)
    n, rank = dist.get_world_size(), dist.get_rank()
    shapes = {k: v for k, v in SHAPES.items() if k not in ("big", "bigpad")}
    gen = torch.Generator().manual_seed(seeded(7))
    full = {k: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for k, s in shapes.items()}
    layout = make_layout(full, n)
    shards = {k: buckets.cut_shard(full[k], layout[k], rank) for k in full}
    fresh, given, in_place, refused = {}, {}, {}, []
    for bucket in plan_buckets(layout, 40):
        if not bucket.shard_numel:
            continue
        s = bucket.shard_numel
        row = buckets.pack_shards(shards, layout, bucket, dtype=dtype)
        for how, out in (("broadcast", fresh), ("all_gather", fresh)):
            out[f"{bucket.names[0]}/{how}"] = _stacked(buckets.launch_gather(row, None, how).wait())
        recv = torch.full((n, s), float("nan"), dtype=dtype)  # stale contents must not leak through
        got = buckets.launch_gather(row, None, "broadcast", async_op=True, out=recv).wait()
        # The broadcasts' rows where they lie: this rank's is the row it sent, the others recv's.
        assert [t.data_ptr() for t in got] == [(row if r == rank else recv[r]).data_ptr() for r in range(n)]
        given[f"{bucket.names[0]}/broadcast"] = _stacked(got)
        # This rank's row packed straight into the receive buffer: no separate row.
        recv = torch.full((n, s), float("nan"), dtype=dtype)
        mine = buckets.pack_shards(shards, layout, bucket, dtype=dtype, out=recv[rank])
        got = buckets.launch_gather(mine, None, "broadcast", out=recv).wait()
        in_place[f"{bucket.names[0]}/broadcast"] = _stacked(got)
        if mine.data_ptr() == recv[rank].data_ptr():
            try:
                buckets.launch_gather(mine, None, "all_gather", out=recv)
            except ValueError as e:
                refused.append(str(e))
        try:
            buckets.launch_gather(row, None, "broadcast", out=torch.empty(n + 1, s, dtype=dtype))
        except ValueError as e:
            refused.append(str(e))
    return {"fresh": fresh, "given": given, "in_place": in_place, "refused": refused}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gathers_into_a_given_buffer_and_from_a_row_packed_in_place_are_bitwise_the_same(world, dtype):
    for res in world.run(_gathers_into_given_buffers, dtype):
        for key, rows in res["given"].items():
            assert_bitwise_equal(rows, res["fresh"][key], key)
            assert_bitwise_equal(res["in_place"][key], res["fresh"][key], key)
            assert_bitwise_equal(res["fresh"][key.replace("broadcast", "all_gather")], res["fresh"][key], key)
        assert res["refused"] and any("out must be" in r for r in res["refused"])
        assert any("only the broadcast realisation" in r for r in res["refused"])


def test_the_plan_a_compiled_step_reads_is_the_eager_plan_for_split_and_whole_members():
    from zerofn._bucket_plan import BucketPlan, MemberPlan, _traced_bucket_plan

    params = {"w": torch.zeros(4, 4), "a": torch.zeros(5, 3), "b": torch.zeros(7), "e": torch.zeros(0)}
    layout = zf.make_layout(params, 3, placement={"w": "whole"})
    for bucket in plan_buckets(layout, 16):
        widths, members, split_width, chunked, filled = _traced_bucket_plan(
            layout.fingerprint, bucket.names, bucket.offsets, bucket.shard_numel
        )
        rebuilt = BucketPlan(widths, tuple(MemberPlan(*m) for m in members), split_width, chunked, filled)
        assert rebuilt == buckets.bucket_plan(layout, bucket)


def _gather_of_one_lone_param(numel_per_rank: int, extra: int) -> dict[str, Any]:
    """gather_params of a state with one split param of ``N * numel_per_rank + extra`` elements."""
    n = dist.get_world_size()
    full = {"w": torch.arange(n * numel_per_rank + extra, dtype=torch.float32)}
    state = zf.shard_params(full, zf.optim.sgd(lr=0.1))
    pool = buckets.StagingPool()
    out = {"w": torch.empty_like(full["w"])}
    ptr = out["w"].data_ptr()
    got = zf.gather_params(state, staging=pool, out=out)
    fresh = zf.gather_params(state)
    return {
        "got": got["w"],
        "fresh": fresh["w"],
        "full": full["w"],
        "same": got["w"].data_ptr() == ptr,
        "pooled": len(pool.buffers()),
        "n": n,
    }


@pytest.mark.parametrize("extra", [0, 1])
def test_a_lone_unpadded_param_is_gathered_into_its_own_storage(world, extra):
    """Row r of such a bucket is the param's r-th chunk: its storage receives the gather, no
    staging buffer is taken and nothing is unpacked; a padded one (``extra`` elements over a
    multiple of N, N > 1) goes through one staging buffer, given back to the pool."""
    for res in world.run(_gather_of_one_lone_param, 8, extra):
        assert_bitwise_equal(res["got"], res["full"], "w (into out)")
        assert_bitwise_equal(res["fresh"], res["full"], "w (fresh)")
        assert res["same"]
        padded = extra and res["n"] > 1
        assert res["pooled"] == (1 if padded else 0), res


def _one_packed_bucket(
    seed: int,
) -> tuple[dict[str, tuple[int, ...]], Any, Bucket, dict[str, torch.Tensor], torch.Tensor]:
    """SHAPES (but the large padded one) at this world size: (shapes, layout, the largest
    bucket, this rank's random gradients, the bucket's packed ``(N, S)`` rows)."""
    shapes = {k: s for k, s in SHAPES.items() if k != "bigpad"}
    layout = make_layout({k: torch.empty(s) for k, s in shapes.items()}, dist.get_world_size())
    bucket = max(plan_buckets(layout, 2**20), key=lambda b: b.shard_numel)
    gen = torch.Generator().manual_seed(seeded(seed + dist.get_rank()))
    grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    return shapes, layout, bucket, grads, buckets.pack_grads(grads, layout, bucket)


def _reduce_through_a_pool() -> dict[str, Any]:
    """The all-to-all reduce with a pool: it receives into the pool's buffer, lent while the
    bucket is in flight and given back by ``wait()``; the same sums as without a pool; and
    ``reduce_grads`` with a pool takes no new buffer from its second call on."""
    rank = dist.get_rank()
    shapes, layout, bucket, grads, rows = _one_packed_bucket(7)
    plain = buckets.launch_reduce(rows.clone(), layout, bucket, None, "all_to_all").wait()
    pool, mine = buckets.StagingPool(), torch.empty(rows.numel())
    pool.give(mine)
    pending = buckets.launch_reduce(rows.clone(), layout, bucket, None, "all_to_all", async_op=True, staging=pool)
    lent = not pool.buffers()
    pooled = pending.wait()
    back = [b.data_ptr() for b in pool.buffers()] == [mine.data_ptr()]
    policy, held, mismatches = zf.CommPolicy(reduce="all_to_all"), [], []
    for step in range(3):
        gen = torch.Generator().manual_seed(seeded(100 * step + rank))
        grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
        a = zf.reduce_grads(grads, layout, bucket_numel=64, comm_policy=policy, staging=pool)
        b = zf.reduce_grads(grads, layout, bucket_numel=64, comm_policy=policy)
        mismatches += [(step, k) for k in b if not torch.equal(a[k], b[k])]
        held.append(sorted(b.data_ptr() for b in pool.buffers()))
    return {"equal": torch.equal(pooled, plain), "lent": lent, "back": back, "held": held, "mismatches": mismatches}


def test_an_all_to_all_reduce_receives_into_a_pools_buffer(world):
    for res in world.run(_reduce_through_a_pool):
        assert res["equal"] and res["back"] and res["mismatches"] == []
        assert res["lent"] == (world.world_size > 1)  # one rank sends nothing: no all-to-all, nothing lent
        assert res["held"][1] == res["held"][2]


def _summed_in_place(how: str) -> dict[str, Any]:
    """``launch_reduce(out=)`` gives ``out`` itself, bitwise the sum without it; ``reduce_grads``
    then writes into its flat gradient buffer by the collective's sum alone (no copy there)."""
    _, layout, bucket, grads, rows = _one_packed_bucket(11)
    plain = buckets.launch_reduce(rows.clone(), layout, bucket, None, how).wait()
    dest = torch.full((bucket.shard_numel,), float("nan"))
    got = buckets.launch_reduce(rows.clone(), layout, bucket, None, how, async_op=True, out=dest).wait()
    refused = []  # a wrong destination (short, float64, strided) is refused before the collective: none hangs
    for bad in (dest[1:], dest.double(), torch.empty(bucket.shard_numel, 2)[:, 0]):
        with pytest.raises(ValueError) as e:
            buckets.launch_reduce(rows.clone(), layout, bucket, None, how, out=bad)
        refused.append(str(e.value))
    policy = zf.CommPolicy(reduce=how) if how != "all_reduce" else None
    with CopyTargets() as mode:
        shards = zf.reduce_grads(grads, layout, stage=1 if how == "all_reduce" else 2, comm_policy=policy)
    into = mode.into(b for b in shards.buffers if b is not None)
    alone = zf.reduce_grads(
        grads, layout, stage=1 if how == "all_reduce" else 2, comm_policy=policy, staging=buckets.StagingPool()
    )
    same = all(torch.equal(shards[k], alone[k]) for k in alone)
    return {
        "is_out": got is dest,
        "equal": torch.equal(got, plain),
        "copies_into_shards": into,
        "same": same,
        "refused": refused,
    }


@pytest.mark.parametrize("how", ["all_to_all", "reduce_scatter", "all_reduce"])
def test_a_reduced_row_is_summed_where_the_shards_keep_it(world, how):
    """The all-to-all's rank-order sum (gloo's default) writes the row straight into the
    shards' flat buffer: no copy writes there. The reduce-scatter's output is that range
    (how the backend fills it is its own); the all-reduce (stage 1) and one rank (no
    collective) copy the row in, once."""
    for res in world.run(_summed_in_place, how):
        assert res["is_out"] and res["equal"] and res["same"], res
        assert len(res["refused"]) == 3 and all("out= takes this rank's row of the sum" in m for m in res["refused"])
        if how == "all_to_all" and world.world_size > 1:
            assert res["copies_into_shards"] == 0, res
        elif how == "all_reduce" or world.world_size == 1:
            assert res["copies_into_shards"] == 1, res
