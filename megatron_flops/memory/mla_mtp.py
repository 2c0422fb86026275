"""Multi-latent attention (MLA) under tensor parallelism and multi-token prediction (MTP) under
tensor and pipeline parallelism and recompute: what they add to a megatron-core GPT's memory and
traffic beyond a dense decoder layer (stdlib only).

As megatron-core 0.16's local layer spec builds them (measured on CPU with gloo):

- MLA: every projection is column parallel but ``linear_proj`` (row parallel). The down
  projections' outputs (``linear_q_down_proj`` [T, q_lora/TP], ``linear_kv_down_proj`` [T,
  (kv_lora + rope)/TP]) are all-gathered over TP in forward (split again in backward, no
  collective), so the latent norms and the up projections run on whole latents on every rank.
  Backward all-reduces the input gradients of both down projections (the hidden states, twice:
  a dense layer's ``linear_qkv`` once) and of both up projections (the latents).
- MLA with Transformer Engine's spec (``transformer_impl="transformer_engine"``, Megatron-LM's
  default; a formula: no Transformer Engine on CPU): the down projections are ``TELinear`` with
  ``parallel_mode="duplicated"``, whole on every TP rank, their gradients all-reduced over TP
  under sequence parallelism (their ``sequence_parallel`` attribute, in ``finalize_model_grads``'
  coalesced all-reduce); no latent all-gather; only the up projections (or ``linear_q_proj``)
  reduce input gradients; under sequence parallelism the kv latent's RoPE part [T_l, rope] is
  all-gathered over the sequence (reduce-scattered in backward).
- MTP: with PP > 1 the last stage holds a copy of the word embeddings (and learned positions)
  for the MTP layers' inputs, all-reduced with the first stage's over the embedding group like
  a tied output weight (whether or not the output weight is tied). Per MTP layer under TP: the
  vocab-parallel embedding's forward all-reduce, ``eh_proj``'s input gradient [T, 2h] all-reduced
  in backward and its output all-gathered in forward, the decoder layer's collectives, the
  output layer's input gradient and cross-entropy's three fp32 reductions.
- Full recompute (``uniform``) checkpoints each MTP layer after its embedding lookup
  (megatron-core asserts ``recompute_num_layers == 1`` then); ``block`` leaves MTP layers alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.mtp_layers import hybrid_mtp, last_stage_mtp_kinds
from megatron_flops.model.spec import ModelSpec

CE_REDUCTIONS = 3  # max logit, target logit, sum of exponentials (as comm.CE_REDUCTIONS)


TRANSFORMER_IMPLS = ("transformer_engine", "local")
# Mixers that are not multi-latent attention when a model has MLA (``spec.mla``): a hybrid pattern's
# Mamba and MLP-only layers, linear attention; attention and DSA layers are MLA.
NOT_MLA = ("none", "mamba", "gdn", "kda")


def mla_layer_count(kinds: Sequence[tuple[str, str]]) -> int:
    """How many of these (mixer, feed-forward) layers run multi-latent attention (with ``spec.mla``)."""
    return sum(mixer not in NOT_MLA for mixer, _ in kinds)


def check_mla_mtp(spec: ModelSpec, par: Parallelism, *, duplicated: bool) -> None:
    """ValueError for MLA/MTP layouts megatron-core refuses or these figures do not model
    (``duplicated``: Transformer Engine's spec, down projections whole on every TP rank)."""
    if spec.mtp_num_layers and spec.hidden_size % par.tp:
        raise ValueError(f"multi-token prediction splits eh_proj's hidden_size={spec.hidden_size} outputs over TP: "
                         f"not divisible by --tp {par.tp}")
    mla = spec.mla
    if mla is None or par.tp == 1 or duplicated:
        return
    # NB: ColumnParallelLinear splits every output over TP (megatron-core's divide() asserts).
    widths = {"q_lora_rank": mla.q_lora_rank or 0,
              "kv_lora_rank + qk_pos_emb_head_dim": mla.kv_lora_rank + mla.qk_pos_emb_head_dim}
    for name, value in widths.items():
        if value % par.tp:
            raise ValueError(f"multi-latent attention splits {name}={value} over TP: not divisible by --tp {par.tp}")


def fully_recomputed_layers(recompute: RecomputeSpec | None, num_layers: int) -> int:
    """Layers of a model chunk that full recompute re-runs: all (``uniform``) or the first
    ``recompute_num_layers`` (``block``)."""
    if recompute is None or recompute.granularity != "full":
        return 0
    if recompute.method == "block":
        return min(recompute.num_layers or 0, num_layers)
    return num_layers


def mtp_recomputed(spec: ModelSpec, recompute: RecomputeSpec | None) -> bool:
    """Whether full recompute checkpoints the MTP layers (``uniform``; ValueError for a group of
    more than one layer, which megatron-core refuses for MTP)."""
    if not spec.mtp_num_layers or recompute is None or recompute.granularity != "full":
        return False
    if recompute.method == "block":
        return False
    if (recompute.num_layers or 1) != 1:
        raise ValueError("megatron-core checkpoints multi-token prediction layers only with "
                         "recompute_num_layers=1 under --recompute-method uniform")
    return True


def mla_mtp_tensor_parallel(spec: ModelSpec, par: Parallelism, training: Training, *, num_layers: int,
                            rerun: int, last: bool, loss: bool, recompute: RecomputeSpec | None,
                            learned_positions: bool, duplicated: bool) -> dict[str, int]:
    """``tp/*`` payload bytes per micro-batch of one model chunk beyond
    :func:`~megatron_flops.memory.comm.tensor_parallel_activations`'s dense layers and main output
    (TP > 1): the ``num_layers`` MLA layers' latent collectives and extra input-gradient reductions
    (``rerun`` of them run their forward twice; a hybrid pattern's Mamba and MLP layers are none:
    :func:`mla_layer_count`), and where ``last`` (the MTP stage) every MTP layer, where ``loss``
    (the last stage) their losses' cross-entropy reductions. Activations in
    the parameter dtype, cross-entropy's reductions in fp32. ``duplicated``: Transformer Engine's
    MLA spec (see the module doc)."""
    if par.tp == 1:
        return {}
    tokens = training.seq_length * training.micro_batch_size
    mtp = spec.mtp_num_layers if last else 0
    recomputed = mtp_recomputed(spec, recompute)  # (a checkpointed depth re-runs every one of its layers)
    out: dict[str, int] = {}
    mla_tp = _mla_tp_duplicated if duplicated else _mla_tp
    # (a hybrid MTP part's MLA layers: those of its mixers that are attention, :mod:`.mtp_layers`)
    mtp_mla = mla_layer_count(last_stage_mtp_kinds(spec, last))
    for part in (mla_tp(spec, par.sequence_parallel, tokens, num_layers + mtp_mla,
                        rerun + (mtp_mla if recomputed else 0)),
                 _mtp_tp(spec.hidden_size * tokens, par.sequence_parallel, mtp, mtp if recomputed else 0,
                         learned_positions),
                 _mtp_output_tp(spec.hidden_size * tokens, par.sequence_parallel, spec.mtp_num_layers if loss else 0)):
        for key, count in part.items():
            out[key] = out.get(key, 0) + count * training.param_bytes
    if loss and spec.mtp_num_layers:
        out["tp/all_reduce"] = out.get("tp/all_reduce", 0) + spec.mtp_num_layers * tokens * 4 * CE_REDUCTIONS
    return {k: v for k, v in out.items() if v}


def _mla_tp(spec: ModelSpec, sp: bool, tokens: int, layers: int, rerun: int) -> dict[str, int]:
    """Elements per micro-batch of ``layers`` MLA layers beyond a dense attention's.

    Without sequence parallelism: the q and kv latents all-gathered in forward; in backward the
    second down projection's input (the hidden states) and both up projections' inputs all-reduced.
    Under sequence parallelism every column-parallel layer all-gathers its input in forward and
    again in backward and reduce-scatters its input gradient: the second down projection (the
    hidden states) and both up projections (the latents, this rank's [s/TP] slice); the latents
    are all-gathered over the hidden dimension in forward and, scattered back to [s/TP] slices,
    their gradients all-gathered in backward (kv's RoPE part stays whole)."""
    mla = spec.mla
    if mla is None or not layers:
        return {}
    h, q, kv, rope = spec.hidden_size, mla.q_lora_rank or 0, mla.kv_lora_rank, mla.qk_pos_emb_head_dim
    if not sp:
        return {"tp/all_gather": (layers + rerun) * tokens * (q + kv + rope),
                "tp/all_reduce": layers * tokens * (h + q + kv)}
    forward = tokens * (h + q + (kv + rope) + q + kv)  # 2nd down input, latents, up inputs
    backward = tokens * (h + q + kv + q + kv)  # 2nd down input again, latent grads, up inputs again
    return {"tp/all_gather": layers * (forward + backward) + rerun * forward,
            "tp/reduce_scatter": layers * tokens * (h + q + kv)}


def _mla_tp_duplicated(spec: ModelSpec, sp: bool, tokens: int, layers: int, rerun: int) -> dict[str, int]:
    """As :func:`_mla_tp` for Transformer Engine's spec (a formula): the down projections
    duplicated, so no latent all-gather and no reduction of their input gradients (the hidden
    states' gradient a dense layer's ``linear_qkv`` reduces: counted there, taken off here with a
    q latent; ``linear_q_proj`` reduces it as ``linear_qkv`` does).

    Without sequence parallelism: the up projections' input gradients all-reduced [T, q] and
    [T, kv]. Under sequence parallelism: each up projection all-gathers its latent input in
    forward and again in backward and reduce-scatters its gradient, and the RoPE part of the kv
    latent [T_l, rope] is all-gathered (its gradient reduce-scattered)."""
    mla = spec.mla
    if mla is None or not layers:
        return {}
    q, kv, rope = mla.q_lora_rank or 0, mla.kv_lora_rank, mla.qk_pos_emb_head_dim
    h = spec.hidden_size if q else 0  # the dense linear_qkv's hidden-state terms this layer lacks
    if not sp:
        return {"tp/all_reduce": layers * tokens * (q + kv - h)}
    return {"tp/all_gather": layers * tokens * (rope + 2 * (q + kv - h)) + rerun * tokens * (rope + q + kv - h),
            "tp/reduce_scatter": layers * tokens * (rope + q + kv - h)}


def _mtp_tp(hidden: int, sp: bool, mtp: int, rerun: int, learned_positions: bool) -> dict[str, int]:
    """Elements per micro-batch of ``mtp`` MTP layers (``rerun`` of them recomputed) beyond their
    MLA terms: the embedding, ``eh_proj`` [T, 2h] -> [T, h/TP] and its output's all-gather, a
    dense decoder layer's collectives (``hidden``: elements of one [s, b, h] activation; the
    output layer's calls: :func:`_mtp_output_tp`).

    Without sequence parallelism: all-reduces of the embedding (forward), eh_proj's input
    gradient and the layer (2 forward, 2 backward); eh_proj's
    output all-gathered. Under sequence parallelism: the embedding reduce-scattered (learned
    positions: all-reduced, then sliced) and its gradient all-gathered; eh_proj all-gathers its
    input twice and reduce-scatters its gradient, its output all-gathered over the hidden
    dimension and the slice's gradient all-gathered back; the layer as a dense one (6 gathers, 4
    reduce-scatters)."""
    if not mtp:
        return {}
    if not sp:
        return {"tp/all_reduce": mtp * (1 + 2 + 4) * hidden + rerun * 2 * hidden,
                "tp/all_gather": (mtp + rerun) * hidden}
    return {"tp/all_gather": mtp * (1 + 2 * 2 + 2 + 6) * hidden + rerun * (2 + 1 + 2) * hidden,
            "tp/reduce_scatter": mtp * ((0 if learned_positions else 1) + 2 + 4) * hidden + rerun * 2 * hidden,
            "tp/all_reduce": mtp * hidden if learned_positions else 0}


def _mtp_output_tp(hidden: int, sp: bool, mtp: int) -> dict[str, int]:
    """Elements per micro-batch of the ``mtp`` MTP depths' output-layer calls, on the last stage
    (a standalone MTP stage's too): without sequence parallelism the input gradient's all-reduce;
    under it 2 all-gathers and 1 reduce-scatter each, as the main output layer's."""
    if not sp:
        return {"tp/all_reduce": mtp * hidden}
    return {"tp/all_gather": 2 * mtp * hidden, "tp/reduce_scatter": mtp * hidden}


def mla_mtp_assumptions(spec: ModelSpec, par: Parallelism, *, duplicated: bool) -> list[str]:
    """What can make an MLA/MTP figure differ from a real run (the report's ``assumptions``)."""
    out = []
    if spec.mla is not None and par.tp > 1 and not duplicated:
        out.append("multi-latent attention as megatron-core's local spec splits it over TP (--transformer-impl "
                   "local, measured): the q and kv down projections column parallel, their outputs all-gathered "
                   "(tp/all_gather); Megatron-LM's default Transformer Engine spec keeps them whole on every TP rank "
                   "(parallel_mode='duplicated')")
    if spec.mtp_num_layers and par.tp > 1 and not hybrid_mtp(spec):
        out.append("multi-token prediction layers as megatron-core 0.16.1's GPTModel runs them under TP; 0.19 also "
                   "counts MTP acceptance (under no grad): each depth's vocab-parallel argmax all-gathers every TP "
                   "rank's max logit and int64 index per token, TP x tokens x (activation bytes + 8) more "
                   "tp/all_gather per depth and micro-batch, not counted here (a hybrid MTP part, 0.19's, counts it)")
    if spec.mtp_num_layers and par.pp > 1:
        out.append("multi-token prediction on the last pipeline stage (megatron-core's default placement), with a "
                   "copy of the word embeddings there, all-reduced with the first stage's (embd/all_reduce)")
    return out


def mla_unmeasured(spec: ModelSpec, par: Parallelism, *, duplicated: bool, down_bias: bool = False) -> list[str]:
    """The MLA figures that are formulas no CPU step could check (Transformer Engine's spec under
    TP; ``down_bias``: Hugging Face's biases on the down projections under TP, which no
    megatron-core MLA has)."""
    if spec.mla is None or par.tp == 1:
        return []
    out = []
    if down_bias:
        out.append("the multi-latent attention down projections' biases of Hugging Face's attention_bias (q_a_proj, "
                   "kv_a_proj_with_mqa; megatron-core's MLA has none, so no TP run has them): under TP split as their "
                   "weights' rows (--transformer-impl local) or whole on every rank (Transformer Engine's duplicated "
                   "layers, their gradients all-reduced over TP under sequence parallelism); measured at TP 1 "
                   "against transformers")
    if not duplicated:
        return out
    return out + ["multi-latent attention as Transformer Engine's spec builds it (--transformer-impl transformer_engine, "
            "Megatron-LM's default; no Transformer Engine on CPU, --transformer-impl local is measured): the q and "
            "kv down projections whole on every TP rank (parallel_mode='duplicated': their weights, gradients and "
            "optimizer state not split; gradients all-reduced over TP under sequence parallelism), no latent "
            "all-gather, the TP traffic of the up projections only; activations as the local spec saves them"]
