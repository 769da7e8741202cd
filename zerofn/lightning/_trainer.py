"""``ZeroTrainerStrategy``: ZeRO-1/2 for ``lightning.pytorch.Trainer``, built on :class:`~zerofn.ZeroOptimizer`.

It is the Trainer's DDP strategy (the same launchers, cluster environments, process group
set-up and collectives for ``self.log(sync_dist=True)`` & co., so it runs under
``torchrun``, SLURM or the Trainer's own launchers and takes the ranks from the
environment the same way) with everything that touches the gradients, the optimizer and
the checkpoints handed to zerofn. What it overrides, and why:

- ``setup``: no ``DistributedDataParallel`` wrapper (its hooks would reduce every gradient
  a second time next to zerofn's); a model holding a DDP wrapper is refused first, before
  any collective, and so is ``gradient_clip_algorithm="value"`` at stage 2. When fitting,
  ``setup_optimizers`` builds the ``ZeroOptimizer``, whose construction broadcasts rank 0's
  params and buffers as DDP's does; otherwise (validate, test, predict) the params and
  buffers are broadcast as Lightning's DDP strategy does without its wrapper.
- ``setup_optimizers``: ``configure_optimizers``' one optimizer becomes
  ``ZeroOptimizer(optimizer, module=lightning_module, ...)`` with the strategy's options.
  The LR schedulers stay on the torch optimizer, whose ``param_groups`` are the
  ZeroOptimizer's live groups, so they step what the ZeroOptimizer reads. Two optimizers
  (manual optimization) and a ``ZeroOptimizer`` built by hand are refused.
- ``training_step`` / ``validation_step`` (while fitting): called through the model's own
  ``__call__`` (Lightning's forward redirection, as through DDP's wrapper), so that the
  facade's forward pre-hook broadcasts rank 0's buffers before each training forward, as
  DDP's forward does, even when ``training_step`` does not call ``self(...)``.
- ``backward``: the loss times zerofn's loss scale (``"16-mixed"``), then Lightning's
  backward (the ``on_before_backward`` hooks, ``LightningModule.backward``); zerofn's
  hooks reduce the gradients while autograd runs.
- ``block_backward_sync`` (``accumulate_grad_batches``, ``toggle_model(sync_grad=False)``):
  ``ZeroOptimizer.no_sync``, at stage 1 and 2: the micro-batches before the last add up
  locally and communicate nothing.
- ``optimizer_step``: runs the Trainer's closure (training step and backward), then the
  ``on_before_optimizer_step`` hooks and the Trainer's clipping, then ``ZeroOptimizer.step()``
  (which takes no closure). ``gradient_clip_val`` clips by the global norm over every rank's
  shards (``ZeroOptimizer.clip_grad_norm_``), as torch's ``clip_grad_norm_`` on DDP's full
  gradients; ``gradient_clip_algorithm="value"`` clips the averaged ``p.grad`` at stage 1.
  Both go through the precision plugin, which the strategy gives zerofn's clipping
  (:class:`_ZeroClipping`).
- ``precision_plugin`` (setter) and the set-up checks: ``"32-true"``, ``"bf16-mixed"``,
  ``"bf16-true"`` as with DDP, ``"16-mixed"`` with zerofn's loss scaler in place of the
  ``GradScaler`` Lightning builds; the rest refused (:mod:`zerofn.lightning._precision`).
- ``optimizer_state`` / ``save_checkpoint`` / ``load_checkpoint`` / ``load_model_state_dict``
  / ``load_optimizer_state_dict`` / ``remove_checkpoint``: ``state_dict_type="sharded"``
  writes one zerofn sharded checkpoint (every rank its shards, DCP; the model once; the
  rest of Lightning's checkpoint as plain entries) and restores it at any world size;
  ``"full"`` writes Lightning's one file with ``ZeroOptimizer.state_dict()`` in torch's
  format, gathered on every rank. Lightning's rank-0 ``consolidate_state_dict`` path is
  never taken. ``restore_checkpoint_after_setup`` is ``True``: the checkpoint restores into
  the ZeroOptimizer, which exists after ``setup``.
- ``teardown``: closes the ZeroOptimizer (its hooks leave the model); Lightning's move of
  the optimizer state to the CPU is skipped (a ``ZeroState`` is not torch's state dict).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from zerofn.facade._guards import check_module
from zerofn.facade.optimizer import ZeroOptimizer
from zerofn.lightning import _checkpoint
from zerofn.lightning._options import ZeroOptions, one_torch_optimizer, register_names
from zerofn.lightning._precision import TRAINER, check_precision, is_fp16_mixed, swap_grad_scaler
from zerofn.precision import scale_loss

__all__ = ["ZeroTrainerStrategy"]

_WHO = "zerofn.lightning.ZeroTrainerStrategy"
# The keys under which the sharded checkpoint records the optimizer and the model: Lightning's own.
_OPTIMIZER_KEY, _MODEL_KEY = "optimizer_states", "state_dict"
_VALUE_AT_STAGE_2 = (
    f"{_WHO}: clipping by value (gradient_clip_algorithm='value') needs the whole averaged gradient on every rank, "
    "but at stage 2 a rank holds only its shards. Clip by norm (Trainer(gradient_clip_val=..., "
    "gradient_clip_algorithm='norm'), the global norm as with DDP), or use ZeroTrainerStrategy(stage=1)."
)


def _unwrap(optimizer: Any) -> Any:
    """The optimizer a ``LightningOptimizer`` wraps (``self.optimizers()`` hands those out), or ``optimizer``."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class _ZeroClipping:
    """Mixed into the Trainer's precision plugin: its clipping goes to the ZeroOptimizer.

    ``Trainer(gradient_clip_val=...)`` and ``LightningModule.clip_gradients`` end in the
    precision plugin's ``clip_grad_by_norm`` / ``clip_grad_by_value``, which call torch's
    functions on the params' ``p.grad``: a local norm at stage 2, where ``p.grad`` holds
    nothing. Here the norm is the global one, as torch's on DDP's full gradients.
    """

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        """``ZeroOptimizer.clip_grad_norm_``: the global norm over every rank's shards (one scalar all-reduce)."""
        zero = _unwrap(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
        zero.clip_grad_norm_(float(clip_val))
        return None

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float | int) -> None:
        """Stage 1: torch's ``clip_grad_value_`` on the averaged (unscaled) ``p.grad``; stage 2: refused."""
        zero = _unwrap(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().clip_grad_by_value(optimizer, clip_val)  # type: ignore[misc]
        if zero.stage == 2:
            raise NotImplementedError(_VALUE_AT_STAGE_2)
        params = [p for g in zero.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)
        return None


class _ZeroPrecision(_ZeroClipping, TRAINER.precision):
    """``"32-true"`` with zerofn's clipping."""


class _ZeroMixedPrecision(_ZeroClipping, TRAINER.mixed):
    """``"bf16-mixed"``, or ``"16-mixed"`` without a ``GradScaler`` (zerofn's loss scaler), with zerofn's clipping."""


class _ZeroHalfPrecision(_ZeroClipping, TRAINER.half):
    """``"bf16-true"`` with zerofn's clipping."""


def _with_zero_clipping(plugin: Any) -> Any:
    """The same plugin (settings and state) as its zerofn-clipping class; ``plugin`` passed :func:`check_precision`."""
    kind = {TRAINER.precision: _ZeroPrecision, TRAINER.mixed: _ZeroMixedPrecision, TRAINER.half: _ZeroHalfPrecision}
    new = kind[type(plugin)].__new__(kind[type(plugin)])
    new.__dict__.update(vars(plugin))
    return new


class ZeroTrainerStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 for the Trainer: ``Trainer(strategy=ZeroTrainerStrategy())`` or ``Trainer(strategy="zerofn")``.

    ``ZeroTrainerStrategy()`` alone is ZeRO-2 with :class:`~zerofn.ZeroOptimizer`'s
    defaults. The zerofn keywords are :class:`~zerofn.lightning.ZeroOptions`' (the same
    as Fabric's :class:`~zerofn.lightning.ZeroStrategy`); the others are Lightning's DDP ones.

    Args:
      accelerator: Lightning's (set by the Trainer).
      parallel_devices: Lightning's (set by the Trainer).
      cluster_environment: Lightning's (set by the Trainer).
      checkpoint_io: Lightning's, for the ``"full"`` file.
      precision_plugin: Lightning's precision plugin (set by the Trainer from ``precision=``).
      process_group_backend: as Lightning's DDP strategy (default: gloo on CPU, NCCL on GPU).
      timeout: as Lightning's DDP strategy (the process group's timeout).
      start_method: as Lightning's DDP strategy (``"popen"``: the Trainer's script launcher).
      **options: zerofn's, see :class:`~zerofn.lightning.ZeroOptions`.
    """

    def __init__(
        self,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
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
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.stage = self.options.stage
        self.state_dict_type = self.options.state_dict_type
        self._zero: ZeroOptimizer | None = None
        self._restored_sharded = False  # the last load restored the model and optimizer from a sharded checkpoint

    # ------------------------------------------------------------------ precision

    @property
    def precision_plugin(self) -> Any:
        """The precision plugin, with zerofn's clipping (``"32-true"`` when none was set)."""
        if self._precision_plugin is None:
            self._precision_plugin = _ZeroPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Lightning's "16-mixed" comes with a fresh GradScaler: replaced by zerofn's loss scaler here. A plugin
        # the strategy runs gets zerofn's clipping; any other is kept as it is, and refused at setup.
        plugin = swap_grad_scaler(plugin, TRAINER)
        with contextlib.suppress(ValueError):
            if plugin is not None:
                check_precision(plugin, _WHO, TRAINER)
                plugin = _with_zero_clipping(plugin)
        self._precision_plugin = plugin

    @property
    def zero_optimizer(self) -> ZeroOptimizer | None:
        """The ZeroOptimizer this strategy built for the current ``fit`` (``None`` before, or when not fitting)."""
        return self._zero

    # ------------------------------------------------------------------ set-up

    def setup_environment(self) -> None:
        """Check the precision plugin first (a refusal needs no collective), then Lightning's DDP set-up."""
        if not isinstance(self.precision_plugin, _ZeroClipping):
            check_precision(self.precision_plugin, _WHO, TRAINER)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        """DDP's set-up without the wrapper: the model converted and moved, then its ZeroOptimizer when fitting.

        Collectives: when fitting, the ZeroOptimizer's construction (the ranks' agreement on
        the layout, the broadcast of rank 0's params and buffers); otherwise the broadcast
        of rank 0's params and buffers, as Lightning's DDP strategy does.
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._check_module(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and self.stage == 2:
            if trainer.gradient_clip_val:
                raise NotImplementedError(_VALUE_AT_STAGE_2)
        self._restored_sharded = False
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        else:
            self._zero = None  # a past fit's (closed) ZeroOptimizer trains nothing here
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: Any) -> None:
        """``configure_optimizers``' optimizer as a ``ZeroOptimizer`` over the model; the schedulers as they are."""
        assert self.lightning_module is not None
        optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(self.lightning_module)
        optimizer = one_torch_optimizer(
            optimizers,
            who=_WHO,
            many=f"{_WHO}: configure_optimizers returned {len(optimizers)} optimizers; zerofn shards one optimizer "
            "per model. Put every param in one optimizer (param groups for different settings).",
            prebuilt=f"{_WHO}: configure_optimizers returned a ZeroOptimizer; return the plain torch optimizer and "
            "give zerofn's options to ZeroTrainerStrategy(...): the strategy builds the ZeroOptimizer",
        )
        if self._zero is not None:  # a second fit with this strategy: the first one's hooks leave the model
            self._zero.close()
        fp16 = is_fp16_mixed(self.precision_plugin, TRAINER)
        self._zero = self.options.zero_optimizer(optimizer, self.lightning_module, fp16_mixed=fp16, who=_WHO)
        self.optimizers = [self._zero]
        self.lr_scheduler_configs = scheduler_configs

    def _check_module(self, module: torch.nn.Module) -> None:
        try:
            check_module(module)
        except ValueError as e:
            raise ValueError(
                f"{_WHO}: the LightningModule holds a model wrapped for data parallelism; keep the bare model in it: "
                f"the strategy reduces the gradients itself, a wrapper would reduce them twice. ({e})"
            ) from None

    # ------------------------------------------------------------------ training

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """``training_step`` through the model's ``__call__``, whose pre-hook broadcasts rank 0's buffers."""
        if self._zero is None:
            return super().training_step(*args, **kwargs)
        return self._through_call("training_step", self.precision_plugin.train_step_context(), args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """While fitting, as ``training_step`` (DDP's wrapper runs validation through its forward too)."""
        if self._zero is None:
            return super().validation_step(*args, **kwargs)
        return self._through_call("validation_step", self.precision_plugin.val_step_context(), args, kwargs)

    def _through_call(
        self,
        step: str,
        context: contextlib.AbstractContextManager,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The LightningModule's ``step`` method run inside ``context`` through the model's own ``__call__``."""
        module = self.lightning_module
        assert module is not None
        with context:
            return self._forward_redirection(module, module, step, *args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward of the loss times zerofn's loss scale; zerofn's hooks reduce the gradients.

        Returns the unscaled loss, detached, as Lightning's does.
        """
        zero = self._zero
        if zero is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        zero._guard.check_structure(f"{_WHO}.backward")  # a moved/cast/replaced param: say what to do
        zero.wait_params()  # as ZeroOptimizer.backward: overlap_allgather's gathers before autograd runs
        scaled = closure_loss if zero.loss_scale == 1.0 else scale_loss(closure_loss, zero.state.loss_scale)
        self.precision_plugin.backward(scaled, module, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """``ZeroOptimizer.no_sync``: local accumulation, no communication (at stage 1 and 2)."""
        if self._zero is None:
            with super().block_backward_sync():
                yield
            return
        with self._zero.no_sync():
            yield

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The closure (training step, backward), the hooks and the Trainer's clipping, then ``ZeroOptimizer.step()``.

        A ``training_step`` that returned ``None`` (automatic optimization) ran no backward:
        no step, as a torch optimizer without gradients changes nothing.
        """
        zero = _unwrap(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if kwargs:
            raise TypeError(f"{_WHO}: optimizer.step() takes no arguments here, got {sorted(kwargs)}")
        model = model or self.lightning_module
        # Lightning's own order: closure, then on_before_optimizer_step and configure_gradient_clipping.
        closure_result = self.precision_plugin._wrap_closure(model, zero, closure)
        if closure_result is None and model.automatic_optimization:
            return None
        zero.step()
        return closure_result

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """``True``: a checkpoint restores into the ZeroOptimizer, which ``setup`` builds."""
        return True

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``"full"``: ``ZeroOptimizer.state_dict()`` on every rank (a collective); ``"sharded"``: a placeholder.

        The sharded state is written by :meth:`save_checkpoint`, every rank its shards.
        Never Lightning's rank-0 ``consolidate_state_dict`` path.
        """
        zero = _unwrap(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().optimizer_state(optimizer)
        if self.state_dict_type == "full" or zero is not self._zero:  # not the one save_checkpoint shards
            return zero.state_dict()  # type: ignore[return-value]
        return {"zerofn": "sharded: in the checkpoint's DCP files"}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Sharded: one zerofn checkpoint at ``filepath``, every rank writing; else Lightning's file from rank 0.

        The sharded checkpoint holds the model the ZeroOptimizer trains (its params and
        persistent buffers, written once), the optimizer's shards, and every other entry of
        Lightning's checkpoint (loops, callbacks, schedulers, hyperparameters) as it is.
        A ``weights_only`` checkpoint (no optimizer state) is Lightning's file.
        """
        zero = self._zero
        checkpoint = _checkpoint.plain_hyperparameters(checkpoint)  # Lightning's AttributeDict: a dict, data
        if zero is None or self.state_dict_type == "full" or _OPTIMIZER_KEY not in checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(f"{_WHO}: storage_options is not supported by the sharded checkpoint")
        rest = {k: v for k, v in checkpoint.items() if k not in (_OPTIMIZER_KEY, _MODEL_KEY)}
        state = {_OPTIMIZER_KEY: zero, _MODEL_KEY: self.lightning_module, **rest}
        _checkpoint.save_sharded(os.fspath(filepath), state, None, _WHO, self.options.safe_globals)
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint restores the model and the ZeroOptimizer here; the rest returns as Lightning's dict.

        Any world size: the optimizer's shards are resharded. Lightning's file (``"full"``,
        or one saved with Lightning's ``"ddp"``) loads as Lightning loads it, on every rank,
        with ``weights_only=True`` (``False`` is refused; the ``safe_globals`` option admits
        classes beyond data by name). Either is read as data, never as code.
        """
        if not _checkpoint.is_sharded_checkpoint(checkpoint_path):
            return _checkpoint.load_file(
                lambda weights_only: super(ZeroTrainerStrategy, self).load_checkpoint(
                    checkpoint_path, weights_only=weights_only
                ),
                checkpoint_path,
                self.options.safe_globals,
                weights_only,
                _WHO,
            )
        zero, module = self._zero, self.lightning_module
        if zero is None or module is None:
            raise ValueError(
                f"{_WHO}: {checkpoint_path} is a sharded zerofn checkpoint, which restores into the model and its "
                "ZeroOptimizer: resume it with trainer.fit(model, ckpt_path=...). To validate, test or predict from a "
                "checkpoint, save it with ZeroTrainerStrategy(state_dict_type='full') (Lightning's one file)."
            )
        state = {_OPTIMIZER_KEY: zero, _MODEL_KEY: module}
        rest = _checkpoint.load_sharded(os.fspath(checkpoint_path), state, True, _WHO, self.options.safe_globals)
        self._restored_sharded = True
        # Lightning's hooks (on_load_checkpoint) see the restored weights under the usual key.
        return {**rest, _MODEL_KEY: module.state_dict(), _OPTIMIZER_KEY: [self.optimizer_state(zero)]}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing after a sharded load (it restored the model); else Lightning's ``load_state_dict``.

        Weights loaded into the model after the ZeroOptimizer exists are trained, as with
        DDP: its next step takes them into the master shards on every rank.
        """
        if not self._restored_sharded:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing after a sharded load; else ``ZeroOptimizer.load_state_dict`` (torch's format; every rank, any N)."""
        zero = self._zero
        if zero is None:
            return super().load_optimizer_state_dict(checkpoint)
        if self._restored_sharded:
            return None
        states = checkpoint[_OPTIMIZER_KEY]
        if len(states) != 1:
            raise ValueError(f"{_WHO}: the checkpoint holds {len(states)} optimizer states; this model has one")
        zero.load_state_dict(states[0])
        return None

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 removes a sharded checkpoint (its link, and the directory the save committed), or Lightning's file.

        The directory goes only when the link is the save's own (``path`` -> ``path.<token>``):
        a link made by someone else (``ModelCheckpoint(save_last="link")``'s ``last.ckpt``)
        goes alone, leaving the checkpoint it points at.
        """
        path = os.fspath(filepath)
        if _checkpoint.is_sharded_checkpoint(path) and os.path.islink(path):
            if self.is_global_zero:
                target = os.readlink(path)
                own = os.path.basename(target).startswith(os.path.basename(path) + ".")
                os.unlink(path)
                if own:
                    shutil.rmtree(os.path.join(os.path.dirname(path), target), ignore_errors=True)
            return
        super().remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Close the ZeroOptimizer (its hooks leave the model); Lightning's teardown without moving optimizer state.

        At stage 2 the gradients are dropped first: ``p.grad`` holds placeholders on which
        torch's functions raise, and Lightning's teardown moves the model (``.cpu()``). The
        ZeroOptimizer stays in ``optimizers`` (a checkpoint can still be saved after ``fit``).
        """
        optimizers = self._optimizers
        if self._zero is not None:
            self._zero.close()
            if self._zero.stage == 2:  # p.grad's placeholders (they hold nothing) go: Lightning moves the model
                self._zero.zero_grad()
        self._optimizers = [o for o in optimizers if not isinstance(o, ZeroOptimizer)]
        try:
            super().teardown()
        finally:
            self._optimizers = optimizers

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``"zerofn"`` and ``"zerofn_stage_2"`` (ZeRO-2), ``"zerofn_stage_1"`` (ZeRO-1), in the Trainer's registry."""
        register_names(strategy_registry, cls)
