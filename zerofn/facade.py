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
  counts each bucket's members as their gradients land; a full bucket is flattened (into
  an ``(N, S)`` staging buffer reused between buckets and steps, see ``staging_bytes``),
  its members' ``p.grad`` freed, and its reduction launched (asynchronously when
  overlapping: gloo work handles, or NCCL's own stream, which waits on the current
  stream at launch and is waited on before the result is read). When autograd finishes,
  an engine callback launches the buckets with absent members (layer drop) and waits for
  all. Both paths send identical buffers, so their results are bitwise equal.
* **accumulation**: inside ``no_sync()`` nothing is communicated, and the first
  ``backward`` outside reduces the sum once. When the accumulation dtype is the working
  dtype (fp32 models, or ``grad_accum_dtype=None``), ``p.grad`` accumulates as in plain
  torch (full local gradients, Ψ·b bytes, for both stages). Under fp16/bf16 it is float32
  by default: a post-accumulate-grad hook moves each fresh ``p.grad`` into a float32
  accumulator (``acc += p.grad``, then ``p.grad = None``), and the closing backward
  folds its gradients in the same way and reduces the accumulators (the wire still
  carries ``communication_dtype``, by default the working dtype). Memory: Ψ·4 bytes of
  accumulators per rank for the whole accumulation window (instead of Ψ·2 for fp16/bf16
  ``p.grad``), plus one param's fresh ``p.grad`` at a time; steps without ``no_sync``
  never allocate them.

Mixed precision is :mod:`zerofn.precision`'s policy, stored in the state: the facade only
scales the loss in ``backward`` by the state's loss scale and hands everything else
(overflow decision, loss-scale update, unscaling, clipping, CPU offload, casting back to
the working dtype) to :func:`~zerofn.step_shards` and :func:`~zerofn.gather_params`.

