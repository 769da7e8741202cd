"""``ZeroOptimizer``: the public facade, each of its concerns delegated to a collaborator.

It owns no math and no bucket code: it keeps one :class:`~zerofn.state.ZeroState` and
threads it through collaborators made at construction (:mod:`~zerofn.facade._build`, the
package docstring lists them), each given what it needs. Mixed precision is
:mod:`zerofn.precision`'s policy, stored in the state: the facade only scales the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerofn import optim
from zerofn._comm import CommPolicy
from zerofn.checkpoint import _async
from zerofn.facade import _build, _options
from zerofn.facade._state_dicts import state_dict_blocks
from zerofn.precision import GradAccumDtype, PrecisionPolicy
from zerofn.stages import DEFAULT_BUCKET_NUMEL
from zerofn.state import StepInfo, ZeroState

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1/2 as a drop-in optimizer; every number it holds is a ``ZeroState``.

    Three ways to build it::

        ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), partition_grad=True)
        ZeroOptimizer([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest)], module=model)
        ZeroOptimizer(model.named_parameters(), zf.optim.adamw(lr=1e-3), partition_grad=True)

    It is a ``torch.optim.Optimizer`` so torch LR schedulers drive it: ``param_groups`` are
    live (a wrapped optimizer's own groups) and read at every ``step``. The params are the
    user's, as with DDP: weights written into the model after building the optimizer are
    trained, not reverted (:mod:`zerofn.facade._guards`). ``optimizer.state`` is a
    :class:`~zerofn.state.ZeroState`; ``optimizer.state[p]`` raises and says where to look.

    Args:
      optimizer: a torch optimizer over the model's params (Muon and Adafactor on whole
        params on their owner ranks; LBFGS and SparseAdam refused); a list of torch
        optimizers, each param in exactly one (one :func:`zerofn.optim.partition`;
        ``state_dict()`` is then a list); or ``(name, param)`` pairs / a mapping with
        ``functional_optimizer``.
      functional_optimizer: a :mod:`zerofn.optim` optimizer, with named params.
      partition_grad: ZeRO stage 2 (gradients sharded) if True, else stage 1.
      reduce_bucket_size: padded elements per communication bucket (default 2**22,
        ``zf.stages.DEFAULT_BUCKET_NUMEL``), for the reductions and the param gathers.
      overlap_communication: launch each bucket's reduction asynchronously from backward.
      overlap_allgather: hide the param gather behind the next forward (needs ``module=``
        owning every param): ``step`` launches the gathers, each module's forward
        pre-hook writes its params, and any other use of a param first waits for its
        bucket (a ``PendingParameter`` until then). Details: :mod:`zerofn.facade._prefetch`.
      clip_grad_norm: clip by the global gradient norm when > 0.
      norm_type: 2.0 or ``math.inf`` for clipping and ``get_grad_norm``.
      dp_process_group: the data-parallel group (``None``: the default), sharded across
        unless ``sub_dp_size`` or ``replicate_group`` make the layout hybrid.
      sub_dp_size: split ``dp_process_group`` into ``sub_dp_size`` shard groups of
        consecutive ranks, replicated across (every rank builds the optimizer).
      replicate_group: explicit hybrid layout: ``dp_process_group`` is then this rank's
        shard group and ``replicate_group`` the ranks holding the same shards.
      comm_policy: collective realisations (default per backend, see :class:`~zerofn.CommPolicy`).
      module: the bare model (not DDP-wrapped), naming the params (else
        ``"group{g}.param{i}"``); a param replaced later is refused at ``backward``/``step``.
      init_sync: every rank starts from rank 0's params (and the module's buffers), as
        DDP's construction: one broadcast per dtype over the data-parallel world.
        ``False``: each rank keeps its own values (they must be equal already).
      broadcast_buffers: with ``module=``, rank 0's buffers are broadcast before each
        forward, as DDP's default (:mod:`zerofn.facade._buffers`); ``False`` opts out.
      entry_timeout: seconds a collective entry point (``state_dict``, checkpoints,
        ``check_params``) waits for every rank before raising, naming the missing ranks
        (:mod:`zerofn.facade._entry`); ``None``: no such wait.
      compile: run what ``step`` does after backward as one ``torch.compile(fullgraph=True)``
        graph (``True``: ``"inductor"``; a string: that backend, ``"aot_eager"`` is bitwise
        the eager facade); learning rates, the loss scale and the step count never
        recompile. Adam/AdamW only, without ``overlap_allgather`` (:mod:`zerofn.facade._compiled`).
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
      initial_scale: the first scale of float16's dynamic loss scaler; ``min_scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis`` and
        ``max_scale`` are its other settings, by their names in
        :class:`~zerofn.precision.DynamicLossScaler`.
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
            communication_dtype=communication_dtype, cpu_offload=cpu_offload, forced_dtype=forced_dtype,
            master_weights=master_weights, nonfinite=nonfinite, grad_accum_dtype=grad_accum_dtype,
            initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis, max_scale=max_scale,
        )  # fmt: skip
        opts = _build.Options(
            clip_grad_norm=clip_grad_norm, norm_type=norm_type, verbose=verbose, reduce_bucket_size=reduce_bucket_size,
            overlap_communication=overlap_communication, overlap_allgather=overlap_allgather,
            partition_grad=partition_grad, dp_process_group=dp_process_group, sub_dp_size=sub_dp_size,
            replicate_group=replicate_group, comm_policy=comm_policy, module=module, precision=precision,
            init_sync=init_sync, broadcast_buffers=broadcast_buffers, entry_timeout=entry_timeout, compile=compile,
        )  # fmt: skip
        built = _build.build(optimizer, functional_optimizer, keywords, opts)
        self._group, self._replicate, self._entry = built.group, built.replicate, built.entry
        self._params, self._module, self._state = built.params, module, built.state
        self._stage, self._bucket_numel, self._overlap = opts.stage, reduce_bucket_size, overlap_communication
        _options.torch_bookkeeping(self, built.defaults)
        self.param_groups = built.torch_groups
        self._last_info: StepInfo | None = None
        self._host_scale = _build.HostScale()
        residual = _build.weak_call(self, lambda me: me.state.residual, ())
        parts = _build.assemble(built, opts, _build.weak_call(self, lambda me: me.loss_scale, 1.0), residual)
        self._reducer, self._guard, self._prefetch = parts.reducer, parts.guard, parts.prefetch
        self._buffer_sync, self._hyperparams, self._grads = parts.buffer_sync, parts.hyperparams, parts.grads
        self._writes, self._steps, self._dicts = parts.writes, parts.steps, parts.dicts
        self._parts = parts

    @property
    def state(self) -> ZeroState:  # type: ignore[override]
        """The current :class:`ZeroState` (master shards, optimizer state, step).

        Not torch's dict param -> state: ``optimizer.state[p]`` raises a ``TypeError`` that
        points at ``state_dict()["state"]`` and at the ZeroState's fields.
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
        return self._host_scale.read(self._state.loss_scale.scale)

    @property
    def last_step_info(self) -> StepInfo | None:
        return self._last_info

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no communication) for both stages, as DDP's ``no_sync``."""
        return self._grads.no_sync()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of the loss times the loss scale; outside ``no_sync`` the gradients are then averaged.

        A plain ``loss.backward()`` does the same without loss scaling (the hooks reduce while
        autograd runs). Then at stage 1 each ``p.grad`` holds the averaged, unscaled gradient,
        as DDP leaves it; at stage 2 a rank keeps its shards and ``p.grad`` a placeholder on
        which torch's functions raise, naming :meth:`clip_grad_norm_` and
        :meth:`get_param_grad`. Two backwards before ``step`` sum. Call ``zero_grad()`` after
        ``step``: without it stage 1 adds to ``p.grad`` (as DDP), stage 2 and loss scaling raise.

        Collectives: per bucket one reduction, and one tiny rank-agreement all-gather.
        """
        loss = self._grads.before_backward(self._state, loss, "ZeroOptimizer.backward")
        loss.backward(retain_graph=retain_graph)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """``torch.autograd.backward(tensor, grad * loss scale)``; the gradients are averaged as in ``backward``."""
        grad = self._grads.before_backward(self._state, grad, "ZeroOptimizer.backward_by_grad")
        torch.autograd.backward(tensor, grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients: ``p.grad`` (set to ``None``, or zeroed), accumulators and shards.

        With ``set_to_none=False`` a real ``p.grad`` is zeroed in place and counts as a zero
        gradient from then on, as with torch.optim; a stage-2 placeholder is removed.
        """
        self._grads.zero_grad(set_to_none)

    def get_grad_norm(self) -> float | None:
        """The global norm of the true (unscaled) gradient: the current one, else the last step's.

        Between ``backward`` and ``step``: the norm of the averaged gradients held now, divided
        by the loss scale (``inf`` if an element is not finite); a **collective** (one all-reduce
        of three float64 scalars; with gradients left from ``no_sync``, their reduction first).
        Otherwise the norm the last ``step`` applied, before clipping (``None`` before the first
        step); no communication.
        """
        return self._grads.grad_norm(self._state, self._last_info)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the current gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``.

        Call it between ``backward`` and ``step``, on every rank, at either stage. The total norm
        is over the whole averaged gradient (every rank's shards, in float64), divided by the loss
        scale; every gradient (``p.grad`` at stage 1, the shards at stage 2) is multiplied by
        ``min(1, max_norm / (total_norm + 1e-6))``, torch's factor. A non-finite norm leaves them
        unchanged (``step`` then skips them, or raises with ``nonfinite="raise"``).

        Args:
          max_norm: the threshold (>= 0).
          norm_type: 2.0 or ``math.inf``.
          error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the norm is not finite.

        Returns:
          The total norm before clipping, a float32 0-d tensor on the params' device; 0 when no
          gradient is held.

        Collectives: one all-reduce of three float64 scalars over the group (with gradients left
        from ``no_sync`` micro-steps, their reduction first).
        """
        return self._grads.clip_(self._state, max_norm, norm_type, error_if_nonfinite)

    def get_param_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The full averaged gradient of ``param`` since the last step, unscaled, or None.

        What ``step`` would apply before clipping. Stage 1: a copy of ``p.grad``, no
        communication. Stage 2: a **collective** (every rank calls it for the same param:
        one gather of its shards), in the shards' dtype.
        """
        return self._grads.param_grad(param)

    def grad_bytes(self) -> int:
        """Bytes this rank holds for gradients right now: ``p.grad``, accumulators, buckets in flight, shards.

        Not counted: the idle staging buffers kept for reuse between steps (:meth:`staging_bytes`).
        """
        return self._grads.grad_bytes()

    def staging_bytes(self) -> int:
        """Bytes of the reusable bucket staging buffers held now, idle or in flight.

        Per dtype up to three ``(N, S)`` gradient buffers with ``overlap_communication``,
        else one; with ``overlap_allgather`` also the ``(S,)`` send rows. ``close()`` frees them.
        """
        return self._grads.staging_bytes()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Unscale, clip, update this rank's shards and write the gathered params into the model.

        Non-finite gradients on any rank skip the step on every rank (the loss scale backs off),
        or raise :class:`~zerofn.precision.NonFiniteGradError` everywhere with
        ``nonfinite="raise"``; the state is then untouched. It applies the gradients the user
        left (stage 1: ``p.grad``, ``None`` leaves the param out; stage 2: the shards). Params
        written since the last step (``model.load_state_dict``, ``p.copy_``) are taken into
        the masters on every rank first; changes it cannot follow raise
        :class:`~zerofn.facade._guards.ParamsChangedError` everywhere (after writes through
        ``p.data``, call :meth:`check_params`).

        Collectives: one scalar all-reduce (norm, overflow flag, whether any rank's params
        changed) and the bucketed gather of the params; only when params changed, one object
        all-gather of what changed and a second scalar all-reduce.
        """
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self.wait_params()  # the last step's gathers, if no forward has written them
        veto = self._steps.prepare()
        old_scale = self._state.loss_scale.scale
        state, info = self._steps.attempt(self._state, self.param_groups, veto)
        while info is None:  # a veto: the masters took the written params (kept even if the next try raises)
            self._state = state
            state, info = self._steps.attempt(state, self.param_groups, None)
        self._last_info = info
        self._state = state
        self._steps.write_back(state, info, old_scale)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("ZeroOptimizer: param groups are fixed at construction (the layout is sharded)")

    def check_params(self) -> list[str]:
        """Find params written without moving their version counter, and make the masters follow them.

        ``step`` notices writes that move a param's version counter; writes through ``p.data``
        do not: call this after them. It compares, bitwise, this rank's part of each param with
        its master rounded to the working dtype (:mod:`zerofn.facade._guards`).

        Returns:
          The names of the params whose masters were updated (the same on every rank).

        Raises:
          ParamsChangedError: on every rank, when the ranks' params are not equal (nothing changed).

        Collectives: the entry wait (:mod:`zerofn.facade._entry`), one object all-gather of each
        rank's differing names and a digest of every param (O(params) hashing).
        """
        self._state, adopted = self._writes.check(self._state)
        return adopted

    def update_master_params(self, model: torch.nn.Module | None = None) -> None:
        """Make the masters follow the model's current params (after editing weights); every rank calls it.

        The optimizer state is kept, as torch keeps it when weights are loaded. Raises and
        communicates as :meth:`check_params`, which it is.
        """
        del model  # the facade already holds the model's param tensors
        self.check_params()

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """``id(model param) -> this rank's master`` (1-D shard, or a whole param it owns)."""
        master = self._state.master
        return {id(p): master[n] for n, p in self._params.items() if n in master}

    def get_master_to_working_map(self) -> dict[int, torch.Tensor]:
        """``id(master) -> model param``, for the masters this rank holds."""
        master = self._state.master
        return {id(master[n]): p for n, p in self._params.items() if n in master}

    def state_dict(self) -> dict[str, Any] | list[dict[str, Any]]:  # type: ignore[override]
        """The whole optimizer state in ``torch.optim`` format (:func:`zerofn.checkpoint.full_state_dict`).

        Over a list of torch optimizers: a list of such dicts, one per wrapped optimizer in order,
        each loadable by a plain torch optimizer over the same params. Weights written into the
        model since the last step are first taken into the masters, as ``step`` would.

        Collective: every rank gathers the full state (one missing raises
        :class:`~zerofn.NotJoinedError` after ``entry_timeout``); before that, the entry wait and
        one scalar all-reduce (did any rank's params change).
        """
        self._state = self._writes.enter(self._state, "state_dict")
        self._state = self._hyperparams.apply(self._state, self.param_groups)
        return self._dicts.full(self._state)

    def load_state_dict(self, state_dict: Mapping[str, Any] | list[Mapping[str, Any]]) -> None:  # type: ignore[override]
        """Load a state dict from ``state_dict()`` (any world size) or from a torch optimizer.

        As in torch, the saved hyperparameters replace those in ``param_groups``. Masters come
        from the dict's ``zerofn`` entry, else from the model's params; with ``module=`` the
        model's persistent buffers take the saved ones. Over a list of torch optimizers: a list
        of dicts, one per wrapped optimizer in order. Validated before anything changes
        (:mod:`zerofn._state_dict_checks`): on failure every rank raises
        :class:`~zerofn.checkpoint.CheckpointError` and everything is as it was.

        Collectives: the entry wait, one all-gather of each rank's verdict over the shard group
        (and the replicate group), so every rank raises alike.
        """
        # master weights may come from the params (the user's writes first), and a late gather would overwrite them
        self._state = self._writes.enter(self._state, "load_state_dict")
        self._state = self._dicts.load(self._state, state_dict)
        self._hyperparams.load_saved(self.param_groups, state_dict)

    def state_dict_shard(self, max_shard_size: int = 1024) -> Iterator[tuple[dict[Any, dict[str, Any]], int]]:
        """Yield ``(block, numel)``: the torch-format ``state`` entries in size-bounded blocks.

        ``max_shard_size`` counts tensor elements per block (a larger param is a block of its
        own); keys as in ``state_dict()["state"]`` (over a list: ``(position, index)``).
        Collective: every rank must iterate it to the end.
        """
        yield from state_dict_blocks(self.state_dict(), max_shard_size)

    def save_checkpoint(
        self,
        path: str,
        *,
        with_model: bool = True,
        extra: Mapping[str, Any] | None = None,
        rng: bool = True,
        async_save: bool = False,
        safe_globals: Sequence[Any] = (),
    ) -> str | _async.PendingCheckpoint:
        """Sharded, atomic checkpoint of the state (and the model) at ``path``: :func:`zerofn.checkpoint.save`.

        With ``with_model`` and ``module=`` the model's persistent buffers are saved too (rank
        0's). ``extra``: the rest of the training state (name -> object with ``state_dict()`` /
        ``load_state_dict()``), per rank; ``rng``: each rank's RNG states; ``safe_globals``: the
        classes beyond data an extra may pickle (admitted by name, needed again on load).
        Weights written into the model since the last step are first taken into the masters.

        Returns the committed directory; with ``async_save=True`` a
        :class:`~zerofn.checkpoint.PendingCheckpoint` once this rank's state is in CPU memory
        (written in the background; the next save, load or :meth:`close` waits). Every rank calls it.
        """
        self._state = self._writes.enter(self._state, "save_checkpoint")
        self._state = self._hyperparams.apply(self._state, self.param_groups)
        return self._dicts.save(
            self._state,
            path,
            with_model=with_model,
            extra=extra,
            rng=rng,
            async_save=async_save,
            safe_globals=safe_globals,
        )

    def load_checkpoint(
        self,
        path: str,
        *,
        with_model: bool = True,
        extra: Mapping[str, Any] | None = None,
        rng: bool = True,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        """Resume from :meth:`save_checkpoint` (any world size): :func:`zerofn.checkpoint.load`.

        State, hyperparameters and, with ``with_model``, the weights and the module's buffers.
        ``extra``: the objects to restore the saved extras into (exactly the names saved);
        ``rng``: restore each rank's RNG; ``safe_globals``: as on save. Validated before anything
        changes: on failure every rank raises :class:`~zerofn.checkpoint.CheckpointError` and
        everything is as it was.
        """
        # The writes first: this waits for a late gather, which would overwrite the loaded weights.
        self._state = self._writes.enter(self._state, "load_checkpoint")
        self._state = self._dicts.load_checkpoint(
            self._state, path, with_model=with_model, extra=extra, rng=rng, safe_globals=safe_globals
        )
        if with_model:
            self._writes.written()  # the loaded weights are the facade's own write, not the user's
        self._hyperparams.load_from(self.param_groups, self._state.optimizer)

    def wait_params(self) -> None:
        """Complete the param gathers the last ``step`` left in flight (``overlap_allgather``).

        Never needed for correctness (a param's first use waits for its gather,
        :mod:`~zerofn.facade._prefetch`); call it to choose when the wait happens, or before
        reading a view of a param kept from before ``step``. Not a collective.
        """
        self._grads.wait_params()

    def close(self) -> None:
        """Finish pending param gathers and background saves, remove the facade's hooks from the model.

        A failed background save nobody has seen yet raises its
        :class:`~zerofn.checkpoint.CheckpointError` here (after the hooks are gone). Garbage
        collection does the rest of this but never waits for a save.
        """
        self._close(collected=False)

    def _close(self, collected: bool) -> None:
        """:meth:`close`; ``collected``: called by garbage collection, which leaves background saves alone."""
        self._parts.close(self._group, collected)

    def __del__(self) -> None:
        # An object that borrowed the class without being built (Lightning's and Fabric's optimizer
        # wrappers subclass what they wrap) has no parts: closing through it would unhook the real one.
        _build.close_when_collected(vars(self).get("_parts"), vars(self).get("_group"))

    def __repr__(self) -> str:
        layout = self._state.layout
        return (
            f"ZeroOptimizer(stage={self._stage}, optimizer={self._state.optimizer.name}, params={len(layout)}, "
            f"world_size={layout.world_size}, bucket_numel={self._bucket_numel}, overlap={self._overlap})"
        )
