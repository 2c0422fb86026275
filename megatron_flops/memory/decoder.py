"""The parameters of a megatron-core ``GPTModel`` (local layer spec), per model chunk and tensor
-parallel rank, in ``named_parameters()`` order (stdlib only).

Only what bytes depend on beyond :class:`~megatron_flops.model.spec.ModelSpec` is read here, by its
``TransformerConfig``/``GPTModel`` name and with megatron-core's defaults: biases, the norm,
position embeddings, dropout, the fused bias-activation, the attention backend.

NB: parameters as megatron-core's local spec registers them. The Transformer-Engine spec fuses
each norm into the next linear layer (``layer_norm_weight``) and may group experts into one
tensor per projection: the same numbers of elements, a different order (which moves the
distributed optimizer's 64-element alignment padding only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_flops.memory.hf_layers import hf_decoder_fields
from megatron_flops.memory.hf_parallel import ONE_NORM
from megatron_flops.memory.hf_qk_norms import HF_QK_NORMS, PER_HEAD_LAYERNORM, qk_norm_reason, qk_norm_tensors
from megatron_flops.model.hf_config import hf_family_of, hf_text_config
from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.memory.layout import Parallelism
from megatron_flops.memory.grouped_lora import grouped_adapter_tensors
from megatron_flops.memory.lora import adapter_numels, lora_tp_reason
from megatron_flops.memory.mla_mtp import TRANSFORMER_IMPLS, check_mla_mtp
from megatron_flops.memory.mtp_layers import mtp_kinds, mtp_layer_prefix
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.linear_cp import linear_cp_reason
from megatron_flops.memory.ssm import MIXERS_WITH_PARAMETERS, dsa_indexer_tensors, mixer_tensors, ssm_reason
from megatron_flops.model.spec import ModelSpec

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
# megatron-core's attention_backend values -> the saved-for-backward convention they follow.
ATTENTION_BACKENDS = {"local": "unfused", "unfused": "unfused", "flash": "flash", "fused": "flash", "auto": "flash"}
ROW_PARALLEL = ("linear_proj", "linear_fc2")
_HF_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")


@dataclass(frozen=True, kw_only=True)
class DecoderOptions:
    """Layer details that bytes depend on, named as ``TransformerConfig``/``GPTModel`` name them,
    with their defaults. ``attention_backend`` is the saved-tensor convention: ``unfused``
    (megatron-core's local ``DotProductAttention``) or ``flash`` (a fused/flash kernel).
    ``transformer_impl`` (Megatron-LM's ``--transformer-impl``): the layer spec, which moves
    bytes only for multi-latent attention under TP (:mod:`~megatron_flops.memory.mla_mtp`)."""

    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    # Hugging Face layers with some of these biases only (memory/hf_layers.py): linear_proj's, and the dense
    # MLP's and shared experts' (linear_fc1, linear_fc2); None: add_bias_linear's (megatron-core's one switch).
    hf_proj_bias: bool | None = None
    hf_mlp_bias: bool | None = None
    # Hugging Face MLA families' attention_bias (memory/hf_layers.py): biases on the down projections
    # (q_a_proj, kv_a_proj_with_mqa), which megatron-core's MLA builds without.
    hf_mla_down_bias: bool = False
    qk_layernorm: bool = False
    # Hugging Face q/k norms megatron-core has no module for (memory/hf_qk_norms.py): cohere's per-head
    # weights, olmo2/olmo3's whole-projection norms; None: megatron-core's [head_dim] norms.
    hf_qk_norm: str | None = None
    # Hugging Face falcon's ALiBi (with position_embedding_type none): saves what attention without it does.
    alibi: bool = False
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int | None = None
    rotary_percent: float = 1.0
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    bias_activation_fusion: bool = False
    attention_softmax_in_fp32: bool = True
    attention_backend: str = "flash"
    moe_token_dispatcher_type: str = "allgather"
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    # The routed experts' class (memory/moe_grouped.py) and the flex dispatcher's backend.
    moe_grouped_gemm: bool = False
    moe_use_legacy_grouped_gemm: bool = False
    moe_flex_dispatcher_backend: str = "deepep"
    bias_dropout_fusion: bool = True  # (read for TEGroupedMLP's refusal of it with linear biases only)
    # Pipeline sends preceded by their shape (3 int64), as megatron-core's P2PCommunicator does under either
    # (memory/comm.py). mtp_standalone without a layout keeps MTP on the last stage; a layout resets it.
    variable_seq_lengths: bool = False
    mtp_standalone: bool = False
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: int | None = None
    transformer_impl: str = "transformer_engine"
    # Megatron-Bridge's gemma2/gemma3 layer spec (memory/hf_layers.py): an RMSNorm on linear_proj's and
    # linear_fc2's outputs, and tanh soft-capping of the attention scores and the output logits.
    post_layernorms: bool = False
    pre_layernorms: bool = True  # (olmo2, olmo3: the norms after the sublayers only)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Hugging Face olmo's LayerNorms have no weight or bias, cohere's no bias (every norm of the model).
    norm_weight: bool = True
    norm_bias: bool = True
    # Hugging Face apertus's xIELU activation (transformers' XIELUActivation in each MLP: alpha_p, alpha_n).
    xielu: bool = False
    # Hugging Face cohere, gpt_neox, stablelm, falcon (memory/hf_parallel.py): attention and the MLP in
    # parallel on the layer's input through 1 shared norm or 2 norms; 0: megatron-core's sequential layer.
    parallel_layer_norms: int = 0

    @property
    def proj_bias(self) -> bool:
        """Whether ``linear_proj`` has a bias."""
        return self.add_bias_linear if self.hf_proj_bias is None else self.hf_proj_bias

    @property
    def mlp_bias(self) -> bool:
        """Whether the dense MLP's and the shared experts' ``linear_fc1`` and ``linear_fc2`` have biases."""
        return self.add_bias_linear if self.hf_mlp_bias is None else self.hf_mlp_bias

    @property
    def duplicated_mla_down(self) -> bool:
        """Transformer Engine's MLA spec: the down projections whole on every TP rank."""
        return self.transformer_impl == "transformer_engine"

    @property
    def fused_norm_targets(self) -> tuple[str, ...]:
        """The LoRA targets Transformer Engine's spec builds with a norm fused in
        (``TELayerNormColumnParallelLinear``, megatron-core 0.16.1's ``gpt_layer_specs``): a dense
        attention's ``linear_qkv`` (the input norm), a dense MLP's ``linear_fc1`` (the pre-MLP norm;
        not in a MoE layer, whose pre-MLP norm is its own module), with ``qk_layernorm`` MLA's up
        projections (the latent norms)."""
        if self.transformer_impl != "transformer_engine":
            return ()
        return ("linear_qkv", "linear_fc1") + (("linear_q_up_proj", "linear_kv_up_proj") if self.qk_layernorm else ())

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding_type must be one of {POSITION_EMBEDDINGS}, got {self.position_embedding_type!r}"
            )
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {self.transformer_impl!r}")
        if self.attention_backend not in ("unfused", "flash"):
            raise ValueError(f"attention backend must be one of {sorted(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
        if self.parallel_layer_norms not in (0, 1, 2):
            raise ValueError(f"parallel_layer_norms must be 0, 1 or 2, got {self.parallel_layer_norms!r}")
        if self.alibi and self.position_embedding_type != "none":
            raise ValueError(f"alibi replaces position embeddings: position_embedding_type must be 'none', got "
                             f"{self.position_embedding_type!r}")
        if self.hf_qk_norm not in (None, *HF_QK_NORMS):
            raise ValueError(f"hf_qk_norm must be one of {HF_QK_NORMS} or None, got {self.hf_qk_norm!r}")
        if self.hf_qk_norm == PER_HEAD_LAYERNORM and self.normalization != "LayerNorm":
            raise ValueError(f"hf_qk_norm {PER_HEAD_LAYERNORM!r} (stablelm's) is a LayerNorm: normalization must be "
                             f"'LayerNorm', got {self.normalization!r}")
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, hf: bool = False, hf_family: str | None = None) -> DecoderOptions:
        """From a model file: ``TransformerConfig`` field names, or a Hugging Face ``config.json``
        (``hf=True``, read with ``hf_family``'s rules, else its model_type's: the norm, biases,
        rotary fraction, q/k norms and parallel attention and MLP its layers have
        (:mod:`megatron_flops.memory.hf_layers`), no hidden dropout, the file's attention dropout,
        the fused SwiGLU that Megatron-Bridge's providers enable)."""
        if hf:
            text = hf_text_config(data)
            if text is None:
                raise ValueError("a Hugging Face config without a text decoder has no decoder to model")
            family = hf_family_of(text, hf_family)
            fields: dict[str, Any] = {
                **hf_decoder_fields(text, family),
                "hidden_dropout": 0.0,
                "attention_dropout": float(text.get("attention_dropout", 0.0) or 0.0),
                "bias_activation_fusion": True,
            }
            if any(text.get(k) for k in _HF_EXPERT_KEYS):
                # NB: Megatron-Bridge's MoE providers use the alltoall dispatcher; DeepSeek-V3 routes
                # with sigmoid scores.
                fields["moe_token_dispatcher_type"] = "alltoall"
                if text.get("scoring_func") == "sigmoid":
                    fields["moe_router_score_function"] = "sigmoid"
        else:
            names = set(cls.__dataclass_fields__) - {"attention_backend"}
            fields = {k: data[k] for k in names if data.get(k) is not None}
            backend = data.get("attention_backend")
            if backend is not None:
                fields["attention_backend"] = backend_convention(str(backend))
        return cls(**fields)


def backend_convention(name: str) -> str:
    """``local``/``unfused`` -> ``unfused``; ``flash``/``fused``/``auto`` -> ``flash``."""
    key = name.rsplit(".", 1)[-1].lower()
    if key not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[key]


@dataclass(frozen=True)
class Param:
    """One parameter tensor on one rank: ``expert`` ones are reduced over the expert
    data-parallel group (EP > 1); ``shared_embedding`` marks the tied embedding/output weight of
    the first and last pipeline stage; ``tp_replicated`` a weight every tensor-parallel rank holds
    whole whose gradient megatron-core all-reduces over TP under sequence parallelism (norms,
    row-parallel biases, the router, the shared-expert gate: their ``sequence_parallel``
    attribute); ``rows`` its dim 0 (None: a 1-D tensor), which FSDP2 shards."""

    name: str
    numel: int
    trainable: bool = True
    expert: bool = False
    shared_embedding: bool = False
    tp_replicated: bool = False
    rows: int | None = field(default=None, compare=False)


def experts_module(options: DecoderOptions) -> str:
    """The routed experts' class megatron-core 0.16.1 builds (``get_moe_module_spec_for_backend``):
    ``SequentialMLP``, ``TEGroupedMLP`` or legacy ``GroupedMLP`` (:mod:`.moe_grouped`)."""
    if not options.moe_grouped_gemm:
        return "SequentialMLP"
    if options.moe_use_legacy_grouped_gemm or options.transformer_impl == "local":
        return "GroupedMLP"
    return "TEGroupedMLP"


def experts_take_adapters(options: DecoderOptions) -> bool:
    """Whether Megatron-Bridge's LoRA (which matches module names) can adapt the routed experts:
    legacy ``GroupedMLP`` has no ``linear_fc1``/``linear_fc2`` modules (``weight1``, ``weight2``)."""
    return experts_module(options) != "GroupedMLP"


def padded_vocab(spec: ModelSpec, options: DecoderOptions, tp: int) -> int:
    """The vocabulary rows of the embedding and output layer: the file's ``padded_vocab_size``,
    else ``vocab_size`` padded to a multiple of ``make_vocab_size_divisible_by x TP``."""
    if options.padded_vocab_size is not None:
        if options.padded_vocab_size % tp:
            raise ValueError(f"padded_vocab_size={options.padded_vocab_size} is not divisible by --tp {tp}")
        return options.padded_vocab_size
    multiple = options.make_vocab_size_divisible_by * tp
    return -(-spec.vocab_size // multiple) * multiple


def check_supported(spec: ModelSpec, par: Parallelism, peft: PeftSpec | None, options: DecoderOptions) -> None:
    """ValueError for what these parameter lists do not model, or sizes that do not divide."""
    reason = ssm_reason(spec, par, peft) or linear_cp_reason(spec, par)
    if reason is not None:
        raise ValueError(reason)
    check_mla_mtp(spec, par, duplicated=options.duplicated_mla_down)
    reason = qk_norm_reason(options.hf_qk_norm if options.qk_layernorm else None, par.tp)
    if reason is not None:
        raise ValueError(reason)
    tp = par.tp
    for name, value in (("num_attention_heads", spec.num_attention_heads), ("num_query_groups", spec.num_query_groups),
                        ("ffn_hidden_size", spec.ffn_hidden_size)):
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by --tp {tp}")
    if par.stage_layers is None and spec.num_layers % (par.pp * par.num_chunks):
        raise ValueError(f"num_layers={spec.num_layers} is not divisible by PP x VPP = {par.pp * par.num_chunks}")
    if spec.moe is not None:
        if spec.moe.num_experts % par.ep:
            raise ValueError(f"num_moe_experts={spec.moe.num_experts} is not divisible by --ep {par.ep}")
        for name, value, size, flag in (
                ("moe_ffn_hidden_size", spec.moe.ffn_hidden_size, par.expert_tp, "--etp" if par.etp else "--tp"),
                ("moe_shared_expert_intermediate_size", spec.moe.shared_expert_ffn_hidden_size, tp, "--tp")):
            if value % size:
                raise ValueError(f"{name}={value} is not divisible by {flag} {size}")
    elif par.ep > 1:
        raise ValueError(f"--ep {par.ep} needs a MoE model (num_moe_experts)")
    if spec.moe is not None and peft is not None and peft.lora_rank is not None and peft.lora_rank % par.expert_tp:
        raise ValueError(f"--lora-rank {peft.lora_rank} is not divisible by the experts' TP {par.expert_tp} "
                         "(Bridge splits the expert adapters' linear_in rows)")
    reason = lora_tp_reason(spec, par, peft, duplicated=options.duplicated_mla_down)
    if reason is not None:
        raise ValueError(reason)


def chunk_parameters(
    spec: ModelSpec,
    options: DecoderOptions,
    par: Parallelism,
    *,
    pp_rank: int,
    chunk: int,
    seq_length: int,
    peft: PeftSpec | None = None,
) -> tuple[Param, ...]:
    """The parameters of model chunk ``chunk`` on pipeline rank ``pp_rank`` and any TP rank, in
    ``named_parameters()`` order, LoRA adapters (``to_wrap``/``adapter`` as Megatron-Bridge
    names them) beside the projections they wrap."""
    peft = peft or PeftSpec()
    out: list[Param] = []
    h, tp, vocab = spec.hidden_size, par.tp, padded_vocab(spec, options, par.tp)
    first, last = par.is_first_stage(pp_rank, chunk), par.is_last_stage(pp_rank, chunk)
    tied, has_mtp = spec.tied_output, bool(spec.mtp_num_layers)
    mtp_here = has_mtp and par.holds_mtp(pp_rank, chunk)
    base = not peft.frozen
    # NB: with MTP, megatron-core keeps a copy of the word embeddings on the MTP layers' stage (the
    # last, or a standalone one), all-reduced with the first stage's like a tied output weight.
    if first or mtp_here:
        out.append(Param("embedding.word_embeddings.weight", vocab // tp * h, base,
                         shared_embedding=(tied or has_mtp) and par.pp > 1, rows=vocab // tp))
        if options.position_embedding_type == "learned_absolute":
            rows = options.max_position_embeddings or seq_length
            out.append(Param("embedding.position_embeddings.weight", rows * h, base, rows=rows))
    layers, kinds = par.chunk_layers(spec.num_layers, pp_rank, chunk), spec.layers
    for local, layer in enumerate(layers):  # NB: layer numbering is per chunk (megatron's local index)
        out += _layer(spec, options, par, peft, f"decoder.layers.{local}.", kinds[layer][1], kinds[layer][0])
    if par.holds_final_norm(spec.num_layers, pp_rank, chunk, mtp=has_mtp and not is_hybrid(spec)):
        out += _norm(options, "decoder.final_layernorm.", h, base)
    if mtp_here:
        for i in range(spec.mtp_num_layers):
            # NB: an MTP layer: norms of the embedding and of the hidden state, eh_proj [h/TP, 2h], a
            # decoder layer of the last layer's kind (a hybrid MTP part: its layers, :mod:`.mtp_layers`),
            # and its own final norm.
            mtp = f"mtp.layers.{i}."
            out += _norm(options, mtp + "enorm.", h, base) + _norm(options, mtp + "hnorm.", h, base)
            out += _linear(mtp, "eh_proj", 2 * h, h // tp, False, peft)  # (column parallel)
            for j, (mixer, ffn) in enumerate(mtp_kinds(spec)):
                out += _layer(spec, options, par, peft, mtp_layer_prefix(spec, i, j), ffn, mixer)
            out += _norm(options, mtp + "final_layernorm.", h, base)
    if last and (not tied or not first):
        # (With MTP here the tied weight the last stage reduces is its embedding copy: this one,
        # allocated but unused when tied, is not marked.)
        out.append(Param("output_layer.weight", vocab // tp * h, base,
                         shared_embedding=tied and par.pp > 1 and not mtp_here, rows=vocab // tp))
    return tuple(out)


def _norm(options: DecoderOptions, prefix: str, width: int, trainable: bool) -> list[Param]:
    if not options.norm_weight:  # (olmo: no affine parameters at all)
        return []
    params = [Param(prefix + "weight", width, trainable, tp_replicated=True)]
    if options.normalization == "LayerNorm" and options.norm_bias:
        params.append(Param(prefix + "bias", width, trainable, tp_replicated=True))
    return params


def _post_norm(options: DecoderOptions, prefix: str, width: int, trainable: bool) -> list[Param]:
    """Bridge's ``TERowParallelLinearLayerNorm``: an RMSNorm [h] on the row-parallel layer's
    (reduced) output, whole on every TP rank, registered after the layer's own weight."""
    return _norm(options, prefix + "post_layernorm.", width, trainable) if options.post_layernorms else []


def _linear(prefix: str, name: str, d_in: int, d_out: int, bias: bool, peft: PeftSpec,
            *, expert: bool = False, duplicated: bool = False, tp: int = 1) -> list[Param]:
    """A linear layer's weight [d_out, d_in] (+ bias [d_out]) on one TP rank, LoRA-wrapped when
    ``name`` is a target: A [r, d_in] and B [d_out, r] train, the wrapped layer is frozen (under
    TP, as Megatron-Bridge splits them: :func:`~megatron_flops.memory.lora.adapter_numels`).
    NB: a row-parallel layer's (``linear_proj``, ``linear_fc2``) bias is whole on every TP rank, as
    are a ``duplicated`` layer's weight and bias (Transformer Engine's MLA down projections)."""
    base = not peft.frozen
    adapted = peft.lora_rank is not None and name in peft.lora_targets
    inner = f"{prefix}{name}.to_wrap." if adapted else f"{prefix}{name}."
    params = [Param(inner + "weight", d_out * d_in, base, expert, tp_replicated=duplicated, rows=d_out)]
    if bias:
        params.append(Param(inner + "bias", d_out, base, expert, tp_replicated=name in ROW_PARALLEL or duplicated))
    if adapted:
        assert peft.lora_rank is not None
        numel_in, numel_out = adapter_numels(name, d_in, d_out, peft.lora_rank, tp, duplicated=duplicated)
        params.append(Param(f"{prefix}{name}.adapter.linear_in.weight", numel_in, True, expert,
                            rows=numel_in // d_in))
        params.append(Param(f"{prefix}{name}.adapter.linear_out.weight", numel_out, True, expert,
                            rows=numel_out // peft.lora_rank))
    return params


def _layer(spec: ModelSpec, options: DecoderOptions, par: Parallelism, peft: PeftSpec, prefix: str,
           ffn: str, mixer: str = "attention") -> list[Param]:
    """One decoder layer: its mixer (softmax attention, MLA/DSA, Mamba, GDN, KDA or none: a hybrid
    MLP layer) and its feed-forward part (none: a hybrid mixer layer), each behind its norm."""
    h, tp, d = spec.hidden_size, par.tp, spec.kv_channels
    nq, ng = spec.num_attention_heads, spec.num_query_groups
    base, bias = not peft.frozen, options.add_bias_linear
    attn = prefix + "self_attention."
    out = _norm(options, prefix + "input_layernorm.", h, base) if mixer != "none" and options.pre_layernorms else []
    if mixer in MIXERS_WITH_PARAMETERS:
        out += [Param(n, k, base, tp_replicated=r) for n, k, r in
                mixer_tensors(spec, mixer, prefix, tp, options.normalization == "LayerNorm")]
    elif spec.mla is not None and mixer != "none":
        if mixer == "dsa":
            out += [Param(n, k, base, tp_replicated=r) for n, k, r in dsa_indexer_tensors(spec, prefix)]
        out += _mla(spec, options, peft, attn, options.proj_bias, tp)
    elif mixer != "none":
        # linear_proj: [h, nq*d/tp] (row parallel; its bias is not split).
        out += _linear(attn, "linear_proj", nq * d // tp, h, options.proj_bias, peft, tp=tp)
        out += _post_norm(options, attn + "linear_proj.", h, base)
        # linear_qkv: [(nq + 2*ng)*d/tp (+ nq*d/tp output gate), h] (column parallel).
        gate = nq * d // tp if spec.attention_output_gate else 0
        out += _linear(attn, "linear_qkv", h, (nq + 2 * ng) * d // tp + gate, bias or options.add_qkv_bias, peft,
                       tp=tp)
        if options.qk_layernorm and options.hf_qk_norm:
            out += [Param(n, k, base, tp_replicated=r, rows=rows) for n, k, r, rows in
                    qk_norm_tensors(options.hf_qk_norm, attn, heads=nq, groups=ng, head_dim=d, tp=tp)]
        elif options.qk_layernorm:
            out += _norm(options, attn + "q_layernorm.", d, base) + _norm(options, attn + "k_layernorm.", d, base)
    if ffn == "none":
        return out
    if options.pre_layernorms and options.parallel_layer_norms != ONE_NORM:  # (the MLP reads the input norm's output)
        out += _norm(options, prefix + "pre_mlp_layernorm.", h, base)
    if ffn == "mlp":
        out += _mlp(spec, peft, prefix + "mlp.", spec.ffn_hidden_size // tp, options.mlp_bias, tp=tp)
        if options.xielu:  # (registered after linear_fc2: transformers' module set on megatron-core's MLP)
            out += [Param(f"{prefix}mlp.activation_func.{n}", 1, base, tp_replicated=True, rows=1)
                    for n in ("alpha_p", "alpha_n")]
        return out + _post_norm(options, prefix + "mlp.linear_fc2.", h, base)
    moe = spec.moe
    assert moe is not None
    mlp = prefix + "mlp."
    out.append(Param(mlp + "router.weight", moe.num_experts * h, base, tp_replicated=True, rows=moe.num_experts))
    if bias:  # (a bias per expert, whole on every TP rank)
        out.append(Param(mlp + "router.bias", moe.num_experts, base, tp_replicated=True))
    latent = moe.latent_size
    if latent:  # NB: Transformer Engine's duplicated TELinear: whole on every TP rank
        for name, shape in (("fc1_latent_proj.", (latent, h)), ("fc2_latent_proj.", (h, latent))):
            out.append(Param(mlp + name + "weight", shape[0] * shape[1], base, tp_replicated=True, rows=shape[0]))
            if bias:
                out.append(Param(mlp + name + "bias", shape[0], base, tp_replicated=True))
    out += _routed_experts(spec, options, par, peft, mlp + "experts.", bias)
    if moe.shared_expert_ffn_hidden_size:
        if moe.shared_expert_gate:  # (registered before the MLP's layers)
            out.append(Param(mlp + "shared_experts.gate_weight", h, base, tp_replicated=True, rows=1))
        out += _mlp(spec, peft, mlp + "shared_experts.", moe.shared_expert_ffn_hidden_size // tp, options.mlp_bias,
                    tp=tp)
    return out


def _mla(spec: ModelSpec, options: DecoderOptions, peft: PeftSpec, attn: str, bias: bool, tp: int) -> list[Param]:
    """Multi-latent attention on one TP rank: linear_proj [h, heads*v/TP] (row parallel), the query
    projection (direct [heads*(qk+rope)/TP, h], or down [q_lora/TP, h] and up [heads*(qk+rope)/TP,
    q_lora]), kv down [(kv_lora + rope)/TP, h] and up [heads*(qk+v)/TP, kv_lora] (column
    parallel), then with ``qk_layernorm`` the norms of the query and key/value latents (whole on
    every TP rank).
    NB: the local spec splits the down projections over TP (their outputs are all-gathered);
    Transformer Engine's spec keeps them whole on every rank (``parallel_mode="duplicated"``, a
    formula). Only ``linear_proj`` has a bias (megatron-core builds the others with bias=False), and
    with ``hf_mla_down_bias`` the down projections (Hugging Face's ``q_a_proj`` [q_lora] and
    ``kv_a_proj_with_mqa`` [kv_lora + rope], split over TP as their weights' rows, or whole)."""
    mla = spec.mla
    assert mla is not None
    h, heads, base = spec.hidden_size, spec.num_attention_heads, not peft.frozen
    dup = options.duplicated_mla_down and tp > 1
    down = 1 if dup else tp
    q_out = heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim) // tp
    out = _linear(attn, "linear_proj", heads * mla.v_head_dim // tp, h, bias, peft, tp=tp)
    if mla.q_lora_rank is None:
        out += _linear(attn, "linear_q_proj", h, q_out, False, peft, tp=tp)
    else:
        out += _linear(attn, "linear_q_down_proj", h, mla.q_lora_rank // down, options.hf_mla_down_bias, peft,
                       duplicated=dup, tp=tp)
        out += _linear(attn, "linear_q_up_proj", mla.q_lora_rank, q_out, False, peft, tp=tp)
    out += _linear(attn, "linear_kv_down_proj", h, (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) // down,
                   options.hf_mla_down_bias, peft, duplicated=dup, tp=tp)
    out += _linear(attn, "linear_kv_up_proj", mla.kv_lora_rank, heads * (mla.qk_head_dim + mla.v_head_dim) // tp,
                   False, peft, tp=tp)
    if options.qk_layernorm:
        if mla.q_lora_rank is not None:
            out += _norm(options, attn + "q_layernorm.", mla.q_lora_rank, base)
        out += _norm(options, attn + "kv_layernorm.", mla.kv_lora_rank, base)
    return out


def _routed_experts(spec: ModelSpec, options: DecoderOptions, par: Parallelism, peft: PeftSpec, prefix: str,
                    bias: bool) -> list[Param]:
    """This rank's routed experts. LoRA (Megatron-Bridge, which matches module names): every
    ``SequentialMLP`` expert's ``linear_fc1``/``linear_fc2`` its own adapter; ``TEGroupedMLP``'s
    grouped ``linear_fc1``/``linear_fc2`` one adapter each, shared by the E/EP local experts
    (Bridge 0.3.1; 0.6.2's default ``share_expert_adapters``; its per-expert and shared-outer
    layouts: :mod:`.grouped_lora`); legacy ``GroupedMLP`` has no linear
    modules (``weight1``, ``weight2``): no adapter."""
    moe = spec.moe
    assert moe is not None
    module, ffn = experts_module(options), moe.ffn_hidden_size // par.expert_tp
    kw: dict[str, Any] = {"expert": par.ep > 1, "width": moe.latent_size or spec.hidden_size, "tp": par.expert_tp}
    each = peft if module == "SequentialMLP" else replace(peft, frozen=False, lora_rank=None)  # (no adapter)
    out = [p for j in range(moe.num_experts // par.ep) for p in _mlp(spec, each, f"{prefix}local_experts.{j}.", ffn,
                                                                     bias, **kw)]
    if each is not peft:
        out = [replace(p, trainable=not peft.frozen) for p in out]
    if module == "TEGroupedMLP" and peft.lora_rank is not None and peft.grouped_expert_adapters == "shared":
        out += [p for p in _mlp(spec, peft, prefix, ffn, bias, **kw) if ".adapter." in p.name]
    elif module == "TEGroupedMLP" and peft.lora_rank is not None:  # (Bridge 0.6.2's other layouts)
        out += [Param(prefix + name, numel, True, grouped, rows=rows) for name, numel, rows, grouped in
                grouped_adapter_tensors(peft, par, width=kw["width"], ffn=ffn, num_local=moe.num_experts // par.ep,
                                        gate=2 if spec.gated_linear_unit else 1)]
    return out


def _mlp(spec: ModelSpec, peft: PeftSpec, prefix: str, ffn: int, bias: bool, *, expert: bool = False,
         width: int | None = None, tp: int = 1) -> list[Param]:
    h, gate = width or spec.hidden_size, 2 if spec.gated_linear_unit else 1
    # linear_fc1: [ffn*(2 if gated)/tp, h]; linear_fc2: [h, ffn/tp].
    return (_linear(prefix, "linear_fc1", h, gate * ffn, bias, peft, expert=expert, tp=tp)
            + _linear(prefix, "linear_fc2", ffn, h, bias, peft, expert=expert, tp=tp))


def parameter_counts(spec: ModelSpec, options: DecoderOptions, *, seq_length: int,
                     peft: PeftSpec | None = None, tp: int = 1) -> dict[str, int]:
    """``total`` and ``trainable`` parameters of the whole model (tied weights once; the
    vocabulary padded for ``tp`` ranks)."""
    whole = Parallelism()
    if options.padded_vocab_size is None:
        options = replace(options, padded_vocab_size=padded_vocab(spec, options, tp))
    params = chunk_parameters(spec, options, whole, pp_rank=0, chunk=0, seq_length=seq_length, peft=peft)
    return {"total": sum(p.numel for p in params), "trainable": sum(p.numel for p in params if p.trainable)}
