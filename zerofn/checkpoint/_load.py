"""The sharded load: a checkpoint written by :func:`zerofn.checkpoint.save` at any world size,
read into this group's shards as one pipeline: read and verify the metadata, say what was
saved (the manifest), check it against the live state, read the tensors, assemble.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from zerofn import _comm as comm
from zerofn import _comm_dcp as comm_dcp
from zerofn import lowbit, optim
from zerofn._comm import Group
from zerofn._tree import FrozenDict
from zerofn.checkpoint import _async, _extras
from zerofn.checkpoint._dcp import _dtensor, _quantized_dtensors
from zerofn.checkpoint._errors import CheckpointError, raise_alike
from zerofn.checkpoint._format import read_meta
from zerofn.checkpoint._manifest import Manifest
from zerofn.checkpoint._optimizer import from_per_param, with_loss_scale
from zerofn.checkpoint._residual import (
    check_bucket_numel,
    compressed_names,
    feedback_wire,
    own_or_resharded,
    with_residual,
)
from zerofn.checkpoint._validate import check_buffers, check_fits, check_placements, layout_and_masters
from zerofn.layout import DEFAULT_BUCKET_NUMEL, ParamSpec, ShardLayout
from zerofn.precision import PrecisionPolicy
from zerofn.state import DEFAULT_POLICY, ZeroState

__all__ = ["load"]


def _load_whole(
    sd: dict[str, Any],
    master: dict[str, torch.Tensor],
    spec: ParamSpec,
    kinds: Mapping[str, str],
    master_dtypes: Mapping[str, str],
    device: torch.device,
) -> dict[str, Any]:
    """Ask DCP for a whole param this rank owns (full-shaped master and state); returns its entries."""
    master[spec.name] = torch.zeros(spec.shape, dtype=getattr(torch, master_dtypes[spec.name]), device=device)
    sd[f"master/{spec.name}"] = master[spec.name]
    entry: dict[str, Any] = {}
    for key, kind in kinds.items():
        what, _, rest = kind.partition(":")
        if what == "whole":
            dtype, _, dims = rest.partition(":")
            shape = tuple(int(d) for d in dims.split("x"))
            value: Any = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
            sd[f"optim/{spec.name}/{key}"] = value
        elif what == "scalar":
            value = _scalar_receiver(rest, device)
            sd[f"optim/{spec.name}/{key}"] = value
        else:
            value = json.loads(rest)
        entry[key] = value
    return entry


def _scalar_receiver(kind_rest: str, device: torch.device) -> torch.Tensor:
    """The 0-d tensor a saved ``scalar:<dtype>:<device>`` state entry is read into (on the CPU if saved there)."""
    dtype, _, dev = kind_rest.partition(":")
    return torch.zeros((), dtype=getattr(torch, dtype), device=device if dev != "cpu" else "cpu")


def _receiving_buffers(
    saved: Manifest, layout: ShardLayout, rank: int, device: torch.device, mesh: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The tensors DCP reads this rank's pieces into: (DCP state dict, masters, per-param state).

    Split params: zero ``(shard_numel,)`` masters and per-element state as DTensor shards
    over the unpadded flat param, 0-d scalars, JSON values decoded here. Whole params: on
    their owner only, full-shaped.
    """
    sd: dict[str, Any] = {}
    master: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    for spec in layout.params:
        if spec.is_whole:
            if spec.holds(rank):
                entries[spec.name] = _load_whole(
                    sd, master, spec, saved.state_kinds[spec.name], saved.master_dtypes, device
                )
            continue
        master[spec.name] = torch.zeros(
            spec.shard_numel, dtype=getattr(torch, saved.master_dtypes[spec.name]), device=device
        )
        sd[f"master/{spec.name}"] = _dtensor(master[spec.name], spec, rank, mesh)
        entries[spec.name] = {}
        for key, kind in saved.state_kinds[spec.name].items():
            what, _, rest = kind.partition(":")
            if what == "lowbit":
                kind, _, dtype = rest.rpartition(":")
                value = lowbit.state_zeros(kind, spec.shard_numel, spec.block, getattr(torch, dtype), device)
                codes, scale = _quantized_dtensors(value, spec, rank, mesh)
                sd[f"optim/{spec.name}/{key}/codes"], sd[f"optim/{spec.name}/{key}/scale"] = codes, scale
            elif what == "shard":
                value = torch.zeros(spec.shard_numel, dtype=getattr(torch, rest), device=device)
                sd[f"optim/{spec.name}/{key}"] = _dtensor(value, spec, rank, mesh)
            elif what == "scalar":
                value = _scalar_receiver(rest, device)
                sd[f"optim/{spec.name}/{key}"] = value
            else:
                value = json.loads(rest)
            entries[spec.name][key] = value
    return sd, master, entries


