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
from megatron_flops.model._layout import Runs, cycle, layer_flags, merged, zip_runs
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
    "xielu": False,
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
        # megatron-core 0.19 TransformerConfig fields (DSA index sharing) beyond the 0.16.1 list.
        "dsa_indexer_topk_freq",
        "dsa_indexer_skip_topk_offset",
    }
)

# megatron-core 0.19's hybrid layer symbols (``hybrid_layer_allocation.Symbols``): symbol -> layer kind.
# ``*`` is a sliding-window layer where ``window_size``/``window_attn_skip_freq`` make that layer number slide.
_HYBRID_SYMBOLS = {"M": ("mamba", "none"), "G": ("gdn", "none"), "*": ("attention", "none"), "+": ("attention", "none"),
                   "D": ("dsa", "none"), "-": ("none", "mlp"), "E": ("none", "moe")}
_HYBRID_PIPE, _HYBRID_MTP = "|", "/"
# experimental_attention_variant values priced here (megatron-core spells GDN both ways) -> mixer.
LINEAR_ATTENTION_VARIANTS = ("gated_delta_net", "gdn")
ATTENTION_VARIANTS = {"gated_delta_net": "gdn", "gdn": "gdn", "dsa": "dsa"}


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
class GDNSpec:
    """Gated DeltaNet mixer sizes (megatron-core's ``linear_*`` fields; Qwen3-Next's ``linear_attn``)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int


@dataclass(frozen=True, kw_only=True)
class KDASpec:
    """Kimi Delta Attention (Kimi Linear) sizes: ``num_heads`` heads of ``head_dim`` for q, k, v."""

    num_heads: int
    head_dim: int
    conv_kernel_dim: int


@dataclass(frozen=True, kw_only=True)
class DSASpec:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a lightning indexer of ``num_heads`` heads
    of ``head_dim`` scores every causal pair; MLA attends to the ``topk`` best keys per query.
    ``trains_indexer``: ``dsa_indexer_loss_coeff > 0`` (the indexer's KL loss trains it);
    ``sparse_loss``: that loss over the selected pairs only."""

    num_heads: int
    head_dim: int
    topk: int
    trains_indexer: bool = False
    sparse_loss: bool = False


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only megatron-core model, as far as GEMM FLOPs are concerned.

    ``layer_runs`` lists the decoder sub-layers in order as runs ``((mixer, ffn), count)`` of
    consecutive layers of one kind, with mixer in ``attention``/``window``/``mamba``/``gdn``/``kda``/``dsa``/
    ``dsa_shared`` (a DSA layer reusing an earlier layer's top-k)/``none``
    and ffn in ``mlp``/``moe``/``none``: a 32-layer GPT is ``((("attention", "mlp"), 32),)``, a
    hybrid ``M`` symbol is ``("mamba", "none")``. ``mtp_layer_runs`` are the layers of one MTP
    depth (a GPT's MTP layer copies its last decoder layer; a hybrid pattern's part after ``/``).
    ``pipeline_segments``: the layer counts of a hybrid pattern's ``|``-delimited parts (megatron-core
    0.19's pipeline stages: part ``v x PP + r`` is model chunk ``v`` of pipeline rank ``r``); empty
    when the pattern has no ``|``.
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
    gdn: GDNSpec | None = None
    kda: KDASpec | None = None
    dsa: DSASpec | None = None
    mtp_num_layers: int = 0
    mtp_layer_runs: tuple[tuple[tuple[str, str], int], ...] = ((("attention", "mlp"), 1),)
    tied_output: bool = True
    pipeline_segments: tuple[int, ...] = ()

    @property
    def pair_window(self) -> int | None:
        """The band of :class:`~megatron_flops.flops.formulas.SeqStats`' window statistic: the sliding
        window, or DSA's top-k keys per query, counted as a causal band of ``topk - 1``."""
        return self.dsa.topk - 1 if self.dsa is not None else self.window_size

    @property
    def mtp_ffn(self) -> str:
        """The feed-forward kind of a (GPT) MTP layer: that of its last sub-layer with one."""
        ffns = [ffn for (_, ffn), _ in self.mtp_layer_runs if ffn != "none"]
        return ffns[-1] if ffns else "none"

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
        # NB: Megatron-LM 0.19 turns the legacy --mtp-hybrid-override-pattern P with --mtp-num-layers N
        # beside a pattern without '/' into the unified pattern's N parts "/P" (validate_args).
        legacy = (getattr(args, "_unread", {}).get("mtp_hybrid_override_pattern") or [None])[0]
        mtp = get("mtp_num_layers")
        if isinstance(pattern, str) and legacy and isinstance(mtp, int) and mtp > 0 and _HYBRID_MTP not in pattern:
            pattern += _HYBRID_MTP + _HYBRID_MTP.join([legacy] * mtp)
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
    "linear_attention_freq",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "dsa_indexer_n_heads",
    "dsa_indexer_head_dim",
    "dsa_indexer_topk",
    "dsa_indexer_loss_coeff",
    "dsa_indexer_use_sparse_loss",
    "dsa_indexer_topk_freq",
    "dsa_indexer_skip_topk_offset",
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
    variant = _attention_variant(f)
    hidden = f.integer("hidden_size")
    heads, groups, kv_channels = _attention_heads(f, hidden)
    ffn = f.opt_integer("ffn_hidden_size") or 4 * hidden
    activation, gated = _activation(f)
    vocab, padded_vocab = _vocabulary(f)
    moe = _moe_spec(f, ffn)
    mla = _mla_spec(f)
    window = _window(f)
    pattern = f.fields.get("hybrid_override_pattern") or f.fields.get("hybrid_layer_pattern")
    if pattern:
        layers = _hybrid_layers(f, pattern, moe, mla)
    else:
        layers = _gpt_layers(f, moe, window, variant)
    mamba = _mamba_spec(f, hidden) if _uses(layers, "mamba") else None
    gdn = _gdn_spec(f) if _uses(layers, "gdn") else None
    kda = KDASpec(num_heads=f.integer("kda_num_heads"), head_dim=f.integer("kda_head_dim"),
                  conv_kernel_dim=f.integer("kda_conv_kernel_dim")) if _uses(layers, "kda") else None
    dsa = _dsa_spec(f, mla, window) if _uses(layers, "dsa", "dsa_shared") else None
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
        layer_runs=layers.main,
        attention_output_gate=f.boolean("attention_output_gate"),
        window_size=window,
        moe=moe,
        mla=mla,
        mamba=mamba,
        gdn=gdn,
        kda=kda,
        dsa=dsa,
        mtp_num_layers=layers.mtp_num_layers,
        mtp_layer_runs=layers.mtp,
        tied_output=_tied_output(f),
        pipeline_segments=layers.segments,
    )


