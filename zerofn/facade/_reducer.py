"""The facade's gradient reducer: when each bucket's reduction launches, and into which buffer.

It owns no packing, scaling or cutting: every bucket goes through
:mod:`zerofn.buckets` (``pack_grads`` into a reused staging buffer, ``launch_reduce``,
``split_row``), the same pieces :func:`~zerofn.reduce_grads` loops over, so both paths
send identical buffers and get identical bits.

Gradient flow per backward:

* **no hooks** (stage 1 without overlap): :meth:`GradReducer.reduce_local` reduces all
  ``p.grad`` with :func:`~zerofn.reduce_grads` and frees them.
* **hooks** (stage 2, or ``overlap_communication=True``): a post-accumulate-grad hook
  counts each bucket's members as their gradients land; a full bucket is packed into an
  ``(N, S)`` staging buffer (reused between buckets and steps), its members' ``p.grad``
  freed, and its reduction launched (asynchronously when overlapping). When autograd
  finishes, an engine callback launches the buckets with absent members (layer drop)
  and waits for all.
* **accumulation**: inside ``no_sync()`` nothing is communicated. When the accumulation
  dtype differs from the working dtype (float32 under fp16/bf16 by default), a hook moves
  each fresh ``p.grad`` into a float32 accumulator, and the closing backward reduces the
  accumulators.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn._comm import CommPolicy, Group
from zerofn.buckets import launch_gather, launch_reduce, pack_grads, split_row, unpack_rows, wire_dtype
from zerofn.layout import Bucket, ShardLayout
from zerofn.precision import PrecisionPolicy
from zerofn.stages import reduce_grads, reduce_realisation, sum_over_replicas

__all__ = ["GradReducer", "Staging"]

# Buckets whose reduction may be in flight at once when overlapping: enough to keep the
# network busy while backward computes, few enough to bound the buffers held.
MAX_INFLIGHT = 2


class Staging:
    """A free list of flat staging buffers per (dtype, device), reused between buckets and steps.

    ``take`` hands out the smallest free buffer with room (or a new one of at least
    ``min_numel`` elements); ``give`` returns one once nothing reads it any more, keeping at
    most ``keep`` per (dtype, device) (the smallest are dropped). Fresh multi-MB buffers
    every step would fault in new pages (measured: about 3x the copy itself).
    """

    def __init__(self, keep: int, min_numel: int) -> None:
        self._keep = keep
        self._min_numel = min_numel
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((dtype, device))
        if free:
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(max(numel, self._min_numel), dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        free = self._free.setdefault((buf.dtype, buf.device), [])
        free.append(buf)
        if len(free) > self._keep:
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def give_unless_aliased(self, buf: torch.Tensor, readers: Iterable[torch.Tensor]) -> None:
        """Return ``buf`` unless one of ``readers`` is a view of it (then it is simply dropped)."""
        ptr = buf.untyped_storage().data_ptr()
        if all(t.untyped_storage().data_ptr() != ptr for t in readers):
            self.give(buf)

    def buffers(self) -> list[torch.Tensor]:
        """The idle buffers held now."""
        return [b for free in self._free.values() for b in free]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def clear(self) -> None:
        self._free = {}


class _InFlight:
    """One bucket whose reduction is launched: its handle, who was present, the buffer it reads."""

    __slots__ = ("bucket", "buf", "dtype", "pending", "present")

    def __init__(
        self, bucket: Bucket, pending: comm.Pending, present: set[str], dtype: torch.dtype, buf: torch.Tensor
    ) -> None:
        self.bucket, self.pending, self.present, self.dtype, self.buf = bucket, pending, present, dtype, buf


class GradReducer:
    """Full local gradients in, this rank's mean-gradient shards out (``shards``).

    Args:
      params: name -> the model's param (layout order).
      layout: the state's layout.
      precision: the state's precision policy (wire and accumulation dtypes).
      group: the sharding group; replicate: the replicas' group of a hybrid layout or None.
      stage: 1 or 2 (the reduce realisation); bucket_numel: elements per bucket.
      overlap: launch reductions asynchronously from the hooks.
      comm_policy: collective realisations.

    Collectives: per bucket one reduction (see :func:`zerofn.buckets.launch_reduce`), one
    tiny rank-agreement all-gather per hooked backward, and with replicas one all-reduce
    per bucket over the replicate group at the end of backward.
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
    ) -> None:
        self._params = params
        self._layout = layout
        self._precision = precision
        self._group, self._replicate = group, replicate
        self._replicas = comm.group_size(replicate) if replicate is not None else 1
        self._stage, self._bucket_numel, self._overlap = stage, bucket_numel, overlap
        self._comm_policy = comm_policy
        self._how = reduce_realisation(stage, group, comm_policy)
        self._buckets = layout.buckets(bucket_numel)
        self._bucket_of = {name: i for i, b in enumerate(self._buckets) for name in b.names}
        self._position = {name: i for i, name in enumerate(layout.names)}  # layout order, for sorting
        self.require_sync = True  # False inside no_sync()
        self.shards: dict[str, torch.Tensor] = {}  # reduced, waiting for step()
        # Hook-path bookkeeping for the backward pass in progress.
        self._ready: list[set[str]] = [set() for _ in self._buckets]
        self._launched: set[int] = set()
        self._inflight: list[_InFlight] = []
        self.staging = Staging(keep=MAX_INFLIGHT + 1 if overlap else 1, min_numel=bucket_numel)
        self._replica_rows: list[tuple[Bucket, torch.Tensor, set[str], torch.dtype]] = []
        self._callback_queued = False
        # Accumulation in another dtype than the working one (float32 under fp16/bf16):
        # micro-step gradients are moved out of p.grad into these by the hooks.
        self._accum_dtype = {n: precision.grad_accum_dtype_for(layout[n].dtype) for n in params}
        self._accum_names = {n for n, d in self._accum_dtype.items() if d != layout[n].dtype}
        self.accum: dict[str, torch.Tensor] = {}
        self._accumulating = False  # a no_sync backward folded gradients since the last reduction
        self._hook_reduce = overlap or stage == 2
        self._hooks: list[Any] = []
        if self._hook_reduce or self._accum_names:
            me = weakref.ref(self)  # hooks live on the model's params; they must not keep us alive
            for name, p in params.items():
                self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(me, name)))

    # ------------------------------------------------------------------ state

    def clear(self) -> None:
        """Forget accumulators and reduced shards (``zero_grad``)."""
        self.accum = {}
        self._accumulating = False
        self.shards = {}

    def take_shards(self) -> dict[str, torch.Tensor]:
        """The reduced shards, handed over (to ``step``); the reducer starts from none."""
        shards, self.shards = self.shards, {}
        return shards

    def full_grad(self, name: str, how: str) -> torch.Tensor | None:
        """The full reduced gradient of ``name`` (param shape, the shard's dtype), or None.

        Collectives: one gather (``how``) of the param's shard, on every rank of the group.
        """
        shard = self.shards.get(name)
        if shard is None:
            return None
        alone = Bucket((name,), (0,), self._layout[name].shard_numel)  # this param's shard is the row
        rows = launch_gather(shard.contiguous(), self._group, how).wait()
        return unpack_rows(rows, self._layout, alone)[name]

    def grad_bytes(self) -> int:
        """Bytes held for gradients beyond ``p.grad``: accumulators, buckets in flight, shards."""
        total = sum(a.numel() * a.element_size() for a in self.accum.values())
        total += sum(s.numel() * s.element_size() for s in self.shards.values())
        n = self._layout.world_size
        total += sum(f.bucket.shard_numel * n * f.buf.element_size() for f in self._inflight)
        return total + sum(row.numel() * row.element_size() for _, row, _, _ in self._replica_rows)

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers held now, idle or in flight."""
        return self.staging.nbytes() + sum(f.buf.numel() * f.buf.element_size() for f in self._inflight)

    def close(self) -> None:
        """Remove the gradient hooks and drop the idle staging buffers."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.staging.clear()

    # ------------------------------------------------------------------ local gradients

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
        if self._accumulating and name in self._accum_names:
            self._fold(name)
        acc = self.accum.pop(name, None)
        if acc is not None:
            return acc
        p = self._params[name]
        g, p.grad = p.grad, None
        return g

    def reduce_local(self) -> None:
        """Reduce whatever full gradients sit in ``p.grad`` or accumulators (no-hook path) and free them."""
        if self.accum:
            self._accumulating = True  # left over (e.g. a param with no gradient in the last micro-step)
        names = [n for n, p in self._params.items() if p.grad is not None or n in self.accum]
        if not names:
            return
        grads = {n: self._take_grad(n) for n in names}
        self._accumulating = False
        shards = reduce_grads(
            grads,
            self._layout,
            self._group,
            self._stage,
            self._bucket_numel,
            comm_policy=self._comm_policy,
            precision=self._precision,
            replicate_group=self._replicate,
        )
        self._merge(shards)

    # ------------------------------------------------------------------ hook path

    def on_grad_ready(self, name: str) -> None:
        """A param's gradient was accumulated into ``p.grad`` by autograd."""
        if name in self._accum_names and (not self.require_sync or self._accumulating):
            self._fold(name)
            self._accumulating = True
        if not (self.require_sync and self._hook_reduce):
            return
        if not self._callback_queued:
            # Runs once autograd has finished this backward pass, whoever called it.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        b = self._bucket_of.get(name)
        if b is None:  # an empty param: nothing to send
            return
        self._ready[b].add(name)
        if len(self._ready[b]) == len(self._buckets[b].names):
            self._launch(b)

    def _launch(self, b: int) -> None:
        """Pack bucket ``b`` into a staging buffer (its members' ``p.grad`` freed) and launch its reduction."""
        bucket = self._buckets[b]
        present = set(self._ready[b])
        grads = {n: self._take_grad(n) for n in bucket.names if n in present}
        first = next(g for g in grads.values() if g is not None)
        n, s = self._layout.world_size, bucket.shard_numel
        buf = self.staging.take(n * s, first.dtype, first.device)
        rows = pack_grads(grads, self._layout, bucket, replicas=self._replicas, out=buf[: n * s].view(n, s))
        wire = wire_dtype(self._layout, bucket, self._precision.comm_dtype)
        wire_buf = self.staging.take(n * s, wire, first.device) if wire != first.dtype else None
        pending = launch_reduce(
            rows,
            self._layout,
            bucket,
            self._group,
            self._how,
            comm_dtype=self._precision.comm_dtype,
            wire_out=wire_buf[: n * s].view(n, s) if wire_buf is not None else None,
            async_op=self._overlap,
        )
        if wire_buf is not None:
            self.staging.give(buf)  # stream-ordered before any later writer on this device
            buf = wire_buf
        self._launched.add(b)
        self._inflight.append(_InFlight(bucket, pending, present, first.dtype, buf))
        self._harvest(MAX_INFLIGHT if self._overlap else 0)

    def _harvest(self, keep: int) -> None:
        """Turn finished buckets into shards, oldest first, leaving at most ``keep`` in flight.

        Each bucket in flight holds an ``(N, S)`` buffer; harvesting early is what keeps a
        rank's gradient memory at its shards plus a few buckets.
        """
        while self._inflight and (len(self._inflight) > keep or self._inflight[0].pending.done()):
            f = self._inflight.pop(0)
            row = f.pending.wait()
            if self._replicate is not None:
                # Hybrid: the replicas' sum waits for the end of backward. Harvesting happens
                # at timing-dependent moments; a blocking all-reduce over the replicate group
                # here could interleave with another rank's shard-group collective and
                # deadlock. Keep just this rank's row (1/N of the bucket) until then.
                kept = row.clone() if row._base is not None else row
                self._replica_rows.append((f.bucket, kept, f.present, f.dtype))
                self.staging.give_unless_aliased(f.buf, [kept])
                continue
            shards = split_row(row, self._layout, f.bucket, f.present, dtype=f.dtype)
            self._merge(shards)
            self.staging.give_unless_aliased(f.buf, shards.values())

    def _sum_replica_rows(self) -> None:
        """Hybrid only: add the replicas' rows, in bucket launch order (the same on every rank)."""
        for bucket, row, present, dtype in self._replica_rows:
            row = sum_over_replicas(row, self._replicate)
            self._merge(split_row(row, self._layout, bucket, present, dtype=dtype))
        self._replica_rows = []

    def _finish_backward(self) -> None:
        """End of a backward pass: launch partial buckets (layer drop), wait, keep shards."""
        self._callback_queued = False
        ready = sorted(set().union(*self._ready), key=self._position.__getitem__)
        # Every rank must have produced gradients for the same params before the last
        # buckets go out; one tiny all-gather (see checks.check_ranks_agree).
        device = next(iter(self._params.values())).device
        checks.check_ranks_agree(self._layout, self._group, "ZeroOptimizer.backward", present=ready, device=device)
        for b in range(len(self._buckets)):
            if b not in self._launched and self._ready[b]:
                self._launch(b)
        self._harvest(0)
        self._sum_replica_rows()
        empty = [n for n in ready if n not in self._bucket_of]
        self._merge({n: g.new_empty(0) for n in empty if (g := self._take_grad(n)) is not None})
        self._accumulating = bool(self.accum)  # leftovers (no gradient in this backward) go in step()
        self._ready = [set() for _ in self._buckets]
        self._launched = set()
        self._inflight = []


def _grad_hook(me: weakref.ref[GradReducer], name: str) -> Any:
    def hook(param: torch.Tensor) -> None:
        reducer = me()
        if reducer is not None:
            reducer.on_grad_ready(name)

    return hook
