"""The four stage functions of a ZeRO step.

::

    params --shard_params--> ZeroState                         (no communication)
    grads  --reduce_grads--> grad shards                       (reduce-scatter, bucketed)
    state, grad shards --step_shards--> new state, StepInfo    (one scalar all-reduce)
    state  --gather_params--> params                           (all-gather, bucketed)

Each is pure: it never changes its inputs (neither tensors nor mappings) and returns new
values. ``donate=True`` on ``step_shards`` lets it reuse the state's and the grad shards'
storage instead (the caller promises not to read them again), as ``jax.jit``'s
``donate_argnums``. Process groups are arguments; ``None`` is the default group.

Every function validates its inputs and checks that all ranks agree *before* the first
collective, so a mistake raises the same clear error on every rank instead of hanging.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import torch

from zerofn import checks, comm
from zerofn._tree import FrozenDict
from zerofn.comm import CommPolicy, Group
from zerofn.layout import Bucket, ParamSpec, ShardLayout, make_layout
from zerofn.optim import Optimizer
from zerofn.state import StepInfo, ZeroState

__all__ = [
    "gather_params",
    "launch_bucket_reduce",
    "reduce_grads",
    "reduce_realisation",
    "shard_params",
    "split_bucket_row",
    "step_shards",
]

DEFAULT_BUCKET_NUMEL = 2**20


def _shard_of(full: torch.Tensor, spec: ParamSpec, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s ``(shard_numel,)`` chunk of ``full``, zero padded, as a new tensor."""
    start, stop = spec.owned_range(rank)
    shard = torch.zeros(spec.shard_numel, dtype=dtype, device=full.device)
    shard[: stop - start].copy_(full.detach().reshape(-1)[start:stop])
    return shard


def shard_params(
    params: Mapping[str, torch.Tensor],
    optimizer: Optimizer,
    group: Group = None,
    *,
    master_dtype: torch.dtype = torch.float32,
) -> ZeroState:
    """The first ZeroState: this rank's master shards of ``params`` and fresh optimizer state.

    Args:
      params: name -> full param, any shapes, floating dtypes, one device. In the order
        every rank uses (``dict(model.named_parameters())``). Not changed or aliased.
      optimizer: a :mod:`zerofn.optim` optimizer; its ``init`` runs on the shards.
      group: the sharding process group (``None``: default). Only its size and this
        rank's index are read.
      master_dtype: dtype of the master shards and optimizer state (float32).

    Returns:
      A :class:`ZeroState` whose ``master[name]`` is chunk ``rank`` of the padded flat
      param, shape ``(ceil(numel / N),)``, in ``master_dtype``.

    Collectives: none. Ranks' layouts are compared by the first ``reduce_grads`` /
    ``gather_params`` (or call :func:`zerofn.checks.check_ranks_agree` yourself).
    """
    checks.validate_params(params, "shard_params")
    rank = comm.group_rank(group)
    layout = make_layout(params, comm.group_size(group))
    master = FrozenDict({s.name: _shard_of(params[s.name], s, rank, master_dtype) for s in layout.params})
    return ZeroState(layout, optimizer, rank, master, optimizer.init(master), 0)