def _attention_variant(f: Fields) -> str | None:
    """``experimental_attention_variant``: None, ``"gdn"`` (Gated DeltaNet) or ``"dsa"``."""
    variant = f.fields.get("experimental_attention_variant")
    if variant is None:
        return None
    if isinstance(variant, str) and variant in ATTENTION_VARIANTS:
        return ATTENTION_VARIANTS[variant]
    raise f.error(f"{f.name('experimental_attention_variant')}={show(variant)} is not supported; supported: "
                  f"{', '.join(ATTENTION_VARIANTS)}. See docs/attention-variants.md")


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


LayerRuns = tuple[tuple[tuple[str, str], int], ...]


@dataclass(frozen=True, kw_only=True)
class _Layers:
    main: LayerRuns
    mtp_num_layers: int
    mtp: LayerRuns
    segments: tuple[int, ...] = ()  # a hybrid pattern's '|'-delimited layer counts (none: no '|')


def _uses(layers: _Layers, *mixers: str) -> bool:
    return any(kind[0] in mixers for kind, _ in layers.main + (layers.mtp if layers.mtp_num_layers else ()))


def _gpt_layers(f: Fields, moe: MoESpec | None, window: int | None, variant: str | None) -> _Layers:
    """A GPT decoder's layers: attention or windowed attention (``window_attn_skip_freq``), Gated
    DeltaNet where ``linear_attention_freq`` says so, dense or MoE MLPs (``moe_layer_freq``)."""
    num_layers = f.integer("num_layers")
    ffn_runs: Runs = ((False, num_layers),)
    if moe is not None:
        ffn_runs = layer_flags(f, "moe_layer_freq", f.fields.get("moe_layer_freq", 1), num_layers, every=True)
    windowed: Runs = ((False, num_layers),)
    if window is not None:
        skip = f.fields.get("window_attn_skip_freq")
        windowed = ((True, num_layers),) if skip is None else layer_flags(
            f, "window_attn_skip_freq", skip, num_layers, every=False)
    linear: Runs = ((False, num_layers),)
    freq = f.fields.get("linear_attention_freq")
    if variant == "gdn":
        if freq is None:
            raise f.error(f"{f.name('experimental_attention_variant')} is Gated DeltaNet but "
                          f"{f.name('linear_attention_freq')!r} is not set (which layers are linear)")
        # megatron-core: an int N makes every N-th layer (1-based) softmax attention, the rest linear.
        linear = layer_flags(f, "linear_attention_freq", freq, num_layers, every=False)
    elif freq is not None:
        raise f.error(f"{f.name('linear_attention_freq')!r} needs {f.name('experimental_attention_variant')}"
                      f" (one of {', '.join(LINEAR_ATTENTION_VARIANTS)})")
    linear_kind = "gdn"
    if f.fields.get("kda_layers") is not None:  # Kimi Linear (Hugging Face files only)
        linear, linear_kind = tuple(f.fields["kda_layers"]), "kda"
    runs = zip_runs(zip_runs(linear, windowed), ffn_runs)
    # megatron-core: a non-linear variant (dsa) replaces the attention of every layer.
    softmax = "dsa" if variant == "dsa" else None
    main = _dsa_sharing(f, tuple(((linear_kind if lin else softmax or ("window" if win else "attention"),
                                   "moe" if m else "mlp"), n) for ((lin, win), m), n in runs))
    # MTP layers copy the last decoder layer's spec (megatron-core's MTP block spec), attention unwindowed.
    (last_mixer, last_ffn), _ = main[-1]
    mtp = f.opt_integer("mtp_num_layers", minimum=0) or 0
    mtp_mixer = {"gdn": "gdn", "kda": "kda", "dsa": "dsa", "dsa_shared": "dsa"}.get(last_mixer, "attention")
    return _Layers(main=main, mtp_num_layers=mtp, mtp=(((mtp_mixer, last_ffn), 1),))


