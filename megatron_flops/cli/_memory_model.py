"""What ``memory`` reads from the model estimate reads (:mod:`megatron_flops.cli._model_args`): the
decoder's byte options and the differences it cannot express, and a Megatron-LM command line's
layout where the flags leave it open."""

from __future__ import annotations

import argparse
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from megatron_flops.cli._model_args import LoadedModel
from megatron_flops.memory.decoder import DecoderOptions, backend_convention, experts_take_adapters
from megatron_flops.memory.hf_layers import hf_differences
from megatron_flops.model.hf_config import hf_family_of, hf_text_config, is_hf_config


def decoder_options(args: argparse.Namespace, model: LoadedModel) -> tuple[DecoderOptions, tuple[str, ...]]:
    """The decoder's options (the model file's or command line's, then the flags), and what the
    model holds or saves that they cannot express (for ``not_modelled``)."""
    notes: tuple[str, ...] = ()
    if model.megatron_args is not None:
        options = _megatron_options(model.megatron_args)
    elif is_hf_config(model.raw):
        options = DecoderOptions.from_mapping(model.raw, hf=True, hf_family=args.hf_family)
        text = hf_text_config(model.raw)
        assert text is not None  # (a file without a text decoder has no spec)
        notes = hf_differences(text, hf_family_of(text, args.hf_family))
    else:
        options = DecoderOptions.from_mapping(model.raw)
    overrides: dict[str, Any] = {}
    if args.pad_vocab_to_multiple is not None:
        overrides.update(make_vocab_size_divisible_by=args.pad_vocab_to_multiple, padded_vocab_size=None)
    if args.attention_backend is not None:
        overrides["attention_backend"] = backend_convention(args.attention_backend)
    if args.moe_token_dispatcher is not None:
        overrides["moe_token_dispatcher_type"] = args.moe_token_dispatcher
    if args.transformer_impl is not None:
        overrides["transformer_impl"] = args.transformer_impl
    return replace(options, **overrides), notes


def routed_expert_adapters(model: LoadedModel) -> bool:
    """Whether Megatron-Bridge's LoRA can adapt the routed experts megatron-core builds for this
    model (:func:`~megatron_flops.memory.decoder.experts_take_adapters`)."""
    options = _experts_options(model)
    return options is None or experts_take_adapters(options)


def grouped_gemm_experts(model: LoadedModel) -> bool:
    """Whether this model's routed experts are grouped-GEMM ones (``moe_grouped_gemm``)."""
    options = _experts_options(model)
    return options is not None and options.moe_grouped_gemm


def _experts_options(model: LoadedModel) -> DecoderOptions | None:
    """The options that choose the routed experts' module, as ``memory`` reads them (None: a
    Hugging Face config, which has no grouped-GEMM fields: SequentialMLP)."""
    if model.megatron_args is not None:
        return _megatron_options(model.megatron_args)
    return None if is_hf_config(model.raw) else DecoderOptions.from_mapping(model.raw)


