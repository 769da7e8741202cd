"""zerofn's options of the framework integrations: one list of names, defaults and checks.

:mod:`zerofn.lightning` (``ZeroStrategy``, ``ZeroTrainerStrategy``) and :mod:`zerofn.hf`
(``ZeroTrainer``) take the same zerofn keywords next to their framework's own and hand them
to :class:`IntegrationOptions` (Lightning's :class:`~zerofn.lightning.ZeroOptions` adds its
checkpoint keywords): the names, meanings and defaults live here once (the precision
keywords' defaults are the facade's ``PRECISION_DEFAULTS``), and so does their translation
into ``ZeroOptimizer``'s keywords. No collectives; no framework is imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

from zerofn._comm import CommPolicy
from zerofn.facade._options import _SCALER_KEYS, PRECISION_DEFAULTS
from zerofn.precision import DynamicLossScaler, GradAccumDtype, PrecisionPolicy
from zerofn.stages import DEFAULT_BUCKET_NUMEL

__all__ = ["IntegrationOptions"]

_D = PRECISION_DEFAULTS
_PRECISION = ("communication_dtype", "cpu_offload", "master_weights", "grad_accum_dtype", "nonfinite")
_FACADE = (
    "reduce_bucket_size",
    "overlap_communication",
    "overlap_allgather",
    "sub_dp_size",
    "broadcast_buffers",
    "comm_policy",
    "entry_timeout",
    "compile",
)

_Options = TypeVar("_Options", bound="IntegrationOptions")


@dataclasses.dataclass(frozen=True)
class IntegrationOptions:
    """zerofn's keywords of an integration (``ZeroTrainer(...)``, ``ZeroStrategy(...)``); the defaults are ZeRO-2.

    Args:
      stage: 2 (optimizer state and gradients sharded) or 1 (optimizer state sharded).
      reduce_bucket_size: as ``ZeroOptimizer``'s (padded elements per bucket).
      overlap_communication: as ``ZeroOptimizer``'s (reduce buckets during backward).
      overlap_allgather: as ``ZeroOptimizer``'s (gather params behind the next forward).
      communication_dtype: as ``ZeroOptimizer``'s (the gradients' wire dtype).
      cpu_offload: as ``ZeroOptimizer``'s (master shards and optimizer state on the CPU).
      master_weights: as ``ZeroOptimizer``'s (float32 master shards for low-precision params).
      grad_accum_dtype: as ``ZeroOptimizer``'s (the dtype micro-batches accumulate in).
      sub_dp_size: as ``ZeroOptimizer``'s (hybrid sharding: that many shard groups).
      broadcast_buffers: as ``ZeroOptimizer``'s (rank 0's buffers before each forward).
      nonfinite: as ``ZeroOptimizer``'s (``"skip"`` or ``"raise"`` without loss scaling).
      initial_scale: zerofn's dynamic loss scaler under float16 autocast (and for float16
        params), with ``min_scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``hysteresis`` and ``max_scale``: the facade's settings and defaults.
      min_scale: see ``initial_scale``.
      growth_factor: see ``initial_scale``.
      backoff_factor: see ``initial_scale``.
      growth_interval: see ``initial_scale``.
      hysteresis: see ``initial_scale`` (1: back off at every overflow, as ``GradScaler``).
      max_scale: see ``initial_scale``.
      comm_policy: as ``ZeroOptimizer``'s (collective realisations).
      entry_timeout: as ``ZeroOptimizer``'s (the wait of a collective entry point).
      compile: as ``ZeroOptimizer``'s (the step after backward as one compiled graph).
    """

    stage: int = 2
    reduce_bucket_size: int = DEFAULT_BUCKET_NUMEL
    overlap_communication: bool = False
    overlap_allgather: bool = False
    communication_dtype: torch.dtype | None = _D["communication_dtype"]
    cpu_offload: bool = _D["cpu_offload"]
    master_weights: bool = _D["master_weights"]
    grad_accum_dtype: GradAccumDtype = _D["grad_accum_dtype"]
    sub_dp_size: int = 1
    broadcast_buffers: bool = True
    nonfinite: str = _D["nonfinite"]
    initial_scale: float = _D["initial_scale"]
    min_scale: float = _D["min_scale"]
    growth_factor: float = _D["growth_factor"]
    backoff_factor: float = _D["backoff_factor"]
    growth_interval: int = _D["growth_interval"]
    hysteresis: int = _D["hysteresis"]
    max_scale: float = _D["max_scale"]
    comm_policy: CommPolicy | None = None
    entry_timeout: float | None = 300.0
    compile: bool | str = False

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {self.stage!r}")
        DynamicLossScaler(**self._scaler())  # its settings checked now, not at the first setup

    @classmethod
    def names(cls) -> frozenset[str]:
        """The keywords these options take."""
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def parse(cls: type[_Options], who: str, options: dict[str, Any]) -> _Options:
        """``cls(**options)``, its errors naming the integration ``who`` and the keywords it takes."""
        known = cls.names()
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{who}: unknown option(s) {unknown}; zerofn's options are {sorted(known)}")
        try:
            return cls(**options)
        except ValueError as e:
            raise ValueError(f"{who}: {e}") from None

    def _scaler(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SCALER_KEYS}

    def facade_kwargs(self, *, fp16_mixed: bool, who: str) -> dict[str, Any]:
        """``ZeroOptimizer``'s keywords (all but the optimizer, ``module=``, ``partition_grad=``, ``init_sync=``).

        ``fp16_mixed``: float32 params under float16 autocast (Lightning's ``"16-mixed"``,
        the HF Trainer's ``fp16=True``): the precision keywords become a ``PrecisionPolicy``
        with zerofn's dynamic loss scaler, which the facade would not turn on for float32
        params by itself.
        """
        out: dict[str, Any] = {k: getattr(self, k) for k in _FACADE}
        if not fp16_mixed:
            return {**out, **{k: getattr(self, k) for k in _PRECISION}, **self._scaler()}
        if self.nonfinite != "skip":
            raise ValueError(
                f"{who}: float16 autocast (Lightning's precision='16-mixed', the HF Trainer's fp16=True) needs "
                "nonfinite='skip' (a dynamic loss scaler skips)"
            )
        out["precision"] = PrecisionPolicy(
            comm_dtype=self.communication_dtype,
            grad_accum_dtype=self.grad_accum_dtype,
            master_weights=self.master_weights,
            state_device="cpu" if self.cpu_offload else None,
            loss_scaler=DynamicLossScaler(**self._scaler()),
        )
        return out
