"""Model description: the architecture facts that FLOPs depend on (stdlib only).

A :class:`ModelSpec` is built from a megatron-core ``TransformerConfig`` (duck-typed: no import),
a Megatron-LM ``args`` namespace, a mapping of ``TransformerConfig`` field names (JSON/YAML), or a
Hugging Face ``config.json``. Every constructor funnels into one validating builder that speaks
``TransformerConfig`` field names, so the rules live in one place.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_flops._mcore_fields import TRANSFORMER_CONFIG_FIELDS

# Activation name -> whether the name itself implies a gated linear unit.
_ACTIVATIONS: dict[str, bool] = {
    "gelu": False,
    "gelu_new": False,
    "gelu_pytorch_tanh": False,
    "fast_gelu": False,
    "quick_gelu": False,
    "openai_gelu": False,
    "erf_gelu": False,
    "silu": False,
    "swish": False,
    "relu": False,
    "squared_relu": False,
    "relu2": False,
    "tanh": False,
    "swiglu": True,
    "geglu": True,
    "reglu": True,
}

# Keys a model file may carry beside TransformerConfig fields.
_EXTRA_KEYS = frozenset(
    {
        "vocab_size",
        "padded_vocab_size",
        "make_vocab_size_divisible_by",
        "tensor_model_parallel_size",
        "share_embeddings_and_output_weights",
        "untie_embeddings_and_output_weights",
        "hybrid_override_pattern",
        "hybrid_layer_pattern",
        "seq_length",
        "max_position_embeddings",
        "position_embedding_type",
        "model_type",
        "vision_config",
        "vision",
        "lora",
        "dit",
    }
)

_HYBRID_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """Routed experts (dropless top-k), optional shared experts and latent projections."""

    num_experts: int
    router_topk: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    latent_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3) projection sizes."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """Mamba-2 mixer sizes as megatron-core configures them (expand factor 2)."""

    state_dim: int
    head_dim: int
    num_groups: int
    num_heads: int


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only megatron-core model, as far as GEMM FLOPs are concerned.

    ``layers`` lists each decoder sub-layer in order as ``(mixer, ffn)`` with mixer in
    ``attention``/``window``/``mamba``/``none`` and ffn in ``mlp``/``moe``/``none``; a GPT layer
    is ``("attention", "mlp")``, a hybrid ``M`` symbol is ``("mamba", "none")``.
    """

    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    gated_linear_unit: bool
    activation: str
    vocab_size: int
    padded_vocab_size: int
    layers: tuple[tuple[str, str], ...]
    attention_output_gate: bool = False
    window_size: int | None = None
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    mamba: MambaSpec | None = None
    mtp_num_layers: int = 0
    mtp_ffn: str = "mlp"
    tied_output: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any], *, source: str = "model file") -> ModelSpec:
        """Build from ``TransformerConfig`` field names plus ``vocab_size`` (JSON/YAML files)."""
        unknown = [k for k in fields if k not in TRANSFORMER_CONFIG_FIELDS and k not in _EXTRA_KEYS]
        if unknown:
            known = sorted(TRANSFORMER_CONFIG_FIELDS | _EXTRA_KEYS)
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"{source}: unknown key(s) {', '.join(hints)}")
        return _build(dict(fields), source=source)

    @classmethod
    def from_transformer_config(
        cls,
        config: Any,
        *,
        vocab_size: int,
        make_vocab_size_divisible_by: int = 128,
        tensor_model_parallel_size: int | None = None,
        share_embeddings_and_output_weights: bool = True,
        hybrid_override_pattern: str | None = None,
    ) -> ModelSpec:
        """Build from a megatron-core ``TransformerConfig`` (or ``MLATransformerConfig``)."""
        fields = {name: getattr(config, name) for name in _CONFIG_FIELDS_READ if hasattr(config, name)}
        fields["activation_func"] = _activation_name(getattr(config, "activation_func", None))
        fields["vocab_size"] = vocab_size
        fields["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
        fields["tensor_model_parallel_size"] = (
            tensor_model_parallel_size
            if tensor_model_parallel_size is not None
            else getattr(config, "tensor_model_parallel_size", 1)
        )
        fields["share_embeddings_and_output_weights"] = share_embeddings_and_output_weights
        if hybrid_override_pattern is not None:
            fields["hybrid_override_pattern"] = hybrid_override_pattern
        return _build(fields, source="TransformerConfig")

    @classmethod
    def from_megatron_args(cls, args: Any) -> ModelSpec:
        """Build from a Megatron-LM ``args`` namespace (``megatron.training.get_args()``)."""
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        fields: dict[str, Any] = {
            name: get(name) for name in _CONFIG_FIELDS_READ if get(name) is not None
        }
        fields.pop("num_query_groups", None)
        if get("group_query_attention"):
            fields["num_query_groups"] = get("num_query_groups")
        if get("num_experts"):
            fields["num_moe_experts"] = get("num_experts")
        if get("swiglu"):
            fields["gated_linear_unit"] = True
            fields["activation_func"] = "silu"
        elif get("squared_relu"):
            fields["activation_func"] = "squared_relu"
        else:
            fields["activation_func"] = "gelu"
        if not get("multi_latent_attention"):
            for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                fields.pop(name, None)
        if get("padded_vocab_size") is not None:
            fields["padded_vocab_size"] = get("padded_vocab_size")
        fields["vocab_size"] = get("vocab_size") or get("padded_vocab_size")
        fields["make_vocab_size_divisible_by"] = get("make_vocab_size_divisible_by", 128)
        fields["tensor_model_parallel_size"] = get("tensor_model_parallel_size", 1)
        fields["share_embeddings_and_output_weights"] = not get("untie_embeddings_and_output_weights", False)
        pattern = get("hybrid_layer_pattern") or get("hybrid_override_pattern")
        if pattern:
            fields["hybrid_override_pattern"] = pattern
        return _build(fields, source="Megatron-LM args")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Build from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2/3, Qwen3-MoE,
        Mixtral, DeepSeek-V2/V3); other ``model_type`` values with Llama-style keys work too."""
        return _build(_hf_to_mcore(config), source="Hugging Face config")


def load_model_file(path: str | Path) -> tuple[ModelSpec | None, dict[str, Any]]:
    """Read a JSON/YAML model file; return the decoder spec (None for a vision-only or DiT-only
    file) and the raw mapping (vision and other sections are read by their own modules)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read model file {str(path)!r}: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError("YAML model files need PyYAML: pip install pyyaml") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path.name}: invalid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path.name}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: the top level must be a mapping of field names")
    return model_from_mapping(data, source=path.name), data


