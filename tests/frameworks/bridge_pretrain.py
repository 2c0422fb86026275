"""A Megatron-Bridge user's pretraining script (test-only): a ``ConfigContainer`` and ``pretrain()``
with the stock ``gpt_step.forward_step`` (or ``vlm_step.forward_step`` for the VLM), run by
``rank_main.py`` through ``python -m megatron_flops.launch --flops-accounting corrected``.

    bridge_pretrain.py SCENARIO      (a name in frameworks.bridge.SCENARIOS)

Or, with ``--config-flag``, the config route instead of the launcher:
``cfg.logger.flops_accounting = "corrected"`` then ``maybe_install_from_config(cfg)``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from frameworks import bridge  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(bridge.SCENARIOS))
    parser.add_argument("--config-flag", action="store_true")
    options = parser.parse_args()
    scenario = bridge.SCENARIOS[options.scenario]

    from megatron.bridge.training.pretrain import pretrain

    cfg = bridge.config(scenario)
    if options.config_flag:
        from megatron_flops.adapters.megatron_bridge import maybe_install_from_config

        cfg.logger.flops_accounting = "corrected"
        cfg.logger.flops_trace = os.environ.get("MEGATRON_FLOPS_TRACE")
        maybe_install_from_config(cfg)
    if scenario.vlm:
        from megatron.bridge.training.vlm_step import forward_step
    else:
        from megatron.bridge.training.gpt_step import forward_step
    pretrain(cfg, forward_step)


if __name__ == "__main__":
    main()
