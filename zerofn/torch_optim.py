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

Optimizers that need whole tensors are run on whole tensors, never on shards:
``torch.optim.Muon`` (it orthogonalises each 2-D matrix) and ``torch.optim.Adafactor``
(factored row/column second moments, and a step size scaled by the RMS of the param and
of the update, for 1-D params too) declare placement ``"whole"`` for every param they
update, so each such param lives on one owner rank in its full shape and the torch class
runs there unchanged (see :mod:`zerofn.layout`). Any other class must declare itself:
``from_torch(cls, placement="split")`` (element-wise) or ``"whole"``; an undeclared class
is refused with that advice. LBFGS (a closure and a line search over the full parameter
vector) and SparseAdam (sparse gradients) are refused.

``torch.optim.Adafactor`` came with torch 2.5 and ``torch.optim.Muon`` with torch 2.9;
:func:`torch_class` names the version when the installed torch lacks one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zerofn import optim
from zerofn._torch_driver import TorchOptimState as TorchOptimState
from zerofn._torch_driver import generic_init, generic_update
from zerofn._tree import FrozenDict

__all__ = [
    "ELEMENTWISE",
    "WHOLE_TENSOR",
    "TorchOptimState",
    "from_torch",
    "from_torch_optimizer",
    "from_torch_optimizers",
    "torch_class",
]

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
}

# The torch version that brought each whole-tensor class (the error where it is missing).
_SINCE = {"Muon": "2.9", "Adafactor": "2.5"}


def torch_class(name: str) -> type[torch.optim.Optimizer]:
    """``torch.optim.<name>``, or an ``AttributeError`` saying which torch version brings it.

    Examples:
      >>> torch_class("Adafactor").__name__
      'Adafactor'
    """
    cls = getattr(torch.optim, name, None)
    if cls is None:
        since = f"; it comes with torch {_SINCE[name]}" if name in _SINCE else ""
        raise AttributeError(f"torch {torch.__version__} has no torch.optim.{name}{since}")
    return cls


def _muon_placement(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) != 2:
        raise ValueError(
            f"torch.optim.Muon updates 2-D weight matrices only; param {name!r} has shape {shape}. "
            "Give it to another optimizer: zf.optim.partition([(is_matrix, muon), (lambda n: True, adamw)]), "
            "or ZeroOptimizer([muon, adamw], ...)"
        )
    return "whole"


def _adafactor_placement(name: str, shape: tuple[int, ...]) -> str:
    # Whole also for 1-D params: the step is scaled by the RMS of the whole param and
    # clipped by the RMS of the whole update, so a shard would get a different step.
    del name, shape
    return "whole"


# Classes (by name: older torch lacks them) whose update reads whole tensors, with the
# placement rule for their params.
WHOLE_TENSOR: dict[str, Callable[[str, tuple[int, ...]], str]] = {
    "Muon": _muon_placement,
    "Adafactor": _adafactor_placement,
}

_DECLARE = (
    "Declare how it updates: from_torch({cls}, placement='split', ...) if the update of every element "
    "reads only that element's gradient and state (it then runs on 1/N shards of each param), or "
    "placement='whole' if it reads whole tensors (each param then lives, whole, on one owner rank); "
    "placement may also be a function (name, shape) -> 'split' | 'whole'."
)


def _is_torchao(cls: type) -> bool:
    """A torchao low-bit Adam class (``torchao.optim.AdamW8bit``, ...), recognised without importing torchao."""
    return cls.__module__.startswith("torchao.optim") and cls.__name__ in (
        "AdamW8bit",
        "AdamW4bit",
        "AdamWFp8",
        "Adam8bit",
        "Adam4bit",
        "AdamFp8",
    )


