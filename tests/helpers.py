"""Shared assertions and a small model/data builder for the zerofn test suite.

Everything here is importable on the worker ranks of a ``World`` too (the tests directory
is on ``sys.path`` of the spawned workers), so rank functions can snapshot their inputs
and check them after a stage function ran.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from zerofn.testing import float64_wire_hook

__all__ = [
    "IN_FEATURES",
    "OUT_FEATURES",
    "Net",
    "Snapshot",
    "Wide",
    "assert_bitwise_equal",
    "assert_trees_close",
    "assert_trees_equal",
    "batches",
    "bits",
    "clip_in_float64",
    "ddp_reference",
    "exact_wire",
    "float64_wire_hook",
    "fp32_wire_sgd_bound",
    "functional_reference",
    "gate_used",
    "max_rel_diff",
    "mean_over_ranks",
    "mse",
    "seeded",
    "tensor_rel_diff",
]

# --------------------------------------------------------------------------- the seed knob
#
# Every seed the suite draws data or initial weights from goes through ``seeded``, so one
# environment variable moves every test to another trajectory, as another machine's
# kernels would: ``ZEROFN_TEST_SEED=3 make test``. At 0 (the default) each seed is itself.

#: The suite's seed offset, ``ZEROFN_TEST_SEED`` (default 0); the spawned ranks inherit it.
TEST_SEED = int(os.environ.get("ZEROFN_TEST_SEED", "0"))
# A prime stride, so the seeds of two knob values never coincide for k below it; the
# largest result stays below 2**32 (numpy's limit) for knob values up to 4000.
_SEED_STRIDE = 1_000_003


def seeded(k: int) -> int:
    """The seed a test uses where it would write ``k``: ``k`` itself at ``ZEROFN_TEST_SEED=0``."""
    return k + _SEED_STRIDE * TEST_SEED


IN_FEATURES = 7
OUT_FEATURES = 5


# --------------------------------------------------------------------------- comparisons


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a flat uint8 tensor (distinguishes -0.0 / +0.0 and NaNs)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype, same shape, same bytes."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    if not torch.equal(bits(actual), bits(expected)):
        diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
        raise AssertionError(f"{what}: values differ bitwise (max abs diff {diff:.3e})")


def assert_trees_equal(actual: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Two ``name -> tensor`` mappings with the same keys (same order) and bitwise-equal tensors."""
    assert list(actual) == list(expected), f"keys differ: {list(actual)} != {list(expected)}"
    for name in expected:
        assert_bitwise_equal(actual[name], expected[name], repr(name))


