"""``value_and_reduced_grads``: the loss and this rank's mean-gradient shards, reduced during the backward.

``reduce_grads(torch.func.grad(loss_fn)(params, ...), layout)`` cannot send a bucket
before ``torch.func.grad`` has returned every gradient, so on a model of a few large
tensors the whole reduction waits behind the whole backward. This transform runs the
same reduction from inside the backward, as the facade's hooks do: each bucket of the
layout's plan is packed (:func:`zerofn.buckets.pack_grads`) and launched
(:func:`zerofn.buckets.launch_reduce`) as soon as its last gradient is accumulated, and
the backward goes on computing while it is on the wire. The pieces, the buckets, the
wire dtype, the ``1/N`` factor and the per-bucket sums are ``reduce_grads``'s, so the
shards are the same bits; only *when* each bucket leaves changes.

Note (launch order): every rank must issue its collectives in the same order, whatever
the order its gradients arrive in. Buckets are launched in one static order, a pure
function of the layout: by the position of their first member in the layout, last
first (the order a backward through a model written in forward order completes them).
A bucket whose gradients are complete waits for the buckets before it in that order;
the buckets still waiting when the backward returns go out then, in the same order.

Note (params without a gradient): after the forward one walk over the autograd graph
finds the params the backward cannot reach (as DDP's ``find_unused_parameters``,
stopped once every param is found); their
slots stay zero (``torch.func.grad``'s zero gradient) and their buckets do not wait for
them. Which params a rank reaches may differ between ranks without changing the order of
the collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from zerofn import _agreement as agreement
from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn._comm import CommPolicy, Group, Pending
from zerofn._offsets import Bucket, plan_buckets
from zerofn._tree import FrozenDict
from zerofn._wire._bucket import launch_compressed, wire_plan
from zerofn._wire._checks import check_wire
from zerofn._wire._policy import CompressedWire
from zerofn.buckets import StagingPool, launch_reduce, pack_grads, wire_dtype
from zerofn.layout import ShardLayout
from zerofn.precision import PrecisionPolicy
from zerofn.stages._grad_shards import GradShards
from zerofn.stages._leaves import Leaves, reached
from zerofn.stages._pipeline import DEFAULT_BUCKET_NUMEL, InFlight, check_reduce_options, pipeline_pool
from zerofn.stages._reduce_grads import reduce_realisation, sum_over_replicas
from zerofn.state import DEFAULT_POLICY

__all__ = ["launch_order", "value_and_reduced_grads"]

_WHERE = "value_and_reduced_grads"

TWICE_MESSAGE = (
    "value_and_reduced_grads: param {name!r} received a second gradient in one backward after its bucket had "
    "been sent (a reentrant backward, e.g. torch.utils.checkpoint(use_reentrant=True), accumulates into a param "
    "more than once). Use torch.utils.checkpoint(..., use_reentrant=False), or torch.func.grad + reduce_grads."
)


TRACE_REASON = (
    "value_and_reduced_grads runs eagerly under torch.compile (its backward hooks launch c10d collectives): "
    "compile loss_fn (value_and_reduced_grads(torch.compile(loss_fn), ...)) and the rest of the step apart, "
    "or trace torch.func.grad + reduce_grads in one fullgraph step"
)


@functools.lru_cache(maxsize=256)
def launch_order(layout: ShardLayout, bucket_numel: int) -> tuple[int, ...]:
    """The order in which :func:`value_and_reduced_grads` launches the buckets (indices into
    ``plan_buckets(layout, bucket_numel)``).

    Last first by the layout position of each bucket's first member: for split params
    (contiguous runs of the layout) the reverse of the plan; whole-param buckets take their
    place by their earliest member. A pure function of the layout, so every rank issues
    its collectives in the same order. Cached per pair.
    """
    position = {name: i for i, name in enumerate(layout.names)}
    buckets = plan_buckets(layout, bucket_numel)
    first = [min(position[n] for n in b.names) for b in buckets]
    return tuple(sorted(range(len(buckets)), key=lambda b: -first[b]))


def _check_options(stage: Any, bucket_numel: Any, precision: Any, staging: Any, loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(f"{_WHERE}: loss_fn must be callable (params, *args) -> loss, got {type(loss_fn).__name__}")
    check_reduce_options(stage, bucket_numel, precision, staging, _WHERE)


def _check_wire(
    wire: CompressedWire | None,
    layout: ShardLayout,
    bucket_numel: int,
    residual: Sequence[torch.Tensor] | None,
    group: Group,
    replicate_group: Group,
    comm_dtype: torch.dtype | None,
) -> None:
    """What the compressed wire cannot serve, and a residual that does not fit: ``reduce_grads``'s checks."""
    if wire is None:
        if residual is not None:
            raise ValueError(f"{_WHERE}: residual= is for a compressed wire with error feedback (precision.wire)")
        return
    buckets = plan_buckets(layout, bucket_numel)
    rank = comm.group_rank(group)
    check_wire(
        wire, layout, buckets, residual, rank=rank, replicate_group=replicate_group, comm_dtype=comm_dtype, where=_WHERE
    )


