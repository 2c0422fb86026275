"""Hugging Face ``config.json`` files read as ``transformers``' modeling code reads them (stdlib
only): one rule set per supported ``model_type`` family, every key type-checked under its HF name,
and the result in ``TransformerConfig`` field names for :class:`megatron_flops.model.spec.ModelSpec`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megatron_flops.model.inputs import Fields, show
from megatron_flops.model._layout import FlagRuns, cleared, cycle, length, merged


def is_hf_config(data: Mapping[str, Any]) -> bool:
    """A Hugging Face config names its layers ``num_hidden_layers`` or carries ``model_type``."""
    return "num_hidden_layers" in data or "model_type" in data or "text_config" in data


def hf_text_config(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The text decoder's keys of a Hugging Face config (``text_config`` of a VLM, inheriting the
    outer ``model_type``), or None for a vision-only file (or Qwen3-Omni's, whose vision tower only is read)."""
    text = data.get("text_config")
    if text is not None:
        if not isinstance(text, Mapping):
            raise ValueError(f"{HF_SOURCE}: 'text_config' must be a mapping, got {show(text)}")
        if "model_type" not in text and "model_type" in data:
            text = {**text, "model_type": data["model_type"]}
        return text
    if "num_hidden_layers" not in data and ("vision_config" in data or "thinker_config" in data):
        # NB: Qwen3-Omni's thinker decoder (thinker_config.text_config) is not read: its vision tower is.
        return None
    return data


@dataclass(frozen=True, kw_only=True)
class _Rules:
    """How one ``model_type``'s modeling code builds its decoder, as far as GEMM shapes go.

    ``gated``: a gate and an up projection (or one fused ``gate_up_proj``) before the down
    projection; else one up projection (nemotron's relu^2, gpt_neox's GELU). ``activation``: the
    key naming the MLP's activation, and its default. ``ffn``: the key of the MLP width.
    ``kv_heads``: ``derived`` (``num_key_value_heads``, default every head), ``fixed`` (its default
    is a fixed size, so the file must give it), ``none`` (multi-head attention), ``falcon``.
    ``head_dim``: ``derived`` (optional, default hidden / heads), ``fixed`` (must be given),
    ``none`` (always hidden / heads). ``window``: which layers slide (:func:`_hf_window`);
    ``window_period``: the default ``layer_types`` period (every ``period``-th layer is global),
    read from ``window_pattern_key`` where the family has one.
    ``moe``: how experts are placed. ``mixer``: the token mixer where it is not softmax attention
    everywhere (``qwen3_next``: Gated DeltaNet layers; ``dsa``: DeepSeek sparse attention;
    ``kimi_linear``: Kimi Delta Attention layers). ``elementwise``: keys the family reads that shape no GEMM
    (partial rotary, parallel residual, logit soft-capping, multipliers).
    """

    gated: bool = True
    activation: tuple[str, str] = ("hidden_act", "silu")
    ffn: str = "intermediate_size"
    kv_heads: str = "derived"
    head_dim: str = "derived"
    tied: bool = False
    window: str = "none"
    window_period: int = 0
    window_pattern_key: str | None = None
    moe: str = "none"
    mixer: str = "softmax"
    elementwise: frozenset[str] = frozenset()


_PARTIAL_ROTARY = frozenset({"partial_rotary_factor"})
_GEMMA = _Rules(activation=("hidden_act", "gelu_pytorch_tanh"), kv_heads="fixed", head_dim="fixed", tied=True)
# NB: logit soft-capping (cap * tanh(x / cap) on attention scores and logits) is elementwise: not
# counted, as FlopCounterMode does not count it.
_GEMMA2 = replace(_GEMMA, activation=("hidden_activation", "gelu_pytorch_tanh"), window="layer_types", window_period=2,
                  elementwise=frozenset({"hidden_act", "attn_logit_softcapping", "final_logit_softcapping",
                                         "query_pre_attn_scalar"}))
