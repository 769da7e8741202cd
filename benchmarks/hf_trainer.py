"""ZeroTrainer against the Hugging Face Trainer's own DDP: the step time of the same script, and the memory per rank.

    python -m benchmarks.hf_trainer              # a GPT-2 of 4 layers (d = 256, vocab 8192), N = 2 gloo ranks
    python -m benchmarks.hf_trainer --quick      # tiny model, few steps (a smoke run)

Needs the ``hf`` extra (``pip install -e '.[hf]'``). On the same ranks in one run, the same
script (AdamW, the Trainer's default ``adamw_torch_fused``; ``max_grad_norm=1.0``, the
Trainer's default; accumulation 2; a token dataset in memory) under:

* ``trainer-ddp``: ``transformers.Trainer`` (accelerate wraps the model in DDP);
* ``zerotrainer-s1`` / ``zerotrainer-s2``: ``zerofn.hf.ZeroTrainer(stage=1)`` / ``(stage=2)``.

The systems take turns for ``--reps`` rounds of ``--steps`` optimizer steps each (a fresh
Trainer per round, so that the machine's load falls on every system alike); a step is timed
from the Trainer's ``on_step_begin`` to its ``on_step_end`` (both micro-batches, the
clipping, the optimizer step), the first step of each round left out. Reported per
system: the median step time and its ratio to ``trainer-ddp``'s; the optimizer state per
rank (DDP: AdamW's two moments; zerofn: its float32 master shards and AdamW's moments),
and the gradient bytes each rank holds at the optimizer step (DDP: every ``p.grad``;
zerofn: ``ZeroOptimizer.grad_bytes()``: ``p.grad`` at stage 1, the shards at stage 2),
both from the tensors' sizes; the largest difference of its logged losses from
``trainer-ddp``'s (small, not 0: the Trainer's DDP clips with torch's float32 norm, zerofn
with its float64 one, so the clipping coefficients may differ in their last bits).

Not measured: the Trainer's FSDP ``shard_grad_op``. On the CPU, transformers 5.23 with
``fsdp="shard_grad_op"`` trained under DDP here (``trainer.model_wrapped`` was a
``DistributedDataParallel``), so there was nothing of FSDP's to time; that comparison
needs GPUs. Prints one JSON object (``--out`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from zerofn.testing import World

SYSTEMS = ("trainer-ddp", "zerotrainer-s1", "zerotrainer-s2")
FULL = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128}
QUICK = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 16}


def _model(shape: dict[str, int]) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _state_bytes(trainer: Any, zero: bool) -> int:
    """This rank's optimizer-state bytes (zerofn: its master and AdamW shards, each flat buffer once)."""
    if not zero:
        state = trainer.optimizer.optimizer.state
        return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if t.dim() > 0)
    import torch.utils._pytree as pytree

    z = trainer.zero_optimizer
    seen, total = set(), 0
    for t in pytree.tree_leaves((z.state.master, z.state.opt_state)):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _timer() -> Any:
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """Each optimizer step's wall time, and the gradient bytes held at the step."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.grad_bytes = 0
            self.trainer: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            dist.barrier()
            self._start = time.perf_counter()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            zero = getattr(self.trainer, "zero_optimizer", None)
            if zero is not None:
                self.grad_bytes = zero.grad_bytes()
            else:
                self.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            dist.barrier()
            self.times.append(time.perf_counter() - self._start)

    return Timer()


def _rank(quick: bool, steps: int, reps: int) -> dict[str, Any]:
    """On every rank: each system's step times, logged losses, state and gradient bytes."""
    import transformers
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from zerofn.hf import ZeroTrainer

    transformers.logging.set_verbosity_error()
    shape = QUICK if quick else FULL
    seq, n = shape["n_positions"], dist.get_world_size()
    rows = 4 * 2 * n * (steps + 1)  # per_device 4, accumulation 2, one epoch of steps + 1 per round
    tokens = torch.randint(0, shape["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in tokens]
    out: dict[str, Any] = {name: {"times": [], "losses": [], "state": 0, "grads": 0} for name in SYSTEMS}
    for _ in range(reps):
        for name in SYSTEMS:  # interleaved: the machine's load falls on every system alike
            args = TrainingArguments(
                output_dir=tempfile.mkdtemp(),
                max_steps=steps + 1,
                per_device_train_batch_size=4,
                gradient_accumulation_steps=2,
                learning_rate=1e-3,
                use_cpu=True,
                report_to=[],
                save_strategy="no",
                logging_steps=1,
                disable_tqdm=True,
            )
            kw = {"model": _model(shape), "args": args, "train_dataset": data}
            trainer = Trainer(**kw) if name == "trainer-ddp" else ZeroTrainer(**kw, stage=int(name[-1]))
            for callback in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(callback)
            timer = _timer()
            timer.trainer = trainer
            trainer.add_callback(timer)
            trainer.train()
            run = out[name]
            run["times"] += timer.times[1:]  # the first step of a round warms up
            run["losses"] += [h["loss"] for h in trainer.state.log_history if "loss" in h]
            run["state"], run["grads"] = _state_bytes(trainer, name != "trainer-ddp"), timer.grad_bytes
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2, help="ranks")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10, --quick 2)")
    ap.add_argument("--reps", type=int, default=None, help="rounds per system (default 3, --quick 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.quick else 10)
    reps = args.reps or (1 if args.quick else 3)
    with World(args.n, timeout=600.0) as world:
        per_rank = world.run(_rank, args.quick, steps, reps)
    shape = QUICK if args.quick else FULL
    psi = sum(p.numel() for p in _model(shape).parameters())
    result: dict[str, Any] = {"model": f"gpt2 {shape}", "n": args.n, "params": psi, "note": args.note}
    result["load_average"], result["steps"], result["reps"], result["systems"] = os.getloadavg(), steps, reps, {}
    ddp_median = statistics.median(per_rank[0]["trainer-ddp"]["times"])
    for name in SYSTEMS:
        median = statistics.median(per_rank[0][name]["times"])
        pairs = [zip(r[name]["losses"], r["trainer-ddp"]["losses"], strict=True) for r in per_rank]
        result["systems"][name] = {
            "median_step_s": median,
            "vs_ddp": median / ddp_median,
            "state_bytes_per_rank": max(r[name]["state"] for r in per_rank),
            "grad_bytes_per_rank": max(r[name]["grads"] for r in per_rank),
            "max_loss_diff_vs_ddp": max(abs(a - b) for p in pairs for a, b in p),
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
