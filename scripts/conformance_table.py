"""Print the README's conformance table: measured (FlopCounterMode) vs estimated FLOPs.

Run: python scripts/conformance_table.py   (needs megatron-core; takes ~20 s on 2 cores)
"""

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mcore_cpu  # noqa: E402
from test_conformance import MATRIX, ROWS, VOCAB, _measure_rows, _spec_for  # noqa: E402

from megatron_flops.formulas import estimate, parse_rows  # noqa: E402

mcore_cpu.init_single_process()
print(f"rows: {ROWS}\n")
print("| architecture | measured FLOPs | estimate --attention full | equal |")
print("|---|---:|---:|:---:|")
for name, kwargs in MATRIX.items():
    model = mcore_cpu.build_gpt(dict(kwargs), vocab_size=VOCAB, max_seq_len=32)
    measured = _measure_rows(model, ROWS)
    estimated = estimate(_spec_for(model, True), parse_rows(ROWS), attention="full").total
    print(f"| {name} | {measured:,} | {estimated:,} | {'yes' if measured == estimated else 'NO'} |")
