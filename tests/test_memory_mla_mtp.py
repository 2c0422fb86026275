"""Multi-latent attention under TP and multi-token prediction under PP/TP/recompute: pure checks
with the derivations written out (the gloo measurements: tests/test_memory_mla_mtp_dist.py)."""

from __future__ import annotations

import json

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
                                               position_embedding_type="rope", transformer_impl="local"))
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


def _te_minus_local(key_fn, **layout):
    spec, local, par = _setup(MLA, **layout)
    te = DecoderOptions(**{**vars(local), "transformer_impl": "transformer_engine"})
    training = Training(seq_length=SEQ, micro_batch_size=MBS, params_dtype="fp32")
    return [key_fn(spec, options, par, training) for options in (te, local)]


def test_mla_transformer_engine_keeps_the_down_projections_whole_on_every_tp_rank():
    def down(spec, options, par, training):
        return {p.name: (p.numel, p.tp_replicated) for p in chunk_parameters(spec, options, par, pp_rank=0, chunk=0,
                                                                              seq_length=SEQ) if "down_proj" in p.name}
    te, local = _te_minus_local(down, tp=2, dp=2)
    attn = "decoder.layers.0.self_attention."
    assert te[attn + "linear_q_down_proj.weight"] == (24 * 48, True)  # [q_lora, h], whole
    assert te[attn + "linear_kv_down_proj.weight"] == ((32 + 8) * 48, True)  # [kv_lora + rope, h], whole
    assert local[attn + "linear_kv_down_proj.weight"] == ((32 + 8) // 2 * 48, False)
    # 3 MLA layers (2 + the MTP layer's) each hold half of [24 + 40, 48] more: 4,608 elements,
    # x 4 bytes (fp32, DDP) in weights, gradients and both Adam moments.
    states = _te_minus_local(lambda *a: rank_memory(*a, pp_rank=0).states, tp=2, dp=2)
    assert {k: states[0][k] - states[1][k] for k in states[0]} == {
        "weights": 18_432, "gradients": 18_432, "optimizer/exp_avg": 18_432, "optimizer/exp_avg_sq": 18_432}


def test_mla_transformer_engine_tp_traffic():
    def comm(*args):
        return rank_memory(*args, pp_rank=0).communication

    # T = 32 tokens, h = 48, q = 24, kv = 32, rope = 8, fp32, 3 MLA layers, one micro-batch.
    te, local = _te_minus_local(comm, tp=2, dp=2)
    assert te["dp/all_reduce"] - local["dp/all_reduce"] == 4_608 * 4  # the gradients above
    # No latent all-gather: only the MTP layer's eh_proj output [T, h] = 6,144 bytes.
    assert te["tp/all_gather"] == 32 * 48 * 4 == 6_144
    # Backward all-reduces: local, hidden states twice + both latents; TE, the latents only
    # (a dense layer's one hidden-state reduction taken off): 2h fewer per token and layer.
    # Once per step, finalize_model_grads matches q_layernorm by name, which TE fuses into
    # linear_q_up_proj (layer_norm_weight/bias): 3 x 2 x 24 elements fewer reduced (fp32).
    assert local["tp/all_reduce"] - te["tp/all_reduce"] == 3 * 32 * 2 * 48 * 4 + 3 * 2 * 24 * 4 == 37_440
    te, local = _te_minus_local(comm, tp=2, dp=2, sequence_parallel=True)
    # Under SP, per layer and token beyond a dense layer: local gathers the second down
    # projection's input (h), the latents (q + kv + rope) and the up projections' inputs (q + kv)
    # forward, and in backward the same but the RoPE part: 2h + 4q + 4kv + rope. TE gathers the
    # up projections' inputs both ways (2q + 2kv) and the RoPE key part (rope), and lacks the
    # dense linear_qkv's two hidden-state gathers: 2q + 2kv + rope - 2h. Difference 4h + 2q + 2kv.
    assert local["tp/all_gather"] - te["tp/all_gather"] == 3 * 32 * (4 * 48 + 2 * 24 + 2 * 32) * 4 == 116_736
    # Reduce-scatters: local h + q + kv extra, TE rope + q + kv - h: 2h - rope fewer.
    assert local["tp/reduce_scatter"] - te["tp/reduce_scatter"] == 3 * 32 * (2 * 48 - 8) * 4 == 33_792
    # The down projections' gradients join finalize_model_grads' TP all-reduce (their
    # sequence_parallel attribute): 3 x (24 + 40) x 48 = 9,216 elements, fp32.
    assert te["tp/all_reduce"] - local["tp/all_reduce"] == 3 * 64 * 48 * 4 == 36_864
    spec, local, _ = _setup(dict(MLA, kv_lora_rank=31))  # TE: the latents need not divide by TP
    te = DecoderOptions(**{**vars(local), "transformer_impl": "transformer_engine"})
    report = decoder_memory(spec, te, Parallelism(tp=2), Training(seq_length=SEQ, micro_batch_size=MBS))
    assert report.unmeasured and "parallel_mode='duplicated'" in report.unmeasured[0]


def test_cli_transformer_impl_flag(tmp_path, capsys):
    from megatron_flops.cli import main

    path = tmp_path / "mla.json"
    path.write_text(json.dumps(dict(MLA, vocab_size=VOCAB)))
    weights = {}
    for impl in ("transformer_engine", "local"):
        main(["memory", "--model", str(path), "--seq-length", str(SEQ), "--tp", "2", "--params-dtype", "fp32",
              "--transformer-impl", impl, "--json"])
        report = json.loads(capsys.readouterr().out)
        weights[impl] = report["per_gpu"]["weights_bytes"]
    # 3 MLA layers x half of [24 + 40, 48] more elements per TP rank, fp32 (as above).
    assert weights["transformer_engine"] - weights["local"] == 4_608 * 4
