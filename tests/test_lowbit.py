"""zerofn.lowbit: torchao's 8-bit, 4-bit and fp8 AdamW state, the same bits at every world size.

The averaged gradient is made the same at every N by construction: every rank cuts its
shard out of one global gradient (the same seeded tensors everywhere), so whatever the
optimizer does with it is the only thing that could depend on N. Params after 30 steps
of ``step_shards`` are compared bitwise across N = 1, 2, 3, 4, and at N = 1 with the plain
torchao optimizer. torchao compiles its update; here both run it eagerly (``torch.compile``
replaced by the identity for the plain optimizer, zerofn's default ``compile=False``): the
compiled path is measured in benchmarks/ (README, "Low-bit optimizer state").

The quantized param has 64 * 64 = 4096 elements, torchao's smallest quantized size:
eager 8-bit and 4-bit quantization on the CPU is one ``aten::index`` gather per code bit.
"""

from __future__ import annotations

import contextlib
import sys
import unittest.mock
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from conftest import get_world, reference_world
from helpers import assert_trees_equal, seeded

import zerofn as zf
from zerofn.buckets import cut_shard
from zerofn.layout import make_layout
from zerofn.testing import World

KINDS = ("adamw8bit", "adamw4bit", "adamwfp8")
STEPS = 30
HP = dict(lr=1e-2, weight_decay=0.1)
SHAPES = {"w": (64, 64), "b": (64,), "odd": (7, 9)}


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seeded(0))
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _grads(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seeded(1))
    return [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(steps)]


def _torchao_class(kind: str) -> type:
    import torchao.optim

    return {"adamw8bit": torchao.optim.AdamW8bit, "adamw4bit": torchao.optim.AdamW4bit}.get(
        kind, torchao.optim.AdamWFp8
    )


@contextlib.contextmanager
def _eager_one_thread() -> Iterator[None]:
    """The plain torchao optimizer as the ranks run it: its update eagerly (``torch.compile``
    replaced by the identity) and one intra-op thread. torchao's 8-bit and 4-bit code search
    is a chain of small ``aten::index`` gathers; split over two threads on a busy machine
    their barriers cost seconds per step (measured: 30 steps of a 4096-element param, 25 ms
    of CPU on one thread, 12.8 s of wall time on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with unittest.mock.patch.object(torch, "compile", lambda fn, **kw: fn):
            yield
    finally:
        torch.set_num_threads(threads)


def _train_functional(kinds: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """On every rank: 30 ``step_shards`` per optimizer, each rank's grad shard cut from the global gradient."""
    rank = dist.get_rank()
    out = {}
    for kind in kinds:
        state = zf.shard_params(_params(), getattr(zf.optim, kind)(**HP))
        assert state.nbytes == _expected_nbytes(state.layout, kind)
        for g in _grads():
            shards = {s.name: cut_shard(g[s.name], s, rank) for s in state.layout.params}
            state, info = zf.step_shards(state, shards)
            assert not info.skipped
        out[kind] = zf.gather_params(state)
    return out


def _expected_nbytes(layout, kind: str) -> int:
    """Masters + state bytes of one rank: fp32 master and step; a quantized moment is its
    codes (1 byte per element, half for 4-bit), one fp32 scale per block and torchao's code
    table (256 entries for 8-bit, 16 for 4-bit, none for fp8); an fp32 moment 4 bytes."""
    codes, table = {"adamw8bit": (1.0, 256), "adamw4bit": (0.5, 16), "adamwfp8": (1.0, 0)}[kind]
    total = 0
    for s in layout.params:
        chunk = s.shard_numel
        moment = codes * chunk + 4 * chunk // s.block + 4 * table if s.block else 4 * chunk
        total += 4 + 4 * chunk + 2 * int(moment)
    return total


_results: dict[World, dict[str, dict[str, torch.Tensor]]] = {}  # by the pool that ran it


def _on(world) -> dict[str, dict[str, torch.Tensor]]:
    if world not in _results:
        _results[world] = world.run(_train_functional, KINDS)[0]
    return _results[world]


def _at(n: int) -> dict[str, dict[str, torch.Tensor]]:
    return _on(get_world(n))