def _hybrid_layers(f: Fields, pattern: Any, moe: MoESpec | None, mla: MLASpec | None) -> _Layers:
    """megatron-core 0.19's unified hybrid pattern ``main|main/mtp/mtp``: ``|`` marks pipeline
    stages, each part after ``/`` is one MTP depth (all identical)."""
    name = f.name("hybrid_override_pattern")
    supported = "".join(_HYBRID_SYMBOLS) + _HYBRID_PIPE + _HYBRID_MTP
    if not isinstance(pattern, str):
        raise f.error(f"{name} must be a string of the symbols {supported}, got {show(pattern)}")
    for c in dict.fromkeys(pattern):
        if c not in supported:
            raise f.error(f"{name} {show(pattern)} may only use the symbols {supported}; {c!r} is unknown")
    main, *mtp_parts = pattern.split(_HYBRID_MTP)
    mtp_parts = [p for p in mtp_parts if p] if all(not p for p in mtp_parts) else mtp_parts
    if len(set(mtp_parts)) > 1 or _HYBRID_PIPE in "".join(mtp_parts):
        raise f.error(f"{name} {show(pattern)}: every MTP part after '/' must be the same (no '|')")
    segments = tuple(len(part) for part in main.split(_HYBRID_PIPE)) if _HYBRID_PIPE in main else ()
    main = main.replace(_HYBRID_PIPE, "")
    if not main:
        raise f.error(f"{name} {show(pattern)} has no decoder layers")
    given = f.fields.get("num_layers")
    if given is not None and given != len(main):
        raise f.error(f"{f.name('num_layers')}={show(given)} but {name} has {len(main)} layers")
    used = set(main + "".join(mtp_parts))
    if "E" in used and moe is None:
        raise f.error(f"{name} has MoE layers ('E') but {f.name('num_moe_experts')} is unset")
    if "*" in used and (used & {"+", "D"} or mla is not None):
        raise f.error(f"{name}: '*' builds standard attention, '+' and 'D' multi-latent attention; megatron-core "
                      f"allows one kind per model (and '+'/'D' with {f.name('multi_latent_attention')})")
    if used & {"+", "D"} and mla is None:
        raise f.error(f"{name} has MLA or DSA layers ('+', 'D') but {f.name('multi_latent_attention')} is not set")
    what = f"{f.source}: {name}"
    runs = merged(((_HYBRID_SYMBOLS[c], len(list(g))) for c, g in itertools.groupby(main)), what)
    runs = _dsa_sharing(f, _hybrid_windows(f, runs))
    mtp_runs = merged(((_HYBRID_SYMBOLS[c], len(list(g))) for c, g in itertools.groupby(mtp_parts[0])), what) \
        if mtp_parts else ()
    mtp = f.opt_integer("mtp_num_layers", minimum=0) or 0
    if mtp_parts:
        if mtp not in (0, len(mtp_parts)):
            raise f.error(f"{f.name('mtp_num_layers')}={mtp} but {name} has {len(mtp_parts)} MTP depths")
        return _Layers(main=runs, mtp_num_layers=len(mtp_parts), mtp=mtp_runs, segments=segments)
    # NB: a pattern without '/' builds no MTP, whatever mtp_num_layers says: megatron-core 0.19's HybridModel
    # builds MTP depths only from parts after '/' (Megatron-LM warns "Hybrid model with --mtp-num-layers but
    # no MTP pattern"), and 0.16.1's MambaModel has none.
    return _Layers(main=runs, mtp_num_layers=0, mtp=(), segments=segments)


