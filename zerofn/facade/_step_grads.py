"""What ``step`` and the gradient idioms take from the reducer: the averaged gradients as shards.

:class:`StepGrads` is held by :class:`~zerofn.facade._reducer.GradReducer` (which keeps
the hook path: which bucket is ready, when it launches, what ``p.grad`` holds) and works
on the same :class:`~zerofn.facade._held.HeldGrads`. Here the gradients a backward left
are handed to ``step`` (stage 1: ``p.grad`` as the user left it, cut into this rank's
shards; stage 2: the shards), given back when the step applied nothing, measured and
scaled for clipping, and peeked at without being consumed. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from zerofn import flat
from zerofn.buckets import cut_shard
from zerofn.facade._held import HeldGrads
from zerofn.layout import ShardLayout
from zerofn.precision import mul_grads_

__all__ = ["StepGrads"]


class StepGrads:
    """``take_step_grads`` / ``give_back`` / ``peek_step_grads`` / ``norm_pieces`` / ``scale_grads_``.

    Args:
      held: the reducer's gradients (changed in place by these methods).
      layout: the state's layout; stage: 1 or 2; rank: this rank in the sharding group.
      loss_scale: returns the loss scale the held gradients carry (1.0 without scaling).

    Shards handed out are 1-D, this rank's slice of each param's averaged gradient, in the
    dtype it was reduced in, still multiplied by the loss scale (``step_shards`` unscales).
    """

    def __init__(
        self, held: HeldGrads, layout: ShardLayout, stage: int, rank: int, loss_scale: Callable[[], float]
    ) -> None:
        self._held, self._layout, self._stage, self._rank = held, layout, stage, rank
        self._params = held.params
        self._loss_scale = loss_scale
        self._flat = flat.flat_layout(layout, rank)

    def norm_pieces(self) -> tuple[dict[str, torch.Tensor], float]:
        """This rank's shards of the current averaged gradients and the loss scale they carry.

        Exactly what :meth:`take_step_grads` would hand to ``step`` now (stage 1: cut from
        ``p.grad`` as the user left it), so a norm of them is the norm the step measures.
        Call the reducer's ``settle`` first.
        """
        return self.peek_step_grads(), self._loss_scale()

    def scale_grads_(self, factor: float) -> None:
        """Multiply the current averaged gradients in place by ``factor`` (clipping).

        Stage 1: ``p.grad`` and the exact shards kept aside alike (an untouched ``p.grad``
        stays untouched); stage 2: the shards. Call the reducer's ``settle`` first.
        """
        h = self._held
        if self._stage == 2:
            mul_grads_(h.shards.values(), factor)
            return
        grads = [g for n in h.averaged if (g := self._params[n].grad) is not None]
        exact = [n for n in h.shards if h.untouched(n)]
        mul_grads_(grads + [h.shards[n] for n in exact], factor)
        for name in exact:
            av = h.averaged[name]
            h.averaged[name] = av._replace(version=av.grad._version)

    def take_step_grads(self) -> Mapping[str, torch.Tensor]:
        """:meth:`_take`, at stage 2 over the flat gradient buffers (see there)."""
        return self._take(flatten=True)

    def _take(self, flatten: bool, peek: bool = False) -> Mapping[str, torch.Tensor]:
        """The shards ``step`` applies, handed over; the reducer starts from none.

        Stage 1: each averaged ``p.grad`` as the user left it, cut into this rank's shard
        (in the dtype it was reduced in, times the loss scale again), or the exact shard
        kept aside when ``p.grad`` is untouched; ``p.grad = None`` leaves the param out, as
        torch.optim does. ``p.grad`` keeps its values after the step (as with DDP) until
        the next backward or ``zero_grad``. Stage 2: the shards; a placeholder the user
        cleared drops its shard. Call the reducer's ``settle`` first. :meth:`give_back` undoes it.

        Stage 2 hands over a :class:`~zerofn.flat.FlatDict` over the flat gradient buffers
        the buckets were written into (:meth:`_flat_shards`), which ``step`` applies
        without packing, and the reducer lets go of those buffers (``step`` may reuse them);
        with ``peek`` (:meth:`peek_step_grads`) the same FlatDict, the buffers kept and
        nothing zeroed (the ranges of names it does not hold are then unspecified).
        """
        h = self._held
        h.drop_cleared()
        h.taken = h.snapshot()
        if self._stage == 2:
            # Consumed: the placeholders left in p.grad are stale from here on (the next
            # backward or zero_grad clears them), and holds_grads() is False again, alike on
            # every rank.
            shards, h.shards, h.placed = h.shards, {}, set()
            h.check_carry = True
            return self._flat_shards(shards, peek) if flatten else shards
        scale = self._loss_scale()
        h.check_carry = scale != 1.0
        out: dict[str, torch.Tensor] = {}
        cut: list[torch.Tensor] = []
        for name, av in h.averaged.items():
            g = self._params[name].grad
            spec = self._layout[name]
            if g is None:
                continue
            h.used[name] = g
            if not spec.holds(self._rank):
                continue
            if name in h.shards and h.untouched(name):
                out[name] = h.shards[name]
                continue
            out[name] = cut_shard(g, spec, self._rank, dtype=av.dtype)
            cut.append(out[name])
        if scale != 1.0 and cut:
            mul_grads_(cut, scale)  # step_shards unscales what it gets
        h.averaged = {}
        h.edited = set()
        h.shards = {}
        return {n: out[n] for n in self._layout.names if n in out}

    def _flat_shards(self, shards: dict[str, torch.Tensor], peek: bool = False) -> Mapping[str, torch.Tensor]:
        """Stage 2: ``shards`` as a FlatDict over the gradient buffers, which the reducer lets go of.

        When every split shard held is still the view the reducer made of its buffer (a
        shard summed over two backwards, or set by a caller, is not): the ranges of names
        without a gradient are zeroed (one ``zero_`` per run of them; none when every param
        got one), whole params ride as loose tensors. Otherwise ``shards`` as they are
        (``step`` packs them).
        """
        h = self._held
        bufs, views = h.grad_bufs, h.grad_views
        if not peek:
            h.grad_bufs, h.grad_views = {}, {}
        fl = self._flat
        held = [0] * len(fl.groups)
        loose: dict[str, torch.Tensor] = {}
        for name, t in shards.items():
            g = fl.where.get(name, (None,))[0]
            if g is None:
                return shards
            if g < 0:
                loose[name] = t
            elif g in bufs and (views.get(name) is t or t.numel() == 0):  # (an empty param: any empty tensor)
                held[g] += 1
            else:
                return shards
        if not bufs:
            return shards
        for g, buf in bufs.items():
            group = fl.groups[g]
            if not peek and 0 < held[g] < len(group.names):
                without = tuple(n for n in group.names if n not in shards)
                for _, start, stop, _ in fl.runs(without):
                    if stop > start:
                        buf[start:stop].zero_()
        buffers = [bufs[g] if held[g] else None for g in range(len(fl.groups))]
        return flat.FlatDict.from_buffers(fl, buffers, loose, tuple(n for n in fl.names if n in shards))

    def give_back(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Undo the last :meth:`take_step_grads`: the step applied nothing (``shards`` unchanged).

        The gradients wait for the next ``step``, as if never taken (stage 1: ``p.grad``
        is again the current averaged gradient; stage 2: ``shards`` are held again).
        """
        h = self._held
        if h.taken is None:
            raise RuntimeError("GradReducer.give_back: nothing was taken")
        h.averaged, h.edited, held, h.used, h.placed = h.taken
        h.taken = None
        if self._stage == 2:
            held = dict(shards)
            owned = flat.buffer_views(shards)
            if owned is not None:  # flat: its buffers are the reducer's again, its views the shards
                h.grad_bufs, h.grad_views = owned
        h.merge_under(held)

    def peek_step_grads(self) -> dict[str, torch.Tensor]:
        """What :meth:`take_step_grads` would hand over now, without consuming anything (for inspection)."""
        h = self._held
        saved = h.snapshot()
        taken, bufs, views = h.taken, h.grad_bufs, h.grad_views
        try:
            # As step will get them (a FlatDict's names in layout order), so a norm of these
            # pieces sums in the order the step's does; nothing zeroed, the buffers kept.
            return dict(self._take(flatten=True, peek=True))
        finally:
            h.averaged, h.edited, h.shards, h.used, h.placed = saved
            h.taken, h.grad_bufs, h.grad_views = taken, bufs, views
