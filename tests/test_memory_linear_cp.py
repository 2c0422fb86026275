"""Context parallelism of Gated DeltaNet and DeepSeek sparse attention layers (memory/linear_cp.py),
as megatron-core 0.19.0 runs them (0.16.1 refuses CP for both).

Measured: the real 0.19.0 ``GatedDeltaNet`` and DSA attention (``AbsorbedMLASelfAttention`` around
``DSAttention``) in 2 gloo processes at CP 1 and CP 2, TP 1, in megatron-core 0.19.0's Python 3.12
venv (tests/frameworks/envs.py; skipped where it cannot be made), run by tests/linear_cp_019.py:
every storage saved for backward and every ``cp/*`` payload, forward and backward. fla's kernels
(GDN) are stand-ins saving what the kernels save (those sizes stay formulas, labelled unmeasured
by the report as without CP); DSA runs its own torch path (a stand-in only for
fast_hadamard_transform, which saves nothing).
Formulas: exact integers with the derivation; the report at CP 1 equals the report without CP."""

from __future__ import annotations

import json

import pytest

from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.activations import chunk_activations
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import INDEX_BYTES, Parallelism, Training
from megatron_flops.memory.linear_cp import (dsa_cp_communication, dsa_cp_recompute_held, dsa_cp_saved,
                                             dsa_cp_traffic, gdn_cp_all_to_all, gdn_cp_head_permutation, gdn_cp_saved)
from megatron_flops.memory.report import decoder_memory
from megatron_flops.memory.ssm import gdn_saved, mixer_tensors, mtp_mixer
from megatron_flops.model.spec import ModelSpec

# GDN: 2 key heads x 16 (qk 32), 4 value heads x 8 (v 32), conv 4 (tests/test_memory_ssm.py's sizes).
GDN_LAYER = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
GDN = dict(GDN_LAYER, num_layers=4, vocab_size=256, normalization="RMSNorm", add_bias_linear=False,
           experimental_attention_variant="gated_delta_net", linear_attention_freq=2)
# DSA: 4 heads, q latent 24, kv latent 32, RoPE 8, qk 16, v 16; indexer 2 heads of 16, top-8.
DSA_LAYER = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, multi_latent_attention=True,
                 q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                 dsa_indexer_n_heads=2, dsa_indexer_head_dim=16, dsa_indexer_topk=8)
