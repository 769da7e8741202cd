"""What a load checks against the live state before it reads a tensor.

The model (names, shapes, dtypes), the placements, the format version, the model's
buffers, and (for a torch-format state dict of a matrix-only class) the per-param state.
Every check raises :class:`CheckpointError` naming the param and the shapes, and none
changes anything. No collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _state_dict_checks, optim
from zerofn._comm import Group
from zerofn.buckets import cut_shard
from zerofn.checkpoint._errors import CheckpointError
from zerofn.checkpoint._format import FORMAT_VERSION
from zerofn.layout import ShardLayout, make_layout


def check_version(zmeta: Mapping[str, Any]) -> None:
    version = zmeta.get("version", FORMAT_VERSION)  # entries written before versioning are version 1
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"the state dict's zerofn entry has format version {version!r}; this zerofn reads version "
            f"{FORMAT_VERSION}: load it with the zerofn release that wrote it"
        )


def check_fits(zmeta: Mapping[str, Any], layout: ShardLayout) -> None:
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


def check_placements(saved: Mapping[str, str], layout: ShardLayout) -> None:
    """Split params are saved as shards of the flat param, whole ones full-shaped: they must
    agree. ``saved``: name -> placement, as the checkpoint records them."""
    for p in layout.params:
        if saved[p.name] != p.placement:
            raise CheckpointError(
                f"param {p.name!r} was saved {saved[p.name]} and would load {p.placement}: the optimizer that "
                "loads it must place it as the one that saved it did (the same optimizer, the same placement override)"
            )


def layout_and_masters(
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


# Torch classes whose constructor refuses any param that is not 2-D. The general checks
# (zerofn._state_dict_checks) probe hyperparameters on a 1-D param, which these refuse, so
# their state dicts are checked here with the same declarations on the params' own shapes.
MATRIX_ONLY = frozenset({"Muon"})


def matrix_only_problem(
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


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds (persistent ones), by their state-dict names."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def buffer_meta(buffers: Mapping[str, torch.Tensor] | None) -> dict[str, list[Any]] | None:
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
    mine = buffer_meta(buffers) or {}
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
