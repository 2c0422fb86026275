"""Grouped-GEMM experts, selective ``moe_act`` recompute and the flex token dispatcher: what
megatron-core 0.16.1 keeps for backward and hands to collectives (stdlib only). Formulas read from
its source (and Transformer Engine's ``GroupedLinear``): none of them runs on CPU (Transformer
Engine, grouped_gemm, DeepEP and HybridEP are CUDA-only), so each figure is listed in
``unmeasured``; SequentialMLP experts and the alltoall/allgather dispatchers
(:mod:`megatron_flops.memory.moe`) are measured.

Per routed token reaching this rank's experts (``n`` of them), in elements of the expert width
``ffn / ETP`` (x2 for fc1's gated output), beside the permuted tokens [n, h] and probabilities [n]:

- ``TEGroupedMLP`` (``moe_grouped_gemm``, Transformer Engine's spec): ``GroupedLinear`` saves
  its input split per expert (views of one storage: fc1 the permuted tokens, fc2 its input), not
  its output; the activation is SequentialMLP's code path (``weighted_bias_swiglu_impl`` keeping
  fc1's output and the probabilities, or the unfused GLU and the probabilities' multiply), so the
  count equals SequentialMLP's. NB: bf16/fp32 without FP8 (FP8 saves quantized copies).
- ``GroupedMLP`` (``moe_use_legacy_grouped_gemm``, or ``moe_grouped_gemm`` with the local spec):
  grouped_gemm's ``gmm`` saves its input, and the activation times the probabilities is one
  ``torch.compile``d function (megatron-core's ``jit_fuser``), which keeps only its inputs (fc1's
  output and the probabilities; seen on CPU with torch 2.13): fc1's output and fc2's input.
- ``moe_act`` (both): ``CheckpointWithoutOutput`` runs the activation under no_grad and keeps its
  inputs (fc1's output, the probabilities), and frees its output (fc2's saved input) after fc2's
  forward; in backward the activation re-runs, and what it saves plus fc2's input are held again
  while the experts' backward runs.
- LoRA (Megatron-Bridge matches module names): ``TEGroupedMLP``'s grouped ``linear_fc1`` and
  ``linear_fc2`` get one adapter each shared by the local experts (0.3.1; 0.6.2's default
  ``share_expert_adapters``), over all ``n`` tokens: per token what ``SequentialMLP``'s per-expert
  adapters keep, and the same expert-TP gathers; a frozen ``GroupedLinear`` keeps no input.
  ``GroupedMLP`` has no linear modules (``weight1``, ``weight2``): no expert adapter, and ``gmm``
  keeps its inputs frozen or not. Under ``moe_act`` fc2's adapter reads the freed output.

The flex dispatcher (``MoEFlexTokenDispatcher``, one group over expert TP x EP, ``G = ETP x EP``
ranks; a token goes once to each rank holding one of its experts, ETP copies each): the
probabilities arrive in fp32 (DeepEP and HybridEP take fp32 only), so the experts keep [n] fp32.
With ``n`` routed pairs, a token's experts on ``min(topk, EP)`` EP ranks (balanced routing, as
for the alltoall dispatcher), ``N = n x min(topk, EP) / topk`` tokens arrive per rank.

- DeepEP (``moe_permute_fusion`` off, megatron-core's default): the top-(ETP x topk) indices
  over the ETP-expanded probabilities (int64 [T_l, ETP k]); converting the received indices to a
  multihot map keeps the mask of valid indices (bool [N, ETP k]) and the (token, expert) index
  pairs (2 x int64 [n]); ``permute`` keeps the transposed map (bool [E/EP, N]), the transposed
  probabilities (fp32 [E/EP, N]) and the sorted indices (int64 [n]). NB: DeepEP's handle (its
  layout and prefix tensors, in its own buffers) is not counted.
- HybridEP: permutes inside its kernels; megatron-core keeps nothing beside its handle (not
  counted).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_flops.memory.decoder import DecoderOptions, experts_module, experts_take_adapters
from megatron_flops.memory.grouped_lora import (adapter_weight_numels, check_grouped_lora, cross_ep_all_reduce,
                                                grouped_adapter_saved,
                                                grouped_lora_note, uses_grouped_mm)
from megatron_flops.memory.layout import BOOL_BYTES, FP32_BYTES, INDEX_BYTES, Parallelism, Training
from megatron_flops.flops.passes import (PeftSpec, RecomputeSpec, check_lora_targets, check_recompute_modules,
                                        gpt_decoder)
from megatron_flops.model.spec import ModelSpec

FLEX_BACKENDS = ("deepep", "hybridep")


def _moe_act(recompute: RecomputeSpec | None) -> bool:
    return recompute is not None and recompute.granularity == "selective" and "moe_act" in recompute.modules


def check_grouped(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                  recompute: RecomputeSpec | None, peft: PeftSpec | None = None) -> None:
    """ValueError, with megatron-core's own reason, for the grouped-GEMM, ``moe_act`` and flex
    layouts megatron-core 0.16.1 refuses to build or train."""
    check_recompute_modules(spec, recompute, grouped_gemm=options.moe_grouped_gemm)
    if peft is not None and gpt_decoder(spec):  # (as estimate: LoRA elsewhere is refused on its own)
        check_lora_targets(spec, replace(peft, expert_adapters=experts_take_adapters(options)))
    if spec.moe is None:
        return
    if experts_module(options) == "GroupedMLP":
        if options.add_bias_linear:
            raise ValueError("megatron-core's GroupedMLP refuses linear biases ('bias not supported in Grouped GEMM "
                             "yet, please set '--disable-bias-linear' instead.')")
        if spec.moe.latent_size:
            raise ValueError("megatron-core's GroupedMLP refuses latent projections ('MoE latent projection not "
                             "supported in GroupedMLP yet.')")
        if training.params_dtype != "bf16":
            raise ValueError("megatron-core's GroupedMLP trains in bf16 only ('Currently GroupedMLP for MoE only "
                             f"supports bf16.'), not {training.params_dtype}")
    check_grouped_lora(par, peft, grouped=experts_module(options) == "TEGroupedMLP")
    if experts_module(options) == "TEGroupedMLP" and options.add_bias_linear and options.bias_dropout_fusion:
        raise ValueError("megatron-core's TEGroupedMLP refuses linear biases with bias_dropout_fusion ("
                         "'bias_dropout_fusion is not supported in TEGroupedMLP when add_bias_linear=True'): set "
                         "add_bias_linear or bias_dropout_fusion false")
    if options.moe_token_dispatcher_type != "flex":
        return
    if options.moe_flex_dispatcher_backend not in FLEX_BACKENDS:
        raise ValueError(f"megatron-core's flex dispatcher refuses backend {options.moe_flex_dispatcher_backend!r} "
                         "('Please set --moe-flex-dispatcher-backend=deepep or --moe-flex-dispatcher-backend=hybridep')")
    if par.expert_tp * par.ep == 1:
        raise ValueError("megatron-core's MoEFlexTokenDispatcher asserts 'Flex token dispatcher requires TPxEP > 1' "
                         "(expert TP x EP): add --ep or --etp")


def expert_adapter_targets(options: DecoderOptions, adapted: tuple[str, ...]) -> tuple[str, ...]:
    """The routed experts' linears Megatron-Bridge adapts among ``adapted``: none in legacy
    ``GroupedMLP`` (no ``linear_fc1``/``linear_fc2`` modules to match); ``TEGroupedMLP``'s one
    shared adapter sees every routed token, as ``SequentialMLP``'s per-expert ones see theirs, so
    it keeps the same per token."""
    return adapted if experts_take_adapters(options) else ()


def grouped_lora_saved(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                       peft: PeftSpec | None, *, tokens: int, received: int | None, moe_act: bool,
                       first: bool = False) -> int:
    """Bytes per MoE layer and micro-batch that ``TEGroupedMLP``'s per-expert or shared-outer
    adapters keep beyond the shared adapter's (:mod:`.grouped_lora`); ``tokens``: the expert
    TP group's tokens (``received``: routed tokens reaching this rank, None: balanced); ``first``:
    a frozen first layer whose gradient starts in them (fc1's input requires no grad)."""
    moe = spec.moe
    if moe is None or peft is None or peft.lora_rank is None or experts_module(options) != "TEGroupedMLP":
        return 0
    width, ffn, gate = moe.latent_size or spec.hidden_size, moe.ffn_hidden_size // par.expert_tp, \
        2 if spec.gated_linear_unit else 1
    num_local = moe.num_experts // par.ep
    return grouped_adapter_saved(
        peft, grouped_mm=uses_grouped_mm(peft, par, bf16=training.params_dtype == "bf16", width=width, ffn=ffn,
                                         gate=gate),
        got=tokens * moe.router_topk if received is None else received, num_local=num_local,
        width=width, ffn=ffn, act=training.param_bytes, frozen=peft.frozen, moe_act=moe_act,
        weights=adapter_weight_numels(peft, par, width=width, ffn=ffn, gate=gate, num_local=num_local),
        started=not first)


def grouped_lora_communication(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                               peft: PeftSpec | None, *, moe_layers: int) -> dict[str, int]:
    """Shared-outer adapters' ``tp_dp_cp/all_reduce`` on ``moe_layers`` MoE layers of a pipeline
    rank (:func:`~megatron_flops.memory.grouped_lora.cross_ep_all_reduce`); {} otherwise."""
    if spec.moe is None or experts_module(options) != "TEGroupedMLP":
        return {}
    return cross_ep_all_reduce(peft, par, width=spec.moe.latent_size or spec.hidden_size, moe_layers=moe_layers,
                               param_bytes=training.param_bytes, num_microbatches=training.num_microbatches)


def frozen_experts_keep_inputs(options: DecoderOptions) -> bool:
    """Whether frozen routed experts still keep their linears' inputs: grouped_gemm's ``gmm``
    saves its input whatever requires grad (legacy ``GroupedMLP``); Transformer Engine's
    ``GroupedLinear`` saves none when its weights are frozen, as megatron-core's local linears."""
    return experts_module(options) == "GroupedMLP"


def expert_elements(spec: ModelSpec, options: DecoderOptions, *, sequential: int, moe_act: bool) -> tuple[int, int]:
    """Elements of ``ffn / ETP`` per routed token the experts keep after forward, and those
    ``moe_act`` frees (re-saved in backward); ``sequential``: SequentialMLP's kept count."""
    module = experts_module(options)
    if module == "SequentialMLP":
        return sequential, 0
    fc1 = 2 if spec.gated_linear_unit else 1  # fc1's output [n, 2 ffn] (GLU) or [n, ffn]
    kept = sequential if module == "TEGroupedMLP" else fc1 + 1  # (GroupedMLP: fc1's output, fc2's input)
    if moe_act:
        return fc1, kept - fc1
    return kept, 0


def probability_bytes(options: DecoderOptions, act: int) -> int:
    """Bytes per routed token's probability as the experts keep it: fp32 from the flex
    dispatcher (DeepEP and HybridEP take fp32 only), else the router's (activation) dtype."""
    return FP32_BYTES if options.moe_token_dispatcher_type == "flex" else act


def flex_dispatcher_saved(spec: ModelSpec, options: DecoderOptions, *, local_tokens: int, etp: int, ep: int,
                          got: int) -> int:
    """Bytes the flex dispatcher keeps for backward per MoE layer and micro-batch (see the
    module doc); ``got``: routed (token, expert) pairs reaching this rank's experts."""
    moe = spec.moe
    assert moe is not None
    if options.moe_flex_dispatcher_backend == "hybridep":
        return 0
    k = moe.router_topk
    arrived = got * min(k, ep) // k  # N: tokens arriving (once per rank holding any of their experts)
    local = moe.num_experts // ep
    return (local_tokens * etp * k * INDEX_BYTES  # top-(ETP k) indices of the expanded probabilities
            + arrived * etp * k * BOOL_BYTES  # mask of the received indices that are this rank's experts
            + 2 * got * INDEX_BYTES  # (token, expert) index pairs of the multihot conversion
            + arrived * local * (BOOL_BYTES + FP32_BYTES)  # permute's transposed map and probabilities
            + got * INDEX_BYTES)  # permute's sorted indices


def flex_communication(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                       moe_layers: int, rerun: int) -> dict[str, int]:
    """``ep/all_to_all`` (``tp_ep/all_to_all`` with expert TP > 1) bytes this rank sends per
    micro-batch over ``moe_layers`` MoE layers, ``rerun`` of them run forward twice, balanced
    routing: each of its ``T_l`` tokens to ``r = ETP x min(topk, EP)`` ranks and as many back.
    DeepEP: dispatch sends per (token, rank) the token [h], its ETP x topk indices (int64) and
    fp32 weights, combine the experts' sum [h]; backward the reverse (combine of the gradient and
    the weights' fp32 gradient, dispatch of [h]). HybridEP (NB: its wire format assumed): [h] and
    the rank's E/EP fp32 probabilities each way. The small count exchanges are not counted."""
    moe = spec.moe
    assert moe is not None
    a, h, k = training.param_bytes, moe.latent_size or spec.hidden_size, moe.router_topk
    sent = training.seq_length * training.micro_batch_size // par.tp * par.expert_tp * min(k, par.ep)
    if options.moe_flex_dispatcher_backend == "hybridep":
        extra = moe.num_experts // par.ep * FP32_BYTES
        forward, backward = sent * (2 * h * a + extra), sent * (2 * h * a + extra)
    else:
        wide = par.expert_tp * k
        forward, backward = sent * (2 * h * a + wide * (INDEX_BYTES + FP32_BYTES)), sent * (2 * h * a + wide * FP32_BYTES)
    group = "ep" if par.expert_tp == 1 else "tp_ep"
    return {f"{group}/all_to_all": (moe_layers + rerun) * forward + moe_layers * backward}


def grouped_unmeasured(spec: ModelSpec, options: DecoderOptions, recompute: RecomputeSpec | None, *,
                       activations: bool, peft: PeftSpec | None = None) -> list[str]:
    """The figures of this module in the report (each a formula: CUDA-only kernels)."""
    if spec.moe is None:
        return []
    out = []
    module = experts_module(options)
    if activations and module != "SequentialMLP":
        out.append(f"routed experts' activations as megatron-core 0.16.1's {module} saves them (moe_grouped_gemm: "
                   + ("Transformer Engine's GroupedLinear keeps its inputs, the activation as SequentialMLP's; no FP8"
                      if module == "TEGroupedMLP" else "grouped_gemm's gmm keeps its inputs, the compiled activation "
                      "fc1's output and the probabilities") + "); SequentialMLP experts are measured")
    if module != "SequentialMLP" and peft is not None:
        out.append(f"LoRA or a frozen base on {module} experts (Megatron-Bridge: "
                   + (grouped_lora_note(peft) + "; frozen GroupedLinear keeps no input" if module == "TEGroupedMLP"
                      else
                      "no expert adapter, as GroupedMLP has no linear modules; gmm keeps its inputs when frozen")
                   + ")")
    if activations and _moe_act(recompute):
        out.append(f"selective moe_act recompute in {module}: CheckpointWithoutOutput keeps fc1's output and the "
                   "probabilities and frees fc2's input, re-saved with the activation's tensors in backward")
    if options.moe_token_dispatcher_type == "flex":
        backend = options.moe_flex_dispatcher_backend
        out.append(f"flex dispatcher ({backend}, CUDA only): "
                   + ("the activations it keeps (top-k indices, multihot conversion and permute as megatron-core "
                      "runs them, DeepEP's handle not counted), " if activations and backend == "deepep" else
                      "nothing kept beside HybridEP's handle (not counted), " if activations else "")
                   + "fp32 probabilities, and its all-to-all over expert TP x EP: each token once per destination "
                   "rank, a token's experts on min(topk, EP) EP ranks (balanced routing)"
                   + ("; HybridEP's wire format assumed ([h] and E/EP fp32 probabilities per token and rank)"
                      if backend == "hybridep" else ""))
    return out