# Index sharing (megatron-core 0.19's dsa_indexer_topk_freq): layer 2 reuses layer 1's top-k.
SHARED = dict(DSA_LAYER, num_layers=2, dsa_indexer_topk_freq=2)
OPTIONS = dict(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope", padded_vocab_size=256)


def _dsa_spec(layer: dict, loss: bool) -> ModelSpec:
    fields = dict(layer, vocab_size=256, experimental_attention_variant="dsa", normalization="RMSNorm",
                  add_bias_linear=False, dsa_indexer_loss_coeff=0.01 if loss else 0.0)
    return ModelSpec.from_mapping(fields)


def test_gdn_cp_formulas():
    spec = ModelSpec.from_mapping(GDN)
    # CP 1 is the formula without CP (tests/test_memory_ssm.py derives 47,888 for T = 32, bf16).
    assert gdn_cp_saved(spec, tokens=32, tp=1, cp=1, act=2, param=2) == gdn_saved(spec, tokens=32, tp=1, act=2,
                                                                                  param=2) == 47_888
    assert gdn_cp_all_to_all(spec, tokens=32, tp=1, cp=1, act=2) == 0
    # CP 2, T = 16 on this rank: the kernels on 32 tokens with 1 key head (qk 16), 2 value heads (v 16):
    # conv input 32*48*2 = 3,072; l2norm 2*(32*16*2 + 32*4) = 2,304; repeated q, k 2*32*2*16*2 = 4,096;
    # softplus 2*32*2*4 + exp, -exp 2*2*2 + beta 32*2*2 = 648; v 1,024, cumulated g 256, WY matrix
    # 32*2*64*2 = 8,192; gated norm 3*1,024 + 256; out_proj's input [16, 32] 1,024: 23,944. Under CP:
    # the conv weight's slice [48, 4] bf16 384: 24,328.
    assert gdn_cp_saved(spec, tokens=16, tp=1, cp=2, act=2, param=2) == 24_328
    # The int64 head permutation [136]: 1,088 once per rank (megatron-core's lru_cache), on every
    # stage holding a GDN layer (GDN's layers 0 and 2 of 4 alternate with attention), none at CP 1.
    assert [gdn_cp_head_permutation(spec, Parallelism(cp=2, pp=pp), pp_rank=r) for pp in (1, 4) for r in range(pp)
            ] == [1_088, 1_088, 0, 1_088, 0]
    assert gdn_cp_head_permutation(spec, Parallelism(cp=1), pp_rank=0) == 0
    # in_proj's output [16, 2*32 + 2*32 + 2*4 = 136] and the norm's output [32, 16] back: (2,176 + 512) x 2.
    assert gdn_cp_all_to_all(spec, tokens=16, tp=1, cp=2, act=2) == 5_376


def test_dsa_cp_formulas():
    trains, frozen = _dsa_spec(DSA_LAYER, True), _dsa_spec(DSA_LAYER, False)
    # CP 2, s = 8 of S = 16 tokens, b = 2 (T = 16), bf16, the indexer frozen (loss coefficient 0).
    # MLA: q latent [16, 24] 768, query [16, 4, 24] 3,072, cos/sin 4 x [8, 8] 512: 4,352. The
    # zigzag order [16] int64 128. Sparse attention: fp32 query [16, 4, 40] 10,240 and key expanded
    # [8, 40, 16] 20,480; masked softmax (scores [2, 4, 8, 16] = 1,024): 3 bool masks 3,072, two fp32
    # 8,192, arg-max, row flag, two row sums 64 x (8 + 1 + 8) = 1,088; bf16 probabilities 2,048;
    # value [8, 16, 32] bf16 8,192: 53,312. Out: up-projection weight [4, 16, 32] 4,096, latent
    # output [16, 4, 32] 4,096, linear_proj's input [16, 64] 2,048: 10,240. Total 68,032.
    assert dsa_cp_saved(frozen, s=8, b=2, cp=2, act=2, latent_norms=False, norm_stats=4) == 68_032
    # The indexer training adds: cos/sin 512, k_norm's input [16, 16] 512 and fp32 stats 128, q
    # [16, 2, 16] 1,024 and weights [16, 2] 64, gathered k [32, 16] 1,024, detached query [16, 4, 40]
    # 5,120, gathered key [32, 40] 2,560, top-k [2, 8, 8] int64 1,024: 11,968.
    assert dsa_cp_saved(trains, s=8, b=2, cp=2, act=2, latent_norms=False, norm_stats=4) == 68_032 + 11_968
    # Latent norms (RMSNorm): the q latent again 768 and the kv down output [16, 40] 1,280, 2 x 16 x 4 stats.
    assert dsa_cp_saved(trains, s=8, b=2, cp=2, act=2, latent_norms=True, norm_stats=4) == 80_000 + 2_176
    # Forward: the key [32, 40] and the indexer key [32, 16] gathered (bf16) and 2 int64 lengths;
    # backward: the key's gradient, and the indexer key's when it trains.
    assert dsa_cp_communication(trains, s=8, b=2, cp=2, act=2) == {"cp/all_gather": 2_560 + 1_024 + 16,
                                                                   "cp/reduce_scatter": 3_584}
    assert dsa_cp_communication(frozen, s=8, b=2, cp=2, act=2)["cp/reduce_scatter"] == 2_560


def test_dsa_cp_formulas_with_a_shared_top_k_and_tensor_parallelism():
    trains, frozen = _dsa_spec(SHARED, True), _dsa_spec(SHARED, False)
    f = lambda spec, **kw: dsa_cp_saved(spec, s=8, b=2, cp=2, act=2, latent_norms=False, norm_stats=4, **kw)  # noqa: E731
    # A layer reusing the top-k (CP 2, s = 8, b = 2): no indexer, what a frozen computing layer keeps
    # (68,032 above) whether or not the indexer trains.
    assert f(trains, indexer=False) == f(frozen, indexer=False) == 68_032
    # A frozen computing layer of this model also leaves its int64 top-k [2, 8, 8] in the holder: 1,024;
    # a training one keeps it for the loss already (80,000 above).
    assert f(frozen) == 68_032 + 1_024 and f(trains) == 80_000
    # TP 2 under sequence parallelism (2 heads a rank): MLA q latent [16, 24] 768 (whole: q_up's input is
    # a slice of it), query [16, 2, 24] 1,536, cos/sin 512; order 128; fp32 query [16, 2, 40] 5,120, key
    # [4, 40, 16] 10,240; softmax (scores [2, 2, 8, 16] = 512): masks 1,536, two fp32 4,096, rows
    # 32 x 17 = 544; probabilities 1,024; value [4, 16, 32] 4,096; up weight [2, 16, 32] 2,048, latent
    # output [16, 2, 32] 2,048, linear_proj's input [16, 32] 1,024: 34,720.
    assert f(trains, tp=2, indexer=False) == 34_720
    # The training indexer adds 11,968 less the detached query's other 2 heads (2,560), plus its gathered
    # inputs [16, 64 + 24] 2,816: 12,224.
    assert f(trains, tp=2) == 34_720 + 12_224
    # Latent norms under sequence parallelism: q_up's input, the q norm's output [8, 24] 384, the kv down
    # output [16, 40] 1,280, fp32 statistics of 8 tokens twice 64.
    assert dsa_cp_saved(trains, s=8, b=2, cp=2, act=2, latent_norms=True, norm_stats=4, tp=2,
                        indexer=False) == 34_720 + 384 + 1_280 + 64
    # Traffic: a reusing layer gathers no indexer key; under TP 2 + SP the indexer gathers [16, 64 + 24]
    # every forward; the loss all-reduces fp32 [2, 8, 16] forward and backward; one [16, 32] all-gather
    # fewer than an MLA layer's.
    assert dsa_cp_communication(trains, s=8, b=2, cp=2, act=2, indexer=False) == {"cp/all_gather": 2_560 + 16,
                                                                                  "cp/reduce_scatter": 2_560}
    assert dsa_cp_traffic(trains, s=8, b=2, cp=2, act=2, tp=2) == (
        {"cp/all_gather": 3_600, "tp/all_gather": 2_816},
        {"cp/reduce_scatter": 3_584, "tp/all_gather": -1_024, "tp/all_reduce": 2_048})
    assert dsa_cp_traffic(trains, s=8, b=2, cp=2, act=2, tp=2, indexer=False)[1]["tp/all_reduce"] == 0


@pytest.mark.parametrize("trains", [False, True])
def test_dsa_cp_full_recompute(trains):
    # SHARED (layer 1 computes its top-k, layer 2 reuses it), CP 2, s = 8 of S = 16 tokens, b = 2, bf16; one
    # layer per checkpoint. Each checkpoint keeps its input [16, 64] 2,048; the computing layer's first,
    # no-grad forward leaves its int64 top-k [2, 8, 8] 1,024 in the holder whether or not the indexer trains
    # (no loss is built to save it).
    spec = _dsa_spec(SHARED, trains)
    assert dsa_cp_recompute_held(spec, "dsa", s=8, b=2, cp=2) == 1_024
    assert dsa_cp_recompute_held(spec, "dsa_shared", s=8, b=2, cp=2) == 0
    assert dsa_cp_recompute_held(spec, "dsa", s=8, b=2, cp=1) == 0
    assert dsa_cp_recompute_held(_dsa_spec(DSA_LAYER, trains), "dsa", s=8, b=2, cp=2) == 0  # (no layer reuses it)
    options = DecoderOptions.from_mapping(dict(SHARED, vocab_size=256, **OPTIONS))
    chunk = lambda recompute: chunk_activations(spec, options, Parallelism(cp=2), Training(  # noqa: E731
        seq_length=8, micro_batch_size=2), pp_rank=0, chunk=0, recompute=recompute)
    plain, full = chunk(None), chunk(RecomputeSpec(granularity="full", method="uniform", num_layers=1))
    # Before the layers: the ids 128 and the embedding's dropout mask [16, 64] bool 1,024: 1,152. The
    # layers' own bytes without recompute, L1 + L2 (what each re-run saves again, its input included):
    # L1 - L2 is what the computing layer's attention keeps beyond the reusing one's (dsa_cp_saved: the
    # held top-k 1,024 when the indexer is frozen, the indexer's 11,968 when it trains).
    before, output = 128 + 1_024, plain.components["output"]
    both = plain.forward - before - output
    diff = 11_968 if trains else 1_024
    l1, l2 = (both + diff) // 2, (both - diff) // 2
    assert (l1, l2) == ((98_560, 86_592) if trains else (87_616, 86_592))
    assert full.components == {"embedding": 128, "dropout": 1_024, "recompute": 2 * 2_048, "attention": 1_024,
                               "output": output}
    # Backward re-runs layer 2 first (layer 1's input and held top-k kept), then layer 1 (the held top-k
    # replaced only once its re-run ends: both held meanwhile; frozen, the new one is in L1).
    assert full.backward_peak == before + max(2_048 + 1_024 + l2, 1_024 + l1) == (100_736 if trains else 90_816)


def test_cli_reports_dsa_under_tp_sp_cp_with_full_recompute(tmp_path, capsys):
    # (The coverage survey skips it: `estimate` refuses recompute with DSA layers.) Full recompute is reported;
    # selective recompute of core_attn (the default), which 0.19.0's absorbed-MLA layer checkpoints itself, is not.
    from megatron_flops.cli import main
    model = tmp_path / "dsa.json"
    model.write_text(json.dumps(dict(SHARED, vocab_size=256, experimental_attention_variant="dsa")))
    argv = ["memory", "--model", str(model), "--seq-length", "16", "--tp", "2", "--sequence-parallel", "--cp", "2",
            "--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["not_modelled"] == [] and isinstance(report["per_gpu"]["activations_bytes"], int)
    assert main([*argv[:10], "--recompute", "selective", "--json"]) == 0
    assert "not of core_attn, mla_up_proj or layernorm" in json.loads(capsys.readouterr().out)["not_modelled"][0]


def _reports(model: dict, cps: tuple[int, ...], **par) -> list:
    spec = ModelSpec.from_mapping(model)
    options = DecoderOptions.from_mapping(dict(model, **OPTIONS))
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2)
    return [decoder_memory(spec, options, Parallelism(cp=cp, **par), training) for cp in cps]


@pytest.mark.parametrize("name", ["gdn", "dsa"])
def test_cp1_equals_the_report_without_cp(name):
    dsa = dict(DSA_LAYER, num_layers=2, vocab_size=256, experimental_attention_variant="dsa")
    model = GDN if name == "gdn" else dsa
    with_cp1, without = _reports(model, (1,), dp=2) + [decoder_memory(
        ModelSpec.from_mapping(model), DecoderOptions.from_mapping(dict(model, **OPTIONS)), Parallelism(dp=2),
        Training(seq_length=16, micro_batch_size=2, num_microbatches=2))]
    assert with_cp1 == without


def test_cp2_reports_gdn_and_dsa():
    gdn = _reports(GDN, (2,))[0]
    spec = ModelSpec.from_mapping(GDN)
    # 2 micro-batches x 2 GDN layers x (forward + backward) x 5,376 (8 of 16 tokens x 2 sequences);
    # the 2 attention layers pass K, V round the ring.
    assert gdn.per_gpu.communication["cp/all_to_all"] == 2 * 2 * 2 * 5_376
    assert gdn.per_gpu.activations_per_microbatch[0]["gdn"] == 2 * (16 * 64 * 2 + gdn_cp_saved(
        spec, tokens=16, tp=1, cp=2, act=2, param=2))
    # PP 1 holds one micro-batch at its peak, and the one head permutation [136] int64 its 2 GDN layers share.
    assert gdn.per_gpu.activations == sum(gdn.per_gpu.activations_per_microbatch[0].values()) + 1_088
    assert any("Gated DeltaNet under context parallelism (CP 2) as megatron-core 0.19.0" in a for a in gdn.assumptions)
    assert not gdn.not_modelled and not any("cp/all_to_all of Gated DeltaNet" in u for u in gdn.unmeasured)
    assert any("cp/all_to_all of Gated DeltaNet layers under TP 2 x CP 2" in u
               for u in _reports(dict(GDN, linear_num_key_heads=4, linear_num_value_heads=8), (2,), tp=2)[0].unmeasured)
    model = dict(DSA_LAYER, num_layers=2, vocab_size=256, experimental_attention_variant="dsa")
    dsa = _reports(model, (2,))[0]
    comm = dsa.per_gpu.communication
    assert "cp/send_recv" not in comm and comm["cp/all_gather"] == 2 * 2 * (2_560 + 1_024 + 16)
    assert not dsa.not_modelled and not any("context parallelism (CP 2)" in u for u in dsa.unmeasured)
    spec = ModelSpec.from_mapping(model)
    assert dsa.per_gpu.activations_per_microbatch[0]["attention"] == 2 * (16 * 64 * 2 + dsa_cp_saved(
        spec, s=8, b=2, cp=2, act=2, latent_norms=False, norm_stats=4))


def test_cp2_reports_dsa_layers_reusing_a_top_k_under_tp_and_sequence_parallelism():
    # Layer 1 computes its top-k (indexer frozen: the holder's top-k counted with it), layer 2 reuses it:
    # each keeps its input [T/TP, h] and dsa_cp_saved's bytes (8 of 16 tokens x 2 sequences on a CP rank).
    spec = ModelSpec.from_mapping(dict(SHARED, vocab_size=256, experimental_attention_variant="dsa"))
    for tp, par in ((1, {}), (2, dict(tp=2, sequence_parallel=True))):
        report = _reports(dict(SHARED, vocab_size=256, experimental_attention_variant="dsa"), (2,), **par)[0]
        assert not report.not_modelled and not any("reuse an earlier top-k" in u for u in report.unmeasured)
        assert any("reuse an earlier layer's top-k" in a for a in report.assumptions)
        assert report.per_gpu.activations_per_microbatch[0]["attention"] == sum(
            16 // tp * 64 * 2 + dsa_cp_saved(spec, s=8, b=2, cp=2, act=2, latent_norms=False, norm_stats=4, tp=tp,
                                              indexer=indexer) for indexer in (True, False))
        comm = report.per_gpu.communication
        # 2 micro-batches x (layer 1: key [32, 40] + indexer key [32, 16] + 16; layer 2: key + 16) forward, no
        # ring; backward the keys' gradients only (the indexer frozen).
        assert "cp/send_recv" not in comm and comm["cp/all_gather"] == 2 * (3_600 + 2_576)
        assert comm["cp/reduce_scatter"] == 2 * 2 * 2_560


