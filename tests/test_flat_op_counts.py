"""The cost of a step does not grow with the number of tensors: aten calls, counted.

One ``step_shards``, one ``reduce_grads`` and one ``gather_params`` on a model of 10
tensors and on one of 1,000 tensors with the same total numel, dtype and param groups, at
world sizes 2 and 3, pure and donated. A ``TorchDispatchMode`` counts the aten calls that
compute or allocate (views apart: a dict of named tensors at the API boundary needs a
view each), which is exact and machine-independent; no timing.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import zerofn as zf

TOTAL = 11_000  # elements in either model: 10 x 1,100 or 1,000 x 11 (padded shards at N = 2 and 3)
BUCKET = 1 << 20  # one bucket holds either model


class _Count(TorchDispatchMode):
    """Counts the aten calls that compute or allocate (views and metadata reads apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace in ("aten", "c10d", "_c10d_functional"):
            self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _params(count: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    size = TOTAL // count
    return {f"p{i}": torch.randn(size, generator=gen) for i in range(count)}


def _all_counts(count: int) -> dict[tuple[str, bool], dict[str, dict[str, int]]]:
    """The counts of every (optimizer, donate) on a model of ``count`` tensors, on this rank.

    ``reduce_grads`` reads neither the optimizer nor ``donate`` (the same grads, the same
    layout for both optimizers): its calls are counted once and stand for all four. Each
    optimizer's state takes one step first (SGD's momentum buffers exist from then on,
    and every cache is warm); its pure step runs before its donated one, which gets a copy
    of the shards.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    params = _params(count)
    gen = torch.Generator().manual_seed(1 + rank)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    opts = {"adamw": zf.optim.adamw(lr=1e-2), "sgd": zf.optim.sgd(lr=0.1, momentum=0.9)}
    states = {name: zf.shard_params(params, opt, check=False) for name, opt in opts.items()}
    layout = states["adamw"].layout
    assert all(state.layout == layout for state in states.values())
    zf.reduce_grads(grads, layout, bucket_numel=BUCKET)  # warm
    with _Count() as c:
        shards = zf.reduce_grads(grads, layout, bucket_numel=BUCKET)
    reduced = dict(c.calls)
    out: dict[tuple[str, bool], dict[str, dict[str, int]]] = {}
    for name, state in states.items():
        state, _ = zf.step_shards(state, pytree.tree_map(torch.clone, shards), max_norm=1.0)
        for donate in (False, True):
            given = pytree.tree_map(torch.clone, shards) if donate else shards
            with _Count() as c:
                new_state, info = zf.step_shards(state, given, max_norm=1.0, donate=donate)
            stepped = dict(c.calls)
            assert not info.skipped
            with _Count() as c:
                zf.gather_params(new_state, bucket_numel=BUCKET)
            out[name, donate] = {"reduce_grads": reduced, "step_shards": stepped, "gather_params": dict(c.calls)}
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_a_step_costs_the_same_aten_calls_for_10_and_1000_tensors(worlds, n):
    world = worlds[n]
    few, many = world.run(_all_counts, 10), world.run(_all_counts, 1000)
    for rank in range(n):
        for (opt, donate), stages in few[rank].items():
            for stage in ("reduce_grads", "step_shards", "gather_params"):
                a, b = collections.Counter(stages[stage]), collections.Counter(many[rank][opt, donate][stage])
                what = f"rank {rank} {opt} donate={donate} {stage}: 10 tensors {dict(a)}, 1,000 tensors {dict(b)}"
                # The same calls, but for one zero_ per bucket where some member's shard has
                # padding (the 1,000 tensors of 11 elements have some at N = 2, the 10 of 1,100 none).
                assert not a - b, what
                assert set(b - a) <= {"aten.zero_"} and (b - a)["aten.zero_"] <= 1, what
                # A small constant: Adam's written-out rule adds about twenty 0-d float64
                # operations per run (bias corrections, step size), whatever the tensor count.
                assert sum(b.values()) < 60, what


def _steps_of_a_copy(count: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """``step_shards``' aten calls on a state and on its copy made leaf by leaf, and how many
    step-count tensors the copy holds."""
    params = _params(count)
    grads = zf.reduce_grads({n: torch.ones_like(p) for n, p in params.items()}, zf.make_layout(params, 1))
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), check=False)
    copy = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
    counts = []
    for s in (state, copy):
        with _Count() as c:
            zf.step_shards(s, grads)
        counts.append(dict(c.calls))
    return len({id(t) for t in copy.opt_state.step.values()}), counts[0], counts[1]


def test_a_state_copied_leaf_by_leaf_shares_its_step_counts_and_steps_in_one_run(worlds):
    """``tree_map(torch.clone, state)`` gives every name its own step-count tensor; the state
    shares equal counts again (one per param group), so Adam still runs once per flat
    buffer, not once per param: a compiled step over such a copy updates each buffer whole
    instead of as a concatenation of its 1,000 params (a kernel inductor cannot compile)."""
    shared, original, copied = worlds[1].run(_steps_of_a_copy, 1000)[0]
    assert shared == 1
    assert copied == original
