r"""Mixed precision: the dtype policy and the loss scaler as a pure state machine.

Nothing here talks to the network or changes a tensor it is given. Two kinds of value
live in this module:

- :class:`PrecisionPolicy`, static metadata (a frozen, hashable dataclass) that says which
  dtype each copy of a parameter lives in and where the master copy lives:

  | copy | what it is | field |
  |---|---|---|
  | working | the full params forward/backward runs on, and their grads | ``param_dtype`` |
  | accumulation | grads summed over micro-batches before ``reduce_grads`` | ``grad_accum_dtype`` |
  | wire | grads inside the reduce collective | ``comm_dtype`` |
  | master | this rank's shard the optimizer updates, and its state | ``master_dtype`` |

- loss scalers (:class:`DynamicLossScaler`, :class:`StaticLossScaler`,
  :class:`NoLossScaling`): hyperparameters in a frozen dataclass plus two pure functions,
  ``init() -> LossScaleState`` and ``update(state, found_overflow) -> LossScaleState``.
  The state is a NamedTuple, so it is a pytree and can sit in ``ZeroState`` next to the
  step count.

A training step with loss scaling, in the order the stage functions apply it::

    loss_scaled = scale_loss(loss, ls)              # before backward
    ...backward, reduce_grads...                    # grads: ls.scale * true grads
    found = <any grad shard on any rank not finite> # ONE flag all-reduce over the
                                                    # data-parallel group, before
                                                    # any state changes
    new_ls = scaler.update(ls, found)               # every rank, same inputs
    if found: skip (master, optimizer state, step unchanged; only new_ls is kept)
    else:     grads *= unscale_and_clip_coef(norm_scaled, ls.scale, max_norm)
              # the OLD scale: the grads carry it, even when update just grew it
              optimizer step
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

# The loss scalers live in zerofn._loss_scale (no dtypes there); users find them here.
from zerofn._loss_scale import DynamicLossScaler as DynamicLossScaler
from zerofn._loss_scale import LossScaler as LossScaler
from zerofn._loss_scale import LossScaleState as LossScaleState
from zerofn._loss_scale import NoLossScaling as NoLossScaling
from zerofn._loss_scale import StaticLossScaler as StaticLossScaler
from zerofn._loss_scale import scale_loss as scale_loss
from zerofn._tree import FrozenDict
from zerofn._wire._policy import CompressedWire

__all__ = [
    "CompressedWire",
    "DynamicLossScaler",
    "LossScaleState",
    "LossScaler",
    "MixedDtypeError",
    "NoLossScaling",
    "NonFiniteGradError",
    "PrecisionPolicy",
    "StaticLossScaler",
    "clip_coef",
    "mul_grads_",
    "nonfinite_grad_names",
    "resolve_param_dtypes",
    "scale_loss",
    "unscale_and_clip_coef",
    "unscaled_norm",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------------------
# Unscaling and clipping (the loss scalers are in zerofn._loss_scale)
# ---------------------------------------------------------------------------------------


def unscaled_norm(grad_norm_scaled: float | torch.Tensor, scale: float) -> float:
    r"""The true gradient norm from the norm of loss-scaled gradients: :math:`n / s`.

    This is the norm zerofn reports (``StepInfo.grad_norm``, ``get_grad_norm()``): the
    norm of the gradients the optimizer would see without clipping, independent of the
    loss scale. Any norm type works, since every p-norm is homogeneous.

    Examples:
      >>> unscaled_norm(3072.0, 1024.0)
      3.0
    """
    return float(grad_norm_scaled) / scale


def unscale_and_clip_coef(
    grad_norm_scaled: float | torch.Tensor,
    scale: float,
    max_norm: float | None,
) -> float:
    r"""The single multiplier that unscales and clips loss-scaled gradients.

    With :math:`n` the global norm of the *scaled* gradients, :math:`s` the loss scale
    and :math:`m` = ``max_norm``:

    .. math::

        c = \frac{n / s + 10^{-6}}{m}, \qquad
        d = \begin{cases} c\, s & m \ne \text{None and } c > 1 \\ s & \text{otherwise}
            \end{cases}, \qquad \text{coef} = 1 / d

    so ``grads * coef`` equals ``true_grads * min(1, m / (n/s + 1e-6))``: unscaling first,
    then clipping the *true* norm to ``m`` (the classic unscale-then-clip formula,
    evaluated in this order). The norm type (2 or inf) only changes how :math:`n` was computed.

    The norm to report is the true one, ``unscaled_norm(n, s)`` = :math:`n / s`; the
    loss-scaled :math:`n` would change with the scale and mean nothing to a user.

    Args:
      grad_norm_scaled: the global norm of the loss-scaled gradients; must be finite
        (skip non-finite steps before calling this).
      scale: the loss scale the gradients carry (``state.scale``; 1.0 without scaling).
      max_norm: the clip threshold on the true norm, or ``None`` for no clipping.

    Returns:
      The Python float to multiply every gradient element by.

    Examples:
      >>> unscale_and_clip_coef(300.0, 100.0, max_norm=None)  # unscale only
      0.01
      >>> coef = unscale_and_clip_coef(300.0, 100.0, max_norm=1.0)  # true norm 3 -> 1
      >>> round(300.0 * coef, 6)
      1.0
    """
    norm = float(grad_norm_scaled)
    if not math.isfinite(norm) or norm < 0:
        raise ValueError(
            f"unscale_and_clip_coef: grad_norm_scaled must be finite and >= 0, got {norm!r}; "
            "a step with non-finite gradients is skipped before unscaling"
        )
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"unscale_and_clip_coef: scale must be positive and finite, got {scale!r}")
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
        msg = f"max_norm must be a positive finite number or None (no clipping), got {max_norm!r}"
        raise ValueError(f"unscale_and_clip_coef: {msg}")
    div = scale
    if max_norm is not None:
        clip = ((norm / scale) + 1e-6) / max_norm
        if clip > 1:
            div = clip * scale
    return 1.0 / div


def clip_coef(total_norm: float, max_norm: float) -> float:
    r"""``torch.nn.utils.clip_grad_norm_``'s factor: :math:`\min(1, m / (n + 10^{-6}))`.

    Args:
      total_norm: the global norm :math:`n` of the true (unscaled) gradients; finite, >= 0.
      max_norm: the threshold :math:`m`, >= 0.

    Returns:
      The Python float to multiply every gradient by (1.0: nothing to clip).

    Examples:
      >>> clip_coef(3.0, 1.0) == 1.0 / (3.0 + 1e-6)
      True
      >>> clip_coef(0.5, 1.0)
      1.0
    """
    if not (math.isfinite(total_norm) and total_norm >= 0):
        raise ValueError(f"clip_coef: total_norm must be finite and >= 0, got {total_norm!r}")
    if not (math.isfinite(max_norm) and max_norm >= 0):
        raise ValueError(f"clip_coef: max_norm must be finite and >= 0, got {max_norm!r}")
    return min(1.0, max_norm / (total_norm + 1e-6))


def mul_grads_(grads: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply gradients in place by ``factor``, as ``clip_grad_norm_`` and ``GradScaler.unscale_`` do.

    The factor is a 0-d tensor in mul's compute dtype (float32; float64 for float64
    gradients), so a float16/bfloat16 gradient is multiplied by the float32 factor and
    rounded once, as torch's own clipping and unscaling round it. One ``_foreach_mul_``
    per (device, dtype).

    Args:
      grads: tensors to scale in place (any floating dtypes and devices; any strides).
      factor: the multiplier (a clip coefficient, or ``1 / loss scale`` to unscale).

    Collectives: none.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), tensors in groups.items():
        scalar = torch.tensor(factor, dtype=torch.promote_types(dtype, torch.float32), device=device)
        torch._foreach_mul_(tensors, scalar)


class NonFiniteGradError(FloatingPointError):
    """A gradient held ``inf`` or ``nan`` and the policy says ``nonfinite="raise"``."""


def nonfinite_grad_names(grads: Mapping[str, torch.Tensor | None]) -> list[str]:
    """Names of the gradients that hold any ``inf`` or ``nan``, in mapping order.

    For the error message of ``nonfinite="raise"``; reads one bool per gradient (a device
    synchronisation each), so call it only once a step is known to be bad.

    Examples:
      >>> nonfinite_grad_names({"w": torch.ones(2), "b": torch.tensor([float("nan")]), "c": None})
      ['b']
    """
    return [n for n, g in grads.items() if g is not None and not bool(torch.isfinite(g).all())]


# ---------------------------------------------------------------------------------------
# Dtype policy
# ---------------------------------------------------------------------------------------


class MixedDtypeError(TypeError):
    """The params have more than one dtype and the policy does not say what to do."""


_MIXED_DTYPES_HELP = (
    "zerofn needs one rule for them. Pass PrecisionPolicy(param_dtype=<dtype>) to cast every "
    "param to one working dtype when the state is built, PrecisionPolicy(mixed_dtypes='keep') "
    "to keep each param's own dtype (e.g. float32 norms in a bfloat16 model), or convert the "
    "model first with model.to(<dtype>)."
)
_SHOW_NAMES = 4
GradAccumDtype = torch.dtype | Literal["auto"] | None


def _check_dtype(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"PrecisionPolicy: {name} must be a torch.dtype, got {value!r}")
    if not value.is_floating_point:
        raise ValueError(f"PrecisionPolicy: {name}={value} is not a floating-point dtype")


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each copy of a parameter lives in, and where the master copy lives.

    A frozen, hashable value: static metadata next to the layout, never a pytree leaf.
    Build the usual ones with :meth:`for_dtype`.

    Attributes:
      param_dtype: the working dtype of the full params (and their grads). ``None`` keeps
        the params' own dtype; a dtype casts every param to it when the state is built
        (a "forced dtype"), which also settles a model with mixed dtypes.
      master_dtype: the dtype of the master shards and the optimizer state (float32);
        a param whose working dtype is wider (float64) keeps its own. Must be at least as
        wide as ``param_dtype``.
      comm_dtype: the dtype gradients travel in through the reduce collective (cast
        before, cast back after); ``None``: the gradients' own dtype.
      wire: a :class:`~zerofn.CompressedWire` to reduce gradients as block-scaled
        one-byte codes with error feedback, summed in float32 (instead of ``comm_dtype``,
        which must then be ``None``); ``None``: a floating wire.
      grad_accum_dtype: the dtype gradients are summed in across micro-batches.
        ``"auto"`` (default): float32 for float16/bfloat16 working params, else the working
        dtype; ``None``: the working dtype; or an explicit dtype.
      master_weights: ``True``: the optimizer updates ``master_dtype`` copies of the shards.
        ``False``: it updates the working-dtype shards directly (no extra copy, less
        accuracy); ``master_dtype`` must then stay at its default.
      state_device: where master shards and optimizer state live, e.g. ``"cpu"`` for CPU
        offload (grads move there, updated params move back each step); ``None``: the
        params' device.
      nonfinite: what a step does when a gradient holds ``inf``/``nan`` and the loss
        scaler is not dynamic: ``"skip"`` the step on every rank (state untouched), or
        ``"raise"`` :class:`NonFiniteGradError` naming the params. A dynamic scaler always
        skips (an overflow is how it learns), so it requires ``"skip"``.
      mixed_dtypes: ``"error"`` (default): params of more than one dtype raise
        :class:`MixedDtypeError` unless ``param_dtype`` is set; ``"keep"``: each param keeps
        its own working dtype.
      loss_scaler: a :class:`DynamicLossScaler`, :class:`StaticLossScaler` or
        :class:`NoLossScaling` (default). float16 training wants a dynamic one.

    Examples:
      >>> p = PrecisionPolicy.for_dtype(torch.float16)
      >>> p.param_dtype, p.master_dtype, p.grad_accum_dtype_for(torch.float16)
      (torch.float16, torch.float32, torch.float32)
      >>> type(p.loss_scaler).__name__
      'DynamicLossScaler'
      >>> PrecisionPolicy.for_dtype(torch.bfloat16, state_device="cpu").cpu_offload
      True
    """

    param_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype | None = None
    wire: CompressedWire | None = None
    grad_accum_dtype: GradAccumDtype = "auto"
    master_weights: bool = True
    state_device: str | None = None
    nonfinite: Literal["skip", "raise"] = "skip"
    mixed_dtypes: Literal["error", "keep"] = "error"
    loss_scaler: LossScaler = dataclasses.field(default_factory=NoLossScaling)

    def __post_init__(self) -> None:
        who = "PrecisionPolicy"
        _check_dtype("param_dtype", self.param_dtype, optional=True)
        _check_dtype("master_dtype", self.master_dtype, optional=False)
        _check_dtype("comm_dtype", self.comm_dtype, optional=True)
        if self.wire is not None and not isinstance(self.wire, CompressedWire):
            raise TypeError(f"{who}: wire must be a zerofn.CompressedWire or None, got {self.wire!r}")
        if self.wire is not None and self.comm_dtype is not None:
            raise ValueError(
                f"{who}: comm_dtype={self.comm_dtype} and a compressed wire: the compressed wire sends "
                "one-byte codes and sums them in float32; drop comm_dtype"
            )
        if self.grad_accum_dtype != "auto":
            _check_dtype("grad_accum_dtype", self.grad_accum_dtype, optional=True)
        if not isinstance(self.master_weights, bool):
            raise TypeError(f"{who}: master_weights must be a bool, got {self.master_weights!r}")
        if not self.master_weights and self.master_dtype != torch.float32:
            raise ValueError(
                f"PrecisionPolicy: master_dtype={self.master_dtype} has no effect with "
                "master_weights=False (the optimizer then updates the working-dtype shards); "
                "drop one of the two"
            )
        if (
            self.master_weights
            and self.param_dtype is not None
            and torch.finfo(self.master_dtype).bits < torch.finfo(self.param_dtype).bits
        ):
            raise ValueError(
                f"PrecisionPolicy: master_dtype={self.master_dtype} is narrower than param_dtype="
                f"{self.param_dtype}; the master copy must be at least as precise as the "
                "working params"
            )
        if self.state_device is not None:
            try:
                device = torch.device(self.state_device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(
                    f"PrecisionPolicy: state_device={self.state_device!r} is not a device; "
                    "use e.g. 'cpu' (CPU offload) or 'cuda', or None for the params' device "
                    f"({e})"
                ) from None
            object.__setattr__(self, "state_device", str(device))
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"{who}: nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        if self.mixed_dtypes not in ("error", "keep"):
            msg = f"mixed_dtypes must be 'error' or 'keep', got {self.mixed_dtypes!r}"
            raise ValueError(f"{who}: {msg}")
        if not isinstance(self.loss_scaler, LossScaler):
            raise TypeError(
                "PrecisionPolicy: loss_scaler must be a DynamicLossScaler, StaticLossScaler or "
                f"NoLossScaling, got {type(self.loss_scaler).__name__}"
            )
        if isinstance(self.loss_scaler, DynamicLossScaler) and self.nonfinite == "raise":
            raise ValueError(
                "PrecisionPolicy: a DynamicLossScaler needs nonfinite='skip': it finds its "
                "scale by overflowing now and then and skipping those steps. Use "
                "nonfinite='raise' with StaticLossScaler or NoLossScaling."
            )

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, **changes: Any) -> PrecisionPolicy:
        """The usual policy for training in ``dtype``, with ``changes`` on top.

        - float16: float16 params, float32 master and accumulation, dynamic loss scaling.
        - bfloat16: bfloat16 params, float32 master and accumulation, no loss scaling.
        - float32 / float64: that dtype throughout, no loss scaling.

        Args:
          dtype: the working dtype.
          **changes: any other field, e.g. ``state_device="cpu"`` or
            ``loss_scaler=DynamicLossScaler(initial_scale=2**12)``.

        Returns:
          A validated :class:`PrecisionPolicy`.
        """
        _check_dtype("dtype", dtype, optional=False)
        fields: dict[str, Any] = {"param_dtype": dtype}
        if dtype == torch.float16:
            fields["loss_scaler"] = DynamicLossScaler()
        if dtype == torch.float64:
            fields["master_dtype"] = torch.float64
        return cls(**{**fields, **changes})

    def replace(self, **changes: Any) -> PrecisionPolicy:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is multiplied by a loss scale: not under :class:`NoLossScaling`,
        whose scale is 1 by definition (a step divides by the constant 1, whatever number
        the state's ``loss_scale`` holds, and so makes no pass over the gradients for it)."""
        return not isinstance(self.loss_scaler, NoLossScaling)

    @property
    def cpu_offload(self) -> bool:
        """True when master shards and optimizer state live on the CPU."""
        return self.state_device == "cpu"

    def grad_accum_dtype_for(self, working: torch.dtype) -> torch.dtype:
        """The accumulation dtype for a param whose working dtype is ``working``."""
        if self.grad_accum_dtype == "auto":
            return torch.float32 if working in _LOW_PRECISION else working
        return working if self.grad_accum_dtype is None else self.grad_accum_dtype

    def comm_dtype_for(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype on the wire for gradients of dtype ``grad_dtype``."""
        return grad_dtype if self.comm_dtype is None else self.comm_dtype

    def master_dtype_for(self, working: torch.dtype) -> torch.dtype:
        """The dtype of the shard the optimizer updates, for working dtype ``working``: never
        narrower than ``working``, so float64 params keep float64 masters and state (as
        ``torch.optim`` keeps them) under the float32 default."""
        if not self.master_weights:
            return working
        return working if torch.finfo(working).bits > torch.finfo(self.master_dtype).bits else self.master_dtype


def resolve_param_dtypes(
    params: Mapping[str, torch.Tensor],
    policy: PrecisionPolicy,
) -> FrozenDict[torch.dtype]:
    """Each param's working dtype under ``policy``; raises on unhandled mixed dtypes.

    Reads only ``.dtype``; no tensor is cast or changed.

    Args:
      params: name -> param tensor (e.g. ``dict(model.named_parameters())``).
      policy: the precision policy.

    Returns:
      A read-only name -> working dtype mapping in ``params``' order: ``param_dtype`` for
      every name when set, else each param's own dtype.

    Raises:
      MixedDtypeError: the params have several dtypes, ``param_dtype`` is None and
        ``mixed_dtypes="error"``; the message lists the names per dtype.
      TypeError: a param is not a floating-point tensor.

    Examples:
      >>> params = {"w": torch.zeros(2, dtype=torch.float16), "b": torch.zeros(2)}
      >>> dict(resolve_param_dtypes(params, PrecisionPolicy(param_dtype=torch.float16)))
      {'w': torch.float16, 'b': torch.float16}
      >>> try:
      ...     resolve_param_dtypes(params, PrecisionPolicy())
      ... except MixedDtypeError as e:
      ...     print(str(e).split(". ")[0])
      params have mixed dtypes: torch.float16: 'w'; torch.float32: 'b'
    """
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, p in params.items():
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            what = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
            raise TypeError(
                f"resolve_param_dtypes: param {name!r} is {what}, not a floating-point tensor; "
                "pass only trainable params (model.named_parameters())"
            )
        by_dtype.setdefault(p.dtype, []).append(name)
    if policy.param_dtype is not None:
        return FrozenDict({name: policy.param_dtype for name in params})
    if len(by_dtype) > 1 and policy.mixed_dtypes == "error":
        parts = []
        for dtype, names in by_dtype.items():
            shown = ", ".join(repr(n) for n in names[:_SHOW_NAMES])
            more = f" and {len(names) - _SHOW_NAMES} more" if len(names) > _SHOW_NAMES else ""
            parts.append(f"{dtype}: {shown}{more}")
        raise MixedDtypeError(f"params have mixed dtypes: {'; '.join(parts)}. {_MIXED_DTYPES_HELP}")
    return FrozenDict({name: p.dtype for name, p in params.items()})
