"""The gradients the facade holds between backward and ``step``, and what ``p.grad`` holds.

One :class:`HeldGrads` per :class:`~zerofn.facade._reducer.GradReducer`, shared with the
pieces that read and write it (the bucket settling of :mod:`~._settle`, the step's view of
:mod:`~._step_grads`): every field is a plain container keyed by param name, so which
piece changes what is visible at each call site. Nothing here communicates.

Vocabulary: a *local* gradient is unreduced (``p.grad`` after a ``no_sync`` backward, or
set by hand, or an accumulator); an *averaged* gradient is the mean over the group that
stage 1 leaves in ``p.grad``; a *shard* is this rank's slice of an averaged gradient
(stage 2 keeps only these; stage 1 keeps one aside where ``p.grad`` cannot hold the bits).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from zerofn.facade._sharded_grad import ShardedGrad
from zerofn.layout import ShardLayout
from zerofn.precision import PrecisionPolicy

__all__ = ["Averaged", "HeldGrads"]


class Averaged(NamedTuple):
    """Stage 1: the averaged gradient the reducer left in ``p.grad``.

    ``grad`` and ``version`` tell whether the user changed it since (then ``step`` cuts
    ``p.grad``, not the exact shard kept aside); ``dtype`` is the dtype the local gradient
    was reduced in (the accumulation dtype after ``no_sync`` micro-steps), the dtype of
    the shard ``step`` gets.
    """

    grad: torch.Tensor
    version: int
    dtype: torch.dtype


class HeldGrads:
    """Per-name bookkeeping of the gradients held now; see the module docstring for the words.

    Args:
      params: name -> the model's param (layout order).
      layout: the state's layout.
      precision: the state's policy (the accumulation dtype per param).

    Fields (all keyed by name): ``shards`` (stage 2: the reduced shards waiting for
    ``step``; stage 1: exact shards kept aside, each a 1-D tensor of the param's shard
    length in the dtype it was reduced in), ``accum`` (accumulators of local gradients in
    the accumulation dtype, param shape), ``averaged`` (stage 1: :class:`Averaged`),
    ``aside`` (stage 1: a mean gradient set aside while more accumulates), ``edited``
    (stage 1: changed by the user, no exact shard), ``used`` (``p.grad`` tensors a step
    applied, kept until zeroed, as DDP), ``placed`` / ``placeholders`` (stage 2: ``p.grad``
    holds the :class:`~._sharded_grad.ShardedGrad`), ``local`` (an unreduced gradient in
    ``p.grad`` or an accumulator), ``taken`` (what the last take consumed, for give-back),
    ``grad_bufs`` / ``grad_views`` (stage 2: the flat gradient buffer per flat group and
    the shards that are views of it).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], layout: ShardLayout, precision: PrecisionPolicy) -> None:
        self.params = params
        self.accum_dtype = {n: precision.grad_accum_dtype_for(layout[n].dtype) for n in params}
        self.accum_names = {n for n, d in self.accum_dtype.items() if d != layout[n].dtype}
        self.placeholders: dict[str, ShardedGrad] = {}  # one per param, reused every step
        self._reset()

    def clear(self) -> None:
        """Forget every gradient (``zero_grad``); placeholders still in ``p.grad`` are removed."""
        self.remove_placeholders()
        self._reset()

    def remove_placeholders(self) -> None:
        """Stage 2: take the placeholders this step placed out of ``p.grad`` (where still there)."""
        for name in self.placed:
            p = self.params[name]
            if p.grad is self.placeholders.get(name):
                p.grad = None
        self.placed = set()

    def _reset(self) -> None:
        self.shards: dict[str, torch.Tensor] = {}
        self.accum: dict[str, torch.Tensor] = {}
        self.accumulating = False  # a no_sync backward folded gradients since the last reduction
        self.averaged: dict[str, Averaged] = {}
        self.aside: dict[str, torch.Tensor] = {}
        self.edited: set[str] = set()
        self.used: dict[str, torch.Tensor] = {}
        self.check_carry = False  # a step left gradients that cannot carry exactly: the next backward checks
        self.placed: set[str] = set()
        self.local: set[str] = set()
        self.taken: tuple[Any, ...] | None = None
        self.grad_bufs: dict[int, torch.Tensor] = {}
        self.grad_views: dict[str, torch.Tensor] = {}

    def holds(self) -> bool:
        """Whether any gradient arrived since the last step or ``zero_grad`` (reduced or local)."""
        # placed: stage 2, alike on every rank (a rank whose whole params got no gradient holds no shard)
        return bool(self.shards or self.placed or self.averaged or self.aside or self.local or self.foreign())

    def foreign(self) -> list[str]:
        """Names whose ``p.grad`` holds a tensor the facade did not produce or consume (set by hand)."""
        local, averaged, used = self.local, self.averaged, self.used
        return [
            name
            for name, p in self.params.items()
            if (g := p.grad) is not None
            and type(g) is not ShardedGrad
            and name not in local
            and name not in averaged
            and used.get(name) is not g
        ]

    def merge(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Add ``shards`` to those held (a new tensor where both hold one: ``have + shard``)."""
        for name, shard in shards.items():
            have = self.shards.get(name)
            self.shards[name] = shard if have is None else have + shard

    def merge_under(self, earlier: Mapping[str, torch.Tensor]) -> None:
        """Put ``earlier`` shards back under whatever arrived since (summed where both hold one)."""
        later, self.shards = self.shards, dict(earlier)
        self.merge(later)

    def untouched(self, name: str) -> bool:
        """Stage 1: ``p.grad`` is still the averaged gradient the reducer left, unchanged since."""
        av = self.averaged.get(name)
        g = self.params[name].grad
        return av is not None and g is av.grad and g._version == av.version

    def drop_cleared(self) -> None:
        """Stage 2: a placeholder the user cleared or replaced (``p.grad = None``) drops its shard."""
        params, placeholders = self.params, self.placeholders
        for name in [n for n in self.placed if params[n].grad is not placeholders[n]]:
            self.placed.discard(name)
            self.shards.pop(name, None)

    def fold(self, name: str) -> None:
        """Move ``p.grad`` into the param's accumulator (accumulation dtype) and free it."""
        p = self.params[name]
        if p.grad is None:
            return
        acc = self.accum.get(name)
        if acc is None:
            self.accum[name] = p.grad.to(self.accum_dtype[name])
        else:
            acc.add_(p.grad)
        p.grad = None

    def take_locals(self, names: Iterable[str]) -> dict[str, torch.Tensor | None]:
        """The local gradient to reduce for each of ``names`` (accumulated, or ``p.grad``), in
        their order; each is freed here."""
        out: dict[str, torch.Tensor | None] = {}
        for n in names:
            if self.accumulating and n in self.accum_names:
                self.fold(n)
            acc = self.accum.pop(n, None) if self.accum else None
            if acc is None:
                p = self.params[n]
                acc, p.grad = p.grad, None
            out[n] = acc
        self.local.difference_update(out)
        return out

    def take_local(self, name: str) -> torch.Tensor | None:
        """The local gradient to reduce for ``name`` (:meth:`take_locals` of one name)."""
        return self.take_locals((name,))[name]

    def snapshot(self) -> tuple[Any, ...]:
        """What a take consumes (averaged, edited, shards, used, placed), as copies to restore."""
        return dict(self.averaged), set(self.edited), dict(self.shards), dict(self.used), set(self.placed)

    def nbytes(self) -> int:
        """Bytes of the accumulators, the shards and the gradients set aside."""
        total = sum(a.numel() * a.element_size() for a in self.accum.values())
        total += sum(s.numel() * s.element_size() for s in self.shards.values())
        return total + sum(a.numel() * a.element_size() for a in self.aside.values())