def model_from_mapping(data: Mapping[str, Any], *, source: str) -> ModelSpec | None:
    """Dispatch a mapping to the Hugging Face or the megatron-core reader; None when it holds
    only a vision tower or a DiT (``"dit"``)."""
    if is_hf_config(data):
        text = data.get("text_config")
        if isinstance(text, Mapping):
            return ModelSpec.from_hf_config(text)
        if "num_hidden_layers" not in data and "vision_config" in data:
            return None
        return ModelSpec.from_hf_config(data)
    if "dit" in data:
        return None  # a DiT model file (dit_passes.dit_setup reads it)
    decoder = {k: v for k, v in data.items() if k not in ("vision_config", "vision", "lora")}
    if not decoder and ("vision_config" in data or "vision" in data):
        return None
    return ModelSpec.from_mapping(decoder, source=source)


def is_hf_config(data: Mapping[str, Any]) -> bool:
    """A Hugging Face config names its layers ``num_hidden_layers`` or carries ``model_type``."""
    return "num_hidden_layers" in data or "model_type" in data or "text_config" in data


# ---- internals ------------------------------------------------------------------------------

# TransformerConfig fields that change GEMM FLOPs (read from configs and args).
_CONFIG_FIELDS_READ = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "gated_linear_unit",
    "attention_output_gate",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_latent_size",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "mtp_num_layers",
    "window_size",
    "window_attn_skip_freq",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_num_heads",
    "experimental_attention_variant",
)


def _activation_name(func: Any) -> str:
    if func is None:
        return "gelu"
    if isinstance(func, str):
        return func
    name = getattr(func, "__name__", None) or type(func).__name__
    return name.lower()


def _int(fields: Mapping[str, Any], key: str, *, source: str, minimum: int = 1) -> int:
    value = fields.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{source}: {key!r} must be >= {minimum}, got {value}")
    return value


def _opt_int(fields: Mapping[str, Any], key: str, *, source: str, minimum: int = 1) -> int | None:
    if fields.get(key) is None:
        return None
    return _int(fields, key, source=source, minimum=minimum)


