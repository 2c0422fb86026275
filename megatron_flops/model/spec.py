"""Model description: the architecture facts that FLOPs depend on (stdlib only).

A :class:`ModelSpec` is built from a megatron-core ``TransformerConfig`` (duck-typed: no import),
a Megatron-LM ``args`` namespace, a mapping of ``TransformerConfig`` field names (JSON/YAML), or a
Hugging Face ``config.json``. Every constructor funnels into one validating builder that speaks
``TransformerConfig`` field names (and names each field as its source spells it in errors), so
the rules live in one place. Repeated layers are stored as runs, never one entry per layer.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_flops.model.inputs import Fields, read_document, show
from megatron_flops.model._layout import Runs, layer_flags, merged, zip_runs
from megatron_flops.model._mcore_fields import TRANSFORMER_CONFIG_FIELDS
from megatron_flops.model.hf_config import HF_FAMILIES, HF_NAMES, HF_SOURCE, hf_text_config, hf_to_mcore, is_hf_config

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

_HYBRID_SYMBOLS = {"M": ("mamba", "none"), "*": ("attention", "none"), "-": ("none", "mlp"), "E": ("none", "moe")}


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

    ``layer_runs`` lists the decoder sub-layers in order as runs ``((mixer, ffn), count)`` of
    consecutive layers of one kind, with mixer in ``attention``/``window``/``mamba``/``none`` and
    ffn in ``mlp``/``moe``/``none``: a 32-layer GPT is ``((("attention", "mlp"), 32),)``, a hybrid
    ``M`` symbol is ``("mamba", "none")``.
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
    layer_runs: tuple[tuple[tuple[str, str], int], ...]
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
        return sum(count for _, count in self.layer_runs)

    @property
    def layers(self) -> tuple[tuple[str, str], ...]:
        """One ``(mixer, ffn)`` per decoder layer (expands the runs: for inspecting small models)."""
        return tuple(itertools.chain.from_iterable(itertools.repeat(kind, n) for kind, n in self.layer_runs))

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_mapping(
        cls, fields: Mapping[str, Any], *, source: str = "model file", options: ModelOptions | None = None
    ) -> ModelSpec:
        """Build from ``TransformerConfig`` field names plus ``vocab_size`` (JSON/YAML files)."""
        unknown = [k for k in fields if k not in TRANSFORMER_CONFIG_FIELDS and k not in _EXTRA_KEYS]
        if unknown:
            raise ValueError(f"{source}: {_unknown_keys_message(unknown)}")
        return _build(_with_options(dict(fields), options), source=source)

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
    def from_megatron_args(
        cls, args: Any, *, source: str = "Megatron-LM args", options: ModelOptions | None = None,
        option_names: bool = False,
    ) -> ModelSpec:
        """Build from a Megatron-LM ``args`` namespace (``megatron.training.get_args()``), with
        Megatron-LM's own rules: grouped-query attention only with ``group_query_attention``, a
        gated SiLU MLP with ``swiglu``, experts from ``num_experts``, and ``validate_args``'
        defaults for ``ffn_hidden_size``. ``option_names``: name fields as ``--options`` in errors."""
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
        elif get("quick_geglu"):
            fields["gated_linear_unit"] = True
            fields["activation_func"] = "quick_gelu"
        else:
            fields["activation_func"] = "gelu"
        hidden = get("hidden_size")
        if get("ffn_hidden_size") is None and isinstance(hidden, int) and not isinstance(hidden, bool):
            # validate_args: a SwiGLU MLP keeps ~4h parameters: 2/3 of 4h, rounded down to 64.
            fields["ffn_hidden_size"] = (8 * hidden // 3) // 64 * 64 if get("swiglu") else 4 * hidden
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
        names = dict(_MLM_NAMES)
        if option_names:
            names = {k: "--" + names.get(k, k).replace("_", "-") for k in _ALL_FIELD_NAMES}
        if fields["vocab_size"] is None:
            raise ValueError(f"{source}: the vocabulary size is unknown: give {names.get('vocab_size', 'vocab_size')!r} "
                             "(the tokenizer's vocabulary before padding)")
        return _build(_with_options(fields, options), source=source, names=names)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, options: ModelOptions | None = None) -> ModelSpec:
        """Build from a Hugging Face ``config.json`` with the rules of its ``model_type``
        (:data:`HF_FAMILIES`, and the text decoders of Qwen2-VL/2.5-VL/3-VL). ``vocab_size`` is
        the embedding as built: no padding unless the file or ``options`` asks for it."""
        options = options or ModelOptions()
        fields = hf_to_mcore(config, family=options.hf_family)
        return _build(_with_options(fields, options), source=HF_SOURCE, names=HF_NAMES)


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Choices a model file leaves open (the CLI's flags).

    ``hf_family``: price a Hugging Face file with this family's rules whatever its ``model_type``;
    ``vocab_multiple``: pad the vocabulary to a multiple of this (1: no padding), overriding the
    file; ``mtp_num_layers``: multi-token-prediction layers trained, overriding the file.
    """

    hf_family: str | None = None
    vocab_multiple: int | None = None
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.hf_family is not None and self.hf_family not in HF_FAMILIES:
            raise ValueError(f"unknown Hugging Face family {self.hf_family!r}; known: {', '.join(HF_FAMILIES)}")
        for name, minimum in (("vocab_multiple", 1), ("mtp_num_layers", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"{name} must be an integer >= {minimum}, got {show(value)}")


def load_model_file(
    path: str | Path, *, options: ModelOptions | None = None
) -> tuple[ModelSpec | None, dict[str, Any]]:
    """Read a JSON/YAML model file; return the decoder spec (None for a vision-only or DiT-only
    file) and the raw mapping (vision and other sections are read by their own modules)."""
    path = Path(path)
    data = read_document(path, what="model file")
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: the top level must be a mapping of field names, got {type(data).__name__}")
    return model_from_mapping(data, source=path.name, options=options), data


def model_from_mapping(
    data: Mapping[str, Any], *, source: str, options: ModelOptions | None = None
) -> ModelSpec | None:
    """Dispatch a mapping to the Hugging Face or the megatron-core reader; None when it holds
    only a vision tower or a DiT (``"dit"``)."""
    if is_hf_config(data):
        text = hf_text_config(data)
        if text is None:
            return None
        return ModelSpec.from_hf_config(text, options=options)
    if "dit" in data:
        return None  # a DiT model file (dit_passes.dit_setup reads it)
    decoder = {k: v for k, v in data.items() if k not in ("vision_config", "vision", "lora")}
    if not decoder and ("vision_config" in data or "vision" in data):
        return None
    return ModelSpec.from_mapping(decoder, source=source, options=options)


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
_ALL_FIELD_NAMES = _CONFIG_FIELDS_READ + (
    "activation_func", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
    "tensor_model_parallel_size", "share_embeddings_and_output_weights", "hybrid_override_pattern",
)
# How Megatron-LM's args name the fields whose names differ from TransformerConfig's.
_MLM_NAMES = {"num_moe_experts": "num_experts", "gated_linear_unit": "swiglu", "activation_func": "swiglu",
              "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights"}


def _unknown_keys_message(unknown: list[str]) -> str:
    from megatron_flops.model import _mlm_args

    mlm = [k for k in unknown if k in _mlm_args.DESTS]
    if mlm:
        what = ("is a Megatron-LM argument, not a TransformerConfig field" if len(mlm) == 1
                else "are Megatron-LM arguments, not TransformerConfig fields")
        return f"{', '.join(repr(k) for k in mlm[:3])} {what}: read an args dump with --megatron-args FILE"
    known = sorted(TRANSFORMER_CONFIG_FIELDS | _EXTRA_KEYS)
    hints = []
    for key in unknown[:5]:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75) if isinstance(key, str) else []
        hints.append(show(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return f"unknown key(s) {', '.join(hints)}{more}"


def _activation_name(func: Any) -> str:
    if func is None:
        return "gelu"
    if isinstance(func, str):
        return func
    name = getattr(func, "__name__", None) or type(func).__name__
    return name.lower()


def _with_options(fields: dict[str, Any], options: ModelOptions | None) -> dict[str, Any]:
    if options is None:
        return fields
    if options.vocab_multiple is not None:
        fields.pop("padded_vocab_size", None)
        fields["make_vocab_size_divisible_by"] = options.vocab_multiple
        fields["tensor_model_parallel_size"] = 1
    if options.mtp_num_layers is not None:
        fields["mtp_num_layers"] = options.mtp_num_layers
    return fields


# ---- the one builder ------------------------------------------------------------------------


def _build(fields: dict[str, Any], *, source: str, names: Mapping[str, str] | None = None) -> ModelSpec:
    f = Fields(fields, source, names or {})
    if fields.get("experimental_attention_variant"):
        raise f.error(f"experimental_attention_variant={show(fields['experimental_attention_variant'])} "
                      "is not supported")
    hidden = f.integer("hidden_size")
    heads, groups, kv_channels = _attention_heads(f, hidden)
    ffn = f.opt_integer("ffn_hidden_size") or 4 * hidden
    activation, gated = _activation(f)
    vocab, padded_vocab = _vocabulary(f)
    moe = _moe_spec(f, ffn)
    mla = _mla_spec(f)
    window = _window(f)
    layer_runs, mamba = _layers(f, hidden, moe, window)
    mtp = f.opt_integer("mtp_num_layers", minimum=0) or 0
    tied = _tied_output(f)
    last_ffn = layer_runs[-1][0][1]
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
        layer_runs=layer_runs,
        attention_output_gate=f.boolean("attention_output_gate"),
        window_size=window,
        moe=moe,
        mla=mla,
        mamba=mamba,
        mtp_num_layers=mtp,
        # MTP layers copy the last decoder layer's kind, as Megatron-LM counts them.
        mtp_ffn=last_ffn if last_ffn != "none" else "mlp",
        tied_output=tied,
    )


def _attention_heads(f: Fields, hidden: int) -> tuple[int, int, int]:
    """(attention heads, query groups, channels per head)."""
    heads = f.integer("num_attention_heads")
    groups = f.opt_integer("num_query_groups") or heads
    if heads % groups:
        raise f.error(f"{f.name('num_query_groups')}={groups} does not divide "
                      f"{f.name('num_attention_heads')}={heads}")
    kv_channels = f.opt_integer("kv_channels")
    if kv_channels is None:
        if hidden % heads:
            raise f.error(f"{f.name('num_attention_heads')}={heads} does not divide {f.name('hidden_size')}="
                          f"{hidden} and {f.name('kv_channels')} is not given")
        kv_channels = hidden // heads
    return heads, groups, kv_channels


def _activation(f: Fields) -> tuple[str, bool]:
    """(the MLP's activation, whether it is gated)."""
    activation = f.fields.get("activation_func", "gelu")
    if not isinstance(activation, str) or activation.lower() not in _ACTIVATIONS:
        raise f.error(f"unknown {f.name('activation_func')} {show(activation)}; known: {', '.join(sorted(_ACTIVATIONS))}")
    activation = activation.lower()
    return activation, f.boolean("gated_linear_unit") or _ACTIVATIONS[activation]


def _vocabulary(f: Fields) -> tuple[int, int]:
    """(the vocabulary, padded as Megatron pads it: to a multiple of make_vocab_size_divisible_by x TP)."""
    vocab = f.integer("vocab_size")
    if f.fields.get("padded_vocab_size") is not None:
        padded_vocab = f.integer("padded_vocab_size")
        if padded_vocab < vocab:
            raise f.error(f"{f.name('padded_vocab_size')}={padded_vocab} < {f.name('vocab_size')}={vocab}")
        return vocab, padded_vocab
    multiple = f.integer("make_vocab_size_divisible_by", default=128) * f.integer("tensor_model_parallel_size", default=1)
    return vocab, -(-vocab // multiple) * multiple


def _mla_spec(f: Fields) -> MLASpec | None:
    if not f.boolean("multi_latent_attention"):
        return None
    return MLASpec(
        q_lora_rank=f.opt_integer("q_lora_rank"),
        kv_lora_rank=f.opt_integer("kv_lora_rank") or 512,
        qk_head_dim=f.opt_integer("qk_head_dim") or 128,
        qk_pos_emb_head_dim=f.integer("qk_pos_emb_head_dim", minimum=0, default=64),
        v_head_dim=f.opt_integer("v_head_dim") or 128,
    )


def _tied_output(f: Fields) -> bool:
    """Whether the output layer shares the embedding's weights."""
    if f.fields.get("share_embeddings_and_output_weights") is not None:
        return f.boolean("share_embeddings_and_output_weights")
    return not f.boolean("untie_embeddings_and_output_weights")


def _moe_spec(f: Fields, ffn: int) -> MoESpec | None:
    num_experts = f.opt_integer("num_moe_experts")
    if num_experts is None:
        freq = f.fields.get("moe_layer_freq")
        if freq is not None and freq != 1:
            raise f.error(f"{f.name('moe_layer_freq')!r} places MoE layers but {f.name('num_moe_experts')!r} "
                          "is not set")
        return None
    topk = f.opt_integer("moe_router_topk") or 2
    if topk > num_experts:
        raise f.error(f"{f.name('moe_router_topk')}={topk} > {f.name('num_moe_experts')}={num_experts}")
    return MoESpec(
        num_experts=num_experts,
        router_topk=topk,
        ffn_hidden_size=f.opt_integer("moe_ffn_hidden_size") or ffn,
        shared_expert_ffn_hidden_size=f.opt_integer("moe_shared_expert_intermediate_size") or 0,
        shared_expert_gate=f.boolean("moe_shared_expert_gate"),
        latent_size=f.opt_integer("moe_latent_size"),
    )


def _window(f: Fields) -> int | None:
    window_size = f.fields.get("window_size")
    name = f.name("window_size")
    if window_size is None:
        if f.fields.get("window_attn_skip_freq") is not None:
            raise f.error(f"{f.name('window_attn_skip_freq')!r} needs {name!r}")
        return None
    if not isinstance(window_size, (list, tuple)) or len(window_size) != 2:
        raise f.error(f"{name} must be a pair (left, right), got {show(window_size)}")
    left, right = window_size
    if (isinstance(right, bool) or right not in (0, -1) or not isinstance(left, int) or isinstance(left, bool)
            or left < -1):
        raise f.error(f"{name}={show(list(window_size))}: only causal sliding windows (left, 0) are supported")
    return None if left == -1 else left


def _layers(
    f: Fields, hidden: int, moe: MoESpec | None, window: int | None
) -> tuple[tuple[tuple[tuple[str, str], int], ...], MambaSpec | None]:
    pattern = f.fields.get("hybrid_override_pattern") or f.fields.get("hybrid_layer_pattern")
    if not pattern:
        num_layers = f.integer("num_layers")
        ffn_runs: Runs = ((False, num_layers),)
        if moe is not None:
            ffn_runs = layer_flags(f, "moe_layer_freq", f.fields.get("moe_layer_freq", 1), num_layers, every=True)
        windowed: Runs = ((False, num_layers),)
        if window is not None:
            skip = f.fields.get("window_attn_skip_freq")
            windowed = ((True, num_layers),) if skip is None else layer_flags(
                f, "window_attn_skip_freq", skip, num_layers, every=False)
        runs = zip_runs(windowed, ffn_runs)
        return tuple((("window" if w else "attention", "moe" if m else "mlp"), n) for (w, m), n in runs), None
    name = f.name("hybrid_override_pattern")
    if not isinstance(pattern, str) or set(pattern) - set(_HYBRID_SYMBOLS):
        raise f.error(f"{name} {show(pattern)} may only use the symbols {''.join(_HYBRID_SYMBOLS)}")
    given = f.fields.get("num_layers")
    if given is not None and given != len(pattern):
        raise f.error(f"{f.name('num_layers')}={show(given)} but {name} has {len(pattern)} layers")
    if "E" in pattern and moe is None:
        raise f.error(f"{name} has MoE layers ('E') but {f.name('num_moe_experts')} is unset")
    layer_runs = merged(((_HYBRID_SYMBOLS[c], len(list(g))) for c, g in itertools.groupby(pattern)),
                         f"{f.source}: {name}")
    mamba = None
    if "M" in pattern:
        d_inner = 2 * hidden
        head_dim = f.opt_integer("mamba_head_dim") or 64
        mamba = MambaSpec(
            state_dim=f.opt_integer("mamba_state_dim") or 128,
            head_dim=head_dim,
            num_groups=f.opt_integer("mamba_num_groups") or 8,
            num_heads=f.opt_integer("mamba_num_heads") or max(d_inner // head_dim, 1),
        )
    return layer_runs, mamba
