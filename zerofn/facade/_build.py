"""``ZeroOptimizer``'s construction: options resolved, the first state cut, the ranks agreed and synced.

:func:`build` turns the constructor's arguments into what the facade's collaborators are
made of (:class:`Built`): the named params, the process groups, the precision policy, the
first :class:`~zerofn.state.ZeroState` (masters from rank 0's params after ``init_sync``).
Every check that can fail runs before the first collective; then one small all-gather per
group confirms every rank built the same optimizer, and ``init_sync`` broadcasts.

It also holds the construction's wiring helpers: :class:`HostScale` (the loss scale as a
Python float for the gradient hooks) and the weak callbacks through which the reducer
and the buffer sync read the facade without keeping it alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zerofn import _agreement as agreement
from zerofn import _comm as comm
from zerofn import _sync, optim
from zerofn._comm import CommPolicy
from zerofn._offsets import plan_buckets
from zerofn.checkpoint import _async
from zerofn.facade import _buffers, _compiled, _entry, _guards, _options, _wire
from zerofn.facade._grads import GradOps
from zerofn.facade._hyperparams import LiveHyperparams
from zerofn.facade._prefetch import ParamPrefetcher
from zerofn.facade._reducer import GradReducer
from zerofn.facade._state_dicts import StateDicts
from zerofn.facade._step import Stepper
from zerofn.facade._writes import ParamWrites
from zerofn.precision import PrecisionPolicy
from zerofn.stages import shard_params
from zerofn.state import ZeroState

__all__ = [
    "Built",
    "HostScale",
    "Options",
    "Parts",
    "assemble",
    "build",
    "close_when_collected",
    "weak_call",
    "world_size",
]


@dataclasses.dataclass(frozen=True)
class Options:
    """``ZeroOptimizer``'s keywords other than the optimizer and the precision ones, as given.

    Their meanings: :class:`~zerofn.facade.optimizer.ZeroOptimizer`'s docstring.
    """

    clip_grad_norm: float
    norm_type: float
    verbose: bool
    reduce_bucket_size: int
    overlap_communication: bool
    overlap_allgather: bool
    partition_grad: bool
    dp_process_group: dist.ProcessGroup | None
    sub_dp_size: int
    replicate_group: dist.ProcessGroup | None
    comm_policy: CommPolicy | None
    module: torch.nn.Module | None
    precision: PrecisionPolicy | None
    init_sync: bool
    broadcast_buffers: bool
    entry_timeout: float | None
    compile: bool | str

    @property
    def stage(self) -> int:
        return 2 if self.partition_grad else 1


class Built(NamedTuple):
    """What the constructor resolved (see :func:`build`)."""

    params: dict[str, torch.Tensor]  # name -> the model's param, layout order
    group_names: list[list[str]]  # per param group, its params' names
    torch_groups: list[dict[str, Any]]  # the facade's param_groups
    wrapped: list[torch.optim.Optimizer]  # the wrapped torch optimizers (none for a functional one)
    defaults: dict[str, Any]  # torch.optim's ``defaults``
    group: comm.Group  # the shard group
    replicate: comm.Group  # the replicas of a hybrid layout, or None
    entry: _entry.EntryGuard  # the collective entry points' wait
    state: ZeroState  # the first state (rank 0's params with init_sync)
    backend: str | None  # compile='s backend, or None (eager)


def build(
    optimizer: Any, functional_optimizer: optim.Optimizer | None, keywords: _options.PrecisionKeywords, opts: Options
) -> Built:
    """Resolve the params, the policy and the groups; cut the first state; agree; sync.

    Casts the params to the policy's working dtype (``forced_dtype``) once every argument is
    validated. Collectives: the hybrid groups' creation (with ``sub_dp_size``), one small
    all-gather per group (:func:`~zerofn._agreement.check_ranks_agree`), and with
    ``init_sync`` one broadcast per dtype over the data-parallel world.
    """
    _options.check_settings(opts.reduce_bucket_size, opts.norm_type, opts.clip_grad_norm)
    module, overlap_allgather, init_sync, broadcast_buffers = (
        opts.module,
        opts.overlap_allgather,
        opts.init_sync,
        opts.broadcast_buffers,
    )
    _guards.check_module(module)  # a DDP-wrapped model would have its gradients reduced twice
    named_groups, fopt, torch_groups = _options.resolve_params(optimizer, functional_optimizer, module)
    backend = _compiled.resolve_backend(opts.compile)
    if backend is not None:
        _compiled.check_compilable(fopt, overlap_allgather=overlap_allgather)
    params = {n: p for g in named_groups for n, p in g}
    if overlap_allgather:
        _options.check_gather_module(params, module)
    policy = _options.precision_policy(params, opts.precision, keywords)
    if policy.wire is not None:
        _wire.check_facade_wire_options(
            stage=opts.stage, compile=opts.compile, sub_dp_size=opts.sub_dp_size, replicate_group=opts.replicate_group
        )
    _options.cast_params(params, policy)  # validated: now cast, before anything reads them
    group, replicate = _options.hybrid_groups(opts.dp_process_group, opts.sub_dp_size, opts.replicate_group)
    entry = _entry.EntryGuard((group,) if replicate is None else (group, replicate), opts.entry_timeout)
    defaults = optimizer.defaults if isinstance(optimizer, torch.optim.Optimizer) else fopt.defaults
    wrapped = list(optimizer) if _options.is_optimizer_list(optimizer) else []
    if isinstance(optimizer, torch.optim.Optimizer):
        wrapped = [optimizer]
    # The masters are cut here and made rank 0's below, once the ranks agree on the layout.
    # A compressed wire's residual is per bucket of the reducer's plan: the state's plan is the reducer's.
    wired = {"bucket_numel": opts.reduce_bucket_size} if policy.wire is not None else {}
    state = shard_params(params, fopt, group, precision=policy, check=False, **wired)
    if policy.wire is not None:
        _wire.check_facade_wire(state, opts.reduce_bucket_size, group)  # whole placements: before any collective
    module_states = _buffers.module_states(module, params, buffers=broadcast_buffers)
    settings = {
        "stage": opts.stage,
        "bucket_numel": opts.reduce_bucket_size,
        "overlap": int(opts.overlap_communication),
    }
    settings |= {"init_sync": int(init_sync), "broadcast_buffers": int(broadcast_buffers)}
    _agree(state, (group,) if replicate is None else (group, replicate), settings, policy, fopt, module_states)
    if init_sync and world_size(group, replicate) > 1:  # DDP's construction: every rank starts from rank 0's
        with torch.no_grad():
            _sync.broadcast_(list(module_states.values()), group, replicate)
        state = _guards.adopt_params(state, params, state.layout.names)
    group_names = [[n for n, _ in g] for g in named_groups]
    return Built(params, group_names, torch_groups, wrapped, dict(defaults), group, replicate, entry, state, backend)


class Parts(NamedTuple):
    """The facade's collaborators, made by :func:`assemble`; the facade holds each as an attribute."""

    reducer: GradReducer  # gradient hooks: buckets reduced into p.grad (stage 1) or shards (stage 2)
    guard: _guards.ParamGuard  # writes made to the params outside the facade
    prefetch: ParamPrefetcher | None  # overlap_allgather's gathers for the next forward
    buffer_sync: _buffers.BufferSync | None  # rank 0's buffers before each forward (broadcast_buffers)
    hyperparams: LiveHyperparams  # param_groups <-> the state's functional optimizer
    grads: GradOps  # backward, zero_grad, no_sync, the global norm, clipping
    writes: ParamWrites  # the masters follow the params' writes; check_params
    steps: Stepper  # step_shards on the shards, the params written back
    dicts: StateDicts  # state dicts and checkpoints

    def close(self, group: comm.Group, collected: bool) -> None:
        """Pending gathers written, background saves waited for (unless ``collected``), hooks removed.

        Collectives: none (a background save's own commit aside).
        """
        try:
            self.grads.wait_params()
            if not collected:
                _async.wait_in_flight(group)
        finally:
            self.reducer.close()
            if self.prefetch is not None:
                self.prefetch.close()
            if self.buffer_sync is not None:
                self.buffer_sync.close()


