"""The demo's launcher and command line: start or join the ranks, parse the options, print.

:func:`run` trains in an existing process group, joins torchrun's, or starts its own gloo
ranks; :func:`add_arguments`, :func:`config_from_args` and :func:`main` are
``python -m zerofn demo`` (``zerofn/__main__.py`` owns the top-level parser). Option
problems go through ``parser.error``: usage, a message, exit code 2, before any rank starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from datetime import timedelta
from typing import Any, TextIO

import torch.distributed as dist

from zerofn.demo.config import APIS, COMM_CHOICES, DTYPES, WIRES, DemoConfig
from zerofn.demo.report import format_report, write_plot
from zerofn.demo.training import train

__all__ = [
    "NO_MASTER_ADDR",
    "TIMEOUT_S",
    "add_arguments",
    "config_from_args",
    "launched_by_torchrun",
    "main",
    "plot_problems",
    "run",
]

TIMEOUT_S = 120.0  # every process group gets a timeout: a stuck collective becomes an error
NO_MASTER_ADDR = (
    "RANK and WORLD_SIZE are set but MASTER_ADDR is not: launch with torchrun, "
    "or unset RANK and WORLD_SIZE to let the demo start its own ranks"
)


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
    cfg.check()
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
    parser.add_argument(
        "--wire",
        choices=WIRES,
        default=d.wire,
        help="what gradients are reduced in: working (the working dtype, default) or fp64 (both runs "
        "in float64, where a sum has no order: bitwise equal to DDP at any world size)",
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
        wire=args.wire,
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