Between ``backward`` and ``step`` a rank holds only its shards of the reduced gradients
(``p.grad`` is ``None``, as in the seed); :meth:`get_param_grad` gathers one on demand.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from zerofn import checks, comm, optim, torch_optim
from zerofn.buckets import launch_gather, launch_reduce, pack_grads, pack_shards, split_row, unpack_rows, wire_dtype
from zerofn.comm import CommPolicy
from zerofn.layout import Bucket
from zerofn.precision import (
    DynamicLossScaler,
    GradAccumDtype,
    MixedDtypeError,
    NoLossScaling,
    PrecisionPolicy,
    resolve_param_dtypes,
    scale_loss,
)
from zerofn.stages import (
    gather_params,
    reduce_grads,
    reduce_realisation,
    shard_params,
    step_shards,
    sum_over_replicas,
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
      overlap_allgather: hide the parameter gather behind the next forward (the seed's
        option of the same name; needs ``module=``, which must own every param). ``step``
        launches every bucket's gather asynchronously and returns; a forward pre-hook on
        each module that owns params (for a container without a ``forward``, such as
        ``nn.ParameterList``, on its parent) waits for the buckets its params live in and
        writes them into the params (the same values, bit for bit, as without it), and the
        model's forward post-hook completes the rest. Until then ``p.data`` holds the
        *previous* values: read params outside the model's forward (evaluation through
        another function, logging ``p.data``) only after :meth:`wait_params`. A forward
        that reads a param before its owner's ``forward`` runs (``F.linear(x,
        self.proj.weight)`` without calling ``self.proj``) would see old values: with
        autograd on, the model's forward post-hook finds such params in the graph and
        raises. The facade's own readers (``step``, ``backward``, ``state_dict``,
        checkpoints, ``get_param_grad``, ``update_master_params``, ``close``) and the
        model's ``state_dict`` / ``load_state_dict`` wait by themselves. Memory: the
        gathered ``(N, S)`` buckets, Ψ·b bytes, are held from ``step`` until the forward
        writes them.
      clip_grad_norm: clip by the global gradient norm when > 0.
      norm_type: 2.0 or ``math.inf`` for clipping and ``get_grad_norm``.
      dp_process_group: the data-parallel group; ``None`` for the default. Shards live
        across all of it unless ``sub_dp_size`` or ``replicate_group`` make it hybrid.
      sub_dp_size: the seed's hybrid option: split ``dp_process_group`` (ranks in order)
        into ``sub_dp_size`` shard groups of ``N / sub_dp_size`` consecutive ranks; a
        rank's replicas are the ranks at its position in the other shard groups. Every
        rank of ``dp_process_group`` must construct the optimizer (it creates groups).
      replicate_group: explicit hybrid layout: ``dp_process_group`` is then this rank's
        shard group and ``replicate_group`` the ranks holding the same shards.
      comm_policy: collective realisations (default per backend, see :mod:`zerofn.comm`).
      module: optional model whose ``named_parameters()`` names the params of a wrapped
        torch optimizer (for messages and ``state.master`` keys); otherwise they are
        named ``"group{g}.param{i}"``.
      verbose: log skipped steps.
      initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
      hysteresis, max_scale: the dynamic loss scaler used when the (working) params are
        float16 (:class:`~zerofn.precision.DynamicLossScaler`, the seed's meanings);
        ``backward`` multiplies the loss (``backward_by_grad`` the given gradient) by the
        current scale. bfloat16 and float32 params train without loss scaling.
      nonfinite: what a step with an ``inf``/``nan`` gradient does when there is no
        dynamic loss scaler (bf16, fp32): ``"skip"`` it on every rank, or ``"raise"``
        :class:`~zerofn.precision.NonFiniteGradError` naming the params on every rank.
        With float16's dynamic scaler overflowing steps are always skipped.
      cpu_offload: keep master shards and optimizer state on the CPU; gradient shards
        move there for the update and the params move back for the gather.
      forced_dtype: cast every param (``p.data``) to this dtype at construction.
      master_weights: keep float32 master shards (default); False: the optimizer
        updates working-dtype shards directly.
      grad_accum_dtype: dtype micro-batch gradients are summed in under ``no_sync``:
        ``"auto"`` (float32 for float16/bfloat16 params, else the working dtype), None
        (the working dtype: ``p.grad`` as in plain torch) or a dtype. See the module
        docstring for the memory it costs.
      precision: a full :class:`~zerofn.precision.PrecisionPolicy` instead of the
        options above (e.g. a static loss scaler, or ``mixed_dtypes="keep"`` for models
        with float32 norms in a bf16 body); then leave those at their defaults. Params
        of several dtypes raise :class:`~zerofn.precision.MixedDtypeError` naming them
        unless ``forced_dtype`` or the policy says what to do.
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
        overlap_allgather: bool = False,
        partition_grad: bool = False,
        cpu_offload: bool = False,
        dp_process_group: dist.ProcessGroup | None = None,
        sub_dp_size: int = 1,
        replicate_group: dist.ProcessGroup | None = None,
        forced_dtype: torch.dtype | None = None,
        master_weights: bool = True,
        comm_policy: CommPolicy | None = None,
        module: torch.nn.Module | None = None,
        nonfinite: str = "skip",
        grad_accum_dtype: GradAccumDtype = "auto",
        precision: PrecisionPolicy | None = None,
    ) -> None:
        scaler_options = dict(
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
        )
        precision_options = dict(
            communication_dtype=communication_dtype,
            cpu_offload=cpu_offload,
            forced_dtype=forced_dtype,
            master_weights=master_weights,
            nonfinite=nonfinite,
            grad_accum_dtype=grad_accum_dtype,
            **scaler_options,
        )
        if not isinstance(reduce_bucket_size, int) or reduce_bucket_size <= 0:
            raise ValueError(f"ZeroOptimizer: reduce_bucket_size must be a positive int, got {reduce_bucket_size!r}")
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"ZeroOptimizer: norm_type must be 2.0 or math.inf, got {norm_type!r}")
        if not (clip_grad_norm >= 0 and math.isfinite(clip_grad_norm)):
            raise ValueError(f"ZeroOptimizer: clip_grad_norm must be a finite number >= 0, got {clip_grad_norm!r}")

        named_groups, fopt, torch_groups = _resolve_params(optimizer, functional_optimizer, module)
        named = {n: p for g in named_groups for n, p in g}
        if overlap_allgather:
            _check_gather_module(named, module)
        policy = _precision_policy(named, precision, precision_options, scaler_options)
        # Validated: now cast (forced_dtype), as the seed does, before anything reads them.
        for p in named.values():
            if policy.param_dtype is not None and p.dtype != policy.param_dtype:
                p.grad = None
                p.data = p.data.to(policy.param_dtype)
        self._group, self._replicate = _hybrid_groups(dp_process_group, sub_dp_size, replicate_group)
        self._replicas = comm.group_size(self._replicate) if self._replicate is not None else 1
        self._stage = 2 if partition_grad else 1
        self._bucket_numel = reduce_bucket_size
        self._comm_dtype = policy.comm_dtype
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

        self._state: ZeroState = shard_params(self._params, fopt, self._group, policy=policy)
        layout = self._state.layout
        checks.check_ranks_agree(
            layout,
            self._group,
            "ZeroOptimizer",
            settings={
                "stage": self._stage,
                "bucket_numel": self._bucket_numel,
                "overlap": int(self._overlap),
                "precision": checks.text_hash(repr(policy)),
            },
            device=next(iter(self._params.values())).device,
        )
        self._how = reduce_realisation(self._stage, self._group, self._policy)
        self.buckets: tuple[Bucket, ...] = layout.buckets(self._bucket_numel)
        self._bucket_of = {name: i for i, b in enumerate(self.buckets) for name in b.names}
        self._position = {name: i for i, name in enumerate(layout.names)}  # layout order, for sorting
        self._hp_cache: tuple[Any, ...] | None = None

        self._grad_shards: dict[str, torch.Tensor] = {}
        self._require_sync = True
        self._last_info: StepInfo | None = None
        # Hook-path bookkeeping for the backward pass in progress.
        self._ready: list[set[str]] = [set() for _ in self.buckets]
        self._launched: set[int] = set()
        # (bucket, pending reduction, names present, gradient dtype, staging buffer it uses)
        self._inflight: list[tuple[Bucket, comm.Pending, set[str], torch.dtype, torch.Tensor]] = []
        # Reused (N, S) staging buffers for the hook path's reductions: fresh multi-MB
        # buffers every step would fault in new pages (measured: ~3x the copy itself).
        self._staging = _Staging(keep=_MAX_INFLIGHT + 1 if self._overlap else 1, min_numel=self._bucket_numel)
        self._replica_rows: list[tuple[Bucket, torch.Tensor, set[str], torch.dtype]] = []
        self._callback_queued = False
        # Accumulation in another dtype than the working one (float32 under fp16/bf16):
        # micro-step gradients are moved out of p.grad into these by the hooks.
        self._accum_dtype = {n: policy.grad_accum_dtype_for(layout[n].dtype) for n in self._params}
        self._accum_names = {n for n, d in self._accum_dtype.items() if d != layout[n].dtype}
        self._accum: dict[str, torch.Tensor] = {}
        self._accumulating = False  # a no_sync backward folded gradients since the last reduction
        self._hook_reduce = self._overlap or self._stage == 2
        self._hooks: list[Any] = []
        if self._hook_reduce or self._accum_names:
            self._attach_hooks()
        # overlap_allgather: per bucket, the gather launched by the last step and not yet
        # written into the params (its Pending and the row it sends), or None.
        self._overlap_gather = overlap_allgather
        self._gather_how = self._policy.resolve(self._group)[1]
        self._gathers: list[tuple[comm.Pending, torch.Tensor] | None] = [None] * len(self.buckets)
        self._gathers_left = 0
        # overlap_allgather: per bucket of several params, the row it sends, reused every step.
        self._gather_rows: list[torch.Tensor | None] = [None] * len(self.buckets)
        if overlap_allgather:
            assert module is not None  # _check_gather_module
            self._attach_gather_hooks(module)

    # ------------------------------------------------------------------ public state

    @property
    def state(self) -> ZeroState:  # type: ignore[override]
        """The current :class:`ZeroState` (master shards, optimizer state, step)."""
        return self._state

    @property
    def stage(self) -> int:
        return self._stage

    @property
    def precision(self) -> PrecisionPolicy:
        """The :class:`~zerofn.precision.PrecisionPolicy` in force (also ``state.policy``)."""
        return self._state.policy

    @property
    def loss_scale(self) -> float:
        """The loss scale the next ``backward`` multiplies the loss by (1.0 without scaling)."""
        return self._state.loss_scale.scale

    def get_grad_norm(self) -> float | None:
        """The global norm of the true (unscaled) gradient of the last ``step``, before clipping.

        ``None`` before the first step; ``inf`` after a step skipped for a non-finite gradient.
        """
        return None if self._last_info is None else self._last_info.grad_norm

    @property
    def last_step_info(self) -> StepInfo | None:
        return self._last_info

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """``id(model param) -> this rank's master shard`` (1-D; fp32 unless ``master_weights=False``)."""
        return {id(p): self._state.master[n] for n, p in self._params.items()}

    def get_master_to_working_map(self) -> dict[int, torch.Tensor]:
        """``id(master shard) -> model param``."""
        return {id(self._state.master[n]): p for n, p in self._params.items()}

    def grad_bytes(self) -> int:
        """Bytes this rank holds for gradients right now: ``p.grad``, accumulators, buckets in flight, shards.

        Not counted: the idle staging buffers the gradient hooks keep for reuse between
        steps (:meth:`staging_bytes`).
        """
        total = sum(p.grad.numel() * p.grad.element_size() for p in self._params.values() if p.grad is not None)
        total += sum(a.numel() * a.element_size() for a in self._accum.values())
        total += sum(s.numel() * s.element_size() for s in self._grad_shards.values())
        n = self._state.layout.world_size
        total += sum(b.shard_numel * n * buf.element_size() for b, _, _, _, buf in self._inflight)
        total += sum(row.numel() * row.element_size() for _, row, _, _ in self._replica_rows)
        return total

    def staging_bytes(self) -> int:
        """Bytes of the reusable bucket staging buffers held now, idle or in flight.

        The gradient hooks copy each bucket into an ``(N, S)`` buffer kept for the next
        bucket and the next step (with ``overlap_communication`` up to three per dtype,
        otherwise one; each ``max(reduce_bucket_size, N·S)`` elements). With
        ``overlap_allgather`` each bucket of several params also keeps the ``(S,)`` row of
        master shards it sends (at most Ψ/N elements of the working dtype in all).
        ``close()`` frees them.
        """
        total = self._staging.nbytes() + sum(buf.numel() * buf.element_size() for *_, buf in self._inflight)
        return total + sum(r.numel() * r.element_size() for r in self._gather_rows if r is not None)

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
        """Backward of the loss times the loss scale, then (outside ``no_sync``) reduce to shards.

        Without loss scaling (scale 1.0) this is ``loss.backward()``.
        """
        # Pending gathers here mean a forward ran outside the model's hooks and read old params: writing
        # them now makes autograd refuse the saved tensors (modified in place) instead of training on them.
        self.wait_params()
        if self._state.loss_scale.scale != 1.0:
            loss = scale_loss(loss, self._state.loss_scale)
        loss.backward(retain_graph=retain_graph)
        if self._require_sync:
            self._reduce_local_grads()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """``torch.autograd.backward(tensor, grad * loss scale)``, then reduce as ``backward``."""
        # Pending gathers here mean a forward ran outside the model's hooks and read old params: writing
        # them now makes autograd refuse the saved tensors (modified in place) instead of training on them.
        self.wait_params()
        if self._state.loss_scale.scale != 1.0:
            grad = scale_loss(grad, self._state.loss_scale)
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
        self._accum = {}
        self._accumulating = False
        self._grad_shards = {}

    def get_param_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The full reduced (mean) gradient of ``param`` since the last step, or None.

        As reduced: under fp16 loss scaling it still carries the loss scale (divide by
        ``loss_scale`` for the true gradient), as the seed's working gradients do.

        Collective: every rank of the group must call it for the same param (one gather
        of the param's shards).
        """
        name = self._name_of.get(id(param))
        if name is None:
            raise KeyError("get_param_grad: this tensor is not one of the optimizer's params")
        self.wait_params()
        shard = self._grad_shards.get(name)
        if shard is None:
            return None
        layout = self._state.layout
        alone = Bucket((name,), (0,), layout[name].shard_numel)  # this param's shard is the row
        rows = launch_gather(shard.contiguous(), self._group, self._gather_how).wait()
        return unpack_rows(rows, layout, alone)[name]

    def _merge(self, shards: Mapping[str, torch.Tensor]) -> None:
        for name, shard in shards.items():
            have = self._grad_shards.get(name)
            self._grad_shards[name] = shard if have is None else have + shard

    def _fold(self, name: str) -> None:
        """Move ``p.grad`` into the param's accumulator (accumulation dtype) and free it."""
        p = self._params[name]
        if p.grad is None:
            return
        acc = self._accum.get(name)
        if acc is None:
            self._accum[name] = p.grad.to(self._accum_dtype[name])
        else:
            acc.add_(p.grad)
        p.grad = None

    def _take_grad(self, name: str) -> torch.Tensor | None:
        """The local gradient to reduce for ``name`` (accumulated or ``p.grad``); frees it here."""
        if self._accumulating and name in self._accum_names:
            self._fold(name)
        acc = self._accum.pop(name, None)
        if acc is not None:
            return acc
        p = self._params[name]
        g, p.grad = p.grad, None
        return g

    def _reduce_local_grads(self) -> None:
        """Reduce whatever full gradients sit in ``p.grad`` or accumulators (no-hook path) and free them."""
        if self._accum:
            self._accumulating = True  # left over (e.g. a param with no gradient in the last micro-step)
        names = [n for n, p in self._params.items() if p.grad is not None or n in self._accum]
        if not names:
            return
        grads = {n: self._take_grad(n) for n in names}
        self._accumulating = False
        shards = reduce_grads(
            grads,
            self._state.layout,
            self._group,
            self._stage,
            self._bucket_numel,
            policy=self._policy,
            precision=self._state.policy,
            replicate_group=self._replicate,
        )
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
        """Finish pending param gathers, remove the facade's hooks from the model (also on garbage collection)."""
        try:
            self.wait_params()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._staging.clear()
            self._gather_rows = [None] * len(self.buckets)

    def __del__(self) -> None:
        if sys.is_finalizing():
            # Interpreter teardown: the model's tensors may be half torn down already, and
            # writing pending gathers into them aborts the process (a torch internal assert
            # in THPVariable_clear). Nobody reads the params any more: leave everything.
            return
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ overlapped gather

    def _attach_gather_hooks(self, module: torch.nn.Module) -> None:
        """Forward pre-hooks that write the buckets of each module's own params before it runs.

        A param's hook sits on the module that owns it, or, when that module has no
        ``forward`` of its own (``nn.ParameterList``, ``nn.ParameterDict``, ``nn.ModuleList``,
        ...: its params are read by the parent's ``forward``), on the nearest ancestor that
        has one. The hook waits for exactly the buckets those params live in (writing every
        member of those buckets). The root's forward post-hook completes whatever is left,
        and refuses a forward that read a param whose gather was still pending (see
        :meth:`_finish_forward`); its ``state_dict`` / ``load_state_dict`` pre-hooks wait
        too. The hooks hold the facade by weak reference, like the gradient hooks.
        """
        me = weakref.ref(self)

        def make_pre(buckets: tuple[int, ...]) -> Any:
            def pre(mod: torch.nn.Module, args: Any) -> None:
                opt = me()
                if opt is not None and opt._gathers_left:
                    opt._complete_gathers(buckets)

            return pre

        def finish(*args: Any) -> None:
            opt = me()
            if opt is not None and opt._gathers_left:
                opt._complete_gathers(range(len(opt.buckets)))

        def after_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
            opt = me()
            if opt is not None and opt._gathers_left:
                opt._finish_forward(output)

        parent: dict[int, torch.nn.Module] = {}
        for mod in module.modules():
            for child in mod.children():
                parent.setdefault(id(child), mod)
        buckets_of: dict[int, set[int]] = {}
        owner_of: dict[int, torch.nn.Module] = {}
        for mod in module.modules():
            owned = {self._name_of.get(id(p)) for p in mod.parameters(recurse=False)}
            buckets = {self._bucket_of[n] for n in owned if n in self._bucket_of}
            if not buckets:
                continue
            owner = mod
            while type(owner).forward is torch.nn.Module.forward and id(owner) in parent:
                owner = parent[id(owner)]  # a container: its params are read by its parent's forward
            buckets_of.setdefault(id(owner), set()).update(buckets)
            owner_of[id(owner)] = owner
            self._hooks.append(mod.register_state_dict_pre_hook(finish))
            self._hooks.append(mod.register_load_state_dict_pre_hook(finish))
        for key, owner in owner_of.items():
            self._hooks.append(owner.register_forward_pre_hook(make_pre(tuple(sorted(buckets_of[key])))))
        self._hooks.append(module.register_state_dict_pre_hook(finish))
        self._hooks.append(module.register_load_state_dict_pre_hook(finish))
        self._hooks.append(module.register_forward_hook(after_forward))

    def _finish_forward(self, output: Any) -> None:
        """End of the model's forward with gathers still pending: write them, and check none was read.

        Buckets still pending here were never waited for in this forward, so any use of
        their params in it read the values from before the last step. Params that took no
        part (layer drop, unused layers) are fine; a param that reached the autograd graph
        of ``output`` is an error (raised after the params are written), as it would
        otherwise train on stale weights silently. Forwards without autograd (``no_grad``)
        cannot be checked this way.
        """
        pending = {
            id(self._params[name]): name
            for b, entry in enumerate(self._gathers)
            if entry is not None
            for name in self.buckets[b].names
        }
        self._complete_gathers(range(len(self.buckets)))
        stack = [t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        seen: set[Any] = set()
        stale: list[str] = []
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf tensor
            if var is not None and id(var) in pending:
                stale.append(pending[id(var)])
            stack.extend(f for f, _ in fn.next_functions)
        if stale:
            stale.sort(key=self._position.__getitem__)
            listing = ", ".join(repr(n) for n in stale[:5]) + (", ..." if len(stale) > 5 else "")
            raise RuntimeError(
                f"ZeroOptimizer(overlap_allgather=True): this forward read {len(stale)} param(s) ({listing}) before "
                "their gathered values were written: the forward pre-hook that writes a param sits on the module "
                "that owns it, and that module's forward did not run before the param was used (e.g. "
                "F.linear(x, self.proj.weight) without calling self.proj). The forward's result used the weights "
                "from before the last step; they are current now. Call optimizer.wait_params() before such a "
                "forward, or leave overlap_allgather off for this model."
            )

    def wait_params(self) -> None:
        """Complete the param gathers the last ``step`` left in flight (``overlap_allgather``).

        After it, every param holds its updated value. Needed only before reading params
        outside the model's forward (evaluation through another function, logging
        ``p.data``); without ``overlap_allgather``, or when nothing is pending, it returns
        at once. Not a collective: the peers launched their side of the gathers in their
        own ``step``.
        """
        if self._gathers_left:
            self._complete_gathers(range(len(self.buckets)))

    def _launch_gathers(self, state: ZeroState) -> None:
        """``gather_params(state, out=params)``'s collectives, launched without waiting."""
        layout = state.layout
        device = state.work_device
        for b, bucket in enumerate(self.buckets):
            dtype = layout[bucket.names[0]].dtype
            out = None
            if len(bucket.names) > 1 and state.state_device == device:
                # Reused every step (a fresh row would fault in new pages each time); the
                # previous step's gather from it has completed (step() waits first). A lone
                # param's shard is its own row (no copy): nothing writes the master shards
                # before this gather completes (step() waits for it first).
                out = self._gather_rows[b]
                if out is None or out.dtype != dtype or out.device != device:
                    out = self._gather_rows[b] = torch.empty(bucket.shard_numel, dtype=dtype, device=device)
            row = pack_shards(state.master, layout, bucket, dtype=dtype, device=device, out=out)
            self._gathers[b] = (launch_gather(row, self._group, self._gather_how, async_op=True), row)
            self._gathers_left += 1

    def _complete_gathers(self, buckets: Iterable[int]) -> None:
        """Wait for these buckets' gathers (those still pending) and write them into the params."""
        layout = self._state.layout
        with torch.no_grad():  # the params are leaves that require grad
            for b in buckets:
                entry = self._gathers[b]
                if entry is None:
                    continue
                self._gathers[b] = None
                self._gathers_left -= 1
                unpack_rows(entry[0].wait(), layout, self.buckets[b], self._params)

    # ------------------------------------------------------------------ hook path (gradients)

    def _on_grad_ready(self, name: str) -> None:
        if name in self._accum_names and (not self._require_sync or self._accumulating):
            self._fold(name)
            self._accumulating = True
        if not (self._require_sync and self._hook_reduce):
            return
        if not self._callback_queued:
            # Runs once autograd has finished this backward pass, whoever called it.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        b = self._bucket_of.get(name)
        if b is None:  # an empty param: nothing to send
            return
        self._ready[b].add(name)
        if len(self._ready[b]) == len(self.buckets[b].names):
            self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        present = set(self._ready[b])
        # Taken (and freed here): the bucket buffer holds a copy of the full gradients.
        grads = {n: self._take_grad(n) for n in bucket.names if n in present}
        first = next(g for g in grads.values() if g is not None)
        pending, buf = self._launch_reduce(grads, bucket, first.dtype, first.device)
        self._launched.add(b)
        self._inflight.append((bucket, pending, present, first.dtype, buf))
        self._harvest(_MAX_INFLIGHT if self._overlap else 0)

    def _launch_reduce(
        self, grads: Mapping[str, torch.Tensor], bucket: Bucket, dtype: torch.dtype, device: torch.device
    ) -> tuple[comm.Pending, torch.Tensor]:
        """:func:`~zerofn.stages.launch_bucket_reduce` into a reused staging buffer; returns it too.

        The same numbers in the same order: the rows in the gradients' dtype, times
        ``1/(N·replicas)`` in that dtype (here fused with the copy: one pass instead of a
        copy and a ``mul_``), cast to the wire dtype, summed over the group. The buffer
        goes back to the pool once the bucket is harvested.
        """
        layout = self._state.layout
        n, s = layout.world_size, bucket.shard_numel
        buf = self._staging.take(n * s, dtype, device)
        rows = pack_grads(grads, layout, bucket, replicas=self._replicas, out=buf[: n * s].view(n, s))
        wire = wire_dtype(layout, bucket, self._comm_dtype)
        wire_buf = self._staging.take(n * s, wire, device) if wire != dtype else None
        pending = launch_reduce(
            rows,
            layout,
            bucket,
            self._group,
            self._how,
            comm_dtype=self._comm_dtype,
            wire_out=wire_buf[: n * s].view(n, s) if wire_buf is not None else None,
            async_op=self._overlap,
        )
        if wire_buf is not None:
            self._staging.give(buf)  # stream-ordered before any later writer on this device
            buf = wire_buf
        return pending, buf

    def _harvest(self, keep: int) -> None:
        """Turn finished buckets into shards, oldest first, leaving at most ``keep`` in flight.

        Each bucket in flight holds an ``(N, S)`` buffer; harvesting early is what keeps a
        rank's gradient memory at its shards plus a few buckets.
        """
        while self._inflight and (len(self._inflight) > keep or self._inflight[0][1].done()):
            bucket, pending, present, dtype, buf = self._inflight.pop(0)
            row = pending.wait()
            if self._replicate is not None:
                # Hybrid: the replicas' sum waits for the end of backward. Harvesting happens
                # at timing-dependent moments; a blocking all-reduce over the replicate group
                # here could interleave with another rank's shard-group collective and
                # deadlock. Keep just this rank's row (1/N of the bucket) until then.
                kept = row.clone() if row._base is not None else row
                self._replica_rows.append((bucket, kept, present, dtype))
                self._staging.give_unless_aliased(buf, [kept])
                continue
            shards = split_row(row, self._state.layout, bucket, present, dtype=dtype)
            self._merge(shards)
            self._staging.give_unless_aliased(buf, shards.values())

    def _sum_replica_rows(self) -> None:
        """Hybrid only: add the replicas' rows, in bucket launch order (the same on every rank)."""
        for bucket, row, present, dtype in self._replica_rows:
            row = sum_over_replicas(row, self._replicate)
            self._merge(split_row(row, self._state.layout, bucket, present, dtype=dtype))
        self._replica_rows = []

    def _finish_backward(self) -> None:
        """End of a backward pass: launch partial buckets (layer drop), wait, keep shards."""
        self._callback_queued = False
        ready = sorted(set().union(*self._ready), key=self._position.__getitem__)
        # Every rank must have produced gradients for the same params before the last
        # buckets go out; one tiny all-gather (see checks.check_ranks_agree).
        checks.check_ranks_agree(
            self._state.layout,
            self._group,
            "ZeroOptimizer.backward",
            present=ready,
            device=next(iter(self._params.values())).device,
        )
        for b in range(len(self.buckets)):
            if b not in self._launched and self._ready[b]:
                self._launch(b)
        self._harvest(0)
        self._sum_replica_rows()
        empty = [n for n in ready if n not in self._bucket_of]
        self._merge({n: g.new_empty(0) for n in empty if (g := self._take_grad(n)) is not None})
        self._accumulating = bool(self._accum)  # leftovers (no gradient in this backward) go in step()
        self._ready = [set() for _ in self.buckets]
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
        """Unscale, clip, update this rank's shards and write the gathered params into the model.

        A step whose gradients are not finite on any rank is skipped on every rank (and
        the dynamic loss scale backs off), or, with ``nonfinite="raise"``, every rank
        raises :class:`~zerofn.precision.NonFiniteGradError`; either way the gradients
        of the step are dropped and the optimizer state is untouched.

        ``step`` consumes the reduced gradients, as ZeRO implementations do: the next
        ``backward`` starts from zero whether or not ``zero_grad`` is called (plain torch
        would keep accumulating into ``p.grad``).

        Collectives: one scalar all-reduce (norm and overflow flag) and the bucketed
        gather of the params.
        """
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self.wait_params()  # the last step's gathers, if no forward has written them
        self._reduce_local_grads()  # e.g. stage 1 after a plain loss.backward()
        if not self._grad_shards:
            raise RuntimeError(
                "ZeroOptimizer.step: no gradients since the last step or zero_grad(). Call "
                "optimizer.backward(loss) (or loss.backward()) outside no_sync() before step()."
            )
        state = self._state.replace(optimizer=self._current_optimizer())
        shards, self._grad_shards = self._grad_shards, {}
        new_state, info = step_shards(
            state, shards, self._group, self._max_norm, norm_type=self._norm_type, donate=True
        )
        self._last_info = info
        self._state = new_state
        if info.skipped:
            if self._verbose:
                log.info(
                    "zerofn: non-finite gradient (norm %s); step skipped on every rank, loss scale %s -> %s",
                    info.grad_norm,
                    state.loss_scale.scale,
                    new_state.loss_scale.scale,
                )
            return
        if self._overlap_gather:  # written into the params by the next forward (or wait_params)
            self._launch_gathers(new_state)
            return
        # The layout and bucket size were confirmed on every rank at construction.
        gather_params(
            new_state, self._group, bucket_numel=self._bucket_numel, policy=self._policy, out=self._params, check=False
        )

    def update_master_params(self, model: torch.nn.Module | None = None) -> None:
        """Re-read the master shards from the model's current params (after editing weights)."""
        del model  # the facade already holds the model's param tensors
        self.wait_params()
        fresh = shard_params(self._params, self._state.optimizer, self._group, policy=self._state.policy)
        self._state = self._state.replace(master=fresh.master)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The whole optimizer state in ``torch.optim`` format (see ``zerofn.checkpoint``).

        Collective: every rank gathers the full state (all ranks must call it).
        """
        from zerofn import checkpoint

        self.wait_params()
        self._state = self._state.replace(optimizer=self._current_optimizer())
        return checkpoint.full_state_dict(self._state, self._group, bucket_numel=self._bucket_numel)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict from ``state_dict()`` (any world size) or from a torch optimizer.

        As in torch, the saved hyperparameters replace those in ``param_groups``. Master
        weights come from the state dict's ``zerofn`` entry when present, else from the
        model's current params. No collectives.
        """
        from zerofn import checkpoint

        self.wait_params()  # master weights may come from the params, and a late gather would overwrite them
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"ZeroOptimizer.load_state_dict: the state dict has {len(state_dict['param_groups'])} param "
                f"groups, this optimizer {len(self.param_groups)}"
            )
        new = checkpoint.shard_state_dict(
            state_dict,
            self._params,
            self._group,
            optimizer=self._state.optimizer,
            master_dtype=next(iter(self._state.master.values())).dtype,
        )
        self._adopt(new)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _adopt(self, new: ZeroState) -> None:
        """Take a loaded state's contents, keeping this facade's static settings."""
        fields = ("optimizer", "master", "opt_state", "step", "loss_scale")
        self._state = self._state.replace(**{f: getattr(new, f) for f in fields if hasattr(new, f)})
        self._hp_cache = None
        self._grad_shards = {}

    def state_dict_shard(self, max_shard_size: int = 1024) -> Iterator[tuple[dict[int, dict[str, Any]], int]]:
        """Yield ``(block, numel)``: the torch-format ``state`` entries in size-bounded blocks.

        ``max_shard_size`` counts tensor elements per block (a param larger than it forms a
        block of its own). Params without optimizer state yet are simply absent, as in
        torch. Collective: every rank must iterate it to the end.
        """
        full = self.state_dict()["state"]
        block: dict[int, dict[str, Any]] = {}
        size = 0
        for index, entry in full.items():
            numel = sum(v.numel() for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            if block and size + numel > max_shard_size:
                yield block, size
                block, size = {}, 0
            block[index] = entry
            size += numel
        if block:
            yield block, size

    def save_checkpoint(self, path: str, *, with_model: bool = True) -> str:
        """Sharded, atomic checkpoint of the optimizer state (and the model weights) at ``path``.

        See :func:`zerofn.checkpoint.save`. Every rank must call it.
        """
        from zerofn import checkpoint

        self.wait_params()
        self._state = self._state.replace(optimizer=self._current_optimizer())
        return checkpoint.save(
            path,
            self._state,
            self._group,
            params=self._params if with_model else None,
            replicate_group=self._replicate,
        )

    def load_checkpoint(self, path: str, *, with_model: bool = True) -> None:
        """Resume from :meth:`save_checkpoint` (any world size): state, hyperparameters, weights."""
        from zerofn import checkpoint

        self.wait_params()  # a late gather would overwrite the loaded weights
        new = checkpoint.load(
            path,
            self._params,
            self._group,
            optimizer=self._state.optimizer,
            params_out=self._params if with_model else None,
        )
        self._adopt(new)
        for i, group in enumerate(self.param_groups):
            names = self._group_names[i]
            if names:
                group.update(torch_optim.group_hyperparams(new.optimizer, new.optimizer.hyperparams(names[0])))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("ZeroOptimizer: param groups are fixed at construction (the layout is sharded)")

    def __repr__(self) -> str:
        layout = self._state.layout
        return (
            f"ZeroOptimizer(stage={self._stage}, optimizer={self._state.optimizer.name}, params={len(layout)}, "
            f"world_size={layout.world_size}, bucket_numel={self._bucket_numel}, overlap={self._overlap})"
        )


class _Staging:
    """A free list of flat staging buffers per (dtype, device), reused between buckets and steps.

    ``take`` hands out the smallest free buffer with room (or a new one of at least
    ``min_numel`` elements); ``give`` returns one once nothing reads it any more, keeping at
    most ``keep`` per (dtype, device) (the smallest are dropped).
    """

    def __init__(self, keep: int, min_numel: int) -> None:
        self._keep = keep
        self._min_numel = min_numel
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((dtype, device))
        if free:
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(max(numel, self._min_numel), dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        free = self._free.setdefault((buf.dtype, buf.device), [])
        free.append(buf)
        if len(free) > self._keep:
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def give_unless_aliased(self, buf: torch.Tensor, readers: Iterable[torch.Tensor]) -> None:
        """Return ``buf`` unless one of ``readers`` is a view of it (then it is simply dropped)."""
        ptr = buf.untyped_storage().data_ptr()
        if all(t.untyped_storage().data_ptr() != ptr for t in readers):
            self.give(buf)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def clear(self) -> None:
        self._free = {}


def _check_gather_module(named: Mapping[str, torch.Tensor], module: torch.nn.Module | None) -> None:
    """``overlap_allgather`` writes params from ``module``'s forward hooks: it must own them all."""
    if module is None:
        raise ValueError(
            "ZeroOptimizer: overlap_allgather=True needs module=<the model>: the gathered params are written "
            "into the model from its forward pre-hooks"
        )
    owned = {id(p) for p in module.parameters()}
    stray = [n for n, p in named.items() if id(p) not in owned]
    if stray:
        raise ValueError(
            f"ZeroOptimizer: overlap_allgather=True, but {len(stray)} param(s) of the optimizer are not parameters "
            f"of module= ({', '.join(repr(n) for n in stray[:5])}{', ...' if len(stray) > 5 else ''}); no forward "
            "hook would write their gathered values. Pass the module that owns every param, or leave "
            "overlap_allgather off"
        )


def _precision_policy(
    named: Mapping[str, torch.Tensor],
    precision: PrecisionPolicy | None,
    options: Mapping[str, Any],
    scaler_options: Mapping[str, Any],
) -> PrecisionPolicy:
    """The facade's precision policy: ``precision`` itself, or one built from the seed-style options.

    Reads only dtypes; raises before anything is changed.
    """
    if precision is not None:
        if not isinstance(precision, PrecisionPolicy):
            what = type(precision).__name__
            raise TypeError(f"ZeroOptimizer: precision must be a zerofn.PrecisionPolicy, got {what}")
        changed = sorted(k for k, v in options.items() if v != _PRECISION_DEFAULTS[k])
        if changed:
            raise TypeError(
                f"ZeroOptimizer: got precision=PrecisionPolicy(...) and also {', '.join(changed)}; put everything "
                "in the policy (e.g. precision.replace(comm_dtype=torch.bfloat16)), or drop precision="
            )
        policy = precision
    else:
        if options["nonfinite"] not in ("skip", "raise"):
            raise ValueError(f"ZeroOptimizer: nonfinite must be 'skip' or 'raise', got {options['nonfinite']!r}")
        forced = options["forced_dtype"]
        working = {forced} if forced is not None else {p.dtype for p in named.values()}
        fp16 = torch.float16 in working
        if fp16 and options["nonfinite"] == "raise":
            raise ValueError(
                "ZeroOptimizer: nonfinite='raise' needs bf16 or fp32 params: fp16 trains with a dynamic loss "
                "scaler, which finds its scale by overflowing now and then and skipping those steps"
            )
        policy = PrecisionPolicy(
            param_dtype=forced,
            comm_dtype=options["communication_dtype"],
            grad_accum_dtype=options["grad_accum_dtype"],
            master_weights=options["master_weights"],
            state_device="cpu" if options["cpu_offload"] else None,
            nonfinite=options["nonfinite"],
            loss_scaler=DynamicLossScaler(**scaler_options) if fp16 else NoLossScaling(),
        )
    try:
        resolve_param_dtypes(named, policy)
    except MixedDtypeError as e:
        raise MixedDtypeError(
            f"ZeroOptimizer: {e} With the facade: pass forced_dtype=<dtype> to cast every param, or "
            "precision=zf.PrecisionPolicy.for_dtype(<working dtype>, param_dtype=None, mixed_dtypes='keep') "
            "to keep each param's dtype."
        ) from None
    return policy


_PRECISION_DEFAULTS: dict[str, Any] = {
    "communication_dtype": None,
    "cpu_offload": False,
    "forced_dtype": None,
    "master_weights": True,
    "nonfinite": "skip",
    "grad_accum_dtype": "auto",
    "initial_scale": 2**16,
    "min_scale": 1,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "hysteresis": 2,
    "max_scale": 2**24,
}


def _hybrid_groups(
    dp_group: dist.ProcessGroup | None, sub_dp_size: int, replicate_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replicate group) from the seed's ``sub_dp_size`` or an explicit pair.

    With ``sub_dp_size = k`` the data-parallel ranks, in order, are read as a
    ``(k, N / k)`` grid: row ``i`` is a shard group, column ``j`` the replicas of shard
    position ``j`` (built by :func:`zerofn.comm.grid_groups`, collectively).
    """
    if not isinstance(sub_dp_size, int) or sub_dp_size < 1:
        raise ValueError(f"ZeroOptimizer: sub_dp_size must be an int >= 1, got {sub_dp_size!r}")
    if sub_dp_size == 1:
        return dp_group, replicate_group
    if replicate_group is not None:
        raise ValueError("ZeroOptimizer: give sub_dp_size or replicate_group, not both")
    size = comm.group_size(dp_group)
    if size % sub_dp_size:
        raise ValueError(f"ZeroOptimizer: sub_dp_size={sub_dp_size} does not divide the {size} data-parallel ranks")
    return comm.grid_groups(dp_group, sub_dp_size)


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
