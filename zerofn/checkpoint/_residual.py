"""The compressed wire's residual in checkpoints: per param, per sender, at any world size.

``ZeroState.residual`` is one ``(N - 1, c)`` float32 tensor per bucket (:mod:`zerofn._wire._bucket`):
row ``k`` is what quantization lost of the compressed columns this rank sent to the
``k``-th *other* rank. That is per-rank data tied to the bucket plan, so a checkpoint
stores it per param instead, independent of buckets:

**A sender row.** For a compressed param ``p`` (a split param the wire quantizes) and a
sender rank ``s``, a float32 ``(numel,)`` tensor over ``p``'s flattened elements: the
elements of rank ``j``'s chunk (``ParamSpec.owned_range(j)``) hold ``s``'s residual for
the chunk it sends to ``j``; ``s``'s own chunk is zero (it never travels, and is ignored
on load). Padding is dropped (its residual is always zero: a zero padded gradient plus a
zero residual quantizes exactly).

A checkpoint holds every sender's row, ``(N, numel)`` per param (row ``s``: sender ``s``)
at the world size ``N`` that wrote it, in the loss scale's units (the saved loss-scale
state is restored with it).

**Same world size**: each rank takes back its own row, so the bucket residual is restored
bit for bit, under any ``bucket_numel``.

**Another world size** ``N -> M``: the residual adds to the mean gradient directly (the
rows that carry it are already times ``1/N``: :func:`~zerofn.buckets.pack_grads` scales
before the residual is added), so the next reduced gradient of element ``e`` carries
``R[e] = sum_s r_s[e]`` extra, whatever the world size: no unit change. The rule keeps
that sum: ``R`` is summed over the saved senders in float64 and split evenly over the
``M - 1`` new senders that send ``e`` (every rank but ``e``'s new owner), each getting
``R[e] / (M - 1)`` rounded once to float32. At ``M = 1`` nothing is sent compressed and
the residual is dropped (at most one step's quantization error, never applied).

No collectives here but :func:`gather_rows`' one gather.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from zerofn import _comm as comm
from zerofn._comm import Group
from zerofn._offsets import Bucket, plan_buckets
from zerofn._wire._bucket import init_residual
from zerofn._wire._policy import CompressedWire
from zerofn.checkpoint._errors import CheckpointError
from zerofn.layout import ShardLayout, make_layout
from zerofn.precision import PrecisionPolicy
from zerofn.state import ZeroState

__all__ = [
    "check_bucket_numel",
    "check_saved_rows",
    "compressed_names",
    "feedback_wire",
    "gather_rows",
    "own_or_resharded",
    "residual_from_rows",
    "sender_rows",
    "with_residual",
]


def feedback_wire(precision: PrecisionPolicy | None) -> CompressedWire | None:
    """The policy's compressed wire if it keeps error feedback (a residual), else ``None``."""
    wire = precision.wire if precision is not None else None
    return wire if wire is not None and wire.error_feedback else None


def compressed_names(layout: ShardLayout, wire: CompressedWire | None) -> tuple[str, ...]:
    """The params that carry a residual under ``wire``: split, non-empty, quantized (layout order)."""
    if wire is None or not wire.error_feedback:
        return ()
    return tuple(
        p.name
        for p in layout.params
        if not p.is_whole and p.shard_numel > 0 and wire.compresses(tuple(p.shape), p.numel)
    )


def _members(layout: ShardLayout, bucket: Bucket, wire: CompressedWire) -> Iterator[tuple[str, int, int]]:
    """``(name, first column, width)`` of each compressed member in the bucket's ``(N - 1, c)``
    residual: the column order of :func:`~zerofn._wire._bucket.wire_plan`."""
    at = 0
    for name in bucket.names:
        spec = layout[name]
        if spec.shard_numel == 0 or spec.is_whole or not wire.compresses(tuple(spec.shape), spec.numel):
            continue
        yield name, at, spec.shard_numel
        at += spec.shard_numel


def _others(rank: int, n: int) -> list[int]:
    return [j for j in range(n) if j != rank]


def sender_rows(state: ZeroState) -> dict[str, torch.Tensor]:
    """This rank's sender row of every compressed param: name -> float32 ``(numel,)`` (module
    docstring), on the residual's device; ``{}`` for a state without a residual.

    Raises :class:`CheckpointError` when the residual does not fit the state's buckets (a
    state whose ``bucket_numel`` was replaced after it was built). No collectives.
    """
    wire = feedback_wire(state.precision)
    if not state.residual or wire is None:
        return {}
    layout, rank = state.layout, state.rank
    n = layout.world_size
    buckets = plan_buckets(layout, state.bucket_numel)
    if len(buckets) != len(state.residual):
        raise CheckpointError(
            f"rank {rank}: state.residual has {len(state.residual)} buckets, the state's bucket_numel="
            f"{state.bucket_numel} makes {len(buckets)}: save the state reduce_grads and step_shards returned"
        )
    out: dict[str, torch.Tensor] = {}
    for bucket, res in zip(buckets, state.residual, strict=True):
        for name, at, width in _members(layout, bucket, wire):
            full = res.new_zeros(n, width)
            full[_others(rank, n)] = res[:, at : at + width]
            out[name] = full.view(-1)[: layout[name].numel]
    return out