def _rows_from_full(
    full: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    bucket: Bucket,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Flatten ``full[bucket.names]`` into a new ``(N, bucket.shard_numel)`` rank-major buffer.

    Row ``r`` holds chunk ``r`` of every member's padded flat tensor, members side by side
    in bucket order. A member that is absent or ``None`` gets a zero block: the buffer's
    shape, and the position of every element in it, depend only on the layout, so the
    result for one param never depends on which others were present.
    """
    n = layout.world_size
    rows = torch.empty(n, bucket.shard_numel, dtype=dtype, device=device)
    for name, col in zip(bucket.names, bucket.offsets, strict=True):
        spec = layout[name]
        block = rows[:, col : col + spec.shard_numel]
        t = full.get(name)
        if t is None:
            block.zero_()
            continue
        flat = t.detach().reshape(-1)
        if spec.padding == 0:
            block.copy_(flat.view(n, spec.shard_numel))
        else:
            # Whole rows first, then the one partial row and the zero padding after it.
            whole = spec.numel // spec.shard_numel
            block[:whole].copy_(flat[: whole * spec.shard_numel].view(whole, spec.shard_numel))
            block[whole:].zero_()
            rest = spec.numel - whole * spec.shard_numel
            if rest:
                block[whole, :rest].copy_(flat[whole * spec.shard_numel :])
    return rows


def _full_from_rows(rows: torch.Tensor, spec: ParamSpec, col: int, out: torch.Tensor) -> None:
    """Write param ``spec``'s columns of a gathered ``(N, S)`` buffer into ``out`` (full shape)."""
    s = spec.shard_numel
    flat = out.view(-1)
    whole = spec.numel // s
    flat[: whole * s].view(whole, s).copy_(rows[:whole, col : col + s])
    rest = spec.numel - whole * s
    if rest:
        flat[whole * s :].copy_(rows[whole, col : col + rest])


def launch_bucket_reduce(
    grads: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    bucket: Bucket,
    group: Group,
    how: str,
    *,
    comm_dtype: torch.dtype | None = None,
    async_op: bool = False,
) -> comm.Pending:
    """Start averaging one bucket of full gradients over the group (a building block).

    :func:`reduce_grads` runs this for every bucket; the facade runs it from gradient
    hooks as buckets fill, so both paths send identical buffers and get identical bits.
    The rows are multiplied by ``1/N`` *before* the sum, as DDP does, so low-precision
    sums do not overflow. Absent members contribute zeros.

    Returns:
      A :class:`~zerofn.comm.Pending` whose ``wait()`` is this rank's ``(bucket.shard_numel,)``
      row of the mean, in ``comm_dtype`` (default: the gradients' dtype).

    Collectives: one ``reduce_scatter`` or ``all_reduce`` (``how``) of ``N * S`` elements.
    """
    dtype = layout[bucket.names[0]].dtype
    device = next(g.device for g in (grads.get(n) for n in bucket.names) if g is not None)
    rows = _rows_from_full(grads, layout, bucket, dtype, device)
    rows.mul_(1.0 / layout.world_size)
    if comm_dtype is not None and comm_dtype != dtype:
        rows = rows.to(comm_dtype)
    return comm.sum_rows(rows, group, how, async_op=async_op)


def split_bucket_row(
    row: torch.Tensor, layout: ShardLayout, bucket: Bucket, present: Collection[str]
) -> dict[str, torch.Tensor]:
    """Cut a reduced bucket row into per-param shards, for the ``present`` names only.

    The row is cast back to the params' dtype; a row that is a view of a bigger buffer
    (the all-reduce realisation) is copied out so the ``(N, S)`` buffer can be freed.
    """
    dtype = layout[bucket.names[0]].dtype
    if row.dtype != dtype:
        row = row.to(dtype)
    elif row._base is not None:
        row = row.clone()
    return {
        name: row[col : col + layout[name].shard_numel]
        for name, col in zip(bucket.names, bucket.offsets, strict=True)
        if name in present
    }


def reduce_grads(
    grads: Mapping[str, torch.Tensor | None],
    layout: ShardLayout,
    group: Group = None,
    stage: int = 2,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    *,
    policy: CommPolicy | None = None,
    comm_dtype: torch.dtype | None = None,
) -> FrozenDict[torch.Tensor]:
    """Average full local gradients over the group and keep this rank's shards.

    For each bucket of the layout's static plan (:meth:`ShardLayout.buckets`) the
    gradients are copied into a rank-major ``(N, S)`` buffer, multiplied by ``1/N``, cast
    to ``comm_dtype``, summed over the group and cast back; this rank's row is cut into
    per-param shards. Params without a gradient fill their slot with zeros (so every
    param's bits are independent of the others'), and a bucket with no gradient at all is
    not sent.

    Args:
      grads: name -> full local gradient (shape and dtype of the param), or ``None`` /
        missing for params that got no gradient this step. Every rank must have
        gradients for the same names (checked).
      layout: ``state.layout``.
      group: the sharding process group (``None``: default).
      stage: 1 reduces with an all-reduce (as ZeRO-1); 2 with the group's reduce
        realisation (``policy``). Both return only this rank's shards.
      bucket_numel: padded elements per bucket; a larger param travels alone.
      policy: how collectives are realised; default :class:`CommPolicy` (per backend).
      comm_dtype: dtype on the wire (default: the gradients' dtype).

    Returns:
      name -> ``(shard_numel,)`` mean-gradient shard in the gradient's dtype, for the
      names that had gradients (in layout order). Padding elements are zero.

    Collectives: one tiny ``all_gather`` (rank agreement, see ``check_ranks_agree``), then
    per bucket one ``reduce_scatter`` (stage 2, NCCL) or one ``all_reduce`` (stage 1, or
    stage 2 on gloo) of ``N*S`` elements.
    """
    if stage not in (1, 2):
        raise ValueError(f"reduce_grads: stage must be 1 or 2, got {stage!r}")
    if not isinstance(bucket_numel, int) or bucket_numel <= 0:
        raise ValueError(f"reduce_grads: bucket_numel must be a positive int (elements), got {bucket_numel!r}")
    checks.validate_world(layout, group, "reduce_grads")
    present = checks.validate_grads(grads, layout, group, "reduce_grads")
    device = next((grads[n].device for n in present), torch.device("cpu"))  # type: ignore[union-attr]
    checks.check_ranks_agree(
        layout,
        group,
        "reduce_grads",
        present=present,
        settings={"stage": stage, "bucket_numel": bucket_numel},
        device=device,
    )
    how = reduce_realisation(stage, group, policy)
    present_set = set(present)
    out: dict[str, torch.Tensor] = {}
    for bucket in layout.buckets(bucket_numel):
        if present_set.isdisjoint(bucket.names):
            continue
        row = launch_bucket_reduce(grads, layout, bucket, group, how, comm_dtype=comm_dtype).wait()
        out.update(split_bucket_row(row, layout, bucket, present_set))
    for name in present:
        if name not in out:  # empty params travel in no bucket
            out[name] = torch.empty(0, dtype=layout[name].dtype, device=device)
    return FrozenDict({name: out[name] for name in present})


def reduce_realisation(stage: int, group: Group, policy: CommPolicy | None) -> str:
    """The reduce collective for ``stage``: all-reduce for 1 (as ZeRO-1), the policy's for 2."""
    return "all_reduce" if stage == 1 else (policy or CommPolicy()).resolve(group)[0]


def _global_norm(
    grad_shards: Mapping[str, torch.Tensor], norm_type: float, group: Group, device: torch.device
) -> float:
    """Global ``norm_type`` norm of the mean gradient over the group, in float64.

    Padding is zero, so summing over padded shards equals the norm of the full grads.
    Returns ``inf``/``nan`` if any rank holds a non-finite gradient element.
    Collectives: one ``all_reduce`` of two float64 values.
    """
    if norm_type == 2.0:
        local = sum(
            (torch.linalg.vector_norm(g, 2, dtype=torch.float64) ** 2 for g in grad_shards.values()),
            torch.zeros((), dtype=torch.float64, device=device),
        )
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for g in grad_shards.values():
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().to(torch.float64))
    finite = bool(torch.isfinite(local))
    packed = torch.stack(
        [
            local if finite else torch.zeros_like(local),
            torch.tensor(0.0 if finite else 1.0, dtype=torch.float64, device=device),
        ]
    )
    total = comm.all_reduce_scalars(packed, "sum" if norm_type == 2.0 else "max", group)
    if float(total[1]) > 0:
        return math.inf
    value = float(total[0])
    return math.sqrt(value) if norm_type == 2.0 else value


