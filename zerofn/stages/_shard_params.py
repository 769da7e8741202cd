"""``shard_params``: the first ZeroState from full params, and the placement every param gets."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn import _sync, flat
from zerofn._comm import Group
from zerofn._wire._bucket import init_residual
from zerofn.buckets import cut_shard
from zerofn.layout import block_of, make_layout
from zerofn.optim import Optimizer
from zerofn.precision import PrecisionPolicy, resolve_param_dtypes
from zerofn.stages._pipeline import DEFAULT_BUCKET_NUMEL, check_bucket_numel
from zerofn.state import DEFAULT_POLICY, ZeroState, tensor_numbers


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
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> ZeroState:
    """The first ZeroState: this rank's master shards of ``params`` and fresh optimizer state.

    Args:
      params: name -> full param, any shapes, floating dtypes, one device. In the order
        every rank uses (``dict(model.named_parameters())``). Not changed or aliased.
      optimizer: a :mod:`zerofn.optim` optimizer; its ``init`` runs on the shards.
      group: the sharding process group (``None``: default). Only its size and this
        rank's index are read.
      master_dtype: dtype of the master shards and optimizer state (float32; a wider
        param, float64, keeps its own), when no ``precision`` is given.
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
        ``precision.loss_scaler.init()``.
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
      bucket_numel: padded elements per bucket of ``gather_params`` when it is given
        none (``state.bucket_numel``). Every ``step_shards`` confirms it equal on every
        rank with the layout, inside its scalar all-reduce, so a gather of its result
        needs no agreement of its own.

    Returns:
      A :class:`ZeroState` whose ``master[name]`` is, for a split param, chunk ``rank`` of
      the padded flat param, shape ``(ceil(numel / N),)``; for a whole param the full
      param (its shape) on its owner rank, absent on the others. ``precision`` is the
      policy used. ``step`` (0) and the loss-scale state are 0-d tensors on the params'
      device (int64 step and counters, float64 scale), so the same state steps eagerly and
      under ``torch.compile``.

    Collectives: with ``check`` (the default) one all-gather of two int64 values (the
    layout fingerprint and a digest of the params' checksums); with ``sync`` one tiny
    all-gather and one ``broadcast`` per dtype of all the params instead; with
    ``check=False`` none. Ranks' layouts are compared by the first ``reduce_grads`` /
    ``gather_params`` (or call :func:`zerofn.check_ranks_agree` yourself).
    """
    checks.validate_params(params, "shard_params")
    check_bucket_numel(bucket_numel, "shard_params")
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
    shards = {
        s.name: cut_shard(
            params[s.name], s, rank, dtype=policy.master_dtype_for(s.dtype), device=state_device, round_to=s.dtype
        )
        for s in layout.params
        if s.holds(rank)
    }
    fl = flat.flat_layout(layout, rank)
    master = flat.pack(fl, shards)  # every shard this rank holds (none: an empty FlatDict)
    opt_state = optimizer.init(master, layout=layout)
    step, loss_scale = tensor_numbers(0, policy.loss_scaler.init(), param_device)
    wire = policy.wire
    residual = init_residual(layout, bucket_numel, wire, param_device) if wire and wire.error_feedback else ()
    return ZeroState(
        layout,
        optimizer,
        rank,
        master,
        opt_state,
        step,
        loss_scale=loss_scale,
        precision=policy,
        param_device=str(param_device),
        bucket_numel=bucket_numel,
        residual=residual,
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