def test_cp2_counts_the_last_stages_gdn_mtp_layer():
    # One MTP layer whose mixer is GDN (the last decoder layer's kind): its all-to-alls are one more
    # GDN layer's, 2 micro-batches x (forward + backward) x 5,376 (8 of 16 tokens x 2 sequences x
    # (2 x 32 + 3 x 32 + 2 x 4) x 2 bytes); everything else on the CP ring is unchanged.
    model = dict(GDN, linear_attention_freq=[0, 1, 0, 1])
    assert mtp_mixer(ModelSpec.from_mapping(dict(model, mtp_num_layers=1))) == "gdn"
    with_mtp = _reports(dict(model, mtp_num_layers=1), (2,))[0].per_gpu.communication
    without = _reports(model, (2,))[0].per_gpu.communication
    assert with_mtp["cp/all_to_all"] - without["cp/all_to_all"] == 2 * 2 * 8 * 2 * (2 * 32 + 3 * 32 + 2 * 4) * 2
    assert with_mtp["cp/send_recv"] == without["cp/send_recv"]

def test_cp2_counts_the_last_stages_attention_mtp_layer():
    # An MTP layer with softmax attention passes its K and V round the CP ring as a decoder layer does:
    # 2 micro-batches x (CP-1 = 1 step) x 2 x (K,V forward + K,V and their gradients backward = 3 x kv),
    # kv = 2 (K and V) x 8 of 16 tokens x 2 sequences x 4 groups x 16 channels x 2 bytes = 4,096.
    model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256)
    with_mtp = _reports(dict(model, mtp_num_layers=1), (2,))[0].per_gpu.communication
    without = _reports(model, (2,))[0].per_gpu.communication
    assert with_mtp["cp/send_recv"] - without["cp/send_recv"] == 2 * 1 * 2 * 3 * (2 * 8 * 2 * 4 * 16 * 2)
    assert without["cp/send_recv"] == 2 * (2 * 1 * 2 * 3 * (2 * 8 * 2 * 4 * 16 * 2))  # two decoder layers


