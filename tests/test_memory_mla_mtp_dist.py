"""Multi-latent attention under tensor parallelism and multi-token prediction under tensor and
pipeline parallelism, with and without sequence parallelism and full recompute: one real
training step each, on megatron-core in 4 gloo processes (tests/test_memory_dist.py's worker and
checks), against :mod:`megatron_flops.memory` to the byte: parameters in order, weights, gradient
buffers, optimizer state, every collective's payload, the bytes each forward saves for backward
and the schedule's peak."""

from __future__ import annotations

import pytest

import mcore_cpu
import mcore_dist
from test_memory_dist import (WORLD, check_activations, check_communication, check_parameters, check_states,
                              memory_worker)

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

BASE = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, hidden_dropout=0.0,
            attention_dropout=0.0)
# Latent widths that divide by TP 2 (the local spec splits the down projections' outputs).
MLA = dict(BASE, multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, normalization="LayerNorm")

# name -> layout (tp, pp), model, micro-batches, build options (tests/mcore_memory.build_training)
RUNS = {
    "TP2 x DP2, MLA (q_lora, latent norms) + 1 MTP layer, distributed optimizer, fp32": dict(
        layout=dict(tp=2), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, mtp_num_layers=1), m=2,
        build=dict(distributed_optimizer=True, params_dtype="fp32")),
    # (MTP and the embedding copy on the last virtual stage: chunk 1 of pipeline rank 1.)
    "PP2 x VPP2 x DP2 (interleaved), MLA (direct q) + 1 MTP layer, tied embeddings, distributed optimizer, bf16, M=4":
        dict(layout=dict(pp=2, vpp=2), model=dict(MLA, num_layers=4, q_lora_rank=None, mtp_num_layers=1), m=4,
        build=dict(distributed_optimizer=True)),
    "TP2 x PP2, 2 MTP layers, untied, learned positions, full recompute (uniform 1), DDP, fp32, M=3": dict(
        layout=dict(tp=2, pp=2), model=dict(BASE, num_layers=4, mtp_num_layers=2, recompute_granularity="full",
                                            recompute_method="uniform", recompute_num_layers=1),
        m=3, build=dict(params_dtype="fp32", share_embeddings=False, position_embedding_type="learned_absolute")),
    # Sequence parallelism (the torch norm marked as TE marks it: mcore_memory.patch_sequence_parallel_norm).
    "TP2 x DP2 + SP, MLA (q_lora, latent norms) + 1 MTP layer, distributed optimizer, fp32": dict(
        layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, mtp_num_layers=1), m=2,
        build=dict(distributed_optimizer=True, params_dtype="fp32")),
    # Selective mla_up_proj (CheckpointWithoutOutput, measured with the live-storage meter): per MLA
    # layer (2 + 1 MTP) and micro-batch the re-run all-gathers the up projections' inputs again,
    # 32 tokens x (q_lora 24 + kv_lora 32) x 4 B = 7168 B (x 3 x 2 = 43008 B of tp/all_gather per
    # step), and its checkpoint keeps k_pos_emb, a view of the all-gathered kv_down output
    # [32, 32 + 8] fp32 = 5120 B per layer that the layer alone would not keep.
    "TP2 x DP2 + SP, MLA (q_lora, latent norms) + 1 MTP layer, selective mla_up_proj, DDP, fp32": dict(
        layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, mtp_num_layers=1,
                                               recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
        m=2, build=dict(params_dtype="fp32"), live=True),
    "TP2 x PP2 + SP, MLA (direct q) + 1 MTP layer, untied, learned positions, full recompute (uniform 1), fp32": dict(
        layout=dict(tp=2, pp=2, sp=True), model=dict(MLA, num_layers=4, q_lora_rank=None, mtp_num_layers=1,
                                                     recompute_granularity="full", recompute_method="uniform",
                                                     recompute_num_layers=1),
        m=3, build=dict(params_dtype="fp32", share_embeddings=False, position_embedding_type="learned_absolute")),
}


@pytest.fixture(scope="module")
def measured():
    return mcore_dist.run_by_name(memory_worker, WORLD, RUNS, timeout=600)


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_in_megatron_order(measured, name):
    check_parameters(RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(RUNS))
def test_weights_gradients_optimizer_state(measured, name):
    check_states(RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(RUNS))
def test_communication_per_step(measured, name):
    check_communication(RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(RUNS))
def test_activations_per_forward_and_schedule_peak(measured, name):
    check_activations(RUNS[name], measured[name])
