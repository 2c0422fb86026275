"""A DiT pipeline stage without blocks (a layout's ``E|...`` or ``...|L`` stage; memory/dit_layouts.py).

megatron-core builds it: ``PipelineParallelLayerLayout`` allows a stage of no decoder layers and
``TransformerBlock`` an empty one (``num_layers_in_first/last_pipeline_stage`` 0 it refuses:
"must be larger than 0"). Megatron-Bridge 0.6.2's ``WanModel.forward`` computes the text and time
embeddings on every stage and passes only the hidden states between stages; on an empty stage only
the head reads the time embedding, so the rest of their graph is freed when the forward returns.
A frozen base whose first stage holds no block: megatron-core skips that stage's backward (its output
needs no gradient) and the next stage's block 0 saves as a block whose input needs a gradient.
Formulas (WAN builds Transformer Engine layers only: no CPU step), exact integers here."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_flops.cli import main
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec
from megatron_flops.memory.dit_activations import DiTBatch, dit_activations

TINY = json.loads((Path(__file__).resolve().parents[1] / "examples" / "wan_tiny_dit.json").read_text())["dit"]


def _report(tmp_path: Path, capsys, layout: str, *extra: str) -> tuple[int, dict]:
    model = tmp_path / "dit.json"
    model.write_text(json.dumps({"dit": TINY, **({"lora": {"dim": 4, "target_modules": ["q"]}} if extra else {})}))
    rc = main(["memory", "--model", str(model), "--pp", "2", "--num-microbatches", "4", "--seq-length", "64",
               "--pipeline-model-parallel-layout", layout, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else {"error": out.err})


def test_activations_of_a_stage_without_blocks():
    spec, batch = DiTSpec.from_mapping(TINY), DiTBatch(video=(64,), text=(12,))
    # First stage: the Conv3d's input [64 tokens, 4 channels x 1 x 2 x 2] bf16 2,048; the text and time
    # embeddings feed nothing there: none of their saves survive the forward.
    first = dit_activations(spec, batch, act_bytes=2, first=True, last=False, num_blocks=0)
    assert first.outside == dict(patch_embed=2_048, time_embed=0, text_embed=0, image_embed=0, head=0, loss=0)
    # Last stage: the time embedding the head's modulation reads: [1, 16] + 2 x [1, 32] bf16 = 160; the head:
    # the received hidden states and (1 + scale) 2 x 64 x 32 x 2 = 8,192, LayerNorm stats 2 x 64 x 4 = 512,
    # the normalised x and the head's input 8,192, e's repeat index 64 x 8 = 512: 17,408; the loss:
    # prediction and target fp32 2 x 64 x 16 x 4 = 8,192. Total 25,760.
    last = dit_activations(spec, batch, act_bytes=2, first=False, last=True, num_blocks=0)
    assert last.outside == dict(patch_embed=0, time_embed=160, text_embed=0, image_embed=0, head=17_408, loss=8_192)
    assert last.total == 25_760


def test_reports_for_layouts_with_an_empty_stage(tmp_path, capsys):
    for layout, stage in (("E|ttL", 0), ("Ett|L", 1)):
        rc, report = _report(tmp_path, capsys, layout)
        assert rc == 0 and report["not_modelled"] == []
        empty = report["per_stage"][stage]
        # Every stage holds the text embedding (24 x 32 + 32 + 32 x 32 + 32 = 1,856), the time embedding
        # (16 x 32 + 32 + 32 x 32 + 32 = 1,600) and its projection (32 x 192 + 192 = 6,336); the first stage
        # the patch embedding (4 x 4 x 32 + 32 = 544), the last the head (32 x 16 + 16 + 2 x 32 = 592); bf16.
        assert empty["weights_bytes"] == 2 * (1_856 + 1_600 + 6_336 + (544 if stage == 0 else 592))
        # 1F1B: the first stage holds 2 micro-batches (2 x 2,048), the last one (25,760, above).
        assert (empty["activations_bytes"], empty["forward_passes_in_flight"]) == ((4_096, 2) if stage == 0
                                                                                   else (25_760, 1))
        # Only the hidden states pass between stages: 4 micro-batches x [64, 32] bf16 x (forward + backward).
        assert report["communication_per_step"]["pp/send_recv"] == 4 * 64 * 32 * 2 * 2
        assert any("a pipeline stage without blocks" in u for u in report["unmeasured"])


def test_a_frozen_base_with_an_empty_first_stage(tmp_path, capsys):
    # 'E|ttL' with LoRA on q (a frozen base): stage 0 holds the frozen patch, text and time embeddings
    # alone. Its output needs no gradient, so megatron-core 0.16.1's backward_step skips its backward
    # (measured on a GPT's frozen embedding-only stage: tests/test_memory_pipeline_split_dist.py): it saves
    # nothing, and has no gradient buffer or optimizer state; its weights as unfrozen, 2 x 10,336 = 20,672.
    rc, report = _report(tmp_path, capsys, "E|ttL", "lora")
    assert rc == 0 and report["not_modelled"] == []
    first, last = report["per_stage"]
    assert (first["weights_bytes"], first["gradients_bytes"], first["optimizer_bytes"]) == (20_672, 0, 0)
    assert (first["activations_bytes"], first["forward_passes_in_flight"]) == (0, 2)
    # Stage 1 receives its input with requires_grad=True (recv_forward), so block 0 saves as block 1 does:
    # the saves of a block whose input needs a gradient, 117,504 (adaLN 32,768, norms 13,824, self-attention
    # 38,912, cross-attention 23,808, FFN 8,192: tests/test_memory_dit_activations.py), not a frozen first
    # block's 100,352 (17,152 fewer: adaLN 4,096, norms 4,608, self-attention 8,448); then the head (the last
    # block's output and (1 + scale) 2 x 64 x 32 x 2, LayerNorm statistics 2 x 64 x 4: 8,704) and the loss
    # (8,192). 2 x 117,504 + 8,704 + 8,192 = 251,904, 17,152 more than the same blocks on one GPU.
    spec = DiTSpec.from_mapping(TINY)
    peft = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("q",))
    one_gpu = dit_activations(spec, DiTBatch(video=(64,), text=(12,)), act_bytes=2, peft=peft).total
    assert (last["activations_bytes"], one_gpu) == (251_904, 251_904 - 17_152)
    # The gradient still goes back: pp/send_recv as with a trained base, 4 x [64, 32] bf16 x 2 directions.
    assert report["communication_per_step"]["pp/send_recv"] == 4 * 64 * 32 * 2 * 2
    assert any("megatron-core 0.16.1's backward_step skips its backward" in u for u in report["unmeasured"])
    # A first stage with blocks: no such label (block 0 there has the frozen patch embedding's input).
    rc, report = _report(tmp_path, capsys, "Ett|L", "lora")
    assert rc == 0 and not any("backward_step skips" in u for u in report["unmeasured"])
