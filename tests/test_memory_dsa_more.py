"""DeepSeek sparse attention beyond one plain layer: whole megatron-core 0.16.1 GPT micro-batches
with DSAttention cores (tests/test_memory_activations.py's single-process fixture), plain, under
full recompute (uniform, block), under the selective modules megatron-core runs with it, and with
an MTP layer; against :func:`megatron_flops.memory.activations.chunk_activations`. Formulas
that cannot run here, as integers: DSA layers reusing an earlier top-k (megatron-core 0.19), KDA
with fla's and causal-conv1d's kernels; GDN MTP layers' parameters."""

from __future__ import annotations

import pytest
import torch

import mcore_cpu
import mcore_memory
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.activations import check_activations_supported, chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.model.spec import ModelSpec
from test_memory_activations import MBS, NUM_MB, SEQ, VOCAB, _measure
from test_memory_ssm import dsa_core_attention_spec

# bf16 (the indexer's Hadamard rotation takes bf16 only), LayerNorm, 2 DSA layers.
DSA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, multi_latent_attention=True,
           q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
           normalization="LayerNorm", add_bias_linear=False, rope_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
           experimental_attention_variant="dsa",
           dsa_indexer_n_heads=2, dsa_indexer_head_dim=16, dsa_indexer_topk=8, dsa_indexer_loss_coeff=0.01)
FULL = dict(recompute_granularity="full")

# name -> (fields, LayerNorms whose statistics are held at the peak: the CPU correction below).
CASES = {
    "plain": ({}, 7),  # 2 per layer, the indexers' k_norm, the final norm: all held after the forward
    # Backward of the last layer's checkpoint (the final norm's backward has run): its 3 norms.
    "full recompute, uniform 1": (dict(FULL, recompute_method="uniform", recompute_num_layers=1), 3),
    "full recompute, uniform 2": (dict(FULL, recompute_method="uniform", recompute_num_layers=2), 6),
    # After the forward: the plain second layer's 3 and the final norm.
    "full recompute, block 1": (dict(FULL, recompute_method="block", recompute_num_layers=1), 4),
    # The layer norms re-run in backward: the k_norms and the final norm at the end of the forward.
    "selective layernorm": (dict(recompute_granularity="selective", recompute_modules=["layernorm"]), 3),
    # The up projections' checkpoint frees MLA's q, k, v (the sparse attention's v is a view of MLA's).
    "selective mla_up_proj": (dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]), 7),
    "selective layernorm + mla_up_proj": (dict(recompute_granularity="selective",
                                               recompute_modules=["layernorm", "mla_up_proj"]), 3),
    # An MTP layer of the last layer's kind (Megatron-LM 0.19's builder): enorm, hnorm, its layer's
    # 3, its final norm beside the 7 above. NB: 0.16.1's DSAttention logs its indexer loss by layer
    # number, out of range in an MTP layer (IndexError) unless the coefficient is 0: the same graph.
    "1 MTP layer": (dict(mtp_num_layers=1, dsa_indexer_loss_coeff=0.0), 13),
    # Full recompute checkpoints the MTP layer after its embedding: the peak in its backward, with
    # its 6 norms re-run and the decoder's final norm.
    "1 MTP layer, full recompute, uniform 1": (dict(FULL, recompute_method="uniform", recompute_num_layers=1,
                                                    mtp_num_layers=1, dsa_indexer_loss_coeff=0.0), 7),
}


