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
import torch.optim.sgd as _torch_sgd

from zerofn import flat

# The eager updates over flat buffers live in zerofn._optim_flat, the updates under
# torch.compile in zerofn._optim_traced, the states (which every path builds) in
# zerofn._optim_state, the Optimizer value and its helpers in zerofn._optimizer (shared with
# zerofn.lowbit without an import cycle); users find the public names here.
from zerofn._optim_flat import (
    _adam_flat_ready,
    _adam_kernel,
    _adam_update_flat,
    _refs,
    _sgd_flat_ready,
    _sgd_update_flat,
)
from zerofn._optim_state import AdamState as AdamState
from zerofn._optim_state import SGDState as SGDState
from zerofn._optim_traced import (
    _NOT_TRACEABLE,
    _adam_group_traced,
    _adam_update_flat_traced,
    _sgd_group_traced,
    _sgd_update_flat_traced,
)
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
                torch._dynamo.graph_break(msg=_NOT_TRACEABLE.format(name="sgd", kernel="SGD"))
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
                torch._dynamo.graph_break(msg=_NOT_TRACEABLE.format(name=opt.name, kernel="Adam"))
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
        _adam_kernel(
            opt,
            hp,
            ps,
            [grads[n] for n in group_names],
            owned["exp_avg"],
            owned["exp_avg_sq"],
            owned.get("max_exp_avg_sq", []),
            owned["step"],
        )
        for i, n in enumerate(group_names):
            new_params[n] = ps[i]
            for f, tensors in owned.items():
                fields[f][n] = tensors[i]
    return new_params, AdamState(**{f: FrozenDict(v) for f, v in fields.items()})


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
