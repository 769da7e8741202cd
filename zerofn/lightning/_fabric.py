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
from zerofn.facade._guards import check_module
from zerofn.facade.optimizer import ZeroOptimizer
from zerofn.lightning import _checkpoint
from zerofn.lightning._options import ZeroOptions, one_torch_optimizer, register_names
from zerofn.lightning._precision import check_precision, is_fp16_mixed, swap_grad_scaler

__all__ = ["ZeroStrategy"]

_WHO = "zerofn.lightning.ZeroStrategy"


class ZeroStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 for Fabric: ``Fabric(strategy=ZeroStrategy())`` or ``Fabric(strategy="zerofn")``.

    ``ZeroStrategy()`` alone is ZeRO-2 with :class:`~zerofn.ZeroOptimizer`'s defaults. The
    zerofn keywords (``stage``, ``reduce_bucket_size``, ``overlap_communication``,
    ``communication_dtype``, ``cpu_offload``, the loss scaler's settings,
    ``state_dict_type``, ...) are :class:`~zerofn.lightning.ZeroOptions`' (the same for the
    Trainer's :class:`~zerofn.lightning.ZeroTrainerStrategy`); the others are Lightning's
    DDP ones.

    Args:
      accelerator: Lightning's (set by Fabric).
      parallel_devices: Lightning's (set by Fabric).
      cluster_environment: Lightning's (set by Fabric).
      checkpoint_io: Lightning's, for the ``"full"`` file.
      precision: Lightning's precision plugin (set by Fabric from ``precision=``).
      process_group_backend: as Lightning's DDP strategy (default: gloo on CPU, NCCL on GPU).
      timeout: as Lightning's DDP strategy (the process group's timeout).
      start_method: as Lightning's DDP strategy (``"popen"``: Fabric's script launcher).
      **options: zerofn's, see :class:`~zerofn.lightning.ZeroOptions`.
    """

    def __init__(
        self,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        self.options = ZeroOptions.parse(_WHO, options)
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
        self.stage = self.options.stage
        self.state_dict_type = self.options.state_dict_type
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
        optimizer = one_torch_optimizer(
            optimizers,
            who=_WHO,
            many=f"{_WHO}: fabric.setup(model, *optimizers) got {len(optimizers)} optimizers; zerofn shards one "
            "optimizer per model. Put every param in one optimizer (param groups for different settings), or "
            "set up each model with its own optimizer in its own fabric.setup call.",
            prebuilt=f"{_WHO}: got a ZeroOptimizer; pass the plain torch optimizer to fabric.setup and give zerofn's "
            "options to ZeroStrategy(...): the strategy builds the ZeroOptimizer",
        )
        zero = self.options.zero_optimizer(optimizer, module, fp16_mixed=is_fp16_mixed(self.precision), who=_WHO)
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
        _checkpoint.save_sharded(path, state, filter, _WHO, self.options.safe_globals)
        return None

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """A zerofn sharded checkpoint into ``state``'s objects (any world size), or Lightning's file.

        Both are read as data (``weights_only`` does not apply to the sharded checkpoint;
        for Lightning's file it is ``True``, and ``False`` is refused): the ``safe_globals``
        option admits classes beyond data by name. A file that names anything else is a
        :class:`~zerofn.checkpoint.CheckpointError` naming the file and the global, on
        every rank, before anything changes.
        """
        if _checkpoint.is_sharded_checkpoint(path):
            if not isinstance(state, dict):
                state = {} if state is None else {"": state}
            return _checkpoint.load_sharded(path, state, strict, _WHO, self.options.safe_globals)
        return _checkpoint.load_file(
            lambda weights_only: super(ZeroStrategy, self).load_checkpoint(
                path, state, strict=strict, weights_only=weights_only
            ),
            path,
            self.options.safe_globals,
            weights_only,
            _WHO,
        )

    def teardown(self) -> None:
        for _, zero in self._zeros:
            zero.close()
        self._zeros.clear()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls)


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
