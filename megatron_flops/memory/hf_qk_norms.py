"""Hugging Face q/k norms that megatron-core has no module for, and falcon's ALiBi (stdlib only).

- ``per_head_weight``: cohere's ``use_qk_norm`` (transformers' ``CohereLayerNorm``): a LayerNorm over
  head_dim with a weight per head, [heads, head_dim] on q and [groups, head_dim] on k, no bias.
- ``per_head_layernorm``: stablelm's ``qk_layernorm`` (``StableLmLayerNormPerHead``): one torch
  ``nn.LayerNorm`` over head_dim per head (a [head_dim] weight each, no bias), heads of q and groups of k.
- ``whole_projection``: olmo2's and olmo3's ``q_norm``/``k_norm`` (``Olmo2RMSNorm``): an RMSNorm over
  the whole q [heads x head_dim] and k [groups x head_dim] projections, weights of those sizes.

All are counted as transformers' modules compute them, put where megatron-core's ``q_layernorm`` and
``k_layernorm`` are (after ``linear_qkv``, before RoPE). cohere's and olmo2's ops are composite (python
on torch tensors): autograd saves the same tensors on CPU and CUDA; stablelm's per-head LayerNorms
save what megatron-core's LayerNorm over head_dim does (each head's input, a view, and its statistics).
Measured on CPU against transformers' layers and in megatron-core's layer (tests/test_memory_hf_qk_norms.py). Falcon's ALiBi adds no saved tensor to attention without
position embeddings (:func:`hf_attention_notes` prints which kernel that assumes).
"""

from __future__ import annotations

from megatron_flops.memory.layout import FP32_BYTES

PER_HEAD_WEIGHT = "per_head_weight"
PER_HEAD_LAYERNORM = "per_head_layernorm"
WHOLE_PROJECTION = "whole_projection"
HF_QK_NORMS = (PER_HEAD_WEIGHT, PER_HEAD_LAYERNORM, WHOLE_PROJECTION)
_FAMILIES = {"cohere": PER_HEAD_WEIGHT, "stablelm": PER_HEAD_LAYERNORM, "olmo2": WHOLE_PROJECTION,
             "olmo3": WHOLE_PROJECTION}


def hf_qk_norm_kind(family: str) -> str | None:
    """The family's q/k norm kind (given its q/k norms are on), or None: megatron-core's."""
    return _FAMILIES.get(family)


