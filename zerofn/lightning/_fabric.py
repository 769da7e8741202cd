"""``ZeroStrategy``: ZeRO-1/2 for ``lightning.fabric.Fabric``, built on :class:`~zerofn.ZeroOptimizer`.

It is Lightning's DDP strategy (the same launchers, cluster environments, process group
set-up and collectives for ``fabric.all_reduce`` & co., so it runs under ``torchrun``,
SLURM or Fabric's own launchers and takes the ranks from the environment the same way)
with everything that touches the model's gradients, the optimizer and the checkpoints
handed to zerofn instead. What it overrides, and why:

- ``setup_module_and_optimizers``: no ``DistributedDataParallel`` wrapper (its hooks would
  reduce every gradient a second time next to zerofn's); the torch optimizer becomes a
  ``ZeroOptimizer(optimizer, module=model, ...)`` with the strategy's options, whose
  construction broadcasts rank 0's params and buffers, as DDP's does. Exactly one optimizer
  per model (``fabric.setup(model, opt)``); a DDP-wrapped model, a ``ZeroOptimizer`` built
  by hand, two optimizers are refused here, before any collective.
- ``setup_module`` (a model without an optimizer): no wrapper; rank 0's params and
  buffers broadcast. ``setup_optimizer`` alone is refused: zerofn needs the model and the
  optimizer together (``fabric.setup(model, optimizer)``), as DeepSpeed does.
- ``backward``: ``ZeroOptimizer.backward``, which multiplies the loss by zerofn's loss scale
  (``"16-mixed"``) and lets zerofn's hooks reduce the gradients.
- ``_backward_sync_control`` (``fabric.no_backward_sync(model)``): ``ZeroOptimizer.no_sync``,
  at stage 1 and 2.
- ``clip_gradients_norm`` (``fabric.clip_gradients(max_norm=...)``):
  ``ZeroOptimizer.clip_grad_norm_``, the global norm over every rank's shards, as torch's
  ``clip_grad_norm_`` computes it over DDP's full gradients. ``clip_gradients_value``: at
  stage 1 torch's ``clip_grad_value_`` on the averaged ``p.grad``; refused at stage 2,
  where a rank holds only its shards of the gradients.
- ``precision`` (setter) and the set-up checks: see :mod:`zerofn.lightning._precision`.
- ``get_optimizer_state``: ``ZeroOptimizer.state_dict()`` on every rank (a collective),
  never Lightning's rank-0 ``consolidate_state_dict`` path.
- ``save_checkpoint`` / ``load_checkpoint``: the sharded checkpoint (DCP, every rank) or
  the full torch-format file, see :mod:`zerofn.lightning._checkpoint`.
- ``teardown``: closes the ZeroOptimizers (their hooks leave the model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.nn import Module
from torch.optim import Optimizer

from zerofn import _sync
from zerofn._comm import CommPolicy
from zerofn.facade._guards import check_module
from zerofn.facade._options import PRECISION_DEFAULTS
from zerofn.facade.optimizer import ZeroOptimizer
from zerofn.lightning import _checkpoint
from zerofn.lightning._precision import check_precision, is_fp16_mixed, swap_grad_scaler
from zerofn.precision import DynamicLossScaler, GradAccumDtype, PrecisionPolicy
from zerofn.stages import DEFAULT_BUCKET_NUMEL

# ZeroOptimizer's precision keywords and their defaults, one source for both signatures.
_DEFAULTS = PRECISION_DEFAULTS

__all__ = ["ZeroStrategy"]

_WHO = "zerofn.lightning.ZeroStrategy"


class ZeroStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 for Fabric: ``Fabric(strategy=ZeroStrategy())`` or ``Fabric(strategy="zerofn")``.

    ``ZeroStrategy()`` alone is ZeRO-2 with :class:`~zerofn.ZeroOptimizer`'s defaults. The
    options are the facade's (same names and meanings, see its docstring), plus Lightning's
    DDP ones (``process_group_backend``, ``timeout``, ``start_method``, ...).

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
      initial_scale: zerofn's dynamic loss scaler under ``precision="16-mixed"`` (and for
        float16 params), with ``min_scale``, ``growth_factor``, ``backoff_factor``,
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
      state_dict_type: ``"sharded"``: ``fabric.save`` writes a zerofn sharded checkpoint
        (every rank its shards, DCP); ``"full"``: Lightning's one file with the optimizer
        in torch's format (gathered on every rank). ``fabric.load`` reads either.
      accelerator: Lightning's (set by Fabric).
      parallel_devices: Lightning's (set by Fabric).
      cluster_environment: Lightning's (set by Fabric).
      checkpoint_io: Lightning's, for the ``"full"`` file.
      precision: Lightning's precision plugin (set by Fabric from ``precision=``).
      process_group_backend: as Lightning's DDP strategy (default: gloo on CPU, NCCL on GPU).
      timeout: as Lightning's DDP strategy (the process group's timeout).
      start_method: as Lightning's DDP strategy (``"popen"``: Fabric's script launcher).
    """

    def __init__(
        self,
        *,
        stage: int = 2,
        reduce_bucket_size: int = DEFAULT_BUCKET_NUMEL,
        overlap_communication: bool = False,
        overlap_allgather: bool = False,
        communication_dtype: torch.dtype | None = _DEFAULTS["communication_dtype"],
        cpu_offload: bool = _DEFAULTS["cpu_offload"],
        master_weights: bool = _DEFAULTS["master_weights"],
        grad_accum_dtype: GradAccumDtype = _DEFAULTS["grad_accum_dtype"],
        sub_dp_size: int = 1,
        broadcast_buffers: bool = True,
        nonfinite: str = _DEFAULTS["nonfinite"],
        initial_scale: float = _DEFAULTS["initial_scale"],
        min_scale: float = _DEFAULTS["min_scale"],
        growth_factor: float = _DEFAULTS["growth_factor"],
        backoff_factor: float = _DEFAULTS["backoff_factor"],
        growth_interval: int = _DEFAULTS["growth_interval"],
        hysteresis: int = _DEFAULTS["hysteresis"],
        max_scale: float = _DEFAULTS["max_scale"],
        comm_policy: CommPolicy | None = None,
        entry_timeout: float | None = 300.0,
        compile: bool | str = False,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"{_WHO}: stage must be 1 or 2, got {stage!r}")
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"{_WHO}: state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.stage = stage
        self.state_dict_type = state_dict_type
        self._options: dict[str, Any] = {
            "reduce_bucket_size": reduce_bucket_size,
            "overlap_communication": overlap_communication,
            "overlap_allgather": overlap_allgather,
            "sub_dp_size": sub_dp_size,
            "broadcast_buffers": broadcast_buffers,
            "comm_policy": comm_policy,
            "entry_timeout": entry_timeout,
            "compile": compile,
        }
        self._precision_options: dict[str, Any] = {
            "communication_dtype": communication_dtype,
            "cpu_offload": cpu_offload,
            "master_weights": master_weights,
            "grad_accum_dtype": grad_accum_dtype,
            "nonfinite": nonfinite,
        }
        self._scaler = {
            "initial_scale": initial_scale,
            "min_scale": min_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "hysteresis": hysteresis,
            "max_scale": max_scale,
        }
        DynamicLossScaler(**self._scaler)  # its settings checked now, not at the first setup
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self._zeros: list[tuple[Module, ZeroOptimizer]] = []

    # ------------------------------------------------------------------ precision

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Lightning's "16-mixed" comes with a fresh GradScaler: replaced by zerofn's loss scaler here.
        self._precision = swap_grad_scaler(precision)

    @property
    def optimizers(self) -> list[ZeroOptimizer]:
        """The ZeroOptimizers this strategy built, in set-up order."""
        return [z for _, z in self._zeros]

    # ------------------------------------------------------------------ set-up

    def setup_environment(self) -> None:
        check_precision(self.precision, _WHO)  # before the process group: a refusal needs no collective
        super().setup_environment()

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """The model as it is (no DDP wrapper), its optimizer as a ``ZeroOptimizer``; the scheduler unchanged.

        The scheduler steps the torch optimizer's ``param_groups``, which are the
        ZeroOptimizer's live groups. Collectives: the ZeroOptimizer's construction (the
        ranks' agreement on the layout, the broadcast of rank 0's params and buffers).
        """
        check_precision(self.precision, _WHO)
        self._check_module(module)
        if len(optimizers) != 1:
            raise ValueError(
                f"{_WHO}: fabric.setup(model, *optimizers) got {len(optimizers)} optimizers; zerofn shards one "
                "optimizer per model. Put every param in one optimizer (param groups for different settings), or "
                "set up each model with its own optimizer in its own fabric.setup call."
            )
        (optimizer,) = optimizers
        if isinstance(optimizer, ZeroOptimizer):
            raise TypeError(
                f"{_WHO}: got a ZeroOptimizer; pass the plain torch optimizer to fabric.setup and give zerofn's "
                "options to ZeroStrategy(...): the strategy builds the ZeroOptimizer"
            )
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{_WHO}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        zero = ZeroOptimizer(
            optimizer,
            module=module,
            partition_grad=self.stage == 2,
            init_sync=True,
            **self._options,
            **self._precision_kwargs(),
        )
        self._zeros.append((module, zero))
        return module, [zero], scheduler

    def setup_module(self, module: Module) -> Module:
        """A model set up without an optimizer: no wrapper; rank 0's params and buffers broadcast, as DDP would.

        Collectives: one all-gather of the structure's digest, one broadcast per dtype.
        """
        self._check_module(module)
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        if dist.is_initialized() and dist.get_world_size() > 1 and tensors:
            _sync.check_structure_agrees(tensors, None, f"{_WHO}.setup_module")
            with torch.no_grad():
                _sync.broadcast_(list(tensors.values()), None)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def _check_module(self, module: Module) -> None:
        try:
            check_module(module)
        except ValueError as e:
            raise ValueError(
                f"{_WHO}: the model is wrapped for data parallelism; pass the bare model to fabric.setup: the "
                f"strategy reduces the gradients itself, a wrapper would reduce them twice. ({e})"
            ) from None

    def _precision_kwargs(self) -> dict[str, Any]:
        """The ZeroOptimizer's precision keywords; under "16-mixed" a policy with zerofn's dynamic loss scaler."""
        if not is_fp16_mixed(self.precision):
            return {**self._precision_options, **self._scaler}
        o = self._precision_options
        if o["nonfinite"] != "skip":
            raise ValueError(f"{_WHO}: precision='16-mixed' needs nonfinite='skip' (a dynamic loss scaler skips)")
        policy = PrecisionPolicy(
            comm_dtype=o["communication_dtype"],
            grad_accum_dtype=o["grad_accum_dtype"],
            master_weights=o["master_weights"],
            state_device="cpu" if o["cpu_offload"] else None,
            loss_scaler=DynamicLossScaler(**self._scaler),
        )
        return {"precision": policy}

    def _zero_for(self, module: Module | None) -> ZeroOptimizer | None:
        """The ZeroOptimizer of ``module`` (``None``: the only one, if there is one)."""
        if module is None:
            return self._zeros[0][1] if len(self._zeros) == 1 else None
        for m, z in self._zeros:
            if m is module:
                return z
        return None

    # ------------------------------------------------------------------ training

    def backward(self, tensor: torch.Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """``ZeroOptimizer.backward``: the loss times zerofn's loss scale; the hooks reduce the gradients."""
        zero = self._zero_for(module)
        if zero is None and len(self._zeros) > 1 and any(z.loss_scale != 1.0 for _, z in self._zeros):
            raise ValueError(
                f"{_WHO}: several models are set up and the loss is scaled: say which model this loss trains, "
                "fabric.backward(loss, model=model)"
            )
        self.precision.pre_backward(tensor, module)
        if zero is None:
            self.precision.backward(tensor, module, *args, **kwargs)
        else:
            unknown = set(kwargs) - {"retain_graph"}
            if args or unknown:
                raise TypeError(
                    f"{_WHO}: fabric.backward(loss, ...) takes only retain_graph= here, got "
                    f"{len(args)} positional and {sorted(unknown)}"
                )
            zero.backward(tensor, retain_graph=bool(kwargs.get("retain_graph", False)))
        self.precision.post_backward(tensor, module)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """The global norm over every rank's shards (``ZeroOptimizer.clip_grad_norm_``), as torch's on DDP."""
        if not isinstance(optimizer, ZeroOptimizer):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return optimizer.clip_grad_norm_(float(max_norm), float(norm_type), error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Stage 1: torch's ``clip_grad_value_`` on the averaged (unscaled) ``p.grad``; stage 2: refused."""
        if not isinstance(optimizer, ZeroOptimizer):
            return super().clip_gradients_value(module, optimizer, clip_val)
        if optimizer.stage == 2:
            raise NotImplementedError(
                f"{_WHO}: clipping by value (clip_val=, gradient_clip_algorithm='value') needs the whole averaged "
                "gradient on every rank, but at stage 2 a rank holds only its shards. Clip by norm "
                "(fabric.clip_gradients(model, optimizer, max_norm=...)), or use ZeroStrategy(stage=1)."
            )
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)
        return None

    # ------------------------------------------------------------------ checkpoints

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``ZeroOptimizer.state_dict()`` on every rank (a collective), never the rank-0 consolidate path."""
        if isinstance(optimizer, ZeroOptimizer):
            return optimizer.state_dict()  # type: ignore[return-value]
        return super().get_optimizer_state(optimizer)

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Sharded (every rank writes its shards) when the state holds a ZeroOptimizer; else Lightning's file."""
        has_zero = any(isinstance(v, ZeroOptimizer) for v in state.values())
        if self.state_dict_type == "full" or not has_zero:
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if storage_options is not None:
            raise TypeError(f"{_WHO}: storage_options is not supported by the sharded checkpoint")
        _checkpoint.save_sharded(path, state, filter, _WHO)
        return None

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """A zerofn sharded checkpoint into ``state``'s objects (any world size), or Lightning's file."""
        if _checkpoint.is_sharded_checkpoint(path):
            if not isinstance(state, dict):
                state = {} if state is None else {"": state}
            return _checkpoint.load_sharded(path, state, strict, _WHO)
        if (
            weights_only is None
            and isinstance(state, dict)
            and any(isinstance(v, ZeroOptimizer) for v in state.values())
        ):
            weights_only = False  # ZeroOptimizer.state_dict()'s "zerofn" entry holds more than tensors
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)

    def teardown(self) -> None:
        for _, zero in self._zeros:
            zero.close()
        self._zeros.clear()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("zerofn", cls, description="zerofn ZeRO-2 (optimizer state and gradients sharded)")
        strategy_registry.register(
            "zerofn_stage_2", cls, description="zerofn ZeRO-2 (optimizer state and gradients sharded)", stage=2
        )
        strategy_registry.register(
            "zerofn_stage_1", cls, description="zerofn ZeRO-1 (optimizer state sharded)", stage=1
        )


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: ``ZeroOptimizer.no_sync`` (local accumulation, no communication)."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        zero = self._strategy._zero_for(module)
        if zero is None:
            raise TypeError(
                f"{_WHO}: no_backward_sync needs a model set up with its optimizer (fabric.setup(model, optimizer)); "
                f"got a {type(module).__name__} that has none"
            )
        return zero.no_sync()
