"""A frozen MoE first layer whose first adapter is an expert's (:mod:`.moe_lora_start`) on
grouped-GEMM experts: Megatron-Bridge 0.6.2's per-expert and shared-outer adapters, selective
``moe_act`` recompute, and legacy ``GroupedMLP`` (stdlib only). Formulas read from megatron-core
0.16.1's and Bridge 0.6.2's source (Transformer Engine and grouped_gemm are CUDA-only), each listed
in ``unmeasured``.

- ``per-expert`` and ``shared-outer`` adapters keep what the shared adapter keeps there, plus what
  :func:`~megatron_flops.memory.grouped_lora.grouped_adapter_saved` counts for a frozen base (the
  grouped GEMMs' int32 offsets; per-expert's ``grouped_mm`` copy of fc1's input stands in for the
  permuted tokens the shared adapter keeps, and of the weight copies it indexes it keeps all but
  fc1's ``linear_in``'s): ``torch._grouped_mm`` keeps its input when only its weight requires grad,
  and its weight only when its input does (seen with torch 2.13 on CPU), as a linear does.
- ``moe_act``: ``CheckpointWithoutOutput`` keeps its inputs, fc1's output (which requires grad
  from fc1's adapter on) and the probabilities (which do not), and frees the activation's output
  (fc2's adapter's input) after fc2; in backward the activation re-runs and, as without the
  checkpoint, saves nothing for the probabilities' gradient (the unfused product keeps no
  activation output): the freed bytes, held while the experts' backward runs. With ``linear_fc2``
  the only expert target, fc1's output requires no grad: the checkpoint's function records no
  node and saves nothing, and its recompute (a hook on fc2's output) calls the activation without
  inputs (seen on CPU with megatron-core 0.16.1's ``CheckpointWithoutOutput``: TypeError).
- Legacy ``GroupedMLP`` has no ``linear_fc1``/``linear_fc2`` for Bridge to adapt: the shared
  experts' ``linear_fc1`` adapter is the layer's first (the caller walks them), and the routed path
  keeps nothing: neither the router, the dispatcher, grouped_gemm's ``gmm`` (an autograd Function
  that records no node when no input requires grad), the compiled activation nor the combine sees
  a tensor that requires grad; its backward never runs, the combine's collectives included
  (:func:`legacy_combine_skip`). Without shared experts no adapter of the layer trains: every
  leading MoE layer before the first dense layer saves nothing and runs no backward (its attention's
  TP/SP collectives, the dispatcher's and the combine's included; :func:`leading_frozen_layers`), and
  the gradient starts at that dense layer's first adapter, as in a frozen dense first layer (the saved
  tensors measured with ``SequentialMLP`` experts stripped of their adapters, tests/test_memory_activations.py).
  On a pipeline's first stage holding only such layers nothing requires grad: megatron-core 0.16.1's
  ``backward_step`` runs no backward there.
"""

from __future__ import annotations

from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.decoder import DecoderOptions, experts_module, experts_take_adapters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.model.spec import ModelSpec


def grouped_first_adapter_reason(spec: ModelSpec, options: DecoderOptions, peft: PeftSpec | None, *,
                                 moe_act: bool) -> str | None:
    """Why a frozen MoE first layer whose first adapter is a routed expert's is not modelled on
    these experts (None: it is; see the module doc)."""
    moe = spec.moe
    assert moe is not None
    # (Legacy GroupedMLP without shared experts: its leading MoE layers train nothing, the gradient starts in the
    # first dense layer: modelled; without one flops.passes.check_lora_targets refuses the targets.)
    if moe_act and experts_take_adapters(options) and peft is not None and "linear_fc1" not in peft.lora_targets:
        return ("activations of a frozen MoE first layer whose first adapter is its experts' linear_fc2 under "
                "selective moe_act recompute: fc1's output requires no grad there, so megatron-core 0.16.1's "
                "CheckpointWithoutOutput saves no input and its recompute fails in backward (the activation "
                "called without arguments; seen on CPU); add linear_fc1 or an attention target (linear_proj)")
    return None


def leading_frozen_layers(spec: ModelSpec, options: DecoderOptions, layers: range) -> int:
    """How many of the first ``layers`` (the first stage's first chunk) of a frozen base whose first layer
    is MoE and whose first adapter is an expert's run no backward at all before the gradient starts: the
    leading MoE layers of legacy ``GroupedMLP`` experts without shared experts (no adapter of theirs
    trains), else 1 (that first layer; its adapted parts run theirs)."""
    moe = spec.moe
    if moe is None or experts_take_adapters(options) or moe.shared_expert_ffn_hidden_size:
        return 1
    count = 0
    for layer in layers:
        if spec.layers[layer][1] != "moe":
            break
        count += 1
    return count


