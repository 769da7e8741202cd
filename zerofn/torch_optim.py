"""From ``torch.optim`` to zerofn's functional optimizers.

Two paths:

* **fast**: ``torch.optim.SGD``, ``Adam`` and ``AdamW`` map onto :func:`zerofn.optim.sgd`,
  :func:`~zerofn.optim.adam` and :func:`~zerofn.optim.adamw`, which call torch's own
  kernels directly on the shards;
* **generic**: any other *element-wise* torch optimizer (Adagrad, RMSprop, Adamax, NAdam,
  RAdam, Adadelta, ASGD, Rprop) is driven as-is on the 1-D shard tensors by
  :func:`from_torch`: a throw-away instance of the class is pointed at the shards, given
  their state, stepped, and its state read back. Element-wise updates give the same bits
  on a shard as on the whole tensor.

Optimizers that need whole tensors (LBFGS's closure and line search over the full
parameter vector, factored second moments as in Adafactor, orthogonalising matrix
updates) cannot run on shards and are refused with an explanation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from zerofn import optim
from zerofn._tree import FrozenDict

__all__ = ["ELEMENTWISE", "TorchOptimState", "from_torch", "from_torch_optimizer"]

# Classes whose update of each element depends only on that element's grad and state.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)

_REFUSED_WHY = {
    "LBFGS": "it needs a closure and a line search over the whole parameter vector",
    "SparseAdam": "it needs sparse gradients of whole tensors",
    "Adafactor": "its factored second moment reads whole rows and columns of each tensor",
    "Muon": "it orthogonalises whole weight matrices",
}

_FAST_KEYS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "fused"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused"),
}


def check_shardable(cls: type[torch.optim.Optimizer]) -> None:
    """Raise ``TypeError`` unless ``cls`` updates every element independently."""
    if cls in ELEMENTWISE:
        return
    why = _REFUSED_WHY.get(cls.__name__, "zerofn only knows how to shard element-wise optimizers")
    names = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise TypeError(
        f"zerofn cannot shard {cls.__name__}: {why}. Each rank only holds a 1/N slice of every "
        f"parameter. Supported torch optimizers: {names}."
    )


class TorchOptimState(NamedTuple):
    """State of a :func:`from_torch` optimizer.

    Attributes:
      per_param: name -> the torch optimizer's state dict for that shard (tensors shaped
        like the shard, ``step`` as torch keeps it); empty until the param's first step,
        as in torch.
    """

    per_param: FrozenDict[FrozenDict[Any]]


def _generic_init(opt: optim.Optimizer, params: Mapping[str, torch.Tensor]) -> TorchOptimState:
    del opt
    return TorchOptimState(FrozenDict({n: FrozenDict() for n in params}))


def _own_value(v: Any, donate: bool) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) and not donate else v


def _generic_update(
    opt: optim.Optimizer,
    grads: Mapping[str, torch.Tensor],
    state: TorchOptimState,
    params: Mapping[str, torch.Tensor],
    donate: bool,
) -> tuple[dict[str, torch.Tensor], TorchOptimState]:
    cls = opt.torch_class
    names = [n for n in params if grads.get(n) is not None]
    new_params = dict(params)
    new_state = dict(state.per_param)
    by_group: dict[int, list[str]] = {}
    for n in names:
        by_group.setdefault(opt.group_index(n), []).append(n)
    for group_names in by_group.values():
        hp = dict(opt.hyperparams(group_names[0]))
        shards = [params[n] if donate else params[n].clone() for n in group_names]
        # A fresh instance per step: it holds nothing between steps, zerofn's state does.
        driver = cls([{"params": shards, **hp}])
        for n, p in zip(group_names, shards, strict=True):
            driver.state[p] = {k: _own_value(v, donate) for k, v in state.per_param[n].items()}
            p.grad = grads[n]
        with torch.no_grad():
            driver.step()
        for n, p in zip(group_names, shards, strict=True):
            p.grad = None
            new_params[n] = p
            new_state[n] = FrozenDict(driver.state[p])
    return new_params, TorchOptimState(FrozenDict(new_state))


def from_torch(
    optimizer_class: type[torch.optim.Optimizer],
    *,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    **defaults: Any,
) -> optim.Optimizer:
    """A functional optimizer that drives any element-wise ``torch.optim`` class on shards.

    Args:
      optimizer_class: e.g. ``torch.optim.Adagrad``; must be element-wise (see
        ``ELEMENTWISE``), others raise ``TypeError``.
      param_groups: per-name overrides as in :mod:`zerofn.optim`.
      **defaults: the class's hyperparameters (``lr=...``); the class's own defaults
        fill the rest and its own validation applies.

    Examples:
      >>> import torch, zerofn as zf
      >>> opt = zf.torch_optim.from_torch(torch.optim.Adagrad, lr=0.1)
      >>> params = {"w": torch.ones(2)}
      >>> new, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> new["w"]
      tensor([0.9000, 0.9000])
    """
    check_shardable(optimizer_class)
    optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)  # torch's own validation
    groups = optim._make_groups(optimizer_class.__name__, param_groups)
    return optim.Optimizer(
        optimizer_class.__name__.lower(),
        FrozenDict(defaults),
        groups,
        _generic_init,
        _generic_update,
        optimizer_class,
    )


def _fast_factory(torch_opt: torch.optim.Optimizer) -> tuple[str, Callable[..., optim.Optimizer]] | None:
    cls = type(torch_opt)
    if cls is torch.optim.SGD:
        return "sgd", optim.sgd
    if cls is torch.optim.AdamW or (cls is torch.optim.Adam and torch_opt.defaults.get("decoupled_weight_decay")):
        return "adam", optim.adamw
    if cls is torch.optim.Adam:
        return "adam", optim.adam
    return None


def from_torch_optimizer(torch_opt: torch.optim.Optimizer, group_names: Sequence[Sequence[str]]) -> optim.Optimizer:
    """The functional twin of a constructed torch optimizer, its groups keyed by name.

    Args:
      torch_opt: a constructed ``torch.optim.Optimizer``.
      group_names: for each of its param groups, the names of its params.

    Returns:
      SGD/Adam/AdamW on the fast path, other element-wise classes on the generic path;
      each torch param group becomes a zerofn param group with its hyperparameters.
    """
    check_shardable(type(torch_opt))
    for g in torch_opt.param_groups:
        if g.get("capturable") or g.get("differentiable"):
            raise ValueError(
                "zerofn: capturable/differentiable torch optimizers are not supported; build it without them"
            )
    fast = _fast_factory(torch_opt)
    groups = []
    for names, g in zip(group_names, torch_opt.param_groups, strict=True):
        keys = _FAST_KEYS[fast[0]] if fast else [k for k in g if k not in ("params", "initial_lr")]
        groups.append({"params": list(names), **{k: g[k] for k in keys if k in g}})
    if fast:
        return fast[1](param_groups=groups)
    return from_torch(type(torch_opt), param_groups=groups)


def group_hyperparams(opt: optim.Optimizer, torch_group: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters of ``torch_group`` that ``opt`` understands (for LR schedules)."""
    if opt.name in ("sgd",):
        keys: Sequence[str] = _FAST_KEYS["sgd"]
    elif opt.name in ("adam", "adamw"):
        keys = _FAST_KEYS["adam"]
    else:
        keys = [k for k in torch_group if k not in ("params", "initial_lr")]
    return {k: torch_group[k] for k in keys if k in torch_group}
