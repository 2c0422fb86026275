"""Hugging Face ``config.json`` files read as ``transformers``' modeling code reads them (stdlib
only): one rule set per supported ``model_type`` family, every key type-checked under its HF name,
and the result in ``TransformerConfig`` field names for :class:`megatron_flops.model.spec.ModelSpec`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from megatron_flops.model.inputs import Fields, show
from megatron_flops.model._layout import FlagRuns, cleared, cycle, length, merged


def is_hf_config(data: Mapping[str, Any]) -> bool:
    """A Hugging Face config names its layers ``num_hidden_layers`` or carries ``model_type``."""
    return "num_hidden_layers" in data or "model_type" in data or "text_config" in data


def hf_text_config(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The text decoder's keys of a Hugging Face config (``text_config`` of a VLM, inheriting the
    outer ``model_type``), or None for a vision-only file."""
    text = data.get("text_config")
    if text is not None:
        if not isinstance(text, Mapping):
            raise ValueError(f"{HF_SOURCE}: 'text_config' must be a mapping, got {show(text)}")
        if "model_type" not in text and "model_type" in data:
            text = {**text, "model_type": data["model_type"]}
        return text
    if "num_hidden_layers" not in data and "vision_config" in data:
        return None
    return data


HF_FAMILIES = ("deepseek_v2", "deepseek_v3", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
# VLM text decoders priced with their text family's rules.
_HF_TEXT_MODEL_TYPES = {
    "qwen2_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_5_vl_text": "qwen2",
    "qwen3_vl": "qwen3", "qwen3_vl_text": "qwen3", "qwen3_vl_moe": "qwen3_moe", "qwen3_vl_moe_text": "qwen3_moe",
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
# Keys whose Hugging Face default is a fixed size rather than derived, so a file must give them.
_HF_FIXED_KV_HEADS = ("mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _hf_family(hf: Mapping[str, Any], family: str | None) -> str:
    if family is not None:
        return family
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"{HF_SOURCE}: missing 'model_type' (one of {', '.join(HF_FAMILIES)}); "
                         "or name the family with --hf-family")
    if not isinstance(model_type, str):
        raise ValueError(f"{HF_SOURCE}: 'model_type' must be a string, got {show(model_type)}")
    if model_type in HF_FAMILIES:
        return model_type
    if model_type in _HF_TEXT_MODEL_TYPES:
        return _HF_TEXT_MODEL_TYPES[model_type]
    raise ValueError(
        f"{HF_SOURCE}: model_type {show(model_type)} is not supported (supported: {', '.join(HF_FAMILIES)}, "
        f"and the text decoders of {', '.join(sorted(k for k in _HF_TEXT_MODEL_TYPES if not k.endswith('_text')))}); "
        "--hf-family FAMILY prices it with that family's rules, ignoring whatever else differs"
    )


def hf_to_mcore(hf: Mapping[str, Any], *, family: str | None = None) -> dict[str, Any]:
    """Translate Hugging Face config keys to TransformerConfig field names with ``family``'s rules
    (as transformers' modeling code reads them); every key is type-checked under its HF name."""
    family = _hf_family(hf, family)
    f = Fields(hf, f"{HF_SOURCE} ({family})", {})
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"]
    if family in _HF_FIXED_KV_HEADS:
        required.append("num_key_value_heads")
    if family == "qwen3":
        required.append("head_dim")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise f.missing(missing)
    num_layers = f.integer("num_hidden_layers")
    heads = f.integer("num_attention_heads")
    out: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": f.integer("hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": f.opt_integer("num_key_value_heads") or heads,
        "ffn_hidden_size": f.integer("intermediate_size"),
        "vocab_size": f.integer("vocab_size"),
        "share_embeddings_and_output_weights": f.boolean("tie_word_embeddings"),
        "activation_func": hf.get("hidden_act") or "silu",
        # Every supported family runs a gated MLP (gate_proj/up_proj/down_proj).
        "gated_linear_unit": True,
        # NB: a Hugging Face vocab_size is the embedding as built: padded only on request.
        "make_vocab_size_divisible_by": f.integer("make_vocab_size_divisible_by", default=1),
        "tensor_model_parallel_size": f.integer("tensor_model_parallel_size", default=1),
    }
    if hf.get("head_dim") is not None:
        out["kv_channels"] = f.integer("head_dim")
    if family.startswith("deepseek"):
        _hf_deepseek(f, out, num_layers)
    elif family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        _hf_moe(f, out, family, num_layers)
    _hf_window(f, out, family, num_layers)
    return out


def _experts_key(hf: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    """The first of ``keys`` the file sets (transformers' ``attribute_map`` aliases), else the first."""
    return next((k for k in keys if hf.get(k) is not None), keys[0])


def _hf_moe(f: Fields, out: dict[str, Any], family: str, num_layers: int) -> None:
    hf = f.fields
    experts_key = _experts_key(hf, ("num_experts", "num_local_experts"))
    required = [experts_key, "num_experts_per_tok"] + (["moe_intermediate_size"] if family != "mixtral" else [])
    if family == "qwen2_moe":
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
    if family == "qwen2_moe":
        out["moe_shared_expert_intermediate_size"] = f.integer("shared_expert_intermediate_size")
        # Qwen2-MoE scales the shared expert by a sigmoid gate: one [T, h] @ [h, 1] GEMM.
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


def _hf_window(f: Fields, out: dict[str, Any], family: str, num_layers: int) -> None:
    """Sliding windows as each family's modeling code applies them.

    NB: HF's window of W tokens includes the query itself (q - k < W): megatron's (W - 1, 0).
    """
    hf = f.fields
    if family in ("llama", "deepseek_v2", "deepseek_v3"):
        return
    if family in ("mistral", "mixtral"):
        if family == "mistral" and "sliding_window" not in hf:
            raise f.error("missing required key 'sliding_window' (null for none; transformers' default is 4096)")
        size = f.opt_integer("sliding_window")
        if size is not None:
            out["window_size"] = (size - 1, 0)  # every layer
        return
    if not f.boolean("use_sliding_window"):
        return
    size = f.opt_integer("sliding_window", minimum=0)
    if not size:
        return
    out["window_size"] = (size - 1, 0)
    if family == "qwen3_moe":
        return  # every layer
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(layer_types, list) or any(not isinstance(t, str) or t not in kinds for t in layer_types):
            raise f.error(f"'layer_types' must be a list of {' or '.join(map(repr, kinds))}, got {show(layer_types)}")
        flags = merged(((t == "sliding_attention", len(list(g))) for t, g in itertools.groupby(layer_types)),
                        f"{f.source}: 'layer_types'")
        if length(flags) != num_layers:
            raise f.error(f"'layer_types' has {len(layer_types)} entries but num_hidden_layers={num_layers}")
    else:
        if hf.get("max_window_layers") is None:
            raise f.error("missing required key 'max_window_layers' (use_sliding_window is true)")
        boundary = min(f.integer("max_window_layers", minimum=0), num_layers)
        if family == "qwen2_moe":
            # Layers i < max_window_layers with (i + 1) % 2 != 0 (the even ones) slide.
            flags = cycle(((True, 1), (False, 1)), boundary, f"{f.source}: 'max_window_layers'")
            flags = merged(flags + ((False, num_layers - boundary),), f.source)
        else:
            flags = merged(((False, boundary), (True, num_layers - boundary)), f.source)
    out["window_attn_skip_freq"] = FlagRuns(flags)