def first_adapter_moe_act_freed(spec: ModelSpec, options: DecoderOptions, *, freed: int, tokens: int, act: int,
                                tp: int, received: int | None) -> int:
    """Bytes selective ``moe_act`` holds again while that layer's experts' backward runs: the
    started layer's ``freed`` (:func:`~megatron_flops.memory.moe.moe_act_freed`) less the unfused
    activation's output [n, ffn], which the probabilities (requiring no grad) do not need."""
    moe = spec.moe
    assert moe is not None
    if not experts_take_adapters(options):
        return 0
    got = tokens * moe.router_topk if received is None else received
    fused = spec.gated_linear_unit and options.bias_activation_fusion
    return freed - (0 if fused else got * (moe.ffn_hidden_size // tp) * act)


def legacy_combine_skip(spec: ModelSpec, options: DecoderOptions, par: Parallelism,
                        training: Training) -> dict[str, int]:
    """Payload bytes per step legacy ``GroupedMLP``'s first MoE layer does not run in backward
    beyond the dispatcher's (:func:`~megatron_flops.memory.moe_lora_start.first_adapter_ep_skip`,
    :func:`~megatron_flops.memory.moe_lora_start.first_adapter_dispatcher_skip`), as negative
    ``group/kind`` entries: the combine's, whose input (the experts' output) requires no grad:
    ``alltoall``: its all-to-all of the output gradient [T_l x k, h] (EP > 1) and its expert-TP
    all-gather [n, h] (ETP > 1); ``allgather``: the output gradient's all-gather [G, h]; ``flex``:
    the combine's backward [h] per (token, rank) sent."""
    moe = spec.moe
    if moe is None or experts_take_adapters(options):
        return {}
    a, h, m, k = training.param_bytes, spec.hidden_size, training.num_microbatches, moe.router_topk
    local = training.seq_length * training.micro_batch_size // par.tp  # this rank's T_l tokens
    dispatcher = options.moe_token_dispatcher_type
    out: dict[str, int] = {}
    if dispatcher == "allgather" and par.expert_tp * par.ep > 1:
        out["tp_ep/all_gather"] = -m * local * par.expert_tp * par.ep * h * a
    elif dispatcher == "alltoall":
        if par.ep > 1:
            out["ep/all_to_all"] = -m * local * k * h * a
        if par.expert_tp > 1:
            group = "tp" if par.expert_tp == par.tp else "etp"
            out[f"{group}/all_gather"] = -m * local * par.expert_tp * k * h * a
    elif dispatcher == "flex":
        sent = local * par.expert_tp * min(k, par.ep)
        out[f"{'ep' if par.expert_tp == 1 else 'tp_ep'}/all_to_all"] = -m * sent * h * a
    return out


def grouped_start_unmeasured(spec: ModelSpec, options: DecoderOptions, peft: PeftSpec | None, *,
                             moe_act: bool) -> list[str]:
    """The ``unmeasured`` labels of this module's figures in a report."""
    out = []
    if not experts_take_adapters(options) and spec.moe is not None and not spec.moe.shared_expert_ffn_hidden_size:
        out.append("the leading MoE layers of legacy GroupedMLP experts without shared experts under a frozen base "
                   "adapted on linear_fc1/linear_fc2: nothing saved and no backward run (nor their attention's, "
                   "dispatcher's or combine's collectives) before the first dense layer's adapter")
    elif not experts_take_adapters(options) and spec.moe is not None:
        out.append("the first MoE layer's legacy GroupedMLP experts under a frozen base whose first adapter is the "
                   "shared experts' linear_fc1: the routed path keeps nothing and runs no backward (nor its "
                   "combine's collectives)")
    elif experts_module(options) == "TEGroupedMLP" and peft is not None and peft.grouped_expert_adapters != "shared":
        out.append(f"the first MoE layer's TEGroupedMLP {peft.grouped_expert_adapters} adapters under a frozen base "
                   "whose first adapter is theirs: as the shared adapter's there, plus their grouped GEMMs' offsets "
                   "(per-expert on grouped_mm's path: its input copies and the indexed weight copies it keeps, fc1's "
                   "linear_in's not, its input requiring no grad)")
    if moe_act and experts_take_adapters(options):
        out.append("selective moe_act recompute in the first MoE layer under a frozen base whose first adapter is "
                   "an expert's: CheckpointWithoutOutput keeps fc1's output and the probabilities, and holds the "
                   "activation again in backward without the unfused product's activation output")
    return out
