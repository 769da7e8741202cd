"""Train a small model with zerofn's ZeRO stage 1 or 2 next to DDP, and compare.

Run it on one machine; it starts its own gloo ranks on the CPU::

    python -m zerofn demo                          # 2 ranks, ZeRO stage 2, fp32, AdamW
    python -m zerofn demo --world-size 3 --stage 1 --steps 50
    python -m zerofn demo --precision bf16 --accumulate 4
    python -m zerofn demo --overlap --plot demo.png   # the ZeroOptimizer facade, a PNG

or let torchrun start the ranks (the same code; ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` in the environment switch it to ``init_process_group("env://")``)::

    torchrun --standalone --nproc_per_node=2 -m zerofn demo --steps 50

Every rank trains the same MLP on the same synthetic classification data twice, with the
same per-rank batches:

* zerofn, through one of its two APIs (``--api``):

  - ``functional`` (default): ``torch.func.functional_call`` + ``torch.func.grad`` ->
    ``zf.reduce_grads`` -> ``zf.step_shards`` -> ``zf.gather_params``, the state threaded
    by hand (:class:`FunctionalRun`);
  - ``facade``: ``zf.ZeroOptimizer(torch.optim.AdamW(...))`` in an ordinary
    ``backward`` / ``step`` / ``zero_grad`` loop (:class:`FacadeRun`). Only the facade
    can overlap communication with backward (``--overlap``): it launches each bucket's
    reduction from gradient hooks while autograd is still running, and the functional
    loop has no hooks (``torch.func.grad`` returns all gradients at once). So
    ``--overlap`` picks the facade when ``--api`` is not given.

* the reference: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``
  with the optimizer state replicated on every rank (:class:`DDPRun`).

``--precision`` sets the working dtype of both runs. Under bf16 and fp16 both keep fp32
master weights and AdamW state: zerofn through ``zf.PrecisionPolicy.for_dtype`` (1/N of
them per rank), DDP as the usual hand-written loop (a working-dtype model, an fp32 copy
of every param that ``torch.optim.AdamW`` updates, the params copied back after each
step), and fp16 adds dynamic loss scaling on both sides (zerofn's
``DynamicLossScaler`` with ``hysteresis=1`` follows ``torch.amp.GradScaler``'s rule, which
the reference uses). ``--accumulate K`` sums K micro-batch gradients per step with no
communication before the last one (``ddp.no_sync()``, ``ZeroOptimizer.no_sync()``, or a
local sum in the functional loop); both runs sum them in the working dtype, as DDP's
``p.grad`` does.

Rank 0 shows a progress bar and the caller gets a report: the loss, how far zerofn's
params are from DDP's (with the tolerance of the working dtype), optimizer-state bytes
per rank, bytes sent per rank per step against the byte-optimal 2(N-1)/N·Ψ·b, and the
time per step of both. ``--plot PATH`` draws the loss curves and the memory bars into a
PNG (needs matplotlib, imported only then).

:func:`train` is the per-rank script (call it inside an initialised process group);
:func:`run` starts the ranks when needed and returns rank 0's report as a dict;
:func:`write_plot` draws a report.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerofn as zf

__all__ = [
    "ByteLog",
    "DDPRun",
    "DemoConfig",
    "FacadeRun",
    "FunctionalRun",
    "add_arguments",
    "config_from_args",
    "format_report",
    "run",
    "train",
    "write_plot",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
APIS = ("functional", "facade")
COMM_CHOICES = ("auto", "byte-optimal")
# How far zerofn's params may be from DDP's, as "max rel diff" (per tensor max|a - b| /
# max|b|, the worst tensor on the worst rank). At 1 and 2 ranks without clipping the two
# runs are bitwise equal in every dtype (the same local gradients; a sum of two addends
# has one order). At 3+ ranks gloo adds each element's addends in an order that depends on
# where it sits in the bucket, and DDP's buckets differ from zerofn's rank-major ones: some
# gradient elements differ by one rounding of the working dtype, AdamW turns that into
# slightly different updates (a near-zero gradient sum can even change sign), and the
# params drift apart slowly. Measured at 4 ranks, 100 to 500 steps: fp32 4e-7 to 8e-7,
# bf16 8e-3 to 1.4e-2, fp16 6e-3 to 1.2e-2; after 1000 steps fp32 3e-6, bf16 6e-2, fp16
# 8e-3. The bounds hold for runs of up to a few hundred steps.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 3e-2}
WEIGHT_DECAY = 0.01
# fp16's dynamic loss scaling, on both sides: start at torch's and the seed's 2^16, halve
# on an overflow (skipping that step), double after GROWTH_INTERVAL good steps in a row
# (torch and the seed wait 2000; shorter here so that a short run shows the dynamics).
INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 50
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
      precision: the working dtype, ``"fp32"``, ``"bf16"`` or ``"fp16"`` (fp32 master
        weights and AdamW state in all three; dynamic loss scaling for fp16).
      api: ``"functional"`` (the four stage functions) or ``"facade"``
        (:class:`zerofn.ZeroOptimizer`).
      overlap: launch each bucket's reduction during backward (facade only).
      accumulate: micro-batches per step, their gradients summed locally (no
        communication) before one reduction.
      seed: seeds the model init and the synthetic data (identical on every rank).
      comm: ``"auto"`` (:class:`zerofn.CommPolicy`'s per-backend choice: all-reduce and
        broadcast on gloo) or ``"byte-optimal"`` (reduce-scatter and all-gather).
      batch_per_rank: samples each rank sees per micro-batch.
      lr: AdamW learning rate (the same for zerofn and torch.optim).
      max_norm: global gradient-norm clip for both runs, or ``None`` for none. zerofn
        computes the norm in float64 (as the seed), ``clip_grad_norm_`` in float32, so
        with clipping the two runs drift apart by an ulp now and then (about 1e-7
        relative after hundreds of steps in fp32); without it they are bitwise equal at
        1 and 2 ranks.
      progress: draw the progress bar on rank 0 (stderr).
    """

    world_size: int = 2
    stage: int = 2
    steps: int = 100
    precision: str = "fp32"
    api: str = "functional"
    overlap: bool = False
    accumulate: int = 1
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
        if self.precision not in DTYPES:
            out.append(f"--precision must be one of {', '.join(DTYPES)}, got {self.precision!r}")
        if self.api not in APIS:
            out.append(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.overlap and self.api == "functional":
            out.append(
                "--overlap needs --api facade: the functional loop has no gradient hooks to launch "
                "communication from (torch.func.grad returns all gradients at once); "
                "drop --api functional, or drop --overlap"
            )
        if self.accumulate < 1:
            out.append(f"--accumulate must be at least 1 (micro-batches per step), got {self.accumulate}")
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


def make_model(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The MLP both runs train; the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, CLASSES),
    )
    return model.to(dtype)  # initialised in fp32, then rounded: the same bits for both runs


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


Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------- the three runs
#
# Each run's `step(micro_batches)` is one optimizer step of its API, written as you would
# write it in your own loop; it returns (the step's loss, whether the step was skipped).