def _check_params(params: Any, layout: ShardLayout, group: Group) -> None:
    """The params the gradients are taken at must be the layout's: names, shapes, dtypes, one device."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{_WHERE}: params must be a mapping name -> tensor (e.g. what gather_params returned), "
            f"got {type(params).__name__}"
        )
    if params.keys() == set(layout.names):
        unknown: list[str] = []
    else:
        unknown = [n for n in params if n not in layout]
    if unknown:
        raise KeyError(
            f"{_WHERE} on rank {comm.group_rank(group)}: params the layout does not know: {unknown}; "
            f"known params start with {list(layout.names[:5])}"
        )
    missing = [n for n in layout.names if n not in params] if len(params) != len(layout.names) else []
    if missing:
        raise KeyError(
            f"{_WHERE} on rank {comm.group_rank(group)}: params has no tensor for {missing[:5]}; give every param "
            "of the layout (the loss's gradient is taken with respect to all of them)"
        )
    devices = set()
    for spec in layout.params:
        p = params[spec.name]
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{_WHERE}: param {spec.name!r} is a {type(p).__name__}, not a torch.Tensor")
        if p.shape != spec.shape or p.dtype != spec.dtype:
            raise ValueError(
                f"{_WHERE} on rank {comm.group_rank(group)}: param {spec.name!r} has shape {tuple(p.shape)} "
                f"dtype {p.dtype}, but the layout has shape {spec.shape} dtype {spec.dtype}"
            )
        devices.add(p.device)
    if len(devices) > 1:
        raise ValueError(f"{_WHERE}: params live on different devices ({sorted(map(str, devices))}); use one device")


def _split_loss(result: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """``loss_fn``'s result as (loss, aux), checked as ``torch.func.grad`` checks it."""
    if has_aux:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"{_WHERE}(has_aux=True): loss_fn must return a (loss, aux) tuple, got {type(result)}")
        loss, aux = result
    else:
        loss, aux = result, None
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{_WHERE}: loss_fn must return a scalar Tensor, got {type(loss).__name__}")
    if loss.dim() != 0 or not loss.is_floating_point():
        raise ValueError(
            f"{_WHERE}: loss_fn must return a 0-d floating-point Tensor (the loss), got shape "
            f"{tuple(loss.shape)} dtype {loss.dtype}"
        )
    return loss, aux


