"""Train a small model with zerofn's functional ZeRO loop next to DDP, and compare.

Run it on one machine; it starts its own gloo ranks on the CPU::

    python -m zerofn demo                          # 2 ranks, ZeRO stage 2, AdamW
    python -m zerofn demo --world-size 3 --stage 1 --steps 50

or let torchrun start the ranks (the same code; ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` in the environment switch it to ``init_process_group("env://")``)::

    torchrun --standalone --nproc_per_node=2 -m zerofn demo --steps 50

Every rank trains the same MLP on the same synthetic classification data twice, with the
same per-rank batches:

* zerofn: ``torch.func.functional_call`` + ``torch.func.grad`` -> ``zf.reduce_grads`` ->
  ``zf.step_shards`` -> ``zf.gather_params`` (optimizer state sharded over the ranks);
* the reference: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``
  (optimizer state replicated on every rank).

Rank 0 shows a progress bar and the caller gets a report: the loss, how far zerofn's
params are from DDP's, optimizer-state bytes per rank, bytes sent per rank per step
against the byte-optimal 2(N-1)/N·Ψ·b, and the time per step of both.

:func:`train` is the per-rank script (call it inside an initialised process group);
:func:`run` starts the ranks when needed and returns rank 0's report as a dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerofn as zf

__all__ = ["DemoConfig", "add_arguments", "config_from_args", "format_report", "run", "train"]

PRECISIONS = ("fp32",)  # bf16 and fp16 arrive with zerofn's mixed-precision policy
COMM_CHOICES = ("auto", "byte-optimal")
TIMEOUT_S = 120.0  # every process group gets a timeout: a stuck collective becomes an error
NO_MASTER_ADDR = (
    "RANK and WORLD_SIZE are set but MASTER_ADDR is not: launch with torchrun, "
    "or unset RANK and WORLD_SIZE to let the demo start its own ranks"
)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo trains and how.

    Attributes:
      world_size: ranks to start when the demo starts its own (under torchrun,
        ``WORLD_SIZE`` decides).
      stage: ZeRO stage: 1 all-reduces the grads and keeps this rank's shards, 2 uses
        the group's reduce realisation (``comm``).
      steps: optimizer steps.
      precision: ``"fp32"`` (the only one for now).
      seed: seeds the model init and the synthetic data (identical on every rank).
      comm: ``"auto"`` (:class:`zerofn.CommPolicy`'s per-backend choice: all-reduce and
        broadcast on gloo) or ``"byte-optimal"`` (reduce-scatter and all-gather).
      batch_per_rank: samples each rank sees per step.
      lr: AdamW learning rate (the same for zerofn and torch.optim).
      max_norm: global gradient-norm clip for both runs, or ``None`` for none. zerofn
        computes the norm in float64 (as the seed), ``clip_grad_norm_`` in float32, so
        with clipping the two runs drift apart by an ulp now and then (about 1e-7
        relative after hundreds of steps); without it they are bitwise equal at 2 ranks.
      progress: draw the progress bar on rank 0 (stderr).
    """

    world_size: int = 2
    stage: int = 2
    steps: int = 100
    precision: str = "fp32"
    seed: int = 0
    comm: str = "auto"
    batch_per_rank: int = 32
    lr: float = 3e-3
    max_norm: float | None = None
    progress: bool = True

    def problems(self) -> list[str]:
        """What is wrong with this config, as messages a user can act on (empty: fine)."""
        out = []
        if self.world_size < 1:
            out.append(f"--world-size must be at least 1, got {self.world_size}")
        if self.stage not in (1, 2):
            out.append(f"--stage must be 1 or 2, got {self.stage}")
        if self.steps < 1:
            out.append(f"--steps must be at least 1, got {self.steps}")
        if self.precision not in PRECISIONS:
            out.append(
                f"--precision {self.precision} is not available yet: mixed precision "
                "(bf16, fp16) is still being built; use --precision fp32"
            )
        if self.comm not in COMM_CHOICES:
            out.append(f"--comm must be one of {', '.join(COMM_CHOICES)}, got {self.comm!r}")
        if self.max_norm is not None and not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            out.append(f"--max-norm must be a positive finite number, got {self.max_norm}")
        if self.batch_per_rank < 1:
            out.append(f"batch_per_rank must be at least 1, got {self.batch_per_rank}")
        return out


# ---------------------------------------------------------------------------- model, data

IN_DIM, HIDDEN, CLASSES = 32, 128, 10
DATA_SIZE = 4096


