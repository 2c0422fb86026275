"""A frozen base + LoRA whose first pipeline stage holds no decoder layer (``E|ttL``): megatron-core
0.16.1 skips that stage's backward (its output, the frozen embedding's, needs no gradient), but the
next stage receives the decoder input with ``requires_grad=True`` (``recv_forward``), so layer 0
runs its input-gradient GEMMs as every later layer does (memory side measured by gloo in
tests/test_memory_pipeline_split_dist.py). Executed FLOPs add exactly those dgrads (unneeded);
model FLOPs do not move. Measured: the same decoder input requiring grad on a real megatron-core
GPTModel under FlopCounterMode.
"""

from __future__ import annotations

import json

import pytest

from megatron_flops.flops.formulas import SeqStats, parse_rows
from megatron_flops.flops.passes import PeftSpec, training_passes
from megatron_flops.flops.pipeline_split import first_stage_without_decoder
from megatron_flops.model.spec import ModelSpec
from test_peft_recompute import ALL, BASE, ROWS, TINY, TINY_STATS, VOCAB, _build, _cli, _measure, _passes


def _delta(targets: tuple[str, ...]) -> tuple[dict[str, int], int]:
    peft = PeftSpec(frozen=True, lora_rank=2, lora_targets=targets)
    plain = training_passes(TINY, TINY_STATS, peft=peft, attention="full")
    empty = training_passes(TINY, TINY_STATS, peft=peft, attention="full", decoder_input_grad=True)
    assert empty.model().components == plain.model().components
    return {k: empty.unneeded[k] - plain.unneeded[k] for k in plain.unneeded}, empty.executed().total - plain.executed().total


def test_one_term_delta_is_layer_0_dgrad():
    # TINY, rows [4, 6] (10 tokens), hidden 8, ffn 16, full attention. LoRA on linear_qkv + linear_fc2:
    # only layer 0's linear_qkv dgrad ([10, 8] @ [8, 24]: 2*10*8*24 = 3840) is new; the adapter's
    # A dgrad (320) already runs (megatron linear), and from the adapter on everything needed one.
    delta, executed = _delta(("linear_qkv", "linear_fc2"))
    assert delta == dict.fromkeys(delta, 0) | {"attn/qkv": 3840}
    assert executed == 3840


def test_adapter_late_in_layer_0_adds_every_earlier_dgrad():
    # LoRA on linear_fc2 only: layer 0's qkv 3840, core both operands 2 x 1664 = 3328, out
    # 2*10*8*8 = 1280, fc1 2*10*8*16 = 2560 and fc2 2*10*16*8 = 2560 dgrads; adapter A's ran already.
    delta, executed = _delta(("linear_fc2",))
    assert delta == dict.fromkeys(delta, 0) | {"attn/qkv": 3840, "attn/core": 3328, "attn/out": 1280, "mlp": 5120}
    assert executed == 3840 + 3328 + 1280 + 5120


@pytest.mark.parametrize("fields, num_layers, expected", [
    ({"pipeline_model_parallel_layout": "E|ttL"}, 2, True),
    ({"pipeline_model_parallel_layout": "|Ett|ttL"}, 4, True),  # the embedding is built on stage 0 (pre_process)
    ({"pipeline_model_parallel_layout": "E|tt|tt|L"}, 4, True),
    ({"pipeline_model_parallel_layout": "Et|tL"}, 2, False),
    ({"pipeline_model_parallel_layout": "EttL"}, 2, False),
    ({}, 2, False),
    # (1 + 1) layers over PP 2, the embedding counted: stage 0 gets 1 - 1 = 0 decoder layers.
    ({"account_for_embedding_in_pipeline_split": True, "pipeline_model_parallel_size": 2}, 1, True),
    ({"account_for_embedding_in_pipeline_split": True, "pipeline_model_parallel_size": 2}, 3, False),
    ({"account_for_embedding_in_pipeline_split": True}, 1, False),  # no PP in the file: one stage
    ({"num_layers_in_first_pipeline_stage": 1, "pipeline_model_parallel_size": 2}, 2, False),
])
def test_first_stage_without_decoder(fields, num_layers, expected):
    assert first_stage_without_decoder(fields, num_layers=num_layers) is expected


@pytest.mark.parametrize("targets", [ALL, ("linear_fc1",), ("linear_proj",)])
def test_decoder_input_requiring_grad_measured_equals_executed(mcore, targets):
    # Stage 1's recv_forward input requires grad: the same decoder input Megatron-Bridge's patch makes.
    model = _build(BASE, targets=targets, bridge_patch=True)
    spec = ModelSpec.from_transformer_config(model.config, vocab_size=VOCAB)
    passes = training_passes(spec, SeqStats.from_rows(parse_rows(ROWS)), attention="full", decoder_input_grad=True,
                             peft=PeftSpec(frozen=True, lora_rank=4, lora_targets=targets))
    assert _measure(model) == passes.executed().total > _passes(model, targets).executed().total


def test_cli_reads_the_layout(tmp_path):
    flags = ("--seqlens", json.dumps(ROWS), "--attention", "full", "--json", "--frozen", "--lora-rank", "4",
             "--lora-targets", "linear_qkv")
    reports = []
    for extra in ({}, {"pipeline_model_parallel_layout": "E|ttL"}):
        (tmp_path / "m.json").write_text(json.dumps(dict(BASE, vocab_size=VOCAB, **extra)))
        out = _cli("--model", str(tmp_path / "m.json"), *flags)
        assert out.returncode == 0, out.stderr
        reports.append(json.loads(out.stdout))
    plain, empty = reports
    assert empty["total_flops"] == plain["total_flops"]
    # Layer 0's linear_qkv dgrad: [25, 64] @ [64, 192] over rows 16 + 9, 2*25*64*192 = 614400.
    assert empty["executed_flops"] - plain["executed_flops"] == 614400 == empty["unneeded_flops"] - plain["unneeded_flops"]