_RULES: dict[str, _Rules] = {
    "llama": _Rules(),
    "mistral": _Rules(kv_heads="fixed", window="every_required"),
    "mixtral": _Rules(kv_heads="fixed", window="every", moe="mixtral"),
    "qwen2": _Rules(kv_heads="fixed", window="qwen"),
    "qwen3": _Rules(kv_heads="fixed", head_dim="fixed", window="qwen"),
    "qwen2_moe": _Rules(kv_heads="fixed", window="qwen2_moe", moe="qwen"),
    "qwen3_moe": _Rules(kv_heads="fixed", window="qwen3_moe", moe="qwen"),
    "deepseek_v2": _Rules(moe="deepseek"),
    "deepseek_v3": _Rules(moe="deepseek"),
    "deepseek_v32": _Rules(moe="deepseek", mixer="dsa"),
    "glm_moe_dsa": _Rules(moe="deepseek", mixer="dsa"),
    "kimi_linear": _Rules(mixer="kimi_linear"),
    "qwen3_next": _Rules(kv_heads="fixed", head_dim="fixed", moe="qwen", mixer="qwen3_next"),
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3_text": replace(_GEMMA2, window_period=6, window_pattern_key="sliding_window_pattern"),
    "phi3": _Rules(window="every", elementwise=_PARTIAL_ROTARY),
    "olmo2": _Rules(),
    "granite": _Rules(elementwise=frozenset({"embedding_multiplier", "logits_scaling", "residual_multiplier",
                                             "attention_multiplier"})),
    "glm": _Rules(kv_heads="fixed", head_dim="fixed", elementwise=_PARTIAL_ROTARY),
    "glm4": _Rules(kv_heads="fixed", head_dim="fixed", elementwise=_PARTIAL_ROTARY),
    "starcoder2": _Rules(gated=False, activation=("hidden_act", "gelu_pytorch_tanh"), kv_heads="fixed", tied=True,
                         window="every"),
    # Cohere runs attention and MLP in parallel from one norm: the same GEMMs.
    "cohere": _Rules(tied=True, elementwise=frozenset({"logit_scale", "use_qk_norm"})),
    "nemotron": _Rules(gated=False, activation=("hidden_act", "relu2"), elementwise=_PARTIAL_ROTARY),
    "gpt_neox": _Rules(gated=False, activation=("hidden_act", "gelu"), kv_heads="none", head_dim="none",
                       elementwise=frozenset({"rotary_pct", "partial_rotary_factor", "use_parallel_residual"})),
    # Further families transformers builds with the same layer kinds.
    "helium": _Rules(kv_heads="fixed", head_dim="fixed"),
    "olmo": _Rules(),
    "olmo3": _Rules(window="layer_types", window_period=4),
    "seed_oss": _Rules(kv_heads="fixed", head_dim="fixed"),
    "hunyuan_v1_dense": _Rules(head_dim="fixed", elementwise=frozenset({"use_qk_norm"})),
    "ernie4_5": _Rules(kv_heads="fixed", head_dim="fixed", tied=True),
    "stablelm": _Rules(kv_heads="fixed", elementwise=frozenset({"partial_rotary_factor", "use_parallel_residual",
                                                                "qk_layernorm", "use_qkv_bias"})),
    "arcee": _Rules(gated=False, activation=("hidden_act", "relu2")),
    "apertus": _Rules(gated=False, activation=("hidden_act", "xielu")),
    "falcon": _Rules(gated=False, activation=("activation", "gelu"), ffn="ffn_hidden_size", kv_heads="falcon",
                     head_dim="none", tied=True,
                     elementwise=frozenset({"parallel_attn", "alibi", "num_ln_in_parallel_attn"})),
}
HF_FAMILIES = tuple(sorted(_RULES))
# VLM text decoders priced with their text family's rules.
_HF_TEXT_MODEL_TYPES = {
    "qwen2_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_5_vl_text": "qwen2",
    "qwen3_vl": "qwen3", "qwen3_vl_text": "qwen3", "qwen3_vl_moe": "qwen3_moe", "qwen3_vl_moe_text": "qwen3_moe",
    "gemma3": "gemma3_text",
}
HF_SOURCE = "Hugging Face config"
HF_NAMES = {
    "num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size", "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim", "activation_func": "hidden_act", "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size", "num_moe_experts": "num_experts",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size", "window_size": "sliding_window",
    "share_embeddings_and_output_weights": "tie_word_embeddings", "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
}
# The keys each rule reads that shape the decoder; a key one family reads and another ignores is a
# tell of the first architecture when a file is priced with the second's rules (--hf-family).
_KV_KEYS = {"derived": ("num_key_value_heads",), "fixed": ("num_key_value_heads",), "none": (),
            "falcon": ("num_kv_heads", "multi_query", "new_decoder_architecture")}
