"""``ZeroTrainer``: ZeRO-1/2 for ``transformers.Trainer``, built on :class:`~zerofn.ZeroOptimizer`.

It is the Trainer (transformers 5.23, accelerate 1.16) with everything that touches the
gradients, the optimizer and its checkpoint handed to zerofn. What it overrides, and why:

- ``__init__``: the Trainer's own, then zerofn's options and the refusals of
  :mod:`zerofn.hf._checks` (before any collective); under ``fp16=True`` accelerate's
  ``GradScaler`` is dropped (zerofn's loss scaler decides for every rank at once).
- ``create_optimizer``: the optimizer the Trainer builds (or was given) becomes a
  ``ZeroOptimizer`` over the model (:func:`zerofn.hf._optimizer.zero_optimizer`).
- ``_prepare_for_training``: accelerate's ``prepare_model`` in evaluation mode, which keeps
  the autocast the Trainer relies on (``bf16=True``, ``fp16=True``) and places the model,
  but wraps it in no ``DistributedDataParallel`` (its hooks would reduce every gradient a
  second time); the ZeroOptimizer goes into :class:`~zerofn.hf._optimizer.ZeroAcceleratedOptimizer`
  (no ``state_dict()`` round trip: that would gather every shard). Then the scheduler and,
  on resume, the optimizer and scheduler states, as the Trainer does.
- ``training_step``: the micro-steps that do not step run under ``ZeroOptimizer.no_sync``
  (``accelerator.no_sync`` does nothing for an unwrapped model), so they communicate
  nothing; the backward is ``ZeroOptimizer.backward`` (the loss times zerofn's loss scale).
- ``_clip_grad_norm`` / ``_get_grad_norm``: the global norm over every rank's shards (in
  float64, one scalar all-reduce), which ``max_grad_norm`` clips by and the Trainer logs;
  torch's functions on ``p.grad`` would see a placeholder at stage 2.
- ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``: every rank writes
  its shards into ``checkpoint-<step>/zerofn_optimizer`` (:mod:`zerofn.hf._checkpoint`);
  no rank saves alone. The model is saved once, by the Trainer, as it saves it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Trainer

from zerofn._integration_options import IntegrationOptions
from zerofn.facade.optimizer import ZeroOptimizer
from zerofn.hf import _checkpoint
from zerofn.hf._checks import WHO, check_trainer
from zerofn.hf._optimizer import ZeroAcceleratedOptimizer, zero_optimizer

__all__ = ["ZeroTrainer"]


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with ZeRO stage 2 (default) or 1: ``ZeroTrainer(model, args, ...)``.

    Takes exactly the Trainer's arguments, positional and keyword, plus zerofn's options as
    keywords, each with its default (:class:`zerofn._integration_options.IntegrationOptions`:
    ``stage=2``, ``overlap_communication``, ``communication_dtype``, ``cpu_offload``, the loss
    scaler's settings under ``fp16=True``, ...). ``trainer.optimizer`` is accelerate's
    wrapper; ``trainer.optimizer.optimizer`` (and :attr:`zero_optimizer`) the ``ZeroOptimizer``.

    Refused at construction, on every rank, saying what to write instead: see
    :mod:`zerofn.hf._checks`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        trainers = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in trainers}  # the rest is zerofn's, or a typo
        self.zero_options = IntegrationOptions.parse(WHO, options)
        self._zero: ZeroOptimizer | None = None
        super().__init__(*args, **kwargs)
        check_trainer(self, self.zero_options, self.optimizer_cls_and_kwargs)
        self.accelerator.scaler = None  # fp16=True: zerofn's loss scaler, not a GradScaler per rank

    @property
    def zero_optimizer(self) -> ZeroOptimizer | None:
        """The ZeroOptimizer this Trainer trains with (``None`` before the first ``train()``)."""
        return self._zero

    # ------------------------------------------------------------------ the optimizer

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (``args.optim``, weight-decay groups; or the one passed) as a ZeroOptimizer.

        Collectives: on its first call, the ZeroOptimizer's construction (the layout's
        agreement, the broadcast of rank 0's params and buffers).
        """
        if self._zero is not None and self.optimizer is not None:
            return self.optimizer
        if self._zero is not None:  # model_init made a new model (train() dropped the optimizer): a new one for it
            self._zero.close()
            self._zero = None
        torch_opt = super().create_optimizer(model)
        kwargs = self.zero_options.facade_kwargs(fp16_mixed=bool(self.args.fp16), who=WHO)
        self._zero = zero_optimizer(torch_opt, self.model, self.zero_options.stage, kwargs)
        self.optimizer = self._zero
        return self._zero

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        """The Trainer's preparation without DDP: autocast and placement, the ZeroOptimizer, scheduler, resume.

        Collectives: the ZeroOptimizer's construction (first call); on resume, its
        ``load_checkpoint`` or ``load_state_dict``.
        """
        if self._created_lr_scheduler:  # as the Trainer: a schedule it made is made again for this run
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        # Autocast and placement, no DDP; first, as its placement writes the params (model.to), which a
        # ZeroOptimizer built before would take for the user's writes at its first step.
        model = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        self.create_optimizer()
        if not isinstance(self.optimizer, ZeroAcceleratedOptimizer):
            self.optimizer = ZeroAcceleratedOptimizer(self._zero)
            # The skip gate (optimizer_step_was_skipped) asks every wrapper: only this run's.
            kept = [o for o in self.accelerator._optimizers if not isinstance(o, ZeroAcceleratedOptimizer)]
            self.accelerator._optimizers = [*kept, self.optimizer]
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        if resume_from_checkpoint is not None:
            # No _load_scaler: zerofn's loss-scale state is in its own checkpoint (a GradScaler's scaler.pt from a
            # run without zerofn is not read; the loss scale then starts at initial_scale).
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    # ------------------------------------------------------------------ a step

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's step; a micro-step that does not step accumulates under ``no_sync`` (no communication).

        Collectives: on the micro-step that steps, zerofn's gradient reductions (from its
        hooks, during or at the end of the backward); none on the others.
        """
        zero = self._zero
        assert zero is not None
        acc = self.accelerator
        sync = acc.sync_gradients or acc.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        with contextlib.nullcontext() if sync else zero.no_sync(), self._backward_through(zero):
            return super().training_step(model, inputs, num_items_in_batch)

    @contextlib.contextmanager
    def _backward_through(self, zero: ZeroOptimizer) -> Iterator[None]:
        """``accelerator.backward(loss)`` is ``zero.backward(loss)`` inside: the loss times zerofn's loss scale.

        accelerate's backward divides by its accumulation steps (the Trainer keeps it at 1)
        and would scale with its ``GradScaler``; zerofn's scaler takes that place (every
        rank skips an overflowing step, or none). Collectives: zerofn's hooks' reductions.
        """
        acc = self.accelerator

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            if kwargs:  # LOMO's learning_rate, DeepSpeed's scale_wrt_gas: their optimizers are refused
                raise TypeError(f"{WHO}: accelerator.backward got {sorted(kwargs)}, which zerofn does not take")
            zero.backward(loss / acc.gradient_accumulation_steps)

        acc.backward = backward  # type: ignore[method-assign]
        try:
            yield
        finally:
            del acc.backward

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """Clip by the global norm over every rank's shards (``ZeroOptimizer.clip_grad_norm_``); return that norm.

        Collectives: one all-reduce of three float64 scalars.
        """
        assert self._zero is not None
        return self._zero.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """The norm the Trainer logs: the clipped step's, or the global norm (a float32 0-d tensor, as torch's).

        Collectives: without ``max_grad_norm``, one all-reduce of three float64 scalars
        (the Trainer computes the norm on every step for its log).
        """
        if grad_norm is not None:
            return grad_norm
        assert self._zero is not None
        norm = self._zero.get_grad_norm()
        return None if norm is None else torch.tensor(norm, dtype=torch.float32)

    # ------------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank its shards (DCP) in ``output_dir/zerofn_optimizer``; ``scheduler.pt`` as the Trainer writes it.

        Collectives: the ZeroOptimizer's ``save_checkpoint``.
        """
        if self._zero is None:  # never trained: the Trainer's own (it has no optimizer to save)
            return super()._save_optimizer_and_scheduler(output_dir)
        _checkpoint.save(output_dir, self._zero, self.lr_scheduler, self.args.should_save)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """zerofn's shards (any world size), or a torch-format ``optimizer.pt``; then ``scheduler.pt``.

        Collectives: the ZeroOptimizer's ``load_checkpoint`` or ``load_state_dict``.
        """
        if checkpoint is None:
            return
        assert self._zero is not None
        _checkpoint.load(checkpoint, self._zero, self.lr_scheduler)
