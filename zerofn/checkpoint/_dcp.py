"""The sharded checkpoint: every rank writes and reads only its own shards through
``torch.distributed.checkpoint`` (DCP), at any world size.

Each shard is described as the local part of a DTensor over the *unpadded* flattened
parameter with ``Shard(0)`` placement (zerofn's even split is DTensor's chunking rule), so
DCP knows where every element lives and a load at another world size reads just the
overlapping pieces.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from zerofn import _comm as comm
from zerofn import lowbit, optim
from zerofn._comm import Group
from zerofn._deprecation import UNSET, renamed
from zerofn._tree import FrozenDict
from zerofn.checkpoint import _async, _extras
from zerofn.checkpoint._async import PendingCheckpoint
from zerofn.checkpoint._errors import CheckpointError, raise_alike
from zerofn.checkpoint._format import commit, read_meta, write_meta
from zerofn.checkpoint._manifest import Manifest
from zerofn.checkpoint._optimizer import (
    from_per_param,
    is_sharded,
    per_param,
    with_loss_scale,
)
from zerofn.checkpoint._validate import buffer_meta, check_buffers, check_fits, check_placements, layout_and_masters
from zerofn.flat import flatten_state
from zerofn.layout import ParamSpec, ShardLayout
from zerofn.precision import PrecisionPolicy
from zerofn.state import DEFAULT_POLICY, ZeroState

__all__ = ["load", "save"]


def _dtensor(shard: torch.Tensor, spec: ParamSpec, rank: int, mesh: Any, per_block: int | None = None) -> Any:
    """This rank's real (unpadded) part of ``shard`` as a DTensor over the flat param.

    A blocked(B) param is described as its ``(numel / B, B)`` view, split by rows: DTensor's
    ``Shard(0)`` chunking of the blocks is exactly zerofn's whole-block chunks (the flat
    chunking would not be). ``per_block``: the shard holds that many values per block of
    the param instead of ``B`` (a quantized state's codes: ``B`` or ``B / 2``; its scales:
    1, described 1-D as ``(numel / B,)``).
    """
    from torch.distributed.tensor import DTensor, Shard

    start, stop = spec.owned_range(rank)
    if not spec.block:
        return DTensor.from_local(
            shard[: stop - start], mesh, [Shard(0)], run_check=False, shape=torch.Size([spec.numel]), stride=(1,)
        )
    width = spec.block if per_block is None else per_block
    blocks, local = spec.numel // spec.block, (stop - start) // spec.block
    if width == 1:
        return DTensor.from_local(shard[:local], mesh, [Shard(0)], run_check=False, shape=(blocks,), stride=(1,))
    rows = shard.view(-1, width)[:local]
    return DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=(blocks, width), stride=(width, 1))


def _quantized_dtensors(value: torch.Tensor, spec: ParamSpec, rank: int, mesh: Any) -> tuple[Any, Any]:
    """A quantized state shard's codes and block scales as DTensors over the param's blocks."""
    codes, scale = lowbit.parts(value)
    width = int(spec.block * lowbit.codes_per_element(value))
    return _dtensor(codes, spec, rank, mesh, width), _dtensor(scale, spec, rank, mesh, 1)


def _save_whole(
    sd: dict[str, Any], state: ZeroState, spec: ParamSpec, entry: Mapping[str, Any]
) -> tuple[dict[str, str], str]:
    """Put a whole param this rank owns into ``sd`` as plain full tensors (only the owner
    has the keys, so DCP writes them once, from here); returns its state kinds and master dtype.

    Kinds: ``whole:<dtype>:<shape>`` for state tensors (Adafactor's ``row_var`` has its own
    shape), ``scalar:...`` and ``json:...`` as for split params.
    """
    sd[f"master/{spec.name}"] = state.master[spec.name]
    kinds: dict[str, str] = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor):
            sd[f"optim/{spec.name}/{key}"] = value
            dtype = str(value.dtype).removeprefix("torch.")
            if value.dim() == 0:
                kinds[key] = f"scalar:{dtype}:{value.device.type}"
            else:
                kinds[key] = f"whole:{dtype}:{'x'.join(str(d) for d in value.shape)}"
        else:
            kinds[key] = "json:" + json.dumps(value)
    return kinds, str(state.master[spec.name].dtype).removeprefix("torch.")


def _rank_entries(
    state: ZeroState, rank: int, mesh: Any
) -> tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, str]]:
    """What this rank writes: (DCP state dict, per-param state kinds, master dtypes).

    Split params: the master and every per-element state field as DTensor shards over the
    unpadded flat param; scalars as plain tensors (or JSON in the kinds). Whole params:
    written by their owner only, full-shaped.
    """
    layout = state.layout
    entries = per_param(state.opt_state, layout.names)
    sd: dict[str, Any] = {}
    kinds: dict[str, dict[str, str]] = {}
    master_dtypes: dict[str, str] = {}
    for spec in layout.params:
        if spec.is_whole:
            if spec.holds(rank):  # the owner writes the whole param and its state, full-shaped
                kinds[spec.name], master_dtypes[spec.name] = _save_whole(sd, state, spec, entries.get(spec.name, {}))
            continue
        master_dtypes[spec.name] = str(state.master[spec.name].dtype).removeprefix("torch.")
        sd[f"master/{spec.name}"] = _dtensor(state.master[spec.name], spec, rank, mesh)
        kinds[spec.name] = {}
        for key, value in entries.get(spec.name, {}).items():
            if lowbit.is_quantized(value):  # codes and scales in the global block layout
                codes, scale = _quantized_dtensors(value, spec, rank, mesh)
                sd[f"optim/{spec.name}/{key}/codes"], sd[f"optim/{spec.name}/{key}/scale"] = codes, scale
                kinds[spec.name][key] = f"lowbit:{lowbit.kind_of(value)}:{str(value.dtype).removeprefix('torch.')}"
            elif is_sharded(value):
                sd[f"optim/{spec.name}/{key}"] = _dtensor(value, spec, rank, mesh)
                kinds[spec.name][key] = f"shard:{str(value.dtype).removeprefix('torch.')}"
            elif isinstance(value, torch.Tensor):
                sd[f"optim/{spec.name}/{key}"] = value
                kinds[spec.name][key] = f"scalar:{str(value.dtype).removeprefix('torch.')}:{value.device.type}"
            else:
                kinds[spec.name][key] = "json:" + json.dumps(value)
    return sd, kinds, master_dtypes


def save(
    path: str | os.PathLike[str],
    state: ZeroState,
    group: Group = None,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    replicate_group: Group = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
    async_save: bool = False,
    _before_commit: Callable[[], None] | None = None,
) -> str | PendingCheckpoint:
    """Write a sharded, world-size-free checkpoint of ``state`` (and ``params``) to ``path``.

    Each rank writes only its shards (DCP); replicated values (model ``params``, step
    counters) are written once. ``path`` becomes a symlink to the new directory only once
    every file is complete, so an interrupted save never damages the previous checkpoint.

    Args:
      path: where the checkpoint lives (a symlink managed by zerofn).
      state: this rank's ZeroState.
      group: the sharding group; every rank of it must call ``save``.
      params: optional full model weights (name -> tensor) to store alongside.
      buffers: optional model buffers (name -> tensor, any dtype: BatchNorm's running
        stats and counters; :func:`persistent_buffers` lists a module's) to store
        alongside, written once; their names, shapes and dtypes go in the metadata.
      replicate_group: for a hybrid layout, the ranks holding the same shards as this
        one; only the shard group whose members are rank 0 of their replicate groups
        writes, the others wait for the commit. Every rank of the world calls ``save``.
      extra: the training state beside the optimizer's, name -> any object with
        ``state_dict()`` and ``load_state_dict()`` (an LR scheduler, a data loader, a
        counter): each rank saves its objects' ``state_dict()`` as it is at the call, and
        whether it was the same on every rank (see :func:`load` for what restores where).
      rng: save each rank's RNG states too (torch's CPU generator, the CUDA generators when
        the process uses CUDA, Python's ``random``, NumPy's global generator when NumPy is
        imported). With a ``replicate_group``, the writing shard group's extras and RNG
        are saved.
      async_save: return once this rank's tensors are copied into CPU memory (staged),
        and write the files in the background while training goes on; ``zerofn.json``
        and the commit follow when every rank's files are complete
        (:mod:`zerofn.checkpoint._async`). ``extra`` and the RNG are captured at the call
        (deep copies of their ``state_dict()``), as without it. With a
        ``replicate_group``, the replicas' handles complete with the writers' commit.

    Raises:
      CheckpointError: on every rank, before anything is written, when ``path`` is a plain
        directory or any rank's extras cannot be saved (no ``state_dict``, another set of
        keys than the other ranks').

    Returns:
      The committed directory the checkpoint was written to, on every rank (replicas
      included), so ``load(save(path, ...), ...)`` works everywhere. With ``async_save``,
      a :class:`PendingCheckpoint` whose ``wait()`` returns it.

    A save first waits for this group's background save in flight, if any (and raises
    its failure if nobody has seen it).

    Collectives: an object all-gather of each rank's extras keys and digests; a broadcast
    of the directory name, DCP's plan exchange, two barriers (within ``group``); with
    replicas one more broadcast of the committed directory's name over ``replicate_group``.
    With ``async_save``: the all-gather and the broadcast, then one scalar all-reduce
    (the staging verdicts) on a side group over the same ranks
    (:func:`zerofn._comm.side_group`, made by the first background save of ``group``;
    with replicas, one more over ``replicate_group``, on which the writers broadcast the
    directory and the staging verdict) before it returns; the rest in the background on
    the side groups.
    """
    _async.wait_in_flight(group)  # one save at a time per group: the next waits for the one in flight
    if async_save:  # the side groups of the background collectives, made in the same order on every rank
        _async.side_groups(group, replicate_group)
    if replicate_group is not None and comm.group_rank(replicate_group) != 0:
        # A replica: the first shard group writes the same shards; this broadcast returns
        # once the checkpoint is committed, with the directory it went to.
        if async_save:
            return _async.replica(os.path.abspath(os.fspath(path)), group, replicate_group)
        return str(comm.broadcast_object(None, replicate_group))
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        raise CheckpointError(f"{path} is a plain directory; zerofn manages checkpoint paths as symlinks")
    payload = _extras.capture(extra, rng, group, "zerofn.checkpoint.save")
    layout = state.layout
    rank = comm.group_rank(group)
    token = comm.broadcast_object(uuid.uuid4().hex[:12] if rank == 0 else None, group)
    target = f"{path}.{token}"
    sd, kinds, master_dtypes = _rank_entries(state, rank, comm.device_mesh(group, state.state_device.type))
    if params is not None:
        for name, t in params.items():
            sd[f"model/{name}"] = t.detach()
    # Buffers may differ between ranks (each forward updates its own): rank 0's are saved, as DDP's
    # `if rank == 0: torch.save(model.state_dict())` saves them.
    for name, t in (buffers or {}).items() if rank == 0 else ():
        sd[f"buffer/{name}"] = t.detach()
    if layout.has_whole:  # rank 0 writes the metadata: it learns the owners' kinds and dtypes
        owned = {n: (kinds[n], master_dtypes[n]) for n in layout.owners if n in kinds}
        for theirs in comm.all_gather_objects(owned, group):
            for n, (k, d) in theirs.items():  # type: ignore[union-attr]
                kinds[n], master_dtypes[n] = k, d
    if async_save:  # the extras were captured (deep copies) above: written in the background as they were
        extras, same_rng = _extras.manifest_entries(payload)
        model = sorted(params) if params is not None else None
        manifest = Manifest.of(state, kinds, master_dtypes, model, buffer_meta(buffers), extras, same_rng)
        write_extras = None if payload is None else functools.partial(_extras.write, target, rank, payload)
        return _async.save(
            path,
            target,
            sd,
            group,
            manifest.to_json(),
            has_model=params is not None,
            write_extras=write_extras,
            replicate_group=replicate_group,
        )
    if payload is not None:  # before DCP's save, whose last collective tells rank 0 every file is written
        _extras.write(target, rank, payload)
    comm.dcp_save(sd, target, group)
    if rank == 0:
        model = sorted(params) if params is not None else None
        extras, same_rng = _extras.manifest_entries(payload)
        manifest = Manifest.of(state, kinds, master_dtypes, model, buffer_meta(buffers), extras, same_rng)
        write_meta(target, manifest.to_json())
    comm.barrier(group)
    if _before_commit is not None:
        _before_commit()
    if rank == 0:
        commit(path, target)
    comm.barrier(group)
    if replicate_group is not None:
        comm.broadcast_object(target, replicate_group)  # release the replicas: the checkpoint is committed
    return target


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
    policy: Any = UNSET,
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
      policy: the old name of ``precision`` (deprecated, warns).

    Returns:
      This rank's ZeroState at ``comm.group_size(group)`` ranks.

    Raises:
      CheckpointError: on every rank, with nothing changed (the params, buffers, extras
        and RNG are as they were): the files are missing, truncated or corrupt; the
        checkpoint does not fit the model, the optimizer or its placements; ``extra``
        names other keys than the saved ones, or a per-rank extra at another world size;
        reading failed; an extra's ``load_state_dict`` raised on any rank.

    Collectives: one object all-gather of every rank's verdict before reading; DCP's plan
    exchange (each rank reads the pieces its shards overlap); one verdict all-gather after
    reading, and one more after restoring the extras.
    """
    precision = renamed("load", "policy", "precision", policy, precision)
    _async.wait_in_flight(group)  # a save of this group in flight first completes (read what was saved)
    path = os.path.abspath(os.fspath(path))
    # 1-3: read and verify the metadata, say what was saved, check it against the live state.
    # Every rank learns every rank's verdict before DCP's collectives start: a rank that
    # cannot load makes all raise, and nothing has changed anywhere.
    try:
        saved = Manifest.from_json(read_meta(path, verify))
        plan = _plan(saved, path, like, group, optimizer, params_out, buffers_out, extra, rng)
        failure: Exception | None = None
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        failure = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: unreadable metadata ({e!r})")
    raise_alike(failure, (group,), "zerofn.checkpoint.load")
    # 4-5: read the tensors (into new tensors only) and assemble the state.
    state: ZeroState | None = None
    try:
        master, entries, staged, staged_buffers = _read(path, saved, plan, group, params_out, buffers_out)
        state = _assemble(saved, plan, master, entries, precision)
        failure = None
    except CheckpointError as e:
        failure = e
    except Exception as e:  # DCP wraps per-rank failures; say which checkpoint and why
        failure = CheckpointError(f"{path}: reading the shards failed: {e}")
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


