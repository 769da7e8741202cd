"""``reduce_grads``: mean gradients over the group, this rank's shards kept.

With the choice of reduce collective per stage and the replicas' sum of a hybrid layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zerofn import _agreement as agreement
from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn._comm import CommPolicy, Group, Pending
from zerofn._offsets import Bucket, plan_buckets
from zerofn._tree import FrozenDict
from zerofn._wire._bucket import launch_compressed, wire_plan
from zerofn._wire._checks import check_wire
from zerofn.buckets import StagingPool, launch_reduce, pack_grads, wire_dtype
from zerofn.layout import ShardLayout
from zerofn.precision import PrecisionPolicy
from zerofn.stages._grad_shards import GradShards
from zerofn.stages._pipeline import DEFAULT_BUCKET_NUMEL, InFlight, check_reduce_options, pipeline_pool
from zerofn.state import DEFAULT_POLICY


def sum_over_replicas(row: torch.Tensor, replicate_group: Group) -> torch.Tensor:
    """Finish a hybrid reduction: add the replicas' copies of this rank's reduced row.

    Ranks with the same position in their shard groups hold the same shards; summing
    their rows (each already scaled by ``1/(N * R)``) gives the mean over all ``N * R``
    ranks. A no-op when ``replicate_group`` is ``None``.

    Collectives: one ``all_reduce`` of the row over ``replicate_group``.
    """
    if replicate_group is None:
        return row
    return comm.sum_across(row.contiguous(), replicate_group)


def reduce_grads(
    grads: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    group: Group = None,
    stage: int = 2,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    *,
    comm_policy: CommPolicy | None = None,
    comm_dtype: torch.dtype | None = None,
    precision: PrecisionPolicy | None = None,
    replicate_group: Group = None,
    staging: StagingPool | None = None,
    residual: Sequence[torch.Tensor] | None = None,
) -> FrozenDict[torch.Tensor] | tuple[FrozenDict[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Average full local gradients over the group and keep this rank's shards.

    For each bucket of the layout's static plan (:meth:`ShardLayout.buckets`) the
    gradients are copied into a rank-major ``(N, S)`` buffer, multiplied by ``1/N``, cast
    to the wire dtype, summed over the group and cast back to the gradients' dtype; this
    rank's row is cut into per-param shards. Params without a gradient fill their slot
    with zeros (so every param's bits are independent of the others'), and a bucket with
    no gradient at all is not sent.

    Args:
      grads: name -> full local gradient, or ``None`` / missing for params that got no
        gradient this step. Every rank must have gradients for the same names, in the
        same dtypes (checked). A gradient has its param's shape and either the param's
        (working) dtype or the precision policy's accumulation dtype for it (float32 for
        float16/bfloat16 params by default: grads summed over micro-batches); the params
        of one bucket must agree.
      layout: ``state.layout``.
      group: the sharding process group (``None``: default).
      stage: 1 reduces with an all-reduce (as ZeRO-1); 2 with the group's reduce
        realisation (``comm_policy``). Both return only this rank's shards.
      bucket_numel: padded elements per bucket; a larger param travels alone.
      comm_policy: how collectives are realised; default :class:`CommPolicy` (per backend).
      comm_dtype: dtype on the wire; default ``precision.comm_dtype``, else the params'
        working dtype (the wire carries working precision, also for
        float32-accumulated gradients, unless told otherwise).
      precision: the state's :class:`~zerofn.precision.PrecisionPolicy`
        (``state.precision``), for the wire and accumulation dtypes; ``None``: the default.
      replicate_group: for a hybrid layout, the group of ranks that hold the same shards
        as this one (one per shard group); gradients are then averaged over all
        ``N * R`` ranks. ``None`` (default): no replicas. Note the asymmetry with
        ``group``: here ``None`` does not mean the default group.
      staging: explicit buffer reuse: a :class:`~zerofn.buckets.StagingPool` the
        ``(N, S)`` rows are taken from and given back to (the same pool every step saves
        faulting in fresh pages for Ψ elements per call); ``None``: fresh rows. The
        returned shards never alias its buffers.
      residual: with a compressed wire that keeps error feedback (``precision.wire``),
        ``state.residual``: added to the chunks this rank sends before they are
        quantized. Not written. Must be ``None`` otherwise.

    Returns:
      name -> ``(shard_numel,)`` mean-gradient shard in the dtype the gradient came in
      (cast back from the wire), for the split params that had gradients (in layout
      order); padding elements are zero. For a whole param (placement ``"whole"``): the
      full-shape mean gradient on its owner rank, nothing on the others.
      A :class:`~zerofn.flat.FlatDict` on this rank's flat layout (each split bucket's
      row written into its range of one buffer per group, what :func:`step_shards`
      applies without packing; the ranges of params without a gradient are zero), or a
      :class:`~zerofn.FrozenDict` of per-name shards when no split param had a gradient
      or one group's gradients came in two dtypes.

    With a compressed wire (``precision.wire``, a :class:`~zerofn.CompressedWire`) each
    bucket goes through one ``all_to_all_single`` of bytes instead: this rank's chunks for
    the other ranks as block-scaled codes (the wire's matrices) and float32 (the rest),
    dequantized and summed in float32 in rank order by each shard's owner
    (:mod:`zerofn._wire._bucket`). With error feedback the result is ``(shards,
    next_residual)``: give ``next_residual`` to ``step_shards(..., residual=)``, which keeps
    it unless the step is skipped.

    Collectives: one tiny ``all_gather`` (rank agreement and input verdict, see
    ``check_ranks_agree``), then per bucket one ``reduce_scatter`` (stage 2, NCCL), one
    ``all_to_all_single`` (stage 2, gloo: the owner adds the ``N`` rows in rank order) or
    one ``all_reduce`` (stage 1) of ``N*S`` elements, and with replicas one ``all_reduce``
    of ``S`` elements over ``replicate_group``.
    """
    comm.group_rank(group)  # a rank outside the group cannot take part: raise here, alone
    # Local validation first; its verdict travels in the agreement all-gather, so a bad
    # input on one rank makes every rank raise instead of leaving the others waiting.
    try:
        check_reduce_options(stage, bucket_numel, precision, staging, "reduce_grads")
        precision = precision or DEFAULT_POLICY
        comm_dtype = comm_dtype if comm_dtype is not None else precision.comm_dtype
        checks.validate_world(layout, group, "reduce_grads")
        checks.validate_replicas(replicate_group, "reduce_grads")
        present = checks.validate_grads(
            grads, layout, group, "reduce_grads", accum_dtype_for=precision.grad_accum_dtype_for
        )
        buckets = plan_buckets(layout, bucket_numel)
        grad_dtypes = {n: grads[n].dtype for n in present}  # type: ignore[union-attr]
        checks.validate_bucket_dtypes(buckets, grad_dtypes, group, "reduce_grads")
        wire = precision.wire
        if wire is not None:
            check_wire(
                wire,
                layout,
                buckets,
                residual,
                rank=comm.group_rank(group),
                replicate_group=replicate_group,
                comm_dtype=comm_dtype,
                where="reduce_grads",
            )
        elif residual is not None:
            raise ValueError("reduce_grads: residual= is for a compressed wire with error feedback (precision.wire)")
        failure: Exception | None = None
    except (TypeError, ValueError, KeyError) as e:
        failure, present, grad_dtypes, buckets, wire = e, [], {}, (), None  # (compiled: traced on, never run)
    device = next((grads[n].device for n in present), torch.device("cpu"))  # type: ignore[union-attr]
    agreed = agreement.check_ranks_agree(
        layout,
        group,
        "reduce_grads",
        present=present,
        settings={
            "stage": stage if isinstance(stage, int) else -1,
            "bucket_numel": bucket_numel if isinstance(bucket_numel, int) else -1,
            "comm_dtype": agreement.dtype_code(comm_dtype),
            "grad_dtypes": agreement.dtypes_mask(set(grad_dtypes.values())),
            "replicas": comm.group_size(replicate_group) if replicate_group is not None else 1,
            "wire": wire.code if wire is not None else 0,
        },
        device=device,
        failure=failure,
    )
    how = reduce_realisation(stage, group, comm_policy)
    replicas = comm.group_size(replicate_group) if replicate_group is not None else 1
    present_set = set(present)
    # The split buckets' rows go straight into this rank's flat gradient buffers (bucket
    # order is flat order): summed there, or one copy (the cast back from the wire) per bucket.
    shards = GradShards(layout, comm.group_rank(group), grad_dtypes, device)
    # Without the caller's pool, one for this call: bucket k + 2 reuses bucket k's pages.
    # (Under torch.compile the compiler plans buffers: a caller's pool is left alone.)
    pool = staging if staging is not None and not comm.tracing() else pipeline_pool()

    def settle(item: tuple[Bucket, torch.dtype, torch.Tensor], pending: Pending) -> None:
        bucket, dtype, borrowed = item
        row = sum_over_replicas(pending.wait(), replicate_group)
        pool.give_unless_aliased(borrowed, shards.put(bucket, row, dtype))

    # Pipelined: a bucket is packed while the previous ones are on the wire. Every rank
    # settles in launch order after the same launches, so the replicas' blocking sums
    # interleave alike everywhere.
    in_flight: InFlight[tuple[Bucket, torch.dtype, torch.Tensor]] = InFlight(settle, pool)
    # The compressed wire's residual: a bucket not sent (no gradient) keeps its own.
    next_residual = list(residual) if residual is not None else None
    every = len(present_set) == len(layout)  # (present is a subset of the layout's names)
    for i, bucket in enumerate(buckets):
        members = bucket.names if every else [n for n in bucket.names if n in present_set]
        if not members:
            continue
        dtype, n, s = grad_dtypes[members[0]], layout.world_size, bucket.shard_numel
        borrowed = pool.take(n * s, dtype, device)
        rows = pack_grads(grads, layout, bucket, replicas=replicas, out=borrowed[: n * s].view(n, s), after=agreed)
        if wire is not None:
            mine = next_residual[i] if next_residual is not None else None
            pending, mine = launch_compressed(rows, wire_plan(layout, bucket, wire), wire.format, mine, group)
            if next_residual is not None:
                next_residual[i] = mine  # type: ignore[assignment]
        else:
            into = shards.target(bucket, wire_dtype(layout, bucket, comm_dtype))  # summed in place: no copy
            pending = launch_reduce(
                rows, layout, bucket, group, how, comm_dtype=comm_dtype, async_op=True, staging=pool, out=into
            )
        in_flight.push((bucket, dtype, borrowed), pending)
    in_flight.settle()
    return shards.result() if next_residual is None else (shards.result(), tuple(next_residual))


def reduce_realisation(stage: int, group: Group, policy: CommPolicy | None) -> str:
    """The reduce collective for ``stage``: all-reduce for 1 (as ZeRO-1), the policy's for 2."""
    return "all_reduce" if stage == 1 else (policy or CommPolicy()).resolve(group)[0]
