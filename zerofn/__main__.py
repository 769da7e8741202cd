"""Command line: ``python -m zerofn demo [options]``, also installed as ``zerofn demo``.

Bad options print the usage and a message and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``zerofn`` argument parser with its ``demo`` subcommand."""
    from zerofn import demo
    from zerofn.demo import cli

    parser = argparse.ArgumentParser(
        prog="zerofn",
        description="zerofn: ZeRO stage 1 and 2 for PyTorch as pure stage functions.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="train a small model with zerofn next to DDP and report parity, bytes and time",
        description=(demo.__doc__ or "").split("\n\n")[0],
    )
    cli.add_arguments(demo_parser)
    # The subparser reports option errors itself, so its usage line is the one shown.
    demo_parser.set_defaults(handler=cli.main, subparser=demo_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return the exit code."""
    from zerofn.demo import cli

    args = build_parser().parse_args(argv)
    try:
        code = args.handler(args, args.subparser)
    except KeyboardInterrupt:  # Ctrl-C: the ranks are gone, a traceback tells nothing
        print("zerofn: interrupted", file=sys.stderr)
        code = 130
    if cli.launched_by_torchrun():
        # This process held a gloo group: leave without interpreter teardown, where gloo
        # now and then aborts ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
