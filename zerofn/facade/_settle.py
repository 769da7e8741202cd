"""Where a reduced bucket becomes the facade's gradients: shards (stage 2) or ``p.grad`` (stage 1).

The :class:`~zerofn.facade._reducer.GradReducer` decides when a bucket launches and hands
each reduced one to a :class:`Settler`, which writes it into the
:class:`~zerofn.facade._held.HeldGrads`:

* **stage 2**, a split bucket's row (this rank's ``(S,)`` slice of the bucket's sum) goes
  into its range of this rank's flat gradient buffer through
  :class:`~zerofn.stages._grad_shards.GradShards`, the piece ``reduce_grads`` finishes its
  buckets with, so both paths hold the same bits in the same buffers. One ``GradShards``
  per flat group and reduction (a backward, or the reduction ``settle`` runs), created at
  the group's first bucket with that bucket's dtype; at the end of the reduction its
  result's views become the shards, and ``step`` gets them as one
  :class:`~zerofn.flat.FlatDict` without packing. A bucket whose members already hold a
  shard (a second backward before ``step`` adds to it), whose group already has a buffer
  from an earlier reduction, or whose dtype differs from its group's, and every bucket of
  whole params, is cut per name (:func:`~zerofn.buckets.split_row`) and summed per name.
* **stage 1**, the whole ``(N, S)`` sum is unpacked into full averaged gradients in
  ``p.grad`` (divided by the loss scale), as DDP leaves them.

Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from zerofn import flat
from zerofn._offsets import Bucket
from zerofn.buckets import StagingPool, split_row, unpack_rows
from zerofn.facade._held import Averaged, HeldGrads
from zerofn.layout import ShardLayout
from zerofn.precision import mul_grads_
from zerofn.stages._grad_shards import GradShards

__all__ = ["Launched", "Settler"]


class Launched:
    """One bucket whose reduction is launched: who was present, the dtype, the buffer it reads.

    ``outs``: stage 1, the local gradients just packed, reused as the full averaged
    gradients' storage (name -> tensor of the param's shape and working dtype). ``buf``
    is the staging buffer to give back once settled (None: not a staging buffer).
    ``shards``: stage 2, the ``GradShards`` its row goes into, decided at launch by
    :meth:`Settler.place` (None: cut per name).
    """

    __slots__ = ("bucket", "buf", "dtype", "outs", "present", "rows", "shards")

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
        self.shards: GradShards | None = None


class Settler:
    """Reduced buckets into :class:`~zerofn.facade._held.HeldGrads` (see the module docstring).

    Args:
      held: the reducer's gradients, written here.
      layout: the state's layout; stage: 1 or 2; rank: this rank in the sharding group.
      staging: the reducer's pool; a settled bucket's staging buffer goes back to it
        unless a kept tensor is a view of it.
      loss_scale: returns the loss scale the reduced gradients carry (stage 1 divides
        ``p.grad`` by it, so users see true gradients, as after ``GradScaler.unscale_``).
    """

    def __init__(
        self,
        held: HeldGrads,
        layout: ShardLayout,
        stage: int,
        rank: int,
        staging: StagingPool,
        loss_scale: Callable[[], float],
    ) -> None:
        self._held, self._layout, self._stage, self._rank = held, layout, stage, rank
        self._params = held.params
        self._staging = staging
        self._loss_scale = loss_scale
        self._flat = flat.flat_layout(layout, rank)
        # The reduction in progress (stage 2): flat group -> its GradShards, their dtype, the names put there.
        self._open: dict[int, GradShards] = {}
        self._open_dtype: dict[int, torch.dtype] = {}
        self._open_names: dict[int, set[str]] = {}

    def settle(self, f: Launched, summed: torch.Tensor) -> None:
        """A reduced bucket (this rank's ``(S,)`` row at stage 2, the whole ``(N, S)`` sum at stage 1)."""
        if self._stage == 2:
            kept = self._settle_row(f, summed)
            if f.buf is not None:
                self._staging.give_unless_aliased(f.buf, kept)
            return
        self._settle_whole(f, summed)
        if f.buf is not None:
            self._staging.give(f.buf)

    def place(self, f: Launched, device: torch.device) -> None:
        """Stage 2, at launch: decide where bucket ``f``'s row will be kept (``f.shards``): its
        group's ``GradShards`` (opened at the group's first bucket), whose range of the flat
        buffer the collective can sum into (:meth:`GradShards.target`); or none, the row cut
        per name (a bucket of whole params, one whose names already hold shards, another
        dtype than its group's). Buckets are placed and settled in launch order."""
        g = self._flat.where.get(f.bucket.names[0], (-1, 0, 0))[0]
        if g < 0 or not self._flat_fits(g, f):
            return
        shards = self._open.get(g)
        if shards is None:
            names = self._flat.groups[g].names
            shards = self._open[g] = GradShards(self._layout, self._rank, dict.fromkeys(names, f.dtype), device)
            self._open_dtype[g], self._open_names[g] = f.dtype, set()
        f.shards = shards

    def _settle_row(self, f: Launched, row: torch.Tensor) -> Iterable[torch.Tensor]:
        """Stage 2: the row into the ``GradShards`` placed at launch, or cut per name; the tensors kept from it."""
        if f.shards is not None:
            self._open_names[self._flat.where[f.bucket.names[0]][0]] |= f.present
            return f.shards.put(f.bucket, row, f.dtype)
        cut = split_row(row, self._layout, f.bucket, f.present, dtype=f.dtype, rank=self._rank)
        self._held.merge(cut)
        return cut.values()

    def _flat_fits(self, g: int, f: Launched) -> bool:
        """Whether bucket ``f`` of flat group ``g`` can be written into the group's flat buffer."""
        held = self._held
        if g in held.grad_bufs or any(n in held.shards for n in f.bucket.names):
            return False
        if any(n in self._open_names.get(g, ()) for n in f.bucket.names):
            return False  # (a reduction cut short by an error: this bucket was put already)
        return self._open_dtype.get(g, f.dtype) == f.dtype

    def finish(self) -> None:
        """End of a reduction: each group's ``GradShards`` result into the held shards (its views)."""
        held = self._held
        for g, shards in self._open.items():
            result = shards.result()
            views = {n: v for n, v in result.group_views(g).items() if n in self._open_names[g]}
            held.grad_bufs[g] = result.buffers[g]  # type: ignore[assignment]
            held.grad_views.update(views)
            held.merge(views)
        self.clear()

    def clear(self) -> None:
        """Forget a reduction in progress (``zero_grad``)."""
        self._open, self._open_dtype, self._open_names = {}, {}, {}

    def nbytes(self) -> int:
        """Bytes of the flat gradient buffers of the reduction in progress (one per group written to)."""
        groups = self._flat.groups
        return sum(groups[g].numel * dtype.itemsize for g, dtype in self._open_dtype.items())

    def _settle_whole(self, f: Launched, rows: torch.Tensor) -> None:
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
            self._held.merge({n: s for n, s in exact.items() if n not in self._held.edited})
        dests = {
            n: f.outs.get(n) if n in f.outs else torch.empty(layout[n].shape, dtype=working, device=rows.device)
            for n in bucket.names
            if n in f.present
        }
        unpack_rows(rows, layout, bucket, dests, names=dests)
        if scale != 1.0:
            mul_grads_(dests.values(), 1.0 / scale)  # what the user sees: true gradients
        for name, g in dests.items():
            self.set_averaged(name, g, f.dtype)

    def set_averaged(self, name: str, g: torch.Tensor, dtype: torch.dtype) -> None:
        """Stage 1: ``g`` (param shape) is ``name``'s averaged gradient: into ``p.grad``, recorded."""
        aside = self._held.aside.pop(name, None)
        if aside is not None:
            g.add_(aside)  # the earlier backward's mean: two backwards before step sum their means
        p = self._params[name]
        if p.dtype == g.dtype and p.device == g.device and p.shape == g.shape:
            p.grad = g
        # else the param was cast, moved or replaced since construction: p.grad stays None and
        # step raises for the param itself (ParamsChangedError), not for its gradient.
        self._held.averaged[name] = Averaged(g, g._version, dtype)
