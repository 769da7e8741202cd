"""Gathering a sharded state whole, on every rank, for the torch-format full state dict.

Split params' shards come back param-shaped through the bucketed gathers; low-bit state
in torchao's own tensor types; whole params from their owners.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn import lowbit
from zerofn._comm import Group
from zerofn._offsets import plan_buckets
from zerofn.buckets import launch_gather, pack_shards, unpack_rows
from zerofn.layout import ShardLayout
from zerofn.state import ZeroState

__all__ = ["cpu_copy", "gather_full", "gather_quantized", "gather_whole"]


def gather_full(
    shards: Mapping[str, torch.Tensor], layout: ShardLayout, group: Group, bucket_numel: int
) -> dict[str, torch.Tensor]:
    """Full, param-shaped CPU tensors (in the shards' dtypes) from every rank's shards.

    Collectives: per bucket one all-gather (or per-rank broadcasts on gloo) of the rows.
    """
    how = comm.CommPolicy().resolve(group)[1]
    out: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(layout, bucket_numel, shards):
        # Shards of mixed dtypes (e.g. bf16 + fp32) are promoted exactly in the row; each
        # full tensor gets its shard's dtype back.
        row = pack_shards(shards, layout, bucket)
        rows = launch_gather(row, group, how).wait()
        fulls = {n: torch.empty(layout[n].shape, dtype=shards[n].dtype, device=row.device) for n in bucket.names}
        unpack_rows(rows, layout, bucket, fulls)
        out.update({n: t.cpu() for n, t in fulls.items()})
    for name, shard in shards.items():
        if name not in out:  # empty params
            out[name] = torch.empty(layout[name].shape, dtype=shard.dtype)
    return out


def gather_quantized(
    entries: Mapping[str, Mapping[str, Any]], layout: ShardLayout, group: Group
) -> dict[tuple[str, str], torch.Tensor]:
    """The low-bit state of every blocked(B) param, param-shaped, in torchao's own state tensor
    types, on every rank: the ranks' codes and block scales joined in block order (the global
    layout: block ``k`` of the param is elements ``[k * B, (k + 1) * B)`` at every N).

    Collectives: one object all-gather over ``group`` when the layout has blocked params
    (static: every rank takes the same branch).
    """
    if not any(p.block for p in layout.params):
        return {}
    # Codes travel as their bytes (uint8): torch's pickling of float8 tensors fails on load.
    mine = {
        (n, k): (lowbit.parts(v)[0].detach().cpu().view(torch.uint8).clone(), lowbit.parts(v)[1].detach().cpu().clone())
        for n, e in entries.items()
        if layout[n].block
        for k, v in e.items()
        if lowbit.is_quantized(v)
    }
    everyone = comm_setup.all_gather_objects(mine, group)
    out = {}
    for n, k in mine:
        dtype = entries[n][k].codes.dtype
        pieces = [(theirs[n, k][0].view(dtype), theirs[n, k][1]) for theirs in everyone]  # type: ignore[index]
        out[n, k] = lowbit.to_global(entries[n][k], pieces, layout[n]).to("cpu")
    return out


def cpu_copy(v: Any) -> Any:
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def gather_whole(
    state: ZeroState, entries: Mapping[str, Mapping[str, Any]], group: Group
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Every whole param's master and optimizer state, from its owner, on every rank (CPU copies).

    Collectives: one object all-gather over ``group`` (each rank sends what it owns).
    """
    mine = {
        s.name: (
            state.master[s.name].detach().cpu().clone(),
            {k: cpu_copy(v) for k, v in entries.get(s.name, {}).items()},
        )
        for s in state.layout.params
        if s.is_whole and s.holds(state.rank)
    }
    masters: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    for theirs in comm_setup.all_gather_objects(mine, group):
        for name, (master, entry) in theirs.items():  # type: ignore[union-attr]
            masters[name] = master
            if entry:
                states[name] = entry
    return masters, states