def tensor_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` over one tensor, computed in float64.

    ``b`` is the reference. If ``b`` is all zeros (or empty) the plain ``max|a - b|`` is
    returned, so an exact match is 0.0 and any difference counts in absolute terms.
    """
    if b.numel() == 0:
        return 0.0
    a64, b64 = a.detach().double(), b.detach().double()
    num = (a64 - b64).abs().max().item()
    den = b64.abs().max().item()
    return num / den if den > 0 else num


def max_rel_diff(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The largest per-tensor relative difference between two trees.

    For each name: ``max|a - b| / max|b|`` (``b`` from ``expected``, the reference), the
    error relative to the tensor's own scale, as in ``tensor_rel_diff``; the result is the
    maximum over all names. Both trees must have the same names.
    """
    assert set(actual) == set(expected), f"names differ: {sorted(set(actual) ^ set(expected))}"
    return max((tensor_rel_diff(actual[n], expected[n]) for n in expected), default=0.0)


def assert_trees_close(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, rel: float) -> None:
    """Same names, dtypes and shapes, and ``max_rel_diff(actual, expected) <= rel``."""
    assert list(actual) == list(expected), f"keys differ: {list(actual)} != {list(expected)}"
    worst = (0.0, None)
    for name in expected:
        a, b = actual[name], expected[name]
        assert a.dtype == b.dtype, f"{name!r}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{name!r}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        d = tensor_rel_diff(a, b)
        assert not math.isnan(d), f"{name!r}: NaN in the comparison"
        worst = max(worst, (d, name), key=lambda x: x[0])
    assert worst[0] <= rel, f"max relative difference {worst[0]:.3e} in {worst[1]!r} > {rel:.1e}"


class CopyTargets(TorchDispatchMode):
    """While active, the ``(data_ptr, nbytes)`` of every tensor an aten copy writes into
    (``copy_``, ``_foreach_copy_``) or makes (``clone``)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in (torch.ops.aten.copy_, torch.ops.aten._foreach_copy_, torch.ops.aten.clone):
            dsts = out if packet is torch.ops.aten.clone else args[0]
            dsts = dsts if isinstance(dsts, (list, tuple)) else [dsts]
            self.written += [(t.data_ptr(), t.numel() * t.element_size()) for t in dsts]
        return out

    def into(self, buffers: Iterable[torch.Tensor]) -> int:
        """How many of the recorded copies wrote into any of ``buffers``' memory."""
        spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
        return sum(1 for ptr, size in self.written if any(ptr < hi and ptr + size > lo for lo, hi in spans))


class Snapshot:
    """Everything observable about a (nested) value's tensors and mappings, to check later
    that nothing changed: each tensor's ``_version``, a copy of its bytes, its shape and
    dtype, and the pytree structure (each mapping's keys in order, each node's type and
    static context, e.g. a ZeroState's layout and rank).

    Examples:
      >>> snap = Snapshot(params)
      >>> zf.shard_params(params, opt)
      >>> snap.assert_unchanged(params)
    """

    def __init__(self, tree: Any) -> None:
        self.structure = pytree.tree_structure(tree)
        self.leaves = [
            (t._version, t.detach().clone(), tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
            for t in pytree.tree_leaves(tree)
        ]

    def assert_unchanged(self, tree: Any, what: str = "input") -> None:
        assert pytree.tree_structure(tree) == self.structure, f"{what}: the mapping structure changed"
        leaves = pytree.tree_leaves(tree)
        assert len(leaves) == len(self.leaves), f"{what}: number of leaves changed"
        for i, (now, before) in enumerate(zip(leaves, self.leaves, strict=True)):
            if isinstance(now, torch.Tensor):
                version, copy, shape, dtype = before
                assert now._version == version, f"{what}: leaf {i} was written in place"
                assert tuple(now.shape) == shape and now.dtype == dtype, f"{what}: leaf {i} changed"
                assert torch.equal(bits(now), bits(copy)), f"{what}: leaf {i} values changed"
            else:
                assert now == before, f"{what}: leaf {i} changed from {before!r} to {now!r}"


# --------------------------------------------------------------------------- model and data


class Net(nn.Module):
    """A tiny MLP with the corners parity tests need.

    * ``a.weight`` has 91 = 7 * 13 elements and ``a.bias`` 13, ``b.weight`` 65 = 13 * 5:
      none divisible by 2, 3 or 4, so every world size pads.
    * ``gate`` is used only when ``use_gate`` is True (layer drop: no gradient in the
      other steps), ``unused`` never takes part in the forward (no gradient ever).
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN_FEATURES, 13)
        self.gate = nn.Linear(13, 13)
        self.b = nn.Linear(13, OUT_FEATURES)
        self.unused = nn.Linear(OUT_FEATURES, 3)

    def forward(self, x: torch.Tensor, use_gate: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_gate:
            h = h + torch.tanh(self.gate(h))
        return self.b(h)


def gate_used(step: int) -> bool:
    """Layer drop schedule shared by every rank: ``gate`` is skipped every third step."""
    return step % 3 != 2


def batches(rank: int, steps: int, batch: int = 8) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(x, y)`` batches for ``rank``; different ranks get different data."""
    gen = torch.Generator().manual_seed(seeded(1000 + rank))
    for _ in range(steps):
        yield (
            torch.randn(batch, IN_FEATURES, generator=gen),
            torch.randn(batch, OUT_FEATURES, generator=gen),
        )


class Wide(nn.Module):
    """Net's interface with two members above the one-pass copy threshold (2**16 elements).

    ``mid.weight`` has 257 * 256 = 65792 elements: no padding at N = 1, 2, 4, one padding
    element at N = 3; ``top.weight`` 65537 * 1 pads at every N > 1.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 256)
        self.mid = nn.Linear(256, 257)
        self.top = nn.Linear(257, 1, bias=False)
        self.extra = nn.Parameter(torch.randn(65537) * 0.01)
        self.b = nn.Linear(257, 5)

    def forward(self, x: torch.Tensor, use_gate: bool = True) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.a(x))))
        if use_gate:
            h = h + self.top(h) * self.extra[:257]
        return self.b(h)


# --------------------------------------------------------------------------- the exact wire
#
# At 1 and 2 ranks zerofn's fp32 mean gradient has DDP's bits: there is no sum at 1 rank,
# and a sum of two addends does not depend on the order (DDP divides by 2, zerofn
# multiplies by 0.5: both exact). At 3 and 4 ranks gloo adds an element's addends in an
# order that depends on the element's offset in the flat buffer, and DDP's buckets and
# zerofn's rank-major rows put it at different offsets, so fp32 sums differ in the last bit.
#
# A float64 wire on both sides makes the sum exact, so its order cannot matter: zerofn
# with ``comm_dtype=torch.float64`` against DDP through ``zerofn.testing.float64_wire_hook``
# (``ddp_reference(..., wire=torch.float64)``) is bitwise at every world size, and any
# difference is a logic error. Why the float64 sum is exact, and the one case (an addend
# below about 1e-8 of the largest) where it may not be: that hook's module docstring.


def exact_wire(n: int) -> torch.dtype | None:
    """The wire a bitwise parity test uses at ``n`` ranks: fp32 (``None``, the default users
    keep) up to 2 ranks, float64 from 3 on (see above)."""
    return None if n <= 2 else torch.float64


def _scale_to_wire(grad: torch.Tensor, world: int, wire: torch.dtype) -> torch.Tensor:
    """``grad`` scaled by 1/N as zerofn's ``pack_grads`` scales it (a 0-d factor in the
    gradient's compute dtype), then cast to the wire dtype."""
    factor = torch.tensor(1.0 / world, dtype=torch.promote_types(grad.dtype, torch.float32), device=grad.device)
    return (grad * factor).to(wire)


def mean_over_ranks(grad: torch.Tensor, group: Any = None, *, wire: torch.dtype | None = None) -> torch.Tensor:
    """The mean of ``grad`` over the group, as DDP's default hook computes it (``wire=None``:
    divide by N, all-reduce SUM in the gradient's dtype) or as ``float64_wire_hook`` does."""
    world = dist.get_world_size(group)
    if wire is None:
        g = grad / world
        dist.all_reduce(g, group=group)
        return g
    g = _scale_to_wire(grad, world, wire)
    dist.all_reduce(g, group=group)
    return g.to(grad.dtype)


#: fp32's unit roundoff: the largest relative error of one rounding.
FP32_U = 2.0**-24


def fp32_wire_sgd_bound(
    *, steps: int, world: int, lr: float, momentum: float, grad_max: float, param_max: float
) -> float:
    r"""The largest ``max_rel_diff`` an fp32 wire may leave between zerofn and DDP after
    ``steps`` steps of SGD, from error analysis (the same on every machine).

    Per step and element, each side's mean gradient is a sum of ``N`` addends ``g_i / N``,
    each rounded once when scaled: at most :math:`(N + 1) u \bar g` from the exact mean,
    with :math:`\bar g = \sum |g_i| / N \le G` (``grad_max``, the largest gradient
    element of the run). The two sides differ by at most twice that. Momentum keeps a
    difference for :math:`1 / (1 - \mu)` steps; the update moves it to the param times
    ``lr``, and the param's own rounding adds one ulp of ``param_max`` a side. Relative to
    ``param_max`` one step is

    .. math:: \delta = \frac{2 (N + 1) u\, \mathrm{lr}\, G}{(1 - \mu) P} + 2u,

    and ``steps`` steps at most :math:`2^{T}\,T\,\delta`: a param's difference enters
    the next gradients too, and with ``lr`` times the loss' curvature below 1 (true of the
    tests' models at their learning rates) it at most doubles a step. A logic error (a
    wrong mean, a stale or dropped param) moves params by ``lr * G`` a step, orders of
    magnitude above this for a few steps.
    """
    per_step = 2 * (world + 1) * FP32_U * lr * grad_max / ((1 - momentum) * param_max) + 2 * FP32_U
    return 2.0**steps * steps * per_step


# --------------------------------------------------------------------------- reference loops
#
# What every parity test compares against: the plain data-parallel training loop, written
# once. ``ddp_reference`` is DistributedDataParallel + torch.optim (the user's script
# zerofn replaces); ``functional_reference`` is the same loop with torch.func.grad and an
# all-reduce mean in place of DDP's hooks. Both take the same options and return the same
# dict, so a test can check one against the other.

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The parity tests' loss: ``((out - y) ** 2).mean()``."""
    return ((out - y) ** 2).mean()


def clip_in_float64(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip ``p.grad`` in place with zerofn's arithmetic and return the norm.

    The norm in float64 (per tensor, then over tensors) and the coefficient
    ``1 / max(1, (norm + 1e-6) / max_norm)`` in Python floats, as ``zf.step_shards`` does;
    ``torch.nn.utils.clip_grad_norm_`` rounds both in the grads' dtype (float32), so its
    coefficient can differ in the last bit.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    coef = 1.0 / max(1.0, (float(norm) + 1e-6) / max_norm)
    if coef != 1.0:
        for g in grads:
            g.mul_(coef)
    return float(norm)


def _result(module: nn.Module, losses: list, norms: list) -> dict[str, Any]:
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()}, "losses": losses, "norms": norms}


def _as_list(opts: Optimizers) -> list[torch.optim.Optimizer]:
    return [opts] if isinstance(opts, torch.optim.Optimizer) else list(opts)


def _forward(module: Callable[..., torch.Tensor], x: torch.Tensor, use_gate: Callable[[int], bool] | None, step: int):
    return module(x) if use_gate is None else module(x, use_gate(step))


def _finish_step(
    module: nn.Module,
    opts: list[torch.optim.Optimizer],
    scheds: list[Any],
    *,
    clip: float | None,
    clip_dtype: torch.dtype,
    grad_edit: Callable[[nn.Module], None] | None,
) -> float | None:
    """The part of a step after the gradients are in ``p.grad``: edit, clip, step, schedule."""
    if grad_edit is not None:
        grad_edit(module)
    norm = None
    if clip:
        if clip_dtype == torch.float64:
            norm = clip_in_float64(module.parameters(), clip)
        else:
            assert clip_dtype == torch.float32, clip_dtype
            norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip))
    for o in opts:
        o.step()
    for s in scheds:
        s.step()
    return norm


def ddp_reference(
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], Optimizers],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
    use_gate: Callable[[int], bool] | None = gate_used,
    accumulate: int = 1,
    clip: float | None = None,
    clip_dtype: torch.dtype = torch.float32,
    grad_edit: Callable[[nn.Module], None] | None = None,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    before_step: Callable[[nn.Module, int], None] | None = None,
    group: Any = None,
    bucket_cap_mb: float | None = None,
    wire: torch.dtype | None = None,
) -> dict[str, Any]:
    """Train a copy of ``model`` with DistributedDataParallel + torch.optim, the user's DDP script.

    Each step: ``before_step``; ``zero_grad(set_to_none=True)``; ``accumulate`` micro-batches taken in turn
    from ``batches``, the first ``accumulate - 1`` backward inside ``ddp.no_sync()`` (DDP's
    gradient accumulation: one all-reduce of the summed local gradients, divided by N);
    then ``grad_edit``, clipping, ``opt.step()`` and ``scheduler.step()``.

    Args:
      model: copied (``copy.deepcopy``) before wrapping, so the caller's model is untouched
        and can start the loop under test from the same values.
      make_optimizer: builds the torch optimizer (or a list of them, each stepped) over the
        copy's params; gets the unwrapped module, so param groups can be chosen by name.
      batches: ``(x, y)`` micro-batches; ``steps * accumulate`` of them are used.
      loss_fn: ``loss_fn(output, y)``, by default ``mse``.
      use_gate: the layer-drop schedule (``gate_used``): the forward is
        ``module(x, use_gate(step))``, so on the steps it says False DDP sees ``gate``
        unused (``find_unused_parameters=True``) and its grads stay None. ``None``: the
        forward is ``module(x)``.
      accumulate: micro-batches per step, all but the last under ``no_sync``.
      clip: max norm; ``None`` or 0 clips nothing.
      clip_dtype: ``torch.float32`` clips with ``torch.nn.utils.clip_grad_norm_``;
        ``torch.float64`` with zerofn's arithmetic (``clip_in_float64``).
      grad_edit: called with the module after the gradients are reduced, before clipping
        (e.g. to perturb their last bits).
      scheduler: builds an LR scheduler on each optimizer, stepped after every step.
      before_step: ``before_step(module, step)`` runs first in every step: the user
        writing params between steps (``load_state_dict``, ``copy_``, ``p.data``).
      group: DDP's ``process_group`` (default: the whole world).
      bucket_cap_mb: DDP's bucket size (default: DDP's own).
      wire: ``torch.float64``: DDP reduces through ``float64_wire_hook`` (exact at any
        world size; pair it with zerofn's ``comm_dtype=torch.float64``); ``None``: DDP's
        default all-reduce in the gradients' dtype.

    Returns:
      ``{"params": name -> final param (a clone), "losses": per step the loss of each
      micro-batch (floats), "norms": per step the pre-clip gradient norm (when clipping)}``.
    """
    kw: dict[str, Any] = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=group, find_unused_parameters=True, **kw
    )
    if wire is not None:
        assert wire == torch.float64, wire
        ddp.register_comm_hook(group, float64_wire_hook)
    opts = _as_list(make_optimizer(ddp.module))
    scheds = [scheduler(o) for o in opts] if scheduler is not None else []
    data = iter(batches)
    losses, norms = [], []
    for step in range(steps):
        if before_step is not None:
            before_step(ddp.module, step)
        for o in opts:
            o.zero_grad(set_to_none=True)
        step_losses = []
        for micro in range(accumulate):
            x, y = next(data)
            with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                loss = loss_fn(_forward(ddp, x, use_gate, step), y)
                loss.backward()
            step_losses.append(float(loss.detach()))
        losses.append(step_losses)
        norm = _finish_step(ddp.module, opts, scheds, clip=clip, clip_dtype=clip_dtype, grad_edit=grad_edit)
        if norm is not None:
            norms.append(norm)
    return _result(ddp.module, losses, norms)


def functional_reference(
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], Optimizers],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
    use_gate: Callable[[int], bool] | None = gate_used,
    accumulate: int = 1,
    clip: float | None = None,
    clip_dtype: torch.dtype = torch.float32,
    grad_edit: Callable[[nn.Module], None] | None = None,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    before_step: Callable[[nn.Module, int], None] | None = None,
    group: Any = None,
    no_grad: Callable[[int], Iterable[str]] = lambda step: (),
    wire: torch.dtype | None = None,
) -> dict[str, Any]:
    """``ddp_reference``'s loop with ``torch.func.grad`` and an all-reduce mean in place of DDP.

    Each micro-batch's gradient is ``torch.func.grad`` of ``loss_fn`` over
    ``functional_call(module, params, ...)``; the step's local sum is divided by the group
    size and all-reduced (SUM), as DDP pre-divides before its all-reduce; the mean goes to
    ``p.grad`` of a copy of ``model`` and the same clipping / torch optimizer / scheduler as
    in ``ddp_reference`` follow. Same arguments and return value as ``ddp_reference``, and:

    Args:
      no_grad: ``no_grad(step)`` names the params that get no gradient that step (their
        ``p.grad`` stays None, as DDP leaves an unused param's): ``torch.func.grad`` gives
        zeros for them and cannot tell.
      wire: as in ``ddp_reference`` (``mean_over_ranks``).
    """
    module = copy.deepcopy(model)
    opts = _as_list(make_optimizer(module))
    scheds = [scheduler(o) for o in opts] if scheduler is not None else []
    data = iter(batches)
    losses, norms = [], []

    def loss_of(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        call = functools.partial(torch.func.functional_call, module, params)
        return loss_fn(call((x,)) if use_gate is None else call((x, use_gate(step))), y)

    for step in range(steps):
        if before_step is not None:
            before_step(module, step)
        for o in opts:
            o.zero_grad(set_to_none=True)
        params = {n: p.detach() for n, p in module.named_parameters()}
        total: dict[str, torch.Tensor] = {}
        step_losses = []
        for _ in range(accumulate):
            x, y = next(data)
            grads, loss = torch.func.grad_and_value(loss_of)(params, x, y, step)
            total = {n: total[n] + g if n in total else g for n, g in grads.items()}
            step_losses.append(float(loss.detach()))
        losses.append(step_losses)
        skip = set(no_grad(step))
        for n, p in module.named_parameters():
            if n in skip:
                continue
            p.grad = mean_over_ranks(total[n], group, wire=wire)
        norm = _finish_step(module, opts, scheds, clip=clip, clip_dtype=clip_dtype, grad_edit=grad_edit)
        if norm is not None:
            norms.append(norm)
    return _result(module, losses, norms)


# --------------------------------------------------------------------------- whole-tensor recipes

# The optimizer recipes of tests/test_whole_*.py and their hyperparameters.
WHOLE_RECIPES = ("muon", "adafactor", "muon_adamw")
WHOLE_MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
WHOLE_ADAFACTOR = dict(lr=0.01, weight_decay=0.01)
WHOLE_ADAMW = dict(lr=1e-2, weight_decay=0.1)


class Mats(nn.Module):
    """Net without biases: every param a 2-D matrix, so Muon alone can train it all."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN_FEATURES, 13, bias=False)
        self.gate = nn.Linear(13, 13, bias=False)
        self.b = nn.Linear(13, OUT_FEATURES, bias=False)
        self.unused = nn.Linear(OUT_FEATURES, 3, bias=False)

    def forward(self, x: torch.Tensor, use_gate: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_gate:
            h = h + torch.tanh(self.gate(h))
        return self.b(h)


def whole_model(recipe: str) -> nn.Module:
    """The model a whole-tensor recipe trains (seeded): ``Mats`` for Muon alone, else ``Net``."""
    torch.manual_seed(seeded(0))
    return Mats() if recipe == "muon" else Net()


def is_matrix(name: str) -> bool:
    """The params Muon takes in the Muon + AdamW recipe (every ``weight``)."""
    return name.endswith("weight")


def whole_torch_optimizers(
    recipe: str, named: list[tuple[str, torch.Tensor]], adamw: Mapping[str, Any] = WHOLE_ADAMW
) -> list[torch.optim.Optimizer]:
    """The plain torch optimizers of ``recipe`` over ``named`` params (Muon + AdamW: two)."""
    if recipe == "muon":
        return [torch.optim.Muon([p for _, p in named], **WHOLE_MUON)]
    if recipe == "adafactor":
        return [torch.optim.Adafactor([p for _, p in named], **WHOLE_ADAFACTOR)]
    return [
        torch.optim.Muon([p for n, p in named if is_matrix(n)], **WHOLE_MUON),
        torch.optim.AdamW([p for n, p in named if not is_matrix(n)], **adamw),
    ]
