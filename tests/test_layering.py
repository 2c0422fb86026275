"""Imports point only toward lighter modules: the pure layers load without torch or megatron,
and importing the package or its adapters patches and imports no framework."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["megatron_flops.spec", "megatron_flops.formulas", "megatron_flops.vision",
                                    "megatron_flops.peaks", "megatron_flops.meter", "megatron_flops.result",
                                    "megatron_flops.passes", "megatron_flops.dit", "megatron_flops.dit_passes",
                                    "megatron_flops.hf_config", "megatron_flops.megatron_args",
                                    "megatron_flops.trace", "megatron_flops.runs", "megatron_flops.memory",
                                    "megatron_flops.cli.memory", "megatron_flops.cli"])
def test_pure_layers_import_without_torch(module):
    loaded = _modules_after(f"import {module}")
    assert "torch" not in loaded and not any(m.startswith("megatron.") for m in loaded)


def test_tracker_and_adapters_import_no_framework():
    loaded = _modules_after("import megatron_flops, megatron_flops.tracker, megatron_flops.session, "
                            "megatron_flops.dit_tracker, "
                            "megatron_flops.adapters.megatron_lm, megatron_flops.adapters.megatron_bridge")
    assert not any(m.startswith("megatron.") or m == "transformers" for m in loaded)
