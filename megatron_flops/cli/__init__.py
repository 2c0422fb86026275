"""Command line ``megatron-flops``: one module per subcommand, each with ``add_parser(sub)``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_flops.cli import demo, estimate

_COMMANDS = (estimate, demo)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="megatron-flops",
        description="True training FLOPs, TFLOP/s/GPU and MFU for Megatron-style training.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors exit 2 with one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"megatron-flops: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