def qk_norm_tensors(kind: str, prefix: str, *, heads: int, groups: int, head_dim: int, tp: int) \
        -> list[tuple[str, int, bool, int | None]]:
    """(name, numel on one TP rank, whole on every TP rank, dim 0: None for 1-D) of the q and k norms'
    weights under ``prefix`` (``...self_attention.``), named as megatron-core names its q/k norms (a
    weight per q and per k channel, no bias: [heads, head_dim] for cohere, 1-D for olmo2/olmo3; stablelm:
    a [head_dim] weight per head, ``q_layernorm.norms.{i}.weight`` as transformers' ModuleList names them).
    NB: under TP each rank holds its heads' rows (cohere, stablelm; olmo2/olmo3 are refused:
    :func:`qk_norm_reason`), so the weights are not TP-replicated and their gradients are not all-reduced over TP."""
    if kind == PER_HEAD_LAYERNORM:
        return [(prefix + f"{n}_layernorm.norms.{i}.weight", head_dim, False, None)
                for n, rows in (("q", heads), ("k", groups)) for i in range(rows // tp)]
    per_head = kind == PER_HEAD_WEIGHT
    return [(prefix + f"{n}_layernorm.weight", rows * head_dim // tp, False, rows // tp if per_head else None)
            for n, rows in (("q", heads), ("k", groups))]


def qk_norm_saved_bytes(kind: str, *, tokens: int, heads: int, groups: int, head_dim: int, act: int,
                        trainable: bool) -> int | None:
    """Bytes the q and k norms save for backward in one layer, ``heads`` and ``groups`` on this TP
    rank, their input requiring grad; ``trainable``: their weights train (else ``weight * x`` keeps
    only the weight, which is a parameter and not counted). None: what megatron-core's LayerNorm over
    head_dim saves (stablelm: each head's ``native_layer_norm`` keeps its input, a view of q or k, and
    mean and rstd per (token, head) row, with a trainable weight or a frozen one)."""
    if kind == PER_HEAD_LAYERNORM:
        return None
    rows = tokens * (heads + groups)  # (token, head) rows of head_dim
    if kind == PER_HEAD_WEIGHT:
        # CohereLayerNorm, in fp32 whatever the input dtype: x - mean, twice (pow keeps the first, the
        # product with rstd the second), rstd [rows] and, for the weight's gradient, (x - mean) * rstd.
        # NB: the input is not kept (mean's and sub's backward need none of it); in 16 bits
        # weight.to(float32) is a copy [heads or groups, head_dim] that the product keeps.
        weight_copies = (heads + groups) * head_dim * FP32_BYTES if act < FP32_BYTES else 0
        return rows * ((3 if trainable else 2) * head_dim + 1) * FP32_BYTES + weight_copies
    if kind == WHOLE_PROJECTION:
        # Olmo2RMSNorm over [tokens, heads x head_dim] and [tokens, groups x head_dim]: its fp32 input
        # (the input itself in fp32, its fp32 copy in 16 bits; pow and the product with rstd keep it),
        # rstd per token (two: q's and k's) and, for the weight's gradient, x * rstd.
        # NB: the weight (a 16-bit parameter) is kept as it is: type promotion inside the product copies nothing.
        # NB: in megatron-core's layer q and k are strided views of linear_qkv's output, so flattening them
        # copies: the fp32 input kept is never that output's storage.
        return rows * head_dim * (2 if trainable else 1) * FP32_BYTES + 2 * tokens * FP32_BYTES
    raise ValueError(f"q/k norm kind must be one of {HF_QK_NORMS}, got {kind!r}")


def qk_norm_reason(kind: str | None, tp: int) -> str | None:
    """Why this layout is refused: olmo2's and olmo3's whole-projection norms under TP."""
    if kind == WHOLE_PROJECTION and tp > 1:
        return (f"olmo2's and olmo3's q/k norms over the whole q and k projections need statistics over every head, "
                f"and no framework splits them over TP (megatron-core has no such norm; transformers' TP plan "
                f"gathers q, k and v whole on every rank and runs attention unsplit): --tp {tp} is not modelled, "
                "give --tp 1")
    return None


def hf_attention_notes(*, qk_norm: str | None, alibi: bool, fused: bool, tp: int, activations: bool) \
        -> tuple[list[str], list[str]]:
    """(assumptions, unmeasured): how the Hugging Face q/k norms of kind ``qk_norm`` (None: none)
    and ALiBi are counted; ``fused``: attention as a fused kernel (else megatron-core's local one)."""
    assumptions, unmeasured = [], []
    if qk_norm is not None:
        what = {PER_HEAD_WEIGHT: "cohere's q/k LayerNorms over head_dim with a weight per head (CohereLayerNorm)",
                PER_HEAD_LAYERNORM: "stablelm's q/k LayerNorms, one per head without bias (StableLmLayerNormPerHead)",
                WHOLE_PROJECTION: "olmo2/olmo3's q/k RMSNorms over the whole q and k projections (Olmo2RMSNorm)",
                }[qk_norm]
        if activations and qk_norm == PER_HEAD_LAYERNORM:
            assumptions.append(f"{what} saved as megatron-core's q_layernorm/k_layernorm LayerNorms over head_dim "
                               "(each head's torch LayerNorm keeps the same input and statistics)")
        elif activations:
            assumptions.append(f"{what} saved as transformers computes them (composite fp32 ops: the same tensors on "
                               "CPU and CUDA), in megatron-core's q_layernorm/k_layernorm places")
        if tp > 1:
            unmeasured.append(f"{what} under TP {tp}: each rank holds and normalises its own heads' rows (no framework "
                              "has this layer under TP)")
    if alibi and activations:
        assumptions.append(_alibi_assumption(fused))
    return assumptions, unmeasured


def _alibi_assumption(fused: bool) -> str:
    """How falcon's ALiBi (``alibi: true``) is counted: as attention without position embeddings.
    NB: the bias is added to the scores and no op saves it (an add's backward needs neither input)."""
    if not fused:
        return ("ALiBi (falcon) added to the scores before megatron-core's local softmax, which no op saves: the "
                "bytes of attention without position embeddings (measured against transformers' eager "
                "FalconAttention)")
    return ("ALiBi (falcon) computed inside the fused kernel from per-head slopes (FlashAttention-2's alibi_slopes, "
            "Transformer Engine's alibi bias type): nothing saved beyond the kernel's; transformers' sdpa path "
            "instead materialises a [b, heads, s, s] bias in the activation dtype that its kernel keeps once per "
            "micro-batch (not counted)")
