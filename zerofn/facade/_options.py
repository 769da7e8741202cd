"""The facade's options: its keywords turned into what the stage functions take.

Everything here reads the user's arguments and the params' dtypes and either returns a
value or raises before anything is changed (``cast_params`` excepted: it applies a
validated ``forced_dtype``). Collectives: only :func:`hybrid_groups` (group creation).

The precision keywords of ``ZeroOptimizer`` (:func:`precision_policy` turns them
into a :class:`~zerofn.precision.PrecisionPolicy`; with ``precision=`` they must stay at
their defaults):

  communication_dtype: dtype gradients are cast to on the wire (``None``: the params'
    working dtype).
  initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
  hysteresis, max_scale: the dynamic loss scaler used when the (working) params are
    float16 (their meanings: :class:`~zerofn.precision.DynamicLossScaler`);
    ``backward`` multiplies the loss (``backward_by_grad`` the given gradient) by the
    current scale. bfloat16 and float32 params train without loss scaling.
  nonfinite: what a step with an ``inf``/``nan`` gradient does when there is no
    dynamic loss scaler (bf16, fp32): ``"skip"`` it on every rank, or ``"raise"``
    :class:`~zerofn.precision.NonFiniteGradError` naming the params on every rank.
  cpu_offload: keep master shards and optimizer state on the CPU.
  forced_dtype: cast every param (``p.data``) to this dtype at construction.
  master_weights: keep float32 master shards (default); False: the optimizer
    updates working-dtype shards directly.
  grad_accum_dtype: dtype micro-batch gradients are summed in under ``no_sync``:
    ``"auto"`` (float32 for float16/bfloat16 params: Ψ·4 bytes of accumulators for
    the accumulation window), None (``p.grad`` as in plain torch) or a dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn import optim, torch_optim
from zerofn.precision import (
    DynamicLossScaler,
    MixedDtypeError,
    NoLossScaling,
    PrecisionPolicy,
    resolve_param_dtypes,
)

__all__ = [
    "PRECISION_DEFAULTS",
    "PrecisionKeywords",
    "cast_params",
    "check_gather_module",
    "check_settings",
    "hybrid_groups",
    "is_optimizer_list",
    "precision_policy",
    "resolve_params",
    "torch_bookkeeping",
    "update_rules",
]


@dataclasses.dataclass(frozen=True)
class PrecisionKeywords:
    """``ZeroOptimizer``'s precision keywords, as given (their defaults are the signature's,
    which a test pins); with ``precision=PrecisionPolicy(...)`` they must stay at these."""

    communication_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    forced_dtype: torch.dtype | None = None
    master_weights: bool = True
    nonfinite: str = "skip"
    grad_accum_dtype: Any = "auto"
    initial_scale: float = 2**16
    min_scale: float = 1
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 2
    max_scale: float = 2**24

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# The defaults by name (the Lightning strategies take the same keywords).
PRECISION_DEFAULTS: dict[str, Any] = PrecisionKeywords().as_dict()
_SCALER_KEYS = (
    "initial_scale",
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "max_scale",
)


def check_settings(reduce_bucket_size: Any, norm_type: Any, clip_grad_norm: Any) -> None:
    """The numeric options, checked before anything else happens."""
    if not isinstance(reduce_bucket_size, int) or reduce_bucket_size <= 0:
        raise ValueError(f"ZeroOptimizer: reduce_bucket_size must be a positive int, got {reduce_bucket_size!r}")
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"ZeroOptimizer: norm_type must be 2.0 or math.inf, got {norm_type!r}")
    if not (clip_grad_norm >= 0 and math.isfinite(clip_grad_norm)):
        raise ValueError(f"ZeroOptimizer: clip_grad_norm must be a finite number >= 0, got {clip_grad_norm!r}")


def cast_params(named: Mapping[str, torch.Tensor], policy: PrecisionPolicy) -> None:
    """Cast every param to the policy's forced dtype (``p.data``), in place; drops stale ``p.grad``."""
    for p in named.values():
        if policy.param_dtype is not None and p.dtype != policy.param_dtype:
            p.grad = None
            p.data = p.data.to(policy.param_dtype)


def check_gather_module(named: Mapping[str, torch.Tensor], module: torch.nn.Module | None) -> None:
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


def precision_policy(
    named: Mapping[str, torch.Tensor], precision: PrecisionPolicy | None, keywords: PrecisionKeywords
) -> PrecisionPolicy:
    """The facade's precision policy: ``precision`` itself, or one built from the precision keywords.

    Reads only dtypes; raises before anything is changed.
    """
    options = keywords.as_dict()
    if precision is not None:
        if not isinstance(precision, PrecisionPolicy):
            what = type(precision).__name__
            raise TypeError(f"ZeroOptimizer: precision must be a zerofn.PrecisionPolicy, got {what}")
        changed = sorted(k for k, v in options.items() if v != PRECISION_DEFAULTS[k])
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
            loss_scaler=DynamicLossScaler(**{k: options[k] for k in _SCALER_KEYS}) if fp16 else NoLossScaling(),
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


def hybrid_groups(
    dp_group: dist.ProcessGroup | None, sub_dp_size: int, replicate_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replicate group) from ``sub_dp_size`` or an explicit pair.

    With ``sub_dp_size = k`` the data-parallel ranks, in order, are read as a
    ``(k, N / k)`` grid: row ``i`` is a shard group, column ``j`` the replicas of shard
    position ``j`` (built by :func:`zerofn._comm_setup.grid_groups`, collectively).
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
    return comm_setup.grid_groups(dp_group, sub_dp_size)


