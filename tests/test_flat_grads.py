"""The gradient shards are flat from the reduction on: ``reduce_grads``,
``value_and_reduced_grads`` and the facade's stage-2 reducer hand ``step_shards`` a
``FlatDict`` on the state's flat layout (each bucket's row written into its range, the
ranges of params without a gradient zero), so the step packs nothing; and a compiled
``step_shards`` updates once per flat buffer, its graph the same size for 10 tensors as
for 100, bitwise the eager step also when some params have no gradient.

Real gloo ranks; the values themselves are checked bitwise elsewhere
(tests/test_value_and_reduced_grads.py, tests/test_reducer.py, tests/test_jit.py): here
the structure, and that a step from the flat shards lands where a step from the same
values held per name lands.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from helpers import Net, assert_bitwise_equal, assert_trees_equal, batches, seeded

import zerofn as zf
from zerofn.flat import FlatDict

BUCKET = 48  # several buckets per group


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seeded(0))
    return {
        "a": torch.randn(7, 5, generator=gen),
        "b": torch.randn(11, generator=gen),
        "gain": torch.randn((), generator=gen),
        "low": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "c": torch.randn(4, 4, generator=gen),
    }


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ p["a"]) * p["gain"]
    return (h.sum() * p["b"].sum() + (h @ p["low"].float()).sum() + (p["c"] ** 2).sum()) / 100


def _functional_shards_are_flat() -> None:
    params = _params()
    state = zf.shard_params(params, zf.optim.adamw(lr=1e-2), check=False)
    fl = state.master.flat_layout
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(seeded(1 + dist.get_rank())))
    grads = torch.func.grad(_loss)(params, x)
    reduced = zf.reduce_grads(grads, state.layout, bucket_numel=BUCKET)
    _, during = zf.value_and_reduced_grads(_loss, state.layout, bucket_numel=BUCKET)(params, x)
    for shards in (reduced, during):
        assert isinstance(shards, FlatDict) and shards.flat_layout == fl and shards.holds_all
    assert_trees_equal(dict(during), dict(reduced))
    # A param without a gradient (layer drop): not held, its range zero, the others as before.
    dropped = zf.reduce_grads({n: g for n, g in grads.items() if n != "b"}, state.layout, bucket_numel=BUCKET)
    assert isinstance(dropped, FlatDict) and "b" not in dropped and not dropped.holds_all
    g, off, k = fl.where["b"]
    assert torch.count_nonzero(dropped.buffers[g][off : off + k]) == 0
    assert_trees_equal(dict(dropped), {n: t for n, t in reduced.items() if n != "b"})
    # A step from the flat shards is a step from the same values held per name.
    flat_step, _ = zf.step_shards(state, reduced)
    named_step, _ = zf.step_shards(state, {n: t.clone() for n, t in reduced.items()})
    assert_trees_equal(dict(flat_step.master), dict(named_step.master))


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_grads_and_value_and_reduced_grads_return_flat_shards(worlds, n):
    worlds[n].run(_functional_shards_are_flat)


def _facade_hands_step_flat_shards() -> None:
    rank = dist.get_rank()
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(seeded(0))
        model = Net()
        models.append(model)
        opts.append(
            zf.ZeroOptimizer(
                model.named_parameters(), zf.optim.adamw(lr=1e-2), partition_grad=True, reduce_bucket_size=64
            )
        )
    data = batches(rank, 3)
    for step in range(3):
        x, y = next(data)
        for model, opt in zip(models, opts, strict=True):
            opt.backward(((model(x, step != 1) - y) ** 2).mean())
        reducer = opts[0]._reducer
        held = dict(reducer.step_grads.peek_step_grads())
        taken = reducer.step_grads.take_step_grads()
        master = opts[0]._state.master
        assert isinstance(taken, FlatDict) and taken.flat_layout == master.flat_layout
        assert set(taken) == set(held)
        assert_trees_equal(dict(taken), {n: held[n] for n in taken})  # (the flat ones in layout order)
        for name in taken.flat_layout.names:  # the ranges of params without a gradient are zero
            if name not in taken and taken.flat_layout.where[name][0] >= 0:
                g, off, k = taken.flat_layout.where[name]
                assert torch.count_nonzero(taken.buffers[g][off : off + k]) == 0, name
        reducer.step_grads.give_back(taken)  # as a vetoed step does: the next step applies them
        for opt in opts:
            opt.step()
            opt.zero_grad()
        a, b = (dict(m.named_parameters()) for m in models)
        assert_trees_equal({n: t.detach() for n, t in a.items()}, {n: t.detach() for n, t in b.items()})


def test_the_facade_hands_step_its_stage2_shards_flat(worlds):
    worlds[2].run(_facade_hands_step_flat_shards)


def _graph_sizes(opt_name: str) -> dict[int, int]:
    """Nodes in the graph of a compiled ``step_shards`` on 10 and on 100 tensors (same numel)."""
    sizes: dict[int, int] = {}
    for count in (10, 100):
        torch._dynamo.reset()
        nodes: list[int] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: Any, nodes: list[int] = nodes) -> Any:
            nodes.append(len(gm.graph.nodes))
            return gm.forward

        gen = torch.Generator().manual_seed(seeded(0))
        params = {f"p{i}": torch.randn(1100 // count, generator=gen) for i in range(count)}
        if opt_name == "adamw":
            opt = zf.optim.adamw(lr=torch.tensor(1e-2, dtype=torch.float64), weight_decay=0.1)
        else:
            opt = zf.optim.sgd(lr=torch.tensor(0.1, dtype=torch.float64), momentum=0.9)
        state = zf.shard_params(params, opt, check=False)
        grads = zf.reduce_grads({n: torch.randn(p.shape, generator=gen) for n, p in params.items()}, state.layout)
        state, _ = zf.step_shards(state, grads)  # SGD's momentum exists from the first step on
        step = torch.compile(lambda s, g: zf.step_shards(s, g, max_norm=1.0), backend=backend, fullgraph=True)
        step(state, grads)
        assert len(nodes) == 1, nodes
        sizes[count] = nodes[0]
    return sizes


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_a_compiled_step_does_not_grow_with_the_tensor_count(worlds, opt_name):
    for sizes in worlds[2].run(_graph_sizes, opt_name):
        assert sizes[10] == sizes[100], sizes


def _compiled_with_gaps(opt_name: str) -> int:
    """A compiled ``step_shards`` (aot_eager) on flat shards some params are missing from
    (their ranges kept, one ``cat`` per buffer), a whole param among them: bitwise the eager step."""
    gen = torch.Generator().manual_seed(seeded(0))
    params = {f"p{i}": torch.randn(7 + i, generator=gen) for i in range(6)}
    params["w"] = torch.randn(4, 4, generator=gen)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    if opt_name == "adamw":
        opt = zf.optim.adamw(lr=lr, weight_decay=0.1, amsgrad=True)
    else:
        opt = zf.optim.sgd(lr=lr, momentum=0.9, nesterov=True)
    state = zf.shard_params(params, opt, check=False, placement={"w": "whole"})
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))  # SGD's momentum exists from here on
    some = zf.reduce_grads({n: g for n, g in grads.items() if n not in ("p2", "p3")}, state.layout)
    assert isinstance(some, FlatDict) and "p2" not in some
    eager, _ = zf.step_shards(state, some, max_norm=1.0)
    torch._dynamo.reset()
    step = torch.compile(lambda s, g: zf.step_shards(s, g, max_norm=1.0), backend="aot_eager", fullgraph=True)
    compiled, _ = step(state, some)
    assert isinstance(compiled.master, FlatDict)
    want = pytree.tree_leaves((eager.master, eager.opt_state, eager.step))
    got = pytree.tree_leaves((compiled.master, compiled.opt_state, compiled.step))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(a, b, f"leaf {i}")
    return len(got)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_a_compiled_step_on_flat_shards_with_gaps_is_the_eager_step(worlds, opt_name):
    worlds[2].run(_compiled_with_gaps, opt_name)


def _compiled_gather_storages() -> tuple[int, int]:
    """A compiled gather_params' fresh params: (distinct storages, params); eagerly they share one."""
    gen = torch.Generator().manual_seed(seeded(0))
    params = {f"p{i}": torch.randn(5 + i, generator=gen) for i in range(6)}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1), check=False)
    torch._dynamo.reset()
    gathered = torch.compile(lambda s: zf.gather_params(s, check=False), backend="aot_eager", fullgraph=True)(state)
    for n, p in params.items():
        assert_bitwise_equal(gathered[n], p, n)
    return len({t.untyped_storage().data_ptr() for t in gathered.values()}), len(gathered)


def test_a_compiled_gather_returns_separate_params_not_views_of_one_buffer(worlds):
    # Graph outputs that are views of one buffer are rebuilt view by view on every call of
    # the compiled graph (the compiled facade's step paid that per param, per step).
    for storages, count in worlds[2].run(_compiled_gather_storages):
        assert storages == count