def _megatron_options(namespace: SimpleNamespace) -> DecoderOptions:
    """A Megatron-LM command line's options as ``core_transformer_config_from_args`` passes them
    (its valued options, and the switches it carries; Megatron-LM's defaults for the rest)."""
    gated = bool(namespace.swiglu or namespace.quick_geglu)
    fusion = getattr(namespace, "bias_swiglu_fusion" if gated else "bias_gelu_fusion", True)
    return DecoderOptions(
        normalization=namespace.normalization, position_embedding_type=namespace.position_embedding_type,
        max_position_embeddings=namespace.max_position_embeddings, rotary_percent=namespace.rotary_percent,
        hidden_dropout=namespace.hidden_dropout, attention_dropout=namespace.attention_dropout,
        attention_backend=backend_convention(str(namespace.attention_backend)),
        moe_token_dispatcher_type=namespace.moe_token_dispatcher_type,
        moe_router_score_function=namespace.moe_router_score_function,
        moe_router_pre_softmax=getattr(namespace, "moe_router_pre_softmax", False),
        moe_grouped_gemm=getattr(namespace, "moe_grouped_gemm", False),
        moe_use_legacy_grouped_gemm=getattr(namespace, "moe_use_legacy_grouped_gemm", False),
        bias_dropout_fusion=getattr(namespace, "bias_dropout_fusion", True),
        mtp_standalone=bool(getattr(namespace, "mtp_standalone", False)),
        moe_flex_dispatcher_backend=getattr(namespace, "_unread", {}).get("moe_flex_dispatcher_backend", ["deepep"])[0],
        add_bias_linear=getattr(namespace, "add_bias_linear", True),
        add_qkv_bias=getattr(namespace, "add_qkv_bias", False),
        qk_layernorm=getattr(namespace, "qk_layernorm", False),
        bias_activation_fusion=fusion,
        attention_softmax_in_fp32=getattr(namespace, "attention_softmax_in_fp32", False),
        make_vocab_size_divisible_by=namespace.make_vocab_size_divisible_by,
        padded_vocab_size=namespace.padded_vocab_size,
        transformer_impl=namespace.transformer_impl,
    )


def layout_defaults(model: LoadedModel) -> dict[str, Any]:
    """What a Megatron-LM command line says of the layout (flags given override it), else the
    flags' defaults."""
    ns = model.megatron_args
    if ns is None:
        return {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": None, "vpp": None, "sequence_parallel": False,
                "distributed_optimizer": False, "fsdp": False, "megatron_fsdp": None, "params_dtype": "bf16", "micro_batch_size": 1}
    etp = getattr(ns, "_unread", {}).get("expert_tensor_parallel_size")
    strategy = None
    if getattr(ns, "use_megatron_fsdp", False):  # (Megatron-LM's default strategy: no_shard)
        strategy = getattr(ns, "data_parallel_sharding_strategy", None) \
            or getattr(ns, "_unread", {}).get("data_parallel_sharding_strategy", ["no_shard"])[0]
    return {
        "micro_batch_size": ns.micro_batch_size or 1,
        "tp": ns.tensor_model_parallel_size or 1, "pp": ns.pipeline_model_parallel_size or 1,
        "cp": ns.context_parallel_size or 1, "ep": ns.expert_model_parallel_size or 1,
        "etp": _int_flag(model, "--expert-tensor-parallel-size", etp[0]) if etp else None,
        "vpp": model.raw.get("virtual_pipeline_model_parallel_size"),
        "sequence_parallel": bool(getattr(ns, "sequence_parallel", False)),
        "distributed_optimizer": bool(getattr(ns, "use_distributed_optimizer", False)),
        "fsdp": bool(getattr(ns, "use_torch_fsdp2", False)), "megatron_fsdp": strategy,
        "params_dtype": "bf16" if getattr(ns, "bf16", False) else "fp16" if getattr(ns, "fp16", False) else "fp32",
    }


def num_microbatches(model: LoadedModel, *, micro_batch_size: int, dp: int) -> int:
    """Micro-batches per step per DP rank as Megatron-LM's ``validate_args`` derives them: a
    command line's ``--global-batch-size`` / (micro-batch size x DP); one without it (Megatron-LM's
    default global batch is micro-batch size x DP) or without a command line."""
    ns = model.megatron_args
    per_step = micro_batch_size * dp
    if ns is None or ns.global_batch_size is None or per_step < 1:  # (Training/Parallelism refuse < 1)
        return 1
    if ns.global_batch_size % per_step:
        raise ValueError(f"{model.source}: --global-batch-size {ns.global_batch_size} is not divisible by the "
                         f"micro-batch size {micro_batch_size} x DP {dp}")
    return ns.global_batch_size // per_step


def _int_flag(model: LoadedModel, flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{model.source}: {flag} takes an integer, got {value!r}") from None