_WINDOW_KEYS = {"none": (), "every": ("sliding_window",), "every_required": ("sliding_window",),
                "qwen": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
                "qwen2_moe": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
                "qwen3_moe": ("use_sliding_window", "sliding_window"),
                "layer_types": ("sliding_window", "layer_types", "sliding_window_pattern")}
_MOE_KEYS = {"none": (), "mixtral": ("num_local_experts", "num_experts", "num_experts_per_tok"),
             "qwen": ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"),
             "deepseek": ("n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok",
                          "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "kv_lora_rank",
                          "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_layer_freq",
                          "num_nextn_predict_layers", "n_group", "topk_group", "routed_scaling_factor")}


def _reads(rules: _Rules) -> frozenset[str]:
    """The architecture keys ``rules`` read (the tells it does not misread)."""
    head_dim = ("head_dim",) if rules.head_dim != "none" else ()
    return frozenset((rules.activation[0], rules.ffn, *head_dim, *_KV_KEYS[rules.kv_heads],
                      *_WINDOW_KEYS[rules.window], *_MOE_KEYS[rules.moe], *rules.elementwise))


# Keys that mark an architecture (read by some family's rules, or the parallel-residual, partial
# rotary and linear-attention keys of families not supported here).
_TELLS = frozenset().union(*map(_reads, _RULES.values())) | {
    "use_parallel_residual", "parallel_attn", "parallel_residual", "rotary_pct", "rotary_dim", "partial_rotary_factor",
    "hidden_activation", "activation", "layer_types", "sliding_window_pattern", "full_attention_interval",
    "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention",
}


def _is_tell(key: str) -> bool:
    return key in _TELLS or key.startswith(("linear_", "moe_")) or key.endswith("_lora_rank") or "expert" in key


def _own_family(model_type: Any) -> str | None:
    if not isinstance(model_type, str):
        return None
    return model_type if model_type in _RULES else _HF_TEXT_MODEL_TYPES.get(model_type)


# Qwen3-Next's Gated DeltaNet sizes, HF name -> TransformerConfig field.
_HF_LINEAR_KEYS = {"linear_num_key_heads": "linear_num_key_heads", "linear_num_value_heads": "linear_num_value_heads",
                   "linear_key_head_dim": "linear_key_head_dim", "linear_value_head_dim": "linear_value_head_dim",
                   "linear_conv_kernel_dim": "linear_conv_kernel_dim"}


def hf_family_of(hf: Mapping[str, Any], family: str | None = None) -> str:
    """The family whose rules read ``hf`` (a text decoder's keys): ``family`` (--hf-family, checked
    against the file), else its model_type's."""
    return _hf_family(hf, family)


def _hf_family(hf: Mapping[str, Any], family: str | None) -> str:
    if family is not None:
        _check_override(hf, family)
        return family
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"{HF_SOURCE}: missing 'model_type' (one of {', '.join(HF_FAMILIES)}); "
                         "or name the family with --hf-family")
    if not isinstance(model_type, str):
        raise ValueError(f"{HF_SOURCE}: 'model_type' must be a string, got {show(model_type)}")
    own = _own_family(model_type)
    if own is not None:
        return own
    raise ValueError(
        f"{HF_SOURCE}: model_type {show(model_type)} is not supported (supported: {', '.join(HF_FAMILIES)}, "
        f"and the text decoders of {', '.join(sorted(k for k in _HF_TEXT_MODEL_TYPES if not k.endswith('_text')))}); "
        "--hf-family FAMILY prices it with that family's rules when the file shows no other architecture"
    )