_PATTERN_TERM = re.compile(r"\[\s*([01](?:\s*,\s*[01])*)\s*\](?:\s*\*\s*(\d+))?")


def _pattern_string(text: str, key: str, *, source: str) -> list[int]:
    """``"([0]*3+[1]*58)"`` or ``"[1,0,1]"`` -> a 0/1 list (the forms Megatron-LM evaluates)."""
    body = text.strip()
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1]
    flags: list[int] = []
    for term in body.split("+"):
        match = _PATTERN_TERM.fullmatch(term.strip())
        if match is None:
            raise ValueError(f"{source}: {key!r} string {text!r} is not a sum of [0/1, ...]*n terms")
        flags += [int(v) for v in match[1].split(",")] * int(match[2] or 1)
    return flags


def _layer_flags(value: Any, num_layers: int, key: str, *, source: str, every: bool) -> tuple[bool, ...]:
    """An int frequency or a 0/1 list of length ``num_layers``, as megatron-core reads them.

    ``every=True``: layer i (0-based) is set when ``i % freq == 0`` (``moe_layer_freq``);
    ``every=False``: set unless ``(i + 1) % freq == 0`` (``window_attn_skip_freq``). Megatron-LM's
    command-line form, a string such as ``"([0]*3+[1]*58)"``, is read without ``eval``.
    """
    if isinstance(value, str):
        value = _pattern_string(value, key, source=source)
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise ValueError(f"{source}: {key!r} must be an integer or a list of 0/1, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{source}: {key!r} must be >= 1, got {value}")
        if every:
            return tuple(i % value == 0 for i in range(num_layers))
        return tuple((i + 1) % value != 0 for i in range(num_layers))
    if len(value) != num_layers:
        raise ValueError(
            f"{source}: {key!r} has {len(value)} entries but the model has {num_layers} layers"
        )
    if any(v not in (0, 1) or isinstance(v, float) for v in value):
        raise ValueError(f"{source}: {key!r} entries must be 0 or 1, got {list(value)!r}")
    return tuple(bool(v) for v in value)