def _one_rank_like(n: int) -> dict[str, dict[str, torch.Tensor]]:
    """The one-rank run on the kernels of the pool of ``n`` ranks (``conftest.reference_world``)."""
    return _on(reference_world(n))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_params_after_30_steps_are_bitwise_equal_at_every_world_size(n):
    for kind in KINDS:
        assert_trees_equal(_at(n)[kind], _one_rank_like(n)[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_at_one_rank_bitwise_equal_to_the_plain_torchao_optimizer(kind):
    params = {n: torch.nn.Parameter(t) for n, t in _params().items()}
    opt = _torchao_class(kind)(list(params.values()), **HP)
    with _eager_one_thread():
        for g in _grads():
            for n, p in params.items():
                p.grad = g[n]
            opt.step()
    # torchao quantized the same params zerofn placed blocked(B): the 4096-element matrix only.
    assert [type(opt.state[p]["exp_avg"]).__name__.startswith("OptimState") for p in params.values()] == [
        True,
        False,
        False,
    ]
    assert_trees_equal(_at(1)[kind], {n: p.detach() for n, p in params.items()})


def test_blocked_placement_is_decided_from_the_global_size_and_is_part_of_the_fingerprint():
    opt = zf.optim.adamw8bit(lr=1e-3)
    assert opt.placement("w", (64, 64)) == "blocked(256)"
    assert opt.placement("small", (32, 64)) == "split"  # under 4096 elements: fp32 state, as torchao
    assert opt.placement("ragged", (65, 64)) == "split"  # not whole blocks: fp32 state, as torchao
    shapes = {"w": torch.empty(64, 64, device="meta")}
    for n in (1, 2, 3, 4, 8):
        layout = make_layout(shapes, n, placement={"w": "blocked(256)"})
        spec = layout["w"]
        assert spec.shard_numel % 256 == 0 and 0 <= spec.padding < n * 256
        assert layout.fingerprint != make_layout(shapes, n).fingerprint
        assert layout.fingerprint != make_layout(shapes, n, placement={"w": "blocked(128)"}).fingerprint
    with pytest.raises(ValueError, match=r"'w' \(shape \(64, 64\).*not a multiple of 384"):
        make_layout(shapes, 2, placement={"w": "blocked(384)"})
    with pytest.raises(ValueError, match="must be placed blocked"):
        zf.stages.resolve_placement({"w": torch.zeros(64, 64)}, opt, {"w": "split"})


def test_without_torchao_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(ImportError, match=r"zerofn\[lowbit\]"):
        zf.optim.adamw8bit(lr=1e-3)


# --------------------------------------------------------------------------- the facade

FACADE_STEPS = 4
FACADE = {
    "stage1": dict(partition_grad=False),
    "stage2_overlap_accumulate_clip": dict(
        partition_grad=True, overlap_communication=True, clip_grad_norm=0.05, accumulate=2
    ),
    "stage2_bf16_fp32_masters": dict(partition_grad=True, precision="bf16"),
    "stage2_overlap_allgather": dict(partition_grad=True, overlap_allgather=True),
}


class Lin(torch.nn.Module):
    """``a.weight``: 64 * 64 = 4096 elements, quantized (blocked(256)); the rest fp32 state."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _same_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches on every rank (the mean of equal gradients is exact at N = 1 and 2)."""
    gen = torch.Generator().manual_seed(seeded(7))
    return [(torch.randn(8, 64, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(steps)]


def _train_facade(name: str, kind: str) -> dict[str, torch.Tensor]:
    import torchao.optim

    cfg = dict(FACADE[name])
    accumulate = cfg.pop("accumulate", 1)
    precision = zf.PrecisionPolicy.for_dtype(torch.bfloat16) if cfg.pop("precision", None) else None
    torch.manual_seed(seeded(0))
    model = Lin()
    cls = {"adamw8bit": torchao.optim.AdamW8bit, "adamwfp8": torchao.optim.AdamWFp8}[kind]
    inner = cls(model.parameters(), **HP)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)  # on torchao's own groups (lr a tensor)
    opt = zf.ZeroOptimizer(inner, module=model, reduce_bucket_size=2048, precision=precision, **cfg)
    dtype = next(model.parameters()).dtype
    assert [s.placement for s in opt.state.layout.params] == ["blocked(256)", "split", "split", "split"]
    data = _same_batches(FACADE_STEPS * accumulate)
    for step in range(FACADE_STEPS):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            with opt.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                opt.backward(((model(x.to(dtype)) - y.to(dtype)).float() ** 2).mean() / accumulate)
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.wait_params()  # overlap_allgather: the last gather lands here, not at a next forward
    return {n: p.detach().clone() for n, p in model.named_parameters()}


_facade: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}


def _facade_at(name: str, kind: str, n: int) -> dict[str, torch.Tensor]:
    if (name, kind, n) not in _facade:
        _facade[name, kind, n] = get_world(n).run(_train_facade, name, kind)[0]
    return _facade[name, kind, n]


@pytest.mark.parametrize("name", FACADE)
def test_facade_over_a_torchao_optimizer_is_bitwise_equal_at_one_and_two_ranks(name):
    kind = "adamwfp8" if "bf16" in name else "adamw8bit"
    assert_trees_equal(_facade_at(name, kind, 2), _facade_at(name, kind, 1))


def test_facade_at_one_rank_is_bitwise_the_plain_torchao_optimizer():
    import torchao.optim

    torch.manual_seed(seeded(0))
    model = Lin()
    opt = torchao.optim.AdamW8bit(model.parameters(), **HP)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with _eager_one_thread():
        for x, y in _same_batches(FACADE_STEPS):
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert_trees_equal(_facade_at("stage1", "adamw8bit", 1), {n: p.detach() for n, p in model.named_parameters()})


# --------------------------------------------------------------------------- checkpoints

SAVE_AT = 25  # steps before the save; the last 5 run at the new world size


def _steps(state, grads):
    rank = dist.get_rank()
    for g in grads:
        shards = {s.name: cut_shard(g[s.name], s, rank) for s in state.layout.params}
        state, _ = zf.step_shards(state, shards)
    return state


def _save(path: str) -> None:
    """At N = 2: 25 steps per optimizer, then a sharded checkpoint and the full state dict.

    The full state dict goes through ``torch.save`` (float8 codes do not survive plain
    pickling, which the rank pool uses for results)."""
    for kind in KINDS:
        state = _steps(zf.shard_params(_params(), getattr(zf.optim, kind)(**HP)), _grads()[:SAVE_AT])
        zf.checkpoint.save(f"{path}/{kind}", state)
        full = zf.checkpoint.full_state_dict(state)
        if dist.get_rank() == 0:
            torch.save(full, f"{path}/{kind}.pt")


def _fulls(path: str) -> dict[str, dict]:
    return {kind: torch.load(f"{path}/{kind}.pt", weights_only=False) for kind in KINDS}


def _resume(path: str) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """At M ranks: from the sharded checkpoint and from the full state dict, the last 5 steps."""
    out: dict[str, dict[str, dict[str, torch.Tensor]]] = {"dcp": {}, "full": {}}
    for kind in KINDS:
        opt = getattr(zf.optim, kind)(**HP)
        loaded = zf.checkpoint.load(f"{path}/{kind}", _params(), optimizer=opt)
        assert loaded.layout.world_size == dist.get_world_size() and loaded.step == SAVE_AT
        out["dcp"][kind] = zf.gather_params(_steps(loaded, _grads()[SAVE_AT:]))
        loaded = zf.checkpoint.shard_state_dict(_fulls(path)[kind], _params(), optimizer=opt)
        out["full"][kind] = zf.gather_params(_steps(loaded, _grads()[SAVE_AT:]))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lowbit"))
    get_world(2).run(_save, path)
    return path


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_a_checkpoint_saved_at_two_ranks_resumes_at_m_ranks_bitwise(saved, m):
    # At one rank against the run that never stopped; at M against one rank resuming on the
    # same kernels (conftest.reference_world: the pool of 3 runs on the portable ones, the
    # saving pool of 2 on this machine's): together, at every M the run that never stopped.
    resumed = get_world(m).run(_resume, saved)[0]
    one_rank = {"dcp": _at(1), "full": _at(1)} if m == 1 else reference_world(m).run(_resume, saved)[0]
    for kind in KINDS:
        assert_trees_equal(resumed["dcp"][kind], one_rank["dcp"][kind])
        assert_trees_equal(resumed["full"][kind], one_rank["full"][kind])


def test_the_full_state_dict_is_torchaos_own_and_loads_into_the_plain_optimizer_and_back(saved):
    for kind, full in _fulls(saved).items():
        names = full["zerofn"]["names"]
        params = {n: torch.nn.Parameter(full["zerofn"]["master"][n].clone()) for n in names}
        plain = _torchao_class(kind)([params[n] for n in names], **HP)
        plain.load_state_dict(full)
        assert type(plain.state[params["w"]]["exp_avg"]) is type(full["state"][names.index("w")]["exp_avg"])
        with _eager_one_thread():
            for g in _grads()[SAVE_AT:]:
                for n, p in params.items():
                    p.grad = g[n]
                plain.step()
        assert_trees_equal({n: p.detach() for n, p in params.items()}, _at(1)[kind])
    # and back: the plain optimizer's state dict (no zerofn entry) into zerofn at 3 ranks
    params = {n: torch.nn.Parameter(t) for n, t in _params().items()}
    plain = _torchao_class("adamw8bit")(list(params.values()), **HP)
    with _eager_one_thread():
        for g in _grads()[:SAVE_AT]:
            for n, p in params.items():
                p.grad = g[n]
            plain.step()
    args = (plain.state_dict(), {n: p.detach() for n, p in params.items()})
    back = get_world(3).run(_continue_plain, *args)[0]
    # as one rank continuing on the same kernels, which on this machine's is the run that never stopped
    assert_trees_equal(back, reference_world(3).run(_continue_plain, *args)[0])
    assert_trees_equal(get_world(1).run(_continue_plain, *args)[0], _at(1)["adamw8bit"])


def _continue_plain(sd: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = zf.checkpoint.shard_state_dict(sd, weights, optimizer=zf.optim.adamw8bit(**HP))
    return zf.gather_params(_steps(state, _grads()[SAVE_AT:]))


def _flat_state(sd: dict) -> dict[str, torch.Tensor]:
    """A state dict's tensors by ``index/key`` (quantized ones as their code bytes and scales)."""
    from zerofn import lowbit

    out = {}
    for i, entry in sd["state"].items():
        for k, v in entry.items():
            if lowbit.is_quantized(v):
                out[f"{i}/{k}/codes"], out[f"{i}/{k}/scale"] = v.codes.view(torch.uint8), v.scale
            else:
                out[f"{i}/{k}"] = v
    return out


def _cross_load(fulls: dict[str, dict]) -> list[str]:
    """Facades over fp32 AdamW and AdamW8bit offered each other's state dicts: refused, state unchanged."""
    import torchao.optim

    errors = []
    for cls, other in ((torch.optim.AdamW, "adamw8bit"), (torchao.optim.AdamW8bit, "adamw")):
        torch.manual_seed(seeded(0))
        model = Lin()
        opt = zf.ZeroOptimizer(cls(model.parameters(), **HP), module=model)
        x, y = _same_batches(1)[0]
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        before = opt.state_dict()
        foreign = fulls[other]
        for sd in (foreign, {k: v for k, v in foreign.items() if k != "zerofn"}):  # zerofn's, and a plain one
            with pytest.raises(zf.CheckpointError) as e:
                opt.load_state_dict(sd)
            errors.append(str(e.value))
            assert_trees_equal(_flat_state(opt.state_dict()), _flat_state(before))
    return errors


def test_low_bit_state_offered_to_an_fp32_adamw_facade_and_the_reverse_is_a_checkpoint_error():
    torch.manual_seed(seeded(0))
    fulls = get_world(2).run(_lin_state_dicts)[0]
    errors = get_world(1).run(_cross_load, fulls)[0]
    assert "holds adamw8bit state, but the optimizer is adamw" in errors[0]
    assert "is quantized (OptimState8bit), but the optimizer keeps full-precision state" in errors[1]
    assert "holds adamw state, but the optimizer is adamw8bit" in errors[2]
    assert "is a full-precision Tensor, but the optimizer keeps it quantized in blocks of 256" in errors[3]


def _lin_state_dicts() -> dict[str, dict]:
    import torchao.optim

    out = {}
    for name, cls in (("adamw", torch.optim.AdamW), ("adamw8bit", torchao.optim.AdamW8bit)):
        torch.manual_seed(seeded(0))
        model = Lin()
        opt = zf.ZeroOptimizer(cls(model.parameters(), **HP), module=model)
        for x, y in _same_batches(2):
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
        out[name] = opt.state_dict()
    return out


def test_benchmark_tables_measured_state_bytes_equal_the_formula():
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # the benchmarks package lives at the repository root
        sys.path.insert(0, root)
    from benchmarks import lowbit as bench

    cfg = bench.models.model_config("transformer", quick=True)
    for row in bench.memory_table(cfg, [1, 2, 3]):
        assert row["measured_bytes"] == row["formula_bytes"], row
    pads = bench.padding_table(cfg, [1, 2, 3])
    assert pads[0]["quantized_params"] == 2  # the 256 x 32 embedding and head
    assert all(row["blocked_padding_max_per_param"] < row["world_size"] * row["block"] for row in pads)


def _state_structures() -> list[str]:
    """The pytree structure of a low-bit state after init and after each of two steps, for
    a model with a quantized moment and for one too small to quantize."""
    out = []
    for shapes in (SHAPES, {"b": (64,), "odd": (7, 9)}):
        params = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in shapes.items()}
        state = zf.shard_params(params, zf.optim.adamw8bit(**HP))
        seen = [pytree.tree_structure(state)]
        for _ in range(2):
            grads = {n: torch.randn_like(p) for n, p in params.items()}
            state, _ = zf.step_shards(state, zf.reduce_grads(grads, state.layout))
            seen.append(pytree.tree_structure(state))
        out.append(repr(seen[0]) if all(s == seen[0] for s in seen) else f"changed: {seen}")
    return out


def test_a_step_returns_the_state_in_the_structure_it_was_given():
    """``lowbit`` computes per name; its moments come back flat where they were flat (every
    moment plain: nothing to quantize) and per name where a torchao state tensor is held,
    so a step's outputs have its inputs' structure (what a compiled step needs)."""
    quantized, small = get_world(2).run(_state_structures)[0]
    assert not quantized.startswith("changed") and not small.startswith("changed"), (quantized, small)
    assert "FlatDict" in small and "FrozenDict" in quantized
