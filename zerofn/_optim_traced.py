"""The updates of :mod:`zerofn.optim` inside a ``torch.compile`` graph, bitwise the eager ones.

Eagerly, SGD and Adam/AdamW call torch's kernels, which read the learning rate and
Adam's step count as Python numbers. Traced, those stay tensors (inputs of the graph, so
a changing ``lr`` or step never recompiles) and the update is written out in torch's
operations and order (``_sgd_traced``, ``_adam_traced``), per name
(``_sgd_group_traced``, ``_adam_group_traced``) or per run of a flat buffer
(``_sgd_update_flat_traced``, ``_adam_update_flat_traced``, which ``_assemble`` the new
buffers). The messages for what a compiled step cannot trace are here too. ``optim.py``
picks this path when ``torch.compiler.is_compiling()``; it is kept apart from the eager
code so that each reads on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zerofn import _traced, flat
from zerofn._optim_flat import _step_runs
from zerofn._optim_state import AdamState, SGDState
from zerofn._optimizer import Optimizer, Params, _by_group
from zerofn._tree import FrozenDict
from zerofn.flat import FlatDict

_FIRST_STEP_SGD = (
    "zerofn.optim.sgd with momentum under torch.compile: the momentum buffers of {names} do not exist yet "
    "(torch.optim.SGD creates them from the first gradient, and a skipped first step must leave them unset), so "
    "the state would change its structure inside the graph. Run the first step eagerly, then compile the step"
)


def _sgd_group_traced(
    hp: Mapping[str, Any],
    names: list[str],
    grads: Params,
    state: SGDState,
    params: Params,
    new_params: dict[str, torch.Tensor],
    new_bufs: dict[str, torch.Tensor | None],
) -> None:
    """One group's SGD update inside a compiled graph, bitwise equal to torch's single-tensor kernel.

    Eagerly ``param.add_(grad, alpha=-lr)`` takes ``lr`` as a Python float (a tensor lr is
    read as one); here a tensor lr stays an input of the graph and the same product is
    ``addcmul(param, grad, -lr)`` with ``-lr`` rounded to the params' dtype as ``alpha``
    is, which the CPU kernels compute with the same fused multiply-add (checked bitwise
    by ``tests/test_jit.py``). A float lr is a constant of the graph (``add`` itself).
    """
    momentum = hp["momentum"]
    missing = [n for n in names if momentum != 0 and state.momentum_buffer[n] is None]
    if missing:
        _traced.refuse(_FIRST_STEP_SGD.format(names=missing))
    for n in names:
        buf = state.momentum_buffer[n] if momentum != 0 else None
        new_params[n], buf = _sgd_traced(hp, params[n], grads[n], buf)
        if buf is not None:
            new_bufs[n] = buf


def _sgd_traced(
    hp: Mapping[str, Any], param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_sgd_group_traced`'s update of one tensor (a param's shard, or a run of a flat
    buffer: element-wise, the same bits): the new param and momentum buffer (``None``
    without momentum)."""
    lr, momentum, dampening, wd = hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"]
    grad = -grad if hp["maximize"] else grad
    if wd != 0:
        grad = grad.add(param, alpha=wd)
    if momentum != 0:
        buf = buf.mul(momentum).add(grad, alpha=1 - dampening)  # type: ignore[union-attr]
        grad = grad.add(buf, alpha=momentum) if hp["nesterov"] else buf
    if isinstance(lr, torch.Tensor):
        return torch.addcmul(param, grad, (-lr.to(torch.float64)).to(param.device, param.dtype)), buf
    return param.add(grad, alpha=-lr), buf


def _sgd_update_flat_traced(
    opt: Optimizer, names: list[str], grads: FlatDict, state: SGDState, params: FlatDict
) -> tuple[FlatDict, SGDState]:
    """:func:`_sgd_update` under torch.compile over flat buffers: the traced update
    (:func:`_sgd_traced`) once per run of consecutive params of a param group (one run per
    buffer when every param has a gradient); the new buffers are the runs' results."""
    fl = params.flat_layout
    bufs = state.momentum_buffer
    results = []
    for group_names in _by_group(opt, names).values():
        hp = opt.hyperparams(group_names[0])
        for r in fl.runs(tuple(group_names)):
            buf = flat.run_view(bufs, r) if hp["momentum"] != 0 else None  # type: ignore[arg-type]
            results.append((r, _sgd_traced(hp, flat.run_view(params, r), flat.run_view(grads, r), buf)))
    new_params = _assemble(params, [(r, p) for r, (p, _) in results])
    if isinstance(bufs, FlatDict):
        bufs = _assemble(bufs, [(r, b) for r, (_, b) in results if b is not None])
    return new_params, SGDState(bufs)


