"""LoRA adapters and a frozen base under tensor + sequence parallelism of a WAN-like DiT
(:mod:`megatron_flops.memory.dit_tp`, ``dit_activations(sequence_parallel=True)``): formulas,
unmeasured (Megatron-Bridge's WanModel builds Transformer Engine layers only), with the adapters'
payloads measured for a GPT (tests/test_memory_lora_tp_dist.py). Exact integers with their
derivations; adapters on vs off one term at a time; the label."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec
from megatron_flops.memory.dit_activations import DiTBatch, dit_activations, dit_block_input_grads
from megatron_flops.memory.dit_layouts import dit_layout_report
from megatron_flops.memory.layout import Parallelism, Training

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPEC = DiTSpec.from_mapping(json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())["dit"])  # h 32, 2 blocks
SP = Parallelism(tp=2, sequence_parallel=True)
TRAINING = Training(seq_length=16, micro_batch_size=1, num_microbatches=4)  # 16 video, 12 text tokens
BATCH = DiTBatch.uniform(SPEC, video_tokens=16, num_clips=1)
TARGETS = ("q", "k", "v", "o")  # self and cross q, k, v, o
TRAINED_LORA = DiTPeftSpec(frozen=False, lora_rank=4, lora_targets=TARGETS)
FROZEN_LORA = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=TARGETS)


def test_adapters_on_a_trained_base_add_their_saves():
    # TP 2 + SP, bf16. Per block, each column-parallel adapter gathers its input along the tokens
    # itself and keeps it, with linear_out's [N, 4] input: self q, k, v over the 16 video tokens
    # ([16, 32] + [16, 4]: 1,152 B each), the cross q (1,152 B), the cross k, v over the text gathered
    # from both ranks ([24, 32] + [24, 4]: 1,728 B each). A row-parallel adapter (o, cross o) reads
    # the base's saved input; its [T, 4] intermediate spans all 16 video tokens (128 B each).
    off, on = (dit_activations(SPEC, BATCH, act_bytes=2, tp=2, sequence_parallel=True, peft=p)
               for p in (None, TRAINED_LORA))
    delta = {k: on.block[k] - off.block[k] for k in on.block}
    assert delta == {"adaln": 0, "norm": 0, "self_attn": 3 * 1_152 + 128, "cross_attn": 1_152 + 2 * 1_728 + 128,
                     "ffn": 0}
    assert on.outside == off.outside
    assert on.total - off.total == 2 * (3_584 + 4_736)
    assert dit_layout_report(SPEC, SP, TRAINING, peft=TRAINED_LORA)["per_gpu"]["activations_bytes"] == on.total


def test_adapters_on_a_trained_base_add_their_collectives():
    # Per block and micro-batch (elements), rank 4, h 32. Column-parallel adapters over N rows (self
    # q, k, v, cross q: 16 each; cross k, v: the gathered text, 24 each; 112 in all): forward the
    # input [N, 32] and linear_in's output [N, 4] all-gathered (112 x 36 = 4,032); backward
    # linear_out's input gradient all-reduced (112 x 4 = 448) and the input's gradient
    # reduce-scattered (112 x 32 = 3,584). Row-parallel adapters (o, cross o: 32 rows): forward
    # linear_in's [T, 4] all-reduced (128) and linear_out's output [T, 32] all-gathered (1,024);
    # backward the [T, 4] gradient all-reduced (128) and the output gradient all-gathered (1,024).
    # The adapters are split over TP: no per-step all-reduce of theirs. 2 blocks x 4 micro-batches x 2 B.
    off, on = (dit_layout_report(SPEC, SP, TRAINING, peft=p)["communication_per_step"] for p in (None, TRAINED_LORA))
    scale = 2 * 4 * 2
    assert on["tp/all_gather"] - off["tp/all_gather"] == scale * (4_032 + 1_024 + 1_024)
    assert on["tp/all_reduce"] - off["tp/all_reduce"] == scale * (448 + 128 + 128)
    assert on["tp/reduce_scatter"] - off["tp/reduce_scatter"] == scale * 3_584


def test_autograd_reach_in_a_frozen_base():
    # The first block of a frozen base: its input (patch and time embeddings, frozen) needs no
    # gradient, so q/k/v's does not; their adapters make q, k and everything after need one; the
    # text embeddings (the cross k/v input) never do.
    first = dit_block_input_grads(SPEC, FROZEN_LORA, input_grad=False)
    assert {m for m, grad in first.items() if not grad} == {"self_attn.q", "self_attn.k", "self_attn.v",
                                                           "cross_attn.k", "cross_attn.v"}
    later = dit_block_input_grads(SPEC, FROZEN_LORA, input_grad=True)
    assert {m for m, grad in later.items() if not grad} == {"cross_attn.k", "cross_attn.v"}


def test_frozen_base_collectives():
    # TP 2 + SP, frozen base, LoRA rank 4 on q, k, v, o, 16 video and 12 text tokens (24 gathered), h 32, P 16.
    # Per block and micro-batch (elements / 32 for the base):
    # - base, forward: all-gather of the column-parallel inputs (q/k/v 16, cross q 16, cross k/v 24, ffn.0
    #   16 = 72) and of q, k, cross q, cross k for the norms (72); reduce-scatter of o, cross o, ffn.2 (48);
    # - base, backward: no weight-gradient gathers (frozen); the row-parallel output gradients (48) and the
    #   norms' (72) all-gathered; the column-parallel input gradients reduce-scattered but the cross k/v's
    #   (text: no gradient): 48, the first block's q/k/v too: 32;
    # - adapters as on a trained base (all-gather 4,032 + 2 x 1,024, all-reduce 128 / 448 + 128), but
    #   the reduce-scatter of an input that needs no gradient: cross k, v (2 x 24 x 32) in every block,
    #   self q, k, v (3 x 16 x 32) in the first: 3,584 - 1,536 = 2,048, the first block 512.
    # Outside: the patch embedding trains no more (no gradient all-gather); the head's output [16, 16]
    # all-gathered and its gradient reduce-scattered (256 each).
    comm = dit_layout_report(SPEC, SP, TRAINING, peft=FROZEN_LORA)["communication_per_step"]
    all_gather = 2 * (144 * 32 + 4_032 + 1_024) + 2 * (120 * 32 + 1_024) + 256
    reduce_scatter = 2 * 48 * 32 + (48 * 32 + 2_048) + (32 * 32 + 512) + 256
    all_reduce = 2 * (128 + 448 + 128)
    assert comm == {"tp/all_gather": 4 * 2 * all_gather, "tp/reduce_scatter": 4 * 2 * reduce_scatter,
                    "tp/all_reduce": 4 * 2 * all_reduce, "total_bytes": 8 * (all_gather + reduce_scatter + all_reduce)}


def test_frozen_base_activations_and_label():
    # A frozen column-parallel layer saves nothing of its input, its adapter keeps what it reads: at TP 2
    # the q, k, v adapters share the block's [16, 32] modulated input (1,024 B, bf16); under SP each
    # gathers the 8 tokens of each rank itself and keeps its own [16, 32] (3 x 1,024 B). The rest of the
    # self-attention (the [16, 4] intermediates, the norms, o's adapter over all 16 tokens) is the same.
    tp2, sp = (dit_activations(SPEC, BATCH, act_bytes=2, tp=2, sequence_parallel=s, peft=FROZEN_LORA)
               for s in (False, True))
    assert sp.block["self_attn"] - tp2.block["self_attn"] == 3 * 1_024 - 1_024
    report = dit_layout_report(SPEC, SP, TRAINING, peft=FROZEN_LORA)
    assert report["per_gpu"]["activations_bytes"] == sp.total
    assert any(u.startswith("LoRA adapters or a frozen base under tensor parallelism and sequence parallelism (TP 2)")
               for u in report["unmeasured"])
    assert report["not_modelled"] == []


def test_frozen_base_without_sequence_parallelism_follows_autograd():
    # TP 2, frozen base, LoRA rank 4 on ffn.0 and ffn.2 only, one micro-batch of 16 video and 12 text
    # tokens, h 32, bf16. Elements per block:
    # - first block: nothing before ffn.0's adapter needs a gradient. All-reduce of o, cross o, ffn.2
    #   outputs (3 x 16 x 32) forward, no input gradient of the base; all-gather of q, k, cross q (16 rows
    #   each) and cross k (12) for the norms forward (60 x 32), none backward; the adapters: ffn.0's
    #   (column) gathers [16, 4] and all-reduces [16, 4 + 32], ffn.2's (row) all-reduces [16, 4] twice
    #   and gathers its output [16, 32]: all-reduce 1,536 + 576 + 128, all-gather 1,920 + 64 + 512;
    # - second block: its input needs a gradient, so do q/k/v's, the cross q's and ffn.0's inputs
    #   (48 x 32 all-reduced backward) and the q, k, cross q norms' (48 x 32 gathered backward); the
    #   cross k's input, the frozen text, never: all-reduce 1,536 + 1,536 + 704, all-gather 1,920 +
    #   1,536 + 576.
    peft = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("ffn.0", "ffn.2"))
    comm = dit_layout_report(SPEC, Parallelism(tp=2), Training(seq_length=16, micro_batch_size=1),
                             peft=peft)["communication_per_step"]
    assert comm["tp/all_reduce"] == 2 * ((1_536 + 576 + 128) + (1_536 + 1_536 + 704))
    assert comm["tp/all_gather"] == 2 * ((1_920 + 64 + 512) + (1_920 + 1_536 + 576))