def test_refusals(tmp_path, capsys):
    from megatron_flops.cli import main

    model = tmp_path / "gdn.json"
    model.write_text(json.dumps(GDN))
    assert main(["memory", "--model", str(model), "--seq-length", "64", "--cp", "4"]) == 2
    assert "linear_num_key_heads / TP = 2 is not divisible by --cp 4" in capsys.readouterr().err
    model.write_text(json.dumps(dict(DSA_LAYER, vocab_size=256, experimental_attention_variant="dsa")))
    assert main(["memory", "--model", str(model), "--seq-length", "64", "--cp", "2", "--tp", "2"]) == 2
    assert "requires sequence parallelism under TP" in capsys.readouterr().err


# (layer, CP, seq, micro-batch, fields, indexer loss coefficient, dtype: megatron-core 0.19.0's DSA indexer
# asserts bf16)
CASES = [
    dict(layer="gdn", cp=2, seq=16, mbs=2, model=GDN_LAYER),
    dict(layer="gdn", cp=1, seq=16, mbs=2, model=GDN_LAYER),
    dict(layer="gdn", cp=2, seq=16, mbs=2, model=GDN_LAYER, layers=2),
    dict(layer="dsa", cp=2, seq=16, mbs=2, model=DSA_LAYER, loss_coeff=0.01, dtype="bfloat16"),
    dict(layer="dsa", cp=1, seq=16, mbs=2, model=DSA_LAYER, loss_coeff=0.01, dtype="bfloat16"),
    dict(layer="dsa", cp=2, seq=16, mbs=2, model=DSA_LAYER, loss_coeff=0.0, dtype="bfloat16"),
    dict(layer="dsa", cp=2, seq=24, mbs=1, model=dict(DSA_LAYER, q_lora_rank=None), loss_coeff=0.01, dtype="bfloat16"),
    dict(layer="dsa", cp=2, seq=16, mbs=1, model=dict(DSA_LAYER, qk_layernorm=True), loss_coeff=0.0, dtype="bfloat16"),
    dict(layer="dsa", cp=2, seq=16, mbs=2, model=dict(DSA_LAYER, qk_layernorm=True), loss_coeff=0.01,
         dtype="bfloat16"),
]


