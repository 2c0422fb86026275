"""Uneven pipeline stages measured: one real step each on megatron-core 0.16.1 in 4 gloo processes
(DP2 x PP2; tests/test_memory_dist.py's worker and checks), where megatron-core builds the stages
from the split fields and the reports place the layers from them
(:mod:`megatron_flops.memory.pipeline_split`): every rank's parameters in megatron-core's order,
weights, gradient buffers, optimizer state, collective payloads, the bytes each forward of each
model chunk saves and the schedule's peak equal the report to the byte."""

from __future__ import annotations

import pytest

import mcore_cpu
import mcore_dist
from megatron_flops.memory.activations import chunk_activations
from test_memory_dist import (BASE, WORLD, check_activations, check_communication, check_parameters, check_states,
                              cpu_delta, memory_worker, setup)

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

RUNS = {
    # 1 + 2 layers: stage 0 holds the embedding and layer 0, stage 1 layers 1-2, the norm and output;
    # block recompute checkpoints layers 0 and 1 (the first of each stage) and runs layer 2 plainly.
    # (fp32, as tests/test_memory_dist.py's full-recompute runs: check_activations' CPU norm-statistics
    # correction counts every layer's norms, which a checkpointed layer does not save in its forward.)
    "DP2 x PP2 (1F1B), first stage 1 of 3 layers, full recompute (block 1), DDP, fp32, tied embeddings, M=3": dict(
        layout=dict(pp=2), model=dict(BASE, num_layers=3, num_layers_in_first_pipeline_stage=1,
                                      recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        m=3, build=dict(params_dtype="fp32")),
    # 'Et|tt|t|tL': virtual stages of 1, 2, 1, 1 layers (VPP 2 from the layout): rank 0 holds
    # layers 0 and 3, rank 1 layers 1-2 and 4.
    "DP2 x PP2 x VPP2, layout Et|tt|t|tL, distributed optimizer, fp32, M=4": dict(
        layout=dict(pp=2, vpp=2), model=dict(BASE, num_layers=5, pipeline_model_parallel_layout="Et|tt|t|tL"), m=4,
        build=dict(distributed_optimizer=True, params_dtype="fp32")),
    # (3 + 1) / 2 = 2 per rank, rank 0 builds one fewer for the embedding.
    "DP2 x PP2 (1F1B), embedding counted in the split (1 + 2 layers), distributed optimizer, bf16, M=2": dict(
        layout=dict(pp=2), model=dict(BASE, num_layers=3, account_for_embedding_in_pipeline_split=True), m=2,
        build=dict(distributed_optimizer=True)),
    # mtp_standalone without a layout: MTP stays on the last stage, and each pipeline transfer sends its shape
    # first (3 int64: megatron-core's _communicate_shapes), 2 micro-batches x 2 directions x 24 bytes per rank.
    "DP2 x PP2 (1F1B), mtp_standalone without a layout, DDP, fp32, M=2": dict(
        layout=dict(pp=2), model=dict(BASE, num_layers=2, mtp_num_layers=1, mtp_standalone=True), m=2,
        build=dict(params_dtype="fp32")),
    # A standalone MTP stage sharing pipeline rank 0 with the embedding and the decoder: rank 0 sends
    # [(1 + 1) s, b, h] (the decoder's hidden states and the MTP layer's, concatenated), each transfer's
    # shape first; rank 1 builds the output layer only and computes both losses.
    "DP2 x PP2 (1F1B), layout Ettm|L (standalone MTP with the embedding), distributed optimizer, bf16, M=3": dict(
        layout=dict(pp=2), model=dict(BASE, num_layers=2, mtp_num_layers=1, pipeline_model_parallel_layout="Ettm|L"),
        m=3, build=dict(distributed_optimizer=True)),
    # Interleaved: MTP in rank 0's second model chunk, the loss in rank 1's; stages 2 and 3 send and receive
    # [2s, b, h]. Untied: Megatron-LM's embedding group is rank 0 alone (no embd/all_reduce). (Tied, megatron-core
    # 0.16.1's setup_embeddings_and_output_layer all-reduces rank 0's embedding twice, for chunk 0 and the MTP
    # chunk, the last rank's once: on gloo the step never starts.)
    "DP2 x PP2 x VPP2, layout Et|t|m|L, DDP, fp32, untied, M=4": dict(
        layout=dict(pp=2, vpp=2, embedding_ranks=(0,)),
        model=dict(BASE, num_layers=2, mtp_num_layers=1, pipeline_model_parallel_layout="Et|t|m|L"), m=4,
        build=dict(params_dtype="fp32", share_embeddings=False)),
    # Empty edge stages: '|Ett|ttL|' is stages [], [E t t], [t t L], [] over PP2 x VPP2. megatron-core builds
    # the embedding on rank 0's chunk 0 (pre_process), whose stage holds no layer, and the final norm, output
    # layer and loss on rank 1's chunk 1 (post_process), whose stage holds none either; every chunk still
    # sends and receives [s, b, h].
    "DP2 x PP2 x VPP2, layout |Ett|ttL| (empty edge stages), distributed optimizer, fp32, M=4": dict(
        layout=dict(pp=2, vpp=2), model=dict(BASE, num_layers=4, pipeline_model_parallel_layout="|Ett|ttL|"), m=4,
        build=dict(distributed_optimizer=True, params_dtype="fp32")),
    # A frozen base whose first stage holds no layer ('E|ttL', LoRA on the decoder only): rank 0's output
    # (the frozen embedding's) needs no gradient, so megatron-core 0.16.1's backward_step skips its backward
    # ("we intentionally skip the backward pass while preserving zero gradients"): it saves nothing, has no
    # gradient buffer; rank 1's received input requires grad (recv_forward builds it so), so its first
    # layer saves as any layer whose input needs a gradient and it still sends the input gradient back
    # (pp/send_recv as with a trained embedding). The DiT's formula (memory/dit_layouts.py) rests on this.
    "DP2 x PP2 (1F1B), layout E|ttL, frozen base + LoRA on the decoder, DDP, bf16, M=3": dict(
        layout=dict(pp=2), model=dict(BASE, num_layers=2, pipeline_model_parallel_layout="E|ttL"), m=3,
        build=dict(lora=(("linear_qkv", "linear_fc2"), 4))),
    # The same under TP2 + SP (LoRA on linear_fc1 only): layer 0 sits on rank 1, whose received input
    # requires grad, so its linear_qkv and linear_proj run their backward collectives (no frozen-first-layer
    # skip on either rank: Parallelism.holds_frozen_first_layer), and rank 0 (the frozen embedding alone)
    # runs no backward collective.
    "TP2 x PP2 + SP (1F1B), layout E|ttL, frozen base + LoRA on linear_fc1, DDP, bf16, M=2": dict(
        layout=dict(pp=2, tp=2, sp=True), model=dict(BASE, num_layers=2, pipeline_model_parallel_layout="E|ttL"),
        m=2, build=dict(lora=(("linear_fc1",), 4))),
    # Experts first: a frozen MoE model whose first adapters are its routed experts' (alltoall, EP2). Layer 0's
    # dispatcher still runs backward on rank 1 (its input requires grad), and rank 0 skips nothing it never runs.
    "EP2 x PP2, MoE top-2 of 4 (alltoall), layout E|ttL, frozen base + LoRA on linear_fc1 + linear_fc2, DDP, bf16, M=2":
        dict(layout=dict(pp=2, ep=2), model=dict(BASE, num_layers=2, pipeline_model_parallel_layout="E|ttL",
                                                 num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                                 moe_token_dispatcher_type="alltoall"),
             m=2, build=dict(lora=(("linear_fc1", "linear_fc2"), 4))),
}

# Standalone MTP stages on a pipeline rank of their own: PP3, in a 3-process group of its own. Rank 1
# builds an embedding copy (in the embedding group: Megatron-LM's get_embedding_ranks, the first rank,
# the last when tied, the MTP ranks) and the MTP layers, receives [s, b, h] and sends [(1 + k) s, b, h] to rank 2, which computes
# every loss.
PP3_WORLD = 3
PP3_RUNS = {
    "PP3 (1F1B), layout Ett|m|L, DDP, fp32, tied embeddings, M=2": dict(
        layout=dict(pp=3, world=PP3_WORLD, embedding_ranks=(0, 1, 2)),
        model=dict(BASE, num_layers=2, mtp_num_layers=1, pipeline_model_parallel_layout="Ett|m|L"), m=2,
        build=dict(params_dtype="fp32")),
    # 2 MTP depths on rank 1 beside a decoder layer: [3s, b, h] to rank 2; untied (no embedding group).
    "PP3 (1F1B), layout Et|tmm|L, distributed optimizer, bf16, untied, M=3": dict(
        layout=dict(pp=3, world=PP3_WORLD, embedding_ranks=(0, 1)),
        model=dict(BASE, num_layers=2, mtp_num_layers=2, pipeline_model_parallel_layout="Et|tmm|L"), m=3,
        build=dict(distributed_optimizer=True, share_embeddings=False)),
    # An empty stage before E: rank 0 builds the embedding alone (pre_process), layers 0-1 on rank 1.
    "PP3 (1F1B), layout |Ett|ttL (empty stage before the embedding), DDP, fp32, tied embeddings, M=3": dict(
        layout=dict(pp=PP3_WORLD, world=PP3_WORLD),
        model=dict(BASE, num_layers=4, pipeline_model_parallel_layout="|Ett|ttL"),
        m=3, build=dict(params_dtype="fp32")),
    # An empty stage after L: rank 2 builds the final norm, output layer and loss alone (post_process).
    "PP3 (1F1B), layout Ett|ttL| (empty stage after the loss), distributed optimizer, bf16, untied, M=3": dict(
        layout=dict(pp=PP3_WORLD, world=PP3_WORLD, embedding_ranks=(0,)),
        model=dict(BASE, num_layers=4, pipeline_model_parallel_layout="Ett|ttL|"),
        m=3, build=dict(distributed_optimizer=True, share_embeddings=False)),
}
ALL_RUNS = {**RUNS, **PP3_RUNS}


@pytest.fixture(scope="module")
def measured():
    return {**mcore_dist.run_by_name(memory_worker, WORLD, RUNS, timeout=600),
            **mcore_dist.run_by_name(memory_worker, PP3_WORLD, PP3_RUNS, timeout=600)}


@pytest.mark.parametrize("name", list(ALL_RUNS))
def test_parameters_in_megatron_order(measured, name):
    check_parameters(ALL_RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(ALL_RUNS))
def test_weights_gradients_optimizer_state(measured, name):
    check_states(ALL_RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(ALL_RUNS))
def test_communication_per_step(measured, name):
    check_communication(ALL_RUNS[name], measured[name])


def _routed(name: str) -> bool:
    """MoE under EP > 1: what one rank's experts save follows the routing."""
    return "MoE" in name and ALL_RUNS[name]["layout"].get("ep", 1) > 1


@pytest.mark.parametrize("name", [n for n in ALL_RUNS if not _routed(n)])
def test_activations_per_forward_and_schedule_peak(measured, name):
    check_activations(ALL_RUNS[name], measured[name])


@pytest.mark.parametrize("name", [n for n in ALL_RUNS if _routed(n)])
def test_moe_activations_balanced_per_stage(measured, name):
    check_routed_activations(ALL_RUNS[name], measured[name])


def check_routed_activations(run: dict, results: list) -> None:
    """One model chunk per rank, EP > 1: what one rank's experts save follows the routing, but over
    a pipeline stage's ranks every routed token is saved once, so the stage's measured forwards sum
    to the balanced figure's (a stage without MoE layers: per rank)."""
    spec, options, par, training, peft, recompute = setup(run)
    totals: dict[int, tuple[int, int]] = {}
    for result in results:
        pp_rank = result["sizes"]["pp_rank"]
        act = chunk_activations(spec, options, par, training, pp_rank=pp_rank, chunk=0, recompute=recompute, peft=peft)
        layers = len(par.chunk_layers(spec.num_layers, pp_rank, 0))
        # LayerNorms per forward as check_activations counts them (a frozen first layer's input norm: none)
        norms = 2 * layers + par.is_last_stage(pp_rank, 0) - par.holds_frozen_first_layer(spec.num_layers, pp_rank)
        forwards = [b for _, b in result["forward"]]
        measured, formula = totals.get(pp_rank, (0, 0))
        totals[pp_rank] = (measured + sum(forwards),
                           formula + (act.forward + act.shared + cpu_delta(par, training, norms)) * len(forwards))
    for pp_rank, (measured, formula) in totals.items():
        assert measured == formula, pp_rank
