"""Where a reduced bucket row becomes this rank's gradient shards: one piece that
``reduce_grads`` and ``value_and_reduced_grads`` both finish their buckets with.

A split bucket's row is its members' shards side by side, which is its range of this
rank's flat gradient buffer of its group (bucket order is flat order,
:mod:`zerofn.flat`), so the row is written there (cast back from the wire) with one copy
per bucket; the result is a :class:`~zerofn.flat.FlatDict` on the rank's flat layout,
what ``step_shards`` applies without packing. A whole param's shard (its full gradient on
its owner) is a loose entry of that FlatDict, cut per name
(:func:`~zerofn.buckets.split_row`). A group whose gradients come in two dtypes (some in
the accumulation dtype, some in the working dtype) has its buffer in the wider of them:
the narrower rows are widened exactly, which is what ``step_shards`` does to them before
it scales them anyway.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from zerofn import _comm as comm
from zerofn import _traced, flat
from zerofn._offsets import Bucket
from zerofn.buckets import split_row
from zerofn.layout import ShardLayout, live_layout

__all__ = ["GradShards"]


class GradShards:
    """Collects the reduced rows of one reduction and hands out the gradient shards.

    Args:
      layout: the layout the buckets follow.
      rank: this rank in the sharding group.
      grad_dtypes: name -> the dtype its gradient came in, for every name that has one
        (its shard is in that dtype); the others get none in the result.
      device: where the gradients live.

    Eagerly each group's buffer is allocated at its first bucket and each row lands in its
    range: summed there by the collective when the caller asked for the range first
    (:meth:`target`, no cast between the wire and the shards), else copied in (``copy_``:
    the cast ``row.to(dtype)`` computes). So a group costs one allocation and a bucket at
    most one copy; a group covered by one bucket whose row was not summed in place is its
    row (cast or copied out of the staging rows, or the row itself when it is a fresh
    tensor of the right dtype). Ranges no bucket wrote
    (buckets without any gradient are not sent) are zeroed in :meth:`result`. Under
    tracing the rows are concatenated once per group instead (a write into a view of
    one buffer becomes a scatter of the whole buffer per bucket in a graph).
    """

    def __init__(
        self, layout: ShardLayout, rank: int, grad_dtypes: Mapping[str, torch.dtype], device: torch.device
    ) -> None:
        self.layout, self.rank, self.grad_dtypes, self.device = layout, rank, grad_dtypes, device
        self.fl = flat.flat_layout(layout, rank)
        self.tracing = comm.tracing()
        if self.tracing:  # a loop over every name: run natively at trace time, its result a constant
            pairs = _traced_buffer_dtypes(layout.fingerprint, rank, tuple(grad_dtypes.items()))
            self.buffer_dtypes = dict(pairs)
        else:
            self.buffer_dtypes = _buffer_dtypes(self.fl, grad_dtypes)
        self._buffers: dict[int, torch.Tensor] = {}
        self._written: dict[int, list[tuple[int, int]]] = {}
        self._rows: dict[int, list[tuple[int, torch.Tensor]]] = {}  # traced: the rows, concatenated at the end
        self._named: dict[str, torch.Tensor] = {}

    def target(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor | None:
        """Where ``bucket``'s reduced row of ``dtype`` would be copied by :meth:`put`, to sum it there.

        Eagerly, for a split bucket whose group buffer has ``dtype`` (no cast between the
        wire and the shards): the bucket's ``(S,)`` range of that buffer (allocated here at
        the group's first bucket); the collective writes the row into it and :meth:`put`
        finds it in place. ``None`` otherwise (whole params, a cast, a traced step).
        """
        if self.tracing or bucket.span is None:
            return None
        g, start, stop = bucket.span
        if self.buffer_dtypes.get(g) != dtype:
            return None
        buf = self._buffers.get(g)
        if buf is None:
            buf = self._buffers[g] = torch.empty(self.fl.groups[g].numel, dtype=dtype, device=self.device)
        return buf[start:stop]

    def put(self, bucket: Bucket, row: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's reduced ``(S,)`` row of ``bucket`` into the shards, cast to ``dtype``.

        ``dtype`` is the bucket's gradient dtype; a split bucket's row goes into its group's
        buffer, in :attr:`buffer_dtypes` (the wider dtype where the group's gradients mix).
        Returns the tensors kept that may share ``row``'s storage (for
        :meth:`~zerofn.buckets.StagingPool.give_unless_aliased`).
        """
        if bucket.span is None:  # whole params: no range in any buffer
            shards = split_row(row, self.layout, bucket, self.grad_dtypes, dtype=dtype, rank=self.rank)
            self._named.update(shards)
            return list(shards.values())
        g, start, stop = bucket.span
        dtype = self.buffer_dtypes[g]
        if self.tracing:
            piece = row.to(dtype) if row.dtype != dtype else row.clone() if row._base is not None else row
            self._rows.setdefault(g, []).append((start, piece))
            return [piece]
        group = self.fl.groups[g]
        buf = self._buffers.get(g)
        if buf is None and start == 0 and stop == group.numel:  # the only bucket of its group
            own = row.to(dtype) if row.dtype != dtype else row.clone() if row._base is not None else row
            self._buffers[g] = own  # a tensor of its own already: no copy
            self._written[g] = [(start, stop)]
            return [own]
        if buf is None:
            buf = self._buffers[g] = torch.empty(group.numel, dtype=dtype, device=row.device)
        dest = buf[start:stop]
        if row.data_ptr() != dest.data_ptr():  # not summed in place (see target)
            dest.copy_(row)
        self._written.setdefault(g, []).append((start, stop))
        return []

    def result(self) -> flat.FlatDict:
        """The shards of every name in ``grad_dtypes`` this rank holds, in layout order.

        A :class:`~zerofn.flat.FlatDict` on the rank's flat layout: the ranges of names
        without a gradient are zero, a group none of whose names has one has no buffer,
        and an empty loose param (in no bucket) gets an empty tensor.
        """
        fl, present = self.fl, self.grad_dtypes
        buffers = [self._buffer(gi, group) for gi, group in enumerate(fl.groups)]
        loose = {n: self._named[n] if n in self._named else self._empty(n) for n in fl.loose if n in present}
        return flat.FlatDict.from_buffers(fl, buffers, loose, tuple(n for n in fl.names if n in present))

    def _empty(self, name: str) -> torch.Tensor:
        return torch.empty(self.fl.shapes[name], dtype=self.grad_dtypes[name], device=self.device)

    def _buffer(self, gi: int, group: flat.FlatGroup) -> torch.Tensor | None:
        """Group ``gi``'s gradient buffer: the rows in their ranges, zeros where no bucket was sent."""
        dtype = self.buffer_dtypes.get(gi)
        if dtype is None:
            return None
        if self.tracing:
            parts: list[torch.Tensor] = []
            at = 0
            for start, piece in sorted(self._rows.get(gi, ()), key=lambda sp: sp[0]):
                if start > at:
                    parts.append(torch.zeros(start - at, dtype=dtype, device=self.device))
                parts.append(piece)
                at = start + piece.numel()
            if at < group.numel or not parts:
                parts.append(torch.zeros(group.numel - at, dtype=dtype, device=self.device))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        buf = self._buffers.get(gi)
        if buf is None:
            return torch.zeros(group.numel, dtype=dtype, device=self.device)
        at = 0
        for start, stop in sorted(self._written.get(gi, ())):
            if start > at:
                buf[at:start].zero_()
            at = stop
        if at < group.numel:
            buf[at:].zero_()
        return buf


def _buffer_dtypes(fl: flat.FlatLayout, grad_dtypes: Mapping[str, torch.dtype]) -> dict[int, torch.dtype]:
    """Each flat group's gradient buffer dtype: its gradients' dtype, the wider where they mix.

    Groups none of whose names has a gradient are absent (they get no buffer).
    """
    out: dict[int, torch.dtype] = {}
    for name, dtype in grad_dtypes.items():
        g = fl.where.get(name, (-1,))[0]
        if g >= 0:
            seen = out.setdefault(g, dtype)
            if seen != dtype:
                out[g] = torch.promote_types(seen, dtype)
    return out


@_traced.constant_result
def _traced_buffer_dtypes(
    fingerprint: str, rank: int, grad_dtypes: tuple[tuple[str, torch.dtype], ...]
) -> tuple[tuple[int, torch.dtype], ...]:
    """:func:`_buffer_dtypes` of the layout with ``fingerprint``, for a compiled step (as pairs)."""
    fl = flat.flat_layout(live_layout(fingerprint), rank)
    return tuple(_buffer_dtypes(fl, dict(grad_dtypes)).items())
