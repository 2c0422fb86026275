"""What the example WAN-like DiT (``examples/wan_dit_fsdp2.py``: its blocks, then the whole model
and its loss) saves for backward, fully trained and LoRA, against
:mod:`megatron_flops.memory.dit_activations`, to the byte (single process, CPU: FSDP2 changes where
the weights live, not what a block saves, and runs one micro-batch at a time).

Without checkpointing: the distinct storages the blocks hand to ``saved_tensors_hooks``
(parameters and one-element tensors excluded). With checkpointing, non-reentrant
``torch.utils.checkpoint`` saves through its own inner hooks, so what it keeps is counted instead:
the storages reachable from Python after the forward (the checkpoints' inputs), and the region
re-run in backward is one block's saves, measured without checkpointing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import copy
import dataclasses
import gc
import json
import sys
from pathlib import Path

import pytest
import torch

import mcore_memory
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec
from megatron_flops.memory.dit_activations import DiTBatch, dit_activations, dit_block_saved, dit_outside_saved
from megatron_flops.memory.fsdp import FSDP_TRANSIENTS, fsdp_working_copies
from megatron_flops.memory.fsdp_transients import unsharded_working_copies
from megatron_flops.memory.layout import Training

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import wan_dit_fsdp2 as example  # noqa: E402

RAW = json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())
I2V = {"image_dim": 20, "image_len": 5}
# name -> (dit overrides, dtype, batch[, LoRA rank and targets on a frozen base])
CASES = {
    "t2v fp32, two clips": ({}, torch.float32, DiTBatch(video=(12, 20), text=(7, 3))),
    "t2v bf16, three clips": ({"num_layers": 3}, torch.bfloat16, DiTBatch(video=(6, 8, 2), text=(12, 2, 5))),
    "i2v fp32, two clips": (I2V, torch.float32, DiTBatch(video=(12, 20), text=(7, 3), image=(5, 5))),
    "i2v bf16, one clip": (I2V, torch.bfloat16, DiTBatch(video=(24,), text=(9,), image=(5,))),
    "LoRA q,k,v,o, t2v fp32": ({}, torch.float32, DiTBatch(video=(12, 20), text=(7, 3)), (4, ["q", "k", "v", "o"])),
    "LoRA q,k,v,o,k_img,v_img, i2v bf16": (
        {"num_layers": 3, **I2V}, torch.bfloat16, DiTBatch(video=(12, 20), text=(7, 3), image=(5, 5)),
        (4, ["q", "k", "v", "o", "k_img", "v_img"])),
    "LoRA rank 3 on ffn.0,ffn.2 only, i2v fp32": (
        I2V, torch.float32, DiTBatch(video=(16,), text=(4,), image=(5,)), (3, ["ffn.0", "ffn.2"])),
    "LoRA on cross_attn v,o only, t2v fp32": (
        {"num_layers": 3}, torch.float32, DiTBatch(video=(8, 4), text=(2, 6)), (2, ["cross_attn.v", "cross_attn.o"])),
}


def _setup(name: str):
    dit, dtype, batch, *lora = CASES[name]
    raw = copy.deepcopy(RAW)
    raw.pop("lora")
    raw.pop("recompute_granularity")
    raw["dit"].update(dit)
    peft = None
    if lora:
        raw["lora"] = {"dim": lora[0][0], "target_modules": lora[0][1]}
        peft = DiTPeftSpec(frozen=True, lora_rank=lora[0][0], lora_targets=tuple(lora[0][1]))
    spec = DiTSpec.from_mapping(raw["dit"])
    # bf16: the weights cast for compute, as FSDP2's MixedPrecisionPolicy(param_dtype=bf16) does.
    model = example.build_model(raw).to(dtype)
    gen = torch.Generator().manual_seed(0)
    h = spec.hidden_size

    def leaf(*shape: int) -> torch.Tensor:
        # A frozen base: the embeddings' outputs need no gradient.
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(peft is None)

    inputs = dict(x=leaf(sum(batch.video), h), e=leaf(sum(batch.video), 6, h), context=leaf(sum(batch.text), h),
                  image=None if batch.image is None else leaf(sum(batch.image), h))
    return spec, peft, model, batch, inputs


def _run(model, batch: DiTBatch, x, e, context, image, checkpointed: bool) -> torch.Tensor:
    for block in model.blocks:
        args = (x, e, list(batch.video), context, list(batch.text), image,
                None if batch.image is None else list(batch.image))
        x = torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False) if checkpointed else block(*args)
    return x


def _act_bytes(model) -> int:
    return next(model.parameters()).element_size()


@pytest.mark.parametrize("name", list(CASES))
def test_saved_without_checkpointing(name):
    spec, peft, model, batch, inputs = _setup(name)
    a = _act_bytes(model)
    meter = mcore_memory.SavedTensorMeter(model.parameters())
    with meter.tracking(), meter.one_forward():
        _run(model, batch, **inputs, checkpointed=False)
    # CPU: LayerNorm keeps its mean and rstd in the input dtype (CUDA: fp32, the formula's default).
    want = dit_activations(spec, batch, act_bytes=a, attention="local", peft=peft, layer_norm_stats_bytes=a)
    blocks = want.total - sum(want.outside.values())  # the blocks alone: no embeddings, head or loss
    assert meter.forward == [blocks]
    assert meter.peak == blocks
    # One block alone: its own saves plus the text/image embeddings.
    meter = mcore_memory.SavedTensorMeter(model.parameters())
    with meter.tracking(), meter.one_forward():
        model.blocks[0](inputs["x"], inputs["e"], list(batch.video), inputs["context"], list(batch.text),
                        inputs["image"], None if batch.image is None else list(batch.image))
    own = dit_block_saved(spec, batch, act_bytes=a, attention="local", peft=peft, input_grad=peft is None,
                          layer_norm_stats_bytes=a)
    # The text/image embeddings: all trained, or read by an adapter of k/v (k_img/v_img).
    lora = DiTPeftSpec.of(peft) if peft is not None else None
    shared = sum(n * spec.hidden_size * a for suffix, n in (("", sum(batch.text)), ("_img", sum(batch.image or ())))
                 if lora is None or lora.adapts(f"cross_attn.k{suffix}") or lora.adapts(f"cross_attn.v{suffix}"))
    assert meter.forward == [sum(own.values()) + shared]


def _python_storages(exclude: set[int]) -> dict[int, int]:
    """Distinct storages of the tensors Python objects reach (not ``exclude``), less each
    checkpoint's copy of the CPU generator state (uint8, host memory: ``preserve_rng_state``)."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor and obj.numel() > 1 and obj.dtype != torch.uint8:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude:
                found[storage.data_ptr()] = storage.nbytes()
    return found


