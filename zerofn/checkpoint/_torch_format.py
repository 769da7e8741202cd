"""The full state dict in ``torch.optim`` format: :func:`full_state_dict` gathers it on
every rank, :func:`shard_state_dict` cuts this rank's shards out of one (from zerofn at
any world size, or from a plain torch optimizer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _state_dict_checks, lowbit, optim
from zerofn._comm import Group
from zerofn._tree import FrozenDict
from zerofn.buckets import cut_shard
from zerofn.checkpoint._errors import CheckpointError
from zerofn.checkpoint._format import FORMAT_VERSION
from zerofn.checkpoint._gather import cpu_copy, gather_full, gather_quantized, gather_whole
from zerofn.checkpoint._optimizer import (
    check_same_optimizer,
    from_per_param,
    group_plan,
    is_sharded,
    loss_scale_to_dict,
    optimizer_for,
    per_param,
    saved_optimizer,
    torch_defaults,
    with_loss_scale,
)
from zerofn.checkpoint._residual import (
    check_bucket_numel,
    check_saved_rows,
    compressed_names,
    feedback_wire,
    gather_rows,
    own_or_resharded,
    with_residual,
)
from zerofn.checkpoint._validate import (
    MATRIX_ONLY,
    buffer_meta,
    check_buffers,
    check_fits,
    check_version,
    layout_and_masters,
    matrix_only_problem,
)
from zerofn.layout import ParamSpec, ShardLayout, make_layout
from zerofn.precision import PrecisionPolicy
from zerofn.stages import DEFAULT_BUCKET_NUMEL
from zerofn.state import DEFAULT_POLICY, ZeroState

__all__ = ["full_state_dict", "shard_state_dict"]


# Per-param scalars in torch optimizers' state (everything else is per element).
_SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def _is_per_element(key: str, value: Any, spec: ParamSpec) -> bool:
    """In a *full* state dict: a param-shaped tensor, one value per element of the param.

    A 0-d param makes shapes ambiguous (its ``exp_avg`` is 0-d like ``step``), so the
    known scalar keys of torch's optimizers decide there.
    """
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != spec.shape:
        return False
    return spec.shape != () or key not in _SCALAR_KEYS


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

    A state with a compressed wire's residual (error feedback) adds ``"zerofn"["residual"]``
    (in the first dict of a list): name -> float32 ``(N, numel)`` CPU tensor per compressed
    param, row ``s`` rank ``s``'s residual laid out over the param's flattened elements
    (zeros on its own chunk), in the saved loss scale's units (:mod:`zerofn.checkpoint._residual`).

    Collectives: bucketed all-gathers of every shard-shaped state field and the masters of
    the split params; with whole params one object all-gather of the owners' state; with
    a residual one gather of every rank's residual rows.
    """
    result = _full_state_dict(state, group, bucket_numel)
    first = result[0] if isinstance(result, list) else result
    if buffers is not None:
        first["zerofn"]["buffers"] = {n: b.detach().to("cpu", copy=True) for n, b in buffers.items()}
    residual = gather_rows(state, group)
    if residual:
        first["zerofn"]["residual"] = residual
    return result


def _full_state_dict(state: ZeroState, group: Group, bucket_numel: int) -> dict[str, Any] | list[dict[str, Any]]:
    """:func:`full_state_dict` without the buffers."""
    layout = state.layout
    entries = per_param(state.opt_state, layout.names)
    split = {n for n in layout.names if not layout[n].is_whole}

    def plain(v: Any) -> bool:
        return is_sharded(v) and not lowbit.is_quantized(v)

    keys = sorted({k for n, e in entries.items() if n in split for k, v in e.items() if plain(v)})
    gathered = {
        k: gather_full(
            {n: e[k] for n, e in entries.items() if n in split and k in e and plain(e[k])}, layout, group, bucket_numel
        )
        for k in keys
    }
    quantized = gather_quantized(entries, layout, group)
    master = gather_full({n: t for n, t in state.master.items() if n in split}, layout, group, bucket_numel)
    full_entries: dict[str, dict[str, Any]] = {
        n: {
            k: quantized[n, k] if lowbit.is_quantized(v) else gathered[k][n] if is_sharded(v) else cpu_copy(v)
            for k, v in e.items()
        }
        for n, e in entries.items()
        if n in split
    }
    if layout.has_whole:
        whole_masters, whole_entries = gather_whole(state, entries, group)
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


