"""Test-only: tiny Hugging Face transformers models on CPU, the FLOPs ``FlopCounterMode`` counts on
them, and megatron-flops' estimate of their ``config.json`` through the CLI.

Nothing here is imported by the ``megatron_flops`` package.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from megatron_flops.cli import main


def eager_model(config: Any) -> Any:
    """``config``'s causal LM (seed 0) with eager attention and experts: the per-expert loop runs
    ``torch.mm``, which ``FlopCounterMode`` sees (grouped kernels it may not)."""
    import torch
    import transformers

    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.set_experts_implementation("eager")
    return model


def tiny_model(model_type: str, **fields: Any) -> tuple[Any, Any]:
    """(config, :func:`eager_model`) of a ``model_type`` config with ``fields``."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **fields)
    return config, eager_model(config)


def measured_flops(model: Any, seqlens: list[int], **call: Any) -> int:
    """Forward + backward FLOPs that ``FlopCounterMode`` counts on ``model``, one sequence of random
    token ids (below 100) at a time; ``call``: more keyword arguments of the model call."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    total = 0
    for s in seqlens:
        ids = torch.randint(0, 100, (1, s))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, **call).logits.float().sum().backward()
        total += counter.get_total_flops()
    return total


def estimate_report(config: Any, rows: list[list[int]]) -> dict[str, Any]:
    """``megatron-flops estimate --attention full --json`` over ``rows`` of the ``config.json``
    that ``save_pretrained`` would write for ``config``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.to_json_string())
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["estimate", "--model", str(path), "--seqlens", json.dumps(rows), "--attention", "full",
                         "--json"]) == 0
    return json.loads(out.getvalue())


def saved_bytes(model: Any, *, seq: int, batch: int, dtype: Any = None, attention: str = "eager") -> int:
    """Bytes of the distinct storages autograd saves in one training forward of ``model`` (cast to
    ``dtype``, with ``attention`` as its attention implementation) on a [batch, seq] batch of random
    token ids (below 100): :class:`mcore_memory.SavedTensorMeter` (parameters and one-element tensors
    left out)."""
    import torch

    from mcore_memory import SavedTensorMeter

    if dtype is not None:
        model = model.to(dtype)
    model.config._attn_implementation = attention
    model.train()
    meter = SavedTensorMeter(model.parameters())
    with meter.tracking(), meter.one_forward():
        loss = model(input_ids=torch.randint(0, 100, (batch, seq))).logits.float().sum()
    loss.backward()
    return meter.forward[0]