def _checkpoint_meter(model: torch.nn.Module) -> tuple[Any, Callable[..., int]]:
    """A saved-tensor meter over ``model`` and ``alive(exclude)``: the bytes of distinct storages
    saved outside the checkpoints (the meter's) or kept or re-saved by them, less ``exclude``'s."""
    before = set(_python_storages(set())) | {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter = mcore_memory.SavedTensorMeter(model.parameters())

    def alive(exclude: torch.Tensor | None = None) -> int:
        found = {**_python_storages(before), **{k: n for k, (_, n) in meter.live.items()}}
        found.pop(None if exclude is None else exclude.untyped_storage().data_ptr(), None)
        return sum(found.values())

    return meter, alive


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_keeps_its_inputs(name):
    spec, peft, model, batch, inputs = _setup(name)
    a = _act_bytes(model)
    before = set(_python_storages(set())) | {p.untyped_storage().data_ptr() for p in model.parameters()}
    # Intermediates, as in the model: the patch embedding's output, the repeated time
    # projection, the text/image embeddings (clones save nothing for backward).
    fresh = {k: None if v is None else v.clone() for k, v in inputs.items()}
    out = _run(model, batch, **fresh, checkpointed=True)
    del fresh
    kept = _python_storages(before | {out.untyped_storage().data_ptr()})
    want = dit_activations(spec, batch, act_bytes=a, attention="local", peft=peft,
                           checkpointed_blocks=spec.num_layers, layer_norm_stats_bytes=a)
    # Kept until backward: every block's input hidden states, the per-token modulation input and
    # the text/image embeddings; backward then re-runs one block (its saves less its input).
    assert sum(kept.values()) == want.kept + want.shared
    T, h = sum(batch.video), spec.hidden_size
    assert want.kept == spec.num_layers * T * h * a + 6 * T * h * a
    # The largest block re-run: one whose input needs a gradient (its input, kept, saved by norm1).
    assert want.recompute == sum(dit_block_saved(spec, batch, act_bytes=a, attention="local", peft=peft,
                                                 layer_norm_stats_bytes=a).values()) - T * h * a
    out.float().sum().backward()  # the checkpoints replay and release what they kept
    del out
    assert sum(_python_storages(before).values()) == 0


def test_flash_convention_and_partial_checkpointing():
    # Tiny i2v, one clip of 24 tokens, 9 text, 5 image tokens, h 32, 4 heads, fp32.
    spec = DiTSpec.from_mapping({**RAW["dit"], **I2V})
    batch = DiTBatch(video=(24,), text=(9,), image=(5,))
    local = dit_block_saved(spec, batch, act_bytes=4, attention="local")
    flash = dit_block_saved(spec, batch, act_bytes=4, attention="flash")
    # local: softmax outputs 4 x 24 x (24, 9, 5) x 4 B; flash: 3 fp32 log-sum-exp [4, 24] and the
    # text and image outputs [24, 32] (o reads their sum).
    assert local["self_attn"] - flash["self_attn"] == 4 * 24 * 24 * 4 - 4 * 24 * 4
    assert local["cross_attn"] - flash["cross_attn"] == 4 * 24 * 14 * 4 - 2 * 4 * 24 * 4 - 2 * 24 * 32 * 4
    full = dit_activations(spec, batch, act_bytes=4, checkpointed_blocks=2)
    one = dit_activations(spec, batch, act_bytes=4, checkpointed_blocks=1)
    none = dit_activations(spec, batch, act_bytes=4)
    own, outside = sum(flash.values()), sum(none.outside.values())
    head = none.outside["head"] + none.outside["loss"]
    assert none.total == 2 * own + none.shared + outside
    # One checkpointed: it keeps its input and the modulation input; its re-run comes after the
    # second block, head and loss have freed theirs (the re-run is smaller than those).
    assert one.recompute == own - 24 * 32 * 4 < own + head
    assert one.total - none.total == 24 * 32 * 4 + 6 * 24 * 32 * 4 - own
    # Both: the re-run (the block less its input) outweighs the head and loss after the forward.
    assert full.recompute > head
    assert full.total == 2 * 24 * 32 * 4 + 6 * 24 * 32 * 4 + (own - 24 * 32 * 4) + full.shared + outside - head
    with pytest.raises(ValueError, match="attention"):
        dit_block_saved(spec, batch, act_bytes=4, attention="sdpa")


def test_cli_reports_the_whole_models_activations(capsys):
    # The tiny DiT, 2 clips of 16 video tokens per micro-batch (text_len 12), fp32, every block
    # checkpointed, the measured attention: the JSON activations are dit_activations' total, the
    # embeddings, head and loss included (measured above): nothing is left out.
    from megatron_flops.cli import main

    argv = ["memory", "--model", str(EXAMPLES / "wan_tiny_dit.json"), "--seq-length", "16",
            "--micro-batch-size", "2", "--dp", "2", "--fsdp", "--params-dtype", "fp32", "--json"]
    assert main([*argv, "--recompute", "full", "--attention-backend", "local"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = DiTSpec.from_mapping(RAW["dit"])
    peft = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("q", "k", "v", "o"))
    want = dit_activations(spec, DiTBatch(video=(16, 16), text=(12, 12)), act_bytes=4, attention="local",
                           peft=peft, checkpointed_blocks=2)
    assert out["per_gpu"]["activations_bytes"] == want.total
    # FSDP2's transient whole copies: a formula, named as unmeasured (not activations), in the total.
    assert (out["unmeasured"], out["not_modelled"]) == ([FSDP_TRANSIENTS], [])
    gpu = out["per_gpu"]
    assert gpu["components"]["fsdp/unsharded_working_copies"] == 174_272  # test_fsdp_working_copies_exact
    assert gpu["total_bytes"] == sum(gpu["components"].values()) + want.total
    assert main(argv) == 0  # the flash convention by default: named as unmeasured
    assert "flash attention kernel" in json.loads(capsys.readouterr().out)["unmeasured"][0]
    # megatron-core's uniform method with 2 blocks per checkpoint: one group of the two blocks.
    assert main([*argv, "--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2",
                 "--attention-backend", "local"]) == 0
    grouped = dit_activations(spec, DiTBatch(video=(16, 16), text=(12, 12)), act_bytes=4, attention="local",
                              peft=peft, checkpointed_blocks=2, checkpoint_group=2)
    assert json.loads(capsys.readouterr().out)["per_gpu"]["activations_bytes"] == grouped.total != want.total


# ---- the whole model: embeddings, blocks, head and loss --------------------------------------------

WHOLE = ["t2v fp32, two clips", "i2v bf16, one clip", "LoRA q,k,v,o, t2v fp32", "LoRA q,k,v,o,k_img,v_img, i2v bf16"]


def _whole_inputs(spec: DiTSpec, batch: DiTBatch, dtype):
    """One micro-batch of data for ``WanLike``: latents ``[C_in, 1, 2, 2 s_i]`` (``s_i`` tokens of
    patch (1, 2, 2)), timesteps, text, CLIP features and fp32 targets, cast to the compute dtype as
    FSDP2's ``MixedPrecisionPolicy`` casts the root's inputs."""
    assert spec.patch_size == (1, 2, 2)
    gen = torch.Generator().manual_seed(0)

    def data(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return dict(latents=[data(spec.in_channels, 1, 2, 2 * s) for s in batch.video],
                t=torch.arange(len(batch.video)) * 300, text=[data(c, spec.text_dim) for c in batch.text],
                clip=None if batch.image is None else [data(m, spec.image_dim) for m in batch.image],
                targets=torch.randn(sum(batch.video), spec.out_channels * 4, generator=gen))


def _whole_loss(model, inputs) -> torch.Tensor:
    pred = model(inputs["latents"], inputs["t"], inputs["text"], inputs["clip"])
    return torch.nn.functional.mse_loss(pred.float(), inputs["targets"])


@pytest.mark.parametrize("name", WHOLE)
def test_whole_model_without_checkpointing(name):
    spec, peft, model, batch, _ = _setup(name)
    a, inputs = _act_bytes(model), _whole_inputs(spec, batch, next(model.parameters()).dtype)
    meter = mcore_memory.SavedTensorMeter(model.parameters())
    with meter.tracking(), meter.one_forward():
        loss = _whole_loss(model, inputs)
    want = dit_activations(spec, batch, act_bytes=a, attention="local", peft=peft, layer_norm_stats_bytes=a)
    assert meter.forward == [want.total]
    assert meter.peak == want.total
    loss.backward()
    assert meter.current == 0


def test_outside_the_blocks_by_hand():
    # Tiny t2v (h 32, C_in = C_out = 4, patch 4, freq 16, text_dim 24), fp32, two clips of 12 and 20
    # video tokens with 7 and 3 text tokens: T 32, C 10, B 2, P 16; CPU LayerNorm statistics fp32.
    spec = DiTSpec.from_mapping(RAW["dit"])
    outside = dit_outside_saved(spec, CASES["t2v fp32, two clips"][2], act_bytes=4, trains=True)
    assert outside == {
        "patch_embed": 32 * 16 * 4,  # the latents, [32, 4 x 4]
        "time_embed": 2 * 16 * 4 + 4 * 2 * 32 * 4 + 32 * 8,  # sinusoid, SiLU in/out twice, int64 index
        "text_embed": 10 * 24 * 4 + 2 * 10 * 32 * 4,  # text, GELU's input and output
        "image_embed": 0,
        "head": 4 * 32 * 32 * 4 + 2 * 32 * 4 + 32 * 8,  # x, norm(x), 1 + scale, head input; stats; index
        "loss": 2 * 32 * 16 * 4,  # fp32 prediction and target
    }
    frozen = dit_outside_saved(spec, CASES["t2v fp32, two clips"][2], act_bytes=4, trains=False)
    assert frozen["head"] == 2 * 32 * 32 * 4 + 2 * 32 * 4 and frozen["loss"] == outside["loss"]
    assert frozen["patch_embed"] == frozen["time_embed"] == frozen["text_embed"] == 0


@pytest.mark.parametrize("name, checkpointed", [(WHOLE[0], 2), (WHOLE[1], 1), (WHOLE[2], 1), (WHOLE[3], 3)])
def test_whole_model_checkpointed_peak(name, checkpointed):
    """Checkpointing ``checkpointed`` blocks: the saved storages at the end of the forward, and at
    the end of the last checkpointed block's re-run in backward, after the head, the loss and the
    later blocks have freed theirs; the report's total is the larger."""
    spec, peft, model, batch, _ = _setup(name)
    a, inputs = _act_bytes(model), _whole_inputs(spec, batch, next(model.parameters()).dtype)
    model.checkpoint_blocks = checkpointed
    meter, alive = _checkpoint_meter(model)

    rerun: list[int] = []
    done = False

    def at_rerun_end(module, args, out) -> None:
        # The last checkpointed block's re-run in backward has saved everything again.
        if done:
            rerun.append(alive(out))

    model.blocks[checkpointed - 1].register_forward_hook(at_rerun_end)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), meter.tracking():
        loss = _whole_loss(model, inputs)
    at_forward_end, done = alive(), True
    loss.backward()
    want = dit_activations(spec, batch, act_bytes=a, attention="local", peft=peft,
                           checkpointed_blocks=checkpointed, layer_norm_stats_bytes=a)
    embeddings = sum(want.outside.values()) - want.outside["head"] - want.outside["loss"]
    later = sum(dit_block_saved(spec, batch, act_bytes=a, attention="local", peft=peft,
                                layer_norm_stats_bytes=a).values()) * (spec.num_layers - checkpointed)
    assert at_forward_end == embeddings + want.shared + want.kept + later + want.outside["head"] + want.outside["loss"]
    assert rerun == [embeddings + want.shared + want.kept + want.recompute]
    assert want.total == max(at_forward_end, rerun[0])


class _Group(torch.nn.Module):
    """Blocks run one after another under one checkpoint (megatron-core's uniform method's chunk)."""

    def __init__(self, blocks) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x, *args):
        for block in self.blocks:
            x = block(x, *args)
        return x


@pytest.mark.parametrize("name, group", [(WHOLE[0], 2), (WHOLE[3], 2), (WHOLE[1], 2)])
def test_whole_model_checkpointed_in_groups(name, group):
    """Every block checkpointed in groups of ``group`` (the last group shorter when the blocks do
    not divide): the saved storages at the end of the forward and at the end of each group's
    re-run in backward; the report's total is the largest."""
    spec, peft, model, batch, _ = _setup(name)
    a, inputs = _act_bytes(model), _whole_inputs(spec, batch, next(model.parameters()).dtype)
    blocks = list(model.blocks)
    model.blocks = torch.nn.ModuleList(_Group(blocks[i:i + group]) for i in range(0, len(blocks), group))
    model.checkpoint_blocks = len(model.blocks)
    meter, alive = _checkpoint_meter(model)

    reruns: list[int] = []
    done = False
    for g in model.blocks:
        g.register_forward_hook(lambda module, args, out: reruns.append(alive(out)) if done else None)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), meter.tracking():
        loss = _whole_loss(model, inputs)
    at_forward_end, done = alive(), True
    loss.backward()
    want = dit_activations(spec, batch, act_bytes=a, attention="local", peft=peft, checkpointed_blocks=spec.num_layers,
                           checkpoint_group=group, layer_norm_stats_bytes=a)
    embeddings = sum(want.outside.values()) - want.outside["head"] - want.outside["loss"]
    assert at_forward_end == embeddings + want.shared + want.kept + want.outside["head"] + want.outside["loss"]
    assert max(reruns) == embeddings + want.shared + want.kept + want.recompute
    assert want.total == max(at_forward_end, *reruns)