def load(
    path: str | os.PathLike[str],
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group = None,
    *,
    optimizer: optim.Optimizer | None = None,
    params_out: Mapping[str, torch.Tensor] | None = None,
    buffers_out: Mapping[str, torch.Tensor] | None = None,
    verify: bool = True,
    precision: PrecisionPolicy | None = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
    safe_globals: Sequence[Any] = (),
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> ZeroState:
    """Read a checkpoint written by :func:`save` at any world size into this group's shards.

    Args:
      path: the checkpoint path given to ``save``.
      like: the model's params (name -> tensor) or a layout: what the checkpoint must fit.
      group: the sharding group (any size); every rank of it must call ``load``.
      optimizer: the functional optimizer to continue with (default: the saved kind);
        the saved hyperparameters are applied to it.
      params_out: model tensors to fill in place with the saved weights (if saved).
      buffers_out: model buffers to fill in place with the saved ones: their names,
        shapes and dtypes must be the saved ones (checked with everything else, before
        anything changes). A checkpoint saved without buffers leaves them as they are.
      verify: check every file's SHA-256 (sizes and presence are always checked).
      precision: the precision policy to continue with; the saved loss-scale state is restored.
      extra: the objects to restore the saved extras into (name -> object with
        ``load_state_dict``), exactly the names saved; ``None`` restores none of them. At
        the saved world size each rank gets its own rank's; at another, an extra that was
        the same on every rank when saved restores on every rank, one that differed is a
        ``CheckpointError``.
      rng: restore this rank's RNG states, if saved: at the saved world size each rank's
        own; at another world size only if they were the same on every rank (else every
        rank keeps the generators it has, as at a fresh start).
      safe_globals: the classes (and functions) beyond data that the saved extras may
        unpickle, admitted by name as ``torch.serialization.safe_globals`` admits them. A
        checkpoint whose ``zerofn.json`` says its extras pickle some (saved with
        ``safe_globals=``) loads its extras only when this covers them all; the record
        itself admits nothing. Pass it only for a checkpoint whose author you trust.
      bucket_numel: the loaded state's ``bucket_numel`` (its buckets' size, which a
        compressed wire's residual follows): what ``shard_params`` was given for the run
        that continues. The saved bucket size does not matter.

    With ``precision.wire`` keeping error feedback, the saved residual is restored: at the
    saved world size each rank's own, bitwise; at another, every saved sender's sum split
    evenly over the new senders, which keeps the next reduced gradient's expectation
    (:mod:`zerofn.checkpoint._residual`); zeros for a checkpoint saved without one. Without
    such a wire a saved residual is dropped (at most one step's quantization error).

    Every file is read as data, never as code: DCP's metadata through an allowlist of its
    own types, the shards and the extras with ``torch.load(weights_only=True)`` (see
    :mod:`zerofn.checkpoint._reader`, the trust model in the checkpoints guide).

    Returns:
      This rank's ZeroState at ``comm.group_size(group)`` ranks.

    Raises:
      CheckpointError: on every rank, with nothing changed (the params, buffers, extras
        and RNG are as they were): the files are missing, truncated or corrupt; the
        checkpoint does not fit the model, the optimizer or its placements; ``extra``
        names other keys than the saved ones, or a per-rank extra at another world size;
        reading failed; an extra's ``load_state_dict`` raised on any rank; a file names
        a global that is not data (the message names the file and the global), before
        anything it names has run. A ``bucket_numel`` that is not a positive int.

    Collectives: one object all-gather of every rank's verdict before reading; DCP's plan
    exchange (each rank reads the pieces its shards overlap); one verdict all-gather after
    reading, and one more after restoring the extras.
    """
    _async.wait_in_flight(group)  # a save of this group in flight first completes (read what was saved)
    path = os.path.abspath(os.fspath(path))
    # 1-3: read and verify the metadata, say what was saved, check it against the live state.
    # Every rank learns every rank's verdict before DCP's collectives start: a rank that
    # cannot load makes all raise, and nothing has changed anywhere.
    try:
        meta = read_meta(path, verify)
        saved = Manifest.from_json(meta)
        plan = _plan(
            saved,
            path,
            meta["files"],
            like,
            group,
            optimizer,
            params_out,
            buffers_out,
            extra,
            rng,
            safe_globals,
            precision,
            bucket_numel,
        )
        failure: Exception | None = None
    except (CheckpointError, AttributeError, KeyError, TypeError, ValueError) as e:
        failure = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: unreadable metadata ({e!r})")
    raise_alike(failure, (group,), "zerofn.checkpoint.load")
    # 4-5: read the tensors (into new tensors only) and assemble the state.
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's, a BaseException

    state: ZeroState | None = None
    try:
        master, entries, staged, staged_buffers, rows = _read(path, saved, plan, group, params_out, buffers_out)
        state = with_residual(_assemble(saved, plan, master, entries, precision), rows, plan.bucket_numel)
        failure = None
    except CheckpointError as e:
        failure = e
    except CheckpointException as e:  # DCP's report of every rank's failures, the same on every rank
        failure = dcp_failure(path, e)
    except Exception as e:
        failure = CheckpointError(f"{path}: reading the shards failed: {type(e).__name__}: {e}")
        failure.__cause__ = e
    raise_alike(failure, (group,), "zerofn.checkpoint.load")
    assert state is not None
    # Only now, with every rank's state built, the caller's objects change: the extras first
    # (all or nothing across the group), then the RNG and the model's tensors.
    _extras.apply(plan.restore, extra, group, "zerofn.checkpoint.load")
    if staged:
        with torch.no_grad():  # params_out may be leaf params that require grad
            for name, value in staged.items():
                params_out[name].copy_(value)  # type: ignore[index]
    for name, value in staged_buffers.items():
        buffers_out[name].detach().copy_(value)  # type: ignore[index]
    return state


def dcp_failure(path: str, error: BaseException) -> CheckpointError:
    """DCP's ``CheckpointException`` (every rank's failures, gathered by DCP) as one
    :class:`CheckpointError`, the same text on every rank: the first failing rank's error.

    A ``KeyboardInterrupt`` or ``SystemExit`` never gets here: only DCP's exception is caught.
    """
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return CheckpointError(f"{path}: reading the shards failed: {error}")
    rank = min(failures)
    first = failures[rank][0]
    if isinstance(first, CheckpointError):
        failure = CheckpointError(f"{path}: rank {rank}: {first}")
    else:
        failure = CheckpointError(f"{path}: reading the shards failed on rank {rank}: {type(first).__name__}: {first}")
    failure.__cause__ = first
    return failure


class _Plan(NamedTuple):
    """How this rank loads a checkpoint: the layout here and the optimizer to continue with."""

    layout: ShardLayout  # at this group's world size
    optimizer: optim.Optimizer  # with the saved hyperparameters
    rank: int
    device: torch.device  # where the master shards and the state live
    restore: _extras.ToRestore  # the extras' states and the RNG this rank restores
    metadata: Any  # DCP's Metadata, read as data and checked (zerofn.checkpoint._reader)
    residual: tuple[str, ...]  # the saved residuals the policy's wire keeps, read and kept
    bucket_numel: int  # the loaded state's, which its residual's buckets follow


def _plan(
    saved: Manifest,
    path: str,
    files: Mapping[str, Any],
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group,
    optimizer: optim.Optimizer | None,
    params_out: Mapping[str, torch.Tensor] | None,
    buffers_out: Mapping[str, torch.Tensor] | None,
    extra: Mapping[str, Any] | None,
    rng: bool,
    safe_globals: Sequence[Any],
    precision: PrecisionPolicy | None,
    bucket_numel: int,
) -> _Plan:
    """Everything :func:`load` checks before reading a tensor, and what it then reads into.

    Raises :class:`CheckpointError` naming what does not fit: another optimizer, another
    model (names, shapes, dtypes), other placements, no weights or other buffers than the
    model's, other extras than the saved ones, DCP metadata that is not data or names files
    that ``files`` (``zerofn.json``'s list) does not. Reads DCP's metadata and this rank's
    extras file, both as data. No collectives.
    """
    from zerofn.checkpoint._reader import read_dcp_metadata  # imports DCP: only when loading

    metadata = read_dcp_metadata(path, files)
    # The model and its placements first (the plainest causes), then the optimizer's kind and groups.
    layout, _ = layout_and_masters(like, group, torch.float32, optimizer or saved.saved_kind())
    check_fits(saved.params_meta(), layout)
    check_placements(saved.placements, layout)
    if params_out is not None and saved.model is None:
        raise CheckpointError(f"{path} holds no model weights (saved without params=)")
    if buffers_out is not None:
        check_buffers(saved.buffers, buffers_out, path)
    fopt = saved.saved_optimizer(optimizer)
    device = next(iter(like.values())).device if isinstance(like, Mapping) else torch.device("cpu")
    rank, n = comm.group_rank(group), comm.group_size(group)
    restore = _extras.read(path, saved, files, extra, rng, rank, n, safe_globals)
    check_bucket_numel(bucket_numel, "zerofn.checkpoint.load")
    unknown = sorted(set(saved.residual or ()) - set(layout.names))
    if unknown:
        raise CheckpointError(f"{path}: zerofn.json lists a residual of {unknown[0]!r}, which the model does not have")
    kept = set(saved.residual or ()) & set(compressed_names(layout, feedback_wire(precision)))
    residual = tuple(n for n in layout.names if n in kept)
    return _Plan(layout, fopt, rank, device, restore, metadata, residual, bucket_numel)


def _read(
    path: str,
    saved: Manifest,
    plan: _Plan,
    group: Group,
    params_out: Mapping[str, torch.Tensor] | None,
    buffers_out: Mapping[str, torch.Tensor] | None,
) -> tuple[
    dict[str, torch.Tensor],
    dict[str, dict[str, Any]],
    dict[str, torch.Tensor],
    dict[str, torch.Tensor],
    dict[str, torch.Tensor],
]:
    """Read this rank's pieces: (masters, per-param state, model weights, buffers, residual
    sender rows), all new tensors.

    The model's weights and buffers are read into new tensors, copied into the caller's only
    once every rank has read and checked everything: a failed load leaves the model as it
    was (the cost: one more copy of the model's weights for the duration of the load).

    Collectives: DCP's plan exchange; each rank reads the pieces its shards overlap.
    """
    mesh = comm_dcp.device_mesh(group, plan.device.type)
    sd, master, entries = _receiving_buffers(saved, plan.layout, plan.rank, plan.device, mesh)
    residual = _residual_receivers(sd, saved, plan, mesh)
    staged: dict[str, torch.Tensor] = {}
    if params_out is not None:
        for name in saved.model or ():
            staged[name] = torch.empty_like(params_out[name].detach())
            sd[f"model/{name}"] = staged[name]
    staged_buffers: dict[str, torch.Tensor] = {}
    if buffers_out is not None and saved.buffers is not None:
        for name in saved.buffers:
            staged_buffers[name] = torch.empty_like(buffers_out[name].detach())
            sd[f"buffer/{name}"] = staged_buffers[name]
    from zerofn.checkpoint._reader import DataPlanner, DataReader

    comm_dcp.dcp_load(sd, group, storage_reader=DataReader(path, plan.metadata), planner=DataPlanner())
    for key, value in sd.items():  # scalars may be replaced rather than filled in place
        if key.startswith("optim/") and isinstance(value, torch.Tensor) and value.dim() == 0:
            _, name, field = key.split("/", 2)
            entries[name][field] = value
    if saved.saved_world_size == plan.layout.world_size:
        rows = {name: local[0] for name, local in residual.items()}
    else:
        rows = own_or_resharded(residual, plan.layout, plan.rank)
    return master, entries, staged, staged_buffers, rows


def _residual_receivers(sd: dict[str, Any], saved: Manifest, plan: _Plan, mesh: Any) -> dict[str, torch.Tensor]:
    """The tensors the saved residuals of ``plan.residual`` are read into, also put in ``sd``.

    At the saved world size this rank's own row only: a ``(1, numel)`` local part of the
    ``(N, numel)`` entry (a DTensor, ``Shard(0)``). At another, every saved sender's rows,
    ``(N_saved, numel)``, which the N -> M rule sums (4 N_saved bytes per element of the
    compressed params, for the length of the load).
    """
    from torch.distributed.tensor import DTensor, Shard

    same = saved.saved_world_size == plan.layout.world_size
    out: dict[str, torch.Tensor] = {}
    for name in plan.residual:
        numel = plan.layout[name].numel
        if same:
            out[name] = torch.zeros(1, numel, dtype=torch.float32, device=plan.device)
            sd[f"residual/{name}"] = DTensor.from_local(
                out[name], mesh, [Shard(0)], run_check=False, shape=(saved.saved_world_size, numel), stride=(numel, 1)
            )
        else:
            out[name] = torch.zeros(saved.saved_world_size, numel, dtype=torch.float32, device=plan.device)
            sd[f"residual/{name}"] = out[name]
    return out


def _assemble(
    saved: Manifest,
    plan: _Plan,
    master: Mapping[str, torch.Tensor],
    entries: Mapping[str, dict[str, Any]],
    precision: PrecisionPolicy | None,
) -> ZeroState:
    """This rank's ZeroState from what it read: the optimizer state built once, the saved
    step and loss-scale state."""
    master_fd = FrozenDict(master)
    opt_state = from_per_param(plan.optimizer, master_fd, {n: e for n, e in entries.items() if e}, plan.layout)
    state = ZeroState(
        plan.layout, plan.optimizer, plan.rank, master_fd, opt_state, saved.step, precision=precision or DEFAULT_POLICY
    )
    return with_loss_scale(state, saved.loss_scale)  # (ZeroState packs the per-name shards flat)
