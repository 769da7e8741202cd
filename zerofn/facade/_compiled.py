"""``ZeroOptimizer(compile=...)``: everything ``step`` does after backward as one compiled graph.

The gradient hooks stay eager (they run inside autograd, bucket by bucket). What ``step``
does once the shards are in hand, :func:`~zerofn.step_shards` (global norm, overflow flag,
loss-scale update, unscale and clip, the optimizer update, the skip) and
:func:`~zerofn.gather_params` (the bucketed all-gather of the new params), runs as one
``torch.compile(fullgraph=True)`` graph, the functional step's (``docs/jit.md``), and the
params take the gathered values once it has returned: its collectives are torch's functional collectives, its decisions
tensor math, its checks the functional step's verdict nodes.

What the facade does around the graph, every step, eagerly:

- the numbers that change (the step count and the loss-scale state) are the state's 0-d
  tensors, inputs of the graph as of the eager step, so the loss scale ``backward``
  multiplies by, ``state_dict`` and checkpoints are the eager facade's;
- each param group's learning rate enters as a 0-d float64 tensor this module owns and
  fills from ``param_groups`` before every call (an LR scheduler or a hand edit of
  ``param_groups[i]["lr"]`` never recompiles); the other hyperparameters are constants of
  the graph: changing one (``betas``, ``weight_decay``) compiles a new graph once;
- a rank whose params the user wrote since the last step (its veto) takes the eager
  ``step_shards``, whose scalar all-reduce and object all-gather match the graph's, so
  every rank raises ``StepVetoed`` alike and the facade adopts the writes as eagerly.

Dynamo keeps compiled graphs per code object and stops compiling a function after
``torch._dynamo.config.recompile_limit`` graphs, running it eagerly from then on. Each
facade configuration (group, clipping, bucket size, policy, layout) compiles its own copy
of the step function (its own code object), which facades alike share (a rebuilt
optimizer reuses the graph), and the call runs with ``fail_on_recompile_limit_hit``: a
step that would recompile past the limit raises instead of silently running eagerly.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import optim
from zerofn._comm import CommPolicy
from zerofn._torch_driver import generic_update
from zerofn._tree import FrozenDict
from zerofn.optim import ParamGroup
from zerofn.stages import gather_params, step_shards
from zerofn.state import StepInfo, ZeroState

__all__ = ["DEFAULT_BACKEND", "CompiledStep", "check_compilable", "resolve_backend"]

DEFAULT_BACKEND = "inductor"
"""``compile=True``'s backend: torch.compile's own default (generated kernels)."""

_COMPILABLE = ("adam", "adamw")


def resolve_backend(compile_: object) -> str | None:
    """``compile=`` as a backend name: ``None`` (eager), ``DEFAULT_BACKEND`` for True, or the string given."""
    if compile_ is False or compile_ is None:
        return None
    if compile_ is True:
        return DEFAULT_BACKEND
    if isinstance(compile_, str) and compile_:
        return compile_
    raise TypeError(
        f"ZeroOptimizer: compile must be False, True or a torch.compile backend name such as 'aot_eager', "
        f"got {compile_!r}"
    )


def check_compilable(opt: optim.Optimizer, *, overlap_allgather: bool) -> None:
    """Raise, naming what cannot run in a compiled step and what to write instead; return if all can.

    Compiled: zerofn's Adam and AdamW (the single-tensor kernel, the CPU default, or torch's
    fused kernel as one opaque op), alone or as the parts of a partition. Not:
    ``overlap_allgather`` (the gathers leave the step for the next forward), SGD, torch
    optimizers on zerofn's generic path (their own ``step()`` breaks a graph), low-bit
    state, ``foreach=True``.
    """
    if overlap_allgather:
        raise ValueError(
            "ZeroOptimizer(compile=...): overlap_allgather=True launches the param gathers for the next forward, "
            "outside the step, while a compiled step gathers inside its graph; pass one of overlap_allgather=True "
            "and compile=..."
        )
    parts = [p for _, p in opt.parts] if opt.parts else [opt]
    for part in parts:
        what = _uncompilable(part)
        if what is not None:
            raise TypeError(
                f"ZeroOptimizer(compile=...): {what}, so its step cannot be compiled into one graph. A compiled "
                "step runs zerofn's Adam and AdamW: wrap torch.optim.Adam/AdamW (foreach left at None) "
                "or pass zf.optim.adam/adamw, or build the ZeroOptimizer with compile=False"
            )


def _uncompilable(opt: optim.Optimizer) -> str | None:
    """Why ``opt`` (not a partition) cannot be traced, or ``None``."""
    if opt.name not in _COMPILABLE:
        if opt._update is generic_update:
            return (
                f"torch.optim.{opt.torch_class.__name__} runs on zerofn's generic path, which calls the torch "
                "optimizer's own step() (a graph break)"
            )
        return f"zerofn.optim.{opt.name} has no traced update"
    for hp in (opt.defaults, *(g.hyperparams for g in opt.groups)):
        if hp.get("foreach"):
            return f"{opt.name} is built with foreach=True (torch's foreach kernel is not traced; fused=True is)"
    return None


class CompiledStep:
    """One facade's compiled step: ``step_shards`` and ``gather_params`` in one graph.

    Args:
      backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ...).
      group: the sharding process group.
      max_norm: the clip threshold or ``None``.
      norm_type: 2.0 or ``math.inf``.
      bucket_numel: the gather's bucket size (confirmed on every rank at construction).
      comm_policy: the collective realisations.
      fingerprint: the layout's; with the settings above, the key under which facades
        alike share one compiled function.
    """

    def __init__(
        self,
        backend: str,
        group: comm.Group,
        max_norm: float | None,
        norm_type: float,
        bucket_numel: int,
        comm_policy: CommPolicy,
        fingerprint: str,
    ) -> None:
        self.backend = backend
        key = (backend, comm.group_name(group), max_norm, norm_type, bucket_numel, comm_policy, fingerprint)
        fn = _SHARED.pop(key, None)
        if fn is None:
            fn = torch.compile(
                _own_code(_make_tail(group, max_norm, norm_type, bucket_numel, comm_policy)),
                fullgraph=True,
                backend=backend,
                dynamic=False,
            )
        _SHARED[key] = fn  # most recent last
        while len(_SHARED) > _SHARED_MAX:
            _SHARED.pop(next(iter(_SHARED)))
        self._fn = fn
        self._lrs: dict[tuple[Any, ...], torch.Tensor] = {}
        self._key: tuple[Any, ...] | None = None
        self._opt: optim.Optimizer | None = None

    def __call__(
        self, state: ZeroState, shards: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> tuple[ZeroState, StepInfo]:
        """The step on ``state`` (with its live hyperparameters); the new state and the info as numbers.

        Writes the gathered params into ``params`` once the graph has returned (one
        ``_foreach_copy_``; nothing when it raised). Collectives: the functional step's,
        in one graph: one scalar all-reduce (norm, overflow, rejected input), the
        bucketed gather; with a rejected input or a non-finite gradient under
        ``nonfinite="raise"``, one object all-gather before raising on every rank.
        """
        traced = state.replace(optimizer=self._with_lr_tensors(state.optimizer))
        config = torch._dynamo.config
        # Set and restored by hand around the call: config.patch costs more on every step.
        limit_raises, config.fail_on_recompile_limit_hit = config.fail_on_recompile_limit_hit, True
        try:
            new_state, info, gathered = self._fn(traced, shards)
        finally:
            config.fail_on_recompile_limit_hit = limit_raises
        # Written here, once the graph has returned: a graph that raises (a veto, a rejected input) has
        # written nothing, whatever order a backend gives its kernels. A skipped step's masters are
        # unchanged, so the params get the values they hold.
        names = list(gathered)
        torch._foreach_copy_([params[n] for n in names], [gathered[n] for n in names])
        info = StepInfo(float(info.grad_norm), bool(info.skipped), float(info.clip_coef))
        return new_state.replace(optimizer=state.optimizer), info

    def _with_lr_tensors(self, opt: optim.Optimizer) -> optim.Optimizer:
        """``opt`` with every group's lr a 0-d float64 tensor of this object, filled with its value now.

        The optimizer returned is the same object while only learning rates change, so the
        graph's guards on it hold and nothing recompiles.
        """
        key = _key_without_lr(opt)
        if key != self._key:
            self._opt, self._key = _replace_lrs(opt, self._lrs, ()), key
        _fill_lrs(opt, self._lrs, ())
        assert self._opt is not None
        return self._opt


_SHARED: dict[tuple[Any, ...], Callable[..., Any]] = {}
"""Compiled steps by (backend, group, clipping, bucket size, policy, layout fingerprint): facades
alike share one, so a rebuilt optimizer (a test, a restarted loop) reuses its graph."""
_SHARED_MAX = 16


def _make_tail(
    group: comm.Group, max_norm: float | None, norm_type: float, bucket_numel: int, comm_policy: CommPolicy
) -> Callable[..., tuple[ZeroState, StepInfo]]:
    """The function compiled: ``step_shards`` then ``gather_params`` (new full tensors, copied out by the caller)."""

    def tail(
        state: ZeroState, shards: Mapping[str, torch.Tensor]
    ) -> tuple[ZeroState, StepInfo, dict[str, torch.Tensor]]:
        new_state, info = step_shards(state, shards, group, max_norm, norm_type=norm_type)
        gathered = gather_params(new_state, group, bucket_numel=bucket_numel, comm_policy=comm_policy, check=False)
        return new_state, info, gathered

    return tail


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own: dynamo's graphs and recompile count belong to this copy."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _levels(opt: optim.Optimizer) -> list[tuple[int | None, Mapping[str, Any]]]:
    return [(None, opt.defaults), *((i, g.hyperparams) for i, g in enumerate(opt.groups))]


def _key_without_lr(opt: optim.Optimizer) -> tuple[Any, ...]:
    if opt.parts:
        return tuple(_key_without_lr(p) for _, p in opt.parts)
    return tuple(tuple(sorted((k, repr(v)) for k, v in hp.items() if k != "lr")) for _, hp in _levels(opt))


def _replace_lrs(
    opt: optim.Optimizer, lrs: dict[tuple[Any, ...], torch.Tensor], path: tuple[int, ...]
) -> optim.Optimizer:
    if opt.parts:
        for k, (_, part) in enumerate(opt.parts):
            opt = opt.with_part(k, _replace_lrs(part, lrs, (*path, k)))
        return opt

    def tensor(level: int | None) -> torch.Tensor:
        return lrs.setdefault((*path, level), torch.zeros((), dtype=torch.float64))

    defaults = FrozenDict({**opt.defaults, "lr": tensor(None)}) if "lr" in opt.defaults else opt.defaults
    groups = tuple(
        ParamGroup(g.select, FrozenDict({**g.hyperparams, "lr": tensor(i)})) if "lr" in g.hyperparams else g
        for i, g in enumerate(opt.groups)
    )
    return dataclasses.replace(opt, defaults=defaults, groups=groups)


def _fill_lrs(opt: optim.Optimizer, lrs: dict[tuple[Any, ...], torch.Tensor], path: tuple[int, ...]) -> None:
    if opt.parts:
        for k, (_, part) in enumerate(opt.parts):
            _fill_lrs(part, lrs, (*path, k))
        return
    for level, hp in _levels(opt):
        if "lr" in hp:
            lrs[(*path, level)].fill_(float(hp["lr"]))
