"""Every rank starts from rank 0's values: the broadcast of params and buffers, and the check that they agree.

DDP broadcasts rank 0's params and buffers when it is built, so a script that seeds each
rank differently before building its model (``torch.manual_seed(100 + rank)``, common for
data augmentation) still trains one model. A ZeRO rank cuts its master shards from its own
copy of the params: without the same broadcast each shard would start from its own rank's
initial weights, and the gathered model would be a patchwork. The facade broadcasts at
construction (``init_sync=True``, DDP's default); the functional path does it when asked
(:func:`broadcast_params`, ``shard_params(..., sync=True)``) and otherwise checks, by
default, that the ranks' params agree (:func:`check_values_agree`, in ``shard_params``).

Over a hybrid layout (a shard group and a replicate group) "rank 0" is the first rank of
the whole data-parallel world: the values travel first over the replicate group (from the
rank in the first shard group), then over the shard group (from its first rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn._agreement import RankMismatchError, text_hash
from zerofn.layout import ShardLayout

__all__ = ["broadcast_", "broadcast_params", "check_values_agree", "checksums"]

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

VALUES_DIFFER = (
    "{where}: param {name!r} holds different values on rank 0 and rank {rank} (its checksums differ: {a} vs {b}), "
    "so each rank's shard would start from that rank's own initial weights and the ranks would train a patchwork "
    "of models (DDP broadcasts rank 0's weights when it is built; the stage functions do not unless asked). "
    "Start every rank from rank 0's weights: params = zf.broadcast_params(params, group) (or "
    "zf.broadcast_params(params, group, out=params) to write them into the model) before shard_params, or "
    "shard_params(..., sync=True); or seed the model identically on every rank. check=False skips this check."
)


def broadcast_(tensors: Sequence[torch.Tensor], group: comm.Group, replicate_group: comm.Group = None) -> None:
    """Overwrite ``tensors`` in place with the values of the data-parallel world's first rank.

    Every rank passes tensors of the same shapes and dtypes in the same order (check first:
    a mismatch inside the broadcast fails or hangs). Collectives: one ``broadcast`` per
    (dtype, device) over ``replicate_group`` (if given), then the same over ``group``.
    """
    if replicate_group is not None:
        comm_setup.broadcast_tensors_(list(tensors), replicate_group)
    comm_setup.broadcast_tensors_(list(tensors), group)


def broadcast_params(
    params: Mapping[str, torch.Tensor],
    group: comm.Group = None,
    *,
    replicate_group: comm.Group = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Rank 0's ``params`` on every rank, as DDP makes them when it is built.

    Args:
      params: name -> tensor (params, and buffers if wanted: any dtypes), the same names,
        shapes and dtypes in the same order on every rank. Not changed (unless ``out`` is
        ``params`` itself).
      group: the process group (``None``: default); its rank 0's values win.
      replicate_group: the replicas of a hybrid layout: then the first rank of the whole
        data-parallel world wins (see the module note).
      out: write the values into these tensors in place (e.g. ``out=params`` with
        ``params = dict(model.named_parameters())``, to make the model itself rank 0's);
        default new tensors.

    Returns:
      name -> tensor with rank 0's values (``out``'s tensors when given).

    Raises:
      ValueError: before any collective, when ``out`` does not match ``params``. Ranks
        whose params differ in names, shapes or dtypes are caught by
        :func:`zerofn.check_ranks_agree`-style agreement in one tiny all-gather first.

    Collectives: one tiny all-gather (the names, shapes and dtypes agree), then one
    ``broadcast`` per dtype (per group of a hybrid layout) of all the tensors at once.
    """
    if out is not None:
        for name, p in params.items():
            o = out.get(name)
            if o is None or o.shape != p.shape or o.dtype != p.dtype or o.device != p.device:
                raise ValueError(
                    f"broadcast_params: out[{name!r}] must be a {tuple(p.shape)} {p.dtype} tensor on {p.device}, "
                    f"got {None if o is None else (tuple(o.shape), o.dtype, o.device)}"
                )
        result = {n: out[n] for n in params}
        with torch.no_grad():
            for n, p in params.items():
                if result[n] is not p:
                    result[n].copy_(p)
    else:
        result = {n: p.detach().clone() for n, p in params.items()}
    check_structure_agrees(result, group, "broadcast_params", replicate_group=replicate_group)
    with torch.no_grad():
        broadcast_(list(result.values()), group, replicate_group)
    return result


