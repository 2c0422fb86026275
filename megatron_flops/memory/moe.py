"""MoE layers' memory: what megatron-core's router, token dispatcher (``alltoall`` or
``allgather``) and ``SequentialMLP`` experts save for backward, and what the dispatcher hands to
collectives, under TP (with sequence parallelism, which megatron-core requires for MoE) x EP
(stdlib only).

Per micro-batch of ``T = s x b`` tokens, ``a`` bytes per activation element, ``E`` experts
(``E / EP`` on this rank), ``k = topk``; under sequence parallelism a rank routes its own
``T / TP`` tokens (``T_l``). Experts are split over the expert TP group (ETP ranks,
``expert_tensor_parallel_size``, TP by default): each rank's experts see every token routed to
them from the ETP x EP ranks, ``n = T_l x ETP x k`` of them with balanced routing (``T x k``
with ETP = TP).

- ``alltoall``: the router permutes its ``T_l`` tokens before the EP all-to-all; with TP > 1 the
  routed tokens and probabilities are all-gathered over expert TP after it (uneven per-rank
  counts) and the experts' output reduce-scattered before the way back.
- ``allgather``: the tokens [T_l, h], probabilities [T_l, E] and routing map (bool) are
  all-gathered over the expert TP x EP group (``G = T x EP`` rows), each rank permutes what its
  experts take, and the output [G, h] is reduce-scattered back.

NB: measured on CPU (gloo) for both dispatchers without TP and under TP2 + SP and TP2 x EP2 + SP,
and with an expert TP other than TP (TP2 + SP with ETP1 x EP2, TP1 with ETP2 x EP2) (the
alltoall dispatcher's uneven TP all-gather and reduce-scatter run as gloo's uneven all-to-all in
the tests). Latent projections (``moe_latent_size`` needs Transformer Engine) are
a formula (measured with a stand-in for TELinear where a frozen base is adapted on the first MoE
layer's experts only: :mod:`.moe_lora_start`).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import INDEX_BYTES, Parallelism, Training
from megatron_flops.memory.mla_mtp import mtp_recomputed
from megatron_flops.memory.mtp_layers import mtp_moe_layers
from megatron_flops.memory.moe_grouped import (expert_elements, flex_communication, flex_dispatcher_saved,
                                               probability_bytes)
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.model.spec import ModelSpec

SCORE_BYTES = 4  # fp32 router scores
DISPATCHERS = ("alltoall", "allgather")


def check_moe(spec: ModelSpec, options: DecoderOptions, par: Parallelism) -> None:
    """ValueError for MoE layouts megatron-core 0.16 refuses to train."""
    if spec.moe is None:
        return
    if par.tp > 1 and not par.sequence_parallel:
        raise ValueError("megatron-core refuses to train MoE layers under tensor parallelism without sequence "
                         "parallelism: add --sequence-parallel")
    if par.expert_tp != par.tp and par.ep == 1:
        # NB: megatron-core marks expert weights for the expert data-parallel group only under EP > 1
        # (their ``allreduce`` attribute); with EP 1 DDP reduces them over the dense DP group, which
        # with ETP != TP sums different shards or leaves TP copies apart.
        raise ValueError(f"an expert TP ({par.expert_tp}) other than TP ({par.tp}) needs --ep > 1: with EP 1 "
                         "megatron-core reduces expert gradients over the dense data-parallel group")
    if options.add_bias_linear and par.expert_tp > 1:
        raise ValueError(f"megatron-core refuses linear biases in MoE layers with expert TP {par.expert_tp} "
                         "(TransformerConfig: 'Bias in Moe is only supported when ETP==1'): set add_bias_linear "
                         "false, or --etp 1")
    if not spec.gated_linear_unit and options.bias_activation_fusion:
        raise ValueError("megatron-core's experts cannot fuse a non-gated activation with the routing "
                         "probabilities (MLP.forward raises 'Only support fusion of swiglu and quick_gelu with "
                         "per_token_scale'): set bias_activation_fusion false")


def moe_activation_reason(options: DecoderOptions) -> str | None:
    """Why MoE activations are not modelled (None: they are)."""
    if options.moe_token_dispatcher_type not in (*DISPATCHERS, "flex"):
        return (f"MoE activations with the {options.moe_token_dispatcher_type!r} dispatcher: megatron-core 0.14.0 to "
                "0.19.0 build none (MoELayer raises 'Unsupported token dispatcher type'; theirs are allgather, alltoall "
                "and flex)")
    return None


def moe_activations(spec: ModelSpec, options: DecoderOptions, *, tokens: int, local_tokens: int, act: int,
                    tp: int, ep: int, received: int | None, frozen: bool = False,
                    moe_act: bool = False) -> dict[str, int]:
    """Saved-for-backward bytes of one MoE layer (the shared experts aside) by key, after its
    norm; ``received``: routed tokens reaching this rank's experts (None: balanced, ``T x k``);
    ``frozen``: the experts' weights do not train (the hidden states require grad), so their
    fc1 and fc2 keep no input; grouped-GEMM experts, selective ``moe_act`` and the flex dispatcher:
    :mod:`~megatron_flops.memory.moe_grouped`. NB: the router's gating function saves its input
    regardless."""
    moe = spec.moe
    assert moe is not None
    E, k, h, a = moe.num_experts, moe.router_topk, spec.hidden_size, act
    n_l = local_tokens * k
    # Router: its input [T_l, h] (the norm's output; the shared experts and the latent projection
    # read the same storage), top-k indices (int64) and fp32 scores: softmax over the top-k
    # logits, or over all experts before the top-k (pre-softmax), or sigmoid over all experts,
    # normalised over the top-k when topk > 1.
    router = local_tokens * h * a + n_l * INDEX_BYTES
    if options.moe_router_score_function == "sigmoid":
        router += local_tokens * E * SCORE_BYTES + ((local_tokens + n_l) * SCORE_BYTES if k > 1 else 0)
    elif options.moe_router_pre_softmax:
        router += local_tokens * E * SCORE_BYTES
    else:
        router += n_l * SCORE_BYTES
    got = tokens * k if received is None else received
    if options.moe_token_dispatcher_type == "flex":
        # (tokens: the expert TP group's, ETP x T_l)
        dispatcher = flex_dispatcher_saved(spec, options, local_tokens=local_tokens, etp=tokens // local_tokens,
                                           ep=ep, got=got)
    elif options.moe_token_dispatcher_type == "allgather":
        # The gathered routing map's columns of this rank's experts (bool [E/EP, G]), the
        # gathered probabilities' same columns [E/EP, G] and the permutation's sorted indices
        # (int64, one per token its experts take).
        dispatcher = tokens * ep * (E // ep) * (1 + a) + got * INDEX_BYTES
    else:
        # The routing map (bool [E, T_l]), the probabilities scattered to it [E, T_l] and the
        # permutation's sorted indices (int64 [T_l x k]), before the all-to-all.
        dispatcher = local_tokens * E * (1 + a) + n_l * INDEX_BYTES
    # Routed experts: the permuted tokens [n, h'] and their probabilities [n] (h' = the latent
    # size with latent projections), then per token the expert MLP (ffn / TP wide): fc1 output,
    # activation, fc2 input, and the activation's output, which the probabilities multiply.
    ffn = moe.ffn_hidden_size // tp
    per = expert_elements(spec, options, sequential=_sequential_elements(spec, options), moe_act=moe_act)[0]
    width = moe.latent_size or h
    if frozen:  # (neither the permuted tokens, fc1's input, nor fc2's input: moe_act frees that one already)
        width, per = 0, per - (not moe_act)
    out = {"moe/router": router, "moe/dispatcher": dispatcher,
           "moe/experts": got * width * a + got * probability_bytes(options, a) + got * ffn * a * per}
    if moe.latent_size and not frozen:
        # NB: a formula (latent projections need Transformer Engine): fc2_latent_proj's input,
        # the combined output [T_l, latent]; fc1_latent_proj reads the router's input.
        out["moe/latent"] = local_tokens * moe.latent_size * a
    return out


def _sequential_elements(spec: ModelSpec, options: DecoderOptions) -> int:
    """Elements of ``ffn / ETP`` per routed token a SequentialMLP expert keeps."""
    if spec.gated_linear_unit and options.bias_activation_fusion:
        return 2 + 1  # fc1 output [n, 2 ffn], fc2 input
    if spec.gated_linear_unit:
        return 2 + 4  # fc1 output, silu(x1), x2 + offset, their product, the weighted product
    return 3  # fc1 output, activation output, fc2 input


def moe_act_freed(spec: ModelSpec, options: DecoderOptions, *, tokens: int, act: int, tp: int,
                  received: int | None) -> int:
    """Bytes per MoE layer that selective ``moe_act`` frees after forward and holds again while
    the experts' backward runs (:func:`~megatron_flops.memory.moe_grouped.expert_elements`)."""
    moe = spec.moe
    assert moe is not None
    got = tokens * moe.router_topk if received is None else received
    freed = expert_elements(spec, options, sequential=_sequential_elements(spec, options), moe_act=True)[1]
    return got * (moe.ffn_hidden_size // tp) * act * freed


def expert_lora_activations(spec: ModelSpec, *, adapted: tuple[str, ...], rank: int, frozen: bool, tokens: int,
                            act: int, tp: int, received: int | None, moe_act: bool = False) -> int:
    """What Megatron-Bridge's LoRA adapters on the routed experts' ``linear_fc1``/``linear_fc2``
    (every expert's, at TP 1) keep beyond :func:`moe_activations`: each adapter's [n, r]
    intermediates over the ``n`` routed tokens, and under a frozen base the wrapped layer's
    input its ``linear_in`` keeps (the permuted tokens [n, h], or fc2's input [n, ffn]), which the
    frozen layer itself does not. Under selective ``moe_act`` (grouped-GEMM experts) fc2's input
    is the activation's output, which the checkpoint frees and restores for backward: counted there
    (:func:`moe_act_freed`), not here."""
    moe = spec.moe
    assert moe is not None
    got = tokens * moe.router_topk if received is None else received
    fc2 = 0 if moe_act else moe.ffn_hidden_size // tp
    width = {"linear_fc1": moe.latent_size or spec.hidden_size, "linear_fc2": fc2}
    targets = [t for t in ("linear_fc1", "linear_fc2") if t in adapted]
    return sum(got * rank * act + (got * width[t] * act if frozen else 0) for t in targets)


def shared_gate_activations(spec: ModelSpec, *, local_tokens: int, act: int) -> int:
    """The shared experts' sigmoid gate: its output [T_l, 1] and the shared experts' output
    [T_l, h] it multiplies (its input is the router's)."""
    moe = spec.moe
    assert moe is not None
    if not (moe.shared_expert_ffn_hidden_size and moe.shared_expert_gate):
        return 0
    return local_tokens * act + local_tokens * spec.hidden_size * act


def layer_is_moe(spec: ModelSpec, layers: Sequence[int]) -> list[bool]:
    """Whether each of ``layers`` (global indices) has MoE experts."""
    kinds = spec.layers
    return [kinds[i][1] == "moe" for i in layers]


def rerun_moe_layers(spec: ModelSpec, recompute: RecomputeSpec | None, layers: Sequence[int], *,
                     last: bool = False) -> int:
    """MoE layers of a model chunk whose forward recompute runs again in backward: under full
    recompute all (``uniform``) or those among the first ``recompute_num_layers`` (``block``), and
    on the last stage (``last``) the MoE layers of the multi-token-prediction block when ``uniform``
    checkpoints them (:func:`~megatron_flops.memory.mla_mtp.mtp_recomputed`); under selective
    ``moe`` every MoE layer, the multi-token-prediction block's too."""
    if recompute is None or (recompute.granularity != "full" and "moe" not in recompute.modules):
        return 0
    moe = layer_is_moe(spec, layers)
    mtp = mtp_moe_layers(spec, last)  # (:mod:`.mtp_layers`)
    if recompute.granularity == "selective":
        return sum(moe) + mtp
    if recompute.method == "block":
        moe = moe[:recompute.num_layers or 0]
    return sum(moe) + (mtp if mtp_recomputed(spec, recompute) else 0)


def moe_communication(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                      moe_layers: int, rerun: int, received: int | None = None) -> dict[str, int]:
    """Payload bytes per ``group/kind`` of one micro-batch of a chunk's ``moe_layers`` MoE layers,
    ``rerun`` of which full recompute runs forward again, beyond the dense layers' ``tp/*`` count
    (which prices an MLP per layer). Balanced routing (see :func:`all_to_all_range`).

    - ``tp/*`` (TP > 1, sequence parallelism): a MoE layer without shared experts has no dense
      MLP (no all-gather of fc1's input, twice, nor reduce-scatter of fc2's output and of fc1's
      input gradient); shared experts run as one.
    - ``tp_ep/all_gather`` (the expert TP x EP group, ETP x EP > 1): ``alltoall`` gathers each
      rank's token count per expert (int64 [E]); ``allgather`` gathers the tokens [G, h] (``G =
      s/TP*b x ETP x EP``), the
      probabilities [G, E] and the routing map (bool [G, E]), and all-gathers the output's
      gradient [G, h] in backward; ``tp_ep/reduce_scatter`` the output [G, h] (in the
      probabilities' dtype) forward, the gradients of the tokens and probabilities backward.
    - ``ep/all_to_all`` (``alltoall``, EP > 1): this rank's routed tokens [s/TP*b*topk, h] and
      probabilities to the experts and as many back, forward (twice when re-run) and backward.
    - ``tp/all_gather`` and ``tp/reduce_scatter`` of the routed tokens (``alltoall``, expert TP
      > 1; ``etp/...`` when the expert TP is not TP: :func:`expert_tp_group`): every token routed
      to this rank's experts from the ETP x EP ranks (``received``; None: balanced, ``s/TP*b x
      ETP x topk``), with its probability, forward; the experts' output for them.
    """
    moe = spec.moe
    assert moe is not None
    a, h, E = training.param_bytes, spec.hidden_size, moe.num_experts
    width = moe.latent_size or h
    tokens = training.seq_length * training.micro_batch_size
    out: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        if value:
            out[key] = out.get(key, 0) + value

    if par.tp > 1 and not moe.shared_expert_ffn_hidden_size:
        hidden = tokens * h * a  # one [s, b, h] activation: fc1 (twice) and fc2's gradient; fc2, fc1's gradient
        add("tp/all_gather", -(3 * moe_layers + rerun) * hidden)
        add("tp/reduce_scatter", -(2 * moe_layers + rerun) * hidden)
    if options.moe_token_dispatcher_type == "flex":
        for key, value in flex_communication(spec, options, par, training, moe_layers, rerun).items():
            add(key, value)
        return out
    passes = 2 * moe_layers + rerun  # forward passes through the dispatcher, backward once
    etp = par.expert_tp
    if options.moe_token_dispatcher_type == "allgather":
        if etp * par.ep > 1:
            rows = tokens // par.tp * etp * par.ep  # every rank of the expert TP x EP group its [T_l, h] slice
            add("tp_ep/all_gather", (moe_layers + rerun) * rows * (width * a + E * a + E) + moe_layers * rows * width * a)
            add("tp_ep/reduce_scatter", (moe_layers + rerun) * rows * width * a + moe_layers * rows * (width * a + E * a))
        return out
    if etp * par.ep > 1:
        add("tp_ep/all_gather", (moe_layers + rerun) * etp * par.ep * E * INDEX_BYTES)
    routed = tokens * moe.router_topk
    if par.ep > 1:
        local = routed // par.tp  # this rank's [T_l x k] routed tokens, to the experts and back
        add("ep/all_to_all", passes * (2 * local * width * a + local * a))
    if etp > 1:
        routed = routed // par.tp * etp if received is None else received
        # All-gather over expert TP of the routed tokens and probabilities the experts take
        # (their gradients reduce-scattered in backward), reduce-scatter of the experts' output
        # (its gradient all-gathered in backward).
        group = expert_tp_group(par)
        add(f"{group}/all_gather", (moe_layers + rerun) * routed * (width + 1) * a + moe_layers * routed * width * a)
        add(f"{group}/reduce_scatter",
            (moe_layers + rerun) * routed * width * a + moe_layers * routed * (width + 1) * a)
    return out


def expert_tp_group(par: Parallelism) -> str:
    """The key of the routed experts' TP group: ``tp`` (ETP = TP, the same ranks), else ``etp``."""
    return "tp" if par.expert_tp == par.tp else "etp"


def all_to_all_range(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                     moe_layers: int, rerun: int = 0) -> tuple[int, int] | None:
    """The least and the most ``ep/all_to_all`` payload one GPU can hand over per micro-batch,
    whatever the routing (None: no all-to-all, the ``allgather`` dispatcher or EP 1).
    ``training``: what one rank routes (its [s/TP, b] slice under sequence parallelism).
    NB: what a rank sends of its own tokens (dispatch forward, combine backward) is fixed; what
    it sends of the tokens it received (combine forward, dispatch backward) runs from none to
    ``EP x s*b x min(topk, local experts)`` (every token of the EP group routed here), with no
    token dropped; ``rerun`` layers run their forward twice (full recompute)."""
    moe = spec.moe
    assert moe is not None
    if par.ep == 1 or options.moe_token_dispatcher_type != "alltoall":
        return None
    a = training.param_bytes
    width = moe.latent_size or spec.hidden_size
    tokens = training.seq_length * training.micro_batch_size
    own = tokens * moe.router_topk
    most = par.ep * tokens * min(moe.router_topk, moe.num_experts // par.ep)
    fixed = (2 * moe_layers + rerun) * own * width * a + (moe_layers + rerun) * own * a
    return fixed, fixed + (2 * moe_layers + rerun) * most * width * a + moe_layers * most * a


def moe_unmeasured(spec: ModelSpec, options: DecoderOptions) -> list[str]:
    """The MoE figures that are formulas no CPU step could check (see the module doc)."""
    moe = spec.moe
    if moe is None:
        return []
    out = []
    if moe.latent_size:
        out.append(f"MoE latent projections (moe_latent_size {moe.latent_size}): their parameters, the experts' "
                   "latent width and the latent output kept for fc2_latent_proj (megatron-core builds them with "
                   "Transformer Engine only, which does not run on CPU: a formula, what TE's linear keeps read in its "
                   "source; only a frozen base whose first MoE layer is adapted on the experts alone is measured, "
                   "with a stand-in for TE's TELinear)")
    return out
