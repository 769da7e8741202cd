"""The collectives outside a training step: Python objects, whole-model broadcasts, groups, barriers.

They run at construction (the params broadcast from one rank, a hybrid layout's grid of
groups), around checkpoints (a rank's objects, barriers) and to explain an error already
found (every rank's description, gathered). The step's own collectives, and the policy
that realises them, are in :mod:`zerofn._comm`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerofn._comm import Group, group_rank, group_size
from zerofn._comm_count import record

__all__ = ["BROADCAST_NUMEL", "all_gather_objects", "barrier", "broadcast_object", "broadcast_tensors_", "grid_groups"]


def all_gather_objects(obj: object, group: Group) -> list[object]:
    """Every rank's picklable ``obj``. Slow; only used to explain an error already found."""
    out: list[object] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, group: Group, src: int = 0) -> object:
    """Group rank ``src``'s picklable ``obj`` on every rank (e.g. a checkpoint's temp name)."""
    box = [obj]
    global_src = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(box, src=global_src, group=group)
    return box[0]


# Elements per flat buffer of broadcast_tensors_ (2**26: 256 MiB in float32, as DDP's
# 250 MB broadcast buckets at construction).
BROADCAST_NUMEL = 2**26


def broadcast_tensors_(tensors: list[torch.Tensor], group: Group, src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values, in place.

    Tensors of one dtype and device travel flattened in buffers of at most
    ``BROADCAST_NUMEL`` elements (params and buffers of a model: a few broadcasts in all,
    whatever their number; the extra memory is one such buffer). Every rank must pass
    tensors of the same shapes and dtypes in the same order (the caller checks first).

    Collectives: one ``broadcast`` per (dtype, device) and ``BROADCAST_NUMEL`` elements;
    none for a group of one.
    """
    n = group_size(group)
    if n == 1 or not tensors:
        return
    global_src = src if group is None else dist.get_global_rank(group, src)
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            kinds.setdefault((t.dtype, t.device), []).append(t)
    chunks: list[list[torch.Tensor]] = []
    for members in kinds.values():  # flat buffers of at most BROADCAST_NUMEL elements (a bigger tensor alone)
        chunk: list[torch.Tensor] = []
        for t in members:
            if chunk and sum(c.numel() for c in chunk) + t.numel() > BROADCAST_NUMEL:
                chunks.append(chunk)
                chunk = []
            chunk.append(t)
        chunks.append(chunk)
    for members in chunks:
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=global_src, group=group)
        record("broadcast", (n - 1) * flat.numel() * flat.element_size() if group_rank(group) == src else 0)
        for t, piece in zip(members, flat.split([t.numel() for t in members]), strict=True):
            t.detach().copy_(piece.view(t.shape))


def grid_groups(group: Group, rows: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (row group, column group) of ``group``'s ranks read as a ``rows x N/rows`` grid.

    Ranks in group order fill the grid row by row. Group creation is collective: every
    rank of ``group`` creates every group, in the same order, so all must call this.
    ``N`` must be divisible by ``rows`` (the caller checks, with its own message).
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    width = len(ranks) // rows
    grid = [ranks[i * width : (i + 1) * width] for i in range(rows)]
    me = dist.get_rank()
    row_group = col_group = None
    for members in grid:
        g = dist.new_group(members)
        row_group = g if me in members else row_group
    for members in ([row[j] for row in grid] for j in range(width)):
        g = dist.new_group(members)
        col_group = g if me in members else col_group
    assert row_group is not None and col_group is not None  # this rank is in `group`
    return row_group, col_group


def barrier(group: Group) -> None:
    """Wait until every rank of ``group`` arrives."""
    if group_size(group) > 1:
        dist.barrier(group=group)
