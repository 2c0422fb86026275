"""Run a training script with the adapters installed, without editing it.

    python -m megatron_flops.launch [--flops-accounting corrected] [--flops-peak-tflops T]
        [--flops-attention causal|full] [--flops-framework auto] [--flops-trace FILE]
        pretrain_gpt.py ARGS...
    torchrun --nproc-per-node 8 -m megatron_flops.launch --flops-accounting corrected pretrain_gpt.py ARGS...

Options go before the script; each defaults to its environment variable (``adapters.env``).
The script then runs as ``__main__`` with ``sys.argv = [script, *ARGS]`` and its own directory
first on ``sys.path``, as ``python script.py ARGS`` would run it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from megatron_flops.adapters import env


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the launcher's options, install the adapters, run the script."""
    parser = argparse.ArgumentParser(prog="python -m megatron_flops.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--flops-accounting", choices=("static", "corrected"), default=None,
                        help=f"default: ${env.ACCOUNTING}, else static")
    parser.add_argument("--flops-peak-tflops", default=None, help=f"default: ${env.PEAK_TFLOPS}")
    parser.add_argument("--flops-attention", default=None, help=f"default: ${env.ATTENTION}")
    parser.add_argument("--flops-framework", default=None, help=f"default: ${env.FRAMEWORK}, else auto")
    parser.add_argument("--flops-trace", default=None, metavar="FILE",
                        help=f"append the per-step trace to FILE (default: ${env.TRACE}, else none)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    options = parser.parse_args(argv)
    environ = dict(os.environ)
    for name, value in ((env.ACCOUNTING, options.flops_accounting), (env.PEAK_TFLOPS, options.flops_peak_tflops),
                        (env.ATTENTION, options.flops_attention), (env.FRAMEWORK, options.flops_framework),
                        (env.TRACE, options.flops_trace)):
        if value is not None:
            environ[name] = value
    try:
        env.install_from_env(environ)
    except ValueError as exc:
        parser.error(str(exc))
    sys.argv = [options.script, *options.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(options.script)))
    runpy.run_path(options.script, run_name="__main__")


if __name__ == "__main__":
    main()
