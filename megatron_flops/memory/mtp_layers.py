"""The sub-layers of one multi-token-prediction (MTP) depth, as megatron-core builds them (stdlib
only).

A GPT's MTP layer holds one decoder layer (``transformer_layer``) of its last decoder layer's
kind (:func:`~megatron_flops.memory.ssm.mtp_mixer`). megatron-core 0.19's ``HybridModel`` builds
each depth of a hybrid pattern's MTP part after ``/`` (``"M*-M/*-/*-"``: two depths of ``*-``) as
``MultiTokenPredictionLayer`` around a ``HybridStack`` (``mtp_model_layer``, no final norm of its
own): one hybrid layer per symbol, named ``mtp.layers.<depth>.mtp_model_layer.layers.<j>.``, each
as the main decoder's layer of that symbol (Mamba, attention, MLP, MoE...), between the same
``enorm``, ``hnorm``, ``eh_proj`` and ``final_layernorm`` as a GPT's (read from megatron-core
0.19.0's ``multi_token_prediction.py`` and ``hybrid_block.py``; built and run in
``tests/test_memory_hybrid_mtp.py``). 0.16.1's hybrid models have no MTP.

Every MTP depth runs on the last pipeline stage (megatron-core's default placement).
"""

from __future__ import annotations

from megatron_flops.memory.layout import INDEX_BYTES, Parallelism, Training
from megatron_flops.model.spec import ModelSpec


def mtp_kinds(spec: ModelSpec) -> list[tuple[str, str]]:
    """(mixer, feed-forward) of each sub-layer of one MTP depth: one GPT decoder layer, or one
    hybrid layer per symbol of the part after ``/`` (``none`` for the half it lacks)."""
    return [kind for kind, count in spec.mtp_layer_runs for _ in range(count)]


def hybrid_mtp(spec: ModelSpec) -> bool:
    """A hybrid pattern's MTP part after ``/`` (its layers have one sub-block each)."""
    return bool(spec.mtp_num_layers) and any("none" in kind for kind in mtp_kinds(spec))


def mtp_layer_prefix(spec: ModelSpec, depth: int, j: int) -> str:
    """The parameter-name prefix of sub-layer ``j`` of MTP depth ``depth``."""
    if hybrid_mtp(spec):
        return f"mtp.layers.{depth}.mtp_model_layer.layers.{j}."
    return f"mtp.layers.{depth}.transformer_layer."


def last_stage_mtp_kinds(spec: ModelSpec, last: bool) -> list[tuple[str, str]]:
    """Every MTP sub-layer on a model chunk (all depths on the last stage; none elsewhere)."""
    return mtp_kinds(spec) * spec.mtp_num_layers if last else []


def mtp_moe_layers(spec: ModelSpec, last: bool) -> int:
    """MoE layers of every MTP depth on a model chunk (the last stage's; none elsewhere)."""
    return sum(ffn == "moe" for _, ffn in last_stage_mtp_kinds(spec, last))


def mtp_sub_blocks(spec: ModelSpec) -> int:
    """Sub-blocks (mixers and feed-forward parts, each with one TP collective pair) of one MTP
    depth: 2 for a GPT's decoder layer."""
    return sum((mixer != "none") + (ffn != "none") for mixer, ffn in mtp_kinds(spec))


def acceptance_all_gather(spec: ModelSpec, par: Parallelism, training: Training, *, last: bool) -> int:
    """``tp/all_gather`` bytes per micro-batch of megatron-core 0.19's MTP acceptance counts
    (``_compute_mtp_acceptance_counts``, under no_grad): each MTP depth's vocab-parallel argmax
    gathers every TP rank's max logit (activation dtype) and its int64 index [s, b]. Counted for
    a hybrid MTP part only (0.19's; a GPT's MTP layers are 0.16.1's, which has no such count)."""
    if par.tp == 1 or not last or not hybrid_mtp(spec):
        return 0
    tokens = training.seq_length * training.micro_batch_size
    return spec.mtp_num_layers * par.tp * tokens * (training.param_bytes + INDEX_BYTES)


def hybrid_mtp_notes(spec: ModelSpec, par: Parallelism) -> tuple[list[str], list[str]]:
    """(assumptions, unmeasured) of a hybrid MTP part (none for other models)."""
    if not hybrid_mtp(spec):
        return [], []
    assumptions = ["a hybrid pattern's MTP part after '/' as megatron-core 0.19's HybridModel builds it: per depth a "
                   "HybridStack of the part's layers (mtp.layers.N.mtp_model_layer.layers.M) between enorm, hnorm, "
                   "eh_proj and its final norm, and under TP 0.19's acceptance-count all-gather (max logit and int64 "
                   "argmax per token and depth); measured on CPU in megatron-core 0.19.0 (parameters; attention and "
                   "MLP layers' saved tensors, GEMM FLOPs and tp/* traffic at TP 1 and TP 2 with and without sequence "
                   "parallelism)"]
    unmeasured = []
    if par.pp > 1:
        unmeasured.append("a hybrid MTP part under pipeline parallelism: on the last stage with a copy of the word "
                          "embeddings, as megatron-core 0.16.1's GPTModel places MTP layers (measured there); 0.19's "
                          "HybridModel is not run under PP here")
    return assumptions, unmeasured
