"""SGD and Adam/AdamW over a rank's shards: the one ``init`` and ``update`` of each optimizer.

The params are a :class:`~zerofn.flat.FlatDict`: what the stages hand an optimizer, or a
plain ``name -> tensor`` mapping (a user's own call, a part of a
:func:`~zerofn.optim.partition`) taken as one whose every name is loose
(:func:`~zerofn.flat.as_flat`, no copy). An update takes the names that have a gradient,
groups them by param group, and applies the rule of :mod:`zerofn._optim_rules` once per
*run* of each group: a range of consecutive params of one flat buffer (one run per buffer
when every param has a gradient), or one loose tensor. The same code runs eagerly and
inside a ``torch.compile`` graph.

Every state tensor mapping is a FlatDict on the params' layout (a state held per name, as
a checkpoint load builds it, is packed here once; over loose params packing copies
nothing). Unless ``donate``, nothing given changes: the rules write into copies (the
whole buffers, and the loose tensors of the names updated). No collectives.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zerofn import _traced, flat
from zerofn._optim_rules import adam_, one_tensor_at_a_time, sgd_
from zerofn._optim_state import AdamState, SGDState
from zerofn._optimizer import Optimizer, Params, _by_group, _grads_in_order
from zerofn._tree import FrozenDict
from zerofn.flat import FlatDict

__all__ = ["adam_init", "adam_update", "sgd_init", "sgd_update"]

Run = tuple[int, int, int, tuple[str, ...]]

FIRST_STEP_SGD = (
    "zerofn.optim.sgd with momentum under torch.compile: the momentum buffers of {names} do not exist yet "
    "(torch.optim.SGD creates them from the first gradient, and a skipped first step must leave them unset), so "
    "the state would change its structure inside the graph. Run the first step eagerly, then compile the step"
)


# --------------------------------------------------------------------------- forms


def _runs(
    params: FlatDict, names: list[str], hp: Mapping[str, Any], cut: Callable[[str], object] | None = None
) -> list[Run]:
    """``names`` of one group as runs ``(group, start, stop, members)``: ranges of a flat buffer
    (group ``>= 0``) or single tensors (group ``-1``); cut where ``cut(member)`` changes.
    Each name is its own run where the rules need that (:func:`one_tensor_at_a_time`)."""
    where = params.flat_layout.where
    if names and one_tensor_at_a_time(params[names[0]].dtype, hp):
        runs = [(where[n][0], where[n][1], where[n][1] + where[n][2], (n,)) for n in names]
    else:
        runs = list(params.flat_layout.runs(tuple(names)))
    if cut is None:
        return runs
    out = []
    for g, start, stop, members in runs:
        first, at = 0, start
        for i in range(1, len(members) + 1):
            if i == len(members) or cut(members[i]) is not cut(members[first]):
                end = stop if i == len(members) else at + sum(where[m][2] for m in members[first:i])
                out.append((g, at, end, members[first:i]))
                first, at = i, end
    return out


def _view(d: Mapping[str, torch.Tensor], run: Run) -> torch.Tensor:
    """The tensor of ``run`` in ``d`` (a FlatDict; gradients of loose names may be a plain
    mapping): a range of a flat buffer, or one entry."""
    return flat.run_view(d, run) if run[0] >= 0 else d[run[3][0]]  # type: ignore[arg-type]


def _like(params: FlatDict, kind: Mapping[str, torch.Tensor | None]) -> FlatDict:
    """A state tensor mapping as a FlatDict on ``params``' layout (:func:`zerofn.flat.pack_state`)."""
    return flat.pack_state(params.flat_layout, kind, "zerofn.optim")


def _owned(d: FlatDict, names: list[str], donate: bool) -> FlatDict:
    """What a rule may write into: ``d`` itself when donated; else copies of its buffers and of
    the loose tensors of ``names`` (the other loose tensors stay the same objects)."""
    return flat.owned(d, donate, names)


def _in_form_of(given: Params, params: FlatDict, new_params: FlatDict) -> Mapping[str, torch.Tensor]:
    """The new params in the form the caller gave: the FlatDict when ``params`` is what was
    given, else (a plain mapping, held loose) a plain dict of its tensors, nothing copied."""
    return new_params if given is params else dict(new_params)