class ByteLog:
    """What a run sent, by collective, summed over ``zf.count_bytes()`` blocks.

    The blocks run one after another, not nested: with torch 2.13 and this zerofn, an
    inner ``count_bytes`` block that ends while its counter still equals the outer one's
    (both at 0 bytes, e.g. around a ``no_sync`` backward) removes the outer counter from
    the active stack (``CommCounter`` is a dataclass compared by value).
    """

    def __init__(self) -> None:
        self.by_collective: dict[str, int] = {}
        self.total = 0
        self.accumulation = 0  # sent while micro-batch gradients were being summed: 0

    @contextlib.contextmanager
    def count(self, *, accumulating: bool = False) -> Iterator[None]:
        with zf.count_bytes() as counter:
            yield
        for kind, nbytes in counter.by_collective.items():
            self.by_collective[kind] = self.by_collective.get(kind, 0) + nbytes
        self.total += counter.bytes_sent
        if accumulating:
            self.accumulation += counter.bytes_sent


def precision_policy(cfg: DemoConfig) -> zf.PrecisionPolicy:
    """zerofn's precision policy for ``cfg``: working dtype, fp32 masters, fp16 loss scaling."""
    dtype = DTYPES[cfg.precision]
    # grad_accum_dtype=None: micro-batch gradients are summed in the working dtype, as
    # DDP sums them in p.grad, so that the two runs stay comparable. The default ("auto")
    # sums fp16/bf16 gradients in fp32: more accurate, what to use outside this comparison.
    changes: dict[str, Any] = {"grad_accum_dtype": None}
    if dtype == torch.float16:
        # hysteresis=1: back off at every overflow, as torch.amp.GradScaler does (the
        # seed's default, 2, lets one overflow pass before backing off).
        changes["loss_scaler"] = zf.DynamicLossScaler(
            initial_scale=INITIAL_SCALE, growth_interval=GROWTH_INTERVAL, hysteresis=1
        )
    return zf.PrecisionPolicy.for_dtype(dtype, **changes)