class _Plan(NamedTuple):
    """How this rank loads a checkpoint: the layout here and the optimizer to continue with."""

    layout: ShardLayout  # at this group's world size
    optimizer: optim.Optimizer  # with the saved hyperparameters
    rank: int
    device: torch.device  # where the master shards and the state live
    restore: _extras.ToRestore  # the extras' states and the RNG this rank restores


def _plan(
    saved: Manifest,
    path: str,
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group,
    optimizer: optim.Optimizer | None,
    params_out: Mapping[str, torch.Tensor] | None,
    buffers_out: Mapping[str, torch.Tensor] | None,
    extra: Mapping[str, Any] | None,
    rng: bool,
) -> _Plan:
    """Everything :func:`load` checks before reading a tensor, and what it then reads into.

    Raises :class:`CheckpointError` naming what does not fit: another optimizer, another
    model (names, shapes, dtypes), other placements, no weights or other buffers than the
    model's, other extras than the saved ones. Reads this rank's extras file. No collectives.
    """
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
    restore = _extras.read(path, saved.extras, saved.rng, saved.saved_world_size, extra, rng, rank, n)
    return _Plan(layout, fopt, rank, device, restore)


def _read(
    path: str,
    saved: Manifest,
    plan: _Plan,
    group: Group,
    params_out: Mapping[str, torch.Tensor] | None,
    buffers_out: Mapping[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Read this rank's pieces: (masters, per-param state, model weights, buffers), all new tensors.

    The model's weights and buffers are read into new tensors, copied into the caller's only
    once every rank has read and checked everything: a failed load leaves the model as it
    was (the cost: one more copy of the model's weights for the duration of the load).

    Collectives: DCP's plan exchange; each rank reads the pieces its shards overlap.
    """
    mesh = comm.device_mesh(group, plan.device.type)
    sd, master, entries = _receiving_buffers(saved, plan.layout, plan.rank, plan.device, mesh)
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
    comm.dcp_load(sd, path, group)
    for key, value in sd.items():  # scalars may be replaced rather than filled in place
        if key.startswith("optim/") and isinstance(value, torch.Tensor) and value.dim() == 0:
            _, name, field = key.split("/", 2)
            entries[name][field] = value
    return master, entries, staged, staged_buffers


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
    return flatten_state(with_loss_scale(state, saved.loss_scale))  # flat, as shard_params makes it
