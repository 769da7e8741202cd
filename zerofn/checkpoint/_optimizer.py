"""The optimizer in a checkpoint: its state as torch keeps it (name -> {key: value}),
and the functional optimizer a checkpoint describes (the kind, the saved hyperparameters,
a partition's parts).

Saving reads :mod:`zerofn.optim`'s state types into torch's per-param view; loading builds
the optimizer once (:func:`optimizer_for`, :func:`with_part_groups`) and the state once
(:func:`from_per_param`). No collectives.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zerofn import lowbit, optim, torch_optim
from zerofn._torch_driver import generic_init
from zerofn._tree import FrozenDict
from zerofn.checkpoint._errors import CheckpointError
from zerofn.layout import ShardLayout
from zerofn.state import ZeroState


def per_param(opt_state: Any, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """An optimizer state as torch keeps it: name -> {key: value}, params without state omitted."""
    out: dict[str, dict[str, Any]] = {}
    if isinstance(opt_state, optim.PartitionState):
        for sub in opt_state.states:
            out.update(per_param(sub, names))
        return {n: out[n] for n in names if n in out}
    # A rank keeps state only for what it holds: whole params of other ranks are absent.
    if isinstance(opt_state, (optim.AdamState, lowbit.LowBitState)):
        for n in names:
            if n not in opt_state.step or int(opt_state.step[n]) == 0:
                continue  # torch creates Adam state lazily, at a param's first step
            # .clone(): a flat state shares one step tensor among names; torch keeps one per param
            entry = {
                "step": opt_state.step[n].clone(),
                "exp_avg": opt_state.exp_avg[n],
                "exp_avg_sq": opt_state.exp_avg_sq[n],
            }
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


def from_per_param(
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
                from_per_param(part, FrozenDict(sub), {n: e for n, e in entries.items() if n in sub}, layout)
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


def is_sharded(value: Any) -> bool:
    """Shard-shaped state (1-D like the master shard) as opposed to replicated scalars."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def group_plan(optimizer: optim.Optimizer, names: tuple[str, ...]) -> list[tuple[list[str], dict[str, Any]]]:
    """Non-empty param groups in group order: (names, hyperparameters)."""
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(optimizer.group_index(n), []).append(n)
    return [(groups[i], dict(optimizer.hyperparams(groups[i][0]))) for i in sorted(groups)]


@functools.lru_cache(maxsize=64)
def torch_defaults(cls: type[torch.optim.Optimizer], given: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Every hyperparameter a param group of ``cls`` carries (torch's own state dicts have them all,
    and torch's ``step`` reads them), for a group built with ``given``."""
    instance = cls([torch.zeros(2, 2, requires_grad=True)], **dict(given))
    group: dict[str, Any] = {"params": []}
    instance.__setstate__({"state": {}, "param_groups": [group]})  # keys later torch releases added
    return {**instance.defaults, **{k: v for k, v in group.items() if k != "params"}}


def loss_scale_to_dict(state: ZeroState) -> dict[str, Any] | None:
    """The loss-scale state as Python numbers (float scale, int counters), as files keep it."""
    ls = getattr(state, "loss_scale", None)
    if ls is None:
        return None
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in ls._asdict().items()}


def with_loss_scale(state: ZeroState, saved: Mapping[str, Any] | None) -> ZeroState:
    """A loaded state with the saved loss-scale state, and its numbers as 0-d tensors on its device.

    Files keep Python numbers (those written before the state held tensors too); the state
    holds tensors, as ``shard_params`` makes them.
    """
    current = getattr(state, "loss_scale", None)
    if saved is not None and current is not None:
        state = state.replace(loss_scale=type(current)(**saved))
    return state._with_tensor_numbers()


def optimizer_for(
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
        check_same_optimizer(zmeta, optimizer)
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
    if optimizer._init is generic_init:
        try:
            torch_keys = set(torch_defaults(optimizer.torch_class, ()))
        except (TypeError, ValueError):  # a user's class with required arguments: what the optimizer names
            torch_keys = set()
        keys |= torch_keys - {"params", "differentiable", "capturable"}
    return keys


def part_groups(optimizer: optim.Optimizer, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """A partition's parts for the sharded checkpoint's metadata: each part's name and its
    non-empty param groups (names, hyperparameters), in part order."""
    names_of: list[list[str]] = [[] for _ in optimizer.parts]
    for n in names:
        names_of[optimizer.part_index(n)].append(n)
    return [
        {"optimizer": part.name, "param_groups": [{**hp, "params": ns} for ns, hp in group_plan(part, tuple(ns))]}
        for (_, part), ns in zip(optimizer.parts, names_of, strict=True)
    ]


def with_part_groups(optimizer: optim.Optimizer, saved: list[Mapping[str, Any]]) -> optim.Optimizer:
    """``optimizer`` (a partition) with each part's saved hyperparameters (``part_groups``)."""
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
        optimizer = optimizer.with_part(k, optimizer_for(list(entry["param_groups"]), list, None, part))
    return optimizer


def check_same_optimizer(zmeta: Mapping[str, Any] | None, optimizer: optim.Optimizer) -> None:
    """A zerofn state dict names the optimizer that saved it: it must be ``optimizer``'s kind."""
    if zmeta is not None and zmeta["optimizer"]["name"] != optimizer.name:
        raise CheckpointError(
            f"the checkpoint holds {zmeta['optimizer']['name']} state, but the optimizer is {optimizer.name}; "
            "load it with the optimizer that saved it"
        )


def saved_optimizer(zmeta: Mapping[str, Any] | None) -> optim.Optimizer:
    """The optimizer a zerofn state dict names (for validation before the real one is rebuilt)."""
    if zmeta is None:
        raise CheckpointError(
            "this is a plain torch optimizer state dict: pass optimizer=zf.optim.adamw(...) (or the "
            "matching factory) so zerofn knows which update rule the state belongs to"
        )
    return optimizer_for([], lambda idx: [], zmeta, None)
