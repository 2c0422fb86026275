"""Print the README's conformance table: measured (FlopCounterMode) vs estimated FLOPs.

Run: python scripts/conformance_table.py   (needs megatron-core; takes ~20 s on 2 cores).
tests/test_conformance.py checks that the README holds exactly this output.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

HEADER = ("| architecture | measured FLOPs | estimate --attention full | equal |", "|---|---:|---:|:---:|")


def table_lines(results: Mapping[str, tuple[int, int]]) -> list[str]:
    """The table's markdown lines from ``{architecture: (measured, estimated)}``, in order."""
    return [*HEADER, *(f"| {name} | {measured:,} | {estimated:,} | {'yes' if measured == estimated else 'NO'} |"
                       for name, (measured, estimated) in results.items())]


def main() -> None:
    import argparse
    import warnings

    argparse.ArgumentParser(
        description="Print the README's conformance table: for every architecture of tests/test_conformance.py, "
        "the FLOPs torch.utils.flop_counter.FlopCounterMode measures on the real megatron-core module and "
        "estimate --attention full's. Needs megatron-core; about 20 s on 2 cores. tests/test_conformance.py "
        "checks that README.md holds exactly this output.").parse_args()

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import mcore_cpu
    from test_conformance import MATRIX, measured_and_estimated

    mcore_cpu.init_single_process()
    print("\n".join(table_lines({name: measured_and_estimated(name) for name in MATRIX})))


if __name__ == "__main__":
    main()