def structure_hash(tensors: Mapping[str, torch.Tensor]) -> int:
    """A digest of the names, shapes and dtypes of ``tensors`` (what a broadcast needs equal everywhere)."""
    return text_hash("\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in tensors.items()))


def check_structure_agrees(
    tensors: Mapping[str, torch.Tensor], group: comm.Group, where: str, *, replicate_group: comm.Group = None
) -> None:
    """Raise :class:`~zerofn.RankMismatchError` on every rank unless every rank holds the same names/shapes/dtypes.

    Collectives: one all-gather of one int64 per group (and, only on a mismatch, one
    object all-gather of the listings to name the first difference).
    """
    mine = structure_hash(tensors)
    for g in (group, replicate_group) if replicate_group is not None else (group,):
        device = next(iter(tensors.values())).device if tensors else "cpu"
        table = comm.all_gather_ints([mine], g, device=device)
        if bool((table == table[0]).all()):
            continue
        listing = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors.items()]
        everyone = comm_setup.all_gather_objects(listing, g)
        for r, other in enumerate(everyone[1:], start=1):
            if other != everyone[0]:
                width = max(len(other), len(everyone[0]))
                padded = [e + [None] * (width - len(e)) for e in (everyone[0], other)]
                diff = next((a, b) for a, b in zip(*padded, strict=True) if a != b)
                raise RankMismatchError(
                    f"{where}: rank 0 and rank {r} hold different models (rank 0: {diff[0]}, rank {r}: {diff[1]}), "
                    "so rank 0's values cannot be broadcast. Build the same model on every rank"
                )


def checksums(tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """One int64 per tensor: the sum of its elements' bit patterns (equal bits, equal sums).

    Cost: one read of every tensor and a single device-to-host copy at the end. Collectives:
    none.
    """
    sums = []
    for t in tensors.values():
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=flat.device))
            continue
        bits = flat.contiguous().view(_INTS[flat.element_size()]) if flat.is_floating_point() else flat
        sums.append(bits.sum(dtype=torch.int64))
    return [int(v) for v in torch.stack(sums).tolist()] if sums else []


def check_values_agree(layout: ShardLayout, params: Mapping[str, torch.Tensor], group: comm.Group, where: str) -> None:
    """Raise :class:`~zerofn.RankMismatchError` on every rank when the ranks' params hold different values.

    Compares a checksum per param (:func:`checksums`). Ranks whose layouts differ are
    left to the first collective's rank-agreement check, which explains that better.

    Collectives: one all-gather of two int64 values (the layout fingerprint and a digest
    of the checksums); only when they differ, one object all-gather of the checksums to
    name the first param that differs.
    """
    if comm.group_size(group) == 1:
        return
    sums = checksums({n: params[n] for n in layout.names})
    device = next(iter(params.values())).device
    table = comm.all_gather_ints([layout.fingerprint_int, text_hash(repr(sums))], group, device=device)
    if not bool((table[:, 0] == table[0, 0]).all()) or bool((table[:, 1] == table[0, 1]).all()):
        return
    everyone: list = comm_setup.all_gather_objects(sums, group)
    for r, other in enumerate(everyone[1:], start=1):
        for i, name in enumerate(layout.names):
            if other[i] != everyone[0][i]:
                raise RankMismatchError(
                    VALUES_DIFFER.format(where=where, name=name, rank=r, a=everyone[0][i], b=other[i])
                )
