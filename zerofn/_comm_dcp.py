"""The checkpoints' calls of ``torch.distributed.checkpoint``: blocking and background saves,
loads, the device mesh their DTensors live on, and the side groups a background write
uses so that its collectives never pair with the training loop's."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerofn._comm import Group

__all__ = ["dcp_async_save", "dcp_load", "dcp_save", "device_mesh", "group_key", "side_group"]


def device_mesh(group: Group, device_type: str) -> Any:
    """A 1-D ``DeviceMesh`` over ``group``, so shards can be described as DTensors."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)


def dcp_save(state_dict: dict[str, Any], path: str, group: Group) -> None:
    """``torch.distributed.checkpoint.save`` over ``group``: each rank writes its own shards.

    Collectives: DCP's plan gather/scatter and a final barrier, all inside ``group``.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, checkpoint_id=path, process_group=group)


def dcp_async_save(staged: dict[str, Any], path: str, side: dist.ProcessGroup) -> Any:
    """``torch.distributed.checkpoint.async_save`` of an already staged (CPU) state dict.

    Returns DCP's future of the write. The write runs in DCP's thread; its collectives
    (plan gather/scatter, the final gather of the write results) run on ``side``, which
    must be a gloo group no other thread uses meanwhile (:func:`side_group`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    class _AlreadyStaged:  # DCP's AsyncStager protocol: the caller staged (copied) the tensors
        _synchronize_after_execute = False
        should_synchronize_after_execute = False

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return dcp.async_save(
        staged,
        checkpoint_id=path,
        process_group=side,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        async_stager=_AlreadyStaged(),  # type: ignore[arg-type]
    )


def group_key(group: Group) -> tuple[int, int]:
    """A hashable key for ``group`` (``None``: the default group) in this world."""
    pg = group if group is not None else dist.group.WORLD
    return (id(pg), id(dist.group.WORLD))


# group key -> (the group, the world it belongs to, its side group): the objects are kept so
# that their ids (in the key) cannot be reused while the entry lives.
_SIDE_GROUPS: dict[tuple[int, int], tuple[Any, Any, dist.ProcessGroup]] = {}


def side_group(group: Group) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks for collectives issued from a background thread.

    gloo matches collectives by their order within a group: a background thread and the
    training loop issuing collectives on one group would pair the wrong ones (a hang or
    mixed data). Background checkpoint writes use this group instead, which nothing else
    uses. Created at the first call for ``group`` by ``group``'s members only
    (``use_local_synchronization``): every member must make that first call at the same
    point, as a collective (a save is one). Later calls return the same group.
    """
    pg = group if group is not None else dist.group.WORLD
    key = group_key(group)
    hit = _SIDE_GROUPS.get(key)
    if hit is not None and hit[0] is pg and hit[1] is dist.group.WORLD:
        return hit[2]
    ranks = dist.get_process_group_ranks(pg)
    side = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    _SIDE_GROUPS[key] = (pg, dist.group.WORLD, side)
    return side


def dcp_load(state_dict: dict[str, Any], group: Group, *, storage_reader: Any, planner: Any) -> None:
    """``torch.distributed.checkpoint.load`` into ``state_dict``'s tensors, in place, with the
    caller's reader (which knows the directory) and planner.

    Collectives: DCP's plan gather/scatter and its gather of the read results, in ``group``.
    """
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=storage_reader, planner=planner, process_group=group)
