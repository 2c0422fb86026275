"""Context parallelism of Mamba layers (megatron-core's ``MambaContextParallel``): the scan's saved
bytes and the ``cp/all_to_all`` payload, formulas labelled unmeasured (the scan is a CUDA/Triton
kernel: no Mamba layer runs on CPU), consistent with the report without CP."""

from __future__ import annotations

import json

import pytest

from megatron_flops.cli import main
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory
from megatron_flops.memory.ssm import mamba_cp_all_to_all, mamba_saved
from megatron_flops.model.spec import ModelSpec

# hidden 64: inner 128, 8 heads of 16, 2 groups of state 16.
SMALL = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, normalization="RMSNorm",
             add_bias_linear=False, vocab_size=256, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
OPTIONS = DecoderOptions(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
                         padded_vocab_size=256, attention_backend="unfused")


def _spec(pattern: str = "M*-M") -> ModelSpec:
    return ModelSpec.from_mapping(dict(SMALL, hybrid_override_pattern=pattern))


def test_mamba_cp_formulas():
    spec = _spec()
    # CP 1 is the formula without CP (tests/test_memory_ssm.py derives 45,920 for T = 32, bf16).
    assert mamba_saved(spec, tokens=32, tp=1, act=2, cp=1) == mamba_saved(spec, tokens=32, tp=1, act=2) == 45_920
    assert mamba_cp_all_to_all(spec, tokens=32, tp=1, cp=1, act=2) == 0
    # CP 2, T = 16 tokens on this rank, bf16. The scan: 32 tokens (the whole sequence), 4 heads,
    # inner 64, 1 group: zxBCdt [32, 2*64 + 2*16 + 4 = 164] 10,496; out_x [32, 64] 4,096; A and
    # exp(A_log) 2 x 4 x 4 = 32 and the dt_bias copy 16; the conv weight and bias sliced for this
    # rank [64 + 2*16 = 96] x (4 + 1) x 2 = 960. After the all-to-all back: the norm's input [16, 128]
    # 4,096 and rstd 16 x 2 x 4 = 128, out_proj's input 4,096. Total 23,920.
    assert mamba_saved(spec, tokens=16, tp=1, act=2, cp=2) == 23_920
    # All-to-all in (z, x [16, 128] each, B, C [16, 32] each, dt [16, 8]) and out ([32, 64]):
    # 16 x (3 x 128 + 2 x 32 + 8) x 2 = 14,592 bytes per layer and direction.
    assert mamba_cp_all_to_all(spec, tokens=16, tp=1, cp=2, act=2) == 14_592
    # CP 4 > 2 groups: each group's B and C repeated to 2 ranks: 16 x (384 + 2 x 2 x 2 x 16 + 8) x 2.
    assert mamba_cp_all_to_all(spec, tokens=16, tp=1, cp=4, act=2) == 16_640
    # TP 2 x CP 2: per TP rank inner 64, 1 group, 4 heads; per CP rank a scan of 2 heads, inner 32 and
    # the one group (repeated) on 32 tokens: 32 x (64 + 32 + 2) x 2 + 32 x 32 x 2 + 2 x 2 x 4 + 2 x 4
    # = 8,344; conv slices (32 + 32) x 5 x 2 = 640; norm and out_proj 16 x 64 x 2 x 2 + 16 x 4 = 4,160.
    assert mamba_saved(spec, tokens=16, tp=2, act=2, cp=2) == 13_144


def test_cp1_equals_the_report_without_cp(tmp_path, capsys):
    spec = _spec()
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2)
    assert decoder_memory(spec, OPTIONS, Parallelism(cp=1, dp=2), training) == \
        decoder_memory(spec, OPTIONS, Parallelism(dp=2), training)
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(dict(SMALL, hybrid_override_pattern="M*-M")))
    reports = []
    for flags in ([], ["--cp", "1"]):
        assert main(["memory", "--model", str(model), "--seq-length", "16", "--dp", "2", "--json", *flags]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1] and not any(k.startswith("cp/") for k in reports[0]["communication_per_step"])


def test_cp2_prices_mamba_all_to_all_and_the_attention_ring():
    spec = _spec()
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2)
    report = decoder_memory(spec, OPTIONS, Parallelism(cp=2), training)
    comm = report.per_gpu.communication
    # 2 micro-batches x 2 Mamba layers x (forward + backward) x 14,592 (8 of 16 tokens x 2 sequences).
    assert comm["cp/all_to_all"] == 2 * 2 * 2 * 14_592
    # The ring passes K and V of the one attention layer only (not of the MLP-only or Mamba layers):
    # 2 micro-batches x 1 layer x (CP - 1) x 2 x 3 x K, V [16 tokens, 4 heads x 16] bf16.
    kv = 2 * 16 * 4 * 16 * 2
    assert comm["cp/send_recv"] == 2 * 1 * 1 * 2 * 3 * kv
    act = report.per_gpu.activations_per_microbatch[0]["mamba"]
    # Two Mamba layers: in_proj's input [16, 64] bf16 and the formula above.
    assert act == 2 * (16 * 64 * 2 + mamba_saved(spec, tokens=16, tp=1, act=2, cp=2))
    assert any("context parallelism of Mamba layers (CP 2)" in u for u in report.unmeasured)
    assert not report.not_modelled


@pytest.mark.parametrize("flags, message", [
    (["--cp", "16"], "mamba_num_heads / TP = 8 is not divisible by --cp 16"),
    (["--tp", "2", "--cp", "2", "--sequence-parallel"], None),
])
def test_megatron_core_cp_limits(tmp_path, capsys, flags, message):
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(dict(SMALL, hybrid_override_pattern="M*-M")))
    rc = main(["memory", "--model", str(model), "--seq-length", "64", *flags])
    if message is None:
        assert rc == 0 and "cp/all_to_all" in capsys.readouterr().out
    else:
        assert rc == 2 and message in capsys.readouterr().err
