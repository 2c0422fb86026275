"""Test-only probes of what a framework computes itself (applied by ``rank_main.py``; they change
nothing, they print).

``print_megatron_lm_flops``: every result of Megatron-LM's ``num_floating_point_operations`` (its
own per-iteration FLOPs; core_v0.19.0 calls it twice an iteration, in ``train()`` and in
``training_log()``, with the same arguments) as ``framework-flops: <float>`` lines.
"""

from __future__ import annotations

import functools
import re
from typing import Any

PREFIX = "framework-flops: "


def print_megatron_lm_flops() -> None:
    import megatron.training.training as training

    stock = training.num_floating_point_operations

    @functools.wraps(stock)
    def num_floating_point_operations(*args: Any, **kwargs: Any) -> Any:
        result = stock(*args, **kwargs)
        print(f"{PREFIX}{float(result)!r}", flush=True)
        return result

    training.num_floating_point_operations = num_floating_point_operations


def framework_flops(output: str) -> list[float]:
    """The probe's values in a rank's output, in call order."""
    return [float(m) for m in re.findall(rf"^.*{PREFIX}(\S+)$", output, flags=re.M)]
