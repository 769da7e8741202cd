"""``step_shards``: overflow decided on every rank, unscale and clip, the optimizer on this rank's shards.

One body serves eager and compiled calls (the state's step count and loss scale are 0-d
tensors either way); the errors it raises on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn import _placement, _traced, flat
from zerofn._comm import Group
from zerofn._norm import exact_sqrt, local_norm_term
from zerofn._tree import FrozenDict
from zerofn.layout import layout_by_fingerprint
from zerofn.precision import (
    LossScaleState,
    NonFiniteGradError,
    nonfinite_grad_names,
    unscale_and_clip_coef,
    unscaled_norm,
)
from zerofn.state import StepInfo, ZeroState
from zerofn.torch_optim import refuse_uncompiled


def step_shards(
    state: ZeroState,
    grad_shards: Mapping[str, torch.Tensor],
    group: Group = None,
    max_norm: float | None = None,
    *,
    norm_type: float = 2.0,
    donate: bool = False,
    veto: object = None,
) -> tuple[ZeroState, StepInfo]:
    r"""Decide overflow on every rank, unscale and clip, and apply the optimizer to this rank's shards.

    The gradient shards carry the loss scale :math:`s` = ``state.loss_scale.scale``
    (1.0 without loss scaling). In order:

    1. the global ``norm_type`` norm :math:`n` of the (scaled) mean gradient over all
       ranks' shards, in float64, and whether any element on any rank is ``inf``/``nan``:
       both in ONE scalar all-reduce over ``group``, before any state changes, so every
       rank takes the same branch;
    2. the loss scaler advances: ``policy.loss_scaler.update(loss_scale, found)``, the
       same inputs on every rank, so the same new scale everywhere;
    3. if some element was not finite: with ``policy.nonfinite == "skip"`` the step is
       skipped on every rank (master, optimizer state and step count untouched; only the
       loss-scale state advances, e.g. a backoff); with ``"raise"`` every rank raises
       :class:`~zerofn.precision.NonFiniteGradError` naming the params (collected from
       all ranks) and the state is unchanged;
    4. otherwise the gradients move to the state device (CPU offload) and are multiplied
       once by the unscale-and-clip coefficient
       (:func:`~zerofn.precision.unscale_and_clip_coef`, with the scale the gradients
       carry, i.e. the *old* one):

       .. math:: c = \frac{n/s + 10^{-6}}{m},\qquad
                 \text{coef} = \frac{1}{s \cdot \max(1, c)}

       in the wider of the gradient and master dtypes, cast to the master dtype, and the
       optimizer updates the master shards (float32 copies, or the working-dtype shards
       themselves with ``master_weights=False``).

    Params absent from ``grad_shards`` (no gradient this step) keep their shard and their
    optimizer state, as torch.optim does.

    Args:
      state: the current state.
      grad_shards: from :func:`reduce_grads`: name -> ``(shard_numel,)`` shard, on the
        params' device, in any floating dtype (the working or accumulation dtype).
      group: the sharding process group (``None``: default).
      max_norm: clip threshold for the true (unscaled) norm, or ``None`` for no clipping.
      norm_type: 2.0 or ``math.inf``.
      donate: reuse ``state``'s and ``grad_shards``' tensors in place; do not use them after.
      veto: a picklable reason (not ``None``) this rank has, outside the function's own
        checks, for no rank to apply this step (the facade's: its params were changed by
        the user since the last step). It rides as a flag in the scalar all-reduce; if any
        rank vetoes, every rank raises :class:`StepVetoed` carrying every rank's veto, with
        ``state`` and ``grad_shards`` untouched (also under ``donate``), so the caller can
        act on the same list on every rank and call again.

    Returns:
      ``(new_state, info)`` with ``new_state.step == state.step + 1`` unless skipped (the
      step count and the loss-scale state are 0-d tensors, as ``shard_params`` makes them;
      a state built by hand with Python numbers comes back with them as tensors);
      ``info.grad_norm`` is the true norm :math:`n/s`, and ``info``'s fields are Python
      numbers. A skipped step returns ``state`` itself when the loss-scale state did not
      move, else ``state`` with only ``loss_scale`` replaced (the same tensors).

    Raises:
      NonFiniteGradError: on every rank, when a gradient element on any rank is not finite
        and ``state.precision.nonfinite == "raise"``.
      StepVetoed: on every rank, when some rank passed a ``veto``.

    Collectives: one ``all_reduce`` of two float64 scalars (norm and non-finite flag);
    with ``nonfinite="raise"`` and a bad step, one object all-gather of the offending
    names before raising.

    Under ``torch.compile`` (one graph with the other stage functions) the same body runs
    without a host sync, bitwise equal with ``backend="aot_eager"``: the overflow decision,
    the loss-scale update and the coefficient are tensor math, a skipped step is a
    ``torch.where`` between the old and the updated state, and ``info``'s fields are 0-d
    tensors (float64, bool, float64). The checks above run once per trace; their verdict,
    and the errors, on every call. Eagerly the step reads the all-reduced scalars on the
    host once, runs no update when it skips, and multiplies by a Python float.
    """
    comm.group_rank(group)  # a rank outside the group cannot take part: raise here, alone
    # Validate locally, then tell the other ranks through the norm all-reduce itself (a
    # third flag), so a bad input on one rank makes every rank raise, none waits.
    failure = _validate_step(state, grad_shards, group, max_norm, norm_type)
    tracing = comm.tracing()
    if tracing:
        refuse_uncompiled(state.optimizer)  # (the same on every rank: before any collective of the graph)
        if not isinstance(state.step, torch.Tensor):
            _traced.refuse(_NOT_TENSORS)
    else:
        state = state._with_tensor_numbers()  # a state built by hand with Python numbers
    policy, loss_scale = state.precision, state.loss_scale
    refused = failure is not None or veto is not None
    device = state.work_device
    pieces = grad_shards.pieces() if isinstance(grad_shards, flat.FlatDict) else grad_shards.values()
    local = local_norm_term(pieces if failure is None else [], norm_type, device)
    finite = torch.isfinite(local)
    packed = torch.stack(
        [
            torch.where(finite, local, torch.zeros_like(local)),
            (~finite).to(torch.float64),
            torch.full((), float(refused), dtype=torch.float64, device=device),
        ]
    )
    total = comm.all_reduce_scalars(packed, "max" if norm_type == math.inf else "sum", group)
    coef: float | torch.Tensor
    if not tracing:
        # Eagerly every rank reads the all-reduced scalars once and branches on them: a
        # skipped step runs no update, and the coefficient is a Python float.
        norm_sq, flag, rejected = total.tolist()
        if rejected > 0:
            _raise_rejected(failure, group, veto)
        if flag > 0:
            new_loss_scale = policy.loss_scaler.update(loss_scale, True)
            if policy.nonfinite == "raise":
                _raise_nonfinite(state, grad_shards, group)
            skipped = state if new_loss_scale is loss_scale else state.replace(loss_scale=new_loss_scale)
            return skipped, StepInfo(math.inf, True, 1.0)
        new_loss_scale = policy.loss_scaler.update(loss_scale, False)
        scale = float(loss_scale.scale)
        norm = math.sqrt(norm_sq) if norm_type == 2.0 else norm_sq
        coef = unscale_and_clip_coef(norm, scale, max_norm)
        true_norm = unscaled_norm(norm, scale)
        clipped = max_norm is not None and (true_norm + 1e-6) / max_norm > 1
        info = StepInfo(true_norm, False, max_norm / (true_norm + 1e-6) if clipped else 1.0)
        found = None
    else:
        coef, found, new_loss_scale, info = _traced_scalars(
            state, grad_shards, group, max_norm, norm_type, total, failure, veto
        )
    flat_grads = _as_flat(state, grad_shards)
    if flat_grads is not None:
        owned = donate or flat_grads is not grad_shards
        grads: Mapping[str, torch.Tensor] = _scaled_flat(state, flat_grads, coef, owned)
    else:
        grads = _scaled(state, grad_shards, coef, donate)
    new_master, new_opt_state = state.optimizer.update(
        grads, state.opt_state, state.master, donate=donate and not tracing
    )
    new_master, new_opt_state = _keep_flat(state, new_master, new_opt_state)
    if found is None:
        master, opt_state, step = new_master, new_opt_state, state.step + 1
    else:  # compiled: a skipped step selects the old state (the update ran, its results are dropped)
        master, opt_state = _select_unless(found.to(state.state_device), state, new_master, new_opt_state)
        step = torch.where(found, state.step, state.step + 1)
    new_state = state.replace(master=master, opt_state=opt_state, step=step, loss_scale=new_loss_scale)
    return new_state, info


def _as_flat(state: ZeroState, grad_shards: Mapping[str, torch.Tensor]) -> flat.FlatDict | None:
    """The gradient shards over the master's flat layout: themselves, packed from a plain mapping
    (one ``cat`` per buffer), or ``None`` when the master is not flat or they cannot be held flat."""
    master = state.master
    if not isinstance(master, flat.FlatDict):
        return None
    fl = master.flat_layout
    if isinstance(grad_shards, flat.FlatDict):
        return grad_shards if grad_shards.flat_layout == fl else None
    if not grad_shards or not flat.packable(fl, grad_shards):
        return None
    return flat.pack(fl, grad_shards)


def _scaled_flat(state: ZeroState, grads: flat.FlatDict, coef: float | torch.Tensor, owned: bool) -> flat.FlatDict:
    """:func:`_scaled` once per flat buffer (and loose tensor): moved to the state device, times
    ``coef`` in the wider dtype, cast to the master's dtype. Zero ranges stay zero."""
    master = state.master
    assert isinstance(master, flat.FlatDict)
    device = state.state_device

    def scale(g: torch.Tensor, target: torch.dtype) -> torch.Tensor:
        moved = _placement.to_device({"g": g}, device)["g"]
        wide = torch.promote_types(g.dtype, target)
        if isinstance(coef, torch.Tensor):
            moved = moved.to(wide) * coef.to(device, wide)  # x * 1.0 == x: no branch
        elif coef != 1.0:
            mine = owned or moved is not g
            moved = moved.mul_(coef) if mine and moved.dtype == wide else moved.to(wide) * coef
        return moved.to(target)

    buffers = [None if g is None else scale(g, _buffer_dtype(master, i, g)) for i, g in enumerate(grads.buffers)]
    loose = {n: scale(g, master[n].dtype) for n, g in grads.loose.items()}
    return grads.with_buffers(buffers, loose)


