"""``ZeroOptimizer``: the stateful facade for an ordinary ``nn.Module`` training loop.

It owns no math. It keeps one :class:`~zerofn.state.ZeroState` and threads it through the
stage functions: gradients go through the same bucket blocks :func:`~zerofn.reduce_grads`
uses (from gradient hooks when overlapping), ``step`` calls
:func:`~zerofn.step_shards` with ``donate=True`` (the facade owns its state, so no step
doubles the optimizer-state memory), and :func:`~zerofn.gather_params` writes the new
values straight into the model's parameters (``out=``).

Gradient flow per step:

* **no hooks** (stage 1 without overlap): ``backward`` runs autograd, then reduces all
  ``p.grad`` with :func:`~zerofn.reduce_grads` and frees them.
* **hooks** (stage 2, or ``overlap_communication=True``): a post-accumulate-grad hook
  counts each bucket's members as their gradients land; a full bucket is flattened, its
  members' ``p.grad`` freed, and its reduction launched (asynchronously when
  overlapping: gloo work handles, or NCCL's own stream, which waits on the current
  stream at launch and is waited on before the result is read). When autograd finishes,
  an engine callback launches the buckets with absent members (layer drop) and waits for
  all. Both paths send identical buffers, so their results are bitwise equal.
* **accumulation**: inside ``no_sync()`` nothing is communicated; ``p.grad`` accumulates
  as in plain torch (full local gradients, Ψ·b bytes, for both stages), and the first
  ``backward`` outside reduces the sum once.

Between ``backward`` and ``step`` a rank holds only its shards of the reduced gradients
(``p.grad`` is ``None``, as in the seed); :meth:`get_param_grad` gathers one on demand.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerofn import checks, comm, optim, torch_optim
from zerofn.comm import CommPolicy
from zerofn.layout import Bucket
from zerofn.stages import (
    gather_params,
    launch_bucket_reduce,
    reduce_grads,
    reduce_realisation,
    shard_params,
    split_bucket_row,
    step_shards,
)
from zerofn.state import StepInfo, ZeroState

__all__ = ["ZeroOptimizer"]

log = logging.getLogger("zerofn")

# Buckets whose reduction may be in flight at once when overlapping: enough to keep the
# network busy while backward computes, few enough to bound the buffers held.
_MAX_INFLIGHT = 2


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1/2 as a drop-in optimizer; every number it holds is a ``ZeroState``.

    Two ways to build it::

        ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), partition_grad=True)
        ZeroOptimizer(model.named_parameters(), zf.optim.adamw(lr=1e-3), partition_grad=True)

    It is a ``torch.optim.Optimizer`` so torch LR schedulers drive it: ``param_groups``
    are live (for a wrapped torch optimizer they are that optimizer's groups), and their
    hyperparameters are read at every ``step``.

    Args:
      optimizer: a torch optimizer over the model's params (SGD/Adam/AdamW run on the
        fast functional path, other element-wise ones on the generic path, whole-tensor
        ones such as LBFGS are refused), or an iterable of ``(name, param)`` /
        mapping ``name -> param`` when ``functional_optimizer`` is given.
      functional_optimizer: a :mod:`zerofn.optim` optimizer, with named params.
      partition_grad: ZeRO stage 2 (gradients sharded, reduced from hooks) if True,
        else stage 1.
      reduce_bucket_size: padded elements per communication bucket.
      communication_dtype: dtype gradients are cast to on the wire (``None``: their own).
      overlap_communication: launch each bucket's reduction asynchronously as soon as
        its gradients are ready during backward.
      clip_grad_norm: clip by the global gradient norm when > 0.
      norm_type: 2.0 or ``math.inf`` for clipping and ``get_grad_norm``.
      dp_process_group: the data-parallel (sharding) group; ``None`` for the default.
      comm_policy: collective realisations (default per backend, see :mod:`zerofn.comm`).
      module: optional model whose ``named_parameters()`` names the params of a wrapped
        torch optimizer (for messages and ``state.master`` keys); otherwise they are
        named ``"group{g}.param{i}"``.
      verbose: log skipped steps.
      initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
      hysteresis, max_scale, cpu_offload, forced_dtype, master_weights: mixed precision
        and offload options; accepted, but only fp32 params without offload are
        supported so far (others raise ``NotImplementedError``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        functional_optimizer: optim.Optimizer | None = None,
        *,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        max_scale: float = 2**24,
        clip_grad_norm: float = 0.0,
        norm_type: float = 2.0,
        verbose: bool = False,
        reduce_bucket_size: int = 1024 * 1024,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        partition_grad: bool = False,
        cpu_offload: bool = False,
        dp_process_group: dist.ProcessGroup | None = None,
        forced_dtype: torch.dtype | None = None,
        master_weights: bool = True,
        comm_policy: CommPolicy | None = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        del initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale
        if cpu_offload or forced_dtype is not None or not master_weights:
            raise NotImplementedError(
                "ZeroOptimizer: cpu_offload, forced_dtype and master_weights=False are not built yet; "
                "use fp32 params with the defaults"
            )
        if not isinstance(reduce_bucket_size, int) or reduce_bucket_size <= 0:
            raise ValueError(f"ZeroOptimizer: reduce_bucket_size must be a positive int, got {reduce_bucket_size!r}")
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"ZeroOptimizer: norm_type must be 2.0 or math.inf, got {norm_type!r}")
        if not (clip_grad_norm >= 0 and math.isfinite(clip_grad_norm)):
            raise ValueError(f"ZeroOptimizer: clip_grad_norm must be a finite number >= 0, got {clip_grad_norm!r}")

        named_groups, fopt, torch_groups = _resolve_params(optimizer, functional_optimizer, module)
        for names_params in named_groups:
            for name, p in names_params:
                if p.dtype not in (torch.float32, torch.float64):
                    raise NotImplementedError(
                        f"ZeroOptimizer: param {name!r} is {p.dtype}; fp16/bf16 params (mixed precision) "
                        "are not built yet"
                    )
        self._group = dp_process_group
        self._stage = 2 if partition_grad else 1
        self._bucket_numel = reduce_bucket_size
        self._comm_dtype = communication_dtype
        self._overlap = overlap_communication
        self._max_norm = clip_grad_norm if clip_grad_norm > 0 else None
        self._norm_type = float(norm_type)
        self._policy = comm_policy or CommPolicy()
        self._verbose = verbose

        # torch.optim.Optimizer's bookkeeping, without its per-param `state` dict: the
        # facade's state is a ZeroState, exposed as `.state`.
        self.defaults = dict(optimizer.defaults if isinstance(optimizer, torch.optim.Optimizer) else fopt.defaults)
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        self._optimizer_state_dict_pre_hooks: dict[int, Any] = {}
        self._optimizer_state_dict_post_hooks: dict[int, Any] = {}
        self._optimizer_load_state_dict_pre_hooks: dict[int, Any] = {}
        self._optimizer_load_state_dict_post_hooks: dict[int, Any] = {}
        self.param_groups = torch_groups
        self._group_names = [[n for n, _ in g] for g in named_groups]
        self._params: dict[str, torch.Tensor] = {n: p for g in named_groups for n, p in g}
        self._name_of = {id(p): n for n, p in self._params.items()}

        self._state: ZeroState = shard_params(self._params, fopt, self._group)
        layout = self._state.layout
        checks.check_ranks_agree(
            layout,
            self._group,
            "ZeroOptimizer",
            settings={"stage": self._stage, "bucket_numel": self._bucket_numel, "overlap": int(self._overlap)},
            device=next(iter(self._params.values())).device,
        )
        self._how = reduce_realisation(self._stage, self._group, self._policy)
        self._buckets: tuple[Bucket, ...] = layout.buckets(self._bucket_numel)
        self._bucket_of = {name: i for i, b in enumerate(self._buckets) for name in b.names}
        self._hp_cache: tuple[Any, ...] | None = None

        self._grad_shards: dict[str, torch.Tensor] = {}
        self._require_sync = True
        self._last_info: StepInfo | None = None
        # Hook-path bookkeeping for the backward pass in progress.
        self._ready: list[set[str]] = [set() for _ in self._buckets]
        self._launched: set[int] = set()
        self._inflight: list[tuple[Bucket, comm.Pending, set[str]]] = []
        self._callback_queued = False
        self._hooks: list[Any] = []
        if self._overlap or self._stage == 2:
            self._attach_hooks()

    # ------------------------------------------------------------------ public state

    @property
    def state(self) -> ZeroState:  # type: ignore[override]
        """The current :class:`ZeroState` (master shards, optimizer state, step)."""
        return self._state

    @property
    def stage(self) -> int:
        return self._stage

    def get_grad_norm(self) -> float | None:
        """The global gradient norm of the last ``step`` (unclipped), or None before one."""
        return None if self._last_info is None else self._last_info.grad_norm

    @property
    def last_step_info(self) -> StepInfo | None:
        return self._last_info

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """``id(model param) -> this rank's master shard`` (1-D, fp32)."""
        return {id(p): self._state.master[n] for n, p in self._params.items()}

    def get_master_to_working_map(self) -> dict[int, torch.Tensor]:
        """``id(master shard) -> model param``."""
        return {id(self._state.master[n]): p for n, p in self._params.items()}

    def grad_bytes(self) -> int:
        """Bytes this rank holds for gradients right now: ``p.grad`` + buckets in flight + shards."""
        total = sum(p.grad.numel() * p.grad.element_size() for p in self._params.values() if p.grad is not None)
        total += sum(s.numel() * s.element_size() for s in self._grad_shards.values())
        n = self._state.layout.world_size
        total += sum(b.shard_numel * n * self._params[b.names[0]].element_size() for b, _, _ in self._inflight)
        return total

    # ------------------------------------------------------------------ gradients

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for both stages, as DDP's ``no_sync``."""
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``loss.backward()``, then (outside ``no_sync``) reduce the gradients to shards."""
        loss.backward(retain_graph=retain_graph)
        if self._require_sync:
            self._reduce_local_grads()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """``torch.autograd.backward(tensor, grad)``, then reduce as ``backward``."""
        torch.autograd.backward(tensor, grad)
        if self._require_sync:
            self._reduce_local_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients: local ``p.grad`` and the reduced shards."""
        for p in self._params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
        self._grad_shards = {}

    def get_param_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The full reduced (mean) gradient of ``param`` since the last step, or None.

        Collective: every rank of the group must call it for the same param (one gather
        of the param's shards).
        """
        name = self._name_of.get(id(param))
        if name is None:
            raise KeyError("get_param_grad: this tensor is not one of the optimizer's params")
        shard = self._grad_shards.get(name)
        if shard is None:
            return None
        spec = self._state.layout[name]
        how = self._policy.resolve(self._group)[1]
        rows = comm.gather_rows(shard.contiguous(), self._group, how).wait()
        return rows.reshape(-1)[: spec.numel].view(spec.shape).clone()

    def _merge(self, shards: Mapping[str, torch.Tensor]) -> None:
        for name, shard in shards.items():
            have = self._grad_shards.get(name)
            self._grad_shards[name] = shard if have is None else have + shard

    def _reduce_local_grads(self) -> None:
        """Reduce whatever full gradients sit in ``p.grad`` (the no-hook path) and free them."""
        grads = {n: p.grad for n, p in self._params.items() if p.grad is not None}
        if not grads:
            return
        shards = reduce_grads(
            grads,
            self._state.layout,
            self._group,
            self._stage,
            self._bucket_numel,
            policy=self._policy,
            comm_dtype=self._comm_dtype,
        )
        for n in grads:
            self._params[n].grad = None
        self._merge(shards)

    # ------------------------------------------------------------------ hook path

    def _attach_hooks(self) -> None:
        me = weakref.ref(self)  # hooks live on the model's params; they must not keep us alive

        def make_hook(name: str) -> Any:
            def hook(param: torch.Tensor) -> None:
                opt = me()
                if opt is not None:
                    opt._on_grad_ready(name)

            return hook

        for name, p in self._params.items():
            self._hooks.append(p.register_post_accumulate_grad_hook(make_hook(name)))

    def close(self) -> None:
        """Remove the gradient hooks from the model's params (also done on garbage collection)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _on_grad_ready(self, name: str) -> None:
        if not self._require_sync:
            return
        if not self._callback_queued:
            # Runs once autograd has finished this backward pass, whoever called it.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        b = self._bucket_of.get(name)
        if b is None:  # an empty param: nothing to send
            return
        self._ready[b].add(name)
        if len(self._ready[b]) == len(self._buckets[b].names):
            self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        present = set(self._ready[b])
        grads = {n: self._params[n].grad for n in bucket.names if n in present}
        pending = launch_bucket_reduce(
            grads,
            self._state.layout,
            bucket,
            self._group,
            self._how,
            comm_dtype=self._comm_dtype,
            async_op=self._overlap,
        )
        for n in present:  # the bucket buffer holds a copy: free the full gradients now
            self._params[n].grad = None
        self._launched.add(b)
        self._inflight.append((bucket, pending, present))
        self._harvest(_MAX_INFLIGHT if self._overlap else 0)

    def _harvest(self, keep: int) -> None:
        """Turn finished buckets into shards, oldest first, leaving at most ``keep`` in flight.

        Each bucket in flight holds an ``(N, S)`` buffer; harvesting early is what keeps a
        rank's gradient memory at its shards plus a few buckets.
        """
        while self._inflight and (len(self._inflight) > keep or self._inflight[0][1].done()):
            bucket, pending, present = self._inflight.pop(0)
            self._merge(split_bucket_row(pending.wait(), self._state.layout, bucket, present))

    def _finish_backward(self) -> None:
        """End of a backward pass: launch partial buckets (layer drop), wait, keep shards."""
        self._callback_queued = False
        ready = sorted(set().union(*self._ready), key=self._state.layout.names.index)
        # Every rank must have produced gradients for the same params before the last
        # buckets go out; one tiny all-gather (see checks.check_ranks_agree).
        checks.check_ranks_agree(
            self._state.layout,
            self._group,
            "ZeroOptimizer.backward",
            present=ready,
            device=next(iter(self._params.values())).device,
        )
        for b in range(len(self._buckets)):
            if b not in self._launched and self._ready[b]:
                self._launch(b)
        self._harvest(0)
        empty = [n for n in ready if n not in self._bucket_of]
        for n in empty:
            self._params[n].grad = None
        self._merge({n: self._params[n].new_empty(0) for n in empty})
        self._ready = [set() for _ in self._buckets]
        self._launched = set()
        self._inflight = []

    # ------------------------------------------------------------------ step

    def _current_optimizer(self) -> optim.Optimizer:
        """The functional optimizer with the hyperparameters now in ``param_groups``."""
        fopt = self._state.optimizer
        per_group = [torch_optim.group_hyperparams(fopt, g) for g in self.param_groups]
        key = tuple(tuple(sorted(hp.items(), key=lambda kv: kv[0])) for hp in per_group)
        if key == self._hp_cache:
            return fopt
        for i, hp in enumerate(per_group):
            fopt = fopt.with_hyperparams(i if i < len(fopt.groups) else None, **hp)
        self._hp_cache = key
        return fopt

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Clip, update this rank's shards and write the gathered params into the model.

        A step whose gradients are not finite on any rank is skipped on every rank.
        Collectives: one scalar all-reduce (norm) and the bucketed gather of the params.
        """
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self._reduce_local_grads()  # e.g. stage 1 after a plain loss.backward()
        if not self._grad_shards:
            raise RuntimeError(
                "ZeroOptimizer.step: no gradients since the last step or zero_grad(). Call "
                "optimizer.backward(loss) (or loss.backward()) outside no_sync() before step()."
            )
        state = self._state.replace(optimizer=self._current_optimizer())
        new_state, info = step_shards(
            state, self._grad_shards, self._group, self._max_norm, norm_type=self._norm_type, donate=True
        )
        self._grad_shards = {}
        self._last_info = info
        self._state = new_state
        if info.skipped:
            if self._verbose:
                log.info("zerofn: non-finite gradient (norm %s); step skipped on every rank", info.grad_norm)
            return
        gather_params(new_state, self._group, bucket_numel=self._bucket_numel, policy=self._policy, out=self._params)

    def update_master_params(self, model: torch.nn.Module | None = None) -> None:
        """Re-read the master shards from the model's current params (after editing weights)."""
        del model  # the facade already holds the model's param tensors
        fresh = shard_params(self._params, self._state.optimizer, self._group)
        self._state = self._state.replace(master=fresh.master)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("ZeroOptimizer: param groups are fixed at construction (the layout is sharded)")

    def __repr__(self) -> str:
        layout = self._state.layout
        return (
            f"ZeroOptimizer(stage={self._stage}, optimizer={self._state.optimizer.name}, params={len(layout)}, "
            f"world_size={layout.world_size}, bucket_numel={self._bucket_numel}, overlap={self._overlap})"
        )


def _resolve_params(
    optimizer: Any, functional: optim.Optimizer | None, module: torch.nn.Module | None
) -> tuple[list[list[tuple[str, torch.Tensor]]], optim.Optimizer, list[dict[str, Any]]]:
    """Named param groups (requires_grad only), the functional optimizer, live torch groups."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if functional is not None:
            raise TypeError("ZeroOptimizer: give a torch optimizer or named params + a zerofn optimizer, not both")
        torch_optim.check_shardable(type(optimizer))
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        named_groups = [
            [(names.get(id(p), f"group{g}.param{i}"), p) for i, p in enumerate(group["params"]) if p.requires_grad]
            for g, group in enumerate(optimizer.param_groups)
        ]
        fopt = torch_optim.from_torch_optimizer(optimizer, [[n for n, _ in g] for g in named_groups])
        return named_groups, fopt, optimizer.param_groups
    if functional is None:
        raise TypeError(
            "ZeroOptimizer: pass a torch.optim.Optimizer, or named params and a zerofn optimizer: "
            "ZeroOptimizer(model.named_parameters(), zf.optim.adamw(lr=1e-3))"
        )
    items = list(optimizer.items()) if isinstance(optimizer, Mapping) else list(optimizer)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError("ZeroOptimizer: named params must be (name, tensor) pairs, e.g. model.named_parameters()")
    trainable = [(n, p) for n, p in items if p.requires_grad]
    buckets: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(len(functional.groups) + 1)]
    for n, p in trainable:
        buckets[functional.group_index(n)].append((n, p))
    torch_groups = []
    for i, members in enumerate(buckets):
        hp = functional.groups[i].hyperparams if i < len(functional.groups) else {}
        torch_groups.append({"params": [p for _, p in members], **functional.defaults, **hp})
    return buckets, functional, torch_groups
