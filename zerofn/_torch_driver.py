"""A ``torch.optim`` class driven on zerofn's shards: the update of a :func:`~zerofn.torch_optim.from_torch` optimizer.

Eagerly a throw-away instance of the class is pointed at a param group's shards, given
their state, stepped, and its state read back (:func:`generic_update`): the class's own
arithmetic, unchanged. Inside a ``torch.compile`` graph no optimizer can be built, so
only ``torch.optim.Muon`` is served there, through torch's own single-tensor kernel
(:func:`_muon_traced`); :func:`refuse_uncompiled` says why the others are refused, and
:func:`state_for_compile` makes the state Muon creates lazily. No collectives.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from zerofn import _optimizer, _traced, optim
from zerofn._tree import FrozenDict

__all__ = ["TorchOptimState", "generic_init", "generic_update", "refuse_uncompiled", "state_for_compile"]


class TorchOptimState(NamedTuple):
    """State of a :func:`from_torch` optimizer.

    Attributes:
      per_param: name -> the torch optimizer's state dict for that shard (tensors shaped
        like the shard, ``step`` as torch keeps it); empty until the param's first step,
        as in torch.
    """

    per_param: FrozenDict[FrozenDict[Any]]


def generic_init(opt: optim.Optimizer, params: Mapping[str, torch.Tensor]) -> TorchOptimState:
    del opt
    return TorchOptimState(FrozenDict({n: FrozenDict() for n in params}))


def _own_value(v: Any, donate: bool) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) and not donate else v


def generic_update(
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
    if torch.compiler.is_compiling():
        refuse_uncompiled(opt)
        _muon_traced(opt, names, grads, state, params, new_params, new_state)
        return new_params, TorchOptimState(FrozenDict(new_state))
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


_NOT_COMPILED = (
    "zerofn.torch_optim.from_torch({cls}) under torch.compile: zerofn steps a torch.optim.{cls} instance built "
    "on the shards each step, and torch.compile does not trace building an optimizer{why}. Compile a step with "
    "zerofn.optim.sgd / adam / adamw or torch.optim.Muon (through from_torch), or keep step_shards eager for "
    "{cls}"
)
_NOT_COMPILED_LOWBIT = (
    "zerofn.optim.{name} under torch.compile: its state is torchao's quantized tensor subclasses, updated by "
    "torchao's own compiled kernels, which a compiled zerofn step does not trace into its graph. Keep step_shards "
    "eager for it, or compile a step with zerofn.optim.sgd / adam / adamw"
)
_NOT_COMPILED_WHY = {
    "Adafactor": " (its update also reads the step count and two norms on the host, with .item(), every step)",
}
_MUON_FIRST_STEP = (
    "torch.optim.Muon under torch.compile: the momentum buffers of {names} do not exist yet (Muon creates them "
    "at the param's first step), so the state would change its structure inside the graph. Pass "
    "state.as_tensors() to the compiled step: it makes them (as the same zeros)"
)
_MUON_TENSOR_LR = (
    "torch.optim.Muon under torch.compile takes a float lr (a new lr is a new optimizer: "
    "opt.with_hyperparams(lr=...), which compiles once per value); got a tensor lr, which its update would "
    "read on the host"
)


def _muon_traced(
    opt: optim.Optimizer,
    names: list[str],
    grads: Mapping[str, torch.Tensor],
    state: TorchOptimState,
    params: Mapping[str, torch.Tensor],
    new_params: dict[str, torch.Tensor],
    new_state: dict[str, FrozenDict[Any]],
) -> None:
    """Muon's update of whole params inside a compiled graph: torch's own single-tensor kernel.

    ``torch.optim.Muon.step`` calls ``_single_tensor_muon`` with the group's
    hyperparameters; here it is called directly on copies of the params and momentum
    buffers (a compiled graph cannot build an optimizer instance), so the arithmetic is the
    same, bit for bit. The buffers must exist (one eager step first) and ``lr`` be a float.
    """
    from torch.optim._muon import _single_tensor_muon

    missing = [n for n in names if "momentum_buffer" not in state.per_param[n]]
    if missing:  # (not from state.as_tensors(), which makes them)
        _traced.refuse(_MUON_FIRST_STEP.format(names=missing))
    by_group: dict[int, list[str]] = {}
    for n in names:
        by_group.setdefault(opt.group_index(n), []).append(n)
    for group_names in by_group.values():
        hp = {**_MUON_DEFAULTS, **opt.hyperparams(group_names[0])}
        ps = [params[n].clone() for n in group_names]
        bufs = [state.per_param[n]["momentum_buffer"].clone() for n in group_names]
        _single_tensor_muon(
            ps,
            [grads[n] for n in group_names],
            bufs,
            lr=hp["lr"],
            weight_decay=hp["weight_decay"],
            momentum=hp["momentum"],
            nesterov=hp["nesterov"],
            ns_coefficients=hp["ns_coefficients"],
            ns_steps=hp["ns_steps"],
            eps=hp["eps"],
            adjust_lr_fn=hp["adjust_lr_fn"],
            has_complex=False,
        )
        for n, p, b in zip(group_names, ps, bufs, strict=True):
            new_params[n] = p
            new_state[n] = FrozenDict({**state.per_param[n], "momentum_buffer": b})


def refuse_uncompiled(opt: optim.Optimizer) -> None:
    """At trace time: refuse a compiled step whose optimizer (or a part of it) cannot be compiled.

    Decided on the optimizer alone, which every rank holds alike (a rank may own no param
    of a whole-tensor part, and then never calls that part's update), so every rank
    refuses while tracing and none waits in the graph's collectives for the others.
    ``from_torch`` classes other than ``torch.optim.Muon`` drive a torch.optim instance
    (not traceable); Muon needs a float lr; the low-bit optimizers (:mod:`zerofn.lowbit`)
    run torchao's kernels on quantized state.
    """
    for _, part in opt.parts:
        refuse_uncompiled(part)
    if "lowbit" in opt.static:
        _traced.refuse(_NOT_COMPILED_LOWBIT.format(name=opt.name))
    if opt.parts or opt._update is not generic_update:
        return
    cls = opt.torch_class
    if cls.__name__ != "Muon" or not cls.__module__.startswith("torch.optim"):
        _traced.refuse(_NOT_COMPILED.format(cls=cls.__name__, why=_NOT_COMPILED_WHY.get(cls.__name__, "")))
    if any(isinstance(hp.get("lr"), torch.Tensor) for hp in [opt.defaults, *(g.hyperparams for g in opt.groups)]):
        _traced.refuse(_MUON_TENSOR_LR)


def state_for_compile(opt: optim.Optimizer, opt_state: Any, params: Mapping[str, torch.Tensor]) -> Any:
    """``opt_state`` with the state torch creates lazily as zeros made now (for a compiled step).

    ``torch.optim.Muon`` creates a param's momentum buffer as zeros at its first step; a
    compiled step needs the buffer to exist from the start (its state keeps one structure),
    so it is made here as the same zeros: the first update is bitwise the eager one. Every
    other optimizer's state is returned as it is (the same object when nothing changed).
    """
    if opt.parts:
        subs = _optimizer._split_names(opt, params)
        states = tuple(
            state_for_compile(part, s, sub) for (_, part), s, sub in zip(opt.parts, opt_state.states, subs, strict=True)
        )
        changed = any(a is not b for a, b in zip(states, opt_state.states, strict=True))
        return optim.PartitionState(states) if changed else opt_state
    if opt.name != "muon" or not isinstance(opt_state, TorchOptimState):
        return opt_state
    missing = [n for n, s in opt_state.per_param.items() if "momentum_buffer" not in s and n in params]
    if not missing:
        return opt_state
    per_param = dict(opt_state.per_param)
    for n in missing:
        per_param[n] = FrozenDict({**per_param[n], "momentum_buffer": torch.zeros_like(params[n])})
    return TorchOptimState(FrozenDict(per_param))


def _defaults_of(cls: type | None) -> FrozenDict[Any]:
    """A class's keyword defaults (for ``torch.optim.Muon``: what an instance's group holds)."""
    if cls is None:
        return FrozenDict()
    sig = inspect.signature(cls.__init__)
    return FrozenDict({k: v.default for k, v in sig.parameters.items() if v.default is not inspect.Parameter.empty})


# Read once at import (a compiled step reads a constant, not the signature).
_MUON_DEFAULTS = _defaults_of(getattr(torch.optim, "Muon", None))