class FunctionalRun:
    """zerofn's functional API: the params are a plain dict, the model only a function of them."""

    def __init__(self, cfg: DemoConfig, group: dist.ProcessGroup | None, comm: zf.CommPolicy) -> None:
        self.model = make_model(cfg.seed, DTYPES[cfg.precision])
        # Our own copies, detached: torch.func differentiates with respect to the dict.
        self.params = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        opt = zf.optim.adamw(lr=cfg.lr, weight_decay=WEIGHT_DECAY)
        # This rank's 1/N of the fp32 master weights and AdamW moments; no communication.
        self.state = zf.shard_params(self.params, opt, group, policy=precision_policy(cfg))
        self.group, self.stage, self.comm, self.max_norm = group, cfg.stage, comm, cfg.max_norm
        self.sent = ByteLog()

        def loss_fn(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor, scale: zf.LossScaleState, k: int):
            loss = F.cross_entropy(torch.func.functional_call(self.model, p, (xb,)), yb) / k
            # fp16: differentiate loss * scale, so that small gradients survive in fp16;
            # step_shards divides the scale back out (scale 1.0 otherwise: a no-op).
            return zf.scale_loss(loss, scale), loss.detach()  # (what to differentiate, aux)

        self.grad_fn = torch.func.grad(loss_fn, has_aux=True)  # -> (grads dict like p, loss)

    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, bool]:
        k, grads, loss = len(micro_batches), None, 0.0
        with self.sent.count(accumulating=True):  # summing micro-batches is local: nothing is sent
            for xb, yb in micro_batches:
                g, micro_loss = self.grad_fn(self.params, xb, yb, self.state.loss_scale, k)
                grads = g if grads is None else {n: grads[n] + g[n] for n in grads}
                loss += float(micro_loss)
        with self.sent.count():
            gshards = zf.reduce_grads(
                grads, self.state.layout, self.group, stage=self.stage, policy=self.comm, precision=self.state.policy
            )  # the mean gradient over ranks, this rank's shards only
            self.state, info = zf.step_shards(self.state, gshards, self.group, max_norm=self.max_norm)
            if not info.skipped:  # a skipped step (fp16 overflow) changed no shard: nothing to gather
                self.params = zf.gather_params(self.state, self.group, policy=self.comm)  # full, equal on all ranks
        return loss, info.skipped

    def named_params(self) -> dict[str, torch.Tensor]:
        """The full params now (equal on every rank)."""
        return self.params

    def zero_state(self) -> zf.ZeroState:
        """This rank's ZeroState."""
        return self.state