def _torch_format(
    state: ZeroState,
    optimizer: optim.Optimizer,
    names: tuple[str, ...] | list[str],
    full_entries: Mapping[str, Mapping[str, Any]],
    master: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """One torch-format state dict over ``names`` (full tensors), with its ``"zerofn"`` entry."""
    layout = state.layout
    plan = group_plan(optimizer, tuple(names))
    if optimizer.name not in ("sgd", "adam", "adamw"):  # a torch class driven as-is: its full defaults
        base = torch_defaults(optimizer.torch_class, tuple(sorted(optimizer.defaults.items(), key=lambda kv: kv[0])))
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
            "step": int(state.step),
            "loss_scale": loss_scale_to_dict(state),
            "optimizer": {"name": optimizer.name, "torch_class": optimizer.torch_class.__name__},
        },
    }


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
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
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
      bucket_numel: the state's ``bucket_numel`` (its buckets' size, which a compressed
        wire's residual follows): what ``shard_params`` was given for the run that continues.

    With ``precision.wire`` keeping error feedback, the residual comes from
    ``"zerofn"["residual"]``: each rank's own row at the saved world size (bitwise), else
    every saved sender's sum split over the new senders (:mod:`zerofn.checkpoint._residual`);
    zeros for params without a saved residual. Without such a wire a saved residual is dropped.

    Raises:
      CheckpointError: before anything is built, when the state dict does not fit: another
        model (param shapes), another optimizer (state keys), another grouping, state that
        is one rank's shard, missing or invalid hyperparameters, or a zerofn entry of an
        unknown format version, a residual that is not float32 (N_saved, numel) per param of
        the model, or a bad bucket_numel. The message names the param, key and shapes.

    Returns:
      The ZeroState; masters from ``full["zerofn"]["master"]`` when present, else ``like``.

    Collectives: none (every rank cuts its own shards out of ``full``).
    """
    first = full[0] if isinstance(full, (list, tuple)) and full else full
    zfirst = first.get("zerofn") if isinstance(first, Mapping) else None
    saved_buffers = zfirst.get("buffers") if isinstance(zfirst, Mapping) else None
    if buffers_out is not None and saved_buffers is not None:
        check_buffers(buffer_meta(saved_buffers), buffers_out, "shard_state_dict")
    check_bucket_numel(bucket_numel, "shard_state_dict")
    shard = _shard_state_dicts if isinstance(full, (list, tuple)) else _shard_state_dict
    state = shard(
        full,  # type: ignore[arg-type]  # the one that takes this kind of ``full``
        like,
        group,
        optimizer=optimizer,
        master_dtype=master_dtype,
        precision=precision,
        group_sizes=group_sizes,
    )
    saved_residual = zfirst.get("residual") if isinstance(zfirst, Mapping) else None
    rows = check_saved_rows(saved_residual, state.layout, "shard_state_dict") if saved_residual is not None else {}
    kept = {n: rows[n] for n in compressed_names(state.layout, feedback_wire(state.precision)) if n in rows}
    state = with_residual(state, own_or_resharded(kept, state.layout, state.rank), bucket_numel)
    if buffers_out is not None and saved_buffers is not None:
        for name, value in saved_buffers.items():
            buffers_out[name].detach().copy_(value)
    return state


def _shard_state_dict(
    full: Mapping[str, Any],
    like: ShardLayout | Mapping[str, torch.Tensor],
    group: Group,
    *,
    optimizer: optim.Optimizer | None,
    master_dtype: torch.dtype,
    precision: PrecisionPolicy | None,
    group_sizes: list[int] | None,
) -> ZeroState:
    """:func:`shard_state_dict` of one dict, without the buffers and the residual."""
    zmeta = full.get("zerofn") if isinstance(full, Mapping) else None
    if isinstance(zmeta, Mapping):
        check_version(zmeta)
    placed_by = optimizer or saved_optimizer(zmeta if isinstance(zmeta, Mapping) else None)
    layout, masters_from_params = layout_and_masters(like, group, master_dtype, placed_by)
    rank = comm.group_rank(group)
    fopt, master, entries, zmeta = _load_one(
        full, layout, layout.names, optimizer, rank, masters_from_params, group_sizes=group_sizes
    )
    return _built_state(layout, fopt, rank, master, entries, zmeta, precision)


def _built_state(
    layout: ShardLayout,
    fopt: optim.Optimizer,
    rank: int,
    master: Mapping[str, torch.Tensor],
    entries: Mapping[str, dict[str, Any]],
    zmeta: Mapping[str, Any] | None,
    precision: PrecisionPolicy | None,
) -> ZeroState:
    """The ZeroState of what :func:`_load_one` cut out (one dict's, or every part's merged).

    ``master`` and ``entries``: this rank's masters and per-param state by name; the step is
    the ``zerofn`` entry's, else the largest saved per-param ``step`` (0 for none); the
    loss-scale state is the ``zerofn`` entry's, else the one a fresh state starts with.
    """
    master_fd = FrozenDict({s.name: master[s.name] for s in layout.params if s.holds(rank)})
    opt_state = from_per_param(fopt, master_fd, entries, layout)
    step = (
        int(zmeta["step"]) if zmeta is not None else max((int(e.get("step", 0)) for e in entries.values()), default=0)
    )
    state = ZeroState(layout, fopt, rank, master_fd, opt_state, step, precision=precision or DEFAULT_POLICY)
    return with_loss_scale(state, zmeta.get("loss_scale") if zmeta else None)  # (ZeroState packs them flat)


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
        check_version(zmeta)
        check_fits(zmeta, checked)
        order: list[str] = list(zmeta["names"])
    else:
        order = list(checked.names)
    # Everything is checked before anything is built: a failed load changes nothing.
    checker = optimizer or saved_optimizer(zmeta)
    check_same_optimizer(zmeta, checker)  # the plainest cause first, before the state's details
    if checker.torch_class.__name__ in MATRIX_ONLY:
        problem = matrix_only_problem(full, checked, order, checker)
    else:
        problem = _state_dict_checks.state_dict_problem(full, checked, order, checker, group_sizes=group_sizes)
    if problem is not None:
        raise CheckpointError(f"cannot load this optimizer state dict: {problem}")
    saved_groups = list(full["param_groups"])
    flat_indices = [i for g in saved_groups for i in g["params"]]
    name_of = dict(zip(flat_indices, order, strict=True))
    fopt = optimizer_for(saved_groups, lambda idx: [name_of[i] for i in idx], zmeta, optimizer)
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
    layout, masters_from_params = layout_and_masters(like, group, master_dtype, optimizer)
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
    return _built_state(layout, fopt, rank, master, entries, zmeta, precision)
