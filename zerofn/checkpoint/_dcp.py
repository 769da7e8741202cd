"""The sharded save: every rank writes only its own shards through
``torch.distributed.checkpoint`` (DCP); :mod:`zerofn.checkpoint._load` reads them back at any
world size.

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
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _comm_dcp as comm_dcp
from zerofn import _comm_setup as comm_setup
from zerofn import lowbit
from zerofn._comm import Group
from zerofn.checkpoint import _async, _extras
from zerofn.checkpoint._async import PendingCheckpoint
from zerofn.checkpoint._errors import CheckpointError
from zerofn.checkpoint._format import commit, write_meta
from zerofn.checkpoint._manifest import Manifest
from zerofn.checkpoint._optimizer import is_sharded, per_param
from zerofn.checkpoint._residual import sender_rows
from zerofn.checkpoint._validate import buffer_meta
from zerofn.layout import ParamSpec
from zerofn.state import ZeroState

__all__ = ["save"]


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


def _residual_entries(rows: Mapping[str, torch.Tensor], state: ZeroState, mesh: Any) -> dict[str, Any]:
    """This rank's sender rows (:func:`~zerofn.checkpoint._residual.sender_rows`) as DCP entries
    ``residual/<name>``: row ``rank`` of a float32 ``(N, numel)`` DTensor, ``Shard(0)`` (one row
    per rank), on the master's device (the mesh's; the residual lives with the gradients)."""
    from torch.distributed.tensor import DTensor, Shard

    n, device = state.layout.world_size, state.state_device
    return {
        f"residual/{name}": DTensor.from_local(
            row.to(device).view(1, -1),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=(n, row.numel()),
            stride=(row.numel(), 1),
        )
        for name, row in rows.items()
    }


def _before_commit() -> None:
    """The point of a save where every file is written and ``path`` still names the previous
    checkpoint. Does nothing; a test replaces it to stop a process there."""


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
    safe_globals: Sequence[Any] = (),
) -> str | PendingCheckpoint:
    """Write a sharded, world-size-free checkpoint of ``state`` (and ``params``) to ``path``.

    Each rank writes only its shards (DCP); replicated values (model ``params``, step
    counters) are written once. ``path`` becomes a symlink to the new directory only once
    every file is complete, so an interrupted save never damages the previous checkpoint.

    Args:
      path: where the checkpoint lives (a symlink managed by zerofn).
      state: this rank's ZeroState. With a compressed wire's residual (error feedback),
        each rank writes its residual too, per compressed param: its row of a float32
        ``(N, numel)`` entry ``residual/<name>`` (:mod:`zerofn.checkpoint._residual`).
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
      safe_globals: the classes (and functions) beyond data that the extras'
        ``state_dict()``s may pickle, admitted by name as ``torch.serialization.safe_globals``
        admits them; the globals the files then name are recorded in ``zerofn.json``, and
        a load needs its caller to admit them again. Without it an extra whose
        ``state_dict()`` holds anything but data (tensors, numbers, strings, bools, ``None``,
        dicts, lists, tuples, sets, dtypes, devices) is refused.

    Raises:
      CheckpointError: on every rank, before anything is written, when ``path`` is a plain
        directory or any rank's extras cannot be saved (no ``state_dict``, another set of
        keys than the other ranks', a ``state_dict()`` that is not data and that
        ``safe_globals`` does not admit: the message names the extra, the key path and the type).

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
    (:func:`zerofn._comm_dcp.side_group`, made by the first background save of ``group``;
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
        return str(comm_setup.broadcast_object(None, replicate_group))
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        raise CheckpointError(f"{path} is a plain directory; zerofn manages checkpoint paths as symlinks")
    rows = sender_rows(state)  # before any collective: a residual that does not fit raises here
    payload = _extras.capture(extra, rng, group, "zerofn.checkpoint.save", safe_globals)
    layout = state.layout
    rank = comm.group_rank(group)
    token = comm_setup.broadcast_object(uuid.uuid4().hex[:12] if rank == 0 else None, group)
    target = f"{path}.{token}"
    mesh = comm_dcp.device_mesh(group, state.state_device.type)
    sd, kinds, master_dtypes = _rank_entries(state, rank, mesh)
    sd.update(_residual_entries(rows, state, mesh))
    if params is not None:
        for name, t in params.items():
            sd[f"model/{name}"] = t.detach()
    # Buffers may differ between ranks (each forward updates its own): rank 0's are saved, as DDP's
    # `if rank == 0: torch.save(model.state_dict())` saves them.
    for name, t in (buffers or {}).items() if rank == 0 else ():
        sd[f"buffer/{name}"] = t.detach()
    if layout.has_whole:  # rank 0 writes the metadata: it learns the owners' kinds and dtypes
        owned = {n: (kinds[n], master_dtypes[n]) for n in layout.owners if n in kinds}
        for theirs in comm_setup.all_gather_objects(owned, group):
            for n, (k, d) in theirs.items():  # type: ignore[union-attr]
                kinds[n], master_dtypes[n] = k, d
    if async_save:  # the extras were captured (deep copies) above: written in the background as they were
        model = sorted(params) if params is not None else None
        entries = _extras.manifest_entries(payload)
        manifest = Manifest.of(
            state, kinds, master_dtypes, model, buffer_meta(buffers), **entries, residual=tuple(rows)
        )
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
    comm_dcp.dcp_save(sd, target, group)
    if rank == 0:
        model = sorted(params) if params is not None else None
        entries = _extras.manifest_entries(payload)
        manifest = Manifest.of(
            state, kinds, master_dtypes, model, buffer_meta(buffers), **entries, residual=tuple(rows)
        )
        write_meta(target, manifest.to_json())
    comm_setup.barrier(group)
    _before_commit()
    if rank == 0:
        commit(path, target)
    comm_setup.barrier(group)
    if replicate_group is not None:
        comm_setup.broadcast_object(target, replicate_group)  # release the replicas: the checkpoint is committed
    return target
