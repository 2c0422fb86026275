"""Hugging Face decoder layers that run attention and the MLP in parallel on the layer's input
(stdlib only): which families do, with how many norms, and what such a layer saves for backward
against megatron-core's sequential layer.

transformers 5.24's layers (``hidden_states`` is the layer's input ``x``):

- cohere: ``n = input_layernorm(x)``; ``x + attn(n) + mlp(n)``: one norm.
- stablelm with ``use_parallel_residual`` (default False): the same, one norm.
- falcon with ``parallel_attn`` (default True) and without ``new_decoder_architecture``: the same,
  one norm (``input_layernorm``; the MLP reads ``attention_layernorm_out``).
- falcon with ``new_decoder_architecture``: ``ln_attn(x)`` and ``ln_mlp(x)``, two norms on the same
  input (``num_ln_in_parallel_attn`` 2, the default), or one norm (``num_ln_in_parallel_attn`` 1).
  (Its layer adds the MLP's output to the attention's whatever ``parallel_attn`` says.)
- gpt_neox with ``use_parallel_residual`` (default True): ``input_layernorm(x)`` and
  ``post_attention_layernorm(x)``, two norms on the same input.

What this changes against megatron-core's sequential layer (the MLP's norm reads the residual
``x + attn(...)``, a storage of its own, and ``linear_fc1`` reads that norm's output):

- one norm: no pre-MLP norm (no parameters, no saved input or statistics), and ``linear_fc1``'s
  input is the norm's output ``linear_qkv`` already keeps: one storage.
- two norms: the MLP's norm keeps the layer's input, the storage the attention's norm keeps
  already; its statistics and its output (``linear_fc1``'s input) are its own.

NB: measured at TP 1 against transformers' own layers (tests/test_memory_hf_parallel.py: parallel
against sequential twins, and full recompute against transformers' per-layer checkpointing), and
whole on megatron-core's local modules wired so (a local port: with selective ``core_attn`` and
``mlp`` and full recompute, and on gloo under TP 2 with and without sequence parallelism). No
framework runs these layers under tensor or sequence parallelism, selective ``layernorm``
recompute (the port's norm output would be freed before the MLP reads it) or LoRA: there the
figures are megatron-core's modules wired as above, each sublayer with its own collectives, named
unmeasured.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# parallel_layer_norms: 0 megatron-core's sequential layer; 1 attention and MLP read one norm's output;
# 2 each reads its own norm of the layer's input.
SEQUENTIAL, ONE_NORM, TWO_NORMS = 0, 1, 2


def parallel_layer_norms(text: Mapping[str, Any], family: str) -> int:
    """How many norms a ``family`` layer with attention and the MLP in parallel has (0: its layer
    is sequential), as transformers' modeling code reads ``text``'s keys."""
    if family == "cohere":
        return ONE_NORM
    if family == "stablelm":
        return ONE_NORM if text.get("use_parallel_residual", False) else SEQUENTIAL
    if family == "gpt_neox":
        return TWO_NORMS if text.get("use_parallel_residual", True) else SEQUENTIAL
    if family == "falcon":
        if text.get("new_decoder_architecture"):
            return ONE_NORM if text.get("num_ln_in_parallel_attn") == 1 else TWO_NORMS
        return ONE_NORM if text.get("parallel_attn", True) else SEQUENTIAL
    return SEQUENTIAL


def parallel_layer_assumptions(norms: int) -> list[str]:
    """How a parallel layer is counted (empty for megatron-core's sequential layer)."""
    if norms == SEQUENTIAL:
        return []
    how = ("one norm, whose output linear_qkv and linear_fc1 both keep" if norms == ONE_NORM
           else "a norm each, both keeping the layer's input")
    return [f"attention and the MLP in parallel on the layer's input as in transformers' layer ({how}; no "
            "residual between them), counted with megatron-core's modules"]


def parallel_layer_unmeasured(norms: int, *, tp: int, sequence_parallel: bool, selective: bool,
                              peft: bool) -> list[str]:
    """The parallel layer's figures no run measures: those under TP, sequence parallelism,
    selective ``layernorm`` recompute or LoRA/frozen bases (no framework has this layer with them)."""
    if norms == SEQUENTIAL:
        return []
    what = [name for name, used in (("TP > 1", tp > 1), ("sequence parallelism", sequence_parallel),
                                    ("selective layernorm recompute", selective), ("LoRA or a frozen base", peft)) if used]
    if not what:
        return []
    return [f"the parallel attention and MLP layer under {', '.join(what)}: no framework runs it so; counted as "
            "megatron-core's modules wired as transformers' layer, each sublayer with its own TP collectives (a "
            "framework may merge the two all-reduces; under TP and sequence parallelism the figures match such a "
            "port of megatron-core's local layer on CPU)"]
