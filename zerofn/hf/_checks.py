"""What ``ZeroTrainer`` refuses at construction, on every rank, before any collective, and why.

Each refusal says what to write instead. What is neither here nor in ``ZeroTrainer``'s
overrides runs as the Trainer runs it (evaluation during training, ``save_steps``,
``save_total_limit``, ``save_only_model``, ``load_best_model_at_end``, frozen params,
activation checkpointing, logging, callbacks).

The ``optim=`` names served (:data:`SERVED_OPTIMIZERS`): ``adamw_torch_fused`` (the
Trainer's default), ``adamw_torch``, ``sgd`` (torch's classes, on zerofn's fast path) and
``adafactor`` (transformers' ``Adafactor``, on whole params on their owner ranks). The
others are refused by name; a torch optimizer zerofn shards can still be passed with
``optimizers=(optimizer, scheduler)`` or ``optimizer_cls_and_kwargs=``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from transformers.optimization import Adafactor

from zerofn import torch_optim
from zerofn._integration_options import IntegrationOptions
from zerofn.facade._guards import check_module

__all__ = ["SERVED_OPTIMIZERS", "WHO", "check_trainer"]

WHO = "zerofn.hf.ZeroTrainer"

#: The ``TrainingArguments.optim`` names ZeroTrainer builds an optimizer for.
SERVED_OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "sgd", "adafactor")

_WHY = {
    "deepspeed": "args.deepspeed hands the model and the optimizer to DeepSpeed's engine, which shards them itself",
    "fsdp": "args.fsdp hands the model to FSDP, which shards the params, gradients and optimizer state itself",
    "torch_compile": (
        "torch_compile=True wraps the model in accelerate's torch.compile; zerofn's hooks on the model (the buffers' "
        "broadcast before each forward, overlap_allgather's param writes) are not run under a compiled module. "
        "Leave the model uncompiled (the default), compile its blocks yourself before building the Trainer, or "
        "compile zerofn's step after the backward with ZeroTrainer(compile=True)"
    ),
    "auto_find_batch_size": (
        "auto_find_batch_size=True reruns the training loop after an out-of-memory error with the optimizer it "
        "already built (its hooks and shards from the failed attempt); set per_device_train_batch_size yourself "
        "(zerofn's stage 2 already keeps 1/N of the gradients and optimizer state per rank)"
    ),
}


def _refuse(why: str) -> None:
    raise ValueError(f"{WHO}: {why}.")


def _check_optimizer(args: Any, optimizer: Any, optimizer_cls_and_kwargs: Any, options: IntegrationOptions) -> None:
    """The optimizer the Trainer will build or was given: one zerofn shards, or a refusal naming it."""
    if optimizer is not None:
        if type(optimizer) is Adafactor:
            _refuse(
                "transformers' Adafactor passed through optimizers=(...) would keep its own param_groups apart from "
                "zerofn's; pass optim='adafactor' (and lr_scheduler_type / learning_rate) in the TrainingArguments"
            )
        torch_optim.check_shardable(type(optimizer))
        return
    if optimizer_cls_and_kwargs is not None:
        cls = optimizer_cls_and_kwargs[0]
        if cls is not Adafactor:
            torch_optim.check_shardable(cls)
        return
    name = str(getattr(args.optim, "value", args.optim))
    if name not in SERVED_OPTIMIZERS:
        _refuse(
            f"optim={name!r} is not served; the optim= names zerofn shards are {list(SERVED_OPTIMIZERS)}. Another "
            "torch optimizer zerofn shards (Adagrad, RMSprop, Muon, ...) can be passed with "
            "optimizers=(optimizer, None) or optimizer_cls_and_kwargs=(cls, kwargs)"
        )
    if options.compile and name == "adamw_torch_fused":
        _refuse("compile=... runs AdamW without fused kernels: pass optim='adamw_torch' in the TrainingArguments")


def check_trainer(trainer: Any, options: IntegrationOptions, optimizer_cls_and_kwargs: Any) -> None:
    """Raise ``ValueError`` (``TypeError`` for an optimizer zerofn cannot shard) naming what to write instead.

    Reads the Trainer's ``args``, model, optimizer and accelerator only: no collectives.
    """
    args = trainer.args
    check_module(trainer.model)  # a DDP-wrapped model would have its gradients reduced twice
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        _refuse(
            "the model was sharded at load time (from_pretrained(distributed_config=...)), which owns its own "
            "gradient reduction; load it whole and let zerofn shard the optimizer state"
        )
    if args.deepspeed:
        _refuse(_WHY["deepspeed"] + "; use one of the two")
    if args.fsdp:
        _refuse(_WHY["fsdp"] + "; use one of the two")
    if getattr(args, "parallelism_config", None) is not None or (getattr(trainer.model, "tp_size", None) or 1) > 1:
        _refuse("tensor, context or sequence parallelism (parallelism_config, tp_size) is not combined with zerofn")
    # DDP's own settings would be ignored without a word (there is no DDP): say what zerofn takes instead.
    for flag, instead in (("ddp_bucket_cap_mb", "reduce_bucket_size"), ("ddp_broadcast_buffers", "broadcast_buffers")):
        if getattr(args, flag, None) is not None:
            _refuse(
                f"{flag}={getattr(args, flag)!r} configures DistributedDataParallel, which ZeroTrainer does not use; "
                f"drop it and pass zerofn's own option, ZeroTrainer(..., {instead}=...)"
            )
    for flag in ("torch_compile", "auto_find_batch_size"):
        if getattr(args, flag):
            _refuse(_WHY[flag])
    if args.fp16 and args.device.type == "cpu":
        _refuse(
            "fp16=True on the CPU: accelerate has no float16 autocast there (it would train in float32 and say "
            "nothing). Use bf16=True on the CPU; fp16=True runs on a GPU, with zerofn's loss scaler"
        )
    if args.n_gpu > 1:
        _refuse(
            f"this process sees {args.n_gpu} GPUs and the Trainer would wrap the model in nn.DataParallel; launch "
            "one process per GPU with torchrun (CUDA_VISIBLE_DEVICES or LOCAL_RANK picks each one's)"
        )
    if not (dist.is_available() and dist.is_initialized()):
        _refuse(
            "zerofn shards over torch.distributed's process group, which is not initialized: launch the script "
            "with torchrun (torchrun --nproc-per-node=N script.py; N=1 works too)"
        )
    _check_optimizer(args, trainer.optimizer, optimizer_cls_and_kwargs, options)
