"""Checkpoints: torch-format state dicts, sharded DCP saves, and resharding N -> M.

Two formats, both world-size free:

**Full state dict** (:func:`full_state_dict` / :func:`shard_state_dict`): exactly what
``torch.optim.Optimizer.state_dict()`` returns — ``{"state": {index: {...}},
"param_groups": [...]}`` with unpadded, param-shaped CPU tensors — plus one ``"zerofn"``
entry for what torch has no slot for: names, shapes and dtypes of the params, the fp32
master weights, the completed step count and the loss-scale state. A plain
``torch.optim.AdamW`` loads it (and ignores the extra entry), and zerofn loads a plain
torch state dict back at any world size. Every rank gathers the whole state: use it for
small models, interop and tests.

**Sharded checkpoint** (:func:`save` / :func:`load`): every rank writes only its own
shards through ``torch.distributed.checkpoint`` (DCP). Each shard is described as the
local part of a DTensor over the *unpadded* flattened parameter with ``Shard(0)``
placement — zerofn's even split is exactly DTensor's chunking rule — so DCP knows where
every element lives and a load at another world size reads just the overlapping pieces.
Model weights (replicated, written once) can go in the same checkpoint, so resume is
one call.

Nothing is lost: a save writes a new directory ``<path>.<token>/`` (files fsynced), records
each file's size and SHA-256 in ``zerofn.json``, and only then atomically repoints the
symlink ``<path>`` at it (``os.replace``) and removes the previous target. A process killed
at any moment leaves ``<path>`` pointing at the last complete checkpoint. A load checks
sizes and hashes, the rank files and the model's names, shapes and dtypes before reading
any tensor, and raises :class:`CheckpointError` naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _state_dict_checks, lowbit, optim, torch_optim
from zerofn._comm import Group
from zerofn._deprecation import UNSET, renamed
from zerofn._tree import FrozenDict
from zerofn.buckets import cut_shard, launch_gather, pack_shards, unpack_rows
from zerofn.layout import ParamSpec, ShardLayout, make_layout
from zerofn.precision import PrecisionPolicy
from zerofn.stages import DEFAULT_BUCKET_NUMEL
from zerofn.state import DEFAULT_POLICY, ZeroState

__all__ = [
    "CheckpointError",
    "check_buffers",
    "full_state_dict",
    "load",
    "persistent_buffers",
    "raise_alike",
    "save",
    "shard_state_dict",
]

FORMAT_VERSION = 1
META_FILE = "zerofn.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model."""


def raise_alike(failure: Exception | None, groups: tuple[Group, ...], where: str) -> None:
    """Every rank learns every rank's verdict; if any rank failed, every rank raises.

    This rank raises its own error; the others a :class:`CheckpointError` naming the rank
    that failed and why. Called before anything has changed, so no rank has.

    Collectives: one object all-gather (``None`` or the error text) per group of size > 1.
    """
    for group in groups:
        if comm.group_size(group) == 1:
            continue
        everyone = comm.all_gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", group)
        if failure is not None:
            raise failure
        bad = next(((r, why) for r, why in enumerate(everyone) if why is not None), None)
        if bad is not None:
            raise CheckpointError(
                f"{where}: rank {bad[0]} of the group could not load it ({bad[1]}), so no rank did; every rank "
                "must load the same checkpoint"
            )
    if failure is not None:
        raise failure


# --------------------------------------------------------------------------- per-param view