# ---- FSDP2's transient whole copies (a formula: gloo cannot show which gathered units overlap) -------

def test_fsdp_working_copies_exact():
    # The tiny DiT over DP 2: a block gathers 13,024 elements + 192 padding (the adaLN table [1, 6, 32]:
    # ceil(1 / 2) = 1 row per rank) = 13,216; the root 10,928 + 64 (head.modulation [1, 2, 32]) = 10,992.
    # LoRA rank 4 on q,k,v,o (self and cross): 8 x (A [4, 32] + B [32, 4]) = 2,048 more per block, the
    # only trainable ones, no padding (4 and 32 rows over 2 ranks).
    spec = DiTSpec.from_mapping(RAW["dit"])
    fp32 = Training(seq_length=16, micro_batch_size=2, params_dtype="fp32")
    bf16 = dataclasses.replace(fp32, params_dtype="bf16")
    # Full training, fp32: the root's gathered parameters and whole gradients (10,992 x (4 + 4)),
    # two blocks gathered (2 x 13,216 x 4) and one block's whole gradients (13,216 x 4).
    assert fsdp_working_copies(spec, fp32, dp=2) == 10_992 * 8 + 3 * 13_216 * 4 == 246_528
    # bf16 compute, fp32 reduce: gathered in 2 bytes, gradients (the reduce-scatter input) in 4.
    assert fsdp_working_copies(spec, bf16, dp=2) == 10_992 * 6 + 2 * 13_216 * 2 + 13_216 * 4 == 171_680
    # LoRA, fp32: the frozen root is gathered only; the blocks gather their adapters too.
    peft = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("q", "k", "v", "o"))
    assert fsdp_working_copies(spec, fp32, dp=2, peft=peft) == 10_992 * 4 + 2 * 15_264 * 4 + 2_048 * 4 == 174_272
    # One block: nothing to prefetch; the shared formula the decoder's FSDP2 path uses.
    one = dataclasses.replace(spec, num_layers=1)
    assert fsdp_working_copies(one, fp32, dp=2) == 10_992 * 8 + 2 * 13_216 * 4
    assert unsharded_working_copies([3, 5, 2], [1, 0, 4], resident=7) == 7 + max(3 + 5 + 1, 5 + 2 + 4) == 18
    assert unsharded_working_copies([], [], resident=7) == 7
