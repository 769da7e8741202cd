"""The facade's gradient reducer: when each bucket's reduction launches, into which buffer,
and what ``p.grad`` holds afterwards.

It owns no packing, scaling or cutting: every bucket goes through :mod:`zerofn.buckets`
(``pack_grads`` into a reused staging buffer, ``launch_reduce``, ``split_row`` /
``unpack_rows``, ``cut_shard``) or a compressed wire (:mod:`~zerofn.facade._wire`), the
pieces :func:`~zerofn.reduce_grads` loops over: both paths get identical bits.

Gradient flow per backward (hooks on every param):

* a post-accumulate-grad hook counts each bucket's members as their gradients land; a
  full bucket is packed into an ``(N, S)`` staging buffer (reused between buckets and
  steps) and its reduction launched (asynchronously with ``overlap``). When autograd
  finishes, an engine callback launches the buckets with absent members (layer drop)
  and the gradients left over from earlier ``no_sync`` micro-steps, and waits for all.
* **stage 1** reduces with an all-reduce, so every rank receives the whole bucket: it is
  unpacked into full averaged gradients in ``p.grad``, as DDP leaves them (memory: full
  gradients, as DDP). ``step`` uses what the user left there (clipped, edited, replaced
  or set to ``None``), cut into this rank's shards.
* **stage 2** keeps this rank's row only (the shards); each reduced param's ``p.grad``
  holds a :class:`ShardedGrad`, a zero-memory placeholder on which every torch function
  (``clip_grad_norm_``, ``clip_grad_value_``, ``GradScaler.unscale_``, ``p.grad.norm()``)
  raises :class:`ShardedGradError` naming the facade's way, instead of silently seeing
  no gradient.
* **accumulation**: inside ``no_sync()`` nothing is communicated. When the accumulation
  dtype differs from the working dtype (float32 under fp16/bf16 by default), a hook moves
  each fresh ``p.grad`` into a float32 accumulator, and the closing backward reduces the
  accumulators.

What ``p.grad`` holds is decided before autograd accumulates into it, by a pre-hook on
each param's ``AccumulateGrad`` node (it runs only when a gradient is about to be
accumulated into ``p.grad``, never for ``torch.autograd.grad``): a stale placeholder is
cleared; an averaged gradient of the current step is set aside and added to the next
reduction's result (two backwards before one step sum their mean gradients, as at stage 2).

Gradients not zeroed after a step, as DDP keeps them: at stage 1 the step leaves its
averaged gradient in ``p.grad``, and a backward without ``zero_grad`` in between
accumulates into it and reduces the sum, as DDP does (bitwise at N = 1, 2; a param that
gets nothing in that backward steps again with it, as torch.optim does). Where that
cannot be exact (stage 2, whose step consumed its shards; stage 1 under loss scaling,
whose ``p.grad`` is unscaled), the first gradient of that backward raises on every rank,
before anything is accumulated or sent, saying to call ``zero_grad()``
(:data:`CARRY_MESSAGE`). ``opt.zero_grad()``, ``model.zero_grad()`` and
``zero_grad(set_to_none=False)`` all count as zeroing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from zerofn import _agreement as agreement
from zerofn import _comm as comm
from zerofn._comm import CommPolicy, Group
from zerofn._offsets import plan_buckets
from zerofn.buckets import launch_gather, launch_reduce, pack_grads, unpack_rows, wire_dtype
from zerofn.facade._held import Averaged, HeldGrads
from zerofn.facade._settle import Launched, Settler
from zerofn.facade._sharded_grad import ShardedGrad, ShardedGradError, sharded_grad
from zerofn.facade._step_grads import StepGrads
from zerofn.facade._wire import FacadeWire
from zerofn.layout import ShardLayout
from zerofn.precision import PrecisionPolicy, mul_grads_
from zerofn.stages._pipeline import MAX_IN_FLIGHT, InFlight, pipeline_pool
from zerofn.stages._reduce_grads import reduce_realisation, sum_over_replicas

__all__ = ["GradReducer", "ShardedGrad", "ShardedGradError"]

CARRY_MESSAGE = (
    "ZeroOptimizer: backward after step() without zero_grad(): the gradients of the last step are still in "
    "p.grad of {names}. DDP would add this backward's gradients to them and step with the sum; {how}, so this "
    "backward was stopped before any gradient was accumulated or sent (on every rank). Call optimizer.zero_grad() "
    "(or model.zero_grad()) after each step(), then run the forward and backward again; to accumulate gradients "
    "over several backwards, run them all before one step() (with optimizer.no_sync() for all but the last)."
)
CARRY_HOW = {
    1: "under loss scaling p.grad holds unscaled gradients and this backward's are scaled",
    2: "at ZeRO stage 2 (partition_grad=True) the step consumed its gradient shards (p.grad holds a placeholder)",
}


def _names(names: list[str], limit: int = 3) -> str:
    return ", ".join(repr(n) for n in names[:limit]) + (f" ({len(names)} params)" if len(names) > limit else "")


class GradReducer:
    """Full local gradients in; averaged gradients in ``p.grad`` (stage 1) or shards (stage 2) out.

    Args:
      params: name -> the model's param (layout order).
      layout: the state's layout.
      precision: the state's precision policy (wire and accumulation dtypes).
      group: the sharding group; replicate: the replicas' group of a hybrid layout or None.
      stage: 1 or 2 (the reduce realisation); bucket_numel: elements per bucket.
      overlap: launch reductions asynchronously from the hooks.
      comm_policy: collective realisations.
      loss_scale: returns the loss scale the next reduced gradients carry (the state's;
        1.0 without loss scaling). Stage 1 divides ``p.grad`` by it, so users see true
        gradients, as after ``GradScaler.unscale_``.
      residual: returns the state's residual (``state.residual``), read by a compressed
        wire (``precision.wire``, :mod:`~zerofn.facade._wire`) at its first bucket after a step.

    It holds its collaborators: the gradients (:class:`~._held.HeldGrads`, ``held``), the
    bucket settling (:class:`~._settle.Settler`) and the step's view of the gradients
    (:class:`~._step_grads.StepGrads`, ``step_grads``: what the step takes, gives back,
    measures and clips, read after :meth:`settle`), which all work on ``held``.

    Collectives: per bucket one reduction (see :func:`zerofn.buckets.launch_reduce`), one
    tiny rank-agreement all-gather per backward (and per :meth:`settle` that finds local
    gradients), and with replicas one all-reduce per bucket over the replicate group at the
    end of backward.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        layout: ShardLayout,
        precision: PrecisionPolicy,
        *,
        group: Group,
        replicate: Group,
        stage: int,
        bucket_numel: int,
        overlap: bool,
        comm_policy: CommPolicy,
        loss_scale: Callable[[], float] = lambda: 1.0,
        residual: Callable[[], tuple[torch.Tensor, ...]] = tuple,
    ) -> None:
        self._params = params
        self._layout = layout
        self._precision = precision
        self._group, self._replicate = group, replicate
        self._rank = comm.group_rank(group)
        self._replicas = comm.group_size(replicate) if replicate is not None else 1
        self._stage, self._overlap = stage, overlap
        self._loss_scale = loss_scale
        self._how = reduce_realisation(stage, group, comm_policy)
        self._buckets = plan_buckets(layout, bucket_numel)
        self._bucket_of = {name: i for i, b in enumerate(self._buckets) for name in b.names}
        self._position = {name: i for i, name in enumerate(layout.names)}  # layout order, for sorting
        self.require_sync = True  # False inside no_sync()
        self.held = HeldGrads(params, layout, precision)
        w = precision.wire
        self.wire = FacadeWire(layout, w, group, residual) if w is not None else None  # its buckets' all-to-alls
        # Hook-path bookkeeping for the backward pass in progress.
        self._ready: list[set[str]] = [set() for _ in self._buckets]
        self._sent: list[set[str]] = [set() for _ in self._buckets]
        self._ready_empty: set[str] = set()
        # Without overlap one bucket's buffers: every reduction (and the facade's gathers,
        # which borrow this pool) is settled as it is launched.
        self.staging = pipeline_pool(MAX_IN_FLIGHT if overlap else 0, min_numel=bucket_numel)
        self._settler = Settler(self.held, layout, stage, self._rank, self.staging, loss_scale)
        self.step_grads = StepGrads(self.held, layout, stage, self._rank, loss_scale)
        self._inflight: InFlight[Launched] = InFlight(self._harvest, self.staging)
        self._replica_rows: list[Launched] = []
        self._callback_queued = False
        self._hooks: list[Any] = []
        self._accumulators: list[Any] = []  # the AccumulateGrad nodes: they must live for their hooks
        me = weakref.ref(self)  # hooks live on the model's params; they must not keep us alive
        with torch.enable_grad():
            for name, p in params.items():
                if not p.requires_grad:  # never gets a gradient
                    continue
                self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(me, name)))
                node = p.view_as(p).grad_fn.next_functions[0][0]
                self._accumulators.append(node)
                self._hooks.append(node.register_prehook(_pre_hook(me, name)))

    # ------------------------------------------------------------------ state

    @property
    def shards(self) -> Mapping[str, torch.Tensor]:
        """The shards held now (name -> 1-D shard), read-only: see :class:`~._held.HeldGrads`."""
        return MappingProxyType(self.held.shards)

    @property
    def accum(self) -> Mapping[str, torch.Tensor]:
        """The local-gradient accumulators (name -> param-shaped tensor in the accumulation dtype)."""
        return MappingProxyType(self.held.accum)

    def clear(self) -> None:
        """Forget every gradient (``zero_grad``): accumulators, shards, averaged and used marks.

        The caller has cleared or zeroed ``p.grad``; placeholders are dropped here.
        """
        self.held.clear()
        self._settler.clear()
        if self.wire is not None:  # the reduced gradients are gone: the state's residual stands
            self.wire.forget()

    def drop_shards(self) -> None:
        """Forget the shards held (a loaded state replaced the one they were reduced for)."""
        self.held.shards = {}
        if self.wire is not None:
            self.wire.forget()

    def holds_grads(self) -> bool:
        """Whether any gradient arrived since the last step or ``zero_grad`` (reduced or local)."""
        return self.held.holds()

    def settle(self) -> None:
        """Reduce local gradients still waiting (after ``no_sync`` micro-steps, or set by hand).

        Collectives: when this rank holds such gradients, the rank-agreement all-gather and
        the buckets' reductions (every rank must be in the same situation, as after the
        same backward calls).
        """
        self.held.drop_cleared()
        if self.held.local or self.held.foreign():
            self._flush()

    def full_grad(self, name: str, how: str) -> torch.Tensor | None:
        """The full averaged gradient of ``name``, unscaled (param shape), or None.

        Stage 1: ``p.grad``'s values (a copy), no communication. Stage 2: the shards
        gathered (``how``) on every rank of the group, divided by the loss scale; in the
        shard's dtype for a split param, and in float32 (float64 for float64 params) for a
        whole param, which only its owner holds (the other ranks send zeros in its place).
        """
        if self._stage == 1:
            g = self._params[name].grad if name in self.held.averaged else None
            return None if g is None else g.detach().clone()
        if name not in self.held.placed:  # no gradient since the last step (alike on every rank)
            return None
        spec = self._layout[name]
        shard = self.held.shards.get(name)
        if spec.is_whole:  # in the same dtype on every rank; zeros where it is not owned
            wide = torch.promote_types(spec.dtype, torch.float32)
            row = torch.zeros(spec.numel, dtype=wide, device=self._params[name].device)
            if shard is not None:
                row.copy_(shard.reshape(-1))
        else:
            assert shard is not None  # split: every rank holds its shard of a placed param
            row = shard.contiguous()
        alone = plan_buckets(self._layout, max(1, spec.padded_numel), (name,))  # a bucket of its own
        if not alone:  # an empty param is in no bucket: nothing to gather
            return torch.zeros(spec.shape, dtype=row.dtype, device=row.device)
        rows = launch_gather(row, self._group, how).wait()
        full = unpack_rows(rows, self._layout, alone[0])[name]
        scale = self._loss_scale()
        if scale != 1.0:
            mul_grads_([full], 1.0 / scale)
        return full

    def grad_bytes(self) -> int:
        """Bytes held for gradients beyond ``p.grad``: accumulators, buckets in flight, shards, set aside."""
        total = self.held.nbytes() + self._settler.nbytes()
        n = self._layout.world_size
        total += sum(f.bucket.shard_numel * n * f.buf.element_size() for f in self._inflight if f.buf is not None)
        return total + sum(f.rows.numel() * f.rows.element_size() for f in self._replica_rows if f.rows is not None)

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers held now: idle, or the rows of a bucket in flight.

        Not counted: the rows an all-to-all reduce receives into, borrowed from the same
        pool only while their bucket is in flight (idle again once it settles).
        """
        held = [f.buf for f in (*self._inflight, *self._replica_rows) if f.buf is not None]
        return self.staging.nbytes() + sum(b.numel() * b.element_size() for b in held)

    def close(self) -> None:
        """Remove the hooks, the placeholders from ``p.grad`` and the idle staging buffers."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._accumulators = []
        self.held.remove_placeholders()
        self.staging.clear()

    # ------------------------------------------------------------------ hook path

    def _refuse_carry(self) -> None:
        """The first gradient of a backward after a step that left gradients which cannot carry exactly.

        DDP adds a backward's gradients to what ``p.grad`` holds; at stage 1 (no loss
        scaling) the facade does too (the step's averaged ``p.grad`` is kept and autograd
        accumulates into it). At stage 2 the step's shards were consumed (``p.grad`` holds a
        placeholder) and under loss scaling ``p.grad`` is unscaled while the new gradients
        are scaled: if such a ``p.grad`` is still there (no ``zero_grad`` since the step),
        raise before anything of this backward is accumulated or sent, alike on every rank
        running the same script. Cost: one look at each ``p.grad``, once per backward, and
        only after a step at stage 2 or under loss scaling.
        """
        self.held.check_carry = False
        stale = [
            n
            for n, p in self._params.items()
            if (type(p.grad) is ShardedGrad and n not in self.held.placed)
            or (p.grad is not None and self.held.used.get(n) is p.grad)
        ]
        if stale:
            self.held.check_carry = True  # still there at the next try
            raise RuntimeError(CARRY_MESSAGE.format(how=CARRY_HOW[self._stage], names=_names(stale)))

    def before_accumulate(self, name: str) -> None:
        """Autograd is about to accumulate a gradient into ``p.grad``: make ``p.grad`` ready for it."""
        if self.held.check_carry:
            self._refuse_carry()
        p = self._params[name]
        g = p.grad
        if type(g) is ShardedGrad and name not in self.held.placed:  # a stale placeholder: holds nothing
            p.grad = None
            return
        if name in self.held.placed:  # stage 2
            self.held.placed.discard(name)
            if g is self.held.placeholders[name]:
                p.grad = None  # the shard stays: the new gradient's is added to it
            else:
                self.held.shards.pop(name, None)  # the user cleared or replaced it: start from that
            return
        if g is None:
            if self.held.averaged.pop(name, None) is not None:  # cleared by the user: start from zero
                self.held.shards.pop(name, None)
            return
        if self.held.used.get(name) is g:  # the step's averaged gradient, not zeroed: accumulate into it, as DDP
            del self.held.used[name]
            return
        if name in self.held.averaged:  # stage 1, a second backward before step: sum the means
            if not self.held.untouched(name):
                self.held.shards.pop(name, None)
                self.held.edited.add(name)
            del self.held.averaged[name]
            self.held.aside[name] = g
            p.grad = None

    def on_grad_ready(self, name: str) -> None:
        """A param's gradient was accumulated into ``p.grad`` by autograd."""
        self.held.local.add(name)
        if name in self.held.accum_names and (not self.require_sync or self.held.accumulating):
            self.held.fold(name)
            self.held.accumulating = True
        if not self.require_sync:
            return
        if not self._callback_queued:
            # Runs once autograd has finished this backward pass, whoever called it.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        b = self._bucket_of.get(name)
        if b is None:  # an empty param: nothing to send
            self._ready_empty.add(name)
            return
        self._ready[b].add(name)
        if len(self._ready[b]) == len(self._buckets[b].names):
            self._launch(b)

    def _launch(self, b: int) -> None:
        """Pack bucket ``b``'s ready, unsent members into a staging buffer and launch its reduction."""
        bucket = self._buckets[b]
        present = self._ready[b] - self._sent[b]
        self._sent[b] |= present
        fresh = present & self.held.local  # autograd's own gradients (not tensors the user set)
        grads = self.held.take_locals(n for n in bucket.names if n in present)
        first = next(g for g in grads.values() if g is not None)
        n, s = self._layout.world_size, bucket.shard_numel
        buf = self.staging.take(n * s, first.dtype, first.device)
        rows = pack_grads(grads, self._layout, bucket, replicas=self._replicas, out=buf[: n * s].view(n, s))
        whole = self._stage == 1  # every rank receives the whole sum: the full averaged gradients
        # Stage 1: the packed local gradients' storage receives the averaged ones (no new memory).
        outs = {}
        if whole:
            for name, g in grads.items():
                if name in fresh and g is not None and g.dtype == self._layout[name].dtype and g.is_contiguous():
                    outs[name] = g
        launched = Launched(bucket, present, first.dtype, buf, outs)
        if self._stage == 2:
            self._settler.place(launched, first.device)  # where its row will be kept: decided once, here
        if self.wire is not None:  # stage 2 only, always asynchronous: ``rows`` are read until the bucket settles
            pending, wire_buf = self.wire.launch(b, bucket, rows), None
        else:
            wire = wire_dtype(self._layout, bucket, self._precision.comm_dtype)
            wire_buf = self.staging.take(n * s, wire, first.device) if wire != first.dtype else None
            out = wire_buf[: n * s].view(n, s) if wire_buf is not None else None
            # Stage 2: summed straight into the shards' buffer (hybrid: the row waits apart for the replicas' sum).
            shards = launched.shards if self._replicate is None else None
            into = shards.target(bucket, wire) if shards is not None else None
            pending = launch_reduce(
                rows, self._layout, bucket, self._group, self._how, comm_dtype=self._precision.comm_dtype,
                wire_out=out, async_op=self._overlap, whole=whole, staging=self.staging, out=into,
            )  # fmt: skip
        if wire_buf is not None:
            self.staging.give(buf)  # stream-ordered before any later writer on this device
            launched.buf = wire_buf
        # Each bucket in flight holds an (N, S) buffer; settling finished ones early is what
        # keeps a rank's gradient memory at its shards plus a few buckets (stage 2).
        self._inflight.push(launched, pending)
        self._inflight.settle_finished()

    def _harvest(self, f: Launched, pending: comm.Pending) -> None:
        """Turn one reduced bucket into gradients (hybrid: keep what the replicas' sum needs)."""
        row = pending.wait()
        if self._replicate is not None:
            # Hybrid: the replicas' sum waits for the end of backward. Harvesting happens
            # at timing-dependent moments; a blocking all-reduce over the replicate group
            # here could interleave with another rank's shard-group collective and
            # deadlock. Keep just what this rank needs until then: its row (stage 2,
            # 1/N of the bucket), or the whole sum (stage 1, in its staging buffer).
            if self._stage == 2:
                kept = row.clone() if row._base is not None else row
                if f.buf is not None:
                    self.staging.give_unless_aliased(f.buf, [kept])
                f.buf = None
                row = kept
            f.rows = row
            self._replica_rows.append(f)
            return
        self._settler.settle(f, row)

    def _sum_replica_rows(self) -> None:
        """Hybrid only: add the replicas' sums, in bucket launch order (the same on every rank)."""
        for f in self._replica_rows:
            assert f.rows is not None  # set by _harvest
            self._settler.settle(f, sum_over_replicas(f.rows, self._replicate))
        self._replica_rows = []

    def _finish_backward(self) -> None:
        """End of a backward pass: reduce what is left (layer drop, earlier micro-steps), wait."""
        self._callback_queued = False
        self._flush()

    def _flush(self) -> None:
        """Launch every unsent gradient (partial buckets, leftovers), wait, settle; reset the bookkeeping.

        Leftovers: local gradients that got nothing in this backward (accumulated in earlier
        ``no_sync`` micro-steps, or set by hand) travel with it, as DDP reduces them, so
        after backward every gradient is averaged.
        """
        ready = set().union(*self._ready) | self._ready_empty
        leftovers = (self.held.local | set(self.held.foreign())) - ready
        for name in leftovers:
            b = self._bucket_of.get(name)
            if b is None:
                self._ready_empty.add(name)
            else:
                self._ready[b].add(name)
        present = sorted(ready | leftovers, key=self._position.__getitem__)
        # Every rank must have produced gradients for the same params before the last
        # buckets go out; one tiny all-gather (see agreement.check_ranks_agree).
        device = next(iter(self._params.values())).device
        agreement.check_ranks_agree(self._layout, self._group, "ZeroOptimizer.backward", present=present, device=device)
        for b in range(len(self._buckets)):
            if self._ready[b] - self._sent[b]:
                self._launch(b)
        self._inflight.settle()
        self._sum_replica_rows()
        self._settler.finish()  # stage 2: this reduction's flat buffers become the shards
        for name in self._ready_empty:  # empty params travel in no bucket
            g = self.held.take_local(name)
            if g is None:
                continue
            if self._stage == 2:
                self.held.merge({name: g.new_empty(0)})
            else:
                self._settler.set_averaged(name, g, g.dtype)
        if self._stage == 2:
            for name in present:
                p = self._params[name]
                if p.grad is None:
                    if name not in self.held.placeholders:
                        self.held.placeholders[name] = sharded_grad(p)
                    p.grad = self.held.placeholders[name]
                    self.held.placed.add(name)
        # The step's gradient, not zeroed and not added to: DDP applies it again.
        for name, used in self.held.used.items():
            if self._params[name].grad is used:
                self.held.averaged[name] = Averaged(used, used._version, used.dtype)
        self.held.used = {}
        self.held.accumulating = bool(self.held.accum)
        self._ready = [set() for _ in self._buckets]
        self._sent = [set() for _ in self._buckets]
        self._ready_empty = set()


def _grad_hook(me: weakref.ref[GradReducer], name: str) -> Any:
    def hook(param: torch.Tensor) -> None:
        reducer = me()
        if reducer is not None:
            reducer.on_grad_ready(name)

    return hook


def _pre_hook(me: weakref.ref[GradReducer], name: str) -> Any:
    def hook(grad_outputs: Any) -> None:
        reducer = me()
        if reducer is not None:
            reducer.before_accumulate(name)

    return hook