_NOT_TRACEABLE = (
    "zerofn.optim.{name}: a compiled step runs {kernel}'s single-tensor kernel; foreach=True or fused=True break "
    "the graph here. Build the optimizer with foreach=None and fused=None (the CPU default) to compile the step "
    "into one graph"
)


def _adam_group_traced(
    opt: Optimizer,
    hp: Mapping[str, Any],
    names: list[str],
    grads: Params,
    state: AdamState,
    params: Params,
    new_params: dict[str, torch.Tensor],
    fields: dict[str, dict[str, torch.Tensor]],
) -> None:
    r"""One group's Adam/AdamW update inside a compiled graph, bitwise equal to the eager one.

    Eagerly torch's single-tensor Adam reads ``step`` with ``.item()`` and computes the
    bias corrections and the step size as Python (float64) numbers, which the kernels
    round to the params' dtype. Here those scalars are 0-d float64 tensors computed by the
    same operations (IEEE ``pow``, ``/``, ``sqrt`` round alike), cast to the params' dtype
    where eager mode casts them, so a changing ``lr`` tensor and the step count never
    recompile the graph. The element-wise ops are torch's, in torch's order:

    .. math::
        \theta \leftarrow \theta - \frac{(-\text{step\_size}) \cdot m}
        {\sqrt{v} / \sqrt{1-\beta_2^t} + \epsilon}

    The foreach and fused kernels are not traced (:data:`_NOT_TRACEABLE`).
    """
    lr64 = _lr64(hp)
    # A step count shared by names stays shared (one graph input): found with `is`, as id()
    # would guard on the object.
    new_steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    for n in names:
        step_t = _next_step(state.step[n], new_steps)
        max_sq = state.max_exp_avg_sq[n] if hp["amsgrad"] else None
        param, exp_avg, exp_avg_sq, max_sq = _adam_traced(
            opt, hp, lr64, params[n], grads[n], state.exp_avg[n], state.exp_avg_sq[n], max_sq, step_t
        )
        new_params[n] = param
        if max_sq is not None:
            fields["max_exp_avg_sq"][n] = max_sq
        fields["step"][n] = step_t
        fields["exp_avg"][n] = exp_avg
        fields["exp_avg_sq"][n] = exp_avg_sq


def _lr64(hp: Mapping[str, Any]) -> torch.Tensor:
    lr = hp["lr"]
    return lr.to(torch.float64) if isinstance(lr, torch.Tensor) else torch.tensor(float(lr), dtype=torch.float64)


