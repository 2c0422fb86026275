"""LoRA adapters (Megatron-Bridge 0.3.1's ``ParallelLinearAdapter``, tests/mcore_memory.apply_lora)
on a frozen base under tensor parallelism with MoE, MLA and multi-token prediction layers: one
real training step each on megatron-core in 2 gloo processes (4 for TP2 x EP2, which needs expert
TP x EP = 4 ranks; tests/test_memory_dist.py's worker), against :mod:`megatron_flops.memory` to the
byte: parameters in order, weights, gradient buffers, optimizer state, every collective's payload,
the bytes each forward saves for backward and the schedule's peak.

fp32 throughout (torch's CPU norms keep their statistics in the input dtype: none of the CUDA
convention's difference to correct). Every token goes to every expert (top-k = experts): each
expert's token count is fixed and even, so Bridge's padding of an odd count to a multiple of
expert TP (which detaches the adapter's output) never runs, and per-rank figures are exact under
EP too."""

from __future__ import annotations

import pytest

import mcore_cpu
import mcore_dist
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.activations import chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import rank_memory
from megatron_flops.model.spec import ModelSpec
from test_memory_dist import MBS, SEQ, VOCAB, memory_worker

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

BASE = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, hidden_dropout=0.0,
            attention_dropout=0.0)
MOE = dict(num_moe_experts=4, moe_router_topk=4, moe_ffn_hidden_size=56, moe_layer_freq=[0, 1])
MLA = dict(multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
           normalization="LayerNorm")
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

# name -> world size, layout (tp, sp, ep), model, micro-batches, LoRA (targets, rank)
RUNS = {
    # Routed experts' adapters split over expert TP (all-gathering [n, r] and their output [n, h]);
    # the shared experts' as a dense MLP's (all-gathering their input under SP).
    "TP2 + SP, MoE top-4 of 4 every other layer (allgather), shared experts, LoRA on all four": dict(
        world=2, layout=dict(tp=2, sp=True),
        model=dict(BASE, **MOE, moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=40),
        m=2, lora=(ALL, 4)),
    # An MLA layer has no linear_qkv (both commands refuse that target there: Bridge would adapt nothing); a MoE
    # layer without shared experts no dense MLP. Layer 0's MLA projections run before its first adapter (linear_proj).
    # Selective moe + shared_experts (live-storage meter): per micro-batch the MoE layer re-runs once
    # and its shared experts twice, their adapters' forward collectives with them. T = 32, h = 48,
    # r = 4, fp32: shared fc1 + fc2 adapters 32 * 48 * 4 + 32 * 4 * 4 + 32 * 48 * 4 = 12800 B of
    # all-gather and 512 B of all-reduce per run; routed adapters over the 128 routed tokens,
    # 128 * 4 * 4 + 128 * 48 * 4 = 26624 B of all-gather: 2 * (2 * 12800 + 26624) = 104448 B of
    # tp/all_gather and 2 * 2 * 512 = 2048 B of tp/all_reduce per step beyond the layer run once.
    "TP2 + SP, MoE top-4 of 4 every other layer (allgather), shared experts, LoRA on all four, selective moe + "
    "shared_experts": dict(
        world=2, layout=dict(tp=2, sp=True),
        model=dict(BASE, **MOE, moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=40,
                   recompute_granularity="selective", recompute_modules=["moe", "shared_experts"]),
        m=2, lora=(ALL, 4), live=True),
    "TP2 + SP, MLA (q_lora) + MoE without shared experts (alltoall), LoRA on proj, fc1, fc2": dict(
        world=2, layout=dict(tp=2, sp=True),
        model=dict(BASE, **MLA, q_lora_rank=24, **MOE, moe_token_dispatcher_type="alltoall"), m=2, lora=(ALL[1:], 4)),
    "TP2 + SP, 1 MTP layer, LoRA on all four": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(BASE, mtp_num_layers=1), m=2, lora=(ALL, 4)),
    # Without SP: layer 0's MLA projections, linear_proj and linear_fc1 run before its first
    # adapter (no input-gradient all-reduce); the MTP layer's fc1 adapted too.
    "TP2, MLA (direct q) + 1 MTP layer, LoRA on linear_fc1": dict(
        world=2, layout=dict(tp=2), model=dict(BASE, **MLA, q_lora_rank=None, mtp_num_layers=1), m=2,
        lora=(("linear_fc1",), 4)),
    # EP2 under TP2: the alltoall dispatcher (uneven TP gathers: mcore_memory.patch_uneven_collectives);
    # full recompute re-runs every layer's adapters' forward collectives, the experts' too.
    "TP2 x EP2 + SP, MoE top-4 of 4 (alltoall), shared experts, full recompute (uniform 1), distributed optimizer":
        dict(world=4, layout=dict(tp=2, sp=True, ep=2),
             model=dict(BASE, **dict(MOE, moe_ffn_hidden_size=48, moe_layer_freq=1),
                        moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=40,
                        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             m=2, lora=(ALL, 4), distributed_optimizer=True),
}


