"""Multi-latent attention under TP and multi-token prediction under PP/TP/recompute: pure checks
with the derivations written out (the gloo measurements: tests/test_memory_mla_mtp_dist.py)."""

from __future__ import annotations

import pytest

from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory, rank_memory
from megatron_flops.model.spec import ModelSpec

VOCAB, SEQ, MBS = 96, 16, 2
MLA = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, multi_latent_attention=True,
           q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
           qk_layernorm=True, mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)


def _setup(fields: dict, **layout):
    spec = ModelSpec.from_mapping(dict(fields, vocab_size=VOCAB))
    options = DecoderOptions.from_mapping(dict(fields, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope"))
    return spec, options, Parallelism(**layout)


def test_mla_tp2_splits_every_projection_and_gathers_the_latents():
    spec, options, par = _setup(MLA, tp=2, dp=2)
    names = {p.name: p.numel for p in chunk_parameters(spec, options, par, pp_rank=0, chunk=0, seq_length=SEQ)}
    attn = "decoder.layers.0.self_attention."
    assert names[attn + "linear_q_down_proj.weight"] == 24 // 2 * 48  # [q_lora/TP, h]
    assert names[attn + "linear_kv_down_proj.weight"] == (32 + 8) // 2 * 48  # [(kv_lora + rope)/TP, h]
    assert names[attn + "linear_q_up_proj.weight"] == 4 * (16 + 8) // 2 * 24  # [heads (qk + rope)/TP, q_lora]
    assert names[attn + "linear_kv_up_proj.weight"] == 4 * (16 + 16) // 2 * 32  # [heads (qk + v)/TP, kv_lora]
    assert names[attn + "linear_proj.weight"] == 48 * 4 * 16 // 2  # [h, heads v/TP]
    assert names[attn + "kv_layernorm.weight"] == 32  # whole on every TP rank
    assert names["mtp.layers.0.eh_proj.weight"] == 48 // 2 * 2 * 48  # [h/TP, 2h]
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=2, params_dtype="fp32")
    comm = rank_memory(spec, options, par, training, pp_rank=0).communication
    # Per micro-batch, T = 32 tokens, fp32: 3 MLA layers (2 + the MTP layer's) gather their
    # latents [T, q_lora + kv_lora + rope] = 32 x 64 x 4 = 8,192 bytes each, and the MTP layer
    # eh_proj's output [T, h] = 6,144: 30,720, twice (measured: 61,440).
    assert comm["tp/all_gather"] == 2 * (3 * 32 * 64 * 4 + 32 * 48 * 4) == 61_440


def test_mtp_under_pp_keeps_an_embedding_copy_on_the_last_stage():
    spec, options, par = _setup(dict(MLA, num_layers=4), pp=2, dp=2, distributed_optimizer=True)
    last = chunk_parameters(spec, options, par, pp_rank=1, chunk=0, seq_length=SEQ)
    first = chunk_parameters(spec, options, par, pp_rank=0, chunk=0, seq_length=SEQ)
    assert last[0].name == "embedding.word_embeddings.weight" and last[0].shared_embedding
    assert first[0].shared_embedding
    # Tied: the last stage's output weight is allocated but unused (not the one reduced).
    assert [p.shared_embedding for p in last if p.name == "output_layer.weight"] == [False]
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=3)
    for pp_rank in (0, 1):
        comm = rank_memory(spec, options, par, training, pp_rank=pp_rank).communication
        assert comm["embd/all_reduce"] == VOCAB * 48 * 4  # the [V, h] gradient in fp32: 18,432 (measured)


def test_mla_mtp_layouts_are_reported_in_full():
    spec, options, par = _setup(MLA, tp=2, pp=1, dp=2, sequence_parallel=True)
    training = Training(seq_length=SEQ, micro_batch_size=MBS)
    recompute = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    report = decoder_memory(spec, options, par, training, recompute=recompute)
    assert report.not_modelled == () and report.per_gpu.activations
    assert any("parallel_mode='duplicated'" in a for a in report.assumptions)


def test_refused_layouts():
    spec, options, _ = _setup(dict(MLA, kv_lora_rank=31))
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_pos_emb_head_dim=39"):
        decoder_memory(spec, options, Parallelism(tp=2), Training(seq_length=SEQ, micro_batch_size=MBS))
    spec, options, par = _setup(MLA)
    with pytest.raises(ValueError, match="recompute_num_layers=1"):
        decoder_memory(spec, options, par, Training(seq_length=SEQ, micro_batch_size=MBS),
                       recompute=RecomputeSpec(granularity="full", method="uniform", num_layers=2))