def _hybrid_windows(f: Fields, runs: LayerRuns) -> LayerRuns:
    """Attention layers ``*`` slide where ``window_size`` and ``window_attn_skip_freq`` make their
    (1-based, whole-pattern) layer number slide, as megatron-core's attention reads them."""
    window = _window(f)
    if window is None:
        return runs
    num_layers = sum(n for _, n in runs)
    skip = f.fields.get("window_attn_skip_freq")
    windowed: Runs = ((True, num_layers),) if skip is None else layer_flags(
        f, "window_attn_skip_freq", skip, num_layers, every=False)
    return tuple(((("window", ffn) if w and mixer == "attention" else (mixer, ffn)), n)
                 for ((mixer, ffn), w), n in zip_runs(runs, windowed))


def _dsa_sharing(f: Fields, runs: LayerRuns) -> LayerRuns:
    """DSA layers that reuse an earlier layer's top-k run no indexer (``dsa_shared``): megatron-core
    0.19's ``dsa_indexer_topk_freq``/``dsa_indexer_skip_topk_offset`` (layer ``n``, 1-based, runs
    its indexer when ``max(n - max(offset, 1), 0) % freq == 0``), or a Hugging Face file's
    ``indexer_types`` (``dsa_indexer_layers``). MTP layers number their own layers: they run theirs."""
    num_layers = sum(n for _, n in runs)
    what = f"{f.source}: the DSA indexer layout"
    given = f.fields.get("dsa_indexer_layers")
    if given is not None:
        own: Runs = tuple(given)
    else:
        freq = f.integer("dsa_indexer_topk_freq", default=1)
        if freq == 1:
            return runs
        first = min(max(f.integer("dsa_indexer_skip_topk_offset", minimum=0, default=0), 1), num_layers)
        own = merged(((True, first),) + cycle(((False, freq - 1), (True, 1)), num_layers - first, what), what)
    return tuple(((("dsa_shared", ffn) if mixer == "dsa" and not runs_indexer else (mixer, ffn)), n)
                 for ((mixer, ffn), runs_indexer), n in zip_runs(runs, own))


def _mamba_spec(f: Fields, hidden: int) -> MambaSpec:
    d_inner = 2 * hidden
    head_dim = f.opt_integer("mamba_head_dim") or 64
    return MambaSpec(
        state_dim=f.opt_integer("mamba_state_dim") or 128,
        head_dim=head_dim,
        num_groups=f.opt_integer("mamba_num_groups") or 8,
        num_heads=f.opt_integer("mamba_num_heads") or max(d_inner // head_dim, 1),
    )


def _dsa_spec(f: Fields, mla: MLASpec | None, window: int | None) -> DSASpec:
    """DSA's indexer from megatron-core's ``dsa_*`` fields (MLA layers with a top-k core)."""
    variant = f.name("experimental_attention_variant")
    if mla is None:
        raise f.error(f"DSA layers need multi-latent attention: set {f.name('multi_latent_attention')} ({variant})")
    if window is not None:
        raise f.error(f"DSA layers and {f.name('window_size')} together are not supported")
    missing = [f.name(k) for k in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
               if f.fields.get(k) is None]
    if missing:
        raise f.error(f"DSA layers need {', '.join(map(repr, missing))}")
    coeff = f.fields.get("dsa_indexer_loss_coeff")
    if coeff is not None and (isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0):
        raise f.error(f"{f.name('dsa_indexer_loss_coeff')} must be a number >= 0, got {show(coeff)}")
    return DSASpec(
        num_heads=f.integer("dsa_indexer_n_heads"),
        head_dim=f.integer("dsa_indexer_head_dim"),
        topk=f.integer("dsa_indexer_topk"),
        trains_indexer=bool(coeff),
        sparse_loss=f.boolean("dsa_indexer_use_sparse_loss"),
    )


def _gdn_spec(f: Fields) -> GDNSpec:
    """Gated DeltaNet sizes with megatron-core's defaults (TransformerConfig ``linear_*``)."""
    spec = GDNSpec(
        num_key_heads=f.opt_integer("linear_num_key_heads") or 16,
        num_value_heads=f.opt_integer("linear_num_value_heads") or 32,
        key_head_dim=f.opt_integer("linear_key_head_dim") or 128,
        value_head_dim=f.opt_integer("linear_value_head_dim") or 128,
        conv_kernel_dim=f.opt_integer("linear_conv_kernel_dim") or 4,
    )
    if spec.num_value_heads % spec.num_key_heads:
        raise f.error(f"{f.name('linear_num_key_heads')}={spec.num_key_heads} does not divide "
                      f"{f.name('linear_num_value_heads')}={spec.num_value_heads}")
    return spec