def _refs(steps: Mapping[str, torch.Tensor]) -> dict[int, int]:
    """How many names share each step count tensor (by identity)."""
    return collections.Counter(map(id, steps.values()))


# --------------------------------------------------------------------------- sgd


def sgd_init(opt: Optimizer, params: Params) -> SGDState:
    """No momentum buffer yet (torch.optim creates each from its param's first gradient): a
    ``None`` per name, as a checkpoint of a state before its first step loads it too."""
    del opt
    return SGDState(FrozenDict(dict.fromkeys(params)))


def sgd_update(
    opt: Optimizer, grads: Params, state: SGDState, params: Params, donate: bool
) -> tuple[Mapping[str, torch.Tensor], SGDState]:
    """``torch.optim.SGD``'s step of the names in ``grads``; the others keep params and buffers.

    Over a plain mapping the momentum buffers come back per name, ``None`` for a param that
    has none yet (as ``torch.optim.SGD``'s state has no entry for it).
    """
    given, params = params, flat.as_flat(params)
    names = _grads_in_order(opt, grads, params)
    grads = flat.grads_on(params.flat_layout, grads, f"zerofn.optim.{opt.name}.update")
    groups = _by_group(opt, names)
    new_params = _owned(params, names, donate)
    if not any(opt.hyperparams(ns[0])["momentum"] != 0 for ns in groups.values()):
        # No buffers to read or make: the state stays what it is (its form included, so a
        # compiled step's state keeps one structure).
        for group_names in groups.values():
            runs = _runs(params, group_names, opt.hyperparams(group_names[0]))
            sgd_(
                opt.hyperparams(group_names[0]),
                [_view(new_params, r) for r in runs],
                [_view(grads, r) for r in runs],
                [None] * len(runs),
            )
        return _in_form_of(given, params, new_params), state
    bufs = _like(params, state.momentum_buffer)
    new_bufs = _owned(bufs, names, donate)
    created: list[tuple[Run, torch.Tensor]] = []
    for group_names in groups.values():
        hp = opt.hyperparams(group_names[0])
        momentum = hp["momentum"] != 0
        if momentum and torch.compiler.is_compiling():
            missing = [n for n in group_names if not _has(bufs, n)]
            if missing:
                _traced.refuse(FIRST_STEP_SGD.format(names=missing))
        runs = _runs(params, group_names, hp, (lambda n: _has(bufs, n)) if momentum else None)
        fresh = [momentum and not _has(bufs, r[3][0]) for r in runs]
        run_bufs = [_view(new_bufs, r) if momentum and not f else None for r, f in zip(runs, fresh, strict=True)]
        sgd_(hp, [_view(new_params, r) for r in runs], [_view(grads, r) for r in runs], run_bufs)
        created += [(r, b) for r, b, f in zip(runs, run_bufs, fresh, strict=True) if f]  # type: ignore[misc]
    held = _with_created(new_bufs, created) if created else new_bufs
    if given is not params:  # the caller's per-name form: every name, None where no buffer exists yet
        return _in_form_of(given, params, new_params), SGDState(FrozenDict({n: held.get(n) for n in params}))
    return new_params, SGDState(held)


def _has(bufs: Mapping[str, torch.Tensor | None], name: str) -> bool:
    return name in bufs and bufs[name] is not None


def _with_created(bufs: FlatDict, created: list[tuple[Run, torch.Tensor]]) -> FlatDict:
    """``bufs`` also holding the momentum buffers a first step created (written into their ranges)."""
    fl = bufs.flat_layout
    buffers = list(bufs.buffers)
    loose = dict(bufs.loose)
    for (g, start, stop, members), b in created:
        if g < 0:
            loose[members[0]] = b
            continue
        if buffers[g] is None:
            if start == 0 and stop == fl.groups[g].numel:
                buffers[g] = b
                continue
            buffers[g] = torch.zeros(fl.groups[g].numel, dtype=b.dtype, device=b.device)
        buffers[g][start:stop].copy_(b)  # type: ignore[index]
    held = set(bufs.names).union(*(members for (_, _, _, members), _ in created))
    return FlatDict.from_buffers(fl, buffers, loose, tuple(n for n in fl.names if n in held))


# --------------------------------------------------------------------------- adam / adamw


