"""``step_shards``: overflow decided on every rank, unscale and clip, the optimizer on this rank's shards.

One body serves eager and compiled calls (the state's step count and loss scale are 0-d
tensors either way); the errors it raises on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerofn import _agreement as agreement
from zerofn import _comm as comm
from zerofn import _placement, _traced, flat
from zerofn._comm import Group
from zerofn._norm import exact_sqrt, local_norm_term
from zerofn._torch_driver import refuse_uncompiled
from zerofn.stages._step_errors import raise_nonfinite, raise_rejected, traced_verdict, validate_step
from zerofn.state import StepInfo, ZeroState


def step_shards(
    state: ZeroState,
    grad_shards: Mapping[str, torch.Tensor],
    group: Group = None,
    max_norm: float | None = None,
    *,
    norm_type: float = 2.0,
    donate: bool = False,
    veto: object = None,
    residual: Sequence[torch.Tensor] | None = None,
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

       in the wider of the gradient and master dtypes, cast to the master dtype (not at
       all when the coefficient is a constant 1: no clipping under ``NoLossScaling``, whose
       scale is 1 by definition, eagerly and compiled alike), and the optimizer updates
       the master shards (float32 copies, or the working-dtype shards
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
      residual: with a compressed wire that keeps error feedback, the ``next_residual``
        ``reduce_grads`` returned with ``grad_shards`` (required then, refused otherwise).
        The new state keeps it, or ``state.residual`` when the step is skipped; either is
        multiplied by ``new_scale / old_scale`` when the loss scale moves (a power of two:
        exact), so it stays in the units of the next step's gradients.

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

    Collectives: one ``all_reduce`` of a few float64 scalars: the norm, the non-finite
    flag, the rejection flag and (at 2 to 16,383 ranks) 20 terms confirming that every
    rank's state has the same layout and ``bucket_numel``
    (:func:`~zerofn._agreement.agreement_terms`). An eager step reads them on the host, a
    compiled one in its graph's verdict node; the state it returns records the verdict in
    ``agreed_in``, so ``gather_params`` of it (in the same graph, when compiled) skips its
    agreement. Ranks whose states disagree all raise :class:`~zerofn.RankMismatchError` (after one all-gather for the
    details) with the state unchanged. With ``nonfinite="raise"`` and a bad step, one
    object all-gather of the offending names before raising.

    Under ``torch.compile`` (one graph with the other stage functions) the same body runs
    without a host sync, bitwise equal with ``backend="aot_eager"``: the overflow decision,
    the loss-scale update and the coefficient are tensor math, a skipped step is the
    optimizer's ``update(..., skip=found)`` (torch's fused Adam kernel writes nothing; other
    rules select the old values with ``torch.where``), and ``info``'s fields are 0-d
    tensors (float64, bool, float64). The checks above run once per trace; their verdict,
    and the errors, on every call. The decision (overflow, coefficient, ``info``) is the
    same tensor math eagerly (:func:`_decide`); eagerly the step reads it on the host once,
    runs no update when it skips, and multiplies by the coefficient as a Python float.
    """
    comm.group_rank(group)  # a rank outside the group cannot take part: raise here, alone
    # Validate locally, then tell the other ranks through the norm all-reduce itself (a
    # third flag), so a bad input on one rank makes every rank raise, none waits.
    failure = validate_step(state, grad_shards, group, max_norm, norm_type) or _residual_failure(state, residual)
    tracing = comm.tracing()
    if tracing:
        refuse_uncompiled(state.optimizer)  # (the same on every rank: before any collective of the graph)
        if not isinstance(state.step, torch.Tensor):
            _traced.refuse(_NOT_TENSORS)
    else:
        state = state._with_tensor_numbers()  # a state built by hand with Python numbers
    policy, loss_scale = state.precision, state.loss_scale
    # Without a loss scale, a Python 1.0: without clipping the coefficient is then the
    # constant 1.0 and no pass multiplies by it, compiled as eagerly.
    scale = loss_scale.scale if policy.scales_loss else 1.0
    refused = failure is not None or veto is not None
    device = state.work_device
    pieces = flat.pieces(grad_shards)
    local = local_norm_term(pieces if failure is None else [], norm_type, device)
    finite = torch.isfinite(local)
    op = "max" if norm_type == math.inf else "sum"
    n = comm.group_size(group)
    # The same all-reduce confirms that every rank steps a state of one layout and bucket
    # size, so the gather after it needs no agreement of its own (ZeroState.agreed_in):
    # eagerly by the host read below, compiled by the graph's verdict node.
    confirms = 1 < n < agreement.MAX_AGREEMENT_RANKS
    terms = agreement.agreement_terms([state.layout.fingerprint_int, state.bucket_numel], op) if confirms else []
    packed = torch.cat(
        [
            torch.stack([torch.where(finite, local, torch.zeros_like(local)), (~finite).to(torch.float64)]),
            torch.tensor([float(refused), *terms], dtype=torch.float64, device=device),
        ]
    )
    total = comm.all_reduce_scalars(packed, op, group)
    if tracing:  # the verdict of every rank's checks, raised on every rank (eagerly: the host read below)
        # The decision reads the verdict's output: the update cannot run before the verdict.
        total = traced_verdict(state, grad_shards, group, failure, veto, total, (n, op) if confirms else None)
        found, coef, info = _decide(total[0], total[1], scale, max_norm, norm_type, _TensorMath(total[0]))
        new_loss_scale = policy.loss_scaler.update(loss_scale, found)
    else:
        # Eagerly every rank reads the all-reduced scalars (and the scale) once and decides on
        # the host, with the same formula: a skipped step runs no update.
        read = torch.cat([total, torch.as_tensor(scale).reshape(1).to(total)])
        norm_sq, flag, rejected, *agreed, scale = read.tolist()
        if rejected > 0:
            raise_rejected(failure, group, veto)
        if agreed and not agreement.agreement_holds(agreed, n, op):  # every rank raises, with the details
            settings = {"bucket_numel": state.bucket_numel}
            agreement.check_ranks_agree(state.layout, group, "step_shards", settings=settings)
        skip, coef, info = _decide(norm_sq, flag, scale, max_norm, norm_type, _FloatMath())
        new_loss_scale = policy.loss_scaler.update(loss_scale, skip)
        if skip:
            if policy.nonfinite == "raise":
                raise_nonfinite(state, grad_shards, group)
            if new_loss_scale is loss_scale:
                return state, info
            kept = _rescaled(state.residual, loss_scale, new_loss_scale)
            return state.replace(loss_scale=new_loss_scale, residual=kept), info
        found = None
    flat_grads = flat.pack(state.master.flat_layout, grad_shards)  # a per-name mapping: one cat per buffer
    grads = _scaled(state, flat_grads, coef, donate or flat_grads is not grad_shards)
    # Compiled, a skipped step is the update's skip: it leaves the values as they were.
    skip = None if found is None else found.to(state.state_device)
    master, opt_state = state.optimizer.update(grads, state.opt_state, state.master, donate=donate, skip=skip)
    master = flat.hold_like(state.master, master)  # an optimizer that computes per name: packed back
    step = state.step + 1 if found is None else torch.where(found, state.step, state.step + 1)
    agreed_in = agreement.agreement_key(group) if confirms or n == 1 else None
    new_state = state.replace(
        master=master,
        opt_state=opt_state,
        step=step,
        loss_scale=new_loss_scale,
        agreed_in=agreed_in,
        residual=_rescaled(tuple(residual or ()), loss_scale, new_loss_scale),
    )
    return new_state, info


