"""Explicit reuse between steps, of bucket rows and of the views params are written through:
:class:`StagingPool`, public as ``zerofn.buckets.StagingPool``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from zerofn._bucket_plan import _bucket_plan, member_targets
from zerofn._offsets import Bucket
from zerofn.layout import ShardLayout

__all__ = ["StagingPool"]

#: Buckets whose unpack views a pool keeps (one entry per (layout, bucket)).
_TARGETS_KEPT = 256


class StagingPool:
    """A free list of flat bucket buffers per (dtype, device), reused between buckets and steps.

    Explicit reuse: the facade keeps one (its gradient staging, which its param gathers
    borrow between ``step`` and the next ``backward``), and a functional loop may pass
    one to :func:`~zerofn.reduce_grads` and :func:`~zerofn.gather_params` (``staging=``).
    Fresh multi-MB buffers every step fault in new pages, which costs more than the copy
    into them; a reused buffer's pages are mapped already. What comes out of the
    stage functions never aliases a pool buffer: results are copied out first.

    ``take`` hands out the smallest free buffer with room (or a new one of at least
    ``min_numel`` elements); ``give`` returns one once nothing reads it any more, keeping at
    most ``keep`` per (dtype, device) (the smallest are dropped). The default keeps a whole
    pipeline's buffers: up to three buckets, each with the rows it sends and the rows the
    all-to-all reduce receives (``stages._pipeline``). ``unpack_targets`` keeps
    the views a gather writes the same params through every step. Not thread safe; one
    pool per training loop.
    """

    def __init__(self, keep: int = 6, min_numel: int = 0) -> None:
        self._keep = keep
        self._min_numel = min_numel
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._targets: dict[tuple[ShardLayout, Bucket, bool], tuple[list[int], list[torch.Tensor]]] = {}

    @property
    def keep(self) -> int:
        """Idle buffers kept per (dtype, device)."""
        return self._keep

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled graph plans its own buffers: never reuse in a trace
            return torch.empty(max(numel, self._min_numel), dtype=dtype, device=device)
        free = self._free.get((dtype, device))
        if free:
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(max(numel, self._min_numel), dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # nothing kept between calls of a compiled graph
            return
        free = self._free.setdefault((buf.dtype, buf.device), [])
        free.append(buf)
        if len(free) > self._keep:
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def give_unless_aliased(self, buf: torch.Tensor, readers: Iterable[torch.Tensor]) -> None:
        """Return ``buf`` unless one of ``readers`` is a view of it (then it is simply dropped)."""
        if torch.compiler.is_compiling():  # no storage addresses in a trace: the compiler owns buffers
            return
        ptr = buf.untyped_storage().data_ptr()
        if all(t.untyped_storage().data_ptr() != ptr for t in readers):
            self.give(buf)

    def unpack_targets(
        self, layout: ShardLayout, bucket: Bucket, out: Mapping[str, torch.Tensor], *, separate: bool = False
    ) -> list[torch.Tensor]:
        """:func:`~zerofn.buckets.unpack_targets` of every member of ``bucket`` in ``out``,
        made once per storage of those tensors and kept here.

        A view per member costs microseconds, a bucket of a thousand params milliseconds a
        step. The kept views hold the storage they were made of, so a tensor given new
        storage since (``p.data = ...``, ``model.to(...)``) has a new address, and its
        bucket's views are made again. ``separate``: for rows given as ``N`` tensors apart
        (a broadcast gather's), kept apart from the views for an ``(N, S)`` buffer.
        """
        plan = _bucket_plan(layout, bucket)
        members = plan.members
        if torch.compiler.is_compiling():  # no storage addresses in a trace
            return member_targets(layout.world_size, plan, members, out, separate)
        key = [out[m.name].data_ptr() for m in members]
        kept = self._targets.get((layout, bucket, separate))
        if kept is None or kept[0] != key:
            if kept is None and len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()
            kept = (key, member_targets(layout.world_size, plan, members, out, separate))
            self._targets[(layout, bucket, separate)] = kept
        return kept[1]

    def buffers(self) -> list[torch.Tensor]:
        """The idle buffers held now."""
        return [b for free in self._free.values() for b in free]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def clear(self) -> None:
        self._free = {}
        self._targets = {}
