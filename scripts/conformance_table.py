"""Print the conformance tables of docs/conventions.md: measured (FlopCounterMode) vs estimated FLOPs.

Run: python scripts/conformance_table.py [--hf]
  (default) the megatron-core table (needs megatron-core; ~20 s on 2 cores);
  --hf      the Hugging Face families table: every model_type the reader supports, measured on a
            tiny random transformers model (needs transformers; a few minutes on 2 cores).
tests/test_conformance.py and tests/test_hf_config.py check that docs/conventions.md holds exactly
this output, and the second that every supported family has a measured case.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

HEADER = ("| architecture | measured FLOPs | estimate --attention full | equal |", "|---|---:|---:|:---:|")
HF_HEADER = ("| model_type | case | measured FLOPs | estimate --attention full | equal |", "|---|---|---:|---:|:---:|")


def _equal(measured: int, estimated: int) -> str:
    return "yes" if measured == estimated else "NO"


def table_lines(results: Mapping[str, tuple[int, int]]) -> list[str]:
    """The megatron-core table's lines from ``{architecture: (measured, estimated)}``, in order."""
    return [*HEADER, *(f"| {name} | {measured:,} | {estimated:,} | {_equal(measured, estimated)} |"
                       for name, (measured, estimated) in results.items())]


def hf_table_lines(results: Mapping[str, tuple[str, int, int]]) -> list[str]:
    """The Hugging Face table's lines from ``{case: (model_type, measured, estimated)}``, sorted by
    model_type then case."""
    rows = sorted(results.items(), key=lambda item: (item[1][0], item[0]))
    return [*HF_HEADER, *(f"| `{model_type}` | {case} | {measured:,} | {estimated:,} | {_equal(measured, estimated)} |"
                          for case, (model_type, measured, estimated) in rows)]


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
    if "--hf" in sys.argv[1:]:
        from test_hf_config import CASES
        from test_hf_config import measured_and_estimated as hf_measured

        print("\n".join(hf_table_lines({case: (CASES[case][0], *hf_measured(case)) for case in CASES})))
        return
    import mcore_cpu
    from test_conformance import MATRIX, measured_and_estimated

    mcore_cpu.init_single_process()
    print("\n".join(table_lines({name: measured_and_estimated(name) for name in MATRIX})))


if __name__ == "__main__":
    main()
