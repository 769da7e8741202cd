"""The per-rank script: train with zerofn and with DDP side by side, and report.

Straight-line on purpose, as nanoGPT's ``train.py``: :func:`train` builds both runs,
steps them in turn on the same micro-batches (:func:`_train_both`), and reduces what
they did over the ranks into the report (:func:`_summarise`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.demo.config import DTYPES, TOLERANCE, DemoConfig
from zerofn.demo.report import ProgressBar
from zerofn.demo.runs import DATA_SIZE, Batch, DDPRun, FacadeRun, FunctionalRun, ZeroRun, batches, make_data

__all__ = ["train"]


def train(cfg: DemoConfig, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Train with zerofn and with DDP on this rank; return the report.

    Call on every rank of an initialised gloo process group (``group``; ``None``: the
    default group).

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

    Raises:
      ValueError: ``cfg`` is invalid (checked before any collective).
    """
    cfg.check()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only fight
    x, y = make_data(cfg.seed, max(DATA_SIZE, cfg.batch_per_rank * world))

    policy = zf.CommPolicy.byte_optimal() if cfg.comm == "byte-optimal" else zf.CommPolicy()
    reduce_how, gather_how = policy.resolve(group)
    if cfg.stage == 1:
        reduce_how = "all_reduce"  # ZeRO-1 all-reduces the full grads, then keeps its shards
    zero: ZeroRun = FunctionalRun(cfg, group, policy) if cfg.api == "functional" else FacadeRun(cfg, group, policy)
    ddp = DDPRun(cfg, group)
    scale_start = float(zero.zero_state().loss_scale.scale)

    data = batches(x, y, rank, world, cfg.batch_per_rank)
    # Only rank 0 draws the bar, as nanoGPT's master_process.
    trace = _train_both(cfg, zero, ddp, data, group, show_progress=cfg.progress and rank == 0)
    return _summarise(cfg, zero, ddp, trace, group, collectives=(reduce_how, gather_how), scale_start=scale_start)


@dataclasses.dataclass
class _Trace:
    """What both runs did on this rank, step by step."""

    losses: list[float] = dataclasses.field(default_factory=list)  # zerofn, this rank's batches
    ddp_losses: list[float] = dataclasses.field(default_factory=list)
    ms: list[float] = dataclasses.field(default_factory=list)  # wall time of each zerofn step
    ddp_ms: list[float] = dataclasses.field(default_factory=list)
    sent: list[int] = dataclasses.field(default_factory=list)  # bytes zerofn sent in each step
    skipped: int = 0  # steps skipped for fp16 overflow
    ddp_skipped: int = 0


def _train_both(
    cfg: DemoConfig,
    zero: ZeroRun,
    ddp: DDPRun,
    data: Iterator[Batch],
    group: dist.ProcessGroup | None,
    *,
    show_progress: bool,
) -> _Trace:
    """``cfg.steps`` optimizer steps of ``zero`` and then ``ddp`` on the same micro-batches."""
    dtype = DTYPES[cfg.precision]
    trace = _Trace()
    bar = ProgressBar(cfg.steps, enabled=show_progress)
    for step in range(1, cfg.steps + 1):
        # Inputs in the working dtype, as the models' weights.
        micro_batches = [(xb.to(dtype), yb) for xb, yb in (next(data) for _ in range(cfg.accumulate))]

        # Start each timing with the ranks in step, so that neither run pays for the skew
        # the other left behind (collectives wait for the slowest rank).
        dist.barrier(group)
        t0 = time.perf_counter()
        before = zero.sent.total
        loss, was_skipped = zero.step(micro_batches)
        trace.ms.append(1e3 * (time.perf_counter() - t0))
        trace.sent.append(zero.sent.total - before)
        trace.losses.append(loss)
        trace.skipped += was_skipped

        dist.barrier(group)
        t0 = time.perf_counter()
        ddp_loss, ddp_was_skipped = ddp.step(micro_batches)
        trace.ddp_ms.append(1e3 * (time.perf_counter() - t0))
        trace.ddp_losses.append(ddp_loss)
        trace.ddp_skipped += ddp_was_skipped

        note = f"rank-0 loss {loss:.4f}"
        if cfg.precision == "fp16":
            note += f", loss scale {float(zero.zero_state().loss_scale.scale):g}"
        bar.update(step, note)
    return trace


def _param_diff(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max abs diff, max rel diff) of ``mine`` against ``ref``; relative per tensor: max|a - b| / max|b|."""
    max_abs, max_rel = 0.0, 0.0
    for name, p_ref in ref.items():
        a, b = mine[name].double(), p_ref.double()
        diff = float((a - b).abs().max())
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(float(b.abs().max()), 1e-30))
    return max_abs, max_rel


def _summarise(
    cfg: DemoConfig,
    zero: ZeroRun,
    ddp: DDPRun,
    trace: _Trace,
    group: dist.ProcessGroup | None,
    *,
    collectives: tuple[str, str],
    scale_start: float,
) -> dict[str, Any]:
    """The report :func:`train` returns: params, memory, bytes and losses, the same on every rank.

    Issues three all-reduces on ``group`` (the worst diffs and bytes over ranks, the loss
    curves, the accumulation bytes). ``collectives`` is (reduce, gather) as zerofn ran
    them; ``scale_start`` the loss scale before the first step.
    """
    world = dist.get_world_size(group)
    state = zero.zero_state()
    mine = zero.named_params()
    max_abs, max_rel = _param_diff(mine, ddp.named_params())
    master_bytes = sum(t.numel() * t.element_size() for t in state.master.values())
    ddp_master_bytes, ddp_state_bytes = ddp.state_bytes()
    num_params = sum(p.numel() for p in mine.values())
    elem = next(iter(mine.values())).element_size()
    worst = torch.tensor(
        [max_abs, max_rel, state.nbytes, master_bytes, sum(trace.sent) / len(trace.sent)],
        dtype=torch.float64,
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    curves = torch.tensor([trace.losses, trace.ddp_losses], dtype=torch.float64)
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
        "wire": cfg.wire,
        "reduce": collectives[0] if world > 1 else "none",
        "gather": collectives[1] if world > 1 else "none",
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
        "skipped": trace.skipped,
        "ddp_skipped": trace.ddp_skipped,
        "loss_scale_start": scale_start,
        "loss_scale_end": float(state.loss_scale.scale),
        "state_bytes_per_rank": int(worst[2]),
        "master_bytes_per_rank": int(worst[3]),
        "ddp_state_bytes": ddp_state_bytes,
        "ddp_master_bytes": ddp_master_bytes,
        "bytes_sent_per_step": float(worst[4]),
        "accumulation_bytes": int(accumulation),
        "bytes_by_collective": {k: v / cfg.steps for k, v in sorted(zero.sent.by_collective.items())},
        "theory_bytes_per_step": 2 * (world - 1) / world * num_params * elem,
        # Medians: the first steps pay one-off costs (DDP rebuilds its buckets at step 2).
        "ms_per_step": statistics.median(trace.ms),
        "ddp_ms_per_step": statistics.median(trace.ddp_ms),
    }
