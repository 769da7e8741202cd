"""``value_and_reduced_grads`` is ``reduce_grads(torch.func.grad(loss_fn)(...))`` bit for bit,
with its buckets reduced during the backward; it changes none of its inputs; bad input
raises on every rank before any bucket is sent.

Each case runs on real gloo ranks at N = 1 to 4 and compares, on the ranks, with the
composition it replaces under the same options (stage, wire dtype, realisation, bucket
size, staging), so the reference's sum is zerofn's own order: bitwise at any N.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from helpers import Snapshot, assert_bitwise_equal, assert_trees_equal, seeded

import zerofn as zf

BUCKET = 48  # several buckets per backward, so several launch from the hooks


def _params() -> dict[str, torch.Tensor]:
    """Two layers in layout order, a 0-d gain, a bfloat16 matrix (a bucket of its own), an
    empty param, and a param the loss does not use, last in the layout (its bucket's turn
    comes first)."""
    gen = torch.Generator().manual_seed(seeded(0))
    return {
        "a.weight": torch.randn(7, 13, generator=gen),
        "a.bias": torch.randn(13, generator=gen),
        "gain": torch.randn((), generator=gen),
        "low": torch.randn(13, 3, generator=gen).to(torch.bfloat16),
        "b.weight": torch.randn(13, 5, generator=gen),
        "b.bias": torch.randn(5, generator=gen),
        "empty": torch.empty(0, 3),
        "unused": torch.randn(6, generator=gen),
    }


class _Probe(torch.autograd.Function):
    """Identity whose backward records the bucket bytes sent so far: it runs just before the
    first layer's gradients accumulate, after the second layer's did."""

    seen: list[int] = []  # noqa: RUF012 (per rank, reset by each case)
    counter: zf.CommCounter | None = None

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        if _Probe.counter is not None:
            by = _Probe.counter.by_collective
            _Probe.seen.append(sum(by.get(k, 0) for k in ("all_to_all", "all_reduce", "reduce_scatter")))
        return g


def _loss_fn(p, x, y, probe=False):
    w = _Probe.apply(p["a.weight"]) if probe else p["a.weight"]
    h = torch.tanh(x @ w + p["a.bias"]) * p["gain"]
    out = h @ p["b.weight"] + p["b.bias"] + (h @ p["low"].float()).sum(dim=1, keepdim=True)
    return ((out - y) ** 2).mean()


def _matches_reduce_grads_of_torch_func_grad() -> list[int]:
    params = _params()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seeded(10 + rank))
    x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
    layout = zf.shard_params(params, zf.optim.sgd(lr=0.1)).layout
    pool = zf.buckets.StagingPool()
    options = [
        {"stage": 2},
        {"stage": 1},
        {"stage": 2, "comm_dtype": torch.float64},
        {"stage": 2, "comm_policy": zf.CommPolicy.byte_optimal(), "staging": pool},
        {"stage": 1, "bucket_numel": zf.stages.DEFAULT_BUCKET_NUMEL},
    ]
    # Whole placements (Muon's, Adafactor's): the owner's rows carry them, shards on the owner only.
    whole = zf.make_layout(params, dist.get_world_size(), placement={"a.weight": "whole", "b.weight": "whole"})
    options.append({"stage": 2, "layout": whole})
    sent_before_first_layer = []
    for kw in options:
        kw = {"bucket_numel": BUCKET, **kw}
        layout = kw.pop("layout", layout)
        snap = Snapshot((params, x, y))
        grads, want_loss = torch.func.grad_and_value(_loss_fn)(params, x, y)
        want = zf.reduce_grads(grads, layout, **kw)
        fn = zf.value_and_reduced_grads(lambda p, x, y: _loss_fn(p, x, y, probe=True), layout, **kw)
        with zf.count_bytes() as counter:
            _Probe.seen, _Probe.counter = [], counter
            loss, shards = fn(params, x, y)
        _Probe.counter = None
        snap.assert_unchanged((params, x, y), "value_and_reduced_grads(params, x, y)")
        assert all(p.grad is None and not p.requires_grad for p in params.values())
        assert isinstance(shards, zf.FrozenDict)
        assert_trees_equal(dict(shards), dict(want))
        assert_bitwise_equal(loss, want_loss, "loss")
        assert not loss.requires_grad
        if kw.get("staging") is pool:  # the pool got its buffers back and the shards do not alias them
            held = {b.untyped_storage().data_ptr() for b in pool.buffers()}
            assert held and not held & {s.untyped_storage().data_ptr() for s in shards.values() if s.numel()}
        sent_before_first_layer.extend(_Probe.seen)
    # has_aux, and a loss that does not depend on the params (every shard zero)
    (loss, aux), shards = zf.value_and_reduced_grads(
        lambda p: (_loss_fn(p, x, y), {"h": p["a.weight"] * 2}), layout, bucket_numel=BUCKET, has_aux=True
    )(params)
    assert_bitwise_equal(aux["h"], params["a.weight"] * 2, "aux")
    assert not aux["h"].requires_grad and not loss.requires_grad

    # A param only some ranks reach: its bucket leaves at different times on different ranks,
    # in the same order of collectives; its mean counts the others' zeros.
    def some_use(p, x, y):
        return _loss_fn(p, x, y) + (p["unused"].sum() if rank % 2 == 0 else 0.0)

    want = zf.reduce_grads(torch.func.grad(some_use)(params, x, y), layout, bucket_numel=BUCKET)
    _, got = zf.value_and_reduced_grads(some_use, layout, bucket_numel=BUCKET)(params, x, y)
    assert_trees_equal(dict(got), dict(want))
    _, zeros = zf.value_and_reduced_grads(lambda p: x.sum(), layout, bucket_numel=BUCKET)(params)
    assert_trees_equal(dict(zeros), dict(zf.reduce_grads({n: torch.zeros_like(p) for n, p in params.items()}, layout)))
    return sent_before_first_layer


@pytest.mark.numerics
def test_value_and_reduced_grads_is_reduce_grads_of_torch_func_grad_reduced_during_the_backward(world):
    sent = world.run(_matches_reduce_grads_of_torch_func_grad)
    # With BUCKET small the second layer's bucket went out before the first layer's
    # gradients existed (all-reduce realisation, the cases but byte_optimal): overlap.
    if world.world_size > 1:
        assert all(s[0] > 0 and s[1] > 0 and s[2] > 0 for s in sent), sent


def _hybrid() -> bool:
    shards_of = [[0, 1], [2, 3]]
    made = {tuple(r): dist.new_group(r) for r in [*shards_of, [0, 2], [1, 3]]}
    me = dist.get_rank()
    shard = made[(0, 1)] if me < 2 else made[(2, 3)]
    replicate = made[(0, 2)] if me % 2 == 0 else made[(1, 3)]
    params = _params()
    gen = torch.Generator().manual_seed(seeded(20 + me))
    x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
    layout = zf.shard_params(params, zf.optim.sgd(lr=0.1), shard).layout
    for stage in (1, 2):
        kw = {"stage": stage, "bucket_numel": BUCKET, "replicate_group": replicate, "comm_dtype": torch.float64}
        want = zf.reduce_grads(torch.func.grad(_loss_fn)(params, x, y), layout, shard, **kw)
        _, got = zf.value_and_reduced_grads(_loss_fn, layout, shard, **kw)(params, x, y)
        assert_trees_equal(dict(got), dict(want))
    return True


def test_value_and_reduced_grads_on_a_hybrid_layout_is_reduce_grads(worlds):
    assert worlds[4].run(_hybrid) == [True] * 4


def _bad(case: str) -> tuple[str, str, dict[str, int], bool]:
    params = _params()
    rank = dist.get_rank()
    layout = zf.make_layout(params, dist.get_world_size())
    loss_fn = _loss_fn
    x, y = torch.randn(4, 7), torch.randn(4, 5)
    if case == "shape" and rank == 0:  # one rank only: the others must raise too, not hang
        params["b.bias"] = torch.zeros(6)
    elif case == "missing":
        del params["unused"]
    elif case == "not_scalar":
        loss_fn = lambda p, x, y: _loss_fn(p, x, y) * torch.ones(2)  # noqa: E731
    elif case == "raises" and rank == 0:
        loss_fn = lambda p, x, y: p["nope"]  # noqa: E731
    snap = Snapshot(params)
    fn = zf.value_and_reduced_grads(loss_fn, layout, bucket_numel=BUCKET)
    with zf.count_bytes() as counter:
        try:
            fn(params, x, y)
        except Exception as e:
            snap.assert_unchanged(params, case)
            failed = type(e).__name__, str(e), dict(counter.by_collective)
        else:
            raise AssertionError(f"{case}: nothing raised")
    # The next call with good input works: the same transform where its loss_fn is good (on a
    # rank that raised from inside its backward, its leaves kept a partial gradient).
    good = _params()
    again = fn if loss_fn is _loss_fn else zf.value_and_reduced_grads(_loss_fn, layout, bucket_numel=BUCKET)
    _, shards = again(good, x, y)
    want = zf.reduce_grads(torch.func.grad(_loss_fn)(good, x, y), layout, bucket_numel=BUCKET)
    assert_trees_equal(dict(shards), dict(want))
    return (*failed, True)


@pytest.mark.parametrize("case", ["shape", "missing", "not_scalar", "raises"])
def test_bad_input_raises_on_every_rank_before_any_bucket_is_sent(worlds, case):
    results = worlds[2].run(_bad, case)
    for rank, (kind, message, sent, recovered) in enumerate(results):
        assert recovered
        assert set(sent) <= {"check"}, sent  # the agreement all-gather only
        if case == "shape":
            want = ("ValueError", "b.bias") if rank == 0 else ("RankMismatchError", "rank 0 rejected")
        elif case == "raises":
            want = ("KeyError", "nope") if rank == 0 else ("RankMismatchError", "rank 0 rejected")
        else:
            want = {"missing": ("KeyError", "unused"), "not_scalar": ("ValueError", "0-d")}[case]
        assert kind == want[0] and want[1] in message, (rank, kind, message)


def _agreement_settles_inside_the_backward() -> list[str]:
    """The order of: the backward's first node, each settle of the agreement, each bucket sent."""
    from zerofn import _agreement  # internal: the agreement's settle is what the order is about

    params = _params()
    gen = torch.Generator().manual_seed(seeded(30 + dist.get_rank()))
    x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
    layout = zf.make_layout(params, dist.get_world_size())
    events: list[str] = []

    class First(torch.autograd.Function):  # the loss's own node: the backward's first
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            events.append("backward")
            return g

    settle = _agreement.Agreement.settle

    def recorded(self):
        events.append("settle")
        return settle(self)

    _agreement.Agreement.settle = recorded
    try:
        with zf.count_bytes() as counter:
            fn = zf.value_and_reduced_grads(lambda p, x, y: First.apply(_loss_fn(p, x, y)), layout, bucket_numel=BUCKET)
            fn(params, x, y)
    finally:
        _agreement.Agreement.settle = settle
    assert counter.calls_by_collective.get("check", 0) == (1 if dist.get_world_size() > 1 else 0)
    return events


