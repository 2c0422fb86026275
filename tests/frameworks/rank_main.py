"""One rank of a real training run on CPU (test-only entry point, started by ``procs.launch``).

    python tests/frameworks/rank_main.py megatron-lm [--packed SEED [--row-local]] [--print-framework-flops] \
        -- LAUNCH_ARGS... pretrain_gpt.py ARGS...
    python tests/frameworks/rank_main.py megatron-bridge -- LAUNCH_ARGS... bridge_pretrain.py SCENARIO

applies the CPU shims (``cpu_shims``), optionally swaps the mock dataset for packed rows with known
document lengths (``data``), then hands over to ``python -m megatron_flops.launch LAUNCH_ARGS...``,
which runs the stock, unmodified script.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from frameworks import cpu_shims  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("megatron-lm", "megatron-bridge"))
    parser.add_argument("--packed", type=int, default=None, help="packed rows from this seed (data.install_packed_mock_dataset)")
    parser.add_argument("--row-local", action="store_true", help="their offsets padded to S + 1 (core_v0.19.0)")
    parser.add_argument("--print-framework-flops", action="store_true",
                        help="print what Megatron-LM's own num_floating_point_operations returns (probes.py)")
    argv = sys.argv[1:]
    split = argv.index("--")
    options, rest = parser.parse_args(argv[:split]), argv[split + 1:]
    cpu_shims.install_torch_cuda()
    cpu_shims.install_megatron_core()
    cpu_shims.install_pipeline_sends()
    if options.framework == "megatron-lm":
        cpu_shims.install_megatron_lm()
    else:
        cpu_shims.import_megatron_bridge()
        cpu_shims.install_megatron_bridge()
        cpu_shims.install_thd_attention()
    if options.packed is not None:
        from frameworks import data

        data.install_packed_mock_dataset(options.packed, row_local=options.row_local)
        cpu_shims.install_thd_attention()
    if options.print_framework_flops:
        from frameworks import probes

        probes.print_megatron_lm_flops()
    from megatron_flops import launch

    launch.main(rest)


if __name__ == "__main__":
    main()
