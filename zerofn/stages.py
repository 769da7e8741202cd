"""The four stage functions of a ZeRO step.

::

    params --shard_params--> ZeroState                         (a tiny value check; sync=True: broadcast)
    grads  --reduce_grads--> grad shards                       (reduce-scatter, bucketed)
    state, grad shards --step_shards--> new state, StepInfo    (one scalar all-reduce)
    state  --gather_params--> params                           (all-gather, bucketed)

Each is pure: it never changes its inputs (neither tensors nor mappings) and returns new
values. ``donate=True`` on ``step_shards`` lets it reuse the state's and the grad shards'
storage instead (the caller promises not to read them again), as ``jax.jit``'s
``donate_argnums``. Process groups are arguments; ``None`` is the default group.

Every function validates its inputs and checks that all ranks agree *before* the first
collective, so a mistake raises the same clear error on every rank instead of hanging.

Mixed precision (:mod:`zerofn.precision`) threads through all four: ``shard_params``
takes a :class:`~zerofn.precision.PrecisionPolicy` (working, master and accumulation
dtypes, master weights on or off, the state device for CPU offload, the loss scaler) and
stores it in the state; ``reduce_grads`` casts to the wire dtype and back;
``step_shards`` decides overflow on all ranks at once, advances the loss scale, unscales
and clips; ``gather_params`` casts the master shards to the working dtype.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn import _placement, _sync, _traced
from zerofn._comm import CommPolicy, Group, Pending
from zerofn._deprecation import UNSET, renamed
from zerofn._norm import exact_sqrt, local_norm_term
from zerofn._tree import FrozenDict
from zerofn.buckets import (
    StagingPool,
    cut_shard,
    launch_gather,
    launch_reduce,
    pack_grads,
    pack_shards,
    split_row,
    unpack_rows,
)
from zerofn.layout import Bucket, ShardLayout, block_of, make_layout
from zerofn.optim import Optimizer
from zerofn.precision import (
    LossScaleState,
    NonFiniteGradError,
    PrecisionPolicy,
    nonfinite_grad_names,
    resolve_param_dtypes,
    unscale_and_clip_coef,
    unscaled_norm,
)
from zerofn.state import DEFAULT_POLICY, StepInfo, ZeroState
from zerofn.torch_optim import refuse_uncompiled

__all__ = [
    "StepVetoed",
    "gather_params",
    "global_grad_norm",
    "reduce_grads",
    "reduce_realisation",
    "resolve_placement",
    "shard_params",
    "step_shards",
    "sum_over_replicas",
]

#: Padded elements per bucket (16 MiB in float32; DDP's buckets are 25 MiB). Measured on gloo,
#: 2 ranks on 2 cores (benchmarks/README.md, "Current numbers"): every collective costs a fixed
#: ~1 ms beside its bytes, so 2**22 against the seed's 2**20 cut the transformer's gradient
#: all-reduce from 42 to 33 ms and its param broadcasts from 40 to 22 ms.
DEFAULT_BUCKET_NUMEL = 2**22

#: Buckets the stage functions keep in flight while packing the next or writing the last.
PIPELINE_DEPTH = 1


def _policy_for(policy: PrecisionPolicy | None, master_dtype: torch.dtype) -> PrecisionPolicy:
    if policy is None:
        return DEFAULT_POLICY if master_dtype == torch.float32 else DEFAULT_POLICY.replace(master_dtype=master_dtype)
    if not isinstance(policy, PrecisionPolicy):
        what = type(policy).__name__
        raise TypeError(f"shard_params: precision must be a zerofn.PrecisionPolicy or None, got {what}")
    if master_dtype != torch.float32:
        raise ValueError(
            f"shard_params: got both master_dtype={master_dtype} and a precision policy; put it in the policy "
            f"instead: precision.replace(master_dtype={master_dtype})"
        )
    return policy


def shard_params(
    params: Mapping[str, torch.Tensor],
    optimizer: Optimizer,
    group: Group = None,
    *,
    master_dtype: torch.dtype = torch.float32,
    precision: PrecisionPolicy | None = None,
    placement: Mapping[str, str] | Callable[[str, torch.Tensor], str] | None = None,
    sync: bool = False,
    check: bool = True,
    policy: Any = UNSET,
) -> ZeroState:
    """The first ZeroState: this rank's master shards of ``params`` and fresh optimizer state.

    Args:
      params: name -> full param, any shapes, floating dtypes, one device. In the order
        every rank uses (``dict(model.named_parameters())``). Not changed or aliased.
      optimizer: a :mod:`zerofn.optim` optimizer; its ``init`` runs on the shards.
      group: the sharding process group (``None``: default). Only its size and this
        rank's index are read.
      master_dtype: dtype of the master shards and optimizer state (float32), when no
        ``precision`` is given.
      precision: the :class:`~zerofn.precision.PrecisionPolicy`; ``None``: every param keeps
        its own (working) dtype, ``master_dtype`` master shards on the params' device, no
        loss scaling. With a policy, each param's working dtype is
        :func:`~zerofn.precision.resolve_param_dtypes` (``param_dtype`` forces one; mixed
        dtypes raise :class:`~zerofn.precision.MixedDtypeError` naming the params unless
        ``mixed_dtypes="keep"``); the layout records the working dtypes; master shards are
        the params rounded to their working dtype, then stored in ``master_dtype``, or kept
        in the working dtype when ``master_weights=False`` (the optimizer then updates
        them directly); they and the optimizer state live on ``state_device`` (CPU
        offload) or else on the params' device. The loss scale starts at
        ``policy.loss_scaler.init()``.
      placement: an override of the optimizer's placements (:func:`resolve_placement`):
        name -> ``"split"`` / ``"whole"`` (names not listed keep the optimizer's choice),
        or a function ``(name, param) -> "split" | "whole"``. It may place whole what the
        optimizer would split, never the reverse (a whole-tensor update never runs on
        shards).
      sync: cut the master shards from group rank 0's values (one broadcast of every
        param, as DDP's construction makes every rank start from rank 0's weights). The
        params themselves are not changed: for the first forward take rank 0's params
        from :func:`zerofn.broadcast_params` (``out=params`` writes them into the model)
        or from ``gather_params(state, group)``.
      check: without ``sync``, confirm that the ranks' params hold the same values (a
        checksum per param, compared in one tiny all-gather), and raise
        :class:`~zerofn.RankMismatchError` naming the first param that differs and what
        to write instead. ``False`` skips it (no collective at all).
      policy: the old name of ``precision`` (deprecated, warns).

    Returns:
      A :class:`ZeroState` whose ``master[name]`` is, for a split param, chunk ``rank`` of
      the padded flat param, shape ``(ceil(numel / N),)``; for a whole param the full
      param (its shape) on its owner rank, absent on the others. ``precision`` is the
      policy used.

    Collectives: with ``check`` (the default) one all-gather of two int64 values (the
    layout fingerprint and a digest of the params' checksums); with ``sync`` one tiny
    all-gather and one ``broadcast`` per dtype of all the params instead; with
    ``check=False`` none. Ranks' layouts are compared by the first ``reduce_grads`` /
    ``gather_params`` (or call :func:`zerofn.check_ranks_agree` yourself).
    """
    precision = renamed("shard_params", "policy", "precision", policy, precision)
    checks.validate_params(params, "shard_params")
    if sync:
        params = _sync.broadcast_params(params, group)
    policy = _policy_for(precision, master_dtype)
    dtypes = resolve_param_dtypes(params, policy)
    rank = comm.group_rank(group)
    param_device = next(iter(params.values())).device
    state_device = torch.device(policy.state_device) if policy.state_device is not None else param_device
    working = {n: torch.empty(p.shape, dtype=dtypes[n], device="meta") for n, p in params.items()}
    layout = make_layout(working, comm.group_size(group), placement=resolve_placement(params, optimizer, placement))
    if check and not sync:
        _sync.check_values_agree(layout, params, group, "shard_params")
    master = FrozenDict(
        {
            s.name: cut_shard(
                params[s.name], s, rank, dtype=policy.master_dtype_for(s.dtype), device=state_device, round_to=s.dtype
            )
            for s in layout.params
            if s.holds(rank)
        }
    )
    return ZeroState(
        layout,
        optimizer,
        rank,
        master,
        optimizer.init(master, layout=layout),
        0,
        loss_scale=policy.loss_scaler.init(),
        precision=policy,
        param_device=str(param_device),
    )


def resolve_placement(
    params: Mapping[str, torch.Tensor],
    optimizer: Optimizer,
    override: Mapping[str, str] | Callable[[str, torch.Tensor], str] | None = None,
) -> dict[str, str]:
    """Each param's placement: what ``optimizer`` needs (:meth:`Optimizer.placement`), then ``override``.

    Args:
      params: name -> param (shape read).
      optimizer: its ``placement(name, shape)`` says ``"split"``, ``"whole"`` or
        ``"blocked(B)"`` per param.
      override: name -> placement (names not listed keep the optimizer's) or a function
        ``(name, param) -> placement``. ``"whole"`` or ``"blocked(B)"`` may replace
        ``"split"`` (an element-wise update gives the same result on a whole tensor or
        whole blocks); nothing may replace ``"whole"`` or ``"blocked(B)"`` (a quantized
        state's blocks must stay whole).

    Returns:
      name -> placement for every param, in ``params``' order.

    Raises:
      ValueError: the override splits a param the optimizer needs whole, names an unknown
        param or an unknown placement, or the optimizer cannot update a param's shape
        (Muon and a 1-D param).
      KeyError: a :func:`zerofn.optim.partition` selects no optimizer for a param.

    Collectives: none (a pure function of names, shapes and the optimizer: every rank
    computes the same placements).
    """
    if isinstance(override, Mapping):
        unknown = [n for n in override if n not in params]
        if unknown:
            raise ValueError(f"shard_params: placement names params that are not there: {unknown}")
    out: dict[str, str] = {}
    for name, p in params.items():
        needed = optimizer.placement(name, tuple(p.shape))
        if override is None:
            chosen = needed
        elif callable(override):
            chosen = override(name, p)
        else:
            chosen = override.get(name, needed)
        try:
            block_of(chosen)
        except ValueError:
            raise ValueError(
                f"shard_params: placement of {name!r} must be 'split', 'whole' or 'blocked(B)', got {chosen!r}"
            ) from None
        if needed == "whole" and chosen != "whole":
            raise ValueError(
                f"shard_params: param {name!r} (shape {tuple(p.shape)}) cannot be split: {optimizer.name} "
                "reads whole tensors, so it lives whole on one owner rank; drop it from the placement override"
            )
        if block_of(needed) and chosen != needed:
            raise ValueError(
                f"shard_params: param {name!r} (shape {tuple(p.shape)}) must be placed {needed}: {optimizer.name} "
                "quantizes its state in blocks of that size, and only whole blocks on every rank keep its numerics "
                "the same at every world size; drop it from the placement override"
            )
        out[name] = chosen
    return out


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
    policy: Any = UNSET,
) -> FrozenDict[torch.Tensor]:
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
        working dtype (as the seed: the wire carries working precision, also for
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
      policy: the old name of ``comm_policy`` (deprecated, warns).

    Returns:
      name -> ``(shard_numel,)`` mean-gradient shard in the dtype the gradient came in
      (cast back from the wire), for the split params that had gradients (in layout
      order); padding elements are zero. For a whole param (placement ``"whole"``): the
      full-shape mean gradient on its owner rank, nothing on the others.

    Collectives: one tiny ``all_gather`` (rank agreement and input verdict, see
    ``check_ranks_agree``), then per bucket one ``reduce_scatter`` (stage 2, NCCL) or one
    ``all_reduce`` (stage 1, or stage 2 on gloo) of ``N*S`` elements, and with replicas
    one ``all_reduce`` of ``S`` elements over ``replicate_group``.
    """
    comm_policy = renamed("reduce_grads", "policy", "comm_policy", policy, comm_policy)
    comm.group_rank(group)  # a rank outside the group cannot take part: raise here, alone
    # Local validation first; its verdict travels in the agreement all-gather, so a bad
    # input on one rank makes every rank raise instead of leaving the others waiting.
    try:
        if stage not in (1, 2):
            raise ValueError(f"reduce_grads: stage must be 1 or 2, got {stage!r}")
        if not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or bucket_numel <= 0:
            raise ValueError(f"reduce_grads: bucket_numel must be a positive int (elements), got {bucket_numel!r}")
        if precision is not None and not isinstance(precision, PrecisionPolicy):
            raise TypeError(
                f"reduce_grads: precision must be a zerofn.PrecisionPolicy (state.precision) or None, "
                f"got {type(precision).__name__}"
            )
        precision = precision or DEFAULT_POLICY
        comm_dtype = comm_dtype if comm_dtype is not None else precision.comm_dtype
        checks.validate_world(layout, group, "reduce_grads")
        checks.validate_replicas(replicate_group, "reduce_grads")
        _check_staging(staging, "reduce_grads")
        present = checks.validate_grads(
            grads, layout, group, "reduce_grads", accum_dtype_for=precision.grad_accum_dtype_for
        )
        buckets = layout.buckets(bucket_numel)
        grad_dtypes = {n: grads[n].dtype for n in present}  # type: ignore[union-attr]
        checks.validate_bucket_dtypes(buckets, grad_dtypes, group, "reduce_grads")
        failure: Exception | None = None
    except (TypeError, ValueError, KeyError) as e:
        failure, present, grad_dtypes, buckets = e, [], {}, ()  # (compiled: traced on, never run)
    device = next((grads[n].device for n in present), torch.device("cpu"))  # type: ignore[union-attr]
    checks.check_ranks_agree(
        layout,
        group,
        "reduce_grads",
        present=present,
        settings={
            "stage": stage if isinstance(stage, int) else -1,
            "bucket_numel": bucket_numel if isinstance(bucket_numel, int) else -1,
            "comm_dtype": checks.dtype_code(comm_dtype),
            "grad_dtypes": checks.dtypes_mask(set(grad_dtypes.values())),
            "replicas": comm.group_size(replicate_group) if replicate_group is not None else 1,
        },
        device=device,
        failure=failure,
    )
    how = reduce_realisation(stage, group, comm_policy)
    rank = comm.group_rank(group)
    replicas = comm.group_size(replicate_group) if replicate_group is not None else 1
    present_set = set(present)
    out: dict[str, torch.Tensor] = {}
    # Without the caller's pool, one for this call: bucket k + 2 reuses bucket k's pages.
    # (Under torch.compile the compiler plans buffers: a caller's pool is left alone.)
    pool = staging if staging is not None and not comm.tracing() else StagingPool(keep=PIPELINE_DEPTH + 1)
    in_flight: collections.deque[tuple[Bucket, torch.dtype, Pending, torch.Tensor]] = collections.deque()

    def settle_oldest() -> None:
        bucket, dtype, pending, borrowed = in_flight.popleft()
        row = sum_over_replicas(pending.wait(), replicate_group)
        shards = split_row(row, layout, bucket, present_set, dtype=dtype, rank=rank)  # copied out of `rows`
        out.update(shards)
        pool.give_unless_aliased(borrowed, shards.values())

    for bucket in buckets:
        members = [n for n in bucket.names if n in present_set]
        if not members:
            continue
        # Pipelined: this bucket is packed while the previous one is on the wire. Every
        # rank issues the same sequence of collectives (launch k, then settle k-1), so the
        # replicas' blocking sums interleave alike everywhere.
        dtype, shape = grad_dtypes[members[0]], (layout.world_size, bucket.shard_numel)
        borrowed = pool.take(shape[0] * shape[1], dtype, device)
        rows = pack_grads(grads, layout, bucket, replicas=replicas, out=borrowed[: shape[0] * shape[1]].view(shape))
        pending = launch_reduce(rows, layout, bucket, group, how, comm_dtype=comm_dtype, async_op=True)
        in_flight.append((bucket, dtype, pending, borrowed))
        if len(in_flight) > PIPELINE_DEPTH:
            settle_oldest()
    while in_flight:
        settle_oldest()
    for name in present:
        spec = layout[name]
        if name not in out and spec.numel == 0 and spec.holds(rank):  # empty params travel in no bucket
            out[name] = torch.empty(spec.local_shape(rank), dtype=grad_dtypes[name], device=device)  # type: ignore[arg-type]
    return FrozenDict({name: out[name] for name in present if name in out})


def reduce_realisation(stage: int, group: Group, policy: CommPolicy | None) -> str:
    """The reduce collective for ``stage``: all-reduce for 1 (as ZeRO-1), the policy's for 2."""
    return "all_reduce" if stage == 1 else (policy or CommPolicy()).resolve(group)[0]


def _global_norm(
    grad_shards: Mapping[str, torch.Tensor],
    norm_type: float,
    group: Group,
    device: torch.device,
    *,
    rejected: bool = False,
) -> tuple[float, bool]:
    """Global ``norm_type`` norm of the mean gradient over the group, accumulated in float64.

    Padding is zero, so summing over padded shards equals the norm of the full grads.
    The norm is ``inf`` if any rank holds a non-finite gradient element: the second value
    all-reduced is that flag, so every rank learns it from the same collective. The third
    is ``rejected`` (this rank found its input invalid); the second return value tells
    whether any rank did.
    Collectives: one ``all_reduce`` of three float64 values, on ``device``.
    """
    local = local_norm_term(grad_shards.values(), norm_type, device)
    finite = bool(torch.isfinite(local))
    packed = torch.stack(
        [
            local if finite else torch.zeros_like(local),
            torch.tensor(0.0 if finite else 1.0, dtype=torch.float64, device=device),
            torch.tensor(float(rejected), dtype=torch.float64, device=device),
        ]
    )
    total = comm.all_reduce_scalars(packed, "max" if norm_type == math.inf else "sum", group).tolist()
    if total[1] > 0:
        return math.inf, total[2] > 0
    return (math.sqrt(total[0]) if norm_type == 2.0 else total[0]), total[2] > 0


def global_grad_norm(
    grad_shards: Mapping[str, torch.Tensor],
    group: Group = None,
    *,
    norm_type: float = 2.0,
    scale: float = 1.0,
    device: torch.device | str = "cpu",
) -> float:
    """The global ``norm_type`` norm of the true gradient, from every rank's pieces of it.

    The same norm ``step_shards`` computes (float64, padding zero, ``inf`` when any rank
    holds a non-finite element), without a step: what ``clip_grad_norm_`` and
    ``get_grad_norm`` report between backward and step.

    Args:
      grad_shards: name -> this rank's piece of each mean gradient (shards from
        :func:`reduce_grads`, or views of the owned range of full gradients); any shapes.
        Together the ranks' pieces must cover each gradient exactly once.
      group: the sharding process group (``None``: default).
      norm_type: 2.0 or ``math.inf``.
      scale: the loss scale the pieces carry (1.0: none); the result is divided by it.
      device: where the scalars go (the params' device).

    Returns:
      The unscaled norm as a Python float, equal on every rank; ``inf`` if any element is
      not finite.

    Collectives: one ``all_reduce`` of three float64 values over ``group``.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"global_grad_norm: norm_type must be 2.0 or math.inf, got {norm_type!r}")
    norm, _ = _global_norm(grad_shards, norm_type, group, torch.device(device))
    return unscaled_norm(norm, scale)


def step_shards(
    state: ZeroState,
    grad_shards: Mapping[str, torch.Tensor],
    group: Group = None,
    max_norm: float | None = None,
    *,
    norm_type: float = 2.0,
    donate: bool = False,
    veto: object = None,
) -> tuple[ZeroState, StepInfo]:
    r"""Decide overflow on every rank, unscale and clip, and apply the optimizer to this rank's shards.

    The gradient shards carry the loss scale :math:`s` = ``state.loss_scale.scale``
    (1.0 without loss scaling). In order:

    1. the global ``norm_type`` norm :math:`n` of the (scaled) mean gradient over all
       ranks' shards, in float64, and whether any element on any rank is ``inf``/``nan``:
       both in ONE scalar all-reduce over ``group``, before any state changes, so every
       rank takes the same branch;
    2. the loss scaler advances: ``policy.loss_scaler.update(loss_scale, found)``, the
       same inputs on every rank, so the same new scale everywhere;
    3. if some element was not finite: with ``policy.nonfinite == "skip"`` the step is
       skipped on every rank (master, optimizer state and step count untouched; only the
       loss-scale state advances, e.g. a backoff); with ``"raise"`` every rank raises
       :class:`~zerofn.precision.NonFiniteGradError` naming the params (collected from
       all ranks) and the state is unchanged;
    4. otherwise the gradients move to the state device (CPU offload) and are multiplied
       once by the seed's unscale-and-clip coefficient
       (:func:`~zerofn.precision.unscale_and_clip_coef`, with the scale the gradients
       carry, i.e. the *old* one):

       .. math:: c = \frac{n/s + 10^{-6}}{m},\qquad
                 \text{coef} = \frac{1}{s \cdot \max(1, c)}

       in the wider of the gradient and master dtypes, cast to the master dtype, and the
       optimizer updates the master shards (float32 copies, or the working-dtype shards
       themselves with ``master_weights=False``).

    Params absent from ``grad_shards`` (no gradient this step) keep their shard and their
    optimizer state, as torch.optim does.

    Args:
      state: the current state.
      grad_shards: from :func:`reduce_grads`: name -> ``(shard_numel,)`` shard, on the
        params' device, in any floating dtype (the working or accumulation dtype).
      group: the sharding process group (``None``: default).
      max_norm: clip threshold for the true (unscaled) norm, or ``None`` for no clipping.
      norm_type: 2.0 or ``math.inf``.
      donate: reuse ``state``'s and ``grad_shards``' tensors in place; do not use them after.
      veto: a picklable reason (not ``None``) this rank has, outside the function's own
        checks, for no rank to apply this step (the facade's: its params were changed by
        the user since the last step). It rides as a flag in the scalar all-reduce; if any
        rank vetoes, every rank raises :class:`StepVetoed` carrying every rank's veto, with
        ``state`` and ``grad_shards`` untouched (also under ``donate``), so the caller can
        act on the same list on every rank and call again.

    Returns:
      ``(new_state, info)`` with ``new_state.step == state.step + 1`` unless skipped;
      ``info.grad_norm`` is the true norm :math:`n/s`. A skipped step returns ``state``
      itself when the loss-scale state did not move, else ``state`` with only
      ``loss_scale`` replaced (the same tensors).

    Raises:
      NonFiniteGradError: on every rank, when a gradient element on any rank is not finite
        and ``state.precision.nonfinite == "raise"``.
      StepVetoed: on every rank, when some rank passed a ``veto``.

    Collectives: one ``all_reduce`` of two float64 scalars (norm and non-finite flag);
    with ``nonfinite="raise"`` and a bad step, one object all-gather of the offending
    names before raising.

    Under ``torch.compile`` (one graph with the other stage functions): the same steps as
    tensor math, bitwise equal with ``backend="aot_eager"``; pass ``state.as_tensors()``
    (tensor step and loss scale) and read ``info``'s fields as 0-d tensors. The checks
    above run once per trace; their verdict, and the errors, on every call.
    """
    comm.group_rank(group)  # a rank outside the group cannot take part: raise here, alone
    # Validate locally, then tell the other ranks through the norm all-reduce itself (a
    # third flag), so a bad input on one rank makes every rank raise, none waits.
    failure = _validate_step(state, grad_shards, group, max_norm, norm_type)
    if comm.tracing():
        return _step_shards_traced(state, grad_shards, group, max_norm, norm_type, failure, veto)
    if isinstance(state.step, torch.Tensor):  # the tensor form (as_tensors) steps as the numbers do
        new_state, info = step_shards(
            _as_numbers(state), grad_shards, group, max_norm, norm_type=norm_type, donate=donate, veto=veto
        )
        return new_state.as_tensors(), info
    policy, loss_scale = state.precision, state.loss_scale
    refused = failure is not None or veto is not None
    norm, rejected = _global_norm(
        grad_shards if failure is None else {}, norm_type, group, state.work_device, rejected=refused
    )
    if rejected:
        _raise_rejected(failure, group, veto)
    found = not math.isfinite(norm)
    new_loss_scale = policy.loss_scaler.update(loss_scale, found)
    if found:
        if policy.nonfinite == "raise":
            _raise_nonfinite(state, grad_shards, group)
        skipped = state if new_loss_scale == loss_scale else state.replace(loss_scale=new_loss_scale)
        return skipped, StepInfo(norm, True, 1.0)
    coef = unscale_and_clip_coef(norm, loss_scale.scale, max_norm)
    true_norm = unscaled_norm(norm, loss_scale.scale)
    clipped = max_norm is not None and (true_norm + 1e-6) / max_norm > 1
    moved = _placement.to_device(grad_shards, state.state_device)  # CPU offload: grads go to the state
    grads = {}
    for name, g in moved.items():
        target = state.master[name].dtype
        if coef != 1.0:
            wide = torch.promote_types(g.dtype, target)
            owned = donate or g is not grad_shards[name]
            g = g.mul_(coef) if owned and g.dtype == wide else g.to(wide) * coef
        grads[name] = g.to(target)
    new_master, new_opt_state = state.optimizer.update(grads, state.opt_state, state.master, donate=donate)
    new_state = state.replace(
        master=FrozenDict(new_master), opt_state=new_opt_state, step=state.step + 1, loss_scale=new_loss_scale
    )
    return new_state, StepInfo(true_norm, False, max_norm / (true_norm + 1e-6) if clipped else 1.0)


def _validate_step(
    state: ZeroState, grad_shards: Mapping[str, torch.Tensor], group: Group, max_norm: float | None, norm_type: float
) -> Exception | None:
    """``step_shards``' local checks (static metadata only): the error, or ``None``."""
    try:
        checks.validate_world(state.layout, group, "step_shards")
        if comm.group_rank(group) != state.rank:
            raise ValueError(
                f"step_shards: the state holds rank {state.rank}'s shards but this process is rank "
                f"{comm.group_rank(group)} of the group"
            )
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"step_shards: norm_type must be 2.0 or math.inf, got {norm_type!r}")
        if max_norm is not None and not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"step_shards: max_norm must be a positive finite number or None, got {max_norm!r}")
        for name, g in grad_shards.items():
            if name not in state.layout:
                raise KeyError(f"step_shards on rank {state.rank}: gradient shard for unknown param {name!r}")
            spec = state.layout[name]
            expected = spec.local_shape(state.rank)
            if expected is None:
                raise ValueError(
                    f"step_shards on rank {state.rank}: got a gradient for whole param {name!r} (shape {spec.shape}), "
                    f"which rank {spec.owner} owns; pass the output of reduce_grads on this rank"
                )
            if tuple(g.shape) != expected:
                what = "the full shape of a whole param this rank owns" if spec.is_whole else "a split param"
                raise ValueError(
                    f"step_shards on rank {state.rank}: shard of {name!r} has shape {tuple(g.shape)}, expected "
                    f"{expected} ({what}) for a param of shape {spec.shape} over {state.layout.world_size} ranks; "
                    "pass the output of reduce_grads, not full gradients"
                )
            if not g.is_floating_point():
                raise TypeError(
                    f"step_shards on rank {state.rank}: shard of {name!r} has dtype {g.dtype}, not floating"
                )
    except (TypeError, ValueError, KeyError) as e:
        return e
    return None


def _as_numbers(state: ZeroState) -> ZeroState:
    """The inverse of :meth:`ZeroState.as_tensors`: step and loss-scale state as Python numbers."""
    scale, tracker, left = state.loss_scale
    return state.replace(step=int(state.step), loss_scale=LossScaleState(float(scale), int(tracker), int(left)))


_NOT_TENSORS = (
    "step_shards under torch.compile: the state's step and loss scale are Python numbers, which a compiled "
    "graph would bake in as constants (and recompile on every change), and a skipped step cannot leave them "
    "as they were without a graph break; pass state.as_tensors() to the compiled step (once, before the loop)"
)


def _step_shards_traced(
    state: ZeroState,
    grad_shards: Mapping[str, torch.Tensor],
    group: Group,
    max_norm: float | None,
    norm_type: float,
    failure: Exception | None,
    veto: object,
) -> tuple[ZeroState, StepInfo]:
    """``step_shards`` inside a compiled graph: the same arithmetic as tensor math, no host sync.

    The local checks ran once, at trace time (shapes and dtypes are static); their
    verdict rides in the scalar all-reduce as eagerly, and :func:`zerofn._traced.verdict`
    raises the eager errors on every rank when a rank rejected its input, or, with
    ``nonfinite="raise"``, when a gradient is not finite. Otherwise the overflow flag is
    a tensor every rank got from the same all-reduce: a skipped step is ``torch.where``
    between the old and the updated state (the update runs either way, its non-finite
    results are dropped), the loss scaler advances by tensor math, and the unscale-and-clip
    coefficient is a float64 tensor computed as :func:`unscale_and_clip_coef` computes it.
    ``donate`` is not needed: the compiler plans the graph's buffers.
    """
    if not isinstance(state.step, torch.Tensor):
        # Python numbers: one graph cannot hold this step. Break here, saying why (with
        # fullgraph=True this is the error), and step the tensor form in the next graph.
        torch._dynamo.graph_break(msg=_NOT_TENSORS)
        new_state, info = _step_shards_traced(
            state.as_tensors(), grad_shards, group, max_norm, norm_type, failure, veto
        )
        return _as_numbers(new_state), info
    refuse_uncompiled(state.optimizer)  # (the same on every rank: before any collective of the graph)
    policy, loss_scale = state.precision, state.loss_scale
    device = state.work_device
    refused = failure is not None or veto is not None
    local = local_norm_term(grad_shards.values() if failure is None else [], norm_type, device)
    finite = torch.isfinite(local)
    packed = torch.stack(
        [
            torch.where(finite, local, torch.zeros_like(local)),
            (~finite).to(torch.float64),
            torch.full((), float(refused), dtype=torch.float64, device=device),
        ]
    )
    total = comm.all_reduce_scalars(packed, "max" if norm_type == math.inf else "sum", group)
    names = list(grad_shards)
    desc = (
        comm.group_name(group),
        _traced.failure_desc(failure),
        None if veto is None else repr(veto),
        policy.nonfinite,
        state.rank,
        state.layout.names,
        tuple(names),
    )
    _traced.verdict(total, "step_shards", desc, [grad_shards[n] for n in names])
    found = total[1] > 0
    norm = torch.where(
        found, torch.full_like(total[0], math.inf), exact_sqrt(total[0]) if norm_type == 2.0 else total[0]
    )
    new_loss_scale = policy.loss_scaler.update(loss_scale, found)
    scale = loss_scale.scale
    finite_norm = torch.where(found, torch.zeros_like(norm), norm)
    true_norm = finite_norm / scale
    div = scale if isinstance(scale, torch.Tensor) else torch.full_like(norm, scale)
    clip_info = torch.ones_like(norm)
    if max_norm is not None:
        clip = (true_norm + 1e-6) / max_norm
        div = torch.where(clip > 1, clip * scale, div)
        clip_info = torch.where(clip > 1, max_norm / (true_norm + 1e-6), clip_info)
    coef = 1.0 / div  # unscale_and_clip_coef, in float64 as eagerly
    moved = _placement.to_device(grad_shards, state.state_device)
    grads = {}
    for name, g in moved.items():
        target = state.master[name].dtype
        wide = torch.promote_types(g.dtype, target)
        grads[name] = (g.to(wide) * coef.to(state.state_device, wide)).to(target)  # x * 1.0 == x: no branch
    new_master, new_opt_state = state.optimizer.update(grads, state.opt_state, state.master, donate=False)
    keep = found.to(state.state_device)

    def select(old: Any, new: Any) -> Any:
        return torch.where(keep, old, new) if isinstance(new, torch.Tensor) and old is not None else new

    old_leaves, spec = pytree.tree_flatten(state.opt_state)
    new_leaves, new_spec = pytree.tree_flatten(new_opt_state)
    if spec != new_spec or any(o is None and n is not None for o, n in zip(old_leaves, new_leaves, strict=True)):
        _traced.refuse(
            f"step_shards under torch.compile: zerofn.optim.{state.optimizer.name}'s state changes its structure "
            "in a step (a buffer created on the first step); run one step eagerly before compiling"
        )
    opt_state = pytree.tree_unflatten([select(o, n) for o, n in zip(old_leaves, new_leaves, strict=True)], spec)
    master = FrozenDict({n: select(state.master[n], t) for n, t in new_master.items()})
    step = torch.where(found, state.step, state.step + 1)
    new_state = state.replace(master=master, opt_state=opt_state, step=step, loss_scale=new_loss_scale)
    return new_state, StepInfo(torch.where(found, norm, true_norm), found, torch.where(found, 1.0, clip_info))


@_traced.handler("step_shards")
def _settle_step(
    total: torch.Tensor,
    shards: list[torch.Tensor],
    group_name: str | None,
    failure: tuple[str, str] | None,
    veto: str | None,
    nonfinite: str,
    rank: int,
    layout_names: tuple[str, ...],
    names: tuple[str, ...],
) -> None:
    """A compiled ``step_shards``' verdict on the all-reduced scalars: return, or raise the eager error everywhere."""
    group = comm.group_from_name(group_name)
    if total[2] > 0:
        _raise_rejected(None if failure is None else _traced.rebuild_failure(failure), group, veto)
    if total[1] > 0 and nonfinite == "raise":
        _raise_nonfinite_names(rank, layout_names, dict(zip(names, shards, strict=True)), group)


def _check_staging(staging: object, where: str) -> None:
    if staging is not None and not isinstance(staging, StagingPool):
        raise TypeError(f"{where}: staging must be a zerofn.buckets.StagingPool or None, got {type(staging).__name__}")


class StepVetoed(RuntimeError):
    """Raised by ``step_shards`` on every rank when some rank passed a ``veto``; nothing was applied.

    Attributes:
      vetoes: every rank's ``veto`` argument, by group rank (``None`` for ranks without one),
        the same list on every rank.
    """

    def __init__(self, vetoes: list[object]) -> None:
        ranks = [r for r, v in enumerate(vetoes) if v is not None]
        super().__init__(f"step_shards: ranks {ranks} vetoed this step, so no rank applied it")
        self.vetoes = vetoes


def _raise_rejected(failure: Exception | None, group: Group, veto: object = None) -> None:
    """Every rank: some rank found its ``step_shards`` input invalid or vetoed; all raise, none changed state."""
    everyone = comm.all_gather_objects(
        (None if failure is None else f"{type(failure).__name__}: {failure}", veto), group
    )
    if failure is not None:
        raise failure
    bad = next(((r, w) for r, (w, _) in enumerate(everyone) if w is not None), None)
    if bad is not None:
        raise checks.RankMismatchError(
            f"step_shards: rank {bad[0]} rejected its input ({bad[1]}), so no rank applied this step; fix the input "
            "on that rank"
        )
    raise StepVetoed([v for _, v in everyone])


def _raise_nonfinite(state: ZeroState, grad_shards: Mapping[str, torch.Tensor], group: Group) -> None:
    """Every rank: collect which params hold non-finite shards where, then raise the same error.

    Only called once the scalar all-reduce has told every rank that the step is bad, so
    every rank issues this one object all-gather and raises: none is left waiting.
    """
    _raise_nonfinite_names(state.rank, state.layout.names, grad_shards, group)


def _raise_nonfinite_names(
    rank: int, layout_names: tuple[str, ...], grad_shards: Mapping[str, torch.Tensor], group: Group
) -> None:
    everyone = comm.all_gather_objects(nonfinite_grad_names(grad_shards), group)
    where = {
        name: [r for r, names in enumerate(everyone) if name in names]  # type: ignore[operator]
        for name in layout_names
        if any(name in names for names in everyone)  # type: ignore[operator]
    }
    if where:
        listing = "; ".join(f"{name!r} (in the shards of ranks {ranks})" for name, ranks in where.items())
        what = f"gradients of these params hold inf or nan: {listing}"
    else:
        what = "no gradient element is inf or nan, but the squared global norm overflowed float64"
    raise NonFiniteGradError(
        f"step_shards on rank {rank}: {what}. The policy says nonfinite='raise', so no rank applied "
        "this step and the state is unchanged. Find the cause (a bad batch, a too large learning rate, an "
        "overflow in the forward), or use PrecisionPolicy(nonfinite='skip') to skip such steps."
    )


def gather_params(
    state: ZeroState,
    group: Group = None,
    *,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    comm_policy: CommPolicy | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    check: bool = True,
    staging: StagingPool | None = None,
    policy: Any = UNSET,
) -> dict[str, torch.Tensor]:
    """All ranks' master shards, gathered into full params in their working dtypes.

    Each bucket's shards are cast to the params' working dtype (the wire carries working
    precision; float32 masters are rounded to nearest), moved to the params' device if
    the state lives elsewhere (CPU offload: from a pinned buffer, non-blocking), gathered
    into a rank-major ``(N, S)`` buffer, and cut back into full tensors with the padding
    dropped.

    Args:
      state: the current state.
      group: the sharding process group (``None``: default).
      bucket_numel: padded elements per bucket.
      comm_policy: how collectives are realised; default :class:`CommPolicy` (per backend).
      out: explicit donation of destination tensors: name -> tensor of the param's
        shape and dtype (e.g. the model's own parameters) to write into in place instead
        of allocating new ones. Validated before any collective.
      check: confirm with one tiny all-gather that every rank has the same layout and
        bucket size (the default). A caller that has confirmed it once for this layout
        and group, as the facade does at construction, may pass False to save the round trip.
      staging: explicit buffer reuse: a :class:`~zerofn.buckets.StagingPool` the ``(N, S)``
        receive buffers are taken from and given back to (with the broadcast
        realisation this rank's row is packed straight into its slot); ``None``: fresh
        buffers. The returned params never alias its buffers.
      policy: the old name of ``comm_policy`` (deprecated, warns).
    Returns:
      A new dict name -> full param (layout order, original shape, working dtype, on the
      params' device ``state.work_device``), equal on every rank. Without ``out`` the
      caller owns fresh tensors that nothing in ``state`` aliases; with ``out`` the
      values are ``out``'s tensors.

    Collectives: one tiny ``all_gather`` (rank agreement, unless ``check=False``), then
    per bucket one ``all_gather`` (NCCL) or one ``broadcast`` per rank (gloo) of ``S``
    elements each.
    """
    comm_policy = renamed("gather_params", "policy", "comm_policy", policy, comm_policy)
    layout = state.layout
    checks.validate_world(layout, group, "gather_params")
    if not isinstance(bucket_numel, int) or bucket_numel <= 0:
        raise ValueError(f"gather_params: bucket_numel must be a positive int (elements), got {bucket_numel!r}")
    device = state.work_device
    _check_staging(staging, "gather_params")
    if out is not None:
        checks.validate_out(out, layout, "gather_params")
    if check:
        checks.check_ranks_agree(layout, group, "gather_params", settings={"bucket_numel": bucket_numel}, device=device)
    how = (comm_policy or CommPolicy()).resolve(group)[1]
    result = {
        s.name: out[s.name] if out is not None else torch.empty(s.shape, dtype=s.dtype, device=device)
        for s in layout.params
    }
    # Without the caller's pool, one for this call: bucket k + 2 reuses bucket k's pages.
    # (Under torch.compile the compiler plans buffers: a caller's pool is left alone.)
    pool = staging if staging is not None and not comm.tracing() else StagingPool(keep=PIPELINE_DEPTH + 1)
    in_flight: collections.deque[tuple[Bucket, Pending, torch.Tensor]] = collections.deque()

    def write_oldest() -> None:
        bucket, pending, borrowed = in_flight.popleft()
        with torch.no_grad():  # `out` may be leaf params that require grad
            unpack_rows(pending.wait(), layout, bucket, result)  # copied out of the (N, S) buffer
        pool.give(borrowed)

    n = layout.world_size
    for bucket in layout.buckets(bucket_numel):
        # Pipelined: the previous bucket's rows are written into the params while this
        # one is on the wire; at most PIPELINE_DEPTH gathered buffers exist at once.
        dtype, n_s = layout[bucket.names[0]].dtype, n * bucket.shard_numel
        borrowed = pool.take(n_s, dtype, device)
        recv = borrowed[:n_s].view(n, bucket.shard_numel)
        in_place = recv[state.rank] if how == "broadcast" else None
        row = pack_shards(state.master, layout, bucket, dtype=dtype, device=device, out=in_place, rank=state.rank)
        in_flight.append((bucket, launch_gather(row, group, how, async_op=True, out=recv), borrowed))
        if len(in_flight) > PIPELINE_DEPTH:
            write_oldest()
    while in_flight:
        write_oldest()
    return result