# Index sharing (2 layers: the second reuses the first's top-k; "held": the top-k left in the holder), on 2
# processes at TP 1 and on 4 at TP 2 x CP 2 under sequence parallelism (with latent norms; without a q
# latent); TP 2 without sequence parallelism: megatron-core 0.19.0 asserts.
SHARED_CASES = [
    dict(layer="dsa", cp=2, seq=16, mbs=2, layers=2, model=SHARED, loss_coeff=0.0, dtype="bfloat16"),
    dict(layer="dsa", cp=2, seq=16, mbs=1, layers=2, model=SHARED, loss_coeff=0.01, dtype="bfloat16"),
    dict(layer="dsa", tp=2, sp=True, cp=2, seq=16, mbs=2, layers=2, model=SHARED, loss_coeff=0.01, dtype="bfloat16"),
    dict(layer="dsa", tp=2, sp=True, cp=2, seq=16, mbs=1, layers=2, model=dict(SHARED, qk_layernorm=True),
         loss_coeff=0.0, dtype="bfloat16"),
    dict(layer="dsa", tp=2, sp=True, cp=2, seq=16, mbs=2, layers=2, model=dict(SHARED, q_lora_rank=None),
         loss_coeff=0.01, dtype="bfloat16"),
    dict(layer="dsa", tp=2, sp=False, cp=2, seq=16, mbs=1, layers=1, model=DSA_LAYER, loss_coeff=0.0,
         dtype="bfloat16"),
]