def step_shards(
    state: ZeroState,
    grad_shards: Mapping[str, torch.Tensor],
    group: Group = None,
    max_norm: float | None = None,
    *,
    norm_type: float = 2.0,
    donate: bool = False,
) -> tuple[ZeroState, StepInfo]:
    r"""Clip by the global norm and apply the optimizer to this rank's shards.

    The global norm is over the whole mean gradient (all ranks' shards), computed in
    float64. With ``max_norm`` set, gradients are scaled by
    :math:`c = \text{max\_norm} / (\lVert g \rVert + 10^{-6})` when :math:`c < 1` (torch's
    ``clip_grad_norm_`` rule). If any gradient element on any rank is not finite, the step
    is skipped on every rank: the state is returned unchanged and ``info.skipped`` is True.
    Params absent from ``grad_shards`` (no gradient this step) keep their shard and their
    optimizer state, as torch.optim does.

    Args:
      state: the current state.
      grad_shards: from :func:`reduce_grads`: name -> ``(shard_numel,)`` shard.
      group: the sharding process group (``None``: default).
      max_norm: clip threshold, or ``None`` for no clipping.
      norm_type: 2.0 or ``math.inf``.
      donate: reuse ``state``'s and ``grad_shards``' tensors in place; do not use them after.

    Returns:
      ``(new_state, info)`` with ``new_state.step == state.step + 1`` unless skipped.

    Collectives: one ``all_reduce`` of two float64 scalars (norm and non-finite flag).
    """
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
        if tuple(g.shape) != (spec.shard_numel,):
            raise ValueError(
                f"step_shards on rank {state.rank}: shard of {name!r} has shape {tuple(g.shape)}, expected "
                f"({spec.shard_numel},) for a param of shape {spec.shape} over {state.layout.world_size} ranks; "
                "pass the output of reduce_grads, not full gradients"
            )
    device = next(iter(state.master.values())).device
    norm = _global_norm(grad_shards, norm_type, group, device)
    if not math.isfinite(norm):
        return state, StepInfo(norm, True, 1.0)
    coef = 1.0
    if max_norm is not None:
        coef = max_norm / (norm + 1e-6)
    clip = coef < 1.0
    grads = {}
    for name, g in grad_shards.items():
        master_dtype = state.master[name].dtype
        if clip:
            g = g.mul_(coef) if donate and g.dtype == master_dtype else g.to(master_dtype) * coef
        grads[name] = g.to(master_dtype)
    new_master, new_opt_state = state.optimizer.update(grads, state.opt_state, state.master, donate=donate)
    new_state = state.replace(master=FrozenDict(new_master), opt_state=new_opt_state, step=state.step + 1)
    return new_state, StepInfo(norm, False, coef if clip else 1.0)


