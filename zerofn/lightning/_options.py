"""zerofn's options of both Lightning strategies: the integrations' options and the checkpoint's.

:class:`~zerofn.lightning.ZeroStrategy` (Fabric) and
:class:`~zerofn.lightning.ZeroTrainerStrategy` (Trainer) take the same zerofn keywords,
next to their own Lightning ones, and hand them to :class:`ZeroOptions`: every integration's
keywords (:class:`zerofn._integration_options.IntegrationOptions`, shared with
:mod:`zerofn.hf`: their names, meanings, defaults and translation into ``ZeroOptimizer``'s
keywords live there once) and Lightning's checkpoint keywords.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from zerofn._integration_options import IntegrationOptions
from zerofn._wire._policy import CompressedWire
from zerofn.facade._options import PRECISION_DEFAULTS, PrecisionKeywords, precision_policy
from zerofn.facade.optimizer import ZeroOptimizer

__all__ = ["ZeroOptions", "one_torch_optimizer", "register_names"]


@dataclasses.dataclass(frozen=True)
class ZeroOptions(IntegrationOptions):
    """zerofn's keywords of ``ZeroStrategy(...)`` and ``ZeroTrainerStrategy(...)``; ``ZeroOptions()`` is ZeRO-2.

    Every keyword of the integrations (``stage``, ``reduce_bucket_size``,
    ``overlap_communication``, ``overlap_allgather``, ``communication_dtype``,
    ``cpu_offload``, ``master_weights``, ``grad_accum_dtype``, ``sub_dp_size``,
    ``broadcast_buffers``, ``nonfinite``, the loss scaler's ``initial_scale``,
    ``min_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``hysteresis``, ``max_scale``, and ``comm_policy``, ``entry_timeout``, ``compile``:
    ``ZeroOptimizer``'s meanings and defaults; ``initial_scale`` & co. apply under
    ``precision="16-mixed"``), and:

    Args:
      communication_wire: a :class:`~zerofn.CompressedWire` to reduce the gradients as
        block-scaled one-byte codes with error feedback (``PrecisionPolicy(wire=...)``, the
        residual in the ZeroOptimizer's state), instead of ``communication_dtype`` (which
        must then stay ``None``); ``stage=2`` only. ``None``: a floating wire.
      state_dict_type: ``"sharded"``: a checkpoint is a zerofn sharded checkpoint (every
        rank writes its shards, DCP); ``"full"``: Lightning's one file with the optimizer in
        torch's format (gathered on every rank). Loading reads either.
      safe_globals: the classes (and functions) beyond data that a checkpoint's entries may
        pickle, admitted by name as ``torch.serialization.safe_globals`` admits them, on save
        (the sharded checkpoint records them) and on load (either format: both are read with
        ``weights_only=True``). Empty: a checkpoint is data only (tensors, numbers, strings,
        bools, ``None``, containers, dtypes, devices), and an entry that is not is refused
        at save, naming its key path and type. Admit only classes of checkpoints you trust.
    """

    state_dict_type: Literal["sharded", "full"] = "sharded"
    safe_globals: tuple[Any, ...] = ()
    communication_wire: CompressedWire | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "safe_globals", tuple(self.safe_globals))
        wire = self.communication_wire
        if wire is not None and not isinstance(wire, CompressedWire):
            raise TypeError(f"communication_wire must be a zerofn.CompressedWire or None, got {wire!r}")
        if wire is not None and self.communication_dtype is not None:
            raise ValueError(
                f"communication_wire and communication_dtype={self.communication_dtype}: the compressed wire sends "
                "one-byte codes and sums them in float32; drop communication_dtype"
            )
        if wire is not None and self.stage != 2:
            raise ValueError("communication_wire leaves each rank its shard of the mean gradient: use stage=2")
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {self.state_dict_type!r}")
        super().__post_init__()

    def facade_kwargs(self, *, fp16_mixed: bool, who: str, params: Iterable[torch.Tensor] = ()) -> dict[str, Any]:
        """``ZeroOptimizer``'s keywords (the integrations'); with ``communication_wire`` the precision keywords
        become ``precision=PrecisionPolicy(..., wire=communication_wire)``, the policy the facade would build
        from them for ``params`` (the optimizer's: their dtypes decide the loss scaler)."""
        out = super().facade_kwargs(fp16_mixed=fp16_mixed, who=who)
        wire = self.communication_wire
        if wire is None:
            return out
        if "precision" not in out:
            keywords = PrecisionKeywords(**{k: out.pop(k) for k in PRECISION_DEFAULTS.keys() & out.keys()})
            out["precision"] = precision_policy({str(i): p for i, p in enumerate(params)}, None, keywords)
        out["precision"] = out["precision"].replace(wire=wire)
        return out

    def zero_optimizer(
        self, optimizer: Optimizer, module: torch.nn.Module, *, fp16_mixed: bool, who: str
    ) -> ZeroOptimizer:
        """``ZeroOptimizer(optimizer, module=module, ...)`` with these options, as both strategies build it.

        Gradients partitioned at stage 2; ``init_sync``: rank 0's params and buffers are
        broadcast, as DDP's construction does; under ``fp16_mixed`` the dtypes of the
        optimizer's params pick the loss scaler. Collectives: the ZeroOptimizer's
        construction (the ranks' agreement on the layout, the broadcast).
        """
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return ZeroOptimizer(
            optimizer,
            module=module,
            partition_grad=self.stage == 2,
            init_sync=True,
            **self.facade_kwargs(fp16_mixed=fp16_mixed, who=who, params=params),
        )


def one_torch_optimizer(optimizers: Sequence[Any], *, who: str, many: str, prebuilt: str) -> Optimizer:
    """The one plain torch optimizer in ``optimizers``, which the strategy makes a ZeroOptimizer of.

    zerofn shards one optimizer per model, and the strategy builds the ZeroOptimizer from its
    own options. Raises, before any collective: ``ValueError(many)`` for anything but one
    optimizer, ``TypeError(prebuilt)`` for a ZeroOptimizer built by hand, ``TypeError`` naming
    the type for anything that is not a ``torch.optim.Optimizer``.
    """
    if len(optimizers) != 1:
        raise ValueError(many)
    (optimizer,) = optimizers
    if isinstance(optimizer, ZeroOptimizer):
        raise TypeError(prebuilt)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{who}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def register_names(strategy_registry: Any, cls: type) -> None:
    """Register ``cls`` as ``"zerofn"`` and ``"zerofn_stage_2"`` (ZeRO-2), ``"zerofn_stage_1"`` (ZeRO-1).

    ``strategy_registry``: Fabric's or the Trainer's; each name passes its ``stage`` option.
    """
    strategy_registry.register("zerofn", cls, description="zerofn ZeRO-2 (optimizer state and gradients sharded)")
    strategy_registry.register(
        "zerofn_stage_2", cls, description="zerofn ZeRO-2 (optimizer state and gradients sharded)", stage=2
    )
    strategy_registry.register("zerofn_stage_1", cls, description="zerofn ZeRO-1 (optimizer state sharded)", stage=1)
