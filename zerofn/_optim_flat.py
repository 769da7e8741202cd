"""The eager updates of :mod:`zerofn.optim` over flat buffers: one torch kernel call per run.

When params, gradients and state are :class:`~zerofn.flat.FlatDict` values over one
layout, SGD and Adam/AdamW update each param group's runs of consecutive params (one run
per buffer when every param has a gradient) instead of each name: the same element-wise
kernels, so the same bits as the per-name update. This module holds the test that the
inputs are flat (``_sgd_flat_ready``, ``_adam_flat_ready``), those updates, and the
step-count bookkeeping a flat Adam state needs (``_refs``, ``_step_runs``), which the
per-name and traced paths share. ``optim.py`` keeps the per-name updates and picks a
path; the traced flat updates are in ``_optim_traced.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.optim.adam as _torch_adam
import torch.optim.sgd as _torch_sgd

from zerofn import flat
from zerofn._optim_state import AdamState, SGDState
from zerofn._optimizer import Optimizer, Params, _by_group, _scalar_lr
from zerofn._tree import FrozenDict
from zerofn.flat import FlatDict


def _sgd_flat_ready(opt: Optimizer, names: list[str], grads: Params, state: SGDState, params: Params) -> bool:
    """Flat inputs over one layout, and momentum buffers that are flat already (or not used);
    compiled, torch's single-tensor kernel in every group (foreach and fused break the graph)."""
    if not isinstance(params, FlatDict) or not flat.same_layout(params.flat_layout, grads) or not params.holds_all:
        return False
    if not _traceable(opt, names):
        return False
    bufs = state.momentum_buffer
    if flat.same_layout(params.flat_layout, bufs) and bufs.holds_all:  # type: ignore[attr-defined]
        return True
    return all(opt.hyperparams(n)["momentum"] == 0 for n in names)


def _sgd_update_flat(
    opt: Optimizer, names: list[str], grads: FlatDict, state: SGDState, params: FlatDict, donate: bool
) -> tuple[FlatDict, SGDState]:
    """:func:`_sgd_update` over flat buffers: one torch kernel call per param group, over its runs
    of consecutive params (one run per buffer when every param has a gradient). Names without
    a gradient keep their ranges (the copies are of whole buffers)."""
    fl = params.flat_layout
    new_params = flat.owned(params, donate)
    bufs = state.momentum_buffer
    new_bufs = flat.owned(bufs, donate) if isinstance(bufs, FlatDict) else bufs
    for group_names in _by_group(opt, names).values():
        hp = _scalar_lr(opt.hyperparams(group_names[0]))
        runs = fl.runs(tuple(group_names))
        # As _sgd_update: torch's foreach nesterov adds into the gradient list in place.
        grads_mutated = hp["nesterov"] and hp["weight_decay"] == 0 and not hp["maximize"]
        _torch_sgd.sgd(
            [flat.run_view(new_params, r) for r in runs],
            [flat.run_view(grads, r).clone() if grads_mutated else flat.run_view(grads, r) for r in runs],
            [flat.run_view(new_bufs, r) if hp["momentum"] != 0 else None for r in runs],  # type: ignore[arg-type]
            weight_decay=hp["weight_decay"],
            momentum=hp["momentum"],
            lr=hp["lr"],
            dampening=hp["dampening"],
            nesterov=hp["nesterov"],
            maximize=hp["maximize"],
            foreach=hp["foreach"],
            fused=hp["fused"],
        )
    return new_params, SGDState(new_bufs)


def _adam_flat_ready(opt: Optimizer, names: list[str], grads: Params, state: AdamState, params: Params) -> bool:
    """Flat inputs over one layout: params, gradients and both moments (and the max, if used);
    compiled, torch's single-tensor kernel in every group (foreach and fused break the graph)."""
    if not isinstance(params, FlatDict) or not params.holds_all or not _traceable(opt, names):
        return False
    fl = params.flat_layout
    if not flat.same_layout(fl, grads, state.exp_avg, state.exp_avg_sq):
        return False
    if not (state.exp_avg.holds_all and state.exp_avg_sq.holds_all):  # type: ignore[attr-defined]
        return False
    if any(opt.hyperparams(ns[0])["amsgrad"] for ns in _by_group(opt, names).values()):
        max_sq = state.max_exp_avg_sq
        return flat.same_layout(fl, max_sq) and max_sq.holds_all  # type: ignore[attr-defined]
    return True


