"""Is a full (torch-format) optimizer state dict loadable into this layout? Checked before anything changes.

``torch.optim.Optimizer.load_state_dict`` checks only the number of param groups and of
params per group; a state dict of another model or another optimizer loads silently and
fails later, far from the cause (or trains on garbage). zerofn checks everything it can
before it touches any state, so a failed load leaves every rank exactly as it was:

* the ``param_groups``: a list of dicts whose ``params`` index every param exactly once,
  as many groups and params per group as the optimizer has, the hyperparameters torch
  cannot fill in itself present (``lr``, ``betas``, ...; keys that ``__setstate__`` adds,
  such as ``foreach``, may be missing) and accepted by the torch class's own constructor;
* the ``state``: entries only for indexed params; each one empty (no state yet) or holding
  exactly the keys the optimizer *declares* for that param, each of the declared kind.

What an optimizer declares is found out once per (class, hyperparameters, number of dims)
by running one step of the torch class on a small probe whose dims are distinct primes
(``(2, 3)`` for a matrix): each dim of a state tensor then shows which dim of the param it
follows, or that it is a literal 1, so the declaration is the state's shape as a function
of the param's. Element-wise state has the param's shape (any real floating dtype: it is
cast to the master dtype, as torch casts it to the param's dtype); factored statistics
have their own (Adafactor's ``row_var`` of an ``(m, n)`` matrix is ``(m, 1)``); a 0-d
value is a scalar (a 0-d real tensor or a Python number; ``step`` is kept as a 0-d float32
tensor, as torch creates it).

Everything here is pure and local: no collectives. The messages name the param (name and
index), the key, the expected and found shapes, and the likely cause.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerofn import optim
from zerofn.layout import ParamSpec, ShardLayout

__all__ = ["declared_state", "required_hyperparams", "state_dict_problem"]

# Hyperparameters that select kernels, not arithmetic: never needed from a state dict
# (torch's __setstate__ fills them in) and left out of the probe so it runs anywhere.
_KERNEL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _probe_kwargs(hyperparams: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in hyperparams.items() if k not in _KERNEL_KEYS}


# Distinct primes: on a probe of shape (2, 3, 5, ...) each dim of a state tensor tells which
# dim of the param it follows (or that it is a literal 1, as in factored statistics).
_PROBE_DIMS = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)

# A state shape as a function of the param's shape: per dim, the index of the param dim it
# equals, or -1 for a literal 1. ``None``: a scalar (a number or a 0-d tensor).
ShapeTemplate = tuple[int, ...] | None


@functools.lru_cache(maxsize=256)
def _declared(
    cls: type[torch.optim.Optimizer], hp_items: tuple[tuple[str, Any], ...], ndim: int
) -> tuple[tuple[str, ShapeTemplate], ...]:
    if ndim > len(_PROBE_DIMS):
        raise ValueError(f"zerofn: cannot describe the state of a {ndim}-d param (at most {len(_PROBE_DIMS)} dims)")
    shape = _PROBE_DIMS[: max(ndim, 1)]  # a 0-d param is probed as 1-d: its per-element state is 0-d
    probe = torch.zeros(shape, requires_grad=True)
    hp = dict(hp_items)
    known = _constructor_keys(cls)
    # Known keys as constructor arguments, so torch's own validation sees them (it checks the
    # defaults, not the groups); anything else rides along in the group, as torch allows.
    driver = cls(
        [{"params": [probe], **{k: v for k, v in hp.items() if k not in known}}],
        **{k: v for k, v in hp.items() if k in known},
    )
    probe.grad = torch.full(shape, 0.5)
    with torch.no_grad():
        driver.step()
    kinds: list[tuple[str, ShapeTemplate]] = []
    for key, value in driver.state[probe].items():
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            kinds.append((key, None))
        elif isinstance(value, torch.Tensor) and all(d == 1 or d in shape for d in value.shape):
            kinds.append((key, tuple(shape.index(d) if d in shape else -1 for d in value.shape)))
        else:
            raise TypeError(f"zerofn: {cls.__name__} keeps state {key!r} whose shape does not follow the param's")
    return tuple(kinds)


def declared_state(
    cls: type[torch.optim.Optimizer], hyperparams: Mapping[str, Any], shape: tuple[int, ...]
) -> dict[str, tuple[int, ...] | None]:
    """The state ``cls`` keeps for a param of ``shape`` under ``hyperparams``: key -> expected shape.

    ``None`` marks a scalar (a number or a 0-d tensor, such as ``step``); a tuple is the
    full shape the state tensor has in a torch-format state dict: the param's own shape
    for element-wise state, something else for factored statistics (Adafactor's
    ``row_var`` of a ``(m, n)`` matrix is ``(m, 1)``). Found by one real step of ``cls``
    on a small float32 CPU probe of the same number of dims (cached per class, options and
    number of dims), so it follows the options (``amsgrad`` adds ``max_exp_avg_sq``, SGD
    without momentum keeps nothing). Raises ``ValueError``/``TypeError`` from torch's own
    constructor when the hyperparameters are invalid.

    Examples:
      >>> declared_state(torch.optim.AdamW, {"lr": 1e-3}, (3, 4))
      {'step': None, 'exp_avg': (3, 4), 'exp_avg_sq': (3, 4)}
    """
    if cls.__module__.startswith("torchao.optim"):
        # torchao's low-bit Adams keep Adam's state (quantized moments appear param-shaped);
        # probing them would compile torchao's update. Declared by torch's Adam instead.
        cls = torch.optim.Adam
        hyperparams = {k: v for k, v in hyperparams.items() if k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
    items = tuple(sorted(_probe_kwargs(hyperparams).items(), key=lambda kv: kv[0]))
    out: dict[str, tuple[int, ...] | None] = {}
    for key, template in _declared(cls, items, len(shape)):
        if template is None or not shape:
            out[key] = None if template is None else ()
        else:
            out[key] = tuple(shape[i] if i >= 0 else 1 for i in template)
    return out


@functools.lru_cache(maxsize=64)
def _constructor_keys(cls: type[torch.optim.Optimizer]) -> frozenset[str]:
    """Hyperparameters ``cls.__init__`` takes (AdamW's defaults hold a key its constructor does not)."""
    return frozenset(inspect.signature(cls.__init__).parameters) - {"self", "params"}


@functools.lru_cache(maxsize=64)
def required_hyperparams(cls: type[torch.optim.Optimizer]) -> frozenset[str]:
    """Hyperparameter keys a saved param group must carry: those torch cannot fill in on load.

    ``cls.__setstate__`` fills in keys added in later torch releases (``foreach``,
    ``maximize``, ...); every other key of the class's defaults must be in the state dict,
    or torch's own ``step`` fails with a ``KeyError`` after the load.
    """
    probe = torch.zeros(2, 2, requires_grad=True)  # a matrix: some classes (Muon) take nothing else
    try:
        instance = cls([probe])
    except TypeError:  # no default learning rate (SGD before torch 2.x, ...)
        instance = cls([probe], lr=1e-3)
    group: dict[str, Any] = {"params": []}
    instance.__setstate__({"state": {}, "param_groups": [group]})
    # Kernel switches are never needed to step (torch's own Adafactor state dicts omit
    # ``differentiable``): only the arithmetic's hyperparameters are required.
    return frozenset(set(instance.defaults) - set(group) - _KERNEL_KEYS)


def _likely_cause(found: tuple[int, ...], spec: ParamSpec) -> str:
    numel = math.prod(found)
    if len(found) == 1 and spec.numel > 1 and 0 < numel < spec.numel and -(-spec.numel // numel) > 1:
        world = -(-spec.numel // numel)
        return (
            f"it looks like one rank's shard (world size {world}): pass the full state dict from "
            "ZeroOptimizer.state_dict() or zf.checkpoint.full_state_dict(), or reshard through zf.checkpoint.save/load"
        )
    if numel == spec.numel:
        return "same number of elements, other shape: the state dict was saved from another model"
    return "the state dict was saved from another model (or lists its params in another order)"


def _index_problem(groups: Sequence[Any], state: Mapping[Any, Any], group_sizes: Sequence[int] | None) -> str | None:
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        return "'param_groups' must be a list of dicts, each with a 'params' list"
    sizes = [len(g["params"]) for g in groups]
    if group_sizes is not None and len(sizes) != len(group_sizes):
        return (
            f"the state dict has {len(sizes)} param groups, this optimizer {len(group_sizes)}: it was saved "
            "from another optimizer setup (build the optimizer with the same param groups)"
        )
    if group_sizes is not None and list(sizes) != list(group_sizes):
        g = next(i for i, (a, b) in enumerate(zip(sizes, group_sizes, strict=True)) if a != b)
        return (
            f"param group {g} of the state dict has {sizes[g]} params, this optimizer's {group_sizes[g]}: it "
            "was saved from another model or another grouping of its params"
        )
    indices = [i for g in groups for i in g["params"]]
    if sorted(indices) != list(range(len(indices))):
        return f"the param groups must index the params 0..{len(indices) - 1} once each, found {sorted(indices)}"
    stray = sorted(int(k) for k in state if int(k) not in set(indices))
    if stray:
        return f"'state' has entries for param indices {stray} that no param group lists"
    return None


def _value_problem(key: str, expected: tuple[int, ...] | None, value: Any, spec: ParamSpec, where: str) -> str | None:
    if expected is None:
        if isinstance(value, bool) or not (
            isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0)
        ):
            found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return f"{where}: state {key!r} must be a number or a 0-d tensor, found {found}"
        if isinstance(value, torch.Tensor) and (value.is_complex() or value.dtype == torch.bool):
            return f"{where}: state {key!r} has dtype {value.dtype}, expected a real number"
        return None
    if not isinstance(value, torch.Tensor):
        return f"{where}: state {key!r} must be a tensor of shape {expected}, found {type(value).__name__}"
    if tuple(value.shape) != expected:
        like = " (the param's shape)" if expected == spec.shape else f" for a param of shape {spec.shape}"
        return (
            f"{where}: state {key!r} has shape {tuple(value.shape)}, expected {expected}{like}: "
            f"{_likely_cause(tuple(value.shape), spec)}"
        )
    if not value.is_floating_point():
        return f"{where}: state {key!r} has dtype {value.dtype}, expected a floating dtype (it is cast to the master's)"
    return None


def state_dict_problem(
    full: Any,
    layout: ShardLayout,
    order: Sequence[str],
    optimizer: optim.Optimizer,
    *,
    group_sizes: Sequence[int] | None = None,
) -> str | None:
    """What makes ``full`` unloadable into ``layout`` with ``optimizer``; ``None`` if nothing does.

    Args:
      full: a torch-format state dict (``{"state": {...}, "param_groups": [...]}``, possibly
        with a ``"zerofn"`` entry, whose masters are checked too).
      layout: the layout being loaded into (full shapes per name).
      order: the param name of each state-dict index, ``order[i]`` for index ``i``.
      optimizer: the functional optimizer that will own the state (its ``torch_class``
        declares the state keys); the saved hyperparameters of each group are used.
      group_sizes: params per param group of the optimizer being loaded into, if known.

    Returns:
      A message naming the param (name and index), the key, expected and found shapes and
      the likely cause, or ``None``.
    """
    if not isinstance(full, Mapping) or "state" not in full or "param_groups" not in full:
        return "a state dict needs 'state' and 'param_groups' entries (from optimizer.state_dict())"
    groups, state = full["param_groups"], full["state"]
    if not isinstance(state, Mapping):
        return "'state' must be a dict param index -> {key: value}"
    problem = _index_problem(groups, state, group_sizes)
    if problem:
        return problem
    if len(order) != sum(len(g["params"]) for g in groups):
        return f"the state dict lists {sum(len(g['params']) for g in groups)} params, the model has {len(order)}"
    cls = optimizer.torch_class
    required = required_hyperparams(cls)
    name_of = dict(enumerate(order))
    for g, group in enumerate(groups):
        missing = sorted(required - set(group))
        if missing:
            return (
                f"param group {g} has no {', '.join(map(repr, missing))}: {cls.__name__} needs them to step "
                "(was the state dict saved from another optimizer?)"
            )
        # torchao keeps lr as a 0-d tensor: checked as its (exact) float
        hyperparams = {
            k: v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v
            for k, v in group.items()
            if k != "params"
        }
        # torch's own validation of the values, on a probe shaped like the group's first param
        # (a matrix-only class such as Muon refuses anything else).
        first = layout[name_of[group["params"][0]]].shape if group["params"] else (2,)
        try:
            optim._check_hyperparams(optimizer.name, hyperparams)
            declared_state(cls, hyperparams, first)
        except (ValueError, TypeError, RuntimeError) as e:
            return f"param group {g}: invalid hyperparameters for {cls.__name__} ({e})"
        for index in group["params"]:
            entry = state.get(index, state.get(str(index)))
            if entry is None or len(entry) == 0:
                continue  # no state yet: created at the param's first step, as torch does
            name = name_of[index]
            declared = declared_state(cls, hyperparams, layout[name].shape)
            where = f"param {name!r} (index {index})"
            if not isinstance(entry, Mapping):
                return f"{where}: its state must be a dict key -> value, found {type(entry).__name__}"
            if set(entry) != set(declared):
                extra, absent = sorted(set(entry) - set(declared)), sorted(set(declared) - set(entry))
                what = "; ".join(
                    part
                    for part in (
                        f"unexpected {', '.join(map(repr, extra))}" if extra else "",
                        f"missing {', '.join(map(repr, absent))}" if absent else "",
                    )
                    if part
                )
                return (
                    f"{where}: state keys {sorted(entry)} are not {cls.__name__}'s {sorted(declared)} ({what}): the "
                    "state dict was saved from another optimizer or with other options (e.g. amsgrad, momentum)"
                )
            for key, expected in declared.items():
                problem = _value_problem(key, expected, entry[key], layout[name], where)
                if problem:
                    return problem
    zmeta = full.get("zerofn")
    if isinstance(zmeta, Mapping) and isinstance(zmeta.get("master"), Mapping):
        for name, master in zmeta["master"].items():
            if name in layout and (not isinstance(master, torch.Tensor) or tuple(master.shape) != layout[name].shape):
                found = tuple(master.shape) if isinstance(master, torch.Tensor) else type(master).__name__
                return f"param {name!r}: master weights have shape {found}, expected {layout[name].shape}"
    return None