def residual_from_rows(
    layout: ShardLayout,
    rank: int,
    bucket_numel: int,
    wire: CompressedWire,
    rows: Mapping[str, torch.Tensor],
    device: torch.device | str,
) -> tuple[torch.Tensor, ...]:
    """``ZeroState.residual`` for ``rank`` from its sender rows (name -> ``(numel,)``).

    Compressed params without a row get zeros; rows of params the wire does not compress
    are not used. Each returned bucket is float32 ``(N - 1, c)`` on ``device``. No collectives.
    """
    n = layout.world_size
    residual = init_residual(layout, bucket_numel, wire, device)
    for bucket, res in zip(plan_buckets(layout, bucket_numel), residual, strict=True):
        for name, at, width in _members(layout, bucket, wire):
            row = rows.get(name)
            if row is None:
                continue
            padded = torch.zeros(n * width, dtype=torch.float32, device=device)
            padded[: row.numel()] = row.to(device=device, dtype=torch.float32)
            res[:, at : at + width] = padded.view(n, width)[_others(rank, n)]
    return residual


def own_or_resharded(saved: Mapping[str, torch.Tensor], layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """This rank's sender rows from every saved sender's (name -> ``(N_saved, numel)``).

    At the saved world size, row ``rank`` itself (bitwise). At another ``M``, the module
    docstring's rule: per element, the sum over the saved senders (their own chunks left
    out) in float64, divided by ``M - 1`` and rounded once to float32, on every element
    this rank does not own; ``{}`` at ``M = 1``. No collectives.
    """
    m = layout.world_size
    out: dict[str, torch.Tensor] = {}
    for name, rows in saved.items():
        n_saved = rows.shape[0]
        if n_saved == m:
            out[name] = rows[rank]
            continue
        if m == 1:
            continue
        spec = layout[name]
        old = make_layout({name: spec}, n_saved, placement={name: spec.placement})[name]
        total = rows.to(torch.float64)  # a copy: the senders' own chunks are zeroed in it
        for s in range(n_saved):
            start, stop = old.owned_range(s)
            total[s, start:stop] = 0
        row = (total.sum(0) / (m - 1)).to(torch.float32)
        start, stop = spec.owned_range(rank)
        row[start:stop] = 0
        out[name] = row
    return out


def gather_rows(state: ZeroState, group: Group) -> dict[str, torch.Tensor]:
    """Every rank's sender rows: name -> float32 ``(N, numel)`` CPU tensor (row ``s`` from rank
    ``s``); ``{}`` for a state without a residual.

    Collectives: with a residual, one gather of every rank's rows, concatenated (an
    all-gather, or per-rank broadcasts on gloo); none without (every rank takes the same
    branch: the wire is in the policy every rank agreed on).
    """
    rows = sender_rows(state)
    if not rows:
        return {}
    how = comm.CommPolicy().resolve(group)[1]
    gathered = comm.gather_rows(torch.cat(list(rows.values())), group, how).wait()
    everyone = (gathered if how == "all_gather" else torch.stack(gathered)).cpu()  # broadcasts: N rows apart
    out: dict[str, torch.Tensor] = {}
    at = 0
    for name, row in rows.items():
        out[name] = everyone[:, at : at + row.numel()].clone()
        at += row.numel()
    return out


def check_saved_rows(saved: object, layout: ShardLayout, where: str) -> dict[str, torch.Tensor]:
    """A full state dict's ``"zerofn"["residual"]``, checked: name -> float32 ``(N_saved, numel)``,
    one ``N_saved >= 1`` for all, split params of the model only.

    Raises :class:`CheckpointError` naming the param and the shape. No collectives.
    """
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where}: 'residual' must map param names to tensors, got a {type(saved).__name__}")
    out: dict[str, torch.Tensor] = {}
    senders: int | None = None
    for name, rows in saved.items():
        if name not in layout.names:
            raise CheckpointError(f"{where}: the residual names param {name!r}, which the model does not have")
        spec = layout[name]
        if spec.is_whole:
            raise CheckpointError(f"{where}: param {name!r} has a residual but is placed whole here")
        ok = isinstance(rows, torch.Tensor) and rows.dtype == torch.float32 and rows.dim() == 2
        if not ok or rows.shape[1] != spec.numel or rows.shape[0] < 1:
            got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise CheckpointError(
                f"{where}: the residual of param {name!r} must be float32 (N_saved, {spec.numel}) (one row per "
                f"sender rank over the param's {spec.numel} elements), got {got}"
            )
        if senders is not None and rows.shape[0] != senders:
            raise CheckpointError(
                f"{where}: the residual of param {name!r} has {rows.shape[0]} sender rows, the others {senders}: "
                "every param's residual is written at one world size"
            )
        senders = rows.shape[0]
        out[name] = rows
    return out


def check_bucket_numel(bucket_numel: object, where: str) -> None:
    """A load's ``bucket_numel`` is a positive int, or :class:`CheckpointError` (no collectives)."""
    if not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or bucket_numel <= 0:
        raise CheckpointError(f"{where}: bucket_numel must be a positive int (elements), got {bucket_numel!r}")


def with_residual(state: ZeroState, rows: Mapping[str, torch.Tensor], bucket_numel: int) -> ZeroState:
    """A loaded ``state`` with ``bucket_numel`` and the residual its policy's wire keeps.

    ``rows``: this rank's sender rows (:func:`own_or_resharded`); compressed params without
    one start from zeros. Without a wire that keeps error feedback the rows are dropped
    (the residual is at most one step's quantization error). The residual lives on the
    state's :attr:`~zerofn.ZeroState.work_device`. No collectives.
    """
    wire = feedback_wire(state.precision)
    if wire is None:
        return state.replace(bucket_numel=bucket_numel)
    residual = residual_from_rows(state.layout, state.rank, bucket_numel, wire, rows, state.work_device)
    return state.replace(bucket_numel=bucket_numel, residual=residual)