def _placement_rule(
    cls: type[torch.optim.Optimizer], placement: str | Callable[[str, tuple[int, ...]], str] | None
) -> Callable[[str, tuple[int, ...]], str] | None:
    """The placement rule of ``cls`` (``None``: split everywhere), or ``TypeError``."""
    if cls.__name__ in _REFUSED_WHY:
        raise TypeError(f"zerofn cannot shard {cls.__name__}: {_REFUSED_WHY[cls.__name__]}.")
    known = WHOLE_TENSOR.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
    if placement is None:
        if cls in ELEMENTWISE:
            return None
        if known is not None:
            return known
        raise TypeError(
            f"zerofn cannot tell whether {cls.__name__} updates each element independently. "
            + _DECLARE.format(cls=cls.__name__)
        )
    if callable(placement):
        return placement
    if placement not in ("split", "whole"):
        raise ValueError(f"from_torch: placement must be 'split', 'whole' or a function, got {placement!r}")
    if placement == "split" and known is not None:
        raise ValueError(
            f"from_torch: {cls.__name__} reads whole tensors and cannot run on shards; leave placement unset"
        )
    if placement == "split":
        return None
    return lambda name, shape: "whole"


_FAST_KEYS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "fused"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused"),
}


def check_shardable(cls: type[torch.optim.Optimizer]) -> None:
    """Raise ``TypeError`` unless zerofn can drive a constructed ``cls`` (the facade's rule).

    The element-wise classes (``ELEMENTWISE``) run on 1-D shards; the known whole-tensor
    classes of ``torch.optim`` (``WHOLE_TENSOR``: Muon, Adafactor) run on whole params on
    their owners. Anything else is refused, naming what to do instead.
    """
    if cls in ELEMENTWISE or (cls.__name__ in WHOLE_TENSOR and cls.__module__.startswith("torch.optim")):
        return
    if _is_torchao(cls):  # low-bit state: zerofn.lowbit drives torchao's own pieces on blocked shards
        return
    why = _REFUSED_WHY.get(cls.__name__)
    if why is None:
        why = (
            "zerofn cannot tell whether its update reads only each element's gradient and state. Declare it "
            f"with the functional API: zf.torch_optim.from_torch({cls.__name__}, placement='split' | 'whole', ...) "
            "and ZeroOptimizer(model.named_parameters(), <that optimizer>)"
        )
    names = ", ".join(c.__name__ for c in (*ELEMENTWISE,)) + ", " + ", ".join(WHOLE_TENSOR)
    raise TypeError(f"zerofn cannot shard {cls.__name__}: {why}. Supported torch optimizers: {names}.")


def from_torch(
    optimizer_class: type[torch.optim.Optimizer],
    *,
    placement: str | Callable[[str, tuple[int, ...]], str] | None = None,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    **defaults: Any,
) -> optim.Optimizer:
    """A functional optimizer that drives a ``torch.optim`` class on what each rank holds.

    Element-wise classes (``ELEMENTWISE``) run on 1-D shards; whole-tensor classes
    (``WHOLE_TENSOR``: Muon, Adafactor) declare placement ``"whole"``, so
    :func:`zerofn.shard_params` gives each of their params to one owner rank in its full
    shape and the class runs there, unchanged: its update is torch's own, bit for bit.

    Args:
      optimizer_class: e.g. ``torch.optim.Adagrad`` or ``torch.optim.Muon``.
      placement: for a class zerofn does not know: ``"split"`` (element-wise), ``"whole"``,
        or a function ``(name, shape) -> "split" | "whole"``. ``None``: the known rule;
        an unknown class without it raises ``TypeError`` saying how to declare it.
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
    rule = _placement_rule(optimizer_class, placement)
    optimizer_class([torch.zeros(1, 1, requires_grad=True)], **defaults)  # torch's own validation
    groups = optim._make_groups(optimizer_class.__name__, param_groups)
    return optim.Optimizer(
        optimizer_class.__name__.lower(),
        FrozenDict(defaults),
        groups,
        generic_init,
        generic_update,
        optimizer_class,
        rule,
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
      SGD/Adam/AdamW on the fast path, other element-wise classes on the generic path,
      Muon/Adafactor on the generic path with their params placed whole; each torch
      param group becomes a zerofn param group with its hyperparameters.
    """
    check_shardable(type(torch_opt))
    if _is_torchao(type(torch_opt)):
        from zerofn import lowbit

        return lowbit.from_torchao(torch_opt, group_names)
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