def _residual_failure(state: ZeroState, residual: Sequence[torch.Tensor] | None) -> ValueError | None:
    """A ``residual`` that does not match the state's compressed wire, as a local failure."""
    keeps = bool(state.residual)
    if residual is None and keeps:
        return ValueError(
            "step_shards: the state keeps a compressed wire's residual (error feedback): pass residual= the "
            "next_residual that reduce_grads returned with these gradient shards"
        )
    if residual is not None and not keeps:
        return ValueError("step_shards: residual= is for a state with a compressed wire's error feedback")
    if residual is not None:
        for i, (new, old) in enumerate(zip(residual, state.residual, strict=False)):
            if not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype:
                return ValueError(
                    f"step_shards: residual of bucket {i} must be {old.dtype} of shape {tuple(old.shape)} "
                    f"(state.residual's), got {getattr(new, 'dtype', type(new).__name__)}"
                )
        if len(residual) != len(state.residual):
            return ValueError(
                f"step_shards: residual has {len(residual)} buckets, state.residual {len(state.residual)}"
            )
    return None


def _rescaled(residual: tuple[torch.Tensor, ...], old: Any, new: Any) -> tuple[torch.Tensor, ...]:
    """``residual`` in the units of the loss scale ``new`` (it was in ``old``'s): eagerly only."""
    if not residual or new is old:
        return residual
    ratio = float(new.scale) / float(old.scale)
    return residual if ratio == 1.0 else tuple(r * ratio for r in residual)


