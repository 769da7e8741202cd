"""Functional optimizers: pure ``init`` / ``update`` pairs with torch.optim's numerics.

An :class:`Optimizer` is a value: a name, hyperparameters (per parameter group) and two
pure functions. ``init(params)`` builds the state for a ``name -> tensor`` mapping;
``update(grads, state, params)`` returns new params and new state and changes nothing it
was given. zerofn calls them on 1-D shards, but they work on any tensors.

The arithmetic is torch's own: ``update`` calls the functional kernels behind
``torch.optim.SGD``, ``Adam`` and ``AdamW`` (``torch.optim.sgd.sgd``,
``torch.optim.adam.adam``, ``torch.optim.adamw.adamw``) with the same ``foreach`` /
``fused`` choice torch would make. Element-wise kernels give the same bits on a slice as
on the whole tensor, so an update of shards is bitwise the update torch.optim makes on
the full parameters, given bitwise-equal gradients.

Parameter groups work as in torch, by name::

    opt = zf.optim.adamw(lr=1e-3, weight_decay=0.1,
                         param_groups=[{"params": ["fc.bias", "ln.weight"], "weight_decay": 0.0}])

A name belongs to the first group that lists it (``"params"`` is a collection of names
or a predicate ``name -> bool``); names no group lists use the factory's hyperparameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.optim.adam as _torch_adam
import torch.optim.sgd as _torch_sgd

from zerofn import _traced, flat
from zerofn._optim_flat import _adam_flat_ready, _adam_update_flat, _refs, _sgd_flat_ready, _sgd_update_flat, _step_runs

# The states live in zerofn._optim_state (every update path builds them), the Optimizer
# value and its helpers in zerofn._optimizer (shared with zerofn.lowbit without an import
# cycle); users find them here.
from zerofn._optim_state import AdamState as AdamState
from zerofn._optim_state import SGDState as SGDState
from zerofn._optimizer import NameSelector as NameSelector
from zerofn._optimizer import (
    Optimizer,
    Params,
    PartitionState,
    _by_group,
    _check_hyperparams,
    _grads_in_order,
    _make_groups,
    _own,
    _scalar_lr,
    partition,
)
from zerofn._optimizer import ParamGroup as ParamGroup
from zerofn._tree import FrozenDict
from zerofn.flat import FlatDict

__all__ = [
    "AdamState",
    "Optimizer",
    "PartitionState",
    "SGDState",
    "adam",
    "adamw",
    "partition",
    "sgd",
]


_LOWBIT = ("adamw8bit", "adamw4bit", "adamwfp8", "adam8bit", "adam4bit", "adamfp8")


def __getattr__(name: str) -> Any:
    """``zf.optim.adamw8bit`` and the other low-bit factories live in :mod:`zerofn.lowbit`
    (imported on first use: it needs the optional torchao)."""
    if name in _LOWBIT:
        from zerofn import lowbit

        return getattr(lowbit, name)
    raise AttributeError(f"module 'zerofn.optim' has no attribute {name!r}")


# --------------------------------------------------------------------------- sgd


def _sgd_init(opt: Optimizer, params: Params) -> SGDState:
    del opt
    return SGDState(FrozenDict(dict.fromkeys(params)))


def _sgd_update(
    opt: Optimizer, grads: Params, state: SGDState, params: Params, donate: bool
) -> tuple[dict[str, torch.Tensor], SGDState]:
    names = _grads_in_order(opt, grads, params)
    if _sgd_flat_ready(opt, names, grads, state, params):
        if torch.compiler.is_compiling():
            return _sgd_update_flat_traced(opt, names, grads, state, params)  # type: ignore[arg-type]
        return _sgd_update_flat(opt, names, grads, state, params, donate)  # type: ignore[arg-type]
    new_params = dict(params)
    new_bufs = dict(state.momentum_buffer)
    for gi, group_names in _by_group(opt, names).items():
        hp = _scalar_lr(opt.hyperparams(group_names[0]))
        if torch.compiler.is_compiling():
            if hp["fused"] or hp["foreach"]:
                # As Adam's: break the graph here, saying so (with fullgraph=True the error).
                torch._dynamo.graph_break(msg=_NOT_TRACEABLE_SGD)
            else:
                _sgd_group_traced(hp, group_names, grads, state, params, new_params, new_bufs)
                continue
        ps = [_own(params[n], donate) for n in group_names]
        bufs = [
            None if state.momentum_buffer[n] is None else _own(state.momentum_buffer[n], donate) for n in group_names
        ]
        # torch's foreach SGD adds the momentum into the gradient list in place for nesterov
        # when neither weight decay nor maximize made a copy first: hand it copies then.
        grads_mutated = hp["nesterov"] and hp["weight_decay"] == 0 and not hp["maximize"]
        _torch_sgd.sgd(
            ps,
            [_own(grads[n], donate) if grads_mutated else grads[n] for n in group_names],
            bufs,
            weight_decay=hp["weight_decay"],
            momentum=hp["momentum"],
            lr=hp["lr"],
            dampening=hp["dampening"],
            nesterov=hp["nesterov"],
            maximize=hp["maximize"],
            foreach=hp["foreach"],
            fused=hp["fused"],
        )
        del gi
        for n, p, b in zip(group_names, ps, bufs, strict=True):
            new_params[n] = p
            new_bufs[n] = b
    return new_params, SGDState(FrozenDict(new_bufs))


_NOT_TRACEABLE_SGD = (
    "zerofn.optim.sgd: a compiled step runs SGD's single-tensor kernel; foreach=True or fused=True break the "
    "graph here. Build the optimizer with foreach=None and fused=None (the CPU default) to compile the step into "
    "one graph"
)

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


def sgd(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> Optimizer:
    r"""Stochastic gradient descent with momentum, exactly as ``torch.optim.SGD``.

    .. math::
        g \leftarrow g + \lambda\theta,\quad
        b \leftarrow \mu b + (1-\tau) g \ (b \leftarrow g \text{ at the first step}),\quad
        \theta \leftarrow \theta - \eta\,(g + \mu b \text{ if nesterov else } b)

    Args:
      lr: learning rate :math:`\eta`.
      momentum: :math:`\mu`; 0 keeps no state.
      dampening: :math:`\tau`.
      weight_decay: L2 penalty :math:`\lambda` added to the gradient.
      nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
      maximize: ascend instead of descend.
      foreach: torch's kernel choice; ``None`` lets torch pick as it would.
      fused: torch's kernel choice; ``None`` lets torch pick as it would.
      param_groups: per-name hyperparameter overrides (see the module docstring).

    Examples:
      >>> import torch, zerofn as zf
      >>> opt = zf.optim.sgd(lr=0.1, momentum=0.9)
      >>> params = {"w": torch.ones(3)}
      >>> state = opt.init(params)
      >>> new, state = opt.update({"w": torch.ones(3)}, state, params)
      >>> new["w"], params["w"]
      (tensor([0.9000, 0.9000, 0.9000]), tensor([1., 1., 1.]))
    """
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("zerofn.optim.sgd: nesterov momentum needs momentum > 0 and dampening == 0")
    defaults = FrozenDict(
        dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
    )
    _check_hyperparams("sgd", defaults)
    return Optimizer("sgd", defaults, _make_groups("sgd", param_groups), _sgd_init, _sgd_update, torch.optim.SGD)


# --------------------------------------------------------------------------- adam / adamw


def _adam_init(opt: Optimizer, params: Params) -> AdamState:
    # torch keeps `step` as a 0-d float32 CPU tensor unless fused/capturable, where it
    # lives on the param's device; mirror that so the kernels take the same path.
    def step_for(name: str, p: torch.Tensor) -> torch.Tensor:
        if opt.hyperparams(name)["fused"]:
            return torch.zeros((), dtype=torch.float32, device=p.device)
        return torch.tensor(0.0, dtype=torch.float32)

    amsgrad = {n for n in params if opt.hyperparams(n)["amsgrad"]}
    if isinstance(params, FlatDict):
        # Flat: one step count per param group, shared by its names (a step updates them
        # together; a param that misses a step gets its own count from then on).
        first: dict[int, torch.Tensor] = {}
        steps = {}
        for n, p in params.items():
            gi = opt.group_index(n)
            steps[n] = first[gi] if gi in first else first.setdefault(gi, step_for(n, p))
        if len(amsgrad) == len(params):
            max_sq: Any = flat.zeros_like(params)
        else:
            max_sq = FrozenDict({n: torch.zeros_like(p) for n, p in params.items() if n in amsgrad})
        return AdamState(FrozenDict(steps), flat.zeros_like(params), flat.zeros_like(params), max_sq)
    return AdamState(
        step=FrozenDict({n: step_for(n, p) for n, p in params.items()}),
        exp_avg=FrozenDict({n: torch.zeros_like(p) for n, p in params.items()}),
        exp_avg_sq=FrozenDict({n: torch.zeros_like(p) for n, p in params.items()}),
        max_exp_avg_sq=FrozenDict({n: torch.zeros_like(p) for n, p in params.items() if n in amsgrad}),
    )


def _adam_update(
    opt: Optimizer, grads: Params, state: AdamState, params: Params, donate: bool
) -> tuple[dict[str, torch.Tensor], AdamState]:
    names = _grads_in_order(opt, grads, params)
    if _adam_flat_ready(opt, names, grads, state, params):
        if torch.compiler.is_compiling():
            return _adam_update_flat_traced(opt, names, grads, state, params)  # type: ignore[arg-type]
        return _adam_update_flat(opt, names, grads, state, params, donate)  # type: ignore[arg-type]
    new_params = dict(params)
    fields = {f: dict(getattr(state, f)) for f in AdamState._fields}
    refs = _refs(state.step) if donate else {}
    for group_names in _by_group(opt, names).values():
        hp = _scalar_lr(opt.hyperparams(group_names[0]))
        if torch.compiler.is_compiling():
            if hp["fused"] or hp["foreach"]:
                # torch's foreach/fused kernels are not what the eager step runs bit for bit:
                # break the graph here, saying so (with fullgraph=True this is the error).
                torch._dynamo.graph_break(msg=_NOT_TRACEABLE.format(name=opt.name))
            else:
                _adam_group_traced(opt, hp, group_names, grads, state, params, new_params, fields)
                continue
        owned = {
            f: [_own(getattr(state, f)[n], donate) for n in group_names]
            for f in AdamState._fields
            if f != "max_exp_avg_sq" or hp["amsgrad"]
        }
        # A flat state shares one step count among a group's names: torch adds 1 to each
        # count in place, so a shared one is copied per name even when donated.
        if donate and any(refs[id(state.step[n])] > 1 for n in group_names):
            owned["step"] = [state.step[n].clone() for n in group_names]
        ps = [_own(params[n], donate) for n in group_names]
        _torch_adam.adam(
            ps,
            [grads[n] for n in group_names],
            owned["exp_avg"],
            owned["exp_avg_sq"],
            owned.get("max_exp_avg_sq", []),
            owned["step"],
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
        for i, n in enumerate(group_names):
            new_params[n] = ps[i]
            for f, tensors in owned.items():
                fields[f][n] = tensors[i]
    return new_params, AdamState(**{f: FrozenDict(v) for f, v in fields.items()})


_NOT_TRACEABLE = (
    "zerofn.optim.{name}: a compiled step runs Adam's single-tensor kernel; foreach=True or fused=True break "
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
    by_group: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    loose = dict(old.loose)
    for (g, start, stop, members), t in pieces:
        if g < 0:
            loose[members[0]] = t
        else:
            by_group.setdefault(g, []).append((start, stop, t))
    buffers: list[torch.Tensor | None] = []
    for g, buf in enumerate(old.buffers):
        if buf is None or g not in by_group:
            buffers.append(None if buf is None else buf.clone())
            continue
        parts: list[torch.Tensor] = []
        at = 0
        for start, stop, t in sorted(by_group[g], key=lambda p: p[0]):
            if start > at:
                parts.append(buf[at:start])
            parts.append(t)
            at = stop
        if at < fl.groups[g].numel:
            parts.append(buf[at:])
        buffers.append(parts[0] if len(parts) == 1 else torch.cat(parts))
    return old.with_buffers(buffers, loose)


def _adam_factory(
    name: str,
    torch_class: type[torch.optim.Optimizer],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    foreach: bool | None,
    fused: bool | None,
    param_groups: Sequence[Mapping[str, Any]] | None,
) -> Optimizer:
    defaults = FrozenDict(
        dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
    )
    _check_hyperparams(name, defaults)
    return Optimizer(name, defaults, _make_groups(name, param_groups), _adam_init, _adam_update, torch_class)


def adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> Optimizer:
    r"""Adam, exactly as ``torch.optim.Adam`` (L2 weight decay added to the gradient).

    .. math::
        g \leftarrow g + \lambda\theta,\quad m \leftarrow \beta_1 m + (1-\beta_1) g,\quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
        \theta \leftarrow \theta - \eta\,\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    Args mirror ``torch.optim.Adam``; ``param_groups`` as in the module docstring.

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2014.
    """
    return _adam_factory(
        "adam", torch.optim.Adam, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused, param_groups
    )


def adamw(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> Optimizer:
    r"""AdamW, exactly as ``torch.optim.AdamW`` (decoupled weight decay).

    .. math::
        \theta \leftarrow \theta(1 - \eta\lambda),\quad
        m, v \text{ as in Adam},\quad
        \theta \leftarrow \theta - \eta\,\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    Args mirror ``torch.optim.AdamW``; ``param_groups`` as in the module docstring.

    Examples:
      >>> import torch, zerofn as zf
      >>> opt = zf.optim.adamw(lr=1e-3)
      >>> state = opt.init({"w": torch.zeros(2)})
      >>> int(state.step["w"])
      0

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019.
    """
    return _adam_factory(
        "adamw", torch.optim.AdamW, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused, param_groups
    )