class FacadeRun:
    """zerofn's facade: ``ZeroOptimizer`` wrapping ``torch.optim.AdamW`` in an ordinary loop."""

    def __init__(self, cfg: DemoConfig, group: dist.ProcessGroup | None, comm: zf.CommPolicy) -> None:
        self.model = make_model(cfg.seed, DTYPES[cfg.precision])
        self.opt = zf.ZeroOptimizer(
            torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=WEIGHT_DECAY),
            partition_grad=cfg.stage == 2,  # stage 2: gradients reduced to shards from hooks
            overlap_communication=cfg.overlap,  # launch each bucket while backward still runs
            clip_grad_norm=cfg.max_norm or 0.0,
            dp_process_group=group,
            comm_policy=comm,
            module=self.model,  # names the params in messages and checkpoints
            precision=precision_policy(cfg),
        )
        self.sent = ByteLog()

    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, bool]:
        k, loss = len(micro_batches), 0.0
        for i, (xb, yb) in enumerate(micro_batches):
            last = i == k - 1
            with contextlib.nullcontext() if last else self.opt.no_sync(), self.sent.count(accumulating=not last):
                micro_loss = F.cross_entropy(self.model(xb), yb) / k
                self.opt.backward(micro_loss)  # loss * scale; outside no_sync: reduce to shards
            loss += float(micro_loss.detach())
        with self.sent.count():
            self.opt.step()  # unscale, clip, update this rank's shards, gather into the model
        self.opt.zero_grad()
        return loss, bool(self.opt.last_step_info and self.opt.last_step_info.skipped)

    def named_params(self) -> dict[str, torch.Tensor]:
        """The model's params now (equal on every rank)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def zero_state(self) -> zf.ZeroState:
        """This rank's ZeroState, held by the optimizer."""
        return self.opt.state