def adam_init(opt: Optimizer, params: Params) -> AdamState:
    """Zero moments and step counts (a 0-d float32 CPU tensor per name, as torch keeps them; on
    the param's device under ``fused``). Over flat params the names of a param group share
    one count (a step updates them together; a param that misses a step gets its own count
    from then on), and ``max_exp_avg_sq`` holds the ``amsgrad`` names."""

    def count(name: str, p: torch.Tensor) -> torch.Tensor:
        if opt.hyperparams(name)["fused"]:
            return torch.zeros((), dtype=torch.float32, device=p.device)
        return torch.tensor(0.0, dtype=torch.float32)

    params = flat.as_flat(params)
    amsgrad = tuple(n for n in params if opt.hyperparams(n)["amsgrad"])
    first: dict[int, torch.Tensor] = {}
    steps = {}
    for n, p in params.items():
        gi = opt.group_index(n)
        steps[n] = first[gi] if gi in first else first.setdefault(gi, count(n, p))
    zeros = flat.zeros_like(params)
    if not amsgrad:
        max_sq: Any = FrozenDict()  # (as a checkpoint of such a state loads it)
    elif len(amsgrad) == len(params):
        max_sq = flat.zeros_like(params)
    else:
        max_sq = flat.pack(params.flat_layout, {n: zeros[n] for n in amsgrad})
    return AdamState(FrozenDict(steps), zeros, flat.zeros_like(params), max_sq)


def adam_update(
    opt: Optimizer, grads: Params, state: AdamState, params: Params, donate: bool, skip: torch.Tensor | None = None
) -> tuple[Mapping[str, torch.Tensor], AdamState]:
    """``torch.optim.Adam`` / ``AdamW``'s step of the names in ``grads``; the others keep params,
    moments and step counts. ``skip`` (a 0-d bool tensor; every group ``fused``, see
    ``optim._all_fused``) true: torch's kernel leaves every value as it was."""
    given, params = params, flat.as_flat(params)
    names = _grads_in_order(opt, grads, params)
    grads = flat.grads_on(params.flat_layout, grads, f"zerofn.optim.{opt.name}.update")
    groups = _by_group(opt, names)
    amsgrad = any(opt.hyperparams(ns[0])["amsgrad"] for ns in groups.values())
    new_params = _owned(params, names, donate)
    exp_avg = _owned(_like(params, state.exp_avg), names, donate)
    exp_avg_sq = _owned(_like(params, state.exp_avg_sq), names, donate)
    max_sq = state.max_exp_avg_sq  # untouched without amsgrad (its form included)
    if amsgrad:
        max_sq = _owned(_like(params, max_sq), names, donate)
    steps = dict(state.step.items())
    count_of = dict(steps).__getitem__  # the counts before this step (``steps`` is rewritten below)
    # Counts are reused only eagerly: a graph's are 0-d copies, and id() would guard on the object.
    reuse = donate and not torch.compiler.is_compiling()
    refs = _refs(state.step) if reuse else {}
    # One new count per old one: runs that shared a count share the new one (equal values),
    # so a compiled step's state keeps its aliasing and its graph is reused. Found with
    # `is` (id() would guard on the object).
    renewed: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group_names in groups.values():
        hp = opt.hyperparams(group_names[0])
        runs = _runs(params, group_names, hp, count_of)
        # A rule adds 1 to each count in place: a donated count is reused only when no name
        # outside the run shares it (a param without a gradient keeps its count).
        run_steps = []
        for r in runs:
            s = state.step[r[3][0]]
            run_steps.append(s if reuse and refs[id(s)] == len(r[3]) else s.clone())
        adam_(
            opt.name == "adamw",
            hp,
            [_view(new_params, r) for r in runs],
            [_view(grads, r) for r in runs],
            [_view(exp_avg, r) for r in runs],
            [_view(exp_avg_sq, r) for r in runs],
            [_view(max_sq, r) for r in runs] if hp["amsgrad"] else [],
            run_steps,
            skip,
        )
        for r, s in zip(runs, run_steps, strict=True):
            old_count = state.step[r[3][0]]
            shared = next((new for o, new in renewed if o is old_count), None)
            if shared is None:
                renewed.append((old_count, s))
            for n in r[3]:
                steps[n] = s if shared is None else shared
    return _in_form_of(given, params, new_params), AdamState(FrozenDict(steps), exp_avg, exp_avg_sq, max_sq)
