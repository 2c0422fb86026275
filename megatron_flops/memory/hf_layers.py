"""What a Hugging Face family's decoder layers hold and save beyond the GEMM shapes (stdlib only):
the ``TransformerConfig`` options that express it (norm, biases, rotary fraction, q/k norms,
position embeddings, Megatron-Bridge's gemma2/gemma3 post-norms and logit soft-capping, attention
and the MLP in parallel: :mod:`.hf_parallel`), and, named, what megatron-core's GPT layer cannot
express (norms after the sublayers instead of before them, norms without weights or bias, xIELU),
which the memory report then lists as not modelled. (cohere's and stablelm's per-head and olmo2/olmo3's
whole-projection q/k norms, and falcon's ALiBi: :mod:`.hf_qk_norms`.) Biases on some linear layers only
(o_proj's without the MLP's, or the MLP's without attention's) are ``hf_proj_bias``/``hf_mlp_bias``, and
the MLA families' ``attention_bias`` on the down projections (``q_a_proj``, ``kv_a_proj_with_mqa``, which
megatron-core's MLA lacks) ``hf_mla_down_bias``:
a bias adds parameters, gradients and optimizer state, and no saved tensor (transformers' ``addmm`` and
megatron-core's bias-dropout-add and bias-activation fusions save the same tensors with it or without).

NB: parameters checked against the transformers model's ``named_parameters()`` (tests/test_memory_hf_families.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_flops.memory.hf_parallel import parallel_layer_norms
from megatron_flops.memory.hf_qk_norms import hf_qk_norm_kind

# Families whose norms are LayerNorms (weight and bias) in transformers: megatron-core's LayerNorm.
# (nemotron's LayerNorm1P: weight + 1, megatron-core's layernorm_zero_centered_gamma: the same bytes.)
_LAYERNORM = ("starcoder2", "nemotron", "stablelm", "gpt_neox", "falcon")
# Families whose norm is a LayerNorm without a bias (cohere) or without any weight (olmo): saved as
# megatron-core's LayerNorm (input, fp32 mean and rstd), parameters without them.
_LAYERNORM_NO_BIAS = ("cohere",)
_LAYERNORM_NO_AFFINE = ("olmo",)
# Families with partial rotary, and transformers' default fraction where the file may omit it.
_ROTARY_DEFAULTS = {"glm": 0.5, "glm4": 0.5, "stablelm": 0.25, "gpt_neox": 0.25, "nemotron": 0.5, "phi3": 1.0}
# attention_bias puts a bias on q, k and v only (not o_proj) in these families; the others put one on o_proj
# too (q_a_proj, kv_a_proj_with_mqa and o_proj in the MLA families).
_QKV_ONLY_ATTENTION_BIAS = ("glm", "glm4", "helium", "seed_oss")
# Families with norms after attention and after the MLP instead of the pre-norms: counted as the spec
# below without its pre-norms (no framework has a megatron-core layer for them).
_POST_NORMS_INSTEAD = ("olmo2", "olmo3")
# Families with RMSNorms after attention and after the MLP as well as the pre-norms, and their logit
# soft-capping: Megatron-Bridge 0.6.2's gemma2/gemma3 layer spec (TERowParallelLinearLayerNorm on
# linear_proj and linear_fc2, Gemma2DotProductAttention, Gemma2OutputLayer). glm4's layer has the
# same norms in the same places; Bridge has no glm4 dense provider: counted as that spec.
_BRIDGE_POST_NORMS = ("gemma2", "gemma3", "gemma3_text", "glm4")


def hf_decoder_fields(text: Mapping[str, Any], family: str) -> dict[str, Any]:
    """``DecoderOptions`` fields for the text decoder ``text`` of ``family``: what a
    megatron-core GPT with the same parameters and saved tensors sets."""
    norm = "LayerNorm" if family in _LAYERNORM + _LAYERNORM_NO_BIAS + _LAYERNORM_NO_AFFINE else "RMSNorm"
    qkv, out, mlp = _biases(text, family)
    experts = any(text.get(k) for k in ("num_local_experts", "n_routed_experts", "num_experts"))
    alibi = family == "falcon" and bool(text.get("alibi"))
    return {
        "normalization": norm,
        "add_bias_linear": qkv and out and mlp and not experts,  # (their experts and routers have no biases)
        "add_qkv_bias": qkv,
        "hf_proj_bias": out,
        "hf_mlp_bias": mlp,
        "hf_mla_down_bias": bool(text.get("kv_lora_rank")) and qkv,
        "qk_layernorm": _qk_norm(text, family),
        "hf_qk_norm": hf_qk_norm_kind(family) if _qk_norm(text, family) else None,
        "alibi": alibi,
        "position_embedding_type": "none" if alibi else "rope",
        "rotary_percent": _rotary_fraction(text, family),
        "max_position_embeddings": text.get("max_position_embeddings"),
        **_bridge_post_norm_fields(text, family),
        "norm_weight": family not in _LAYERNORM_NO_AFFINE,
        "norm_bias": family not in _LAYERNORM_NO_BIAS + _LAYERNORM_NO_AFFINE,
        "xielu": family == "apertus",
        "parallel_layer_norms": parallel_layer_norms(text, family),
    }


def _bridge_post_norm_fields(text: Mapping[str, Any], family: str) -> dict[str, Any]:
    if family in _POST_NORMS_INSTEAD:
        return {"post_layernorms": True, "pre_layernorms": False}
    if family not in _BRIDGE_POST_NORMS:
        return {}
    caps = {k: float(text[k]) if text.get(k) else None for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {"post_layernorms": True, **caps}


def hf_layer_assumptions(*, post_layernorms: bool, attn_cap: bool, final_cap: bool, pre_layernorms: bool = True) \
        -> list[str]:
    """How Megatron-Bridge's gemma2/gemma3 spec (Transformer Engine's layers) is counted: as
    megatron-core's local modules in the same places save (measured: tests/test_memory_hf_layers.py)."""
    parts = [what for what, used in (
        ("an RMSNorm on linear_proj's and on linear_fc2's output (TERowParallelLinearLayerNorm: its input and fp32 "
         "rstd per token; glm4's norms, which Bridge has no dense provider for, counted the same)", post_layernorms),
        ("no norms before attention and the MLP (olmo2, olmo3: no framework has their layer; counted as this spec "
         "without its pre-norms)", not pre_layernorms),
        ("tanh soft-capping of the attention scores (Gemma2DotProductAttention: its [b, heads, s, s] output kept by "
         "the local attention, none inside a fused kernel's score_mod)", attn_cap),
        ("tanh soft-capping of the logits (Gemma2OutputLayer: its [tokens, vocab/TP] output)", final_cap),
    ) if used]
    if not parts:
        return []
    return ["layers as Megatron-Bridge 0.6.2's gemma2/gemma3 spec, counted as megatron-core's local modules in the "
            "same places save: " + "; ".join(parts)]


