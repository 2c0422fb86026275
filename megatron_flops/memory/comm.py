"""Bytes each GPU hands to collectives in one training step of a megatron-core GPT (stdlib only).

NB: payload = the bytes of the tensor handed to the collective on this rank: the all-reduce
tensor, the reduce-scatter input, the all-gather output, the all-to-all input, and for pipeline
point-to-point the bytes sent plus the bytes received. A bus-bandwidth figure (what a ring moves
per GPU) is ``payload x (n - 1) / n`` for all-gather/reduce-scatter and twice that for
all-reduce; it is not what these keys hold. Not counted: collectives on one-rank groups and
one-element ones (loss averaging, grad norm, found-inf). Keys are ``<group>/<kind>``:

- ``dp/all_reduce`` (DDP) or ``dp/reduce_scatter`` + ``dp/all_gather`` (distributed optimizer):
  the gradient buffer (``grad_reduce_in_fp32``: fp32), and the parameter buffer after the step,
  padding included, once per step (the all-gather twice with expert-parallel buffers: see
  :func:`data_parallel_bytes`); ``expt_dp/...`` the same for expert-parallel buffers.
- ``embd/all_reduce``: the tied embedding/output weight's gradient between the first and the
  last pipeline stage (PP > 1; none when that weight is frozen); with multi-token prediction the
  last stage's copy of the word embeddings, tied or not (:mod:`~megatron_flops.memory.mla_mtp`).
- ``tp/all_reduce``, ``tp/all_gather``, ``tp/reduce_scatter``, per micro-batch: [s, b, h]
  activations and their gradients (:func:`tensor_parallel_activations`; full recompute runs the
  forward's collectives again) and vocab-parallel cross-entropy's three fp32 [s, b] reductions;
  once per step the gradients of the weights every TP rank holds whole, under sequence
  parallelism (:func:`tp_replicated_numel`). Multi-latent attention's latent all-gathers and
  multi-token prediction's layers: :func:`~megatron_flops.memory.mla_mtp.mla_mtp_tensor_parallel`.
- ``pp/send_recv``, per micro-batch and model chunk: the [s, b, h] activation ([s/TP, b, h] under
  sequence parallelism) received from the previous virtual stage and its gradient sent back, the
  activation sent to the next and its gradient received.
- ``ep/all_to_all`` (alltoall dispatcher), per MoE layer and micro-batch: the routed tokens
  [s*b*topk, h] and their probabilities [s*b*topk] to the experts and back, forward and backward.
  NB: the bytes a rank sends back depend on how many tokens it received; the figure assumes
  balanced routing (every rank receives s*b*topk tokens), which the EP group's total always is;
  :func:`~megatron_flops.memory.moe.all_to_all_range` bounds it per rank.
- ``tp_ep/all_gather``, ``tp_ep/reduce_scatter`` (the expert TP x EP group), per MoE layer and
  micro-batch: each rank's token count per expert (alltoall), or the tokens, probabilities and
  routing map gathered and the output reduce-scattered (allgather); see
  :func:`~megatron_flops.memory.moe.moe_communication`.
- ``cp/send_recv`` (CP > 1): a formula, not measured (see :func:`step_communication`);
  ``cp/all_to_all``: Mamba layers' sequence-to-head all-to-alls (:func:`~megatron_flops.memory.ssm.mamba_cp_all_to_all`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from megatron_flops.memory.decoder import DecoderOptions, Param, padded_vocab
from megatron_flops.memory.dsa_tp import dsa_tensor_parallel
from megatron_flops.memory.layout import INDEX_BYTES, Parallelism, Training
from megatron_flops.memory.mla_mtp import (fully_recomputed_layers, mla_layer_count, mla_mtp_tensor_parallel,
                                           mtp_recomputed)
from megatron_flops.memory.moe import moe_communication, rerun_moe_layers
from megatron_flops.memory.linear_cp import CP_MIXERS, linear_cp_communication
from megatron_flops.memory.ssm import mamba_cp_all_to_all, missing_blocks
from megatron_flops.memory.mtp_layers import (acceptance_all_gather, last_stage_mtp_kinds, mtp_moe_layers,
                                              mtp_sub_blocks)
from megatron_flops.memory.states import Bucket
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.model.spec import ModelSpec

CE_REDUCTIONS = 3  # max logit, target logit, sum of exponentials


def data_parallel_bytes(
    buffers: Mapping[str, Sequence[Bucket]], par: Parallelism, training: Training, group_sizes: Mapping[str, int]
) -> dict[str, int]:
    """Once per step: ``buffers`` maps a group (``dp``, ``expt_dp``) to its buckets on this rank."""
    out: dict[str, int] = {}
    # NB: megatron-core builds one distributed optimizer for dense and one for expert-parallel
    # parameters; without overlap_param_gather each one's step all-gathers every buffer of the
    # model chunks (DistributedOptimizer.step_with_ready_grads), so with expert-parallel buffers
    # every parameter buffer is gathered twice per step.
    gathers = 2 if any(buffers.get("expt_dp", ())) else 1
    for group, buckets in buffers.items():
        numel = sum(b.numel for b in buckets)
        if group_sizes[group] == 1 or numel == 0:
            continue
        if par.distributed_optimizer:
            out[f"{group}/reduce_scatter"] = numel * training.grad_bytes
            out[f"{group}/all_gather"] = gathers * numel * training.param_bytes
        else:
            out[f"{group}/all_reduce"] = numel * training.grad_bytes
    return out


def tensor_parallel_activations(options: DecoderOptions, par: Parallelism, num_layers: int, rerun: int,
                                 first: bool, last: bool) -> dict[str, int]:
    """[s, b, h] activations (or their gradients) per micro-batch that one model chunk hands to
    the TP group's collectives, by ``tp/<kind>``. ``rerun`` layers run their forward twice (full
    recompute).

    Without sequence parallelism: ``all_reduce`` of ``linear_proj`` and ``linear_fc2`` outputs
    (forward) and of ``linear_qkv`` and ``linear_fc1`` input gradients (backward), the embedding
    output (forward) and the output layer's input gradient (backward).

    With sequence parallelism (megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication``):
    each column-parallel layer (``linear_qkv``, ``linear_fc1``, ``output_layer``) all-gathers
    its input in forward, all-gathers it again for the weight gradient and reduce-scatters its
    input gradient in backward; each row-parallel layer (``linear_proj``, ``linear_fc2``)
    reduce-scatters its output in forward and all-gathers its output gradient in backward. The
    embedding reduce-scatters its output (RoPE or no positions; learned positions: all-reduce the
    word embeddings, then keep this rank's slice) and all-gathers the gradient in backward.
    """
    if not par.sequence_parallel:
        return {"tp/all_reduce": 4 * num_layers + 2 * rerun + first + last}
    learned = options.position_embedding_type == "learned_absolute"
    return {
        "tp/all_gather": 6 * num_layers + 2 * rerun + 2 * last + first,
        "tp/reduce_scatter": 4 * num_layers + 2 * rerun + last + (first and not learned),
        "tp/all_reduce": int(first and learned),
    }


def tp_replicated_numel(buffers: Mapping[str, Sequence[Bucket]], par: Parallelism, options: DecoderOptions, *,
                        fused_latent_norms: bool = False) -> int:
    """Gradient elements megatron-core's ``finalize_model_grads`` all-reduces over TP once per
    step, in one coalesced tensor: weights every TP rank holds whole (norms, row-parallel
    biases, router, shared-expert gate, Transformer Engine's duplicated MLA down projections)
    under sequence parallelism, and the q/k norms with ``qk_layernorm`` (always, matched by name,
    but for cohere's and stablelm's, split by head over TP: :mod:`.hf_qk_norms`;
    ``fused_latent_norms``: Transformer Engine's MLA spec, whose latent norms are the up
    projections' ``layer_norm_weight``, which the name match misses). NB: counted from the
    gradient buffers (trainable parameters)."""
    def reduced(p: Param) -> bool:
        qk = options.qk_layernorm and not fused_latent_norms and p.tp_replicated \
            and ("q_layernorm" in p.name or "k_layernorm" in p.name)
        return qk or (par.sequence_parallel and p.tp_replicated)

    return sum(p.numel for buckets in buffers.values() for b in buckets for p, _, _ in b.params if reduced(p))


def step_communication(
    spec: ModelSpec,
    options: DecoderOptions,
    par: Parallelism,
    training: Training,
    *,
    pp_rank: int,
    buffers: Mapping[str, Sequence[Bucket]],
    recompute: RecomputeSpec | None = None,
) -> dict[str, int]:
    """Payload bytes per ``group/kind`` on one GPU of pipeline rank ``pp_rank`` for one step."""
    out = data_parallel_bytes(buffers, par, training, {"dp": par.dp * par.cp, "expt_dp": par.expert_dp})
    replicated = tp_replicated_numel(buffers, par, options,
                                     fused_latent_norms=spec.mla is not None and options.duplicated_mla_down)
    if par.tp > 1 and replicated > 1:
        out["tp/all_reduce"] = replicated * training.grad_bytes
    hidden = training.seq_length * training.micro_batch_size * spec.hidden_size * training.param_bytes  # [s, b, h]
    m = training.num_microbatches
    add = lambda key, value: out.__setitem__(key, out.get(key, 0) + value) if value else None  # noqa: E731
    add("embd/all_reduce", embedding_all_reduce(spec, options, par, training, pp_rank=pp_rank, buffers=buffers))
    kinds = spec.layers  # (mixer, ffn) per layer, expanded once
    for chunk in range(par.num_chunks):
        layers = par.chunk_layers(spec.num_layers, pp_rank, chunk)
        first, last = par.is_first_stage(pp_rank, chunk), par.is_last_stage(pp_rank, chunk)
        mtp_here = par.holds_mtp(pp_rank, chunk)  # (the last stage, or a standalone MTP stage)
        if par.pp > 1:
            # Activation in and its gradient out (not the first virtual stage), activation out
            # and its gradient in (not the last).
            # NB: under sequence parallelism each TP rank sends its slice [s/TP, b, h].
            sp = par.tp if par.sequence_parallel else 1
            # NB: under variable_seq_lengths or mtp_standalone (a flag, or a layout's MTP stage apart
            # from the loss's) each transfer's shape goes first (3 int64).
            standalone = options.mtp_standalone or par.mtp_stage is not None
            shape = 3 * INDEX_BYTES if options.variable_seq_lengths or standalone else 0
            # NB: a standalone MTP stage and those after it send [(1 + k) s, b, h]: the decoder's
            # hidden states and every MTP depth's, concatenated (MultiTokenPredictionBlock).
            wide = lambda on: (1 + spec.mtp_num_layers) if on else 1  # noqa: E731
            stage = chunk * par.pp + pp_rank
            received = wide(par.mtp_stage is not None and stage - 1 >= par.mtp_stage)
            sent = wide(par.sends_mtp(pp_rank, chunk))
            add("pp/send_recv", m * 2 * ((not first) * (received * hidden // sp + shape)
                                         + (not last) * (sent * hidden // sp + shape)))
        moe_layers = sum(kinds[i][1] == "moe" for i in layers) + mtp_moe_layers(spec, mtp_here)
        if par.tp > 1:
            for key, value in _tensor_parallel_chunk(spec, options, par, training, layers=layers, first=first,
                                                     last=last, mtp_here=mtp_here, recompute=recompute).items():
                add(key, m * value)
        if par.cp > 1:
            for key, value in _context_parallel_chunk(spec, par, training, layers=layers, mtp_here=mtp_here,
                                                      recompute=recompute).items():
                add(key, m * value)
        if moe_layers:
            rerun_moe = rerun_moe_layers(spec, recompute, layers, last=mtp_here)
            for key, value in moe_communication(spec, options, par, training, moe_layers, rerun_moe).items():
                add(key, m * value)
    return out


def _tensor_parallel_chunk(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *,
                           layers: range, first: bool, last: bool, mtp_here: bool,
                           recompute: RecomputeSpec | None) -> dict[str, int]:
    """``tp/*`` payload bytes per micro-batch of one model chunk's activations (TP > 1): its dense
    sub-blocks (:func:`tensor_parallel_activations`), the MTP depths where they are (``mtp_here``:
    the last stage, or a standalone MTP stage), the loss's reductions (``last``), MLA's and DSA's
    own collectives."""
    out: dict[str, int] = {}
    add = lambda key, value: out.__setitem__(key, out.get(key, 0) + value) if value else None  # noqa: E731
    kinds = spec.layers
    hidden = training.seq_length * training.micro_batch_size * spec.hidden_size * training.param_bytes
    rerun = fully_recomputed_layers(recompute, len(layers))
    for key, count in tensor_parallel_activations(options, par, len(layers), rerun, first, last).items():
        add(key, hidden * count)
    # (a hybrid layer has one sub-block: half a layer's traffic, its re-run forward's too)
    for key, count in tensor_parallel_activations(options, par, missing_blocks(kinds, layers),
                                                  missing_blocks(kinds, layers[:rerun]), False, False).items():
        add(key, -hidden * count // 2)
    # (MTP: each depth priced as a decoder layer's 2 sub-blocks; a hybrid MTP part has its own count)
    extra = (mtp_sub_blocks(spec) - 2) * spec.mtp_num_layers if mtp_here else 0
    extra_rerun = abs(extra) if mtp_recomputed(spec, recompute) else 0
    for key, count in tensor_parallel_activations(options, par, abs(extra), extra_rerun, False, False).items():
        add(key, hidden * count // 2 * (1 if extra > 0 else -1))
    add("tp/all_gather", acceptance_all_gather(spec, par, training, last=last))
    if last:
        add("tp/all_reduce", training.seq_length * training.micro_batch_size * 4 * CE_REDUCTIONS)
    learned = options.position_embedding_type == "learned_absolute"
    chunk_kinds = [kinds[i] for i in layers]  # (MLA: only the attention layers of a hybrid pattern)
    for key, value in mla_mtp_tensor_parallel(spec, par, training, num_layers=mla_layer_count(chunk_kinds),
                                              rerun=mla_layer_count(chunk_kinds[:rerun]), last=mtp_here, loss=last,
                                              recompute=recompute, learned_positions=learned,
                                              duplicated=options.duplicated_mla_down).items():
        add(key, value)
    for key, value in dsa_tensor_parallel(spec, par, training, layers=list(layers), last=mtp_here,
                                          recompute=recompute).items():
        add(key, value)
    return out


def _context_parallel_chunk(spec: ModelSpec, par: Parallelism, training: Training, *, layers: range,
                            mtp_here: bool, recompute: RecomputeSpec | None) -> dict[str, int]:
    """``cp/*`` (and DSA's ``tp/*`` under CP) payload bytes per micro-batch of one model chunk's
    layers and, where they are (``mtp_here``), its MTP depths (CP > 1).

    NB: a formula, not measured (no context-parallel attention on CPU): Transformer Engine's ring
    attention passes each layer's K and V [s/CP, b, groups/TP, d] round the CP ring, CP-1 steps
    forward (again in a re-run forward), and K, V and their gradients backward. A hybrid
    pattern's Mamba layers all-to-all instead (:func:`~.ssm.mamba_cp_all_to_all`, forward, backward and a full recompute's rerun);
    its MLP-only layers pass nothing. GDN and DSA layers: megatron-core 0.19.0's own all-to-alls
    and all-gathers (:mod:`.linear_cp`)."""
    out: dict[str, int] = {}
    add = lambda key, value: out.__setitem__(key, out.get(key, 0) + value) if value else None  # noqa: E731
    act, tokens = training.param_bytes, training.seq_length * training.micro_batch_size
    kv = 2 * tokens * (spec.num_query_groups // par.tp) * spec.kv_channels * act
    rerun = fully_recomputed_layers(recompute, len(layers))
    mixers = [spec.layers[i][0] for i in layers]
    # (the MTP depths too: every layer of each, :mod:`.mtp_layers`, re-run as
    # :func:`~.mla_mtp.mtp_recomputed` says)
    mtp = [mixer for mixer, _ in last_stage_mtp_kinds(spec, mtp_here)]
    mtp_rerun = len(mtp) if mtp_recomputed(spec, recompute) else 0
    no_ring = ("mamba", "none", *CP_MIXERS)
    ring = sum(mixer not in no_ring for mixer in mixers + mtp)
    # NB: a re-run forward (full recompute, or selective ``core_attn``: the checkpointed attention
    # kernel) passes K and V round the ring again.
    selective_attn = recompute is not None and recompute.granularity == "selective" and "core_attn" in recompute.modules
    ring_reruns = ring if selective_attn else sum(mixer not in no_ring for mixer in mixers[:rerun] + mtp[:mtp_rerun])
    add("cp/send_recv", (ring * 3 + ring_reruns) * (par.cp - 1) * 2 * kv)
    passes = sum(2 * (mixer == "mamba") for mixer in mixers + mtp) \
        + sum(mixer == "mamba" for mixer in mixers[:rerun] + mtp[:mtp_rerun])
    if passes:
        add("cp/all_to_all", passes * mamba_cp_all_to_all(spec, tokens=tokens, tp=par.tp, cp=par.cp, act=act))
    for chunk_mixers, reruns in ((mixers, rerun), ([mixer for mixer in mtp if mixer in CP_MIXERS], mtp_rerun)):
        for key, value in linear_cp_communication(spec, chunk_mixers, tokens=tokens, s=training.seq_length,
                                                  b=training.micro_batch_size, par=par, act=act,
                                                  reruns=min(reruns, len(chunk_mixers))).items():
            add(key, value)
    return out


def embedding_all_reduce(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *,
                         pp_rank: int, buffers: Mapping[str, Sequence[Bucket]]) -> int:
    """``embd/all_reduce`` bytes per step: the word embeddings' gradient shared by the first and
    the last pipeline stage (PP > 1), tied to the output weight or, with MTP, the last stage's
    copy; none on other stages or when that weight is frozen (no gradient)."""
    shared_trains = any(p.shared_embedding for group in buffers.values() for b in group for p, _, _ in b.params)
    if par.pp == 1 or not (spec.tied_output or spec.mtp_num_layers) or not shared_trains:
        return 0
    if not spec.tied_output and par.mtp_stage is not None and par.mtp_stage % par.pp == 0:
        return 0  # (untied, MTP on the first rank: an embedding group of one rank, which megatron-core skips)
    # (a standalone MTP stage's embedding copy too: Megatron-LM's get_embedding_ranks adds the MTP ranks)
    if not any(par.is_first_stage(pp_rank, c) or par.is_last_stage(pp_rank, c)
               or (spec.mtp_num_layers and par.holds_mtp(pp_rank, c)) for c in range(par.num_chunks)):
        return 0
    return padded_vocab(spec, options, par.tp) // par.tp * spec.hidden_size * training.grad_bytes


def sequence_parallel_slice(training: Training, par: Parallelism) -> Training:
    """The tokens one TP rank routes: its [s/TP, b] slice under sequence parallelism."""
    if par.tp == 1:
        return training
    return replace(training, seq_length=training.seq_length // par.tp)


def bus_bytes(payload: Mapping[str, int], group_sizes: Mapping[str, int]) -> dict[str, int]:
    """What a ring algorithm moves per GPU for each ``group/kind`` payload (NCCL's "bus
    bandwidth" bytes): ``(n - 1) / n`` of an all-gather output, reduce-scatter input or
    all-to-all input, twice that for an all-reduce, and point-to-point bytes as they are."""
    factors = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}
    out = {}
    for key, value in payload.items():
        group, kind = key.split("/")
        if kind == "send_recv":
            out[key] = value
        else:
            n = group_sizes[group]
            out[key] = factors[kind] * value * (n - 1) // n
    return out
