"""Shared assertions and a small model/data builder for the zerofn test suite.

Everything here is importable on the worker ranks of a ``World`` too (the tests directory
is on ``sys.path`` of the spawned workers), so rank functions can snapshot their inputs
and check them after a stage function ran.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

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
    "gate_used",
    "max_rel_diff",
    "tensor_rel_diff",
]

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
    gen = torch.Generator().manual_seed(1000 + rank)
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