def test_the_agreement_travels_while_the_backward_runs(world):
    # Launched after the forward, read before the first bucket is sent: the backward began first.
    for events in world.run(_agreement_settles_inside_the_backward):
        assert events[0] == "backward" and "settle" in events, events


def test_bad_options_raise_when_the_transform_is_made():
    layout = zf.make_layout(_params(), 2)
    for kwargs, match in [
        ({"stage": 3}, "stage must be 1 or 2"),
        ({"bucket_numel": 0}, "bucket_numel must be a positive int"),
        ({"precision": "bf16"}, "PrecisionPolicy"),
        ({"staging": []}, "StagingPool"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            zf.value_and_reduced_grads(_loss_fn, layout, **kwargs)


def _one_transform_over_many_calls() -> None:
    """One transform called step after step, as a training loop does: the params updated in
    place (``gather_params(out=params)``), one param's memory swapped (``p.data = ...``), a new
    dict of new tensors; every call's shards are ``reduce_grads`` of ``torch.func.grad`` at the
    values of that call, bitwise."""
    params = _params()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seeded(20 + rank))
    x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1))
    seen: list[dict[str, torch.Tensor]] = []

    def loss_fn(p, x, y):
        seen.append(dict(p))
        return _loss_fn(p, x, y)

    fn = zf.value_and_reduced_grads(loss_fn, state.layout, bucket_numel=BUCKET)

    def call_and_compare(params):
        want = zf.reduce_grads(torch.func.grad(_loss_fn)(params, x, y), state.layout, bucket_numel=BUCKET)
        _, shards = fn(params, x, y)
        assert_trees_equal(dict(shards), dict(want))
        assert all(p.grad is None and not p.requires_grad for p in params.values())
        return shards

    for _ in range(3):  # the donated loop: the same tensors, new values written into them
        state, _ = zf.step_shards(state, call_and_compare(params))
        zf.gather_params(state, out=params)
    # The leaves were made once and reused (the hooks with them), each a view of its param.
    assert all(seen[0][n] is seen[-1][n] for n in params)
    assert all(seen[-1][n].data_ptr() == params[n].data_ptr() for n in params if params[n].numel())
    # A param whose memory is swapped in place gets a new leaf: the gradient is taken at the new values.
    params["b.weight"].data = params["b.weight"] * 3.0
    call_and_compare(params)
    assert seen[-1]["b.weight"] is not seen[-2]["b.weight"] and seen[-1]["a.weight"] is seen[-2]["a.weight"]
    # New tensors (the pure loop): a kept leaf goes with the param it was made for, at once.
    old_leaf = weakref.ref(seen[-1]["a.weight"])
    seen.clear()
    params = {n: p.clone() for n, p in params.items()}
    gc.collect()
    assert old_leaf() is None, "a kept leaf outlived the param it was made for"
    call_and_compare(params)
    # A call from inside its own loss_fn is refused, on every rank, and the transform still works.
    nested = zf.value_and_reduced_grads(lambda p, x, y: nested(p, x, y)[0], state.layout, bucket_numel=BUCKET)
    with pytest.raises(RuntimeError, match="called again from inside one of its own calls"):
        nested(params, x, y)
    call_and_compare(params)


def test_one_transform_over_many_calls_reuses_its_leaves_and_follows_the_params(world):
    world.run(_one_transform_over_many_calls)