def assemble(
    built: Built,
    opts: Options,
    loss_scale: Callable[[], float],
    residual: Callable[[], tuple[torch.Tensor, ...]] = tuple,
) -> Parts:
    """The collaborators over what :func:`build` resolved, each given what it needs.

    ``loss_scale`` returns the facade's current loss scale (the reducer reads it per
    bucket); ``residual`` its state's residual (a compressed wire's, read at the first
    bucket after each step). Registers the gradient hooks on the params and, with ``module``, the forward
    hooks of the prefetch and the buffer sync. Collectives: none (monitor groups aside,
    made by :class:`~zerofn.facade._entry.EntryGuard` in :func:`build`).
    """
    params, group, replicate, state = built.params, built.group, built.replicate, built.state
    stage, bucket_numel, module, norm_type = opts.stage, opts.reduce_bucket_size, opts.module, float(opts.norm_type)
    comm_policy = opts.comm_policy or CommPolicy()
    max_norm = opts.clip_grad_norm if opts.clip_grad_norm > 0 else None
    compiled = None
    if built.backend is not None:  # compile='s step after backward: step_shards and the gather in one graph
        fingerprint = state.layout.fingerprint
        compiled = _compiled.CompiledStep(
            built.backend, group, max_norm, norm_type, bucket_numel, comm_policy, fingerprint
        )
    reducer = GradReducer(
        params,
        state.layout,
        state.precision,
        group=group,
        replicate=replicate,
        stage=stage,
        bucket_numel=bucket_numel,
        overlap=opts.overlap_communication,
        comm_policy=comm_policy,
        loss_scale=loss_scale,
        residual=residual,
    )
    # Params are the user's: writes made to them outside the facade are noticed at step.
    guard = _guards.ParamGuard(params, module)
    gather_how = comm_policy.resolve(group)[1]
    prefetch = None
    if opts.overlap_allgather:  # module owns every param (_options.check_gather_module)
        buckets = plan_buckets(state.layout, bucket_numel)
        staging = reducer.staging  # idle between step and the next backward: the gathers borrow it
        prefetch = ParamPrefetcher(
            params, state.layout, buckets, group=group, how=gather_how, module=module, guard=guard, staging=staging
        )
    buffer_sync = None
    if module is not None and opts.broadcast_buffers and world_size(group, replicate) > 1:
        require_sync = weak_call(reducer, lambda r: r.require_sync, False)
        buffer_sync = _buffers.BufferSync(module, group, replicate, require_sync)
    hyperparams = LiveHyperparams(built.wrapped, built.group_names)
    grads = GradOps(params, reducer, guard, group, gather_how=gather_how, norm_type=norm_type, prefetch=prefetch)
    writes = ParamWrites(params, group, guard, built.entry, grads.wait_params)
    steps = Stepper(
        params,
        group,
        reducer,
        guard,
        hyperparams,
        max_norm=max_norm,
        norm_type=norm_type,
        bucket_numel=bucket_numel,
        comm_policy=comm_policy,
        compiled=compiled,
        prefetch=prefetch,
        verbose=opts.verbose,
    )
    dicts = StateDicts(
        params,
        group,
        replicate,
        bucket_numel=bucket_numel,
        group_names=built.group_names,
        module=module,
        reducer=reducer,
        hyperparams=hyperparams,
    )
    return Parts(reducer, guard, prefetch, buffer_sync, hyperparams, grads, writes, steps, dicts)


