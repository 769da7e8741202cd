"""Real ``transformers.Trainer`` runs for the tests of zerofn.hf, on a rank of a ``World`` pool.

A GPT-2 of one layer built from a config (no download; 4,464 params, the embedding tied to
the head), an in-memory dataset of random token rows (labels = inputs), and the two sides
of every comparison: :class:`~zerofn.hf.ZeroTrainer` and the Trainer's own DDP run of the
same script (:class:`DDPTrainer`). The pool's workers set ``RANK`` / ``WORLD_SIZE`` as
torchrun does and their process group is up, so the Trainer finds both.

Bitwise by construction (DESIGN's rule): at 2 ranks an fp32 mean does not depend on the
order of the sum; at 3 zerofn sends the gradients as float64 (``communication_dtype``) and
the DDP side through ``float64_wire_hook``. The DDP side clips with ``clip_in_float64``
(zerofn's arithmetic: the norm in float64) unless ``torch_clip=True`` (torch's own float32
``clip_grad_norm_``, the Trainer's default).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import transformers
from helpers import clip_in_float64, float64_wire_hook, seeded
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import zerofn as zf
from zerofn.hf import ZeroTrainer

__all__ = ["DDPTrainer", "Recorder", "args", "data", "model", "params", "run", "state_bytes"]

ROWS, SEQ, VOCAB = 96, 8, 64


def model(seed: int = 0, frozen: tuple[str, ...] = ()) -> GPT2LMHeadModel:
    """The tiny GPT-2 (no dropout, so a step is a function of its batch), the same on every rank."""
    torch.manual_seed(seeded(seed))
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    net = GPT2LMHeadModel(config)
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)  # PEFT-like: the optimizer leaves these out
    return net


def data(seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Token rows, labels equal to the inputs (the causal LM's loss shifts them)."""
    g = torch.Generator().manual_seed(seeded(seed))
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def args(out: str | None = None, **kw: Any) -> TrainingArguments:
    """The script's TrainingArguments: 8 steps on the CPU, a log line per step, no saves unless asked."""
    base: dict[str, Any] = {
        "output_dir": out or tempfile.mkdtemp(),
        "max_steps": 8,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "warmup_steps": 2,
        "max_grad_norm": 0.0,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": seeded(0),
    }
    base.update(kw)
    return TrainingArguments(**base)


class DDPTrainer(Trainer):
    """The Trainer's own DDP run, optionally on zerofn's float64 wire and with zerofn's float64 clipping."""

    def __init__(self, *a: Any, wire64: bool = False, torch_clip: bool = False, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.wire64, self.torch_clip = wire64, torch_clip

    def _prepare_for_training(self, *a: Any, **kw: Any) -> Any:
        wrapped, loader = super()._prepare_for_training(*a, **kw)
        if self.wire64 and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            wrapped.register_comm_hook(None, float64_wire_hook)
        return wrapped, loader

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        if self.torch_clip:
            return super()._clip_grad_norm(model)
        return torch.tensor(clip_in_float64(model.parameters(), self.args.max_grad_norm), dtype=torch.float32)


class Recorder(TrainerCallback):
    """zerofn's bytes per micro-step that does not step and per optimizer step; params after ``at`` steps."""

    def __init__(self, at: int | None = None, stop_at: int | None = None) -> None:
        self.micro: list[int] = []
        self.steps: list[int] = []
        self.at, self.stop_at = at, stop_at
        self.snapshot: dict[str, torch.Tensor] | None = None
        self._counting: Any = None

    def _start(self) -> None:
        self._counting = contextlib.ExitStack()
        self._counter = self._counting.enter_context(zf.count_bytes())

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._start()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.micro.append(self._counter.bytes_sent)
        self._counting.close()
        self._start()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.steps.append(self._counter.bytes_sent)
        self._counting.close()
        if state.global_step == self.at:
            self.snapshot = params(model)
        if state.global_step == self.stop_at:
            control.should_training_stop = True
            control.should_save = True


def params(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def state_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree``, each storage once (zerofn's names are views of flat buffers)."""
    import torch.utils._pytree as pytree

    seen = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def run(
    zero: bool,
    train_args: TrainingArguments,
    *,
    frozen: tuple[str, ...] = (),
    recorder: Recorder | None = None,
    resume: str | None = None,
    ddp: dict[str, Any] | None = None,
    **zero_options: Any,
) -> Trainer:
    """One training run of the script, ZeroTrainer (with ``zero_options``) or the Trainer's DDP (``ddp`` keywords)."""
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    net = model(frozen=frozen)
    kw: dict[str, Any] = {"model": net, "args": train_args, "train_dataset": data()}
    if train_args.eval_strategy != "no":
        kw["eval_dataset"] = data(seed=2)[:16]
    trainer = ZeroTrainer(**kw, **zero_options) if zero else DDPTrainer(**kw, **(ddp or {}))
    trainer.remove_callback(PrinterCallback)
    if recorder is not None:
        trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def world() -> int:
    return dist.get_world_size()
