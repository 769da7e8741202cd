"""What the demo trains and how: :class:`DemoConfig`, the choices it accepts, the tolerances.

The leaf of the demo package: it imports no other demo module, so every other one may
import it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

import torch

__all__ = ["APIS", "COMM_CHOICES", "DTYPES", "TOLERANCE", "WIRES", "DemoConfig"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
APIS = ("functional", "facade")
COMM_CHOICES = ("auto", "byte-optimal")
# What gradients travel in: the working dtype (what training uses), or float64 in both runs
# (zerofn's comm_dtype and DDP's zerofn.testing.float64_wire_hook), where a sum of a few
# ranks' addends is exact and so has no order: the runs are then bitwise equal at any
# world size, and the remaining difference of the default wire is shown to be the order.
WIRES = ("working", "fp64")
# How far zerofn's params may be from DDP's, as "max rel diff" (per tensor max|a - b| /
# max|b|, the worst tensor on the worst rank). At 1 and 2 ranks without clipping the two
# runs are bitwise equal in every dtype (the same local gradients; a sum of two addends
# has one order). At 3+ ranks zerofn adds each element's addends in rank order and DDP's
# gloo all-reduce in an order that depends on where the element sits in its bucket: some
# gradient elements differ by one rounding of the working dtype, AdamW turns that into
# slightly different updates (a near-zero gradient sum can even change sign), and the
# params drift apart slowly. The bounds hold for runs of up to a few hundred steps (the
# drift at 4 ranks: docs/getting-started.md).
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 3e-2}


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
        computes the norm in float64, ``clip_grad_norm_`` in float32, so
        with clipping the two runs drift apart by an ulp now and then (about 1e-7
        relative after hundreds of steps in fp32); without it they are bitwise equal at
        1 and 2 ranks.
      wire: ``"working"`` (gradients reduced in the working dtype, as in training) or
        ``"fp64"`` (both runs reduce in float64: bitwise equal at any world size without
        clipping; twice the bytes of fp32 on the wire, so the byte figures grow).
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
    wire: str = "working"
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
        out += _not_one_of("--precision", self.precision, DTYPES)
        out += _not_one_of("--api", self.api, APIS)
        if self.overlap and self.api == "functional":
            out.append(
                "--overlap needs --api facade: the functional loop has no gradient hooks to launch "
                "communication from (torch.func.grad returns all gradients at once); "
                "drop --api functional, or drop --overlap"
            )
        if self.accumulate < 1:
            out.append(f"--accumulate must be at least 1 (micro-batches per step), got {self.accumulate}")
        out += _not_one_of("--comm", self.comm, COMM_CHOICES)
        out += _not_one_of("--wire", self.wire, WIRES)
        if self.max_norm is not None and not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            out.append(f"--max-norm must be a positive finite number, got {self.max_norm}")
        if self.batch_per_rank < 1:
            out.append(f"batch_per_rank must be at least 1, got {self.batch_per_rank}")
        return out

    def check(self) -> None:
        """Raise ``ValueError`` with every problem joined by ``"; "``; return if there is none."""
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))


def _not_one_of(flag: str, value: str, choices: Collection[str]) -> list[str]:
    """``[problem]`` when ``value`` is not one of ``choices`` (the problem names ``flag`` and them all); else ``[]``."""
    return [] if value in choices else [f"{flag} must be one of {', '.join(choices)}, got {value!r}"]
