"""The model, the data, and the three runs the demo compares.

Each run's ``step(micro_batches)`` is one optimizer step of its API, written as you would
write it in your own loop; it returns (the step's loss, whether the step was skipped):

* :class:`FunctionalRun`: zerofn's stage functions, the state threaded by hand (one
  micro-batch: ``value_and_reduced_grads``, the gradient and its reduction in one call);
* :class:`FacadeRun`: ``zf.ZeroOptimizer`` wrapping ``torch.optim.AdamW``;
* :class:`DDPRun`: the reference, DDP + ``torch.optim.AdamW``.

Only zerofn's public API (``import zerofn as zf``) and ``torch.distributed`` are used: this
is the code a user would write.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerofn as zf
from zerofn.demo.config import DTYPES, DemoConfig
from zerofn.testing import float64_wire_hook

__all__ = [
    "CLASSES",
    "DATA_SIZE",
    "GROWTH_INTERVAL",
    "HIDDEN",
    "INITIAL_SCALE",
    "IN_DIM",
    "WEIGHT_DECAY",
    "Batch",
    "ByteLog",
    "DDPRun",
    "FacadeRun",
    "FunctionalRun",
    "ZeroRun",
    "batches",
    "make_data",
    "make_model",
    "precision_policy",
]

WEIGHT_DECAY = 0.01
# fp16's dynamic loss scaling, on both sides: start at 2^16 (torch's and zerofn's default), halve
# on an overflow (skipping that step), double after GROWTH_INTERVAL good steps in a row
# (torch and ZeroOptimizer wait 2000; shorter here so that a short run shows the dynamics).
INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 50

# ---------------------------------------------------------------------------- model, data

IN_DIM = 32
HIDDEN = 128
CLASSES = 10
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


class ByteLog:
    """What a run sent, by collective, summed over ``zf.count_bytes()`` blocks.

    One block per part of a step (a micro-batch's backward, the step), so that what the
    accumulation micro-steps sent (nothing, under ``no_sync``) is counted apart.
    """

    def __init__(self) -> None:
        self.by_collective: dict[str, int] = {}
        self.total = 0
        self.accumulation = 0  # sent while micro-batch gradients were being summed: 0

    @contextlib.contextmanager
    def count(self, *, accumulating: bool = False) -> Iterator[None]:
        """Add what the block sends; to ``accumulation`` too when ``accumulating``."""
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
    if cfg.wire == "fp64":  # DDPRun reduces through float64_wire_hook to match
        changes["comm_dtype"] = torch.float64
    if dtype == torch.float16:
        # hysteresis=1: back off at every overflow, as torch.amp.GradScaler does (zerofn's
        # default, 2, lets one overflow pass before backing off).
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
        self.state = zf.shard_params(self.params, opt, group, precision=precision_policy(cfg))
        self.group, self.stage, self.comm, self.max_norm = group, cfg.stage, comm, cfg.max_norm
        self.sent = ByteLog()

        def loss_fn(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor, scale: zf.LossScaleState, k: int):
            loss = F.cross_entropy(torch.func.functional_call(self.model, p, (xb,)), yb) / k
            # fp16: differentiate loss * scale, so that small gradients survive in fp16;
            # step_shards divides the scale back out (scale 1.0 otherwise: a no-op).
            return zf.scale_loss(loss, scale), loss.detach()  # (what to differentiate, aux)

        self.grad_fn = torch.func.grad(loss_fn, has_aux=True)  # -> (grads dict like p, loss)
        # One micro-batch: the loss and this rank's reduced shards in one call, each bucket
        # sent while the backward still runs (the same shards as reduce_grads of grad_fn's).
        self.value_and_grads = zf.value_and_reduced_grads(
            loss_fn, self.state.layout, group, cfg.stage, has_aux=True, comm_policy=comm, precision=self.state.precision
        )  # -> ((scaled loss, loss), shards)

    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, bool]:
        """One step of the four stage functions; several micro-batches' gradients summed locally first."""
        loss, gshards = self._reduced(micro_batches)  # the mean gradient over ranks, this rank's shards only
        with self.sent.count():
            self.state, info = zf.step_shards(self.state, gshards, self.group, max_norm=self.max_norm)
            if not info.skipped:  # a skipped step (fp16 overflow) changed no shard: nothing to gather
                self.params = zf.gather_params(
                    self.state, self.group, comm_policy=self.comm
                )  # full, equal on all ranks
        return loss, info.skipped

    def _reduced(self, micro_batches: Sequence[Batch]) -> tuple[float, Any]:
        """(the step's loss, this rank's mean-gradient shards) over ``micro_batches``."""
        k, scale = len(micro_batches), self.state.loss_scale
        if k == 1:
            with self.sent.count():
                (_, loss), gshards = self.value_and_grads(self.params, *micro_batches[0], scale, 1)
            return float(loss), gshards
        grads, loss = None, 0.0
        with self.sent.count(accumulating=True):  # summing micro-batches is local: nothing is sent
            for xb, yb in micro_batches:
                g, micro_loss = self.grad_fn(self.params, xb, yb, scale, k)
                grads = g if grads is None else {n: grads[n] + g[n] for n in grads}
                loss += float(micro_loss)
        with self.sent.count():
            precision = self.state.precision
            gshards = zf.reduce_grads(
                grads, self.state.layout, self.group, stage=self.stage, comm_policy=self.comm, precision=precision
            )
        return loss, gshards

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
        """One ``backward`` per micro-batch (all but the last under ``no_sync``), then ``step``."""
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
        if cfg.wire == "fp64":  # zerofn's arithmetic in float64: a sum with no order
            self.ddp.register_comm_hook(group, float64_wire_hook)
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
        """One DDP + ``torch.optim.AdamW`` step, written as the usual mixed-precision loop."""
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


class ZeroRun(Protocol):
    """What the training loop needs of a zerofn run (:class:`FunctionalRun`, :class:`FacadeRun`)."""

    sent: ByteLog

    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, bool]:
        """One optimizer step over ``micro_batches``: (the step's loss, whether it was skipped)."""
        ...

    def named_params(self) -> dict[str, torch.Tensor]:
        """The full params now (equal on every rank)."""
        ...

    def zero_state(self) -> zf.ZeroState:
        """This rank's ZeroState."""
        ...