def _biases(text: Mapping[str, Any], family: str) -> tuple[bool, bool, bool]:
    """Whether the q/k/v projections, o_proj and the MLP have biases, as the family's modeling
    code reads its keys."""
    if family == "qwen2":
        return True, False, False  # q, k and v always; o_proj and the MLP never
    if family == "qwen2_moe":
        return bool(text.get("qkv_bias", True)), False, False
    if family in ("starcoder2", "ernie4_5"):
        every = bool(text.get("use_bias", family == "starcoder2"))
        return every, every, every
    if family == "falcon":
        every = bool(text.get("bias", False))
        return every, every, every
    if family == "stablelm":
        return bool(text.get("use_qkv_bias", False)), False, False
    if family == "gpt_neox":
        attention = bool(text.get("attention_bias", True))
        return attention, attention, True  # the MLP always has biases
    attention, mlp = bool(text.get("attention_bias", False)), bool(text.get("mlp_bias", False))
    if family in _QKV_ONLY_ATTENTION_BIAS:
        return attention, bool(text.get("attention_out_bias", False)), mlp
    return attention, attention, mlp


def _qk_norm(text: Mapping[str, Any], family: str) -> bool:
    if family in ("qwen3", "qwen3_moe", "olmo2", "olmo3", "gemma3", "gemma3_text", "apertus") \
            or family.startswith("deepseek"):
        return True  # (deepseek: its q/kv latents' norms)
    if family in ("cohere", "hunyuan_v1_dense"):
        return bool(text.get("use_qk_norm", False))
    if family == "stablelm":
        return bool(text.get("qk_layernorm", False))
    return False


def _rotary_fraction(text: Mapping[str, Any], family: str) -> float:
    """The fraction of each head RoPE rotates: ``rope_parameters``'s (transformers 5),
    ``rope_scaling``'s or the top-level ``partial_rotary_factor``, gpt_neox's ``rotary_pct``; 1 in
    families that rotate whole heads (their modeling code ignores the key)."""
    if family not in _ROTARY_DEFAULTS:
        return 1.0
    for name in ("rope_parameters", "rope_scaling"):
        rope = text.get(name)
        if isinstance(rope, Mapping) and rope.get("partial_rotary_factor") is not None:
            return float(rope["partial_rotary_factor"])
    for key in ("partial_rotary_factor", "rotary_pct"):
        if text.get(key) is not None:
            return float(text[key])
    return _ROTARY_DEFAULTS.get(family, 1.0)


def hf_differences(text: Mapping[str, Any], family: str) -> tuple[str, ...]:
    """What the family's layers hold or save that megatron-core's GPT layer (and so this report)
    does not: one entry per difference, naming what is counted instead."""
    return tuple(f"Hugging Face {family}: {what}" for what in _layer_differences(text, family))


def _layer_differences(text: Mapping[str, Any], family: str) -> list[str]:
    out = []
    if family not in _BRIDGE_POST_NORMS and (text.get("final_logit_softcapping") or text.get("attn_logit_softcapping")):
        out.append("logit soft-capping (tanh of the scores or logits: its saved output left out)")
    return out