def gather_params(
    state: ZeroState,
    group: Group = None,
    *,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    policy: CommPolicy | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """All ranks' master shards, gathered into full params in their original dtypes.

    Each bucket's shards are cast to the params' dtype (the wire carries working
    precision), gathered into a rank-major ``(N, S)`` buffer, and cut back into full
    tensors with the padding dropped.

    Args:
      state: the current state.
      group: the sharding process group (``None``: default).
      bucket_numel: padded elements per bucket.
      policy: how collectives are realised; default :class:`CommPolicy` (per backend).
      out: explicit donation of destination tensors: name -> tensor of the param's
        shape and dtype (e.g. the model's own parameters) to write into in place instead
        of allocating new ones. Validated before any collective.

    Returns:
      A new dict name -> full param (layout order, original shape and dtype), equal on
      every rank. Without ``out`` the caller owns fresh tensors that nothing in
      ``state`` aliases; with ``out`` the values are ``out``'s tensors.

    Collectives: one tiny ``all_gather`` (rank agreement), then per bucket one
    ``all_gather`` (NCCL) or one ``broadcast`` per rank (gloo) of ``S`` elements each.
    """
    layout = state.layout
    checks.validate_world(layout, group, "gather_params")
    if not isinstance(bucket_numel, int) or bucket_numel <= 0:
        raise ValueError(f"gather_params: bucket_numel must be a positive int (elements), got {bucket_numel!r}")
    device = next(iter(state.master.values())).device
    if out is not None:
        checks.validate_out(out, layout, "gather_params")
    checks.check_ranks_agree(layout, group, "gather_params", settings={"bucket_numel": bucket_numel}, device=device)
    how = (policy or CommPolicy()).resolve(group)[1]
    result = {
        s.name: out[s.name] if out is not None else torch.empty(s.shape, dtype=s.dtype, device=device)
        for s in layout.params
    }
    for bucket in layout.buckets(bucket_numel):
        dtype = layout[bucket.names[0]].dtype
        row = torch.cat([state.master[name].to(dtype) for name in bucket.names])
        gathered = comm.gather_rows(row, group, how).wait()
        with torch.no_grad():  # `out` may be leaf params that require grad
            for name, col in zip(bucket.names, bucket.offsets, strict=True):
                _full_from_rows(gathered, layout[name], col, result[name])
    return result