def _scaled(state: ZeroState, grads: flat.FlatDict, coef: float | torch.Tensor, owned: bool) -> flat.FlatDict:
    """The gradient shards on the state device (CPU offload), times ``coef`` in the wider of
    their dtype and the master's, cast to the master's dtype: once per flat buffer and loose
    tensor. ``owned``: the tensors are this call's to change in place (donated, or packed
    here). Zero ranges stay zero."""
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

    master = state.master
    buffers = [None if g is None else scale(g, b.dtype) for g, b in zip(grads.buffers, master.buffers, strict=True)]
    loose = {n: scale(g, master[n].dtype) for n, g in grads.loose.items()}
    return grads.with_buffers(buffers, loose)


_NOT_TENSORS = (
    "step_shards under torch.compile: the state's step and loss scale are Python numbers (a state built by "
    "hand), which a compiled graph would bake in as constants and recompile on every change; pass the state "
    "from shard_params, whose numbers are 0-d tensors, or state.as_tensors()"
)


class _TensorMath:
    """:func:`_decide`'s arithmetic on 0-d float64 tensors (a compiled step: no host sync)."""

    def __init__(self, like: torch.Tensor) -> None:
        self._like = like

    def where(self, cond: Any, a: Any, b: Any) -> torch.Tensor:
        return torch.where(cond, self._tensor(a), self._tensor(b))

    def _tensor(self, x: Any) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.full_like(self._like, x)

    @staticmethod
    def sqrt(x: torch.Tensor) -> torch.Tensor:
        return exact_sqrt(x)  # math.sqrt's bits


class _FloatMath:
    """:func:`_decide`'s arithmetic on Python floats (IEEE float64, as the tensors'), eagerly."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    sqrt = staticmethod(math.sqrt)


def _decide(
    norm_sq: Any, flag: Any, scale: Any, max_norm: float | None, norm_type: float, xp: _TensorMath | _FloatMath
) -> tuple[Any, Any, StepInfo]:
    r"""The step's decision from the all-reduced norm term and non-finite flag, and the loss scale
    :math:`s` the gradients carry: one formula, on 0-d float64 tensors (``xp`` a
    :class:`_TensorMath`, compiled) or Python floats (:class:`_FloatMath`, eagerly).

    Returns ``(found, coef, info)``: ``found``, some element on some rank was not finite;
    ``coef``, the unscale-and-clip coefficient :func:`~zerofn.precision.unscale_and_clip_coef`
    defines, :math:`1 / (s \max(1, c))` with :math:`c = (n/s + 10^{-6}) / m`; ``info``, the
    true norm :math:`n/s`, ``found`` and the clip factor (``inf``, True, 1.0 when ``found``).
    """
    found = flag > 0
    norm = xp.where(found, math.inf, xp.sqrt(norm_sq) if norm_type == 2.0 else norm_sq)
    true_norm = xp.where(found, 0.0, norm) / scale
    div, clip_info = scale, 1.0
    if max_norm is not None:
        clip = (true_norm + 1e-6) / max_norm
        div = xp.where(clip > 1, clip * scale, div)
        clip_info = xp.where(clip > 1, max_norm / (true_norm + 1e-6), clip_info)
    coef = 1.0 / div
    return found, coef, StepInfo(xp.where(found, norm, true_norm), found, xp.where(found, 1.0, clip_info))