def measure(runs: dict) -> dict:
    """Every run of ``runs`` (this module's RUNS layout) measured on its world size, by name."""
    out = {}
    for world in sorted({run["world"] for run in runs.values()}):
        group = {name: dict(run, build=dict(params_dtype="fp32", lora=run["lora"],
                                            distributed_optimizer=run.get("distributed_optimizer", False)))
                 for name, run in runs.items() if run["world"] == world}
        results = mcore_dist.run_distributed(memory_worker, world, group, timeout=600)
        out.update({name: [r[name] for r in results] for name in group})
    return out


@pytest.fixture(scope="module")
def measured():
    return measure(RUNS)


def setup(name: str, runs: dict | None = None):
    run = (runs or RUNS)[name]
    model, layout = run["model"], run["layout"]
    fields = {k: v for k, v in model.items() if k != "moe_token_dispatcher_type"}
    spec = ModelSpec.from_mapping(dict(fields, vocab_size=VOCAB))
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               transformer_impl="local", position_embedding_type="rope",
                                               add_bias_linear=False))
    tp = layout["tp"]
    par = Parallelism(tp=tp, ep=layout.get("ep", 1), dp=run["world"] // tp, sequence_parallel=layout.get("sp", False),
                      distributed_optimizer=run.get("distributed_optimizer", False))
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=run["m"], params_dtype="fp32")
    peft = PeftSpec(frozen=True, lora_rank=run["lora"][1], lora_targets=run["lora"][0])
    return spec, options, par, training, peft, RecomputeSpec.from_mapping(model)


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_in_megatron_order(measured, name):
    check_parameters(measured[name], *setup(name))


def check_parameters(results, spec, options, par, training, peft, _recompute) -> None:
    for result in results:
        params = chunk_parameters(spec, options, par, pp_rank=0, chunk=0, seq_length=training.seq_length, peft=peft)
        assert [(p.name, p.numel) for p in params] == [tuple(n) for n in result["names"][0]]


@pytest.mark.parametrize("name", list(RUNS))
def test_states_and_communication(measured, name):
    check_states_and_communication(measured[name], *setup(name))


def check_states_and_communication(results, spec, options, par, training, peft, recompute) -> None:
    for result in results:
        report = rank_memory(spec, options, par, training, pp_rank=0, dp_rank=result["sizes"]["dp_rank"], peft=peft,
                             recompute=recompute)
        assert report.states == result["states"], result["sizes"]
        assert report.communication == dict(result["comm"]), result["sizes"]


@pytest.mark.parametrize("name", list(RUNS))
def test_activations_per_forward_and_schedule_peak(measured, name):
    check_activations(measured[name], *setup(name))


def check_activations(results, spec, options, par, training, peft, recompute) -> None:
    act = chunk_activations(spec, options, par, training, pp_rank=0, chunk=0, recompute=recompute, peft=peft)
    peak, _ = schedule_peak([act], in_flight(par, training.num_microbatches, 0))
    for result in results:
        assert {b for _, b in result["forward"]} == {act.forward + act.shared}, result["sizes"]
        assert peak == result["peak"], result["sizes"]
