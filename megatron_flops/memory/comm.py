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
  last pipeline stage (PP > 1; none when that weight is frozen).
- ``tp/all_reduce``, ``tp/all_gather``, ``tp/reduce_scatter``, per micro-batch: [s, b, h]
  activations and their gradients (:func:`tensor_parallel_activations`; full recompute runs the
  forward's collectives again) and vocab-parallel cross-entropy's three fp32 [s, b] reductions;
  once per step the gradients of the weights every TP rank holds whole, under sequence
  parallelism (:func:`tp_replicated_numel`).
- ``pp/send_recv``, per micro-batch and model chunk: the [s, b, h] activation ([s/TP, b, h] under
  sequence parallelism) received from the previous virtual stage and its gradient sent back, the
  activation sent to the next and its gradient received.
- ``ep/all_to_all`` (alltoall dispatcher), per MoE layer and micro-batch: the routed tokens
  [s*b*topk, h] and their probabilities [s*b*topk] to the experts and back, forward and backward.
  NB: the bytes a rank sends back depend on how many tokens it received; the figure assumes
  balanced routing (every rank receives s*b*topk tokens), which the EP group's total always is;
  :func:`all_to_all_range` bounds it per rank.
  ``ep/all_gather``: each rank's token count per expert (int64 [num_experts]).
- ``cp/send_recv`` (CP > 1): a formula, not measured (see :func:`step_communication`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from megatron_flops.memory.decoder import DecoderOptions, Param, padded_vocab
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.ssm import missing_blocks
from megatron_flops.memory.states import Bucket
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.model.spec import ModelSpec

CE_REDUCTIONS = 3  # max logit, target logit, sum of exponentials


def fully_recomputed_layers(recompute: RecomputeSpec | None, num_layers: int) -> int:
    """Layers of a model chunk that full recompute re-runs: all (``uniform``) or the first
    ``recompute_num_layers`` (``block``)."""
    if recompute is None or recompute.granularity != "full":
        return 0
    if recompute.method == "block":
        return min(recompute.num_layers or 0, num_layers)
    return num_layers


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


def tp_replicated_numel(buffers: Mapping[str, Sequence[Bucket]], par: Parallelism, options: DecoderOptions) -> int:
    """Gradient elements megatron-core's ``finalize_model_grads`` all-reduces over TP once per
    step, in one coalesced tensor: weights every TP rank holds whole (norms, row-parallel
    biases, router, shared-expert gate) under sequence parallelism, and the q/k norms with
    ``qk_layernorm`` (always). NB: counted from the gradient buffers (trainable parameters)."""
    def reduced(p: Param) -> bool:
        qk = options.qk_layernorm and ("q_layernorm" in p.name or "k_layernorm" in p.name)
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
    replicated = tp_replicated_numel(buffers, par, options)
    if par.tp > 1 and replicated > 1:
        out["tp/all_reduce"] = replicated * training.grad_bytes
    act = training.param_bytes
    tokens = training.seq_length * training.micro_batch_size
    hidden = tokens * spec.hidden_size * act  # one [s, b, h] activation
    m = training.num_microbatches
    add = lambda key, value: out.__setitem__(key, out.get(key, 0) + value) if value else None  # noqa: E731
    tied_trains = any(p.shared_embedding for group in buffers.values() for b in group for p, _, _ in b.params)
    if par.pp > 1 and spec.tied_output and tied_trains:  # (a frozen tied weight has no gradient to reduce)
        for chunk in range(par.num_chunks):
            if par.is_first_stage(pp_rank, chunk) or par.is_last_stage(pp_rank, chunk):
                vocab = padded_vocab(spec, options, par.tp)
                add("embd/all_reduce", vocab // par.tp * spec.hidden_size * training.grad_bytes)
                break
    kinds = spec.layers  # (mixer, ffn) per layer, expanded once
    for chunk in range(par.num_chunks):
        layers = par.chunk_layers(spec.num_layers, pp_rank, chunk)
        first, last = par.is_first_stage(pp_rank, chunk), par.is_last_stage(pp_rank, chunk)
        if par.pp > 1:
            # Activation in and its gradient out (not the first virtual stage), activation out
            # and its gradient in (not the last).
            # NB: under sequence parallelism each TP rank sends its slice [s/TP, b, h].
            sp = par.tp if par.sequence_parallel else 1
            add("pp/send_recv", m * hidden // sp * 2 * ((not first) + (not last)))
        moe_layers = sum(kinds[i][1] == "moe" for i in layers) + mtp_moe_layers(spec, last)
        if par.tp > 1:
            rerun = fully_recomputed_layers(recompute, len(layers))
            for key, count in tensor_parallel_activations(options, par, len(layers), rerun, first, last).items():
                add(key, m * hidden * count)
            for key, count in tensor_parallel_activations(options, par, missing_blocks(kinds, layers), 0, False,
                                                          False).items():
                add(key, -m * hidden * count // 2)  # a hybrid layer has one sub-block: half a layer's traffic
            if moe_layers:
                for key, value in tensor_parallel_moe(spec, options, par, training, moe_layers, rerun).items():
                    add(key, m * value)
            if last:
                add("tp/all_reduce", m * tokens * 4 * CE_REDUCTIONS)
        if par.cp > 1:
            # NB: a formula, not measured (no context-parallel attention on CPU): Transformer
            # Engine's ring attention passes each layer's K and V [s/CP, b, groups/TP, d] round
            # the CP ring, CP-1 steps forward, and K, V and their gradients backward.
            kv = 2 * tokens * (spec.num_query_groups // par.tp) * spec.kv_channels * act
            add("cp/send_recv", m * len(layers) * (par.cp - 1) * 2 * (kv + 2 * kv))
        if par.ep > 1 and moe_layers:
            local = sequence_parallel_slice(training, par)
            all_to_all_range(spec, options, par, local, moe_layers)  # (checks the dispatcher)
            add("ep/all_to_all", m * balanced_all_to_all(spec, local, moe_layers))
            moe = spec.moe
            assert moe is not None
            # Token counts per expert (int64 [E]) gathered over the expert TP x EP group.
            add("ep/all_gather", m * moe_layers * par.tp * par.ep * moe.num_experts * 8)
    return out


def sequence_parallel_slice(training: Training, par: Parallelism) -> Training:
    """The tokens one TP rank routes: its [s/TP, b] slice under sequence parallelism."""
    if par.tp == 1:
        return training
    return replace(training, seq_length=training.seq_length // par.tp)


def tensor_parallel_moe(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                        moe_layers: int, rerun: int) -> dict[str, int]:
    """``tp/*`` payload per micro-batch of a chunk's MoE layers beyond the dense layers' count of
    :func:`tensor_parallel_activations` (which prices an MLP per layer), under TP > 1 with
    sequence parallelism and the alltoall dispatcher, experts split over TP (megatron-core's
    default ``expert_tensor_parallel_size = TP``): the MoE layer routes this rank's [s/TP, b]
    slice (no all-gather before it), and the dispatcher all-gathers over TP the routed tokens
    [s*b*topk/TP, h] and probabilities it received from the EP ranks (forward; their gradients
    reduce-scattered in backward) and reduce-scatters the experts' output (its gradient
    all-gathered in backward), all in the activation dtype (the router's). Shared experts run as
    a dense MLP. NB: balanced routing, as :func:`balanced_all_to_all`."""
    moe = spec.moe
    assert moe is not None
    if not par.sequence_parallel or par.ep == 1 or options.moe_token_dispatcher_type != "alltoall":
        raise ValueError("MoE layers under tensor parallelism are modelled with --sequence-parallel, --ep > 1 "
                         "and the alltoall dispatcher (megatron-core needs sequence parallelism for TP with EP)")
    if rerun:
        raise ValueError("MoE layers under tensor parallelism are modelled without full recompute")
    act = training.param_bytes
    tokens = training.seq_length * training.micro_batch_size
    hidden = tokens * spec.hidden_size * act
    dense_mlp = {"tp/all_gather": 3 * hidden, "tp/reduce_scatter": 2 * hidden}  # fc1 twice + fc2's gradient; fc1 and fc2
    routed = tokens * moe.router_topk * (2 * spec.hidden_size + 1) * act  # tokens and probs in, output out
    out = {}
    for key, value in dense_mlp.items():
        out[key] = moe_layers * (routed - (0 if moe.shared_expert_ffn_hidden_size else value))
    return out


def mtp_moe_layers(spec: ModelSpec, last: bool) -> int:
    """MoE layers inside the multi-token-prediction block (on the last stage)."""
    return spec.mtp_num_layers if last and spec.mtp_ffn == "moe" else 0


def balanced_all_to_all(spec: ModelSpec, training: Training, moe_layers: int) -> int:
    """``ep/all_to_all`` payload of one micro-batch when every EP rank receives as many routed
    tokens as it sends (balanced routing): the routed tokens [s*b*topk, h] and their
    probabilities [s*b*topk] to the experts and back, forward and backward."""
    assert spec.moe is not None
    act = training.param_bytes
    routed = training.seq_length * training.micro_batch_size * spec.moe.router_topk
    return moe_layers * (4 * routed * spec.hidden_size * act + 2 * routed * act)


def all_to_all_range(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                     moe_layers: int) -> tuple[int, int]:
    """The least and the most ``ep/all_to_all`` payload one GPU can hand over per micro-batch,
    whatever the routing. NB: what a rank sends of its own tokens (dispatch forward, combine
    backward) is fixed; what it sends of the tokens it received (combine forward, dispatch
    backward) runs from none to ``EP x s*b x min(topk, local experts)`` (every token of the EP
    group routed here), with no token dropped."""
    moe = spec.moe
    assert moe is not None
    if options.moe_token_dispatcher_type != "alltoall":
        raise ValueError("expert parallelism is modelled with moe_token_dispatcher_type='alltoall'")
    act = training.param_bytes
    tokens = training.seq_length * training.micro_batch_size
    own = tokens * moe.router_topk
    most = par.ep * tokens * min(moe.router_topk, moe.num_experts // par.ep)
    fixed = moe_layers * (2 * own * spec.hidden_size * act + own * act)
    return fixed, fixed + moe_layers * (2 * most * spec.hidden_size * act + most * act)


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