def _check_override(hf: Mapping[str, Any], family: str) -> None:
    """Refuse ``family``'s rules for a file that shows another architecture: a supported
    ``model_type`` whose rules differ, a key that ``family`` does not read but another family's
    rules do (or a linear-attention, latent or expert key), another activation, partial rotary."""
    rules = _RULES[family]
    where = f"{HF_SOURCE}: --hf-family {family}"
    own = _own_family(hf.get("model_type"))
    if own is not None:
        if _RULES[own] != rules:
            raise ValueError(f"{where}: the file's model_type {hf['model_type']!r} is supported and built "
                             f"differently ({own}'s rules price it exactly): drop --hf-family")
        return
    reads = _reads(rules)
    tells = [k for k, v in hf.items() if v is not None and isinstance(k, str) and k not in reads and _is_tell(k)]
    if tells:
        more = f" and {len(tells) - 4} more" if len(tells) > 4 else ""
        raise ValueError(f"{where}: the file's {', '.join(map(repr, tells[:4]))}{more} {'mark' if len(tells) > 1 else 'marks'} another architecture, "
                         f"which {family}'s rules would ignore (a wrong estimate); describe the model in "
                         "megatron-core fields")
    key, default = rules.activation
    if hf.get(key) is not None and hf[key] != default:
        raise ValueError(f"{where}: the file's {key}={show(hf[key])} differs from {family}'s {default!r}: "
                         f"another architecture (its MLP may not be {'gated' if rules.gated else 'plain'}); "
                         "describe the model in megatron-core fields")
    if "partial_rotary_factor" not in reads:
        for name in ("rope_parameters", "rope_scaling"):
            rope = hf.get(name)
            if isinstance(rope, Mapping) and rope.get("partial_rotary_factor") not in (None, 1, 1.0):
                raise ValueError(f"{where}: the file's {name}.partial_rotary_factor marks another architecture "
                                 "(partial rotary); describe the model in megatron-core fields")


def hf_to_mcore(hf: Mapping[str, Any], *, family: str | None = None) -> dict[str, Any]:
    """Translate Hugging Face config keys to TransformerConfig field names with ``family``'s rules
    (as transformers' modeling code reads them); every key is type-checked under its HF name."""
    family = _hf_family(hf, family)
    rules = _RULES[family]
    f = Fields(hf, f"{HF_SOURCE} ({family})", {})
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"]
    required += [rules.ffn] if rules.ffn == "intermediate_size" else []
    required += ["num_key_value_heads"] if rules.kv_heads == "fixed" else []
    required += ["head_dim"] if rules.head_dim == "fixed" else []
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise f.missing(missing)
    if f.boolean("use_bidirectional_attention"):
        raise f.error("use_bidirectional_attention=true: a bidirectional encoder, not a causal decoder")
    num_layers = f.integer("num_hidden_layers")
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    out: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": _kv_heads(f, rules, heads),
        # NB: falcon's ffn_hidden_size defaults to 4 x hidden_size.
        "ffn_hidden_size": f.integer(rules.ffn, default=4 * hidden),
        "vocab_size": f.integer("vocab_size"),
        "share_embeddings_and_output_weights": f.boolean("tie_word_embeddings", rules.tied),
        "activation_func": hf.get(rules.activation[0]) or rules.activation[1],
        # gate_proj/up_proj/down_proj (gated) or up/down (plain), as the family builds it.
        "gated_linear_unit": rules.gated,
        # NB: a Hugging Face vocab_size is the embedding as built: padded only on request.
        "make_vocab_size_divisible_by": f.integer("make_vocab_size_divisible_by", default=1),
        "tensor_model_parallel_size": f.integer("tensor_model_parallel_size", default=1),
    }
    if rules.head_dim != "none" and hf.get("head_dim") is not None:
        out["kv_channels"] = f.integer("head_dim")
    if rules.moe == "deepseek":
        _hf_deepseek(f, out, num_layers)
    elif rules.moe != "none":
        _hf_moe(f, out, family, num_layers)
    if rules.mixer == "qwen3_next":
        _hf_qwen3_next(f, out, num_layers)
    elif rules.mixer == "dsa":
        _hf_dsa(f, out, num_layers)
    elif rules.mixer == "kimi_linear":
        _hf_kimi_linear(f, out, num_layers)
    else:
        _hf_window(f, out, rules, num_layers)
    return out