# Full recompute: each layer in megatron-core's checkpoint (tensor_parallel.checkpoint, as TransformerBlock wraps a
# layer); one layer, and index sharing at TP 1 (frozen and training indexer) and TP 2 x CP 2 with sequence parallelism.
RECOMPUTE_CASES = [
    dict(layer="dsa", cp=2, seq=16, mbs=2, model=DSA_LAYER, loss_coeff=0.01, dtype="bfloat16", recompute=True),
    dict(layer="dsa", cp=2, seq=16, mbs=2, layers=2, model=SHARED, loss_coeff=0.0, dtype="bfloat16", recompute=True),
    dict(layer="dsa", cp=2, seq=16, mbs=1, layers=2, model=SHARED, loss_coeff=0.01, dtype="bfloat16", recompute=True),
    dict(layer="dsa", tp=2, sp=True, cp=2, seq=16, mbs=2, layers=2, model=SHARED, loss_coeff=0.01, dtype="bfloat16",
         recompute=True),
]


def _expected_recompute(case: dict) -> dict:
    """What one rank of a :data:`RECOMPUTE_CASES` case should measure, from the case without recompute: each
    checkpoint saves its input [T/TP, h]; the computing layer's top-k stays in the holder (no layer saved it:
    the no-grad forward builds no indexer loss), its backward re-runs save what the layers saved without
    recompute (the last layer's first, beside the others' inputs; the holder's top-k, which no layer saves,
    apart); the payloads: each forward's again, but for the indexer loss's ``tp/all_reduce``, which the
    no-grad forward skips."""
    plain, (tp, b, s) = dict(case, recompute=False), (case.get("tp", 1), case["mbs"], case["seq"] // case["cp"])
    x = s * b // tp * case["model"]["hidden_size"] * 2
    spec = _dsa_spec(case["model"], case["loss_coeff"] > 0)
    if case.get("layers", 1) == 1:
        saved, forward, step = _expected(plain)
        return dict(saved=[x], held=0, peak=saved, forward=[forward],
                    step={k: v + forward.get(k, 0) for k, v in step.items()})
    expected = _expected_layers(plain)
    (l1, f1), (l2, f2) = expected["layers"]
    forwards = [{k: v for k, v in f.items() if k != "tp/all_reduce"} for f in (f1, f2)]
    step = dict(expected["step"])
    for f in forwards:
        for k, v in f.items():
            step[k] += v
    return dict(saved=[x, x], held=dsa_cp_recompute_held(spec, "dsa", s=s, b=b, cp=case["cp"]),
                peak=max(x + l2, l1 - expected["held"]), forward=forwards, step=step)


def _expected_layers(case: dict) -> dict:
    """Per layer (saved bytes, forward payloads), the holder's bytes and the step's payloads one rank of a
    :data:`SHARED_CASES` case should measure: the formulas, and for ``tp/*`` what the report counts of an
    MLA layer (:func:`.mla_mtp.mla_mtp_tensor_parallel`, plus a dense attention's ``linear_qkv`` all-gather
    forward and backward, reduce-scatter of its input gradient, and ``linear_proj``'s reduce-scatter and
    all-gather) with :func:`.linear_cp.dsa_cp_traffic`'s terms."""
    from megatron_flops.memory.mla_mtp import mla_mtp_tensor_parallel

    model, tp, cp, b = case["model"], case.get("tp", 1), case["cp"], case["mbs"]
    s, a, t, norms = case["seq"] // cp, 2, case["seq"] // cp * case["mbs"], bool(model.get("qk_layernorm"))
    spec = _dsa_spec(model, case["loss_coeff"] > 0)
    q, kv, latent, h = model["q_lora_rank"] or 0, model["kv_lora_rank"], 40, model["hidden_size"]
    layers, step = [], {}
    for indexer in (True, False):
        saved = t // tp * h * a + dsa_cp_saved(spec, s=s, b=b, cp=cp, act=a, latent_norms=norms, norm_stats=4,
                                                tp=tp, indexer=indexer)
        if indexer and spec.dsa.trains_indexer:
            saved -= 2 * t * (4 - a)  # NB: torch's CPU LayerNorm keeps k_norm's mean and rstd in bf16
        if norms:  # NB: torch's CPU RMSNorm (see _expected)
            saved += 2 * t // tp * (q + kv) * 4 - t * (q + latent) * a
        forward, once = dsa_cp_traffic(spec, s=s, b=b, cp=cp, act=a, tp=tp, indexer=indexer)
        if tp > 1:  # the down projections' inputs [T, h] x 2, the q latent, kv down output and kv latent
            # gathered, q_up's input [T, q] (no q latent: linear_q_proj's [T, h] in place of one down input);
            # the indexer's gathers; the loss's all-reduce; linear_proj's reduce-scatter [T, h]
            forward["tp/all_gather"] += t * (2 * h + 2 * q + latent + kv) * a
            forward["tp/all_reduce"] = once["tp/all_reduce"] // 2
            forward["tp/reduce_scatter"] = t * h * a
        layers.append((saved, {k: v for k, v in forward.items() if v}))
        for key in {**forward, **once}:
            step[key] = step.get(key, 0) + dsa_cp_traffic(spec, s=s, b=b, cp=cp, act=a, tp=tp, indexer=indexer)[0].get(
                key, 0) + once.get(key, 0)
    if tp > 1:
        mla = mla_mtp_tensor_parallel(spec, Parallelism(tp=tp, cp=cp, sequence_parallel=True), Training(
            seq_length=s, micro_batch_size=b), num_layers=2, rerun=0, last=False, loss=False, recompute=None,
            learned_positions=False, duplicated=False)
        step["tp/all_gather"] += mla["tp/all_gather"] + 2 * 3 * t * h * a
        step["tp/reduce_scatter"] = mla["tp/reduce_scatter"] + 2 * 2 * t * h * a
    held = b * s * min(spec.dsa.topk, s * cp) * INDEX_BYTES if not spec.dsa.trains_indexer else 0
    return dict(layers=layers, held=held, step={k: v for k, v in step.items() if v})


