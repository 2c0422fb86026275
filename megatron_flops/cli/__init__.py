"""Command line ``megatron-flops``: one module per subcommand, each with ``add_parser(sub)``."""

from __future__ import annotations

import argparse
import os
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
    except BrokenPipeError:  # `... | head -1`: the reader has what it wanted
        _quiet_stdout()
        return 0
    except ValueError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"megatron-flops: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the command writes (an --out, a --plot) that the system refuses
        where = " ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
        print(f"megatron-flops: error: {where or 'a file'}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _quiet_stdout() -> None:
    """Point stdout at the null device, so that flushing it at exit raises nothing again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file descriptor (captured)
        pass


if __name__ == "__main__":
    sys.exit(main())