def _agree(
    state: ZeroState,
    groups: tuple[comm.Group, ...],
    settings: dict[str, Any],
    policy: PrecisionPolicy,
    fopt: optim.Optimizer,
    module_states: Mapping[str, torch.Tensor],
) -> None:
    """Every rank of every group built the same optimizer, or every rank raises, before any
    broadcast. Collectives: one small all-gather per group (``check_ranks_agree``)."""
    layout = state.layout
    settings = dict(settings, precision=agreement.text_hash(repr(policy)))
    # Equal placements do not mean equal updates ([Adafactor, AdamW] vs [Muon, AdamW]).
    settings["optimizer"] = agreement.text_hash(_options.update_rules(fopt, layout.names))
    # What the init_sync broadcasts move must be alike everywhere (a mismatch inside them would hang).
    settings["module"] = _sync.structure_hash(module_states)
    for g in groups:
        agreement.check_ranks_agree(layout, g, "ZeroOptimizer", settings=settings, device=state.work_device)


def world_size(group: comm.Group, replicate: comm.Group) -> int:
    """Ranks of the whole data-parallel world (shard group times replicas)."""
    replicas = comm.group_size(replicate) if replicate is not None else 1
    return comm.group_size(group) * replicas


class HostScale:
    """A state's loss scale as a Python float, read from its 0-d tensor once per new tensor.

    The gradient hooks ask for it per bucket; a step makes at most one new scale tensor, so
    the device is read at most once per step (never under ``NoLossScaling``, whose tensor
    does not change).
    """

    def __init__(self) -> None:
        self._seen: tuple[torch.Tensor, float] | None = None

    def read(self, scale: torch.Tensor) -> float:
        seen = self._seen
        if seen is None or seen[0] is not scale:
            seen = self._seen = (scale, float(scale))
        return seen[1]


def weak_call(obj: Any, read: Callable[[Any], Any], default: Any) -> Callable[[], Any]:
    """``read(obj)`` while ``obj`` lives, else ``default``, without a reference to it (hooks live on the model)."""
    ref = weakref.ref(obj)

    def call() -> Any:
        me = ref()
        return default if me is None else read(me)

    return call


def close_when_collected(parts: Parts | None, group: comm.Group) -> None:
    """What garbage collection of a ZeroOptimizer does: :meth:`Parts.close`, leaving background saves alone.

    Nothing for an optimizer that was never built (``parts`` None), or at interpreter
    teardown: the model's tensors may be half torn down already, and writing pending gathers
    into them aborts the process (a torch internal assert in ``THPVariable_clear``); nobody
    reads the params any more.
    """
    if parts is None or sys.is_finalizing():
        return
    with contextlib.suppress(Exception):
        parts.close(group, True)
