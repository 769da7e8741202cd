"""The leaf tensors ``value_and_reduced_grads`` differentiates at, kept with their hooks between calls.

The backward accumulates into leaves of zerofn's own (``p.detach().requires_grad_()``,
sharing the caller's storage), so the caller's tensors get no ``.grad`` and no hook. A
post-accumulate-grad hook on each leaf tells the call's reduction that a gradient has
arrived. Making a leaf and registering its hook costs a few microseconds, milliseconds a
call on a model of a thousand tensors, so a :class:`Leaves` keeps them while the caller
passes the same tensors: the usual loop, where ``gather_params(out=params)`` updates the
params in place, makes them once. The hooks stay registered and report to whichever call
is listening; between calls they report to nobody.

A kept leaf is reused only while it still is a view of the caller's tensor: the same
memory with the same strides (``p.data = other`` or ``p.set_(...)`` swaps a tensor's
memory in place; the next call then makes a new leaf).
Each entry holds the caller's tensor by a weak reference whose callback drops the entry,
so a kept leaf never keeps the memory of a param the caller has let go of.

:func:`reached` finds, after the forward, the leaves the backward will reach.

No collectives here.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["Leaves", "reached"]


class Leaves:
    """One transform's leaves, one per param name, and the listener their hooks report to.

    Not reentrant: a call of the transform from inside one of its own calls (its
    ``loss_fn`` or backward) is refused by :meth:`take`.
    """

    def __init__(self, where: str) -> None:
        self._where = where
        self._kept: dict[str, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._listener: Callable[[str], None] | None = None
        self._busy = False

    def take(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Leaves for ``params`` (same names, order, shapes, dtypes; requiring grad, no ``.grad``).

        Raises:
          RuntimeError: a call is already under way (a reentrant call of the transform).
        """
        if self._busy:
            raise RuntimeError(
                f"{self._where}: called again from inside one of its own calls (its loss_fn or backward); "
                "make a second transform for a nested use"
            )
        self._busy = True
        leaves = {}
        for name, p in params.items():
            kept = self._kept.get(name)
            leaf = kept[1] if kept is not None and kept[0]() is p and _same_view(kept[1], p) else self._make(name, p)
            leaf.grad = None  # a backward the caller ran between calls, through a leaf kept from one
            leaves[name] = leaf
        return leaves

    def listen(self, listener: Callable[[str], None] | None) -> None:
        """Report each gradient accumulated into a leaf, by name, to ``listener`` (``None``: to nobody)."""
        self._listener = listener

    def release(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """End the call that took ``leaves``: stop listening, drop any gradient left on them
        (one a failed call did not hand to its reduction)."""
        self._listener = None
        for leaf in leaves.values():
            leaf.grad = None
        self._busy = False

    def _make(self, name: str, p: torch.Tensor) -> torch.Tensor:
        leaf = p.detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(functools.partial(self._arrived, name))
        self._kept[name] = (weakref.ref(p, functools.partial(self._forget, name)), leaf)
        return leaf

    def _arrived(self, name: str, _leaf: torch.Tensor) -> None:
        if self._listener is not None:
            self._listener(name)

    def _forget(self, name: str, ref: weakref.ref[torch.Tensor]) -> None:
        kept = self._kept.get(name)
        if kept is not None and kept[0] is ref:  # not an entry made since for a newer tensor
            del self._kept[name]


def _same_view(leaf: torch.Tensor, p: torch.Tensor) -> bool:
    """``leaf`` still shows exactly ``p``'s memory (what ``p.detach()`` would give now).

    The caller checks ``p``'s shape and dtype against the layout first, as they were when
    ``leaf`` was made; what ``p.data = ...`` can change beyond them is the memory (a new
    address; no two live allocations, on any device, share one) and the strides.
    """
    return leaf.data_ptr() == p.data_ptr() and leaf.stride() == p.stride()


def reached(loss: torch.Tensor, leaves: Mapping[str, torch.Tensor]) -> set[str]:
    """Names of the ``leaves`` the backward from ``loss`` reaches (an ``AccumulateGrad`` node in its graph).

    The others will get no gradient: their buckets need not wait for them. One walk over
    the autograd graph after the forward (as DDP's ``find_unused_parameters``), stopped
    as soon as every leaf is found; no communication.
    """
    want = {id(leaf): name for name, leaf in leaves.items()}
    found: set[str] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack and len(found) < len(want):
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":  # a leaf: node.variable is the tensor it accumulates into
            name = want.get(id(node.variable))
            if name is not None:
                found.add(name)
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return found