def _buffer_dtype(master: flat.FlatDict, i: int, g: torch.Tensor) -> torch.dtype:
    b = master.buffers[i]
    return g.dtype if b is None else b.dtype


def _scaled(
    state: ZeroState, grad_shards: Mapping[str, torch.Tensor], coef: float | torch.Tensor, donate: bool
) -> dict[str, torch.Tensor]:
    """Per name: the gradient shard on the state device, times ``coef``, in the master's dtype."""
    moved = _placement.to_device(grad_shards, state.state_device)  # CPU offload: grads go to the state
    grads = {}
    for name, g in moved.items():
        target = state.master[name].dtype
        wide = torch.promote_types(g.dtype, target)
        if isinstance(coef, torch.Tensor):
            g = g.to(wide) * coef.to(state.state_device, wide)  # x * 1.0 == x: no branch
        elif coef != 1.0:
            owned = donate or g is not grad_shards[name]
            g = g.mul_(coef) if owned and g.dtype == wide else g.to(wide) * coef
        grads[name] = g.to(target)
    return grads


def _validate_step(
    state: ZeroState, grad_shards: Mapping[str, torch.Tensor], group: Group, max_norm: float | None, norm_type: float
) -> Exception | None:
    """``step_shards``' local checks (static metadata only): the error, or ``None``."""
    try:
        checks.validate_world(state.layout, group, "step_shards")
        if comm.group_rank(group) != state.rank:
            raise ValueError(
                f"step_shards: the state holds rank {state.rank}'s shards but this process is rank "
                f"{comm.group_rank(group)} of the group"
            )
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"step_shards: norm_type must be 2.0 or math.inf, got {norm_type!r}")
        if max_norm is not None and not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"step_shards: max_norm must be a positive finite number or None, got {max_norm!r}")
        for name, shape, dtype in _metadata_to_check(state, grad_shards):
            if name not in state.layout:
                raise KeyError(f"step_shards on rank {state.rank}: gradient shard for unknown param {name!r}")
            spec = state.layout[name]
            expected = spec.local_shape(state.rank)
            if expected is None:
                raise ValueError(
                    f"step_shards on rank {state.rank}: got a gradient for whole param {name!r} (shape {spec.shape}), "
                    f"which rank {spec.owner} owns; pass the output of reduce_grads on this rank"
                )
            if shape != expected:
                what = "the full shape of a whole param this rank owns" if spec.is_whole else "a split param"
                raise ValueError(
                    f"step_shards on rank {state.rank}: shard of {name!r} has shape {shape}, expected "
                    f"{expected} ({what}) for a param of shape {spec.shape} over {state.layout.world_size} ranks; "
                    "pass the output of reduce_grads, not full gradients"
                )
            if not dtype.is_floating_point:
                raise TypeError(f"step_shards on rank {state.rank}: shard of {name!r} has dtype {dtype}, not floating")
    except (TypeError, ValueError, KeyError) as e:
        return e
    return None


