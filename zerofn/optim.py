"""Functional optimizers: pure ``init`` / ``update`` pairs with torch.optim's numerics.

An :class:`Optimizer` is a value: a name, hyperparameters (per parameter group) and two
pure functions. ``init(params)`` builds the state for a ``name -> tensor`` mapping;
``update(grads, state, params)`` returns new params and new state and changes nothing it
was given. zerofn calls them on 1-D shards, but they work on any tensors.

The arithmetic is torch.optim's, bit for bit: each optimizer has one update
(:mod:`zerofn._optim_update`) that applies its rule (:mod:`zerofn._optim_rules`) once per
run of consecutive params of a flat buffer, or per tensor of a plain mapping. With torch's
default kernel choice on the CPU the rule is torch's single-tensor arithmetic written out,
the same code eagerly and inside a ``torch.compile`` graph; ``foreach`` / ``fused`` (and,
eagerly, bfloat16/float16 or non-CPU tensors) call torch's own functional kernels
(``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``). Element-wise updates give the same
bits on a slice as on the whole tensor, so an update of shards is bitwise the update
torch.optim makes on the full parameters, given bitwise-equal gradients.

Parameter groups work as in torch, by name::

    opt = zf.optim.adamw(lr=1e-3, weight_decay=0.1,
                         param_groups=[{"params": ["fc.bias", "ln.weight"], "weight_decay": 0.0}])

A name belongs to the first group that lists it (``"params"`` is a collection of names
or a predicate ``name -> bool``); names no group lists use the factory's hyperparameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zerofn._optim_state import AdamState as AdamState
from zerofn._optim_state import SGDState as SGDState
from zerofn._optim_update import adam_init, adam_update, sgd_init, sgd_update
from zerofn._optimizer import NameSelector as NameSelector
from zerofn._optimizer import Optimizer, PartitionState, _check_hyperparams, _make_groups, partition
from zerofn._optimizer import ParamGroup as ParamGroup
from zerofn._tree import FrozenDict

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


def _optimizer(
    name: str,
    defaults: dict[str, Any],
    param_groups: Sequence[Mapping[str, Any]] | None,
    init: Callable[..., Any],
    update: Callable[..., Any],
    torch_class: type[torch.optim.Optimizer],
    skips: Callable[[Optimizer], bool] | None = None,
) -> Optimizer:
    """The ``Optimizer`` of a factory: its hyperparameters and every group's checked (``ValueError``
    naming ``name``) before anything is built. ``skips``: whether ``update`` honours ``skip=`` itself."""
    frozen = FrozenDict(defaults)
    _check_hyperparams(name, frozen)
    return Optimizer(name, frozen, _make_groups(name, param_groups), init, update, torch_class, _skips=skips)


# --------------------------------------------------------------------------- sgd


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
    defaults = dict(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        foreach=foreach,
        fused=fused,
    )
    return _optimizer("sgd", defaults, param_groups, sgd_init, sgd_update, torch.optim.SGD)


# --------------------------------------------------------------------------- adam / adamw


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
    defaults = dict(
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
        fused=fused,
    )
    return _optimizer(name, defaults, param_groups, adam_init, adam_update, torch_class, skips=_all_fused)


def _all_fused(opt: Optimizer) -> bool:
    """Every group runs torch's fused kernel, which reads a skip as its ``found_inf``."""
    return all(hp["fused"] for hp in (opt.defaults, *(g.hyperparams for g in opt.groups)) if "fused" in hp)


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