def _expected(case: dict) -> tuple[int, dict, dict]:
    """(saved bytes, forward payloads, step payloads) one rank of ``case`` should measure."""
    cp, s, b = case["cp"], case["seq"] // case["cp"], case["mbs"]
    if case["layer"] == "gdn":
        spec, layers = ModelSpec.from_mapping(GDN), case.get("layers", 1)
        one_way = layers * gdn_cp_all_to_all(spec, tokens=s * b, tp=1, cp=cp, act=2)
        comm = {"cp/all_to_all": one_way} if cp > 1 else {}
        # Per layer in_proj's input [T, 64] bf16, then the formula; one head permutation for all.
        saved = layers * (s * b * 64 * 2 + gdn_cp_saved(spec, tokens=s * b, tp=1, cp=cp, act=2, param=2))
        return saved + gdn_cp_head_permutation(spec, Parallelism(cp=cp), pp_rank=0), comm, (
            {"cp/all_to_all": 2 * one_way} if cp > 1 else {})
    model, t = case["model"], s * b
    spec = _dsa_spec(model, case["loss_coeff"] > 0)
    act = 4 if case["dtype"] == "float32" else 2
    norms = bool(model.get("qk_layernorm"))
    saved = t * 64 * act + dsa_cp_saved(spec, s=s, b=b, cp=cp, act=act, latent_norms=norms, norm_stats=4)
    if spec.dsa is not None and spec.dsa.trains_indexer:
        saved -= 2 * t * (4 - act)  # NB: torch's CPU LayerNorm keeps k_norm's mean and rstd in bf16 (CUDA: fp32)
    if norms:
        # NB: torch's CPU RMSNorm keeps an fp32 copy of its input and x * rstd [T, width] beside rstd, where
        # the formula counts the input (the kv norm's: the kv down output it views) and fp32 rstd.
        q, kv = model["q_lora_rank"], model["kv_lora_rank"]
        latent = kv + model["qk_pos_emb_head_dim"]
        saved += 2 * t * (q + kv) * 4 - t * (q + latent) * act
    comm = dsa_cp_communication(spec, s=s, b=b, cp=cp, act=act)
    return saved, {k: v for k, v in comm.items() if k == "cp/all_gather"}, comm