def _metadata_to_check(
    state: ZeroState, grad_shards: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """What :func:`_validate_step` checks per name. Shards on the master's own flat layout
    (what ``reduce_grads`` returns) are right in names and shapes by construction: only each
    buffer (as its first name) and the loose tensors are checked, so a compiled step traces
    no loop over the names."""
    master = state.master
    if not (
        isinstance(grad_shards, flat.FlatDict)
        and isinstance(master, flat.FlatDict)
        and grad_shards.flat_layout is master.flat_layout
    ):
        yield from _shard_metadata(grad_shards)
        return
    fl = grad_shards.flat_layout
    for group, buf in zip(fl.groups, grad_shards.buffers, strict=True):
        if buf is not None:
            name = group.names[0]
            yield name, fl.shapes[name] if buf.numel() == group.numel else tuple(buf.shape), buf.dtype
    for name, t in grad_shards.loose.items():
        yield name, tuple(t.shape), t.dtype


def _shard_metadata(grad_shards: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every gradient shard; for a FlatDict from its layout and
    buffers, without making a view per name."""
    if not isinstance(grad_shards, flat.FlatDict):
        for name, g in grad_shards.items():
            yield name, tuple(g.shape), g.dtype
        return
    fl, buffers, loose = grad_shards.flat_layout, grad_shards.buffers, grad_shards.loose
    for name in grad_shards.names:
        g = fl.where[name][0]
        t = loose[name] if g < 0 else buffers[g]
        yield name, tuple(t.shape) if g < 0 else fl.shapes[name], t.dtype  # type: ignore[union-attr]


_NOT_TENSORS = (
    "step_shards under torch.compile: the state's step and loss scale are Python numbers (a state built by "
    "hand), which a compiled graph would bake in as constants and recompile on every change; pass the state "
    "from shard_params, whose numbers are 0-d tensors, or state.as_tensors()"
)


def _traced_scalars(
    state: ZeroState,
    grad_shards: Mapping[str, torch.Tensor],
    group: Group,
    max_norm: float | None,
    norm_type: float,
    total: torch.Tensor,
    failure: Exception | None,
    veto: object,
) -> tuple[torch.Tensor, torch.Tensor, LossScaleState, StepInfo]:
    """A compiled step's decisions from the all-reduced scalars, as tensor math (no host sync).

    The local checks ran once, at trace time (shapes and dtypes are static); their
    verdict rides in the scalar all-reduce as eagerly, and :func:`zerofn._traced.verdict`
    raises the eager errors on every rank when a rank rejected its input, or, with
    ``nonfinite="raise"``, when a gradient is not finite. Otherwise the overflow flag is a
    tensor every rank got from the same all-reduce, the loss scaler advances by tensor
    math, and the unscale-and-clip coefficient is a float64 tensor computed as
    :func:`unscale_and_clip_coef` computes it. Returns ``(coef, found, new loss scale, info)``.
    """
    policy, loss_scale = state.precision, state.loss_scale
    # The shards the handler names non-finite ones from: flat, one tensor per run of the
    # buffers (and the members' sizes to cut it by), so the graph does not grow with the
    # tensor count; per name otherwise.
    # (The names travel as strings and the layout as its fingerprint: a tuple per name
    # would cost a compiled step's trace per name.)
    is_flat = isinstance(grad_shards, flat.FlatDict)
    if is_flat:
        names = grad_shards.names
        tensors = grad_shards.pieces()
    else:
        names = tuple(grad_shards)
        tensors = [grad_shards[n] for n in names]
    desc = (
        comm.group_name(group),
        _traced.failure_desc(failure),
        None if veto is None else repr(veto),
        policy.nonfinite,
        state.rank,
        state.layout.fingerprint,
        "\0".join(names),
        is_flat,
    )
    _traced.verdict(total, "step_shards", desc, tensors)
    found = total[1] > 0
    norm = torch.where(
        found, torch.full_like(total[0], math.inf), exact_sqrt(total[0]) if norm_type == 2.0 else total[0]
    )
    new_loss_scale = policy.loss_scaler.update(loss_scale, found)
    scale = loss_scale.scale
    finite_norm = torch.where(found, torch.zeros_like(norm), norm)
    true_norm = finite_norm / scale
    div = scale if isinstance(scale, torch.Tensor) else torch.full_like(norm, scale)
    clip_info = torch.ones_like(norm)
    if max_norm is not None:
        clip = (true_norm + 1e-6) / max_norm
        div = torch.where(clip > 1, clip * scale, div)
        clip_info = torch.where(clip > 1, max_norm / (true_norm + 1e-6), clip_info)
    coef = 1.0 / div  # unscale_and_clip_coef, in float64 as eagerly
    info = StepInfo(torch.where(found, norm, true_norm), found, torch.where(found, 1.0, clip_info))
    return coef, found, new_loss_scale, info


def _select_unless(
    keep: torch.Tensor, state: ZeroState, new_master: Mapping[str, torch.Tensor], new_opt_state: Any
) -> tuple[FrozenDict[torch.Tensor], Any]:
    """The updated masters and optimizer state where ``keep`` is false, the old ones where it is true."""

    # A 0-d tensor shared by names (a flat state's step count) stays shared: found with `is`
    # (id() would guard on the object).
    chosen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def select(old: Any, new: Any) -> Any:
        if not (isinstance(new, torch.Tensor) and old is not None):
            return new
        if new.dim() != 0:
            return torch.where(keep, old, new)
        for o, n, picked in chosen:
            if o is old and n is new:
                return picked
        picked = torch.where(keep, old, new)
        chosen.append((old, new, picked))
        return picked

    old_leaves, spec = pytree.tree_flatten(state.opt_state)
    new_leaves, new_spec = pytree.tree_flatten(new_opt_state)
    if spec != new_spec or any(o is None and n is not None for o, n in zip(old_leaves, new_leaves, strict=True)):
        _traced.refuse(
            f"step_shards under torch.compile: zerofn.optim.{state.optimizer.name}'s state changes its structure "
            "in a step (a buffer created on the first step); run one step eagerly before compiling"
        )
    opt_state = pytree.tree_unflatten([select(o, n) for o, n in zip(old_leaves, new_leaves, strict=True)], spec)
    if isinstance(new_master, flat.FlatDict) and isinstance(state.master, flat.FlatDict):
        return pytree.tree_map(select, state.master, new_master), opt_state
    return FrozenDict({n: select(state.master[n], t) for n, t in new_master.items()}), opt_state


def _keep_flat(
    state: ZeroState, new_master: Mapping[str, torch.Tensor], new_opt_state: Any
) -> tuple[Mapping[str, torch.Tensor], Any]:
    """The optimizer's results held flat again when the state was (one ``cat`` per buffer for an
    optimizer that returns per-name tensors; nothing to do for one that returns FlatDicts).

    Eagerly every name -> shard mapping of the new optimizer state that can be held flat is
    (so a state loaded per name, or SGD's momentum made at the first step, becomes flat);
    in a compiled step the state keeps its structure exactly: flat where it was flat.
    """
    master = state.master
    if isinstance(master, flat.FlatDict) and not isinstance(new_master, flat.FlatDict):
        fl = master.flat_layout
        new_master = flat.pack(fl, new_master) if flat.packable(fl, new_master) else new_master
    if comm.tracing():
        if not isinstance(master, flat.FlatDict) or not isinstance(new_master, flat.FlatDict):
            new_master = FrozenDict(dict(new_master.items()))
        return new_master, _match_flat(state.opt_state, new_opt_state)
    if not isinstance(new_master, flat.FlatDict):
        return FrozenDict(new_master), new_opt_state
    return new_master, flat.flatten_like(new_master, new_opt_state)


def _match_flat(old: Any, new: Any) -> Any:
    """``new`` with FlatDicts exactly where ``old`` has them (packed, or unpacked to per-name views)."""
    if isinstance(old, flat.FlatDict):
        fl = old.flat_layout
        if isinstance(new, flat.FlatDict) or not isinstance(new, Mapping) or not flat.packable(fl, new):
            return new
        return flat.pack(fl, new)
    if isinstance(new, flat.FlatDict):
        return FrozenDict(dict(new.items()))
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        matched = [_match_flat(o, n) for o, n in zip(old, new, strict=True)]
        return type(new)(*matched) if hasattr(new, "_fields") else tuple(matched)
    return new


@_traced.handler("step_shards")
def _settle_step(
    total: torch.Tensor,
    shards: list[torch.Tensor],
    group_name: str | None,
    failure: tuple[str, str] | None,
    veto: str | None,
    nonfinite: str,
    rank: int,
    fingerprint: str,
    joined_names: str,
    is_flat: bool,
) -> None:
    """A compiled ``step_shards``' verdict on the all-reduced scalars: return, or raise the eager error everywhere.

    ``shards``: one per name (``joined_names``, NUL-separated), or when ``is_flat`` one per
    run of the rank's flat layout under the layout with ``fingerprint`` (cut into its
    members' shards; a loose tensor is one name).
    """
    group = comm.group_from_name(group_name)
    if total[2] > 0:
        _raise_rejected(None if failure is None else _traced.rebuild_failure(failure), group, veto)
    if total[1] > 0 and nonfinite == "raise":
        layout = layout_by_fingerprint(fingerprint)
        assert layout is not None, "zerofn: a compiled step's layout is alive while it runs"
        names = tuple(joined_names.split("\0")) if joined_names else ()
        if is_flat:
            fl = flat.flat_layout(layout, rank)
            shards = [
                t
                for piece, (g, _, _, members) in zip(shards, fl.runs(names), strict=True)
                for t in ([piece] if g < 0 else piece.split([fl.where[m][2] for m in members]))
            ]
        _raise_nonfinite_names(rank, layout.names, dict(zip(names, shards, strict=True)), group)


class StepVetoed(RuntimeError):
    """Raised by ``step_shards`` on every rank when some rank passed a ``veto``; nothing was applied.

    Attributes:
      vetoes: every rank's ``veto`` argument, by group rank (``None`` for ranks without one),
        the same list on every rank.
    """

    def __init__(self, vetoes: list[object]) -> None:
        ranks = [r for r, v in enumerate(vetoes) if v is not None]
        super().__init__(f"step_shards: ranks {ranks} vetoed this step, so no rank applied it")
        self.vetoes = vetoes


def _raise_rejected(failure: Exception | None, group: Group, veto: object = None) -> None:
    """Every rank: some rank found its ``step_shards`` input invalid or vetoed; all raise, none changed state."""
    everyone = comm.all_gather_objects(
        (None if failure is None else f"{type(failure).__name__}: {failure}", veto), group
    )
    if failure is not None:
        raise failure
    bad = next(((r, w) for r, (w, _) in enumerate(everyone) if w is not None), None)
    if bad is not None:
        raise checks.RankMismatchError(
            f"step_shards: rank {bad[0]} rejected its input ({bad[1]}), so no rank applied this step; fix the input "
            "on that rank"
        )
    raise StepVetoed([v for _, v in everyone])


def _raise_nonfinite(state: ZeroState, grad_shards: Mapping[str, torch.Tensor], group: Group) -> None:
    """Every rank: collect which params hold non-finite shards where, then raise the same error.

    Only called once the scalar all-reduce has told every rank that the step is bad, so
    every rank issues this one object all-gather and raises: none is left waiting.
    """
    _raise_nonfinite_names(state.rank, state.layout.names, grad_shards, group)


def _raise_nonfinite_names(
    rank: int, layout_names: tuple[str, ...], grad_shards: Mapping[str, torch.Tensor], group: Group
) -> None:
    everyone = comm.all_gather_objects(nonfinite_grad_names(grad_shards), group)
    where = {
        name: [r for r, names in enumerate(everyone) if name in names]  # type: ignore[operator]
        for name in layout_names
        if any(name in names for names in everyone)  # type: ignore[operator]
    }
    if where:
        listing = "; ".join(f"{name!r} (in the shards of ranks {ranks})" for name, ranks in where.items())
        what = f"gradients of these params hold inf or nan: {listing}"
    else:
        what = "no gradient element is inf or nan, but the squared global norm overflowed float64"
    raise NonFiniteGradError(
        f"step_shards on rank {rank}: {what}. The policy says nonfinite='raise', so no rank applied "
        "this step and the state is unchanged. Find the cause (a bad batch, a too large learning rate, an "
        "overflow in the forward), or use PrecisionPolicy(nonfinite='skip') to skip such steps."
    )