def _traceable(opt: Optimizer, names: list[str]) -> bool:
    """Eagerly True; compiled, True when no group asks for the foreach or fused kernel."""
    if not torch.compiler.is_compiling():
        return True
    return not any(
        opt.hyperparams(ns[0])["fused"] or opt.hyperparams(ns[0])["foreach"] for ns in _by_group(opt, names).values()
    )


def _refs(steps: Mapping[str, torch.Tensor]) -> dict[int, int]:
    """How many names share each step count tensor (by identity)."""
    out: dict[int, int] = {}
    for t in steps.values():
        out[id(t)] = out.get(id(t), 0) + 1
    return out


def _step_runs(
    fl: flat.FlatLayout, names: tuple[str, ...], steps: Mapping[str, torch.Tensor]
) -> list[tuple[int, int, int, tuple[str, ...]]]:
    """:meth:`FlatLayout.runs` of ``names``, cut where the step count tensor changes (one count per run)."""
    out = []
    for g, start, stop, members in fl.runs(names):
        if g < 0 or len(members) == 1:
            out.append((g, start, stop, members))
            continue
        first, at = 0, start
        for i in range(1, len(members) + 1):
            if i == len(members) or steps[members[i]] is not steps[members[first]]:
                end = at + sum(fl.where[m][2] for m in members[first:i])
                out.append((g, at, end, members[first:i]))
                first, at = i, end
    return out


def _adam_update_flat(
    opt: Optimizer, names: list[str], grads: FlatDict, state: AdamState, params: FlatDict, donate: bool
) -> tuple[FlatDict, AdamState]:
    """:func:`_adam_update` over flat buffers: one torch kernel call per param group, over its runs
    of consecutive params sharing a step count (one run per buffer when every param has a
    gradient). Names without a gradient keep their ranges (the copies are of whole buffers)
    and their step counts. Element-wise, so the bits are those of the per-param update."""
    fl = params.flat_layout
    new_params = flat.owned(params, donate)
    exp_avg = flat.owned(state.exp_avg, donate)  # type: ignore[arg-type]
    exp_avg_sq = flat.owned(state.exp_avg_sq, donate)  # type: ignore[arg-type]
    max_sq = state.max_exp_avg_sq
    if isinstance(max_sq, FlatDict):
        max_sq = flat.owned(max_sq, donate)
    steps = dict(state.step)
    refs = _refs(state.step) if donate else {}
    for group_names in _by_group(opt, names).values():
        hp = _scalar_lr(opt.hyperparams(group_names[0]))
        runs = _step_runs(fl, tuple(group_names), state.step)
        # torch adds 1 to each count in place: a donated count is reused only when no name
        # outside this run shares it (a param without a gradient keeps its count).
        run_steps = []
        for r in runs:
            s = state.step[r[3][0]]
            run_steps.append(s if donate and refs[id(s)] == len(r[3]) else s.clone())
        _adam_kernel(
            opt,
            hp,
            [flat.run_view(new_params, r) for r in runs],
            [flat.run_view(grads, r) for r in runs],
            [flat.run_view(exp_avg, r) for r in runs],
            [flat.run_view(exp_avg_sq, r) for r in runs],
            [flat.run_view(max_sq, r) for r in runs] if hp["amsgrad"] else [],  # type: ignore[arg-type]
            run_steps,
        )
        for r, s in zip(runs, run_steps, strict=True):
            for n in r[3]:
                steps[n] = s
    return new_params, AdamState(FrozenDict(steps), exp_avg, exp_avg_sq, max_sq)


def _adam_kernel(
    opt: Optimizer,
    hp: Mapping[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """torch's functional Adam/AdamW (``torch.optim.adam.adam``) on equal-length lists, in
    place, with one param group's hyperparameters ``hp`` (a float ``lr``): the call the
    per-name and the flat eager updates share. ``max_exp_avg_sqs`` is empty without amsgrad."""
    _torch_adam.adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        foreach=hp["foreach"],
        fused=hp["fused"],
        decoupled_weight_decay=opt.name == "adamw",
        amsgrad=hp["amsgrad"],
        beta1=hp["betas"][0],
        beta2=hp["betas"][1],
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        eps=hp["eps"],
        maximize=hp["maximize"],
    )