def _next_step(old: torch.Tensor, new_steps: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``old + 1``, one tensor per old count (a count shared by names stays shared)."""
    step_t = next((new for o, new in new_steps if o is old), None)
    if step_t is None:
        step_t = old + 1
        new_steps.append((old, step_t))
    return step_t


def _adam_traced(
    opt: Optimizer,
    hp: Mapping[str, Any],
    lr64: torch.Tensor,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_sq: torch.Tensor | None,
    step_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`_adam_group_traced`'s update of one tensor (a param's shard, or a run of a flat
    buffer: element-wise, the same bits): new param, moments and max (``None`` without amsgrad)."""
    beta1, beta2, eps, wd = hp["betas"][0], hp["betas"][1], hp["eps"], hp["weight_decay"]
    grad = -grad if hp["maximize"] else grad
    if wd != 0:
        if opt.name == "adamw":
            param = param * (1 - lr64 * wd).to(param.dtype)
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    step = step_t.to(lr64.device, torch.float64)  # eager: step_t.item(), exact
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    step_size = lr64 / bias_correction1
    bias_correction2_sqrt = bias_correction2.sqrt()
    if max_sq is not None:
        max_sq = torch.maximum(max_sq, exp_avg_sq)
        denom = (max_sq.sqrt() / bias_correction2_sqrt.to(param.dtype)).add(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt.to(param.dtype)).add(eps)
    # addcdiv(value=-step_size) computes param + (value * exp_avg) / denom in the params' dtype.
    return param + (exp_avg * (-step_size).to(param.dtype)) / denom, exp_avg, exp_avg_sq, max_sq


def _adam_update_flat_traced(
    opt: Optimizer, names: list[str], grads: FlatDict, state: AdamState, params: FlatDict
) -> tuple[FlatDict, AdamState]:
    """:func:`_adam_update` under torch.compile over flat buffers: the traced update
    (:func:`_adam_traced`) once per run of consecutive params sharing a step count (one run
    per buffer when every param has a gradient), so the graph does not grow with the
    tensor count; the new buffers are the runs' results (with the old ranges of names
    without a gradient, one ``cat`` per buffer then)."""
    fl = params.flat_layout
    amsgrad = any(opt.hyperparams(n)["amsgrad"] for n in names)
    max_old = state.max_exp_avg_sq if amsgrad else None
    results: list[tuple[tuple[int, int, int, tuple[str, ...]], tuple[Any, ...]]] = []
    steps = dict(state.step)
    for group_names in _by_group(opt, names).values():
        hp = opt.hyperparams(group_names[0])
        lr64 = _lr64(hp)
        new_steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # per group, as _adam_group_traced
        for r in _step_runs(fl, tuple(group_names), state.step):
            step_t = _next_step(state.step[r[3][0]], new_steps)
            max_sq = flat.run_view(max_old, r) if hp["amsgrad"] else None  # type: ignore[arg-type]
            out = _adam_traced(
                opt,
                hp,
                lr64,
                flat.run_view(params, r),
                flat.run_view(grads, r),
                flat.run_view(state.exp_avg, r),  # type: ignore[arg-type]
                flat.run_view(state.exp_avg_sq, r),  # type: ignore[arg-type]
                max_sq,
                step_t,
            )
            results.append((r, out))
            for n in r[3]:
                steps[n] = step_t
    olds = (params, state.exp_avg, state.exp_avg_sq, max_old)
    new = [
        None if o is None else _assemble(o, [(r, out[i]) for r, out in results if out[i] is not None])
        for i, o in enumerate(olds)
    ]
    return new[0], AdamState(FrozenDict(steps), new[1], new[2], new[3] if amsgrad else state.max_exp_avg_sq)  # type: ignore[arg-type]


def _assemble(old: Any, pieces: list[tuple[tuple[int, int, int, tuple[str, ...]], torch.Tensor]]) -> FlatDict:
    """New buffers (and loose tensors) for the flat ``old``: the runs' new tensors in their ranges,
    ``old``'s values elsewhere; a buffer one run covers is that run's tensor, one no run
    touches a copy (a new state shares no storage with the old)."""
    fl = old.flat_layout
    by_group: dict[int, list[tuple[int, int, torch.Tensor, str]]] = {}
    loose = dict(old.loose)
    for (g, start, stop, members), t in pieces:
        if g < 0:
            loose[members[0]] = t
        else:
            by_group.setdefault(g, []).append((start, stop, t, members[0]))
    buffers: list[torch.Tensor | None] = []
    for g, buf in enumerate(old.buffers):
        if buf is None or g not in by_group:
            buffers.append(None if buf is None else buf.clone())
            continue
        # In buffer order, which is the order of the group's names. Not by ``start``: on a
        # second compile of one step function dynamo's automatic dynamic shapes make the
        # offsets read from the state's layout symbols, and it sorts by constants only.
        position = {n: i for i, n in enumerate(fl.groups[g].names)}
        parts: list[torch.Tensor] = []
        at = 0
        for start, stop, t, _ in sorted(by_group[g], key=lambda p: position[p[3]]):
            if start > at:
                parts.append(buf[at:start])
            parts.append(t)
            at = stop
        if at < fl.groups[g].numel:
            parts.append(buf[at:])
        buffers.append(parts[0] if len(parts) == 1 else torch.cat(parts))
    return old.with_buffers(buffers, loose)
