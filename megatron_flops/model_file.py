"""A tracker from any model file ``megatron-flops estimate`` takes (torch level).

A decoder (megatron-core fields or a Hugging Face ``config.json``; a ``vision_config`` adds the
vision tower of a VLM), or a DiT (a ``"dit"`` section); a ``"lora"`` section and ``recompute_*``
fields set up frozen weights, LoRA and recompute as in the CLI.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from megatron_flops.dit_passes import dit_setup
from megatron_flops.dit_tracker import DiTFlopsTracker
from megatron_flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.spec import load_model_file
from megatron_flops.tracker import FlopsTracker
from megatron_flops.vision import vision_spec_from_model_mapping


def tracker_from_model_file(path: str | Path, **options: Any) -> FlopsTracker | DiTFlopsTracker:
    """A :class:`FlopsTracker` or, for a DiT model file, a :class:`DiTFlopsTracker`; ``options``
    are the tracker's keyword arguments and override the file's setup."""
    spec, raw = load_model_file(path)
    source = Path(path).name
    if "dit" in raw:
        _check_options(DiTFlopsTracker, options, source, "a DiT")
        setup = dit_setup(raw, source=source)
        return DiTFlopsTracker(setup.spec, **{"peft": setup.peft, "recompute": setup.recompute, **options})
    _check_options(FlopsTracker, options, source, "a decoder")
    if spec is None:
        raise ValueError(f"{source}: holds no decoder to track (a vision tower alone is priced by the CLI)")
    defaults = {
        "peft": PeftSpec.from_lora_mapping(raw["lora"], source=source) if raw.get("lora") is not None else None,
        "recompute": RecomputeSpec.from_mapping(raw, source=source),
        "vision": vision_spec_from_model_mapping(raw) if "vision_config" in raw else None,
    }
    return FlopsTracker(spec, **{**defaults, **options})


def _check_options(cls: type, options: dict[str, Any], source: str, what: str) -> None:
    known = [name for name in inspect.signature(cls).parameters if name != "spec"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{source} describes {what}: option(s) {', '.join(unknown)} do not apply "
                         f"(options: {', '.join(known)})")
