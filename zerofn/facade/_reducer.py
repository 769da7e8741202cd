"""The facade's gradient reducer: when each bucket's reduction launches, into which buffer,
and what ``p.grad`` holds afterwards.

It owns no packing, scaling or cutting: every bucket goes through
:mod:`zerofn.buckets` (``pack_grads`` into a reused staging buffer, ``launch_reduce``,
``split_row`` / ``unpack_rows``, ``cut_shard``), the same pieces
:func:`~zerofn.reduce_grads` loops over, so both paths send identical buffers and get
identical bits.

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
from typing import Any, NamedTuple

import torch

from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn import flat
from zerofn._comm import CommPolicy, Group
from zerofn.buckets import (
    StagingPool,
    launch_gather,
    launch_reduce,
    pack_grads,
    split_row,
    unpack_rows,
    wire_dtype,
)
from zerofn.facade._sharded_grad import ShardedGrad, ShardedGradError, sharded_grad
from zerofn.facade._step_grads import StepGrads
from zerofn.layout import Bucket, ShardLayout
from zerofn.precision import PrecisionPolicy, mul_grads_
from zerofn.stages._pipeline import MAX_IN_FLIGHT, InFlight
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


class _InFlight:
    """One bucket whose reduction is launched: its handle, who was present, the buffer it reads.

    ``outs``: stage 1, the local gradients just packed, reused as the full averaged
    gradients' storage (name -> tensor of the param's shape and working dtype). ``buf``
    is the staging buffer to give back once settled (None: not a staging buffer).
    """

    __slots__ = ("bucket", "buf", "dtype", "outs", "present", "rows")

    def __init__(
        self,
        bucket: Bucket,
        present: set[str],
        dtype: torch.dtype,
        buf: torch.Tensor,
        outs: dict[str, torch.Tensor],
    ) -> None:
        self.bucket, self.present, self.dtype = bucket, present, dtype
        self.buf: torch.Tensor | None = buf
        self.outs = outs
        self.rows: torch.Tensor | None = None  # hybrid: what waits for the replicas' sum


class _Averaged(NamedTuple):
    """Stage 1: the averaged gradient the reducer left in ``p.grad``.

    ``grad`` and ``version`` tell whether the user changed it since (then ``step`` cuts
    ``p.grad``, not the exact shard kept aside); ``dtype`` is the dtype the local gradient
    was reduced in (the accumulation dtype after ``no_sync`` micro-steps), the dtype of
    the shard ``step`` gets.
    """

    grad: torch.Tensor
    version: int
    dtype: torch.dtype


class GradReducer(StepGrads):
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
    ) -> None:
        self._params = params
        self._layout = layout
        self._precision = precision
        self._group, self._replicate = group, replicate
        self._rank = comm.group_rank(group)
        self._replicas = comm.group_size(replicate) if replicate is not None else 1
        self._stage, self._bucket_numel, self._overlap = stage, bucket_numel, overlap
        self._comm_policy = comm_policy
        self._loss_scale = loss_scale
        self._how = reduce_realisation(stage, group, comm_policy)
        self._buckets = layout.buckets(bucket_numel)
        self._bucket_of = {name: i for i, b in enumerate(self._buckets) for name in b.names}
        self._position = {name: i for i, name in enumerate(layout.names)}  # layout order, for sorting
        self.require_sync = True  # False inside no_sync()
        # Stage 2: the reduced shards, waiting for step(). Stage 1: the exact shards of the
        # averaged gradients where p.grad cannot hold them bit for bit (loss-scaled, or a
        # wire dtype finer than the working one); used while p.grad is untouched.
        self.shards: dict[str, torch.Tensor] = {}
        # Stage 2: where the shards of split buckets are written (one buffer per group of this
        # rank's flat layout, allocated at a step's first bucket) and the views handed out of
        # them; ``take_step_grads`` hands the buffers to ``step`` as a FlatDict when every
        # split shard held is still such a view (see :meth:`_settle_flat`).
        self._flat = flat.flat_layout(layout, self._rank)
        self._grad_bufs: dict[int, torch.Tensor] = {}
        self._grad_views: dict[str, torch.Tensor] = {}
        self._averaged: dict[str, _Averaged] = {}  # stage 1: p.grad holds this step's mean gradient
        self._aside: dict[str, torch.Tensor] = {}  # stage 1: a mean gradient set aside while more accumulates
        self._edited: set[str] = set()  # stage 1: its mean gradient was changed by the user; no exact shard
        self._used: dict[str, torch.Tensor] = {}  # p.grad tensors a step applied (kept, as DDP, until zeroed)
        self._check_carry = False  # a step left gradients that cannot carry exactly: the next backward checks
        self._placed: set[str] = set()  # stage 2: p.grad holds the placeholder
        self._placeholders: dict[str, ShardedGrad] = {}
        self._local: set[str] = set()  # local, unreduced gradient in p.grad or an accumulator
        self._taken: tuple[Any, ...] | None = None  # what the last take_step_grads consumed (give_back)
        # Hook-path bookkeeping for the backward pass in progress.
        self._ready: list[set[str]] = [set() for _ in self._buckets]
        self._sent: list[set[str]] = [set() for _ in self._buckets]
        self._ready_empty: set[str] = set()
        # One staging buffer without overlap: every reduction (and the facade's gathers, which
        # borrow this pool) is settled as it is launched.
        self.staging = StagingPool(keep=MAX_IN_FLIGHT + 1 if overlap else 1, min_numel=bucket_numel)
        self._inflight: InFlight[_InFlight] = InFlight(self._harvest, self.staging)
        self._replica_rows: list[_InFlight] = []
        self._callback_queued = False
        # Accumulation in another dtype than the working one (float32 under fp16/bf16):
        # micro-step gradients are moved out of p.grad into these by the hooks.
        self._accum_dtype = {n: precision.grad_accum_dtype_for(layout[n].dtype) for n in params}
        self._accum_names = {n for n, d in self._accum_dtype.items() if d != layout[n].dtype}
        self.accum: dict[str, torch.Tensor] = {}
        self._accumulating = False  # a no_sync backward folded gradients since the last reduction
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

    def clear(self) -> None:
        """Forget every gradient (``zero_grad``): accumulators, shards, averaged and used marks.

        The caller has cleared or zeroed ``p.grad``; placeholders are dropped here.
        """
        for name in self._placed:
            p = self._params[name]
            if p.grad is self._placeholders.get(name):
                p.grad = None
        self.accum = {}
        self._accumulating = False
        self.shards = {}
        self._grad_bufs, self._grad_views = {}, {}
        self._averaged = {}
        self._aside = {}
        self._edited = set()
        self._used = {}
        self._check_carry = False
        self._placed = set()
        self._local = set()
        self._taken = None

    def holds_grads(self) -> bool:
        """Whether any gradient arrived since the last step or ``zero_grad`` (reduced or local)."""
        # _placed: stage 2, alike on every rank (a rank whose whole params got no gradient holds no shard)
        return bool(self.shards or self._placed or self._averaged or self._aside or self._local or self._foreign())

    def full_grad(self, name: str, how: str) -> torch.Tensor | None:
        """The full averaged gradient of ``name``, unscaled (param shape), or None.

        Stage 1: ``p.grad``'s values (a copy), no communication. Stage 2: the shards
        gathered (``how``) on every rank of the group, divided by the loss scale; in the
        shard's dtype for a split param, and in float32 (float64 for float64 params) for a
        whole param, which only its owner holds (the other ranks send zeros in its place).
        """
        if self._stage == 1:
            g = self._params[name].grad if name in self._averaged else None
            return None if g is None else g.detach().clone()
        if name not in self._placed:  # no gradient since the last step (alike on every rank)
            return None
        spec = self._layout[name]
        shard = self.shards.get(name)
        if spec.is_whole:
            wide = torch.promote_types(spec.dtype, torch.float32)  # the same dtype on every rank
            row = torch.zeros(spec.numel, dtype=wide, device=self._params[name].device)
            if shard is not None:
                row.copy_(shard.reshape(-1))
            alone = Bucket((name,), (0,), spec.numel)  # the owner's row holds it
        else:
            assert shard is not None  # split: every rank holds its shard of a placed param
            row, alone = shard.contiguous(), Bucket((name,), (0,), spec.shard_numel)
        rows = launch_gather(row, self._group, how).wait()
        full = unpack_rows(rows, self._layout, alone)[name]
        scale = self._loss_scale()
        if scale != 1.0:
            mul_grads_([full], 1.0 / scale)
        return full

    def grad_bytes(self) -> int:
        """Bytes held for gradients beyond ``p.grad``: accumulators, buckets in flight, shards, set aside."""
        total = sum(a.numel() * a.element_size() for a in self.accum.values())
        total += sum(s.numel() * s.element_size() for s in self.shards.values())
        total += sum(a.numel() * a.element_size() for a in self._aside.values())
        n = self._layout.world_size
        total += sum(f.bucket.shard_numel * n * f.buf.element_size() for f in self._inflight if f.buf is not None)
        return total + sum(f.rows.numel() * f.rows.element_size() for f in self._replica_rows if f.rows is not None)

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers held now, idle or in flight."""
        held = [f.buf for f in (*self._inflight, *self._replica_rows) if f.buf is not None]
        return self.staging.nbytes() + sum(b.numel() * b.element_size() for b in held)

    def close(self) -> None:
        """Remove the hooks, the placeholders from ``p.grad`` and the idle staging buffers."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._accumulators = []
        for name in self._placed:
            p = self._params[name]
            if p.grad is self._placeholders.get(name):
                p.grad = None
        self._placed = set()
        self.staging.clear()

    # step's view of the gradients (settle, take_step_grads, give_back, ...): zerofn.facade._step_grads

    # ------------------------------------------------------------------ local gradients

    def _foreign(self) -> list[str]:
        """Names whose ``p.grad`` holds a tensor the facade did not produce or consume (set by hand)."""
        out = []
        for name, p in self._params.items():
            g = p.grad
            if g is None or type(g) is ShardedGrad or name in self._local or name in self._averaged:
                continue
            if self._used.get(name) is g:
                continue
            out.append(name)
        return out

    def _merge(self, shards: Mapping[str, torch.Tensor]) -> None:
        for name, shard in shards.items():
            have = self.shards.get(name)
            self.shards[name] = shard if have is None else have + shard

    def _fold(self, name: str) -> None:
        """Move ``p.grad`` into the param's accumulator (accumulation dtype) and free it."""
        p = self._params[name]
        if p.grad is None:
            return
        acc = self.accum.get(name)
        if acc is None:
            self.accum[name] = p.grad.to(self._accum_dtype[name])
        else:
            acc.add_(p.grad)
        p.grad = None

    def _take_grad(self, name: str) -> torch.Tensor | None:
        """The local gradient to reduce for ``name`` (accumulated or ``p.grad``); frees it here."""
        self._local.discard(name)
        if self._accumulating and name in self._accum_names:
            self._fold(name)
        acc = self.accum.pop(name, None)
        if acc is not None:
            return acc
        p = self._params[name]
        g, p.grad = p.grad, None
        return g

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
        self._check_carry = False
        stale = [
            n
            for n, p in self._params.items()
            if (type(p.grad) is ShardedGrad and n not in self._placed)
            or (p.grad is not None and self._used.get(n) is p.grad)
        ]
        if stale:
            self._check_carry = True  # still there at the next try
            raise RuntimeError(CARRY_MESSAGE.format(how=CARRY_HOW[self._stage], names=_names(stale)))

    def before_accumulate(self, name: str) -> None:
        """Autograd is about to accumulate a gradient into ``p.grad``: make ``p.grad`` ready for it."""
        if self._check_carry:
            self._refuse_carry()
        p = self._params[name]
        g = p.grad
        if type(g) is ShardedGrad and name not in self._placed:  # a stale placeholder: holds nothing
            p.grad = None
            return
        if name in self._placed:  # stage 2
            self._placed.discard(name)
            if g is self._placeholders[name]:
                p.grad = None  # the shard stays: the new gradient's is added to it
            else:
                self.shards.pop(name, None)  # the user cleared or replaced it: start from that
            return
        if g is None:
            if self._averaged.pop(name, None) is not None:  # cleared by the user: start from zero
                self.shards.pop(name, None)
            return
        if self._used.get(name) is g:  # the step's averaged gradient, not zeroed: accumulate into it, as DDP
            del self._used[name]
            return
        if name in self._averaged:  # stage 1, a second backward before step: sum the means
            if not self._untouched(name):
                self.shards.pop(name, None)
                self._edited.add(name)
            del self._averaged[name]
            self._aside[name] = g
            p.grad = None

    def on_grad_ready(self, name: str) -> None:
        """A param's gradient was accumulated into ``p.grad`` by autograd."""
        self._local.add(name)
        if name in self._accum_names and (not self.require_sync or self._accumulating):
            self._fold(name)
            self._accumulating = True
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
        fresh = present & self._local  # autograd's own gradients (not tensors the user set)
        grads = {n: self._take_grad(n) for n in bucket.names if n in present}
        first = next(g for g in grads.values() if g is not None)
        n, s = self._layout.world_size, bucket.shard_numel
        buf = self.staging.take(n * s, first.dtype, first.device)
        rows = pack_grads(grads, self._layout, bucket, replicas=self._replicas, out=buf[: n * s].view(n, s))
        wire = wire_dtype(self._layout, bucket, self._precision.comm_dtype)
        wire_buf = self.staging.take(n * s, wire, first.device) if wire != first.dtype else None
        whole = self._stage == 1  # every rank receives the whole sum: the full averaged gradients
        pending = launch_reduce(
            rows,
            self._layout,
            bucket,
            self._group,
            self._how,
            comm_dtype=self._precision.comm_dtype,
            wire_out=wire_buf[: n * s].view(n, s) if wire_buf is not None else None,
            async_op=self._overlap,
            whole=whole,
        )
        if wire_buf is not None:
            self.staging.give(buf)  # stream-ordered before any later writer on this device
            buf = wire_buf
        # Stage 1: the packed local gradients' storage receives the averaged ones (no new memory).
        outs = {}
        if whole:
            for name, g in grads.items():
                if name in fresh and g is not None and g.dtype == self._layout[name].dtype and g.is_contiguous():
                    outs[name] = g
        # Each bucket in flight holds an (N, S) buffer; settling finished ones early is what
        # keeps a rank's gradient memory at its shards plus a few buckets (stage 2).
        self._inflight.push(_InFlight(bucket, present, first.dtype, buf, outs), pending)
        self._inflight.settle_finished()

    def _harvest(self, f: _InFlight, pending: comm.Pending) -> None:
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
        self._settle_bucket(f, row)

    def _settle_bucket(self, f: _InFlight, summed: torch.Tensor) -> None:
        """A reduced bucket (this rank's row, or the whole ``(N, S)`` sum at stage 1) into gradients."""
        if self._stage == 2:
            if self._settle_flat(f, summed):
                return
            shards = split_row(summed, self._layout, f.bucket, f.present, dtype=f.dtype, rank=self._rank)
            self._merge(shards)
            if f.buf is not None:
                self.staging.give_unless_aliased(f.buf, shards.values())
            return
        self._settle_whole(f, summed)
        if f.buf is not None:
            self.staging.give(f.buf)

    def _settle_flat(self, f: _InFlight, row: torch.Tensor) -> bool:
        """Stage 2: a split bucket's row into its range of this rank's flat gradient buffer.

        One copy (the cast back from the wire), the members' shards views of the buffer,
        as ``reduce_grads`` writes them (:class:`~zerofn.stages._grad_shards.GradShards`),
        so ``step`` gets them flat without packing. Only when none of the bucket's members
        holds a shard already (a second backward before ``step`` adds to it: per name, in
        :meth:`_merge`) and the group's buffer has the row's dtype; False otherwise.
        """
        g, start, _ = self._flat.where.get(f.bucket.names[0], (-1, 0, 0))
        if g < 0 or any(n in self.shards for n in f.bucket.names):
            return False
        buf = self._grad_bufs.get(g)
        if buf is None:
            buf = self._grad_bufs[g] = torch.empty(self._flat.groups[g].numel, dtype=f.dtype, device=row.device)
        elif buf.dtype != f.dtype:
            return False
        buf[start : start + row.numel()].copy_(row)  # absent members' slots are zeros in the row
        where = self._flat.where
        for name in f.present:
            _, off, k = where[name]
            self.shards[name] = self._grad_views[name] = buf[off : off + k]
        if f.buf is not None:
            self.staging.give(f.buf)  # copied out
        return True

    def _settle_whole(self, f: _InFlight, rows: torch.Tensor) -> None:
        """Stage 1: the ``(N, S)`` sum into full averaged gradients in ``p.grad``.

        The exact shards are kept aside too where ``p.grad`` cannot hold the reduced values
        bit for bit: under loss scaling (``p.grad`` is unscaled) or when the gradients are
        accumulated in a dtype wider than the working one (``f.dtype``). Nowhere else: a
        shard kept aside is trusted while ``p.grad``'s version counter has not moved, and
        some in-place writes do not move it (``GradScaler.unscale_``'s kernel), so a wide
        wire alone (float64 for fp32 params, rounded to fp32 here as in the shard) keeps
        none and ``step`` cuts ``p.grad`` as the user left it.
        """
        layout, bucket = self._layout, f.bucket
        working = layout[bucket.names[0]].dtype
        scale = self._loss_scale()
        if scale != 1.0 or f.dtype != working:
            exact = split_row(rows[self._rank], layout, bucket, f.present, dtype=f.dtype, rank=self._rank)
            self._merge({n: s for n, s in exact.items() if n not in self._edited})
        dests = {
            n: f.outs.get(n) if n in f.outs else torch.empty(layout[n].shape, dtype=working, device=rows.device)
            for n in bucket.names
            if n in f.present
        }
        unpack_rows(rows, layout, bucket, dests, names=dests)
        if scale != 1.0:
            mul_grads_(dests.values(), 1.0 / scale)  # what the user sees: true gradients
        for name, g in dests.items():
            self._set_averaged(name, g, f.dtype)

    def _set_averaged(self, name: str, g: torch.Tensor, dtype: torch.dtype) -> None:
        aside = self._aside.pop(name, None)
        if aside is not None:
            g.add_(aside)  # the earlier backward's mean: two backwards before step sum their means
        p = self._params[name]
        if p.dtype == g.dtype and p.device == g.device and p.shape == g.shape:
            p.grad = g
        # else the param was cast, moved or replaced since construction: p.grad stays None and
        # step raises for the param itself (ParamsChangedError), not for its gradient.
        self._averaged[name] = _Averaged(g, g._version, dtype)

    def _sum_replica_rows(self) -> None:
        """Hybrid only: add the replicas' sums, in bucket launch order (the same on every rank)."""
        for f in self._replica_rows:
            assert f.rows is not None  # set by _harvest
            self._settle_bucket(f, sum_over_replicas(f.rows, self._replicate))
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
        leftovers = (self._local | set(self._foreign())) - ready
        for name in leftovers:
            b = self._bucket_of.get(name)
            if b is None:
                self._ready_empty.add(name)
            else:
                self._ready[b].add(name)
        present = sorted(ready | leftovers, key=self._position.__getitem__)
        # Every rank must have produced gradients for the same params before the last
        # buckets go out; one tiny all-gather (see checks.check_ranks_agree).
        device = next(iter(self._params.values())).device
        checks.check_ranks_agree(self._layout, self._group, "ZeroOptimizer.backward", present=present, device=device)
        for b in range(len(self._buckets)):
            if self._ready[b] - self._sent[b]:
                self._launch(b)
        self._inflight.settle()
        self._sum_replica_rows()
        for name in self._ready_empty:  # empty params travel in no bucket
            g = self._take_grad(name)
            if g is None:
                continue
            if self._stage == 2:
                self._merge({name: g.new_empty(0)})
            else:
                self._set_averaged(name, g, g.dtype)
        if self._stage == 2:
            for name in present:
                p = self._params[name]
                if p.grad is None:
                    if name not in self._placeholders:
                        self._placeholders[name] = sharded_grad(p)
                    p.grad = self._placeholders[name]
                    self._placed.add(name)
        for name, used in self._used.items():  # the step's gradient, not zeroed and not added to: DDP applies it again
            if self._params[name].grad is used:
                self._averaged[name] = _Averaged(used, used._version, used.dtype)
        self._used = {}
        self._accumulating = bool(self.accum)
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