def _torch_named_groups(
    torch_opt: torch.optim.Optimizer, names: Mapping[int, str], prefix: str
) -> list[list[tuple[str, torch.Tensor]]]:
    """``torch_opt``'s param groups as (name, param) lists, requires_grad params only.

    Names come from ``module.named_parameters()`` (``names``: id -> name), else
    ``"{prefix}group{g}.param{i}"``.
    """
    return [
        [(names.get(id(p), f"{prefix}group{g}.param{i}"), p) for i, p in enumerate(group["params"]) if p.requires_grad]
        for g, group in enumerate(torch_opt.param_groups)
    ]


def is_optimizer_list(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a non-empty list/tuple of torch optimizers (``ZeroOptimizer([muon, adamw])``)."""
    return (
        isinstance(optimizer, (list, tuple))
        and len(optimizer) > 0
        and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
    )


def _resolve_list(
    torch_opts: list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...], module: torch.nn.Module | None
) -> tuple[list[list[tuple[str, torch.Tensor]]], optim.Optimizer, list[dict[str, Any]]]:
    """Several torch optimizers as one :func:`zerofn.optim.partition` (see :func:`resolve_params`).

    Every param must be in exactly one of them; with ``module=`` every trainable param of
    the module must be in one (a param no optimizer updates would silently not train).
    Raises before anything is changed, naming the param.
    """
    for o in torch_opts:
        torch_optim.check_shardable(type(o))
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    where: dict[int, int] = {}
    for k, o in enumerate(torch_opts):
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) in where and where[id(p)] != k:
                    what = repr(names[id(p)]) if id(p) in names else f"of shape {tuple(p.shape)}"
                    raise ValueError(
                        f"ZeroOptimizer: param {what} is in optimizers[{where[id(p)]}] and optimizers[{k}]; each "
                        "param must be in exactly one of the wrapped optimizers: take it out of one of them"
                    )
                where[id(p)] = k
    if module is not None:
        missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in where]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(
                f"ZeroOptimizer: {len(missing)} trainable param(s) of module= are in none of the wrapped optimizers "
                f"({shown}); each param must be in exactly one of them: add it to one (e.g. the AdamW for "
                "everything that is not a hidden matrix), or set requires_grad=False"
            )
    per_opt = [_torch_named_groups(o, names, f"opt{k}.") for k, o in enumerate(torch_opts)]
    fopt = torch_optim.from_torch_optimizers(torch_opts, [[[n for n, _ in g] for g in groups] for groups in per_opt])
    named_groups = [g for groups in per_opt for g in groups]
    # The wrapped optimizers' own group dicts, in order: live for their LR schedulers.
    return named_groups, fopt, [g for o in torch_opts for g in o.param_groups]


def resolve_params(
    optimizer: Any, functional: optim.Optimizer | None, module: torch.nn.Module | None
) -> tuple[list[list[tuple[str, torch.Tensor]]], optim.Optimizer, list[dict[str, Any]]]:
    """Named param groups (requires_grad only), the functional optimizer, live torch groups.

    ``optimizer`` is a torch optimizer (its own groups stay live), a list of torch
    optimizers (a :func:`zerofn.optim.partition` with one part per optimizer, their groups
    one after the other) or named params with ``functional``.
    """
    if isinstance(optimizer, torch.optim.Optimizer) or is_optimizer_list(optimizer):
        if functional is not None:
            raise TypeError("ZeroOptimizer: give a torch optimizer or named params + a zerofn optimizer, not both")
    if is_optimizer_list(optimizer):
        return _resolve_list(optimizer, module)
    if isinstance(optimizer, (list, tuple)) and any(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        others = sorted({type(o).__name__ for o in optimizer if not isinstance(o, torch.optim.Optimizer)})
        raise TypeError(
            f"ZeroOptimizer: a list of optimizers must hold torch.optim.Optimizer instances only, found "
            f"{', '.join(others)}: ZeroOptimizer([muon, adamw], ...)"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        torch_optim.check_shardable(type(optimizer))
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        named_groups = _torch_named_groups(optimizer, names, "")
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


def torch_bookkeeping(opt: torch.optim.Optimizer, defaults: Mapping[str, Any]) -> None:
    """``torch.optim.Optimizer``'s attributes on ``opt`` (its hooks' registries, ``defaults``),
    without its per-param ``state`` dict: the facade's state is a ZeroState."""
    opt.defaults = dict(defaults)
    opt._optimizer_step_pre_hooks = {}
    opt._optimizer_step_post_hooks = {}
    opt._optimizer_state_dict_pre_hooks = {}
    opt._optimizer_state_dict_post_hooks = {}
    opt._optimizer_load_state_dict_pre_hooks = {}
    opt._optimizer_load_state_dict_post_hooks = {}


def update_rules(optimizer: optim.Optimizer, names: Iterable[str]) -> str:
    """Which update rule each param gets (``name:optimizer:torch class``), for the ranks to compare.

    Equal on ranks that built the same optimizers over the same params. Ranks whose
    placements agree may still wrap different optimizers (``[Adafactor(matrices), AdamW]``
    on one rank, ``[Muon(matrices), AdamW]`` on another: every matrix whole on both); each
    owner would then update its whole params with its own rule, silently, and the state
    dict of "Muon" would hold Adafactor's statistics. Its :func:`zerofn._agreement.text_hash`
    belongs in the construction's :func:`~zerofn._agreement.check_ranks_agree` settings.
    Hyperparameters are left out (a callable's repr differs between processes).
    """
    rules = []
    for name in names:
        rule = optimizer.parts[optimizer.part_index(name)][1] if optimizer.parts else optimizer
        rules.append(f"{name}:{rule.name}:{rule.torch_class.__name__}")
    return "\n".join(rules)