def _per_param(opt_state: Any, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """An optimizer state as torch keeps it: name -> {key: value}, params without state omitted."""
    out: dict[str, dict[str, Any]] = {}
    if isinstance(opt_state, optim.PartitionState):
        for sub in opt_state.states:
            out.update(_per_param(sub, names))
        return {n: out[n] for n in names if n in out}
    # A rank keeps state only for what it holds: whole params of other ranks are absent.
    if isinstance(opt_state, (optim.AdamState, lowbit.LowBitState)):
        for n in names:
            if n not in opt_state.step or int(opt_state.step[n]) == 0:
                continue  # torch creates Adam state lazily, at a param's first step
            entry = {"step": opt_state.step[n], "exp_avg": opt_state.exp_avg[n], "exp_avg_sq": opt_state.exp_avg_sq[n]}
            if n in opt_state.max_exp_avg_sq:
                entry["max_exp_avg_sq"] = opt_state.max_exp_avg_sq[n]
            out[n] = entry
    elif isinstance(opt_state, optim.SGDState):
        for n in names:
            if opt_state.momentum_buffer.get(n) is not None:
                out[n] = {"momentum_buffer": opt_state.momentum_buffer[n]}
    elif isinstance(opt_state, torch_optim.TorchOptimState):
        for n in names:
            if len(opt_state.per_param.get(n, ())):
                out[n] = dict(opt_state.per_param[n])
    else:
        raise TypeError(f"zerofn.checkpoint: unknown optimizer state type {type(opt_state).__name__}")
    return out


def _from_per_param(
    optimizer: optim.Optimizer,
    master: Mapping[str, torch.Tensor],
    entries: Mapping[str, dict],
    layout: ShardLayout | None = None,
) -> Any:
    """The optimizer state for ``master`` shards (of ``layout``) with torch-style ``entries`` filled in."""
    if optimizer.parts:  # a partition: each part's state over its own names
        sub_masters: list[dict[str, torch.Tensor]] = [{} for _ in optimizer.parts]
        for n, t in master.items():
            sub_masters[optimizer.part_index(n)][n] = t
        return optim.PartitionState(
            tuple(
                _from_per_param(part, FrozenDict(sub), {n: e for n, e in entries.items() if n in sub}, layout)
                for (_, part), sub in zip(optimizer.parts, sub_masters, strict=True)
            )
        )
    fresh = optimizer.init(master, layout=layout)
    if isinstance(fresh, (optim.AdamState, lowbit.LowBitState)):
        kind = type(fresh)
        fields = {f: dict(getattr(fresh, f)) for f in kind._fields}
        for n, entry in entries.items():
            for key, value in entry.items():
                if key not in fields:
                    raise CheckpointError(f"param {n!r}: state key {key!r} does not belong to {optimizer.name}")
                fields[key][n] = value
        return kind(**{f: FrozenDict(v) for f, v in fields.items()})
    if isinstance(fresh, optim.SGDState):
        bufs = dict(fresh.momentum_buffer)
        for n, entry in entries.items():
            if set(entry) - {"momentum_buffer"}:
                raise CheckpointError(f"param {n!r}: state keys {sorted(entry)} do not belong to sgd")
            bufs[n] = entry.get("momentum_buffer")
        return optim.SGDState(FrozenDict(bufs))
    per = dict(fresh.per_param)
    for n, entry in entries.items():
        per[n] = FrozenDict(entry)
    return torch_optim.TorchOptimState(FrozenDict(per))


# Per-param scalars in torch optimizers' state (everything else is per element).
_SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def _is_sharded(value: Any) -> bool:
    """Shard-shaped state (1-D like the master shard) as opposed to replicated scalars."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def _is_per_element(key: str, value: Any, spec: ParamSpec) -> bool:
    """In a *full* state dict: a param-shaped tensor, one value per element of the param.

    A 0-d param makes shapes ambiguous (its ``exp_avg`` is 0-d like ``step``), so the
    known scalar keys of torch's optimizers decide there.
    """
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != spec.shape:
        return False
    return spec.shape != () or key not in _SCALAR_KEYS


# --------------------------------------------------------------------------- gathering


def _gather_full(
    shards: Mapping[str, torch.Tensor], layout: ShardLayout, group: Group, bucket_numel: int
) -> dict[str, torch.Tensor]:
    """Full, param-shaped CPU tensors (in the shards' dtypes) from every rank's shards.

    Collectives: per bucket one all-gather (or per-rank broadcasts on gloo) of the rows.
    """
    how = comm.CommPolicy().resolve(group)[1]
    out: dict[str, torch.Tensor] = {}
    for bucket in layout.buckets(bucket_numel, shards):
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


def _gather_quantized(
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
    everyone = comm.all_gather_objects(mine, group)
    out = {}
    for n, k in mine:
        dtype = entries[n][k].codes.dtype
        pieces = [(theirs[n, k][0].view(dtype), theirs[n, k][1]) for theirs in everyone]  # type: ignore[index]
        out[n, k] = lowbit.to_global(entries[n][k], pieces, layout[n]).to("cpu")
    return out


def _group_plan(optimizer: optim.Optimizer, names: tuple[str, ...]) -> list[tuple[list[str], dict[str, Any]]]:
    """Non-empty param groups in group order: (names, hyperparameters)."""
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(optimizer.group_index(n), []).append(n)
    return [(groups[i], dict(optimizer.hyperparams(groups[i][0]))) for i in sorted(groups)]


def _cpu_copy(v: Any) -> Any:
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def _gather_whole(
    state: ZeroState, entries: Mapping[str, Mapping[str, Any]], group: Group
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Every whole param's master and optimizer state, from its owner, on every rank (CPU copies).

    Collectives: one object all-gather over ``group`` (each rank sends what it owns).
    """
    mine = {
        s.name: (
            state.master[s.name].detach().cpu().clone(),
            {k: _cpu_copy(v) for k, v in entries.get(s.name, {}).items()},
        )
        for s in state.layout.params
        if s.is_whole and s.holds(state.rank)
    }
    masters: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    for theirs in comm.all_gather_objects(mine, group):
        for name, (master, entry) in theirs.items():  # type: ignore[union-attr]
            masters[name] = master
            if entry:
                states[name] = entry
    return masters, states


def full_state_dict(
    state: ZeroState,
    group: Group = None,
    *,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any] | list[dict[str, Any]]:
    """The whole optimizer state in ``torch.optim.Optimizer.state_dict()`` format, on every rank.

    Params are numbered in param-group order (as torch does); ``param_groups`` carry the
    hyperparameters. The ``"zerofn"`` entry holds ``names`` (index -> name), ``shapes``,
    ``dtypes``, ``master`` (name -> full master weights), ``step``, ``loss_scale`` and
    ``optimizer`` (the functional optimizer's name and torch class).

    Whole params (placement ``"whole"``) come from their owners with the state's real
    shapes (Muon's ``momentum_buffer`` shaped like the param, Adafactor's ``row_var`` of
    an ``(m, n)`` matrix ``(m, 1)``), so the dict loads into the plain torch class.

    For a :func:`zerofn.optim.partition` the result is a list: one such dict per part, in
    part order, each numbering only that part's params (each loads into the matching
    plain torch optimizer built over those params in order).

    ``buffers`` (the model's persistent buffers, :func:`persistent_buffers`): CPU copies of
    this rank's go in ``"zerofn"["buffers"]`` (of the first dict of a partition's list),
    for :func:`shard_state_dict`'s ``buffers_out``; rank 0's dict holds rank 0's, which is
    what a rank-0 save writes, as DDP's rank-0 ``model.state_dict()``.

    Collectives: bucketed all-gathers of every shard-shaped state field and the masters of
    the split params; with whole params one object all-gather of the owners' state.
    """
    result = _full_state_dict(state, group, bucket_numel)
    if buffers is not None:
        first = result[0] if isinstance(result, list) else result
        first["zerofn"]["buffers"] = {n: b.detach().to("cpu", copy=True) for n, b in buffers.items()}
    return result


def _full_state_dict(state: ZeroState, group: Group, bucket_numel: int) -> dict[str, Any] | list[dict[str, Any]]:
    """:func:`full_state_dict` without the buffers."""
    layout = state.layout
    entries = _per_param(state.opt_state, layout.names)
    split = {n for n in layout.names if not layout[n].is_whole}

    def plain(v: Any) -> bool:
        return _is_sharded(v) and not lowbit.is_quantized(v)

    keys = sorted({k for n, e in entries.items() if n in split for k, v in e.items() if plain(v)})
    gathered = {
        k: _gather_full(
            {n: e[k] for n, e in entries.items() if n in split and k in e and plain(e[k])}, layout, group, bucket_numel
        )
        for k in keys
    }
    quantized = _gather_quantized(entries, layout, group)
    master = _gather_full({n: t for n, t in state.master.items() if n in split}, layout, group, bucket_numel)
    full_entries: dict[str, dict[str, Any]] = {
        n: {
            k: quantized[n, k] if lowbit.is_quantized(v) else gathered[k][n] if _is_sharded(v) else _cpu_copy(v)
            for k, v in e.items()
        }
        for n, e in entries.items()
        if n in split
    }
    if layout.has_whole:
        whole_masters, whole_entries = _gather_whole(state, entries, group)
        master.update(whole_masters)
        full_entries.update(whole_entries)
    if state.optimizer.parts:
        names_of: list[list[str]] = [[] for _ in state.optimizer.parts]
        for n in layout.names:
            names_of[state.optimizer.part_index(n)].append(n)
        return [
            _torch_format(state, part, names, full_entries, master)
            for (_, part), names in zip(state.optimizer.parts, names_of, strict=True)
        ]
    return _torch_format(state, state.optimizer, layout.names, full_entries, master)


@functools.lru_cache(maxsize=64)
def _torch_defaults(cls: type[torch.optim.Optimizer], given: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Every hyperparameter a param group of ``cls`` carries (torch's own state dicts have them all,
    and torch's ``step`` reads them), for a group built with ``given``."""
    instance = cls([torch.zeros(2, 2, requires_grad=True)], **dict(given))
    group: dict[str, Any] = {"params": []}
    instance.__setstate__({"state": {}, "param_groups": [group]})  # keys later torch releases added
    return {**instance.defaults, **{k: v for k, v in group.items() if k != "params"}}


def _torch_format(
    state: ZeroState,
    optimizer: optim.Optimizer,
    names: tuple[str, ...] | list[str],
    full_entries: Mapping[str, Mapping[str, Any]],
    master: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """One torch-format state dict over ``names`` (full tensors), with its ``"zerofn"`` entry."""
    layout = state.layout
    plan = _group_plan(optimizer, tuple(names))
    if optimizer.name not in ("sgd", "adam", "adamw"):  # a torch class driven as-is: its full defaults
        base = _torch_defaults(optimizer.torch_class, tuple(sorted(optimizer.defaults.items(), key=lambda kv: kv[0])))
        plan = [(group_names, {**base, **hp}) for group_names, hp in plan]
    if "lowbit" in optimizer.static:  # torchao keeps lr as a 0-d float32 tensor (its step refuses a float)
        plan = [(group_names, {**hp, "lr": torch.tensor(hp["lr"], dtype=torch.float32)}) for group_names, hp in plan]
    ordered = [n for group_names, _ in plan for n in group_names]
    index = {n: i for i, n in enumerate(ordered)}
    return {
        "state": {index[n]: dict(full_entries[n]) for n in ordered if n in full_entries},
        "param_groups": [{**hp, "params": [index[n] for n in group_names]} for group_names, hp in plan],
        "zerofn": {
            "version": FORMAT_VERSION,
            "names": ordered,
            "shapes": [list(layout[n].shape) for n in ordered],
            "dtypes": [str(layout[n].dtype).removeprefix("torch.") for n in ordered],
            "master": {n: master[n] for n in ordered},
            "step": state.step,
            "loss_scale": _loss_scale_to_dict(state),
            "optimizer": {"name": optimizer.name, "torch_class": optimizer.torch_class.__name__},
        },
    }


# --------------------------------------------------------------------------- loading


def _loss_scale_to_dict(state: ZeroState) -> dict[str, Any] | None:
    ls = getattr(state, "loss_scale", None)
    return None if ls is None else dict(ls._asdict())


def _with_loss_scale(state: ZeroState, saved: Mapping[str, Any] | None) -> ZeroState:
    current = getattr(state, "loss_scale", None)
    if saved is None or current is None:
        return state
    return state.replace(loss_scale=type(current)(**saved))


def _optimizer_for(
    saved_groups: list[dict[str, Any]],
    names_of: Callable[[list[int]], list[str]],
    zmeta: Mapping[str, Any] | None,
    optimizer: optim.Optimizer | None,
) -> optim.Optimizer:
    """``optimizer`` (or the one the checkpoint names) with the saved per-group hyperparameters."""
    if optimizer is None:
        if zmeta is None:
            raise CheckpointError(
                "this is a plain torch optimizer state dict: pass optimizer=zf.optim.adamw(...) (or the "
                "matching factory) so zerofn knows which update rule the state belongs to"
            )
        info = zmeta["optimizer"]
        if info["name"] == "partition":
            raise CheckpointError(
                "this checkpoint was saved from a zf.optim.partition: pass the same partition as optimizer= "
                "(zerofn cannot rebuild the parts' selectors from a checkpoint)"
            )
        factories = {"sgd": optim.sgd, "adam": optim.adam, "adamw": optim.adamw}
        if info["name"] in factories:
            optimizer = factories[info["name"]]()
        else:
            optimizer = torch_optim.from_torch(getattr(torch.optim, info["torch_class"]))
    else:
        _check_same_optimizer(zmeta, optimizer)
    known = _hyperparam_keys(optimizer)
    # JSON (the sharded checkpoint's metadata) turns tuples such as betas into lists.
    groups = [
        {
            "params": names_of(g["params"]),
            **{k: _plain_value(v) for k, v in g.items() if k in known},
        }
        for g in saved_groups
    ]
    return dataclasses.replace(optimizer, groups=optim._make_groups(optimizer.name, groups))


def _plain_value(v: Any) -> Any:
    """A saved hyperparameter as zerofn keeps it: JSON's lists as tuples (betas), a 0-d tensor
    (torchao's ``lr``) as its float, which is exact."""
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return v.item()
    return v


def _hyperparam_keys(optimizer: optim.Optimizer) -> set[str]:
    """The hyperparameters a saved param group may set on ``optimizer``.

    zerofn's own optimizers name them all in ``defaults``; a torch class driven by
    :func:`zerofn.torch_optim.from_torch` (Muon, Adafactor, RMSprop, ... wrapped by the
    facade: hyperparameters in the groups, ``defaults`` often empty) takes every keyword
    of its torch class.
    """
    keys = set(optimizer.defaults).union(*(g.hyperparams for g in optimizer.groups))
    if optimizer._init is torch_optim._generic_init:
        try:
            torch_keys = set(_torch_defaults(optimizer.torch_class, ()))
        except (TypeError, ValueError):  # a user's class with required arguments: what the optimizer names
            torch_keys = set()
        keys |= torch_keys - {"params", "differentiable", "capturable"}
    return keys


def _part_groups(optimizer: optim.Optimizer, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """A partition's parts for the sharded checkpoint's metadata: each part's name and its
    non-empty param groups (names, hyperparameters), in part order."""
    names_of: list[list[str]] = [[] for _ in optimizer.parts]
    for n in names:
        names_of[optimizer.part_index(n)].append(n)
    return [
        {"optimizer": part.name, "param_groups": [{**hp, "params": ns} for ns, hp in _group_plan(part, tuple(ns))]}
        for (_, part), ns in zip(optimizer.parts, names_of, strict=True)
    ]


def _with_part_groups(optimizer: optim.Optimizer, saved: list[Mapping[str, Any]]) -> optim.Optimizer:
    """``optimizer`` (a partition) with each part's saved hyperparameters (``_part_groups``)."""
    if len(saved) != len(optimizer.parts):
        raise CheckpointError(
            f"the checkpoint was saved from a partition of {len(saved)} optimizers, but the optimizer is a partition "
            f"of {len(optimizer.parts)}; load it with the partition that saved it"
        )
    for k, (entry, (_, part)) in enumerate(zip(saved, optimizer.parts, strict=True)):
        if entry["optimizer"] != part.name:
            raise CheckpointError(
                f"part {k} of the checkpoint's partition holds {entry['optimizer']} state, but part {k} of the "
                f"optimizer is {part.name}; load it with the partition that saved it"
            )
        optimizer = optimizer.with_part(k, _optimizer_for(list(entry["param_groups"]), list, None, part))
    return optimizer


def _check_fits(zmeta: Mapping[str, Any], layout: ShardLayout) -> None:
    """The checkpoint's params must be the model's: same names, shapes and dtypes."""
    saved = list(zip(zmeta["names"], (tuple(s) for s in zmeta["shapes"]), zmeta["dtypes"], strict=True))
    here = [(p.name, p.shape, str(p.dtype).removeprefix("torch.")) for p in layout.params]
    if sorted(saved) == sorted(here):
        return
    saved_by, here_by = {s[0]: s for s in saved}, {h[0]: h for h in here}
    for name in [*here_by, *saved_by]:
        if name not in saved_by:
            raise CheckpointError(f"the checkpoint has no param {name!r}; it was saved from a different model")
        if name not in here_by:
            raise CheckpointError(f"the checkpoint has param {name!r}, which the model does not have")
        if saved_by[name] != here_by[name]:
            _, s_shape, s_dtype = saved_by[name]
            _, h_shape, h_dtype = here_by[name]
            raise CheckpointError(
                f"param {name!r}: the checkpoint has shape {s_shape} dtype {s_dtype}, the model {h_shape} {h_dtype}"
            )


def _layout_and_masters(
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group,
    master_dtype: torch.dtype,
    optimizer: optim.Optimizer | None = None,
) -> tuple[ShardLayout, dict[str, torch.Tensor] | None]:
    """The layout to load into (this group's size) and, from params, this rank's masters.

    Placements: a layout's own (owners re-planned for another world size), else what
    ``optimizer`` needs for the params (:func:`zerofn.stages.resolve_placement`).
    """
    from zerofn.stages import resolve_placement  # stages imports nothing from here; keep it so

    n = comm.group_size(group)
    if isinstance(like, ShardLayout):
        if like.world_size != n:
            placement = {p.name: p.placement for p in like.params}
            return make_layout(dict(zip(like.names, like.params, strict=True)), n, placement=placement), None
        return like, None
    placement = resolve_placement(like, optimizer) if optimizer is not None else None
    layout = make_layout(like, n, placement=placement)
    rank = comm.group_rank(group)
    return layout, {s.name: cut_shard(like[s.name].to(master_dtype), s, rank) for s in layout.params if s.holds(rank)}


def _check_same_optimizer(zmeta: Mapping[str, Any] | None, optimizer: optim.Optimizer) -> None:
    """A zerofn state dict names the optimizer that saved it: it must be ``optimizer``'s kind."""
    if zmeta is not None and zmeta["optimizer"]["name"] != optimizer.name:
        raise CheckpointError(
            f"the checkpoint holds {zmeta['optimizer']['name']} state, but the optimizer is {optimizer.name}; "
            "load it with the optimizer that saved it"
        )


def _check_version(zmeta: Mapping[str, Any]) -> None:
    version = zmeta.get("version", FORMAT_VERSION)  # entries written before versioning are version 1
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"the state dict's zerofn entry has format version {version!r}; this zerofn reads version "
            f"{FORMAT_VERSION}: load it with the zerofn release that wrote it"
        )


def _saved_optimizer(zmeta: Mapping[str, Any] | None) -> optim.Optimizer:
    """The optimizer a zerofn state dict names (for validation before the real one is rebuilt)."""
    if zmeta is None:
        raise CheckpointError(
            "this is a plain torch optimizer state dict: pass optimizer=zf.optim.adamw(...) (or the "
            "matching factory) so zerofn knows which update rule the state belongs to"
        )
    return _optimizer_for([], lambda idx: [], zmeta, None)


def _loaded_value(key: str, value: Any, spec: ParamSpec, rank: int, master: torch.Tensor) -> Any:
    """One validated state value, as this rank keeps it.

    Per-element state: this rank's shard, cast to the master's dtype (torch casts loaded
    state to its param's dtype; zerofn's optimizer steps the master shard). ``step``: a 0-d
    float32 tensor, as torch creates it. Other scalars: copies.
    """
    if lowbit.is_quantized(value) or (spec.block and key != "step"):
        return _loaded_lowbit(key, value, spec, rank, master)
    if _is_per_element(key, value, spec):
        return cut_shard(value, spec, rank, dtype=master.dtype, device=master.device)
    if key == "step":
        return torch.as_tensor(value, dtype=torch.float32).detach().clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def _loaded_lowbit(key: str, value: Any, spec: ParamSpec, rank: int, master: torch.Tensor) -> Any:
    """A quantized state value cut to this rank's whole blocks, or a ``CheckpointError`` when
    the state's precision does not match the param's placement (quantized state for a
    full-precision optimizer, full-precision state for a param kept quantized)."""
    if not lowbit.is_quantized(value):
        raise CheckpointError(
            f"param {spec.name!r}: state {key!r} is a full-precision {type(value).__name__}, but the optimizer keeps "
            f"it quantized in blocks of {spec.block} ({spec.placement}): the state dict was saved from a "
            "full-precision optimizer; load it with that optimizer (e.g. torch.optim.AdamW)"
        )
    if not spec.block:
        raise CheckpointError(
            f"param {spec.name!r}: state {key!r} is quantized ({type(value).__name__}), but the optimizer keeps "
            "full-precision state: the state dict was saved from a low-bit optimizer (torchao's AdamW8bit, ...); "
            "load it with that optimizer"
        )
    return lowbit.to_shard(value, spec, rank, device=master.device)


def shard_state_dict(
    full: Mapping[str, Any] | list[Mapping[str, Any]],
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group = None,
    *,
    optimizer: optim.Optimizer | None = None,
    master_dtype: torch.dtype = torch.float32,
    precision: PrecisionPolicy | None = None,
    group_sizes: list[int] | None = None,
    buffers_out: Mapping[str, torch.Tensor] | None = None,
    policy: Any = UNSET,
) -> ZeroState:
    """A ZeroState for this rank, at the group's world size, from a full state dict.

    Args:
      full: from :func:`full_state_dict` (any world size) or a plain torch optimizer's
        ``state_dict()``; for a :func:`zerofn.optim.partition`, the list of one such
        dict per part (``optimizer`` required: the partition itself).
      like: the params (name -> tensor, in the order the torch optimizer listed them) or
        a :class:`ShardLayout` (then the masters must come from ``full["zerofn"]``).
      group: the sharding group; the state is sharded over its size.
      optimizer: the functional optimizer; required for a plain torch state dict,
        otherwise rebuilt from the checkpoint. Saved per-group hyperparameters win.
      master_dtype: master dtype when the masters come from ``like``'s params.
      precision: the precision policy of the run that continues (loss scaler, dtypes);
        the saved loss-scale state is restored into it.
      group_sizes: params per param group of the optimizer loading it, when known (the
        facade passes its own): the state dict must have the same grouping.
      buffers_out: the model's buffers, filled in place from ``"zerofn"["buffers"]`` once
        everything else has been checked and built (names, shapes and dtypes must be the
        saved ones); a state dict without buffers leaves them as they are.
      policy: the old name of ``precision`` (deprecated, warns).

    Raises:
      CheckpointError: before anything is built, when the state dict does not fit: another
        model (param shapes), another optimizer (state keys), another grouping, state that
        is one rank's shard, missing or invalid hyperparameters, or a zerofn entry of an
        unknown format version. The message names the param, key and shapes.

    Returns:
      The ZeroState; masters from ``full["zerofn"]["master"]`` when present, else ``like``.

    Collectives: none (every rank cuts its own shards out of ``full``).
    """
    precision = renamed("shard_state_dict", "policy", "precision", policy, precision)
    first = full[0] if isinstance(full, (list, tuple)) and full else full
    zfirst = first.get("zerofn") if isinstance(first, Mapping) else None
    saved_buffers = zfirst.get("buffers") if isinstance(zfirst, Mapping) else None
    if buffers_out is not None and saved_buffers is not None:
        check_buffers(_buffer_meta(saved_buffers), buffers_out, "shard_state_dict")
    state = _shard_state_dict(
        full,
        like,
        group,
        optimizer=optimizer,
        master_dtype=master_dtype,
        precision=precision,
        group_sizes=group_sizes,
    )
    if buffers_out is not None and saved_buffers is not None:
        for name, value in saved_buffers.items():
            buffers_out[name].detach().copy_(value)
    return state


def _shard_state_dict(
    full: Mapping[str, Any] | list[Mapping[str, Any]],
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group,
    *,
    optimizer: optim.Optimizer | None,
    master_dtype: torch.dtype,
    precision: PrecisionPolicy | None,
    group_sizes: list[int] | None,
) -> ZeroState:
    """:func:`shard_state_dict` without the buffers."""
    if isinstance(full, (list, tuple)):
        return _shard_state_dicts(
            full,
            like,
            group,
            optimizer=optimizer,
            master_dtype=master_dtype,
            precision=precision,
            group_sizes=group_sizes,
        )
    zmeta = full.get("zerofn") if isinstance(full, Mapping) else None
    if isinstance(zmeta, Mapping):
        _check_version(zmeta)
    placed_by = optimizer or _saved_optimizer(zmeta if isinstance(zmeta, Mapping) else None)
    layout, masters_from_params = _layout_and_masters(like, group, master_dtype, placed_by)
    rank = comm.group_rank(group)
    fopt, master, entries, zmeta = _load_one(
        full, layout, layout.names, optimizer, rank, masters_from_params, group_sizes=group_sizes
    )
    master_fd = FrozenDict({s.name: master[s.name] for s in layout.params if s.holds(rank)})
    opt_state = _from_per_param(fopt, master_fd, entries, layout)
    step = (
        int(zmeta["step"]) if zmeta is not None else max((int(e.get("step", 0)) for e in entries.values()), default=0)
    )
    state = ZeroState(layout, fopt, rank, master_fd, opt_state, step, precision=precision or DEFAULT_POLICY)
    return _with_loss_scale(state, zmeta.get("loss_scale") if zmeta else None)


# Torch classes whose constructor refuses any param that is not 2-D. The general checks
# (zerofn._state_dict_checks) probe hyperparameters on a 1-D param, which these refuse, so
# their state dicts are checked here with the same declarations on the params' own shapes.
_MATRIX_ONLY = frozenset({"Muon"})


def _matrix_only_problem(
    full: Mapping[str, Any], layout: ShardLayout, order: list[str], optimizer: optim.Optimizer
) -> str | None:
    """:func:`zerofn._state_dict_checks.state_dict_problem` for a matrix-only class (Muon).

    Checks the structure (groups indexing every param once), then each param's state keys
    and shapes against :func:`~zerofn._state_dict_checks.declared_state` for its own
    (2-D) shape, with torch's constructor validating each group's hyperparameters.
    """
    if not isinstance(full, Mapping) or "state" not in full or "param_groups" not in full:
        return "a state dict needs 'state' and 'param_groups' entries (from optimizer.state_dict())"
    groups, state = full["param_groups"], full["state"]
    indices = [i for g in groups for i in g["params"]]
    if sorted(indices) != list(range(len(order))):
        return f"the param groups must index the {len(order)} params 0..{len(order) - 1} once each, found {indices}"
    cls = optimizer.torch_class
    for g, group in enumerate(groups):
        hp = {k: v for k, v in group.items() if k != "params"}
        for index in group["params"]:
            spec = layout[order[index]]
            where = f"param {spec.name!r} (index {index})"
            try:
                declared = _state_dict_checks.declared_state(cls, hp, spec.shape)
            except (ValueError, TypeError, RuntimeError) as e:
                return f"param group {g}, {where}: {cls.__name__} cannot take it ({e})"
            entry = state.get(index, state.get(str(index)))
            if not entry:
                continue
            if set(entry) != set(declared):
                return (
                    f"{where}: state keys {sorted(entry)} are not {cls.__name__}'s {sorted(declared)}: the state "
                    "dict was saved from another optimizer"
                )
            for key, expected in declared.items():
                value = entry[key]
                found = tuple(value.shape) if isinstance(value, torch.Tensor) else None
                if (expected is None) != (found is None or found == ()) or (expected is not None and found != expected):
                    return f"{where}: state {key!r} has shape {found}, expected {expected} (param {spec.shape})"
    return None


def _load_one(
    full: Mapping[str, Any],
    layout: ShardLayout,
    names: tuple[str, ...] | list[str],
    optimizer: optim.Optimizer | None,
    rank: int,
    masters_from_params: Mapping[str, torch.Tensor] | None,
    *,
    group_sizes: list[int] | None = None,
) -> tuple[optim.Optimizer, dict[str, torch.Tensor], dict[str, dict[str, Any]], Mapping[str, Any] | None]:
    """Check one torch-format dict over ``names`` and cut what this rank holds out of it.

    Returns ``(optimizer with the saved hyperparameters, masters, per-param state, zerofn
    entry)``, masters and state for the params of ``names`` that ``rank`` holds.
    """
    zmeta = full.get("zerofn") if isinstance(full, Mapping) else None
    # Checks read names, shapes and dtypes only: a part's dict is checked against its params.
    checked = layout if len(names) == len(layout) else make_layout({n: layout[n] for n in names}, 1)
    if zmeta is not None:
        _check_version(zmeta)
        _check_fits(zmeta, checked)
        order: list[str] = list(zmeta["names"])
    else:
        order = list(checked.names)
    # Everything is checked before anything is built: a failed load changes nothing.
    checker = optimizer or _saved_optimizer(zmeta)
    _check_same_optimizer(zmeta, checker)  # the plainest cause first, before the state's details
    if checker.torch_class.__name__ in _MATRIX_ONLY:
        problem = _matrix_only_problem(full, checked, order, checker)
    else:
        problem = _state_dict_checks.state_dict_problem(full, checked, order, checker, group_sizes=group_sizes)
    if problem is not None:
        raise CheckpointError(f"cannot load this optimizer state dict: {problem}")
    saved_groups = list(full["param_groups"])
    flat_indices = [i for g in saved_groups for i in g["params"]]
    name_of = dict(zip(flat_indices, order, strict=True))
    fopt = _optimizer_for(saved_groups, lambda idx: [name_of[i] for i in idx], zmeta, optimizer)
    held = [layout[n] for n in names if layout[n].holds(rank)]
    if zmeta is not None and "master" in zmeta:
        master = {s.name: cut_shard(zmeta["master"][s.name], s, rank, device="cpu") for s in held}
    elif masters_from_params is not None:
        master = {s.name: masters_from_params[s.name] for s in held}
    else:
        raise CheckpointError("the state dict holds no master weights: pass the params as `like`")
    entries: dict[str, dict[str, Any]] = {}
    for idx, per in full["state"].items():
        name = name_of[int(idx)]
        spec = layout[name]
        if not spec.holds(rank):
            continue  # a whole param another rank owns: its state lives there
        entries[name] = {k: _loaded_value(k, v, spec, rank, master[name]) for k, v in per.items()}
    return fopt, master, entries, zmeta


def _shard_state_dicts(
    fulls: list[Mapping[str, Any]] | tuple[Mapping[str, Any], ...],
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group,
    *,
    optimizer: optim.Optimizer | None,
    master_dtype: torch.dtype,
    precision: PrecisionPolicy | None,
    group_sizes: list[int] | None,
) -> ZeroState:
    """:func:`shard_state_dict` of a list: one torch-format dict per part of a partition."""
    if optimizer is None or not optimizer.parts or len(optimizer.parts) != len(fulls):
        parts = len(optimizer.parts) if optimizer is not None else 0
        raise CheckpointError(
            f"a list of {len(fulls)} state dicts (one per optimizer) loads with optimizer=zf.optim.partition([...]) "
            f"of as many parts; got {'no optimizer' if optimizer is None else f'{optimizer.name} with {parts} parts'}"
        )
    if group_sizes is not None:
        raise CheckpointError("group_sizes applies to one state dict; check each part's dict separately")
    layout, masters_from_params = _layout_and_masters(like, group, master_dtype, optimizer)
    rank = comm.group_rank(group)
    names_of: list[list[str]] = [[] for _ in optimizer.parts]
    for n in layout.names:
        names_of[optimizer.part_index(n)].append(n)
    fopt, master, entries = optimizer, {}, {}
    zmeta = None
    for i, (full, names) in enumerate(zip(fulls, names_of, strict=True)):
        part_opt, part_master, part_entries, part_meta = _load_one(
            full, layout, names, optimizer.parts[i][1], rank, masters_from_params
        )
        fopt = fopt.with_part(i, part_opt)
        master.update(part_master)
        entries.update(part_entries)
        zmeta = zmeta or part_meta
    master_fd = FrozenDict({s.name: master[s.name] for s in layout.params if s.holds(rank)})
    step = (
        int(zmeta["step"]) if zmeta is not None else max((int(e.get("step", 0)) for e in entries.values()), default=0)
    )
    state = ZeroState(
        layout,
        fopt,
        rank,
        master_fd,
        _from_per_param(fopt, master_fd, entries, layout),
        step,
        precision=precision or DEFAULT_POLICY,
    )
    return _with_loss_scale(state, zmeta.get("loss_scale") if zmeta else None)


# --------------------------------------------------------------------------- sharded save / load


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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rank_entries(
    state: ZeroState, rank: int, mesh: Any
) -> tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, str]]:
    """What this rank writes: (DCP state dict, per-param state kinds, master dtypes).

    Split params: the master and every per-element state field as DTensor shards over the
    unpadded flat param; scalars as plain tensors (or JSON in the kinds). Whole params:
    written by their owner only, full-shaped.
    """
    layout = state.layout
    entries = _per_param(state.opt_state, layout.names)
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
            elif _is_sharded(value):
                sd[f"optim/{spec.name}/{key}"] = _dtensor(value, spec, rank, mesh)
                kinds[spec.name][key] = f"shard:{str(value.dtype).removeprefix('torch.')}"
            elif isinstance(value, torch.Tensor):
                sd[f"optim/{spec.name}/{key}"] = value
                kinds[spec.name][key] = f"scalar:{str(value.dtype).removeprefix('torch.')}:{value.device.type}"
            else:
                kinds[spec.name][key] = "json:" + json.dumps(value)
    return sd, kinds, master_dtypes


def _write_meta(
    target: str,
    state: ZeroState,
    kinds: Mapping[str, Any],
    master_dtypes: Mapping[str, str],
    model: list[str] | None,
    buffers: dict[str, list[Any]] | None = None,
) -> None:
    """Rank 0: ``zerofn.json`` in ``target``, with every file's size and SHA-256, fsynced."""
    layout = state.layout
    plan = _group_plan(state.optimizer, layout.names)
    files = sorted(f for f in os.listdir(target) if not f.startswith("."))
    meta = {
        "version": FORMAT_VERSION,
        "names": list(layout.names),
        "shapes": [list(p.shape) for p in layout.params],
        "dtypes": [str(p.dtype).removeprefix("torch.") for p in layout.params],
        "master_dtypes": [master_dtypes[n] for n in layout.names],
        "placements": [p.placement for p in layout.params],
        "state_kinds": kinds,
        "param_groups": [{**hp, "params": names} for names, hp in plan],
        # A partition's hyperparameters live in its parts (a list of torch optimizers in the facade).
        "part_groups": _part_groups(state.optimizer, layout.names) if state.optimizer.parts else None,
        "optimizer": {"name": state.optimizer.name, "torch_class": state.optimizer.torch_class.__name__},
        "step": state.step,
        "loss_scale": _loss_scale_to_dict(state),
        "saved_world_size": layout.world_size,
        "model": model,
        "buffers": buffers,
        "files": {
            f: {"bytes": os.path.getsize(os.path.join(target, f)), "sha256": _file_digest(os.path.join(target, f))}
            for f in [*files, ".metadata"]
        },
    }
    meta_path = os.path.join(target, META_FILE)
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(target)


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds (persistent ones), by their state-dict names."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def _buffer_meta(buffers: Mapping[str, torch.Tensor] | None) -> dict[str, list[Any]] | None:
    """name -> [shape, dtype] of the buffers saved (``None``: saved without buffers)."""
    if buffers is None:
        return None
    return {n: [list(b.shape), str(b.dtype).removeprefix("torch.")] for n, b in buffers.items()}


def check_buffers(saved: Mapping[str, Any] | None, buffers: Mapping[str, torch.Tensor], where: str) -> None:
    """The model's buffers must be exactly the saved ones (names, shapes, dtypes), or raise ``CheckpointError``.

    ``saved`` is ``None`` for a checkpoint written without buffers (before they were
    saved): nothing to check, the model's buffers stay. No collectives.
    """
    if saved is None:
        return
    mine = _buffer_meta(buffers) or {}
    if set(saved) != set(mine):
        missing, extra = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
        raise CheckpointError(
            f"{where}: the checkpoint's buffers do not match the model's (in the checkpoint only: {missing[:5]}; in "
            f"the model only: {extra[:5]}): load it into the model it was saved from"
        )
    for name, (shape, dtype) in saved.items():
        if [list(mine[name][0]), mine[name][1]] != [list(shape), dtype]:
            raise CheckpointError(
                f"{where}: buffer {name!r} was saved as {tuple(shape)} {dtype}, the model's is "
                f"{tuple(mine[name][0])} {mine[name][1]}: load it into the model it was saved from"
            )


def _commit(path: str, target: str) -> None:
    """Rank 0: point the symlink ``path`` at ``target`` atomically, then drop the previous target."""
    previous = os.path.realpath(path) if os.path.islink(path) else None
    link = f"{target}.link"
    os.symlink(os.path.basename(target), link)
    os.replace(link, path)  # the commit: atomic on POSIX
    _fsync_dir(os.path.dirname(path))
    if previous and previous != target and os.path.isdir(previous):
        shutil.rmtree(previous, ignore_errors=True)


def save(
    path: str | os.PathLike[str],
    state: ZeroState,
    group: Group = None,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    replicate_group: Group = None,
    _before_commit: Callable[[], None] | None = None,
) -> str:
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

    Returns:
      The committed directory the checkpoint was written to, on every rank (replicas
      included), so ``load(save(path, ...), ...)`` works everywhere.

    Collectives: a broadcast of the directory name, DCP's plan exchange, two barriers
    (within ``group``); with replicas one more broadcast of the committed directory's
    name over ``replicate_group``.
    """
    if replicate_group is not None and comm.group_rank(replicate_group) != 0:
        # A replica: the first shard group writes the same shards; this broadcast returns
        # once the checkpoint is committed, with the directory it went to.
        return str(comm.broadcast_object(None, replicate_group))
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        raise CheckpointError(f"{path} is a plain directory; zerofn manages checkpoint paths as symlinks")
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
    comm.dcp_save(sd, target, group)
    if rank == 0:
        _write_meta(
            target, state, kinds, master_dtypes, sorted(params) if params is not None else None, _buffer_meta(buffers)
        )
    comm.barrier(group)
    if _before_commit is not None:
        _before_commit()
    if rank == 0:
        _commit(path, target)
    comm.barrier(group)
    if replicate_group is not None:
        comm.broadcast_object(target, replicate_group)  # release the replicas: the checkpoint is committed
    return target


def _check_placements(meta: Mapping[str, Any], layout: ShardLayout) -> None:
    """Split params are saved as shards of the flat param, whole ones full-shaped: they must agree."""
    saved = dict(zip(meta["names"], meta.get("placements") or ["split"] * len(meta["names"]), strict=True))
    for p in layout.params:
        if saved[p.name] != p.placement:
            raise CheckpointError(
                f"param {p.name!r} was saved {saved[p.name]} and would load {p.placement}: the optimizer that "
                "loads it must place it as the one that saved it did (the same optimizer, the same placement override)"
            )


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
            dtype, _, dev = rest.partition(":")
            value = torch.zeros((), dtype=getattr(torch, dtype), device=device if dev != "cpu" else "cpu")
            sd[f"optim/{spec.name}/{key}"] = value
        else:
            value = json.loads(rest)
        entry[key] = value
    return entry


def _read_meta(path: str, verify: bool) -> dict[str, Any]:
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {META_FILE}: not a zerofn checkpoint, or an unfinished save") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e})") from None
    for name, info in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(
                f"{path}: file {name} is missing (written by one of the {meta['saved_world_size']} ranks)"
            )
        size = os.path.getsize(file)
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: file {name} has {size} bytes, {info['bytes']} were written: truncated")
        if verify and _file_digest(file) != info["sha256"]:
            raise CheckpointError(f"{path}: file {name} does not match its SHA-256: corrupt")
    return meta


def _checked_meta(
    path: str,
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group,
    optimizer: optim.Optimizer | None,
    verify: bool,
    wants_model: bool,
) -> tuple[dict[str, Any], ShardLayout, optim.Optimizer]:
    """Everything :func:`load` checks before reading a tensor: (metadata, layout here, optimizer).

    Raises ``CheckpointError`` (or the ``KeyError``/``TypeError``/``ValueError`` of
    unreadable metadata) naming what does not fit. No collectives.
    """
    meta = _read_meta(path, verify)
    placed_by = optimizer or _saved_optimizer({"optimizer": meta["optimizer"]})
    layout, _ = _layout_and_masters(like, group, torch.float32, placed_by)
    _check_fits({k: meta[k] for k in ("names", "shapes", "dtypes")}, layout)
    _check_placements(meta, layout)
    if wants_model and meta["model"] is None:
        raise CheckpointError(f"{path} holds no model weights (saved without params=)")
    names_of = {n: [n] for n in layout.names}
    fopt = _optimizer_for(
        [{**g, "params": g["params"]} for g in meta["param_groups"]],
        lambda names: [m for n in names for m in names_of[n]],
        {"optimizer": meta["optimizer"]},
        optimizer,
    )
    if fopt.parts and meta.get("part_groups"):  # checkpoints written before part_groups keep the given ones
        fopt = _with_part_groups(fopt, meta["part_groups"])
    return meta, layout, fopt


def _receiving_buffers(
    meta: Mapping[str, Any], layout: ShardLayout, rank: int, device: torch.device, mesh: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The tensors DCP reads this rank's pieces into: (DCP state dict, masters, per-param state).

    Split params: zero ``(shard_numel,)`` masters and per-element state as DTensor shards
    over the unpadded flat param, 0-d scalars, JSON values decoded here. Whole params: on
    their owner only, full-shaped.
    """
    master_dtypes = dict(zip(meta["names"], meta["master_dtypes"], strict=True))
    sd: dict[str, Any] = {}
    master: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    for spec in layout.params:
        if spec.is_whole:
            if spec.holds(rank):
                entries[spec.name] = _load_whole(
                    sd, master, spec, meta["state_kinds"][spec.name], master_dtypes, device
                )
            continue
        master[spec.name] = torch.zeros(spec.shard_numel, dtype=getattr(torch, master_dtypes[spec.name]), device=device)
        sd[f"master/{spec.name}"] = _dtensor(master[spec.name], spec, rank, mesh)
        entries[spec.name] = {}
        for key, kind in meta["state_kinds"][spec.name].items():
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
                dtype, _, dev = rest.partition(":")
                value = torch.zeros((), dtype=getattr(torch, dtype), device=device if dev != "cpu" else "cpu")
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
      policy: the old name of ``precision`` (deprecated, warns).

    Returns:
      This rank's ZeroState at ``comm.group_size(group)`` ranks.

    Collectives: DCP's plan exchange; each rank reads the pieces its shards overlap.
    """
    precision = renamed("load", "policy", "precision", policy, precision)
    path = os.path.abspath(os.fspath(path))
    # Everything that can be checked before reading a tensor is, and every rank learns every
    # rank's verdict before DCP's collectives start: a rank that cannot load makes all raise.
    try:
        meta, layout, fopt = _checked_meta(path, like, group, optimizer, verify, params_out is not None)
        if buffers_out is not None:
            check_buffers(meta.get("buffers"), buffers_out, path)
        failure: Exception | None = None
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        failure = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: unreadable metadata ({e!r})")
    raise_alike(failure, (group,), "zerofn.checkpoint.load")
    rank = comm.group_rank(group)
    device = next(iter(like.values())).device if isinstance(like, Mapping) else torch.device("cpu")
    mesh = comm.device_mesh(group, device.type)
    sd, master, entries = _receiving_buffers(meta, layout, rank, device, mesh)
    # The model's weights are read into new tensors and copied into ``params_out`` only once
    # every rank has read and checked everything: a failed load leaves the model as it was
    # (the cost: one more copy of the model's weights for the duration of the load).
    staged: dict[str, torch.Tensor] = {}
    if params_out is not None:
        for name in meta["model"]:
            staged[name] = torch.empty_like(params_out[name].detach())
            sd[f"model/{name}"] = staged[name]
    staged_buffers: dict[str, torch.Tensor] = {}
    if buffers_out is not None and meta.get("buffers") is not None:
        for name in meta["buffers"]:
            staged_buffers[name] = torch.empty_like(buffers_out[name].detach())
            sd[f"buffer/{name}"] = staged_buffers[name]
    state: ZeroState | None = None
    try:
        comm.dcp_load(sd, path, group)
        for key, value in sd.items():  # scalars may be replaced rather than filled in place
            if key.startswith("optim/") and isinstance(value, torch.Tensor) and value.dim() == 0:
                _, name, field = key.split("/", 2)
                entries[name][field] = value
        master_fd = FrozenDict(master)
        state = ZeroState(
            layout,
            fopt,
            rank,
            master_fd,
            _from_per_param(fopt, master_fd, {n: e for n, e in entries.items() if e}, layout),
            meta["step"],
            precision=precision or DEFAULT_POLICY,
        )
        failure = None
    except CheckpointError as e:
        failure = e
    except Exception as e:  # DCP wraps per-rank failures; say which checkpoint and why
        failure = CheckpointError(f"{path}: reading the shards failed: {e}")
        failure.__cause__ = e
    raise_alike(failure, (group,), "zerofn.checkpoint.load")
    assert state is not None
    if staged:
        with torch.no_grad():  # params_out may be leaf params that require grad
            for name, value in staged.items():
                params_out[name].copy_(value)  # type: ignore[index]
    for name, value in staged_buffers.items():
        buffers_out[name].detach().copy_(value)  # type: ignore[index]
    return _with_loss_scale(state, meta.get("loss_scale"))
