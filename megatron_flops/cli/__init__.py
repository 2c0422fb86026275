"""Command line ``megatron-flops``: one module per subcommand, each with ``add_parser(sub)``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from megatron_flops import __version__
from megatron_flops.cli import compare, demo, estimate, memory, sweep

_COMMANDS = (estimate, memory, demo, compare, sweep)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``prog: error: message``), exit status 2, for every subcommand."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = _Parser(
        prog="megatron-flops",
        description="True training FLOPs, TFLOP/s/GPU and MFU for Megatron-style training.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-flops {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors exit 2 with one line on stderr."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.func(args)
    except ValueError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"megatron-flops: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