def _build(fields: dict[str, Any], *, source: str) -> ModelSpec:
    if fields.get("experimental_attention_variant"):
        raise ValueError(
            f"{source}: experimental_attention_variant="
            f"{fields['experimental_attention_variant']!r} is not supported"
        )
    hidden = _int(fields, "hidden_size", source=source)
    heads = _int(fields, "num_attention_heads", source=source)
    groups = _opt_int(fields, "num_query_groups", source=source) or heads
    if heads % groups:
        raise ValueError(f"{source}: num_query_groups={groups} does not divide num_attention_heads={heads}")
    kv_channels = _opt_int(fields, "kv_channels", source=source)
    if kv_channels is None:
        if hidden % heads:
            raise ValueError(
                f"{source}: num_attention_heads={heads} does not divide hidden_size={hidden} "
                "and kv_channels is not given"
            )
        kv_channels = hidden // heads
    ffn = _opt_int(fields, "ffn_hidden_size", source=source) or 4 * hidden

    activation = fields.get("activation_func", "gelu")
    if not isinstance(activation, str) or activation.lower() not in _ACTIVATIONS:
        raise ValueError(
            f"{source}: unknown activation_func {activation!r}; known: {', '.join(sorted(_ACTIVATIONS))}"
        )
    activation = activation.lower()
    gated = bool(fields.get("gated_linear_unit", False)) or _ACTIVATIONS[activation]

    # Vocabulary: Megatron pads to a multiple of make_vocab_size_divisible_by x TP.
    vocab = _int(fields, "vocab_size", source=source)
    if fields.get("padded_vocab_size") is not None:
        padded_vocab = _int(fields, "padded_vocab_size", source=source)
        if padded_vocab < vocab:
            raise ValueError(f"{source}: padded_vocab_size={padded_vocab} < vocab_size={vocab}")
    else:
        multiple = _int(
            {"m": fields.get("make_vocab_size_divisible_by", 128)}, "m", source=source
        ) * _int({"t": fields.get("tensor_model_parallel_size", 1)}, "t", source=source)
        padded_vocab = -(-vocab // multiple) * multiple

    moe = None
    num_experts = _opt_int(fields, "num_moe_experts", source=source)
    if num_experts is not None:
        topk = _opt_int(fields, "moe_router_topk", source=source) or 2
        if topk > num_experts:
            raise ValueError(f"{source}: moe_router_topk={topk} > num_moe_experts={num_experts}")
        moe = MoESpec(
            num_experts=num_experts,
            router_topk=topk,
            ffn_hidden_size=_opt_int(fields, "moe_ffn_hidden_size", source=source) or ffn,
            shared_expert_ffn_hidden_size=_opt_int(
                fields, "moe_shared_expert_intermediate_size", source=source
            )
            or 0,
            shared_expert_gate=bool(fields.get("moe_shared_expert_gate", False)),
            latent_size=_opt_int(fields, "moe_latent_size", source=source),
        )

    mla = None
    if fields.get("multi_latent_attention"):
        mla = MLASpec(
            q_lora_rank=_opt_int(fields, "q_lora_rank", source=source),
            kv_lora_rank=_opt_int(fields, "kv_lora_rank", source=source) or 512,
            qk_head_dim=_opt_int(fields, "qk_head_dim", source=source) or 128,
            qk_pos_emb_head_dim=_int(fields, "qk_pos_emb_head_dim", source=source, minimum=0)
            if fields.get("qk_pos_emb_head_dim") is not None
            else 64,
            v_head_dim=_opt_int(fields, "v_head_dim", source=source) or 128,
        )

    window = None
    window_size = fields.get("window_size")
    if window_size is not None:
        if not isinstance(window_size, (list, tuple)) or len(window_size) != 2:
            raise ValueError(f"{source}: window_size must be a pair (left, right), got {window_size!r}")
        left, right = window_size
        if right not in (0, -1) or not isinstance(left, int) or isinstance(left, bool) or left < -1:
            raise ValueError(
                f"{source}: window_size={list(window_size)!r}: only causal sliding windows "
                "(left, 0) are supported"
            )
        window = None if left == -1 else left

    pattern = fields.get("hybrid_override_pattern") or fields.get("hybrid_layer_pattern")
    mamba = None
    if pattern:
        if not isinstance(pattern, str) or set(pattern) - set(_HYBRID_SYMBOLS):
            raise ValueError(
                f"{source}: hybrid_override_pattern {pattern!r} may only use the symbols "
                f"{''.join(_HYBRID_SYMBOLS)}"
            )
        if "num_layers" in fields and fields["num_layers"] != len(pattern):
            raise ValueError(
                f"{source}: num_layers={fields['num_layers']} but hybrid_override_pattern has "
                f"{len(pattern)} layers"
            )
        kinds = [_HYBRID_SYMBOLS[c] for c in pattern]
        if "moe" in kinds and moe is None:
            raise ValueError(f"{source}: hybrid pattern has MoE layers ('E') but num_moe_experts is unset")
        layers = tuple(
            {"mamba": ("mamba", "none"), "attention": ("attention", "none"), "mlp": ("none", "mlp"),
             "moe": ("none", "moe")}[k]
            for k in kinds
        )
        if "M" in pattern:
            d_inner = 2 * hidden
            head_dim = _opt_int(fields, "mamba_head_dim", source=source) or 64
            mamba = MambaSpec(
                state_dim=_opt_int(fields, "mamba_state_dim", source=source) or 128,
                head_dim=head_dim,
                num_groups=_opt_int(fields, "mamba_num_groups", source=source) or 8,
                num_heads=_opt_int(fields, "mamba_num_heads", source=source) or d_inner // head_dim,
            )
    else:
        num_layers = _int(fields, "num_layers", source=source)
        if moe is None:
            ffn_kinds = ("mlp",) * num_layers
        else:
            moe_flags = _layer_flags(
                fields.get("moe_layer_freq", 1), num_layers, "moe_layer_freq", source=source, every=True
            )
            ffn_kinds = tuple("moe" if f else "mlp" for f in moe_flags)
        if window is not None:
            skip = fields.get("window_attn_skip_freq")
            windowed = (
                (True,) * num_layers
                if skip is None
                else _layer_flags(skip, num_layers, "window_attn_skip_freq", source=source, every=False)
            )
        else:
            windowed = (False,) * num_layers
        layers = tuple(("window" if w else "attention", f) for w, f in zip(windowed, ffn_kinds))

    mtp = _opt_int(fields, "mtp_num_layers", source=source, minimum=0) or 0
    tied = fields.get("share_embeddings_and_output_weights")
    if tied is None:
        tied = not fields.get("untie_embeddings_and_output_weights", False)
    return ModelSpec(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=kv_channels,
        ffn_hidden_size=ffn,
        gated_linear_unit=gated,
        activation=activation,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab,
        layers=layers,
        attention_output_gate=bool(fields.get("attention_output_gate", False)),
        window_size=window,
        moe=moe,
        mla=mla,
        mamba=mamba,
        mtp_num_layers=mtp,
        # MTP layers copy the last decoder layer's kind, as Megatron-LM counts them.
        mtp_ffn=layers[-1][1] if layers[-1][1] != "none" else "mlp",
        tied_output=bool(tied),
    )


def _hf_to_mcore(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Translate Hugging Face config keys to TransformerConfig field names."""
    src = "Hugging Face config"
    model_type = str(hf.get("model_type", "llama"))
    num_layers = _int(hf, "num_hidden_layers", source=src)
    out: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hf.get("hidden_size"),
        "num_attention_heads": hf.get("num_attention_heads"),
        "num_query_groups": hf.get("num_key_value_heads") or hf.get("num_attention_heads"),
        "ffn_hidden_size": hf.get("intermediate_size"),
        "vocab_size": hf.get("vocab_size"),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "attention_output_gate": bool(hf.get("attn_output_gate", False)),
    }
    if hf.get("head_dim") is not None:
        out["kv_channels"] = hf["head_dim"]
    act = hf.get("hidden_act", "silu")
    out["activation_func"] = act
    # Every supported HF decoder family uses a gated MLP (gate_proj/up_proj/down_proj).
    out["gated_linear_unit"] = model_type not in ("gpt2", "gpt_neox", "opt", "bloom")

    # MoE families.
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    if num_experts:
        out["num_moe_experts"] = num_experts
        out["moe_router_topk"] = hf.get("num_experts_per_tok", 2)
        out["moe_ffn_hidden_size"] = hf.get("moe_intermediate_size") or hf.get("intermediate_size")
        shared = hf.get("shared_expert_intermediate_size")
        if hf.get("n_shared_experts"):
            shared = hf["n_shared_experts"] * hf["moe_intermediate_size"]
        if shared:
            out["moe_shared_expert_intermediate_size"] = shared
            # Qwen2-MoE scales the shared expert by a sigmoid gate: one [T, h] @ [h, 1] GEMM.
            out["moe_shared_expert_gate"] = model_type == "qwen2_moe"
        flags = [1] * num_layers
        first_dense = hf.get("first_k_dense_replace") or 0
        step = hf.get("decoder_sparse_step") or hf.get("moe_layer_freq") or 1
        mlp_only = set(hf.get("mlp_only_layers") or ())
        for i in range(num_layers):
            if i < first_dense or (i - first_dense) % step or i in mlp_only:
                flags[i] = 0
        if model_type in ("qwen2_moe", "qwen3_moe") and step > 1:
            # Qwen counts a layer sparse when (i + 1) % decoder_sparse_step == 0.
            flags = [int((i + 1) % step == 0 and i not in mlp_only) for i in range(num_layers)]
        out["moe_layer_freq"] = flags

    # Multi-latent attention (DeepSeek-V2/V3).
    if hf.get("kv_lora_rank"):
        out["multi_latent_attention"] = True
        out["q_lora_rank"] = hf.get("q_lora_rank")
        out["kv_lora_rank"] = hf["kv_lora_rank"]
        out["qk_head_dim"] = hf.get("qk_nope_head_dim")
        out["qk_pos_emb_head_dim"] = hf.get("qk_rope_head_dim")
        out["v_head_dim"] = hf.get("v_head_dim")
        out.pop("kv_channels", None)
    if hf.get("num_nextn_predict_layers"):
        out["mtp_num_layers"] = hf["num_nextn_predict_layers"]

    # Sliding windows: Mistral sets sliding_window alone; Qwen2/3 gate it by use_sliding_window
    # and keep the first max_window_layers layers on full attention.
    # NB: HF's window of W tokens includes the query itself (q - k < W): megatron's (W - 1, 0).
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", model_type in ("mistral", "mixtral")):
        out["window_size"] = (int(window) - 1, 0)
        if "max_window_layers" in hf:
            out["window_attn_skip_freq"] = [
                int(i >= hf["max_window_layers"]) for i in range(num_layers)
            ]
        elif hf.get("layer_types"):
            out["window_attn_skip_freq"] = [
                int(t == "sliding_attention") for t in hf["layer_types"]
            ]
    return {k: v for k, v in out.items() if v is not None}