def _kv_heads(f: Fields, rules: _Rules, heads: int) -> int:
    """Key/value heads as the family's attention builds them."""
    if rules.kv_heads == "none":
        return heads
    if rules.kv_heads == "falcon":
        # Falcon: query_key_value is [h, (heads + 2 * kv) * d] with kv = num_kv_heads under the new
        # decoder architecture, 1 under multi_query (the default), else every head.
        if f.boolean("new_decoder_architecture"):
            return f.opt_integer("num_kv_heads") or heads
        return 1 if f.boolean("multi_query", True) else heads
    return f.opt_integer("num_key_value_heads") or heads


def _hf_kimi_linear(f: Fields, out: dict[str, Any], num_layers: int) -> None:
    """Kimi Linear: Kimi Delta Attention where ``layer_types`` says ``linear_attention``, MLA (as
    DeepSeek's keys give it) elsewhere; MoE where ``mlp_layer_types`` says ``sparse``, with
    ``n_shared_experts`` shared experts of ``moe_intermediate_size``, no shared gate."""
    hf = f.fields
    # transformers' attribute_map: the file may spell each of these either way.
    experts, topk_key, shared = (_experts_key(hf, keys) for keys in (
        ("num_experts", "num_local_experts"), ("num_experts_per_token", "num_experts_per_tok"),
        ("num_shared_experts", "n_shared_experts")))
    required = ["layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                experts, topk_key, "moe_intermediate_size", shared, "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim"]
    missing = [k for k in required if hf.get(k) is None]
    if "q_lora_rank" not in hf:
        missing.append("q_lora_rank")  # null is allowed: a plain q_proj.
    if missing:
        raise f.missing(missing)
    flags = {}
    for key, kinds in (("layer_types", ("linear_attention", "full_attention")), ("mlp_layer_types", ("sparse", "dense"))):
        types = hf[key]
        if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
            raise f.error(f"{key!r} must list {' or '.join(map(repr, kinds))} for each of the {num_layers} layers, "
                          f"got {show(types)}")
        flags[key] = FlagRuns(merged(((t == kinds[0], len(list(g))) for t, g in itertools.groupby(types)),
                                     f"{f.source}: {key!r}"))
    num_experts, topk, moe_ffn = f.integer(experts), f.integer(topk_key), f.integer("moe_intermediate_size")
    if topk > num_experts:
        raise f.error(f"{topk_key}={topk} > {experts}={num_experts}")
    out.update(
        kda_layers=flags["layer_types"], kda_num_heads=f.integer("linear_num_heads"),
        kda_head_dim=f.integer("linear_head_dim"), kda_conv_kernel_dim=f.integer("linear_conv_kernel_dim"),
        num_moe_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
        moe_layer_freq=flags["mlp_layer_types"],
        moe_shared_expert_intermediate_size=f.integer(shared, minimum=0) * moe_ffn,
        multi_latent_attention=True, q_lora_rank=f.opt_integer("q_lora_rank"), kv_lora_rank=f.integer("kv_lora_rank"),
        qk_head_dim=f.integer("qk_nope_head_dim"), qk_pos_emb_head_dim=f.integer("qk_rope_head_dim", minimum=0),
        v_head_dim=f.integer("v_head_dim"), num_query_groups=out["num_attention_heads"],
    )
    out.pop("kv_channels", None)


def _hf_dsa(f: Fields, out: dict[str, Any], num_layers: int) -> None:
    """DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``): DeepSeek-V3's MLA and MoE with DSA in every layer
    (``index_*`` keys), MoE layers from ``mlp_layer_types``, GLM-5's index sharing from ``indexer_types``. NB: transformers runs the indexer under ``no_grad`` (no
    indexer loss), as a model whose indexer does not train."""
    hf = f.fields
    missing = [k for k in ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank") if hf.get(k) is None]
    if missing:
        raise f.missing(missing)
    layer_types = hf.get("layer_types")
    if layer_types is not None and layer_types != ["indexed_attention"] * num_layers:
        raise f.error(f"'layer_types' must be 'indexed_attention' for each of the {num_layers} layers, "
                      f"got {show(layer_types)}")
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is not None:
        kinds = ("dense", "sparse")
        if not isinstance(mlp_types, list) or len(mlp_types) != num_layers or any(t not in kinds for t in mlp_types):
            raise f.error(f"'mlp_layer_types' must list 'dense' or 'sparse' for each of the {num_layers} layers, "
                          f"got {show(mlp_types)}")
        out["moe_layer_freq"] = FlagRuns(merged(((t == "sparse", len(list(g))) for t, g in itertools.groupby(mlp_types)),
                                                f"{f.source}: 'mlp_layer_types'"))
    indexer_types = hf.get("indexer_types")
    if indexer_types is not None:  # GLM-5: "shared" layers reuse the previous "full" layer's top-k.
        kinds = ("full", "shared")
        if (not isinstance(indexer_types, list) or len(indexer_types) != num_layers
                or any(t not in kinds for t in indexer_types) or indexer_types[0] != "full"):
            raise f.error(f"'indexer_types' must list 'full' or 'shared' for each of the {num_layers} layers, the "
                          f"first 'full', got {show(indexer_types)}")
        out["dsa_indexer_layers"] = FlagRuns(merged(((t == "full", len(list(g))) for t, g in itertools.groupby(indexer_types)),
                                                    f"{f.source}: 'indexer_types'"))
    out.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=f.integer("index_n_heads"),
               dsa_indexer_head_dim=f.integer("index_head_dim"), dsa_indexer_topk=f.integer("index_topk"))


def _hf_qwen3_next(f: Fields, out: dict[str, Any], num_layers: int) -> None:
    """Qwen3-Next: Gated DeltaNet layers where ``layer_types`` says ``linear_attention``, gated
    softmax attention (q_proj doubled for the output gate) elsewhere; no sliding window."""
    hf = f.fields
    missing = [k for k in (*_HF_LINEAR_KEYS, "layer_types") if hf.get(k) is None]
    if missing:
        raise f.missing(missing)
    for key, field in _HF_LINEAR_KEYS.items():
        out[field] = f.integer(key)
    layer_types = hf["layer_types"]
    kinds = ("linear_attention", "full_attention")
    if not isinstance(layer_types, list) or any(not isinstance(t, str) or t not in kinds for t in layer_types):
        raise f.error(f"'layer_types' must be a list of {' or '.join(map(repr, kinds))}, got {show(layer_types)}")
    if len(layer_types) != num_layers:
        raise f.error(f"'layer_types' has {len(layer_types)} entries but num_hidden_layers={num_layers}")
    out["experimental_attention_variant"] = "gated_delta_net"
    out["linear_attention_freq"] = FlagRuns(merged(
        ((t == "linear_attention", len(list(g))) for t, g in itertools.groupby(layer_types)), f"{f.source}: 'layer_types'"))
    out["attention_output_gate"] = True


def _experts_key(hf: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    """The first of ``keys`` the file sets (transformers' ``attribute_map`` aliases), else the first."""
    return next((k for k in keys if hf.get(k) is not None), keys[0])


def _hf_moe(f: Fields, out: dict[str, Any], family: str, num_layers: int) -> None:
    hf = f.fields
    experts_key = _experts_key(hf, ("num_experts", "num_local_experts"))
    required = [experts_key, "num_experts_per_tok"] + (["moe_intermediate_size"] if family != "mixtral" else [])
    if family in ("qwen2_moe", "qwen3_next"):
        required.append("shared_expert_intermediate_size")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise f.missing(missing)
    num_experts = f.integer(experts_key, minimum=0)
    if num_experts == 0:  # Qwen: no experts, every layer dense.
        return
    topk = f.integer("num_experts_per_tok")
    if topk > num_experts:
        raise f.error(f"num_experts_per_tok={topk} > {experts_key}={num_experts}")
    out["num_moe_experts"] = num_experts
    out["moe_router_topk"] = topk
    out["moe_ffn_hidden_size"] = f.integer("intermediate_size" if family == "mixtral" else "moe_intermediate_size")
    if family == "mixtral":
        return
    if family in ("qwen2_moe", "qwen3_next"):
        out["moe_shared_expert_intermediate_size"] = f.integer("shared_expert_intermediate_size")
        # Qwen2-MoE and Qwen3-Next scale the shared expert by a sigmoid gate: one [T, h] @ [h, 1] GEMM.
        out["moe_shared_expert_gate"] = True
    # Qwen: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    step = f.integer("decoder_sparse_step", default=1)
    flags = cycle(((False, step - 1), (True, 1)), num_layers, f"{f.source}: 'decoder_sparse_step'")
    mlp_only = [] if hf.get("mlp_only_layers") is None else hf["mlp_only_layers"]
    if not isinstance(mlp_only, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in mlp_only
    ):
        raise f.error(f"'mlp_only_layers' must be a list of layer indices in [0, {num_layers}), got {show(mlp_only)}")
    out["moe_layer_freq"] = FlagRuns(cleared(flags, sorted(set(mlp_only)), f.source))


def _hf_deepseek(f: Fields, out: dict[str, Any], num_layers: int) -> None:
    hf = f.fields
    experts_key = _experts_key(hf, ("n_routed_experts", "num_local_experts", "num_experts"))
    required = [experts_key, "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "first_k_dense_replace", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    missing = [k for k in required if hf.get(k) is None and not (k == "n_shared_experts" and k in hf)]
    if "q_lora_rank" not in hf:
        missing.append("q_lora_rank")  # null is allowed (DeepSeek-V2-Lite): a plain q_proj.
    if missing:
        raise f.missing(missing)
    freq = f.integer("moe_layer_freq", default=1)
    if freq != 1:
        # NB: transformers makes every layer from first_k_dense_replace on an MoE layer, DeepSeek's own
        # modeling code only every moe_layer_freq-th: the file does not say which one trains.
        raise f.error(f"moe_layer_freq={freq}: transformers ignores it (every layer from first_k_dense_replace "
                      "on is MoE) while DeepSeek's remote code places MoE layers every moe_layer_freq-th; set it "
                      "to 1 for transformers' placement, or describe the model in megatron-core fields")
    first_dense = f.integer("first_k_dense_replace", minimum=0)
    if first_dense > num_layers:
        raise f.error(f"first_k_dense_replace={first_dense} > num_hidden_layers={num_layers}")
    num_experts = f.integer(experts_key)
    topk = f.integer("num_experts_per_tok")
    if topk > num_experts:
        raise f.error(f"num_experts_per_tok={topk} > {experts_key}={num_experts}")
    moe_ffn = f.integer("moe_intermediate_size")
    out.update(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_layer_freq=FlagRuns(merged(((False, first_dense), (True, num_layers - first_dense)), f.source)),
        multi_latent_attention=True,
        q_lora_rank=f.opt_integer("q_lora_rank"),
        kv_lora_rank=f.integer("kv_lora_rank"),
        qk_head_dim=f.integer("qk_nope_head_dim"),
        qk_pos_emb_head_dim=f.integer("qk_rope_head_dim", minimum=0),
        v_head_dim=f.integer("v_head_dim"),
    )
    shared = f.opt_integer("n_shared_experts", minimum=0)
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared * moe_ffn
    # MLA has no key/value groups: num_key_value_heads (and head_dim) shape no GEMM.
    out.pop("kv_channels", None)
    out["num_query_groups"] = out["num_attention_heads"]
    # NB: num_nextn_predict_layers (DeepSeek-V3's MTP module) is not counted: transformers never runs
    # it; ModelOptions.mtp_num_layers (--mtp-num-layers) counts MTP layers as Megatron-LM trains them.


def _hf_window(f: Fields, out: dict[str, Any], rules: _Rules, num_layers: int) -> None:
    """Sliding windows as each family's modeling code applies them.

    NB: HF's window of W tokens includes the query itself (q - k < W): megatron's (W - 1, 0).
    """
    hf = f.fields
    if rules.window == "none":
        return
    if rules.window in ("every", "every_required"):
        if rules.window == "every_required" and "sliding_window" not in hf:
            raise f.error("missing required key 'sliding_window' (null for none; transformers' default is 4096)")
        size = f.opt_integer("sliding_window")
        if size is not None:
            out["window_size"] = (size - 1, 0)  # every layer
        return
    if rules.window == "layer_types":
        _hf_layer_types_window(f, out, rules, num_layers)
        return
    if not f.boolean("use_sliding_window"):
        return
    size = f.opt_integer("sliding_window", minimum=0)
    if not size:
        return
    out["window_size"] = (size - 1, 0)
    if rules.window == "qwen3_moe":
        return  # every layer
    if hf.get("layer_types") is not None:
        flags = _layer_type_flags(f, num_layers)
    else:
        if hf.get("max_window_layers") is None:
            raise f.error("missing required key 'max_window_layers' (use_sliding_window is true)")
        boundary = min(f.integer("max_window_layers", minimum=0), num_layers)
        if rules.window == "qwen2_moe":
            # Layers i < max_window_layers with (i + 1) % 2 != 0 (the even ones) slide.
            flags = cycle(((True, 1), (False, 1)), boundary, f"{f.source}: 'max_window_layers'")
            flags = merged(flags + ((False, num_layers - boundary),), f.source)
        else:
            flags = merged(((False, boundary), (True, num_layers - boundary)), f.source)
    out["window_attn_skip_freq"] = FlagRuns(flags)


def _hf_layer_types_window(f: Fields, out: dict[str, Any], rules: _Rules, num_layers: int) -> None:
    """Gemma 2/3, OLMo 3: ``layer_types``, by default every ``period``-th layer global and the
    others sliding (Gemma 3's period is ``sliding_window_pattern``, default 6)."""
    hf = f.fields
    if hf.get("layer_types") is not None:
        flags = _layer_type_flags(f, num_layers)
    else:
        period = rules.window_period
        if rules.window_pattern_key is not None:
            period = f.integer(rules.window_pattern_key, default=period)
        flags = cycle(((True, period - 1), (False, 1)), num_layers, f"{f.source}: 'sliding_window_pattern'")
    if not any(flag for flag, _ in flags):
        return
    if "sliding_window" not in hf:
        raise f.error("missing required key 'sliding_window' (null for none; transformers' default is 4096)")
    size = f.opt_integer("sliding_window")
    if size is None:
        return  # sliding layers without a window attend to every earlier token
    out["window_size"] = (size - 1, 0)
    out["window_attn_skip_freq"] = FlagRuns(flags)


def _layer_type_flags(f: Fields, num_layers: int) -> tuple[tuple[Any, int], ...]:
    """``layer_types`` as runs of sliding (True) and full (False) layers."""
    layer_types = f.fields["layer_types"]
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or any(not isinstance(t, str) or t not in kinds for t in layer_types):
        raise f.error(f"'layer_types' must be a list of {' or '.join(map(repr, kinds))}, got {show(layer_types)}")
    flags = merged(((t == "sliding_attention", len(list(g))) for t, g in itertools.groupby(layer_types)),
                   f"{f.source}: 'layer_types'")
    if length(flags) != num_layers:
        raise f.error(f"'layer_types' has {len(layer_types)} entries but num_hidden_layers={num_layers}")
    return flags