def make_model(seed: int) -> nn.Module:
    """The MLP both runs train; the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` synthetic samples: Gaussian inputs labelled by a fixed random teacher network."""
    # Its own generator, so the data does not depend on how the model was initialised.
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, IN_DIM, generator=g)
    w1 = torch.randn(IN_DIM, 64, generator=g) / math.sqrt(IN_DIM)
    w2 = torch.randn(64, CLASSES, generator=g) / 8.0
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


def batches(
    x: torch.Tensor, y: torch.Tensor, rank: int, world: int, per_rank: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of each global batch, cycling through the data forever."""
    global_batch = per_rank * world
    start = 0
    while True:
        if start + global_batch > len(x):
            start = 0  # wrap around: drop the last partial global batch, as drop_last=True
        lo = start + rank * per_rank  # rank r takes rows [r*B, (r+1)*B) of the global batch
        yield x[lo : lo + per_rank], y[lo : lo + per_rank]
        start += global_batch


# ---------------------------------------------------------------------------- progress bar


class ProgressBar:
    """One line of progress: redrawn in place on a terminal, printed once at the end otherwise.

    Written here so that torch stays zerofn's only run-time dependency.
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.live = enabled and self.stream.isatty()  # no \r redraws in logs and pipes

    def update(self, done: int, note: str = "") -> None:
        """Show ``done`` of ``total`` steps, with ``note`` after the bar."""
        if not self.enabled or not (self.live or done == self.total):
            return
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{self.total} {time.perf_counter() - self.start:5.1f}s {note}"
        self.stream.write(f"\r{line}" if self.live else f"{line}\n")
        if self.live and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


# ---------------------------------------------------------------------------- the script


def train(cfg: DemoConfig, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Train with zerofn and with DDP on this rank; return the report (the same on every rank).

    Call on every rank of an initialised gloo process group (``group``; ``None``: the
    default group). Straight-line on purpose, as nanoGPT's ``train.py``.

    Returns:
      A dict with the config (``world_size``, ``stage``, ``steps``, ``precision``, ``seed``,
      ``comm``, ``max_norm``); ``num_params`` (Ψ); ``loss_start`` / ``loss_end`` (zerofn)
      and ``ddp_loss_start`` / ``ddp_loss_end``, each the mean over ranks of that step's
      batch loss; ``max_abs_diff`` and ``max_rel_diff``, the final params against DDP's
      (relative: per tensor ``max|a - b| / max|b|``, the largest over tensors and ranks);
      ``state_bytes_per_rank`` (``ZeroState.nbytes``: master + AdamW shards, the largest
      over ranks); ``unsharded_bytes`` (params + torch AdamW state of one DDP rank);
      ``bytes_sent_per_step`` (mean over steps of ``zf.count_bytes`` around reduce, step
      and gather, the largest over ranks) and ``bytes_by_collective`` (rank 0, per step);
      ``theory_bytes_per_step`` (2(N-1)/N·Ψ·b); ``reduce`` / ``gather`` (the collectives
      used); ``ms_per_step`` and ``ddp_ms_per_step`` (rank 0, median over steps).
    """
    problems = cfg.problems()
    if problems:
        raise ValueError("; ".join(problems))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    master_process = rank == 0  # only rank 0 draws the bar, as nanoGPT's master_process
    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only fight
    x, y = make_data(cfg.seed, max(DATA_SIZE, cfg.batch_per_rank * world))

    # --- zerofn: the params are a plain dict, the model only a function of them.
    model = make_model(cfg.seed)
    # Our own copies, detached: torch.func differentiates with respect to the dict.
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = zf.optim.adamw(lr=cfg.lr, weight_decay=0.01)
    # This rank's 1/N of the fp32 master weights and AdamW moments; no communication.
    state = zf.shard_params(params, opt, group)
    policy = zf.CommPolicy.byte_optimal() if cfg.comm == "byte-optimal" else zf.CommPolicy()
    reduce_how, gather_how = policy.resolve(group)
    if cfg.stage == 1:
        reduce_how = "all_reduce"  # ZeRO-1 all-reduces the full grads, then keeps its shards

    def loss_fn(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = F.cross_entropy(torch.func.functional_call(model, p, (xb,)), yb)
        return loss, loss.detach()  # (what to differentiate, aux: the value, for the log)

    grad_fn = torch.func.grad(loss_fn, has_aux=True)  # -> (grads dict like p, loss)

    # --- the reference: the same weights under DDP + torch.optim, state replicated.
    ref = make_model(cfg.seed)
    ddp = nn.parallel.DistributedDataParallel(ref, process_group=group)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, weight_decay=0.01)

    losses, ddp_losses, ms, ddp_ms, sent = [], [], [], [], []
    by_collective: dict[str, int] = {}
    bar = ProgressBar(cfg.steps, enabled=cfg.progress and master_process)
    data = batches(x, y, rank, world, cfg.batch_per_rank)
    for step in range(1, cfg.steps + 1):
        xb, yb = next(data)

        # Start each timing with the ranks in step, so that neither run pays for the skew
        # the other left behind (collectives wait for the slowest rank).
        dist.barrier(group)
        t0 = time.perf_counter()
        grads, loss = grad_fn(params, xb, yb)  # full local grads of this rank's batch
        with zf.count_bytes() as counter:
            gshards = zf.reduce_grads(grads, state.layout, group, stage=cfg.stage, policy=policy)
            state, _info = zf.step_shards(state, gshards, group, max_norm=cfg.max_norm)
            params = zf.gather_params(state, group, policy=policy)  # full, equal on all ranks
        ms.append(1e3 * (time.perf_counter() - t0))
        sent.append(counter.bytes_sent)
        for kind, nbytes in counter.by_collective.items():
            by_collective[kind] = by_collective.get(kind, 0) + nbytes
        losses.append(float(loss))

        dist.barrier(group)
        t0 = time.perf_counter()
        ref_loss = F.cross_entropy(ddp(xb), yb)
        ref_loss.backward()  # DDP all-reduces the grads (mean over ranks) during backward
        if cfg.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.max_norm)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        ddp_ms.append(1e3 * (time.perf_counter() - t0))
        ddp_losses.append(float(ref_loss.detach()))

        bar.update(step, f"rank-0 loss {losses[-1]:.4f}")

    # --- compare params, memory and bytes, reduced over ranks so every rank reports the same.
    max_abs, max_rel = 0.0, 0.0
    for name, p_ref in ref.named_parameters():
        diff = float((params[name] - p_ref.detach()).abs().max())
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(float(p_ref.detach().abs().max()), 1e-30))
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    torch_state_bytes = sum(
        t.numel() * t.element_size() for s in torch_opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    num_params = sum(p.numel() for p in params.values())
    elem = next(iter(params.values())).element_size()
    worst = torch.tensor([max_abs, max_rel, state.nbytes, sum(sent) / len(sent)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    mean = torch.tensor([losses[0], losses[-1], ddp_losses[0], ddp_losses[-1]], dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    mean /= world  # the mean of per-rank batch losses is the global batch's loss
    return {
        "world_size": world,
        "stage": cfg.stage,
        "steps": cfg.steps,
        "precision": cfg.precision,
        "seed": cfg.seed,
        "comm": cfg.comm,
        "max_norm": cfg.max_norm,
        "reduce": reduce_how if world > 1 else "none",
        "gather": gather_how if world > 1 else "none",
        "num_params": num_params,
        "loss_start": float(mean[0]),
        "loss_end": float(mean[1]),
        "ddp_loss_start": float(mean[2]),
        "ddp_loss_end": float(mean[3]),
        "max_abs_diff": float(worst[0]),
        "max_rel_diff": float(worst[1]),
        "state_bytes_per_rank": int(worst[2]),
        "unsharded_bytes": param_bytes + torch_state_bytes,
        "bytes_sent_per_step": float(worst[3]),
        "bytes_by_collective": {k: v / cfg.steps for k, v in sorted(by_collective.items())},
        "theory_bytes_per_step": 2 * (world - 1) / world * num_params * elem,
        # Medians: the first steps pay one-off costs (DDP rebuilds its buckets at step 2).
        "ms_per_step": statistics.median(ms),
        "ddp_ms_per_step": statistics.median(ddp_ms),
    }


def format_report(r: dict[str, Any]) -> str:
    """The report :func:`train` returns, as the lines the command line prints."""
    n = r["world_size"]
    theory, measured = r["theory_bytes_per_step"], r["bytes_sent_per_step"]
    bytes_ratio = f": {measured / theory:.2f}x" if theory else ""
    kinds = " + ".join(r["bytes_by_collective"]) or "none"
    clip = f", clip {r['max_norm']:g}" if r["max_norm"] is not None else ""
    lines = [
        f"zerofn demo: ZeRO stage {r['stage']}, {n} gloo rank(s), {r['precision']}, "
        f"{r['steps']} steps, AdamW{clip}, MLP {IN_DIM}-{HIDDEN}-{HIDDEN}-{CLASSES} "
        f"(Ψ = {r['num_params']:,} params)",
        f"  loss             {r['loss_start']:.4f} -> {r['loss_end']:.4f}   "
        f"(DDP {r['ddp_loss_start']:.4f} -> {r['ddp_loss_end']:.4f})",
        f"  params vs DDP    max abs diff {r['max_abs_diff']:.3g}, max rel diff {r['max_rel_diff']:.3g}",
        f"  optimizer state  {r['state_bytes_per_rank']:,} B per rank (fp32 master + AdamW "
        f"shards) vs {r['unsharded_bytes']:,} B unsharded: "
        f"{r['state_bytes_per_rank'] / r['unsharded_bytes']:.2f}x",
        f"  bytes sent       {measured:,.0f} B per rank per step ({kinds})",
        f"                   vs 2(N-1)/N·Ψ·b = {theory:,.0f} B byte-optimal{bytes_ratio}",
        f"  time per step    zerofn {r['ms_per_step']:.2f} ms, DDP {r['ddp_ms_per_step']:.2f} ms (median)",
    ]
    if n > 1 and r["reduce"] != "reduce_scatter" and r["comm"] == "auto":
        lines.append(
            f"  (on gloo zerofn reduces with {r['reduce']} and gathers with {r['gather']}: more\n"
            "   bytes, less time; --comm byte-optimal uses reduce_scatter + all_gather)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- launching


def launched_by_torchrun() -> bool:
    """True when the environment names this process's rank (torchrun, or set by hand)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Run :func:`train` on every rank and return rank 0's report.

    * A default process group already exists: train in it (this process is a rank).
    * ``RANK`` and ``WORLD_SIZE`` are set (torchrun): join with ``init_process_group``
      over ``env://`` on gloo, train, and leave the group.
    * Otherwise start ``cfg.world_size`` gloo ranks with :class:`zerofn.testing.World`.

    Raises:
      ValueError: ``cfg`` is invalid, or the torchrun environment is incomplete.
    """
    problems = cfg.problems()
    if problems:
        raise ValueError("; ".join(problems))
    if dist.is_initialized():
        return train(cfg)
    if launched_by_torchrun():
        if "MASTER_ADDR" not in os.environ:
            raise ValueError(NO_MASTER_ADDR)
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=TIMEOUT_S))
        try:
            return train(cfg)
        finally:
            dist.destroy_process_group()
    from zerofn.testing import World  # only needed when the demo starts its own ranks

    with World(cfg.world_size, timeout=TIMEOUT_S, threads=1) as world:
        return world.run(train, cfg)[0]  # every rank returns the same report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's command-line options to ``parser``."""
    d = DemoConfig()
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help=f"gloo ranks to start (default {d.world_size}; under torchrun: its WORLD_SIZE)",
    )
    parser.add_argument("--stage", type=int, choices=(1, 2), default=d.stage, help="ZeRO stage (default %(default)s)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default=d.precision,
        help="fp32 (bf16 and fp16 are not available yet)",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="model and data seed (default %(default)s)")
    parser.add_argument(
        "--comm",
        choices=COMM_CHOICES,
        default=d.comm,
        help="collectives: auto (the fastest per backend, default) or byte-optimal "
        "(reduce-scatter and all-gather everywhere)",
    )
    parser.add_argument(
        "--max-norm",
        type=float,
        default=None,
        help="clip the global gradient norm to this in both runs (default: no clipping)",
    )
    parser.add_argument("--no-progress", action="store_true", help="draw no progress bar")
    parser.set_defaults(world_size_default=d.world_size)


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DemoConfig:
    """A checked :class:`DemoConfig` from parsed options; ``parser.error`` (exit 2) if not valid."""
    problems = []
    world_size = args.world_size if args.world_size is not None else args.world_size_default
    if launched_by_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != env_world:
            problems.append(
                f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={env_world}; "
                "leave --world-size out under torchrun"
            )
        if "MASTER_ADDR" not in os.environ:
            problems.append(NO_MASTER_ADDR)
        world_size = env_world
    cfg = DemoConfig(
        world_size=world_size,
        stage=args.stage,
        steps=args.steps,
        precision=args.precision,
        seed=args.seed,
        comm=args.comm,
        max_norm=args.max_norm,
        progress=not args.no_progress,
    )
    problems += cfg.problems()
    if problems:
        parser.error("; ".join(problems))
    return cfg


def main(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    """Run the demo from parsed options and print rank 0's report; return the exit code."""
    cfg = config_from_args(args, parser)
    report = run(cfg)
    if not launched_by_torchrun() or int(os.environ["RANK"]) == 0:  # rank-0-only printing
        stream = out or sys.stdout
        stream.write(format_report(report) + "\n")
        stream.flush()
    return 0