class DDPRun:
    """The reference: DDP + ``torch.optim.AdamW``, optimizer state replicated on every rank.

    Under bf16/fp16 the model runs in the working dtype and ``torch.optim.AdamW`` updates
    an fp32 copy of every param (the masters); fp16 scales the loss with
    ``torch.amp.GradScaler``.
    """

    def __init__(self, cfg: DemoConfig, group: dist.ProcessGroup | None) -> None:
        dtype = DTYPES[cfg.precision]
        self.model = make_model(cfg.seed, dtype)
        self.ddp = nn.parallel.DistributedDataParallel(self.model, process_group=group)
        self.mixed = dtype != torch.float32
        params = list(self.model.parameters())
        # fp32: the params are their own masters. bf16/fp16: fp32 copies, what AdamW updates.
        self.masters = [p.detach().float() for p in params] if self.mixed else params
        self.opt = torch.optim.AdamW(self.masters, lr=cfg.lr, weight_decay=WEIGHT_DECAY)
        self.scaler = torch.amp.GradScaler(
            "cpu", init_scale=INITIAL_SCALE, growth_interval=GROWTH_INTERVAL, enabled=dtype == torch.float16
        )
        self.max_norm = cfg.max_norm

    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, bool]:
        k, loss = len(micro_batches), 0.0
        for i, (xb, yb) in enumerate(micro_batches):
            # no_sync: p.grad sums the micro-batches locally; the last backward all-reduces.
            with contextlib.nullcontext() if i == k - 1 else self.ddp.no_sync():
                micro_loss = F.cross_entropy(self.ddp(xb), yb) / k
                self.scaler.scale(micro_loss).backward()  # fp16: loss * scale (else: loss)
            loss += float(micro_loss.detach())
        if self.mixed:  # hand the working-dtype gradients to the fp32 masters
            for m, p in zip(self.masters, self.model.parameters(), strict=True):
                m.grad, p.grad = p.grad.float(), None
        scale = self.scaler.get_scale()
        if self.max_norm is not None:
            self.scaler.unscale_(self.opt)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.masters, self.max_norm)
        self.scaler.step(self.opt)  # skipped when a gradient is inf/nan (fp16 overflow)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                for m, p in zip(self.masters, self.model.parameters(), strict=True):
                    p.copy_(m)  # round the updated masters to the working dtype
        return loss, self.scaler.get_scale() < scale  # GradScaler backs off exactly on a skip

    def named_params(self) -> dict[str, torch.Tensor]:
        """The model's params now (equal on every rank)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def state_bytes(self) -> tuple[int, int]:
        """(fp32 master bytes, total optimizer-state bytes incl. the masters) this rank holds."""
        master = sum(m.numel() * m.element_size() for m in self.masters)
        moments = sum(
            t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)
        )
        return master, master + moments


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
    """Train with zerofn and with DDP on this rank; return the report.

    Call on every rank of an initialised gloo process group (``group``; ``None``: the
    default group). Straight-line on purpose, as nanoGPT's ``train.py``.

    Returns:
      A dict with the config (``world_size``, ``stage``, ``steps``, ``precision``,
      ``api``, ``overlap``, ``accumulate``, ``seed``, ``comm``, ``max_norm``);
      ``num_params`` (Ψ); ``losses`` / ``ddp_losses`` (every step's loss, the mean over
      ranks) and their first and last values ``loss_start`` / ``loss_end`` /
      ``ddp_loss_start`` / ``ddp_loss_end``; ``max_abs_diff`` and ``max_rel_diff``, the
      final params against DDP's (relative: per tensor ``max|a - b| / max|b|``, the
      largest over tensors and ranks), ``tolerance`` (the bound on ``max_rel_diff`` for
      the working dtype) and ``parity_ok``; ``skipped`` / ``ddp_skipped`` (steps skipped
      for fp16 overflow) and ``loss_scale_start`` / ``loss_scale_end``;
      ``state_bytes_per_rank`` (``ZeroState.nbytes``: master + AdamW shards, the largest
      over ranks) and ``master_bytes_per_rank``; ``ddp_state_bytes`` and
      ``ddp_master_bytes`` (fp32 masters + torch AdamW state of one DDP rank);
      ``bytes_sent_per_step`` (mean over steps of ``zf.count_bytes`` around zerofn's
      step, the largest over ranks), ``accumulation_bytes`` (sent during the first K-1
      micro-batches of all steps: 0) and ``bytes_by_collective`` (per step);
      ``theory_bytes_per_step`` (2(N-1)/N·Ψ·b, b the working dtype's size); ``reduce`` /
      ``gather`` (the collectives used); ``ms_per_step`` and ``ddp_ms_per_step`` (median
      over steps). Every rank returns the same values, except the times and
      ``bytes_by_collective``, which are this rank's own.
    """
    problems = cfg.problems()
    if problems:
        raise ValueError("; ".join(problems))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    master_process = rank == 0  # only rank 0 draws the bar, as nanoGPT's master_process
    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only fight
    x, y = make_data(cfg.seed, max(DATA_SIZE, cfg.batch_per_rank * world))

    dtype = DTYPES[cfg.precision]
    policy = zf.CommPolicy.byte_optimal() if cfg.comm == "byte-optimal" else zf.CommPolicy()
    reduce_how, gather_how = policy.resolve(group)
    if cfg.stage == 1:
        reduce_how = "all_reduce"  # ZeRO-1 all-reduces the full grads, then keeps its shards
    zero = FunctionalRun(cfg, group, policy) if cfg.api == "functional" else FacadeRun(cfg, group, policy)
    ddp = DDPRun(cfg, group)
    scale_start = zero.zero_state().loss_scale.scale

    losses, ddp_losses, ms, ddp_ms, sent = [], [], [], [], []
    skipped = ddp_skipped = 0
    bar = ProgressBar(cfg.steps, enabled=cfg.progress and master_process)
    data = batches(x, y, rank, world, cfg.batch_per_rank)
    for step in range(1, cfg.steps + 1):
        # Inputs in the working dtype, as the models' weights.
        micro_batches = [(xb.to(dtype), yb) for xb, yb in (next(data) for _ in range(cfg.accumulate))]

        # Start each timing with the ranks in step, so that neither run pays for the skew
        # the other left behind (collectives wait for the slowest rank).
        dist.barrier(group)
        t0 = time.perf_counter()
        before = zero.sent.total
        loss, was_skipped = zero.step(micro_batches)
        ms.append(1e3 * (time.perf_counter() - t0))
        sent.append(zero.sent.total - before)
        losses.append(loss)
        skipped += was_skipped

        dist.barrier(group)
        t0 = time.perf_counter()
        ddp_loss, ddp_was_skipped = ddp.step(micro_batches)
        ddp_ms.append(1e3 * (time.perf_counter() - t0))
        ddp_losses.append(ddp_loss)
        ddp_skipped += ddp_was_skipped

        note = f"rank-0 loss {losses[-1]:.4f}"
        if cfg.precision == "fp16":
            note += f", loss scale {zero.zero_state().loss_scale.scale:g}"
        bar.update(step, note)

    # --- compare params, memory and bytes, reduced over ranks so every rank reports the same.
    state = zero.zero_state()
    mine = zero.named_params()
    max_abs, max_rel = 0.0, 0.0
    for name, p_ref in ddp.named_params().items():
        a, b = mine[name].double(), p_ref.double()
        diff = float((a - b).abs().max())
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(float(b.abs().max()), 1e-30))
    master_bytes = sum(t.numel() * t.element_size() for t in state.master.values())
    ddp_master_bytes, ddp_state_bytes = ddp.state_bytes()
    num_params = sum(p.numel() for p in mine.values())
    elem = next(iter(mine.values())).element_size()
    worst = torch.tensor(
        [max_abs, max_rel, state.nbytes, master_bytes, sum(sent) / len(sent)],
        dtype=torch.float64,
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    curves = torch.tensor([losses, ddp_losses], dtype=torch.float64)
    dist.all_reduce(curves, group=group)
    curves /= world  # the mean of per-rank batch losses is the global batch's loss
    accumulation = torch.tensor([zero.sent.accumulation], dtype=torch.float64)
    dist.all_reduce(accumulation, group=group)
    mean_losses, mean_ddp_losses = curves[0].tolist(), curves[1].tolist()
    tolerance = TOLERANCE[cfg.precision]
    return {
        "world_size": world,
        "stage": cfg.stage,
        "steps": cfg.steps,
        "precision": cfg.precision,
        "api": cfg.api,
        "overlap": cfg.overlap,
        "accumulate": cfg.accumulate,
        "seed": cfg.seed,
        "comm": cfg.comm,
        "max_norm": cfg.max_norm,
        "reduce": reduce_how if world > 1 else "none",
        "gather": gather_how if world > 1 else "none",
        "num_params": num_params,
        "losses": mean_losses,
        "ddp_losses": mean_ddp_losses,
        "loss_start": mean_losses[0],
        "loss_end": mean_losses[-1],
        "ddp_loss_start": mean_ddp_losses[0],
        "ddp_loss_end": mean_ddp_losses[-1],
        "max_abs_diff": float(worst[0]),
        "max_rel_diff": float(worst[1]),
        "tolerance": tolerance,
        "parity_ok": float(worst[1]) <= tolerance,
        "skipped": skipped,
        "ddp_skipped": ddp_skipped,
        "loss_scale_start": scale_start,
        "loss_scale_end": state.loss_scale.scale,
        "state_bytes_per_rank": int(worst[2]),
        "master_bytes_per_rank": int(worst[3]),
        "ddp_state_bytes": ddp_state_bytes,
        "ddp_master_bytes": ddp_master_bytes,
        "bytes_sent_per_step": float(worst[4]),
        "accumulation_bytes": int(accumulation),
        "bytes_by_collective": {k: v / cfg.steps for k, v in sorted(zero.sent.by_collective.items())},
        "theory_bytes_per_step": 2 * (world - 1) / world * num_params * elem,
        # Medians: the first steps pay one-off costs (DDP rebuilds its buckets at step 2).
        "ms_per_step": statistics.median(ms),
        "ddp_ms_per_step": statistics.median(ddp_ms),
    }


def _what_ran(r: dict[str, Any]) -> str:
    """The run in words: stage, API, ranks, dtype, steps."""
    api = "functional API" if r["api"] == "functional" else "ZeroOptimizer facade"
    if r["overlap"]:
        api += " with overlap"
    steps = f"{r['steps']} steps"
    if r["accumulate"] > 1:
        steps += f" x {r['accumulate']} micro-batches"
    return f"ZeRO stage {r['stage']}, {api}, {r['world_size']} gloo rank(s), {r['precision']}, {steps}"


def format_report(r: dict[str, Any]) -> str:
    """The report :func:`train` returns, as the lines the command line prints."""
    n = r["world_size"]
    theory, measured = r["theory_bytes_per_step"], r["bytes_sent_per_step"]
    bytes_ratio = f": {measured / theory:.2f}x" if theory else ""
    kinds = " + ".join(r["bytes_by_collective"]) or "none"
    clip = f", clip {r['max_norm']:g}" if r["max_norm"] is not None else ""
    if r["max_abs_diff"] == 0:
        verdict = "bitwise equal"
    else:
        verdict = "within" if r["parity_ok"] else "NOT within"
        verdict += f" the {r['precision']} tolerance (max rel diff <= {r['tolerance']:g})"
    state, ddp_state = r["state_bytes_per_rank"], r["ddp_state_bytes"]
    lines = [
        f"zerofn demo: {_what_ran(r)}, AdamW{clip}, MLP {IN_DIM}-{HIDDEN}-{HIDDEN}-{CLASSES} "
        f"(Ψ = {r['num_params']:,} params)",
        f"  loss             {r['loss_start']:.4f} -> {r['loss_end']:.4f}   "
        f"(DDP {r['ddp_loss_start']:.4f} -> {r['ddp_loss_end']:.4f})",
        f"  params vs DDP    max abs diff {r['max_abs_diff']:.3g}, max rel diff {r['max_rel_diff']:.3g}: {verdict}",
    ]
    if r["precision"] == "fp16":
        lines.append(
            f"  loss scale       {r['loss_scale_start']:g} -> {r['loss_scale_end']:g}, "
            f"{r['skipped']} of {r['steps']} steps skipped for overflow "
            f"(DDP + torch.amp.GradScaler: {r['ddp_skipped']})"
        )
    lines += [
        f"  optimizer state  {state:,} B per rank (fp32 master + AdamW shards) vs DDP {ddp_state:,} B "
        f"(replicated): {state / ddp_state:.2f}x",
        f"  bytes sent       {measured:,.0f} B per rank per step ({kinds})",
        f"                   vs 2(N-1)/N·Ψ·b = {theory:,.0f} B byte-optimal (b = {r['precision']}){bytes_ratio}",
    ]
    if r["accumulate"] > 1:
        lines.append(
            f"  accumulation     {r['accumulate']} micro-batches per step, one reduction: "
            f"{r['accumulation_bytes']:,} B sent before the last micro-batch"
        )
    lines.append(f"  time per step    zerofn {r['ms_per_step']:.2f} ms, DDP {r['ddp_ms_per_step']:.2f} ms (median)")
    if n > 1 and r["reduce"] != "reduce_scatter" and r["comm"] == "auto":
        lines.append(
            f"  (on gloo zerofn reduces with {r['reduce']} and gathers with {r['gather']}: more\n"
            "   bytes, less time; --comm byte-optimal uses reduce_scatter + all_gather)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the plot


def write_plot(r: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw a report into a PNG: both loss curves, and optimizer-state bytes per rank as bars.

    Needs matplotlib (imported here, so the demo runs without it when there is no plot).
    """
    import matplotlib

    matplotlib.use("Agg")  # draw into files only: no window, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1.8, 1]})
    steps = range(1, len(r["losses"]) + 1)
    ax_loss.plot(steps, r["ddp_losses"], color="C0", lw=5, alpha=0.35, label="DDP + torch.optim.AdamW")
    ax_loss.plot(steps, r["losses"], color="C1", lw=1.3, ls="--", label=f"zerofn ZeRO-{r['stage']}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (global batch)")
    parity = "bitwise equal" if r["max_abs_diff"] == 0 else f"max rel diff {r['max_rel_diff']:.2g}"
    ax_loss.set_title(f"loss; final params vs DDP: {parity}", fontsize=10)
    ax_loss.legend(frameon=False)

    labels = ["DDP\n(replicated)", f"zerofn ZeRO-{r['stage']}\n(1/{r['world_size']} per rank)"]
    kib = 1024.0
    master = [r["ddp_master_bytes"] / kib, r["master_bytes_per_rank"] / kib]
    total = [r["ddp_state_bytes"] / kib, r["state_bytes_per_rank"] / kib]
    rest = [t - m for t, m in zip(total, master, strict=True)]
    ax_mem.bar(labels, master, color="C2", label="fp32 master weights")
    ax_mem.bar(labels, rest, bottom=master, color="C4", label="AdamW state")
    for i, t in enumerate(total):
        ax_mem.annotate(f"{t:,.0f} KiB", (i, t), ha="center", va="bottom", fontsize=9)
    ax_mem.set_ylim(0, max(total) * 1.2)
    ax_mem.set_ylabel("KiB per rank")
    ax_mem.set_title("optimizer state per rank", fontsize=10)
    ax_mem.legend(frameon=False, fontsize=8, loc="upper right")

    fig.suptitle(f"zerofn demo: {_what_ran(r)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
        choices=tuple(DTYPES),
        default=d.precision,
        help="working dtype of both runs; fp32 master weights and AdamW state in all three, "
        "dynamic loss scaling for fp16 (default %(default)s)",
    )
    parser.add_argument(
        "--api",
        choices=APIS,
        default=None,
        help="zerofn's API: functional (the four stage functions, default) or facade "
        "(ZeroOptimizer); --overlap picks the facade",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="reduce each gradient bucket while backward still runs (ZeroOptimizer's overlap_communication)",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        default=d.accumulate,
        metavar="K",
        help="micro-batches per step, summed locally before one reduction (default %(default)s)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a PNG of the loss curves and the optimizer-state bytes per rank (needs matplotlib)",
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


def plot_problems(path: str) -> list[str]:
    """What stops ``--plot path`` from working, checked before any rank starts."""
    if not path.lower().endswith(".png"):
        return [f"--plot writes a PNG: give a path ending in .png, got {path!r}"]
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return [f"--plot {path}: the folder {folder} does not exist"]
    existed = os.path.exists(path)
    try:  # open it now, so that a path that cannot be written fails before training, not after
        with open(path, "ab"):
            pass
    except OSError as e:
        return [f"--plot {path}: cannot write there ({e.strerror or e})"]
    if not existed:
        with contextlib.suppress(FileNotFoundError):  # under torchrun every rank checks
            os.remove(path)
    try:
        import matplotlib  # noqa: F401  (only to learn now, not after training, that it is missing)
    except ImportError:
        return [
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(it comes with zerofn's test extra), or leave out --plot"
        ]
    return []


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
        # Overlap lives in the facade's gradient hooks, so --overlap alone picks the facade.
        api=args.api if args.api is not None else ("facade" if args.overlap else "functional"),
        overlap=args.overlap,
        accumulate=args.accumulate,
        seed=args.seed,
        comm=args.comm,
        max_norm=args.max_norm,
        progress=not args.no_progress,
    )
    problems += cfg.problems()
    if args.plot is not None:
        problems += plot_problems(args.plot)
    if problems:
        parser.error("; ".join(problems))
    return cfg


def main(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    """Run the demo from parsed options and print rank 0's report; return the exit code.

    1 when zerofn's params end further from DDP's than the working dtype's tolerance.
    """
    cfg = config_from_args(args, parser)
    report = run(cfg)
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return 0 if report["parity_ok"] else 1  # rank-0-only printing and plotting
    stream = out or sys.stdout
    stream.write(format_report(report) + "\n")
    stream.flush()
    if args.plot is not None:
        try:
            write_plot(report, args.plot)
        except OSError as e:  # checked before training, but the disk may have filled up since
            print(f"zerofn demo: could not write {args.plot}: {e}", file=sys.stderr)
            return 1
        print(f"zerofn demo: wrote {args.plot}", file=sys.stderr)
    if not report["parity_ok"]:
        print(
            f"zerofn demo: zerofn's params are further from DDP's than the {cfg.precision} tolerance allows",
            file=sys.stderr,
        )
        return 1
    return 0
