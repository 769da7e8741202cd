"""``ZeroOptimizer``: construction, backward/step/zero_grad/no_sync/state_dict, the torch.optim bridge.

It owns no math and no bucket code. It keeps one :class:`~zerofn.state.ZeroState` and
threads it through the stage functions: the :class:`~._reducer.GradReducer` turns
gradients into shards (from hooks, through :mod:`zerofn.buckets`), ``step`` calls
:func:`~zerofn.step_shards` with ``donate=True`` (the facade owns its state, so no step
doubles the optimizer-state memory), and :func:`~zerofn.gather_params` writes the new
values straight into the model's parameters (``out=``), or the
:class:`~._prefetch.ParamPrefetcher` launches the same gathers for the next forward.

Mixed precision is :mod:`zerofn.precision`'s policy, stored in the state: the facade only
scales the loss in ``backward`` by the state's loss scale and hands everything else
(overflow decision, loss-scale update, unscaling, clipping, CPU offload, casting back to
the working dtype) to the stage functions.

Gradients, as a DDP user expects them (see :mod:`~._reducer`): at stage 1, after
``backward`` every ``p.grad`` holds the averaged, unscaled gradient as DDP leaves it, so
``torch.nn.utils.clip_grad_norm_``, logging and inspection work unchanged, and ``step``
uses what the user left there. At stage 2 a rank holds only its shards; ``p.grad`` holds a
zero-memory placeholder on which torch's functions raise, naming
:meth:`ZeroOptimizer.clip_grad_norm_`, :meth:`~ZeroOptimizer.get_grad_norm` and
:meth:`~ZeroOptimizer.get_param_grad` (which gathers one gradient on demand).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn import _sync, optim, torch_optim
from zerofn._comm import CommPolicy
from zerofn.checkpoint import _async
from zerofn.facade import _buffers, _compiled, _entry, _guards, _options
from zerofn.facade._grad_methods import GradMethods
from zerofn.facade._param_methods import ParamMethods
from zerofn.facade._prefetch import ParamPrefetcher
from zerofn.facade._reducer import GradReducer, ShardedGrad
from zerofn.facade._state_dicts import StateDictMethods
from zerofn.precision import GradAccumDtype, NoLossScaling, PrecisionPolicy, scale_loss
from zerofn.stages import DEFAULT_BUCKET_NUMEL, gather_params, shard_params
from zerofn.state import StepInfo, ZeroState

__all__ = ["ZeroOptimizer"]

log = logging.getLogger("zerofn")


class ZeroOptimizer(GradMethods, ParamMethods, StateDictMethods, torch.optim.Optimizer):
    """ZeRO stage 1/2 as a drop-in optimizer; every number it holds is a ``ZeroState``.

    Three ways to build it::

        ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), partition_grad=True)
        ZeroOptimizer([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest)], module=model)
        ZeroOptimizer(model.named_parameters(), zf.optim.adamw(lr=1e-3), partition_grad=True)

    It is a ``torch.optim.Optimizer`` so torch LR schedulers drive it: ``param_groups``
    are live (for a wrapped torch optimizer they are that optimizer's groups; over a list,
    the wrapped optimizers' groups one after the other, so an LR scheduler on one wrapped
    optimizer drives its own groups), and their hyperparameters are read at every ``step``.

    The params are the user's, as with DDP: weights written into the model after building
    the optimizer are trained, not reverted (:mod:`zerofn.facade._guards`; after writes
    through ``p.data``, call :meth:`check_params`). ``optimizer.state`` is a
    :class:`~zerofn.state.ZeroState`; ``optimizer.state[p]`` raises and says where to look.

    Args:
      optimizer: a torch optimizer over the model's params (SGD/Adam/AdamW run on the
        fast functional path, other element-wise ones on the generic path, Muon and
        Adafactor on whole params on their owner ranks, LBFGS and SparseAdam are
        refused); a list of torch optimizers, each param in exactly one of them (one
        :func:`zerofn.optim.partition`: one backward, one gradient reduction, one global
        norm over every param; ``state_dict()`` is a list of torch-format dicts, one per
        optimizer in order); or an iterable of ``(name, param)`` / mapping
        ``name -> param`` when ``functional_optimizer`` is given.
      functional_optimizer: a :mod:`zerofn.optim` optimizer, with named params.
      partition_grad: ZeRO stage 2 (gradients sharded, reduced from hooks) if True,
        else stage 1.
      reduce_bucket_size: padded elements per communication bucket (default
        ``zf.stages.DEFAULT_BUCKET_NUMEL`` = 2**22, 16 MiB in float32). The param gathers
        use the same buckets.
      overlap_communication: launch each bucket's reduction asynchronously as soon as
        its gradients are ready during backward.
      overlap_allgather: hide the parameter gather behind the next forward (needs
        ``module=``, which must own every param). ``step`` launches the
        gathers; each module's forward pre-hook writes its params (the same bits). Any
        other read or write of a param before then (an EMA, logging, clamping,
        ``state_dict()``, an evaluation, a checkpoint) first waits for that param's
        bucket, so it sees the updated values, as with DDP; until its bucket is written a
        param's class is a ``PendingParameter`` (a subclass of its own). Details, the one
        exception (aliases kept from before ``step``), limits and memory:
        :mod:`zerofn.facade._prefetch`.
      clip_grad_norm: clip by the global gradient norm when > 0.
      norm_type: 2.0 or ``math.inf`` for clipping and ``get_grad_norm``.
      dp_process_group: the data-parallel group; ``None`` for the default. Shards live
        across all of it unless ``sub_dp_size`` or ``replicate_group`` make it hybrid.
      sub_dp_size: a hybrid layout: split ``dp_process_group`` (ranks in order)
        into ``sub_dp_size`` shard groups of ``N / sub_dp_size`` consecutive ranks; a
        rank's replicas are the ranks at its position in the other shard groups. Every
        rank of ``dp_process_group`` must construct the optimizer (it creates groups).
      replicate_group: explicit hybrid layout: ``dp_process_group`` is then this rank's
        shard group and ``replicate_group`` the ranks holding the same shards.
      comm_policy: collective realisations (default per backend, see :class:`~zerofn.CommPolicy`).
      module: optional model whose ``named_parameters()`` names the params of a wrapped
        torch optimizer (for messages and ``state.master`` keys); otherwise they are
        named ``"group{g}.param{i}"``. The bare model, not a ``DistributedDataParallel``
        (refused: gradients would be reduced twice). With it, a param or submodule
        replaced after construction is refused at the next ``backward``/``step``.
      init_sync: at construction, make every rank start from rank 0's params (and, with
        ``module=``, its buffers), as DDP does when it is built (its ``init_sync``): one
        broadcast per dtype over the data-parallel world (both groups of a hybrid
        layout), after the ranks agreed on the layout and before the masters are used.
        ``False``: each rank keeps its own values (they must then be equal already).
      broadcast_buffers: with ``module=``, rank 0's buffers (BatchNorm running stats) are
        broadcast before each forward of the module, as DDP's ``broadcast_buffers=True``
        default (see :mod:`zerofn.facade._buffers` for its cost); ``False`` is DDP's opt-out.
      entry_timeout: seconds that a collective entry point (``state_dict``,
        ``save_checkpoint``, ``load_checkpoint``, ``load_state_dict``, ``check_params``)
        waits for every rank to call it before raising, naming the ranks that did not and
        what to write instead (:mod:`zerofn.facade._entry`); ``None``: no such wait.
      compile: run everything ``step`` does after backward (norm, overflow skip and loss
        scale, unscale, clip, the optimizer update, the param gather) as one
        ``torch.compile(fullgraph=True)`` graph; the backward hooks stay eager. ``True``:
        the ``"inductor"`` backend (generated, fused kernels: the one that can be faster
        than eager); a string: that backend (``"aot_eager"``: eager mode's kernels,
        bitwise the eager facade). The first ``step`` compiles; learning rates (schedulers,
        edits of ``param_groups``), the loss scale and the step count are tensors the graph
        reads, so they never recompile. Needs Adam/AdamW without ``foreach``/``fused``
        (anything else is refused here, saying what to write) and no ``overlap_allgather``.
        See :mod:`zerofn.facade._compiled` and the docs' "jit the step" page.
      verbose: log skipped steps.
      communication_dtype: dtype gradients are cast to on the wire (``None``: the params'
        working dtype). This and the precision keywords below are turned into a
        :class:`~zerofn.precision.PrecisionPolicy` (meanings: :mod:`zerofn.facade._options`).
      cpu_offload: keep master shards and optimizer state on the CPU.
      forced_dtype: cast every param (``p.data``) to this dtype at construction.
      master_weights: keep float32 master shards (default); False: the optimizer updates
        working-dtype shards directly.
      nonfinite: what a step with an ``inf``/``nan`` gradient does without a dynamic loss
        scaler (bf16, fp32): ``"skip"`` it on every rank, or ``"raise"``
        :class:`~zerofn.precision.NonFiniteGradError` on every rank.
      grad_accum_dtype: dtype micro-batch gradients are summed in under ``no_sync``
        (``"auto"``: float32 for float16/bfloat16 params).
      initial_scale: the dynamic loss scaler's first scale. float16 params train with a
        dynamic loss scaler (``backward`` multiplies the loss by its current scale);
        bfloat16 and float32 without. This and the next six are its settings
        (their meanings: :class:`~zerofn.precision.DynamicLossScaler`).
      min_scale: the smallest scale a backoff may reach.
      growth_factor: the scale's factor after ``growth_interval`` good steps.
      backoff_factor: the scale's factor after ``hysteresis`` overflows.
      growth_interval: good steps before the scale grows.
      hysteresis: overflows tolerated before the scale backs off.
      max_scale: the largest scale growth may reach.
      precision: a full :class:`~zerofn.precision.PrecisionPolicy` instead of the
        options above (then leave those at their defaults). Params of several dtypes
        raise :class:`~zerofn.precision.MixedDtypeError` naming them unless
        ``forced_dtype`` or the policy says what to do.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer
        | list[torch.optim.Optimizer]
        | Iterable[tuple[str, torch.Tensor]]
        | Mapping[str, torch.Tensor],
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
        reduce_bucket_size: int = DEFAULT_BUCKET_NUMEL,
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
        init_sync: bool = True,
        broadcast_buffers: bool = True,
        entry_timeout: float | None = 300.0,
        compile: bool | str = False,
    ) -> None:
        keywords = _options.PrecisionKeywords(
            communication_dtype=communication_dtype,
            cpu_offload=cpu_offload,
            forced_dtype=forced_dtype,
            master_weights=master_weights,
            nonfinite=nonfinite,
            grad_accum_dtype=grad_accum_dtype,
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
        )
        _options.check_settings(reduce_bucket_size, norm_type, clip_grad_norm)
        _guards.check_module(module)  # a DDP-wrapped model would have its gradients reduced twice
        named_groups, fopt, torch_groups = _options.resolve_params(optimizer, functional_optimizer, module)
        backend = _compiled.resolve_backend(compile)
        if backend is not None:
            _compiled.check_compilable(fopt, overlap_allgather=overlap_allgather)
        params = {n: p for g in named_groups for n, p in g}
        if overlap_allgather:
            _options.check_gather_module(params, module)
        policy = _options.precision_policy(params, precision, keywords)
        _options.cast_params(params, policy)  # validated: now cast, before anything reads them
        self._group, self._replicate = _options.hybrid_groups(dp_process_group, sub_dp_size, replicate_group)
        groups = (self._group,) if self._replicate is None else (self._group, self._replicate)
        self._entry = _entry.EntryGuard(groups, entry_timeout)
        self._stage = 2 if partition_grad else 1
        self._bucket_numel = reduce_bucket_size
        self._overlap = overlap_communication
        self._max_norm = clip_grad_norm if clip_grad_norm > 0 else None
        self._norm_type = float(norm_type)
        self._comm_policy = comm_policy or CommPolicy()
        self._verbose = verbose
        defaults = optimizer.defaults if isinstance(optimizer, torch.optim.Optimizer) else fopt.defaults
        _options.torch_bookkeeping(self, defaults)
        # The wrapped torch optimizers (one, several, or none for a functional optimizer).
        self._wrapped = list(optimizer) if _options.is_optimizer_list(optimizer) else []
        if isinstance(optimizer, torch.optim.Optimizer):
            self._wrapped = [optimizer]
        self.param_groups = torch_groups
        self._group_names = [[n for n, _ in g] for g in named_groups]
        self._params = params
        self._name_of = {id(p): n for n, p in params.items()}
        # The masters are cut here and made rank 0's below, once the ranks agree on the layout.
        self._state: ZeroState = shard_params(params, fopt, self._group, precision=policy, check=False)
        layout = self._state.layout
        module_states = _buffers.module_states(module, params, buffers=broadcast_buffers)
        settings = {"stage": self._stage, "bucket_numel": reduce_bucket_size, "overlap": int(overlap_communication)}
        settings |= {"init_sync": int(init_sync), "broadcast_buffers": int(broadcast_buffers)}
        self._agree(settings, policy, fopt, module_states)
        if init_sync:  # DDP's construction: every rank starts from rank 0's params and buffers
            self._init_sync(module_states)
        self._gather_how = self._comm_policy.resolve(self._group)[1]
        self._hp_cache: tuple[Any, ...] | None = None
        self._compiled = None if backend is None else self._make_compiled(backend)
        self._last_info: StepInfo | None = None
        self._reducer = GradReducer(
            params,
            layout,
            policy,
            group=self._group,
            replicate=self._replicate,
            stage=self._stage,
            bucket_numel=reduce_bucket_size,
            overlap=overlap_communication,
            comm_policy=self._comm_policy,
            loss_scale=_loss_scale_of(weakref.ref(self)),
        )
        # Params are the user's: writes made to them outside the facade are noticed at step.
        self._guard = _guards.ParamGuard(params, module)
        self._prefetch = self._make_prefetch(module) if overlap_allgather else None
        self._module = module
        self._buffer_sync = None
        if module is not None and broadcast_buffers and self._world_size() > 1:
            require_sync = _require_sync_of(weakref.ref(self._reducer))
            self._buffer_sync = _buffers.BufferSync(module, self._group, self._replicate, require_sync)

    def _agree(
        self,
        settings: dict[str, int],
        policy: PrecisionPolicy,
        fopt: optim.Optimizer,
        module_states: Mapping[str, torch.Tensor],
    ) -> None:
        """Every rank of both groups built the same optimizer, or every rank raises, before any
        broadcast. Collectives: one small all-gather per group (``check_ranks_agree``)."""
        layout = self._state.layout
        settings = dict(settings, precision=checks.text_hash(repr(policy)))
        # Equal placements do not mean equal updates ([Adafactor, AdamW] vs [Muon, AdamW]).
        settings["optimizer"] = checks.text_hash(_options.update_rules(fopt, layout.names))
        # What the init_sync broadcasts move must be alike everywhere (a mismatch inside them would hang).
        settings["module"] = _sync.structure_hash(module_states)
        for g in (self._group, self._replicate) if self._replicate is not None else (self._group,):
            checks.check_ranks_agree(layout, g, "ZeroOptimizer", settings=settings, device=self._state.work_device)

    def _init_sync(self, module_states: Mapping[str, torch.Tensor]) -> None:
        """Broadcast rank 0's params and buffers over the data-parallel world; the masters take them.

        Collectives: one broadcast per dtype over the replicate group (hybrid), then over
        the shard group.
        """
        if self._world_size() == 1:
            return
        with torch.no_grad():
            _sync.broadcast_(list(module_states.values()), self._group, self._replicate)
        self._state = _guards.adopt_params(self._state, self._params, self._state.layout.names)

    def _make_compiled(self, backend: str) -> _compiled.CompiledStep:
        """``compile=``'s step after backward: ``step_shards`` and the gather in one graph."""
        return _compiled.CompiledStep(
            backend,
            self._group,
            self._max_norm,
            self._norm_type,
            self._bucket_numel,
            self._comm_policy,
            self._state.layout.fingerprint,
        )

    def _world_size(self) -> int:
        """Ranks of the whole data-parallel world (shard group times replicas)."""
        replicas = comm.group_size(self._replicate) if self._replicate is not None else 1
        return comm.group_size(self._group) * replicas

    def _make_prefetch(self, module: torch.nn.Module | None) -> ParamPrefetcher:
        """``overlap_allgather``'s prefetcher over the layout's buckets (``module`` owns every param)."""
        assert module is not None  # _options.check_gather_module
        layout = self._state.layout
        buckets = layout.buckets(self._bucket_numel)
        group, how, guard = self._group, self._gather_how, self._guard
        staging = self._reducer.staging  # idle between step and the next backward: the gathers borrow it
        return ParamPrefetcher(
            self._params, layout, buckets, group=group, how=how, module=module, guard=guard, staging=staging
        )

    # ------------------------------------------------------------------ public state

    @property
    def state(self) -> ZeroState:  # type: ignore[override]
        """The current :class:`ZeroState` (master shards, optimizer state, step).

        Not torch's dict param -> state: ``optimizer.state[p]`` raises a ``TypeError`` that
        points at ``state_dict()["state"]`` (the whole state, torch's format) and at the
        ZeroState's fields (this rank's shards).
        """
        return self._state

    @property
    def stage(self) -> int:
        return self._stage

    @property
    def precision(self) -> PrecisionPolicy:
        """The :class:`~zerofn.precision.PrecisionPolicy` in force (also ``state.precision``)."""
        return self._state.precision

    @property
    def loss_scale(self) -> float:
        """The loss scale the next ``backward`` multiplies the loss by (1.0 without scaling)."""
        return self._host_loss_scale()

    def _host_loss_scale(self) -> float:
        """The state's loss scale as a Python float, read from its 0-d tensor once per new tensor.

        The gradient hooks ask for it per bucket; a step makes at most one new scale tensor, so
        the device is read at most once per step (never under ``NoLossScaling``, whose tensor
        does not change).
        """
        scale = self._state.loss_scale.scale
        seen = self.__dict__.get("_scale_seen")
        if seen is None or seen[0] is not scale:
            seen = self._scale_seen = (scale, float(scale))
        return seen[1]

    @property
    def last_step_info(self) -> StepInfo | None:
        return self._last_info

    # ------------------------------------------------------------------ gradients

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for both stages, as DDP's ``no_sync``."""
        old = self._reducer.require_sync
        self._reducer.require_sync = False
        try:
            yield
        finally:
            self._reducer.require_sync = old

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of the loss times the loss scale; outside ``no_sync`` the gradients are then averaged.

        Without loss scaling (scale 1.0) this is ``loss.backward()``, and a plain
        ``loss.backward()`` does the same: the facade's hooks reduce the gradients while
        autograd runs (or at its end without ``overlap_communication``). Afterwards, at
        stage 1 each ``p.grad`` holds the averaged gradient divided by the loss scale, as
        DDP (after ``GradScaler.unscale_``) leaves it; memory: full gradients, as DDP. At
        stage 2 a rank keeps its shards and ``p.grad`` a placeholder that holds nothing
        (torch's functions on it raise, naming :meth:`clip_grad_norm_`,
        :meth:`get_grad_norm`, :meth:`get_param_grad`). A second backward before ``step``
        adds its averaged gradient to the first's. After ``step``, call ``zero_grad()`` (or
        ``model.zero_grad()``) before the next backward, as with DDP; without it, at stage 1
        the new gradients add to the step's in ``p.grad`` as with DDP, and at stage 2 (or
        under loss scaling) the backward raises on every rank saying so.

        Collectives: per bucket one reduction, and one tiny rank-agreement all-gather.
        """
        self._guard.check_structure("ZeroOptimizer.backward")  # a moved/cast/replaced param: say what to do
        # Pending gathers here mean a forward ran outside the model's hooks and read old params: writing
        # them now makes autograd refuse the saved tensors (modified in place) instead of training on them.
        self.wait_params()
        if self._scales_loss():
            loss = scale_loss(loss, self._state.loss_scale)
        loss.backward(retain_graph=retain_graph)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """``torch.autograd.backward(tensor, grad * loss scale)``; the gradients are averaged as in ``backward``."""
        self._guard.check_structure("ZeroOptimizer.backward_by_grad")
        self.wait_params()  # as in backward
        if self._scales_loss():
            grad = scale_loss(grad, self._state.loss_scale)
        torch.autograd.backward(tensor, grad)

    def _scales_loss(self) -> bool:
        """Whether ``backward`` multiplies by the loss scale: not under ``NoLossScaling`` (a scale of 1.0 forever)."""
        return not isinstance(self._state.precision.loss_scaler, NoLossScaling)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients: ``p.grad`` (set to ``None``, or zeroed), accumulators and shards.

        With ``set_to_none=False`` a real ``p.grad`` is zeroed in place, as torch does, and
        counts as a zero gradient from then on (the next backward accumulates into it, and a
        param that gets nothing more steps with a zero gradient, as with torch.optim); a
        stage-2 placeholder is removed.
        """
        # Params may be pending (overlap_allgather's guard): .grad reads no values, skip their check.
        with torch._C.DisableTorchFunctionSubclass():
            for p in self._params.values():
                g = p.grad
                if g is None:
                    continue
                if set_to_none or type(g) is ShardedGrad:
                    p.grad = None
                else:
                    g.detach_()
                    g.zero_()
        self._reducer.clear()

    def close(self) -> None:
        """Finish pending param gathers and background saves, remove the facade's hooks from the model.

        A background save (``save_checkpoint(async_save=True)``) still in flight is waited
        for; if it failed and nobody has seen it yet, its
        :class:`~zerofn.checkpoint.CheckpointError` is raised here (after the hooks are gone).
        Garbage collection does the rest of this but never waits for a save: it may run in
        any thread, the save's own writer included. A save left in flight commits by
        itself, and the interpreter waits for it at exit.
        """
        self._close(collected=False)

    def _close(self, collected: bool) -> None:
        """:meth:`close`; ``collected``: called by garbage collection, which leaves background saves alone."""
        try:
            self.wait_params()
            if not collected:
                _async.wait_in_flight(self._group)
        finally:
            self._reducer.close()
            if self._prefetch is not None:
                self._prefetch.close()
            if self._buffer_sync is not None:
                self._buffer_sync.close()

    def __del__(self) -> None:
        if "_reducer" not in vars(self):
            # Not a ZeroOptimizer that was built, but an object that borrowed the class: Lightning's
            # LightningOptimizer and Fabric's _FabricOptimizer subclass the optimizer they wrap and forward
            # attribute reads to it. Closing through one would take the real optimizer's hooks off the model.
            return
        if sys.is_finalizing():
            # Interpreter teardown: the model's tensors may be half torn down already, and
            # writing pending gathers into them aborts the process (a torch internal assert
            # in THPVariable_clear). Nobody reads the params any more: leave everything.
            return
        with contextlib.suppress(Exception):
            self._close(collected=True)

    def wait_params(self) -> None:
        """Complete the param gathers the last ``step`` left in flight (``overlap_allgather``).

        After it, every param holds its updated value. Never needed for correctness: the
        first use of a param whose gather is in flight waits for it by itself
        (:mod:`~zerofn.facade._prefetch`); call it to choose when the wait happens, or
        before reading a view of a param kept from before ``step``. Without
        ``overlap_allgather``, or when nothing is pending, it returns at once. Not a
        collective: the peers launched their side of the gathers in their own ``step``.
        """
        if self._prefetch is not None:
            self._prefetch.wait()

    # ------------------------------------------------------------------ step

    def _current_optimizer(self) -> optim.Optimizer:
        """The functional optimizer with the hyperparameters now in ``param_groups``."""
        # What the wrapped optimizers' own step would do for an LR scheduler built on one of them:
        # the scheduler then knows its optimizer stepped (torch warns otherwise, by this attribute).
        for wrapped in self._wrapped:
            wrapped._opt_called = True  # type: ignore[attr-defined]
        fopt, self._hp_cache = torch_optim.with_live_hyperparams(
            self._state.optimizer, self.param_groups, self._hp_cache
        )
        return fopt

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Unscale, clip, update this rank's shards and write the gathered params into the model.

        A step whose gradients are not finite on any rank is skipped on every rank (and
        the dynamic loss scale backs off), or, with ``nonfinite="raise"``, every rank
        raises :class:`~zerofn.precision.NonFiniteGradError`; either way the gradients
        of the step are dropped and the optimizer state is untouched.

        ``step`` applies the gradients the user left: stage 1, each ``p.grad`` (clipped,
        edited, replaced; ``None`` leaves the param out, as torch.optim), cut into this
        rank's shards; stage 2, the shards (a placeholder set to ``None`` drops its
        param's). ``p.grad`` keeps its values after the step, as with DDP, until
        ``zero_grad``: a backward before it accumulates into them at stage 1 (as DDP), and
        raises on every rank at stage 2 or under loss scaling (the step consumed the
        shards), saying to call ``zero_grad()``.

        Params are the user's: a param written outside the facade since its last write
        (``model.load_state_dict``, ``p.copy_``, in-place ops under ``no_grad``) is noticed here,
        before the write-back could revert it, and its masters take the written values on
        every rank, so the step trains what the user loaded (as with DDP + torch.optim).
        Changes the optimizer cannot follow (a param moved, cast or replaced; ranks that
        changed different things) raise :class:`~zerofn.facade._guards.ParamsChangedError`
        on every rank. Writes through ``p.data`` are not seen: call :meth:`check_params`
        after them. See :mod:`zerofn.facade._guards`.

        Collectives: one scalar all-reduce (norm, overflow flag, and whether any rank's
        params changed) and the bucketed gather of the params; only when params changed,
        one object all-gather of what changed and a second scalar all-reduce.
        """
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self.wait_params()  # the last step's gathers, if no forward has written them
        self._guard.check_structure("ZeroOptimizer.step")  # before reduce_local reads moved/cast grads
        self._reducer.settle()  # local gradients left by no_sync() micro-steps, or set by hand
        if not self._reducer.holds_grads():
            raise RuntimeError(
                "ZeroOptimizer.step: no gradients since the last step or zero_grad(). Call "
                "optimizer.backward(loss) (or loss.backward()) outside no_sync() before step()."
            )
        old_scale = self._state.loss_scale.scale
        new_state, info = self._step_shards(self._guard.inspect())
        self._last_info = info
        self._state = new_state
        if self._compiled is not None:  # it copied the gathered params in (a skipped step: the values they held)
            self._guard.record()
        if info.skipped:
            if self._verbose:
                scales = float(old_scale), float(new_state.loss_scale.scale)
                log.info(
                    "zerofn: non-finite gradient (norm %s); step skipped, loss scale %s -> %s", info.grad_norm, *scales
                )
            return
        if self._compiled is not None:
            return
        if self._prefetch is not None:  # written into the params by the next forward (or wait_params)
            self._prefetch.launch(new_state)
            return
        # The layout and bucket size were confirmed on every rank at construction.
        gather_params(
            new_state,
            self._group,
            bucket_numel=self._bucket_numel,
            comm_policy=self._comm_policy,
            out=self._params,
            check=False,
            staging=self._reducer.staging,  # idle between step and the next backward
        )
        self._guard.record()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("ZeroOptimizer: param groups are fixed at construction (the layout is sharded)")

    def __repr__(self) -> str:
        layout = self._state.layout
        return (
            f"ZeroOptimizer(stage={self._stage}, optimizer={self._state.optimizer.name}, params={len(layout)}, "
            f"world_size={layout.world_size}, bucket_numel={self._bucket_numel}, overlap={self._overlap})"
        )


def _require_sync_of(reducer: weakref.ref[GradReducer]) -> Any:
    """Whether the reducer synchronises gradients now (False inside ``no_sync``), without a reference cycle."""

    def require() -> bool:
        me = reducer()
        return me is not None and me.require_sync

    return require


def _loss_scale_of(opt: weakref.ref[ZeroOptimizer]) -> Any:
    """The loss scale of the facade's state now (for the reducer, without a reference cycle)."""

    def scale() -> float:
        me = opt()
        return 1.0 if me is None else me._host_loss_scale()

    return scale
