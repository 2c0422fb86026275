"""Multi-latent attention under tensor parallelism and multi-token prediction under tensor and
pipeline parallelism, with and without sequence parallelism and full recompute: one real
training step each, on megatron-core in 4
gloo processes (tests/test_memory_dist.py's worker), against :mod:`megatron_flops.memory` to the
byte: parameters in order, weights, gradient buffers, optimizer state, every collective's payload,
the bytes each forward saves for backward and the schedule's peak."""

from __future__ import annotations

import dataclasses

import pytest

import mcore_cpu
import mcore_dist
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.activations import chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import rank_memory
from megatron_flops.model.spec import ModelSpec
from test_memory_dist import MBS, SEQ, VOCAB, WORLD, memory_worker

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
    "TP2 x PP2 + SP, MLA (direct q) + 1 MTP layer, untied, learned positions, full recompute (uniform 1), fp32": dict(
        layout=dict(tp=2, pp=2, sp=True), model=dict(MLA, num_layers=4, q_lora_rank=None, mtp_num_layers=1,
                                                     recompute_granularity="full", recompute_method="uniform",
                                                     recompute_num_layers=1),
        m=3, build=dict(params_dtype="fp32", share_embeddings=False, position_embedding_type="learned_absolute")),
}


@pytest.fixture(scope="module")
def measured():
    results = mcore_dist.run_distributed(memory_worker, WORLD, RUNS, timeout=600)
    return {name: [r[name] for r in results] for name in RUNS}


def setup(name: str):
    run = RUNS[name]
    model, build, layout = run["model"], run["build"], run["layout"]
    tied = build.get("share_embeddings", True)
    spec = ModelSpec.from_mapping(dict(model, vocab_size=VOCAB, share_embeddings_and_output_weights=tied))
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               transformer_impl="local",  # (the spec these runs build)
                                               position_embedding_type=build.get("position_embedding_type", "rope"),
                                               add_bias_linear=False))
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    par = Parallelism(tp=tp, pp=pp, vpp=layout.get("vpp"), dp=WORLD // (tp * pp),
                      sequence_parallel=layout.get("sp", False),
                      distributed_optimizer=build.get("distributed_optimizer", False))
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=run["m"],
                        params_dtype=build.get("params_dtype", "bf16"))
    recompute = RecomputeSpec.from_mapping(dict(model, pipeline_model_parallel_size=pp,
                                                virtual_pipeline_model_parallel_size=layout.get("vpp")))
    return spec, options, par, training, recompute


def expected(name: str, result: dict):
    spec, options, par, training, recompute = setup(name)
    sizes = result["sizes"]
    return rank_memory(spec, options, par, training, pp_rank=sizes["pp_rank"], dp_rank=sizes["dp_rank"],
                       recompute=recompute)


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_in_megatron_order(measured, name):
    spec, options, par, training, _ = setup(name)
    for result in measured[name]:
        for chunk, names in enumerate(result["names"]):
            params = chunk_parameters(spec, options, par, pp_rank=result["sizes"]["pp_rank"], chunk=chunk,
                                      seq_length=training.seq_length)
            assert [(p.name, p.numel) for p in params] == [tuple(n) for n in names]


@pytest.mark.parametrize("name", list(RUNS))
def test_weights_gradients_optimizer_state(measured, name):
    for result in measured[name]:
        assert expected(name, result).states == result["states"], result["sizes"]


@pytest.mark.parametrize("name", list(RUNS))
def test_communication_per_step(measured, name):
    for result in measured[name]:
        assert expected(name, result).communication == dict(result["comm"]), result["sizes"]


@pytest.mark.parametrize("name", list(RUNS))
def test_activations_per_forward_and_schedule_peak(measured, name):
    spec, options, par, training, recompute = setup(name)
    for result in measured[name]:
        pp_rank, chunks = result["sizes"]["pp_rank"], []
        for c in range(par.num_chunks):
            act = chunk_activations(spec, options, par, training, pp_rank=pp_rank, chunk=c, recompute=recompute)
            # torch's CPU LayerNorm keeps mean and rstd in the input dtype (CUDA: fp32): per norm
            # of the forward (2 per layer; on the last stage the final norm and 5 per MTP layer)
            # and token of its slice (the latent norms run in fp32 runs only).
            last = par.is_last_stage(pp_rank, c)
            norms = 2 * len(par.chunk_layers(spec.num_layers, pp_rank, c)) + last * (1 + 5 * spec.mtp_num_layers)
            delta = norms * SEQ * MBS // (par.tp if par.sequence_parallel else 1) * 2 * (training.param_bytes - 4)
            chunks.append(dataclasses.replace(act, components={**act.components, "cpu": delta}))
            assert {b for i, b in result["forward"] if i == c} == {act.forward + act.shared + delta}, result["sizes"]
        peak, _ = schedule_peak(chunks, in_flight(par, training.num_microbatches, pp_rank))
        assert peak == result["peak"], result["sizes"]