@pytest.mark.dist
def test_measured_in_megatron_core_019_on_gloo():
    from frameworks import procs

    measured = procs.run_json("megatron-lm-0.19.0", "import linear_cp_019; linear_cp_019.main()",
                              CASES + SHARED_CASES + RECOMPUTE_CASES)
    for case, ranks in zip(SHARED_CASES, measured[len(CASES):]):
        if case.get("tp", 1) > 1 and not case["sp"]:
            assert all("AbsorbedMLA requires sequence_parallel" in rank["error"] for rank in ranks), ranks
            continue
        expected = _expected_layers(case)
        for rank in ranks:
            got = [(layer["saved"], layer["forward"]) for layer in rank["layers"]]
            # (the holder's top-k: counted with the layer that computes it)
            assert ([(got[0][0] + rank["held"], got[0][1]), got[1]], rank["held"], rank["step"]) == (
                expected["layers"], expected["held"], expected["step"]), case
    for case, ranks in zip(RECOMPUTE_CASES, measured[len(CASES) + len(SHARED_CASES):]):
        expected = _expected_recompute(case)
        for rank in ranks:
            assert dict(saved=[layer["saved"] for layer in rank["layers"]], held=rank["held"], peak=rank["peak"],
                        forward=[layer["forward"] for layer in rank["layers"]], step=rank["step"]) == expected, case
    for case, ranks in zip(CASES, measured):
        saved, forward, step = _expected(case)
        for rank in ranks:
            assert (rank["saved"], rank["forward"], rank["step"]) == (saved, forward, step), case
    # Two GDN layers keep one head permutation (1,088 B) between them: 2 x (2,048 + 24,328) + 1,088.
    assert measured[2][0]["saved"] == 2 * (16 * 64 * 2 + 24_328) + 1_088
    # Parameters: 0.19.0's layers hold the tensors 0.16.1's list (names and sizes; their order differs).
    gdn_params = sorted(("self_attention." + name, n) for name, n in measured[0][0]["params"])
    assert gdn_params == sorted((name, n) for name, n, _ in mixer_tensors(ModelSpec.from_mapping(GDN), "gdn", "", 1,
                                                                          False))
    spec = _dsa_spec(DSA_LAYER, True)
    options = DecoderOptions.from_mapping(dict(DSA_LAYER, vocab_size=256, **OPTIONS))
    ours = [(p.name.removeprefix("decoder.layers.0.self_attention."), p.numel) for p in chunk_parameters(
        spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=16) if ".self_attention." in p.name]
    assert sorted(ours) == sorted((name, n) for name, n in measured[3][0]["params"])