def from_torch_optimizers(
    torch_opts: Sequence[torch.optim.Optimizer], group_names: Sequence[Sequence[Sequence[str]]]
) -> optim.Optimizer:
    """One functional optimizer over several constructed torch optimizers: a partition.

    The usual Muon recipe, ``[torch.optim.Muon(matrices), torch.optim.AdamW(rest)]``,
    becomes ``zf.optim.partition([(names of Muon's params, muon), (AdamW's, adamw)])``, so
    one layout, one gradient reduction and one global norm serve all of them.

    Args:
      torch_opts: the torch optimizers, in order; each param in exactly one of them.
      group_names: for each optimizer, for each of its param groups, the names of its
        params (as for :func:`from_torch_optimizer`).

    Returns:
      A :func:`zerofn.optim.partition` whose part ``k`` is
      ``from_torch_optimizer(torch_opts[k], group_names[k])``, selecting exactly its names.

    Raises:
      ValueError: a name appears in two optimizers (naming it and both positions).
    """
    seen: dict[str, int] = {}
    for k, groups in enumerate(group_names):
        for name in (n for g in groups for n in g):
            if name in seen:
                raise ValueError(
                    f"zerofn: param {name!r} is in optimizers[{seen[name]}] and optimizers[{k}]; each param "
                    "must be in exactly one of the wrapped optimizers: take it out of one of them"
                )
            seen[name] = k
    return optim.partition(
        [
            (frozenset(n for g in groups for n in g), from_torch_optimizer(o, groups))
            for o, groups in zip(torch_opts, group_names, strict=True)
        ]
    )


def group_hyperparams(opt: optim.Optimizer, torch_group: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters of ``torch_group`` that ``opt`` understands (for LR schedules)."""
    if opt.name in ("sgd",):
        keys: Sequence[str] = _FAST_KEYS["sgd"]
    elif opt.name in ("adam", "adamw"):
        keys = _FAST_KEYS["adam"]
    elif "lowbit" in opt.static:  # torchao keeps lr as a 0-d float32 tensor: its float is exact
        hp = {k: torch_group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad") if k in torch_group}
        if isinstance(hp.get("lr"), torch.Tensor):
            hp["lr"] = float(hp["lr"])
        return hp
    else:
        keys = [k for k in torch_group if k not in ("params", "initial_lr")]
    return {k: torch_group[k] for k in keys if k in torch_group}


def with_live_hyperparams(
    opt: optim.Optimizer, torch_groups: Sequence[Mapping[str, Any]], known: tuple[Any, ...] | None = None
) -> tuple[optim.Optimizer, tuple[Any, ...]]:
    """``opt`` with the hyperparameters now in ``torch_groups`` (an LR scheduler may have changed them).

    Group ``i`` of ``torch_groups`` updates ``opt``'s group ``i`` (a trailing group without
    its own entry in ``opt.groups`` updates the defaults). For a :func:`zerofn.optim.partition`
    built by :func:`from_torch_optimizers`, ``torch_groups`` are the wrapped optimizers'
    groups one after the other: part ``k`` takes as many as it has groups. Returns the
    optimizer and a key of the hyperparameters read; when it equals ``known`` (the key of
    the last call), ``opt`` itself is returned unchanged, so an unchanged schedule costs no
    rebuild.
    """
    if opt.parts:
        spans, start = [], 0
        for _, part in opt.parts:
            spans.append((part, torch_groups[start : start + len(part.groups)]))
            start += len(part.groups)
        per_part = [[group_hyperparams(part, g) for g in groups] for part, groups in spans]
    else:
        per_part = [[group_hyperparams(opt, g) for g in torch_groups]]
    key = tuple(tuple(tuple(sorted(hp.items(), key=lambda kv: kv[0])) for hp in part) for part in per_part)
    if key == known:
        return opt, key
    if not opt.parts:
        return _with_group_hyperparams(opt, per_part[0]), key
    for k, ((_, part), hps) in enumerate(zip(opt.parts, per_part, strict=True)):
        opt = opt.with_part(k, _with_group_hyperparams(part, hps))
    return opt, key


def _with_group_hyperparams(opt: optim.Optimizer, per_group: Sequence[Mapping[str, Any]]) -> optim.Optimizer:
    for i, hp in enumerate(per_group):
        opt = opt.with_hyperparams(i if i < len(opt.groups) else None, **hp)
    return opt