@pytest.fixture
def dsa_spec(monkeypatch):
    """mcore_cpu.build_gpt's local spec with DSAttention as every layer's (and the MTP layer's) core,
    and a fresh indexer-loss tracker (megatron-core sizes its class-wide tracker by the first model's
    layer count)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    monkeypatch.setattr(dsa.DSAIndexerLossLoggingHelper, "tracker", {})
    build = mcore_cpu.build_layer_spec

    def with_dsa(config, **kw):
        spec = build(config, **kw)
        spec.submodules.self_attention.submodules.core_attention = dsa_core_attention_spec()
        return spec

    monkeypatch.setattr(mcore_cpu, "build_layer_spec", with_dsa)


def _ours_inputs(fields: dict):
    model = dict(fields, vocab_size=VOCAB)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", transformer_impl="local"))
    return ModelSpec.from_mapping(model), options, Parallelism(), RecomputeSpec.from_mapping(model)


def _ours(fields: dict):
    spec, options, par, recompute = _ours_inputs(fields)
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype="bf16")
    return chunk_activations(spec, options, par, training, pp_rank=0, chunk=0, recompute=recompute)


@pytest.mark.parametrize("name", list(CASES))
def test_dsa_gpt_saved_bytes_match_megatron_core(mcore, dsa_spec, name):
    fields, norms = CASES[name]
    fields = dict(DSA, **fields)
    _, measured_peak = _measure(fields, "rope", "bf16", meter_cls=mcore_memory.LiveStorageMeter)
    act = _ours(fields)
    # NB: torch's CPU LayerNorm keeps mean and rstd in bf16 (CUDA: fp32): 2 x T x 2 bytes less per norm.
    # (The peak, not each forward's saved bytes: top-k saves its indices, and they go before the
    # forward ends; the forward count sees them.)
    assert measured_peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0] - norms * SEQ * MBS * 2 * 2


def test_selective_core_attn_recompute_of_dsa_fails_in_megatron_core(mcore, dsa_spec):
    # MLA's _checkpointed_attention_forward calls the core attention without x and qr.
    with pytest.raises(TypeError, match="missing 2 required positional arguments: 'x' and 'qr'"):
        _measure(dict(DSA, recompute_granularity="selective"), "rope", "bf16")
    assert "calls DSAttention without its x and qr" in check_activations_supported(
        *_ours_inputs(dict(DSA, recompute_granularity="selective")))


def test_dsa_mtp_parameters_in_megatron_order(mcore, dsa_spec):
    from megatron_flops.memory.decoder import chunk_parameters

    fields = dict(DSA, mtp_num_layers=1)
    model = mcore_cpu.build_gpt(fields, vocab_size=VOCAB, max_seq_len=SEQ, share_embeddings=False)
    spec, options, par, _ = _ours_inputs(dict(fields, share_embeddings_and_output_weights=False))
    params = chunk_parameters(spec, options, par, pp_rank=0, chunk=0, seq_length=SEQ)
    assert [(p.name, p.numel) for p in params] == [(n, p.numel()) for n, p in model.named_parameters()]
    assert sum("mtp.layers.0.transformer_layer.self_attention.core_attention.indexer." in p.name for p in params) == 5


def test_gdn_mtp_layer_is_the_last_layers_gdn_mixer():
    from megatron_flops.memory.decoder import chunk_parameters

    # A list: 1 marks softmax attention; layer 4 (the last) is GDN, and so the MTP layer.
    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=VOCAB,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  experimental_attention_variant="gated_delta_net", linear_attention_freq=[0, 1, 0, 1],
                  mtp_num_layers=1, normalization="RMSNorm", add_bias_linear=False)
    spec, options, par, _ = _ours_inputs(fields)
    params = chunk_parameters(spec, options, par, pp_rank=0, chunk=0, seq_length=SEQ)
    layer = [(p.name.removeprefix("decoder.layers.3."), p.numel) for p in params if p.name.startswith("decoder.layers.3.")]
    mtp = [(p.name.removeprefix("mtp.layers.0.transformer_layer."), p.numel) for p in params
           if p.name.startswith("mtp.layers.0.transformer_layer.")]
    assert mtp == layer and ("self_attention.conv1d.weight", (2 * 16 + 32) * 4) in mtp


def test_reused_top_k_formula():
    from megatron_flops.memory.ssm import dsa_saved, ssm_notes

    one = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=VOCAB,
               multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
               v_head_dim=16, experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=16,
               dsa_indexer_topk=8)
    plain, shared = ModelSpec.from_mapping(one), ModelSpec.from_mapping(dict(one, dsa_indexer_topk_freq=2))
    assert [kind for kind, _ in shared.layer_runs] == [("dsa", "mlp"), ("dsa_shared", "mlp")]
    # tests/test_memory_ssm.py: at s 16, b 2, 4 heads, bf16 the sparse attention keeps 40,960 bytes,
    # the indexer 12,672 and the KL loss 6,144. A reusing layer: the sparse attention only; the
    # computing layer also holds its int64 top-k [2, 16, 8] = 2,048 for the micro-batch.
    assert dsa_saved(shared, s=16, b=2, heads=4, act=2, indexer=False) == 40_960
    assert dsa_saved(shared, s=16, b=2, heads=4, act=2) == dsa_saved(plain, s=16, b=2, heads=4, act=2) + 2_048 \
        == 40_960 + 12_672 + 6_144 + 2_048
    assert any("reuse an earlier top-k" in u for u in ssm_notes(shared, Parallelism(), activations=True)[1])


def test_kda_with_fla_and_causal_conv1d_is_an_unmeasured_formula(tmp_path, capsys):
    import json

    import test_linear_attention
    from megatron_flops.cli import main
    from megatron_flops.memory.kda_fla import kda_fla_saved

    spec = ModelSpec.from_hf_config(dict(test_linear_attention.KIMI, model_type="kimi_linear"))
    # 2 heads of 8 (dim 16), s 128, b 2 (T 256), bf16. Conv input [2, 48, 128]: 24,576. Gates: f_a and
    # g_a outputs 2 x [T, 8] 8,192, beta [T, 2] 1,024, exp(A_log) and its negation 16, fp32 exp, 1 + exp,
    # softplus [T, 16] and the bool mask 53,248: 62,480. chunk_kda: normalised q, k and contiguous v
    # 3 x [T, 16] 24,576, rstd 2 x [T, 2] fp32 4,096, g and its chunk cumsum 2 x [T, 16] fp32 32,768,
    # Aqk and Akk 2 x [T, 2, 64] 131,072: 192,512. Norm and o_proj as the torch path: 75,808.
    assert kda_fla_saved(spec, s=128, b=2, act=2) == 24_576 + 62_480 + 192_512 + 75_808 == 355_376
    path = tmp_path / "kimi.json"
    path.write_text(json.dumps(dict(test_linear_attention.KIMI, model_type="kimi_linear")))
    assert main(["memory", "--model", str(path), "--seq-length", "128", "--micro-batch-size", "2",
                 "--params-dtype", "bf16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any("fla's chunk_kda" in u and "355,376 bytes per KDA layer" in u for u in report["unmeasured"])


def dsa_comm_worker(rank: int, world_size: int, runs: dict) -> dict:
    """A 2-rank gloo worker: TP collectives (bytes per group/kind) of one forward and backward of
    tests/test_memory_ssm.py's MLA attention, with its DSA core or megatron-core's local
    DotProductAttention in its place, for each run (sequence parallel, DSA)."""
    import mcore_dist
    import test_memory_ssm
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    mcore_dist.init_worker(tp=world_size)
    mcore_memory.patch_sequence_parallel_norm()
    out = {}
    for name, (sp, dsa) in runs.items():
        attention = test_memory_ssm._dsa_attention(test_memory_ssm.DSA, sp)
        if not dsa:
            attention.core_attention = DotProductAttention(
                attention.config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                softmax_scale=attention.softmax_scale, k_channels=attention.q_head_dim,
                v_channels=attention.config.v_head_dim)
            attention.config.experimental_attention_variant = None
        torch.manual_seed(0)
        x = torch.randn(SEQ // (world_size if sp else 1), MBS, 64, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).expand(MBS, 1, SEQ, SEQ)
        comm = mcore_memory.CommMeter(mcore_memory.megatron_groups())
        with comm, mcore_cpu.cuda_to_cpu_mode():
            o, _ = attention(x, attention_mask=mask)
            o.float().sum().backward()
        out[name] = dict(comm.bytes)
    return out


@pytest.mark.dist
def test_dsa_tensor_parallel_traffic_beyond_mla(mcore):
    import mcore_dist
    import test_memory_ssm
    from megatron_flops.memory.dsa_tp import dsa_tensor_parallel

    runs = {"DSA": (False, True), "MLA": (False, False), "DSA, SP": (True, True), "MLA, SP": (True, False)}
    measured = mcore_dist.run_distributed(dsa_comm_worker, 2, runs, timeout=600)
    spec = ModelSpec.from_mapping(test_memory_ssm.DSA)
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=1, params_dtype="bf16")
    for sp in (False, True):
        dsa, mla = (measured[0]["DSA, SP" if sp else "DSA"], measured[0]["MLA, SP" if sp else "MLA"])
        extra = {k: dsa.get(k, 0) - mla.get(k, 0) for k in dsa.keys() | mla.keys() if dsa.get(k, 0) != mla.get(k, 0)}
        ours = dsa_tensor_parallel(spec, Parallelism(tp=2, sequence_parallel=sp), training, layers=[0], last=False,
                                   recompute=None)
        # The KL target fp32 [2, 16, 16] all-reduced: 2,048; under SP the indexer's gathered norm output
        # [32, 64] and q latent [32, 24] in bf16: 5,632.
        assert extra == ours == ({"tp/all_reduce": 2_048, "tp/all_gather": 5_632} if sp else {"tp/all_reduce": 2_048})
    assert all(r == measured[0] for r in measured)


def test_dsa_tensor_parallel_traffic_under_full_recompute():
    import test_memory_ssm
    from megatron_flops.memory.dsa_tp import dsa_tensor_parallel

    # 2 DSA layers and an MTP layer on the last stage (per layer: 2,048 all-reduced, 5,632 gathered
    # under SP, see above). The KL target is built only with grad enabled: once per micro-batch
    # whatever the recompute; the indexer's inputs are gathered again by each re-run layer.
    spec = ModelSpec.from_mapping(dict(test_memory_ssm.DSA, num_layers=2, mtp_num_layers=1))
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=1, params_dtype="bf16")
    par = Parallelism(tp=2, sequence_parallel=True)
    for method, gathers in (("uniform", 6), ("block", 4)):  # (uniform re-runs the MTP layer; block does not)
        recompute = RecomputeSpec(granularity="full", method=method, num_layers=1)
        assert dsa_tensor_parallel(spec, par, training, layers=[0, 1], last=True, recompute=recompute) == {
            "tp/all_reduce": 3 * 2_048, "tp/all_gather": gathers * 5_632}
    shared = ModelSpec.from_mapping(dict(test_memory_ssm.DSA, num_layers=2, dsa_indexer_topk_freq=2))
    assert dsa_tensor_parallel(shared, par, training, layers=[0, 1], last=True, recompute=None) == {
        "tp/all_reduce": 2_048, "tp/all_gather": 5_632}