class _Reduction:
    """One call's reduction: gradients arriving, buckets launched in :func:`launch_order`, shards out.

    ``arrived`` runs in autograd's post-accumulate-grad hooks; ``finish`` after the backward.
    """

    def __init__(
        self,
        layout: ShardLayout,
        bucket_numel: int,
        leaves: Mapping[str, torch.Tensor],
        *,
        group: Group,
        how: str,
        comm_dtype: torch.dtype | None,
        replicate_group: Group,
        pool: StagingPool,
        device: torch.device,
        reachable: set[str],
        agreed: agreement.Agreement,
        wire: CompressedWire | None = None,
        residual: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.layout, self.leaves, self.group, self.how = layout, leaves, group, how
        self.agreed = agreed  # settled before the first bucket is sent
        # The compressed wire's residual, per bucket: a launched bucket's entry becomes its next one.
        self.wire, self.residual = wire, list(residual) if residual is not None else None
        self.comm_dtype, self.replicate_group, self.pool, self.device = comm_dtype, replicate_group, pool, device
        self.rank = comm.group_rank(group)
        self.replicas = comm.group_size(replicate_group) if replicate_group is not None else 1
        self.buckets = plan_buckets(layout, bucket_numel)
        self.order = launch_order(layout, bucket_numel)
        self.bucket_of = {name: b for b, bucket in enumerate(self.buckets) for name in bucket.names}
        self.missing = [len(b.names) for b in self.buckets]  # members whose gradient has not arrived
        self.arrived_names: set[str] = set()
        self.sent = [False] * len(self.buckets)
        self.next = 0  # position in self.order of the next bucket to launch
        # During the backward a hook that would launch one more bucket than the pipeline holds first
        # settles the oldest; finished ones are settled as they are found (their settle runs no
        # collective: the replicas' sums wait for finish()).
        self.in_flight: InFlight[tuple[Bucket, torch.Tensor]] = InFlight(self._harvest, pool)
        self.replica_rows: list[tuple[Bucket, torch.Tensor]] = []
        # Every param gets a gradient (zero where the loss does not reach it), in its own dtype.
        self.shards = GradShards(layout, self.rank, {spec.name: spec.dtype for spec in layout.params}, device)
        for name in self.bucket_of.keys() - reachable:  # no gradient will come: its slot stays zero
            self.arrived_names.add(name)
            self.missing[self.bucket_of[name]] -= 1

    def launch_ready(self) -> None:
        """Launch, in :func:`launch_order`, every bucket whose turn it is and whose members all arrived."""
        while self.next < len(self.order) and self.missing[self.order[self.next]] == 0:
            self._launch(self.order[self.next])

    def arrived(self, name: str) -> None:
        """A gradient was accumulated into ``leaves[name].grad``: launch what is ready, in order."""
        b = self.bucket_of.get(name)
        if b is None:  # an empty param: in no bucket
            return
        if name in self.arrived_names:
            if self.sent[b]:
                raise RuntimeError(TWICE_MESSAGE.format(name=name))
            return  # accumulated into the same .grad (or not expected), not sent yet: it goes out with it
        self.arrived_names.add(name)
        self.missing[b] -= 1
        self.launch_ready()

    def _launch(self, b: int) -> None:
        """Pack bucket ``b`` (absent members as zeros), free its gradients, launch its reduction."""
        self.agreed.settle()  # every rank agrees before any bucket is sent (else all raise)
        bucket = self.buckets[b]
        self.sent[b] = True
        self.next += 1
        grads = {n: g for n in bucket.names if (g := self.leaves[n].grad) is not None}
        n, s = self.layout.world_size, bucket.shard_numel
        borrowed = self.pool.take(n * s, self.layout[bucket.names[0]].dtype, self.device)
        rows = pack_grads(grads, self.layout, bucket, replicas=self.replicas, out=borrowed[: n * s].view(n, s))
        for name in grads:
            self.leaves[name].grad = None  # packed: its memory goes back while the backward runs on
        if self.wire is not None:
            mine = self.residual[b] if self.residual is not None else None
            plan = wire_plan(self.layout, bucket, self.wire)
            pending, mine = launch_compressed(rows, plan, self.wire.format, mine, self.group)
            if self.residual is not None:
                self.residual[b] = mine  # type: ignore[assignment]
        else:
            # Summed straight into the shards' buffer (hybrid: the row waits apart for the replicas' sum).
            wire = wire_dtype(self.layout, bucket, self.comm_dtype)
            into = self.shards.target(bucket, wire) if self.replicate_group is None else None
            pending = launch_reduce(
                rows, self.layout, bucket, self.group, self.how, comm_dtype=self.comm_dtype, async_op=True,
                staging=self.pool, out=into,
            )  # fmt: skip
        self.in_flight.push((bucket, borrowed), pending)
        self.in_flight.settle_finished()

    def _harvest(self, item: tuple[Bucket, torch.Tensor], pending: Pending) -> None:
        """One reduced bucket into the shards (or kept for the replicas' sum)."""
        bucket, borrowed = item
        row = pending.wait()
        if self.replicate_group is not None:
            # The replicas' (blocking) sum waits for the end of the backward, in launch
            # order on every rank: here it could interleave with another rank's
            # shard-group launches and deadlock. Keep this rank's row only.
            kept = row.clone() if row._base is not None else row
            self.pool.give_unless_aliased(borrowed, [kept])
            self.replica_rows.append((bucket, kept))
            return
        self._settle(bucket, row, borrowed)

    def _settle(self, bucket: Bucket, row: torch.Tensor, borrowed: torch.Tensor | None) -> None:
        kept = self.shards.put(bucket, row, self.layout[bucket.names[0]].dtype)
        if borrowed is not None:
            self.pool.give_unless_aliased(borrowed, kept)

    def finish(self) -> FrozenDict[torch.Tensor]:
        """After the backward: launch the buckets still waiting (in order), wait, add the replicas' sums."""
        self.agreed.settle()  # also when no bucket is left to send
        while self.next < len(self.order):
            self._launch(self.order[self.next])
        self.in_flight.settle()
        for bucket, row in self.replica_rows:
            self._settle(bucket, sum_over_replicas(row, self.replicate_group), None)
        return self.shards.result()


def value_and_reduced_grads(
    loss_fn: Callable[..., Any],
    layout: ShardLayout,
    group: Group = None,
    stage: int = 2,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    *,
    has_aux: bool = False,
    comm_policy: CommPolicy | None = None,
    comm_dtype: torch.dtype | None = None,
    precision: PrecisionPolicy | None = None,
    replicate_group: Group = None,
    staging: StagingPool | None = None,
    residual: Sequence[torch.Tensor] | None = None,
) -> Callable[..., tuple[Any, Any]]:
    r"""Transform ``loss_fn`` into a function returning its value and this rank's mean-gradient
    shards, each bucket reduced as soon as the backward has produced its gradients.

    ``value_and_reduced_grads(loss_fn, layout, group, ...)(params, *args)`` gives
    ``(loss, shards)`` with ``shards`` bitwise equal to

    ``reduce_grads(torch.func.grad(loss_fn)(params, *args), layout, group, ...)``

    with the same options (the same buckets, wire dtype, ``1/N`` factor and sums: the
    bucket pieces of :mod:`zerofn.buckets`), and ``loss`` the value of ``loss_fn``, as
    ``jax.value_and_grad`` orders them (``torch.func.grad_and_value`` returns the other
    way round). The difference is when the reductions run: ``reduce_grads`` starts after
    the last gradient exists; here a post-accumulate-grad hook launches each bucket's
    reduction (asynchronously, at most two in flight) once all its
    members' gradients are accumulated, so the communication overlaps the rest of the
    backward, and each packed gradient is freed at once (peak memory: the params'
    gradients of the buckets not yet sent, not all of them).

    Pure at its boundary: the gradients are taken with respect to leaf tensors of its own
    (``p.detach().requires_grad_()``, sharing the params' storage, never written; made
    once and kept with their hooks while the caller passes the same tensors), so the
    caller's tensors get no ``.grad``, no hook and no new version, and other tensors that
    ``loss_fn`` reads keep their ``.grad`` too (``backward(inputs=...)``). A param the
    loss does not depend on gets a zero gradient, as ``torch.func.grad`` gives it: zeros in
    its bucket slot, a zero shard in the result. The buckets are launched in one static
    order on every rank, a pure function of the layout: by the layout position of their
    first member, last first (the order a backward through a model written in forward
    order completes them); one that completes before its turn waits for it, and those
    left when the backward returns go out then.

    Args:
      loss_fn: ``(params, *args, **kwargs) -> loss``, ``loss`` a 0-d floating-point
        tensor; with ``has_aux``, ``-> (loss, aux)``. ``params`` is a ``dict`` name ->
        leaf tensor in the caller's order (e.g. for ``torch.func.functional_call``).
        Every rank must run the same computation (the same graph), as with DDP.
      layout: ``state.layout``.
      group: the sharding process group (``None``: default).
      stage: 1 reduces with an all-reduce (as ZeRO-1); 2 with the group's reduce
        realisation (``comm_policy``). Both return only this rank's shards.
      bucket_numel: padded elements per bucket; a larger param travels alone.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the result is then
        ``((loss, aux), shards)`` (``aux``'s tensors detached).
      comm_policy: how collectives are realised; default :class:`~zerofn.CommPolicy`.
      comm_dtype: dtype on the wire; default ``precision.comm_dtype``, else the params'
        working dtype (as ``reduce_grads``).
      precision: the state's :class:`~zerofn.PrecisionPolicy` (``state.precision``),
        for the wire dtype; ``None``: the default.
      replicate_group: for a hybrid layout, the group of ranks holding the same shards
        (``reduce_grads``'s); their rows are summed after the backward, in launch order.
      staging: a :class:`~zerofn.buckets.StagingPool` the ``(N, S)`` rows are taken from
        and given back to between calls (``None``: one per call). The shards never alias it.
      residual: with a compressed wire that keeps error feedback (``precision.wire``),
        ``state.residual`` (``reduce_grads``'s): each call adds it to the chunks this rank
        sends and returns the next one. Not written. Make the transform again each step
        with the new state's residual (no collective, nothing traced). ``None`` otherwise.

    Returns:
      A function ``(params, *args, **kwargs) -> (loss, shards)``:

      * ``params``: name -> full tensor for every param of ``layout``, in its shape and
        dtype (the working params, e.g. from :func:`~zerofn.gather_params`), on one
        device. Not changed.
      * ``loss``: ``loss_fn``'s 0-d value, detached (with ``has_aux``: ``(loss, aux)``).
      * ``shards``: a :class:`~zerofn.FrozenDict` name -> ``(shard_numel,)`` mean-gradient
        shard in the param's dtype (cast back from the wire), for every split param, in
        layout order; padding elements are zero. A whole param (placement ``"whole"``):
        its full-shape mean gradient on its owner rank, nothing on the others. What
        :func:`~zerofn.step_shards` takes, and of ``reduce_grads``'s type: a
        :class:`~zerofn.flat.FlatDict` on this rank's flat layout (each bucket's row
        written into its range of one buffer per group) when it holds a split param.
      * with ``residual=``: ``(loss, (shards, next_residual))``, ``reduce_grads``'s pair:
        give ``next_residual`` to ``step_shards(..., residual=)``.

    Collectives, per call: one tiny ``all_gather`` launched after the forward (the
    rank-agreement check of ``reduce_grads``: layout, settings and this rank's verdict on
    its input, see :func:`~zerofn.check_ranks_agree`), in flight while the backward runs
    and settled before the first bucket is sent, then per bucket
    one ``reduce_scatter`` (stage 2 on NCCL, or ``CommPolicy.byte_optimal()``), one
    ``all_to_all_single`` (stage 2 on gloo) or one ``all_reduce`` (stage 1) of ``N*S``
    elements, asynchronous, and
    with replicas one ``all_reduce`` of ``S`` elements per bucket over
    ``replicate_group`` at the end. With a compressed wire, per bucket one
    ``all_to_all_single`` of codes instead (``reduce_grads``'s, the same bits). The
    options are checked when the transform is made; the params, the world, the wire and
    its residual, and ``loss_fn``'s result (or the exception it raised) before the
    agreement all-gather, so a bad input on one rank makes every rank raise before any
    bucket is sent.

    Under ``torch.compile`` the returned function runs eagerly (``torch.compiler.disable``:
    a graph break, refused by ``fullgraph=True``); a compiled ``loss_fn`` works, its
    backward one compiled node whose gradients all arrive when it ends. To trace the
    reduction into a graph, use ``torch.func.grad`` + ``reduce_grads``.

    Examples:
      >>> import torch, zerofn as zf
      >>> import torch.nn.functional as F
      >>> params = {"w": torch.ones(3, 2)}
      >>> state = zf.shard_params(params, zf.optim.sgd(lr=0.1))  # doctest: +SKIP
      >>> def loss_fn(p, x, y):
      ...     return F.mse_loss(x @ p["w"], y)
      >>> value_and_grads = zf.value_and_reduced_grads(loss_fn, state.layout)  # doctest: +SKIP
      >>> loss, gshards = value_and_grads(params, torch.ones(4, 3), torch.zeros(4, 2))  # doctest: +SKIP
      >>> state, info = zf.step_shards(state, gshards)  # doctest: +SKIP
    """
    _check_options(stage, bucket_numel, precision, staging, loss_fn)
    precision = precision or DEFAULT_POLICY
    wire = comm_dtype if comm_dtype is not None else precision.comm_dtype
    compressed = precision.wire
    kept = Leaves(_WHERE)

    def value_and_grads(params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        comm.group_rank(group)  # a rank outside the group cannot take part: raise here, alone
        failure: Exception | None = None
        loss: torch.Tensor | None = None
        aux: Any = None
        leaves: dict[str, torch.Tensor] | None = None
        try:
            checks.validate_world(layout, group, _WHERE)
            checks.validate_replicas(replicate_group, _WHERE)
            _check_wire(compressed, layout, bucket_numel, residual, group, replicate_group, wire)
            _check_params(params, layout, group)
            leaves = kept.take(params)
            with torch.enable_grad():
                result = loss_fn(leaves, *args, **kwargs)
            loss, aux = _split_loss(result, has_aux)
        except Exception as e:  # it travels in the agreement all-gather: every rank raises
            failure = e
        try:
            return _reduced(leaves or {}, loss, aux, failure, params)
        finally:
            if leaves is not None:  # this call took them (not refused as a reentrant one)
                kept.release(leaves)

    def _reduced(leaves: dict[str, torch.Tensor], loss: Any, aux: Any, failure: Exception | None, params: Any) -> Any:
        tensors = params.values() if isinstance(params, Mapping) else ()
        device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))
        # Launched here and settled before the first bucket leaves: the backward runs
        # while the table travels. A rank whose input failed settles (and raises) now.
        agreed = agreement.launch_agreement(
            layout,
            group,
            _WHERE,
            settings={
                "stage": stage,
                "bucket_numel": bucket_numel,
                "comm_dtype": agreement.dtype_code(wire),
                "replicas": comm.group_size(replicate_group) if replicate_group is not None else 1,
                "wire": compressed.code if compressed is not None else 0,
            },
            device=device,
            failure=failure,
        )
        if failure is not None:
            agreed.settle()  # raises on every rank: this one's input or forward failed
        assert loss is not None
        pool = staging if staging is not None else pipeline_pool()
        reduction = _Reduction(
            layout,
            bucket_numel,
            leaves,
            group=group,
            how=reduce_realisation(stage, group, comm_policy),
            comm_dtype=wire,
            replicate_group=replicate_group,
            pool=pool,
            device=device,
            reachable=reached(loss, leaves) if loss.requires_grad else set(),
            wire=compressed,
            residual=residual,
            agreed=agreed,
        )
        kept.listen(reduction.arrived)
        if loss.requires_grad:  # else the loss does not depend on the params: every gradient is zero
            torch.autograd.backward(loss, inputs=list(leaves.values()))
        shards = reduction.finish()
        if reduction.residual is not None:  # the compressed wire's error feedback: reduce_grads' pair
            shards = (shards, tuple(reduction.residual))
        value = loss.detach()
        if has_aux:
            aux = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, aux)
            return (value, aux), shards
        return value, shards

    # Its backward hooks launch c10d collectives and wait on them: under torch.compile it
    # runs eagerly, a graph break (fullgraph=True refuses it with this reason).
    return torch.compiler.disable(value_and_grads, reason=TRACE_REASON)
