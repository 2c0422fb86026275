"""Memory of a VLM's vision tower (:mod:`megatron_flops.memory.vision`) against the real Hugging
Face towers on CPU: parameters in ``named_parameters()`` order (built on the meta device), bytes
saved for backward by the eager attention (``saved_tensors_hooks`` over distinct storages,
tests/mcore_memory.py), and the states of a megatron-core DDP + distributed optimizer holding the
tower before a GPT decoder, as Megatron-Bridge's ``Qwen25VLModel`` does."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_flops.flops.vision import VisionStats
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory, rank_memory
from megatron_flops.memory.vision import GRIDS_NEEDED, vision_activations, vision_memory, vision_parameters, vision_tower
from megatron_flops.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")

# Tiny towers (patch 2: 24 pixel values per patch; merge 2x2).
QWEN2 = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=24, patch_size=2)
QWEN25 = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=24, patch_size=2,
              window_size=8, fullatt_block_indexes=[1])
QWEN3 = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=24, patch_size=2,
             num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
# Qwen3-Omni's tower (Qwen3OmniMoeVisionEncoder, built as Qwen3-VL's): deep-stack after blocks 1 and 2.
TOWERS = {"qwen2_vl": QWEN2, "qwen2_5_vl": QWEN25, "qwen3_vl": QWEN3,
          "qwen3_omni_moe": dict(QWEN3, deepstack_visual_indexes=[1, 2])}


def _hf_tower(family: str, fields: dict):
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as mod
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig as config
        return mod.Qwen2VisionTransformerPretrainedModel, config(**fields)
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as config
        return mod.Qwen2_5_VisionTransformerPretrainedModel, config(**fields)
    if family == "qwen3_omni_moe":
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mod
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
            Qwen3OmniMoeVisionEncoderConfig as config,
        )
        return mod.Qwen3OmniMoeVisionEncoder, config(**fields)
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mod
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as config
    return mod.Qwen3VLVisionModel, config(**fields)


def _tower(family: str, fields: dict | None = None):
    vision = {"vision_config": fields or TOWERS[family]}
    return vision_tower({"model_type": family, **({"thinker_config": vision} if family == "qwen3_omni_moe" else vision)})


@pytest.mark.parametrize("family", list(TOWERS))
def test_parameters_in_hugging_face_order(family):
    cls, config = _hf_tower(family, TOWERS[family])
    with torch.device("meta"):
        module = cls._from_config(config)
    ours = [(p.name.removeprefix("visual."), p.numel) for p in vision_parameters(_tower(family))]
    assert ours == [(n, p.numel()) for n, p in module.named_parameters()]


def test_parameters_by_hand():
    # Qwen2.5-VL, D 32, F 48, 3 blocks, merger 128 -> 24: patch 24*32 = 768; per block two RMSNorms
    # 64, qkv 32*96+96 = 3168, proj 32*32+32 = 1056, gate/up 2*(32*48+48) = 3168, down 48*32+32 = 1568
    # (9024); merger ln_q 32, 128*128+128 = 16512, 128*24+24 = 3096. 768 + 3*9024 + 19640 = 47480.
    params = vision_parameters(_tower("qwen2_5_vl"))
    assert sum(p.numel for p in params) == 47480
    frozen = vision_parameters(_tower("qwen2_5_vl"), model_trains=False)
    assert sum(p.numel for p in frozen if p.trainable) == 19640  # the merger only


def _measure(family: str, grids: list, dtype: torch.dtype, model_trains: bool, projection_trains: bool,
             attention: str = "eager") -> int:
    import mcore_memory

    cls, config = _hf_tower(family, TOWERS[family])
    config._attn_implementation = attention
    torch.manual_seed(0)
    module = cls._from_config(config).to(dtype).train()
    for name, p in module.named_parameters():
        p.requires_grad_(projection_trains if "merger" in name else model_trains)  # (deep-stack mergers too)
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(dim=1).sum()), 24, dtype=dtype)
    meter = mcore_memory.SavedTensorMeter(module.parameters())
    with meter.tracking(), meter.one_forward():
        module(pixels, grid_thw=grid)
    return meter.forward[0]


# Windows of 2x2 merged tokens: [1, 6, 10] leaves remainder windows (3 x 5 merged).
GRIDS = {"image": [[1, 4, 4]], "images and a video": [[1, 6, 10], [2, 8, 12]]}
FREEZE = {"trained": (True, True), "frozen blocks": (False, True), "frozen merger": (True, False),
          "frozen": (False, False)}


# Eager: every freeze setting on the images and a video in fp32 and bf16, the single image trained and
# fully frozen; sdpa (torch's CPU kernel): trained, both dtypes, both grid sets. Qwen3-Omni's tower (the
# same code as Qwen3-VL's, deep-stack after other blocks): eager in bf16, every freeze setting; sdpa trained.
_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
CASES = ([(f, "eager", d, "images and a video", z) for f in _FAMILIES for d in (torch.float32, torch.bfloat16)
          for z in FREEZE]
         + [(f, "eager", torch.bfloat16, "image", z) for f in _FAMILIES for z in ("trained", "frozen")]
         + [(f, "sdpa", d, g, "trained") for f in _FAMILIES for d in (torch.float32, torch.bfloat16) for g in GRIDS]
         + [("qwen3_omni_moe", "eager", torch.bfloat16, "images and a video", z) for z in FREEZE]
         + [("qwen3_omni_moe", "sdpa", torch.bfloat16, "images and a video", "trained")])


@pytest.mark.parametrize("family, attention, dtype, grids, freeze", CASES,
                         ids=[f"{f}-{a}-{str(d)[6:]}-{g}-{z}" for f, a, d, g, z in CASES])
def test_saved_bytes_match_the_tower(family, attention, dtype, grids, freeze):
    model_trains, projection_trains = FREEZE[freeze]
    measured = _measure(family, GRIDS[grids], dtype, model_trains, projection_trains, attention)
    tower = _tower(family)
    a = torch.finfo(dtype).bits // 8
    # NB: torch's CPU LayerNorm keeps its statistics in the input dtype (CUDA: fp32).
    ours = vision_activations(tower, VisionStats.from_grids(tower.spec, GRIDS[grids]), act_bytes=a, attention=attention,
                              model_trains=model_trains, projection_trains=projection_trains, norm_stats_bytes=a)
    assert measured == sum(ours.values())


def test_saved_bytes_by_hand():
    # Qwen2.5-VL fp32, one full-attention block (D 32, F 48, 2 heads of 16), one 4x4 image: P = 16.
    # Block: two RMSNorms 2*(4PD + 4P + 4PD) = 8320; qkv in/out, rotated q, k, proj in 7*4PD = 14336;
    # softmax 2*16*16*4 = 2048; MLP in 4PD = 2048, silu in/out, up, product 4*4PF = 12288: 39040.
    # Outside: pixels 4*16*24 = 1536, cos/sin 2*4*16*16 = 2048, window order and inverse 2*8*4 = 64,
    # merger RMSNorm 4160 + linear ins and GELU in 3*4PD = 6144: 13952. Total 52992 (measured).
    fields = dict(QWEN25, depth=1, fullatt_block_indexes=[0])
    tower = _tower("qwen2_5_vl", fields)
    ours = vision_activations(tower, VisionStats.from_grids(tower.spec, [[1, 4, 4]]), act_bytes=4)
    assert sum(ours.values()) == 52992
    flash = vision_activations(tower, VisionStats.from_grids(tower.spec, [[1, 4, 4]]), act_bytes=4,
                               attention="flash_attention_2")
    assert ours["vit/attn"] - flash["vit/attn"] == 2048 - 4 * 16 * 2  # the softmax out, an fp32 lse in
    sdpa = vision_activations(tower, VisionStats.from_grids(tower.spec, [[1, 4, 4]]), act_bytes=4, attention="sdpa")
    assert sdpa["vit/attn"] - flash["vit/attn"] == 4 * 16 * 32  # the kernel's output before the transpose


SPEC = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256)


def _report_setup(**par):
    spec = ModelSpec.from_mapping(SPEC)
    options = DecoderOptions.from_mapping(dict(SPEC, padded_vocab_size=256, attention_backend="local",
                                               position_embedding_type="rope", add_bias_linear=False,
                                               hidden_dropout=0.0, attention_dropout=0.0))
    return spec, options, Parallelism(**par), Training(seq_length=16, micro_batch_size=2, num_microbatches=2)


def test_tower_on_the_first_stage_whole_on_every_tp_rank():
    spec, options, par, training = _report_setup(tp=2, pp=2)
    tower = vision_memory(_tower("qwen2_5_vl"), [[1, 4, 4]], act_bytes=2, attention="eager")
    plain, with_tower = decoder_memory(spec, options, par, training), decoder_memory(spec, options, par, training,
                                                                                     vision=tower)
    numel = 47480
    assert with_tower.parameters["total"] - plain.parameters["total"] == numel
    first, last = with_tower.stages
    assert first.states["weights"] - plain.stages[0].states["weights"] == 2 * numel  # bf16, not split over TP
    assert first.states["gradients"] - plain.stages[0].states["gradients"] == 4 * numel
    assert last.states == plain.stages[1].states
    assert first.communication["tp/all_reduce"] - plain.stages[0].communication.get("tp/all_reduce", 0) == 4 * numel
    per_mb = sum(tower.activations.values())
    # 1F1B on 2 stages, 2 micro-batches: stage 0 holds both forwards, each with one tower pass.
    assert first.in_flight == 2 and first.activations - plain.stages[0].activations == 2 * per_mb
    assert last.activations == plain.stages[1].activations


def test_cli_vlm_memory(capsys):
    from megatron_flops.cli import main

    base = ["memory", "--model", "examples/qwen2_5_vl_7b_config.json", "--seq-length", "4096", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    # No grids: the tower's activations need --grid-thw (an input, not a gap), and the total says it leaves them out.
    assert out["not_modelled"] == [] and out["needs_input"] == [
        {"flag": "--grid-thw", "excluded": "the vision tower's activations",
         "give": "the [t, h, w] grids of one micro-batch"}]
    assert main(base[:-1]) == 0
    text = capsys.readouterr().out
    assert "total, without the vision tower's activations" in text and "needs --grid-thw (this setup)" in text
    assert main(base + ["--grid-thw", "[[1, 98, 146]]", "--vision-attention", "eager",
                        "--freeze-vision-model"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Frozen: the patch embedding 1176*1280 = 1,505,280 and 32 blocks of 19,702,200 (norms 2560, qkv
    # 1280*3840+3840, proj 1280*1280+1280, gate/up 2*(1280*3420+3420), down 3420*1280+1280); the merger
    # (ln_q 1280, 5120*5120+5120, 5120*3584+3584 = 44,574,464) trains: 676,550,144 in all.
    assert out["parameters"]["total"] - out["parameters"]["trainable"] == 1_505_280 + 32 * 19_702_200
    assert out["per_gpu"]["activations_per_microbatch"][0]["vit/merger"] > 0
    assert "vit/attn" not in out["per_gpu"]["activations_per_microbatch"][0]


def _megatron_vlm_states(distributed_optimizer: bool, model_trains: bool, bucket_size: int | None):
    """A megatron-core GPT behind the Hugging Face Qwen2.5-VL tower in one ``MegatronModule``
    (``visual`` registered first, as Megatron-Bridge's ``Qwen25VLModel``), bf16 (``Float16Module``),
    megatron-core DDP (+ distributed optimizer), Adam; one optimizer step on zero gradients."""
    import mcore_cpu
    import mcore_memory
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module, MegatronModule

    mcore_cpu.init_single_process()
    fields = {k: v for k, v in SPEC.items() if k != "vocab_size"}
    gpt = mcore_cpu.build_gpt(dict(fields, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16),
                              vocab_size=256, max_seq_len=16)
    cls, config = _hf_tower("qwen2_5_vl", QWEN25)

    class VLM(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=gpt.config)
            self.visual = cls._from_config(config)
            self.language_model = gpt

    vlm = VLM()
    for p in list(vlm.visual.blocks.parameters()) + list(vlm.visual.patch_embed.parameters()):
        p.requires_grad_(model_trains)
    names = [(n, p.numel()) for n, p in vlm.named_parameters()]
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=bucket_size is not None,
                                               use_distributed_optimizer=distributed_optimizer, bucket_size=bucket_size)
    ddp = DistributedDataParallel(config=gpt.config, module=Float16Module(gpt.config, vlm), ddp_config=ddp_config)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                                 use_distributed_optimizer=distributed_optimizer, clip_grad=1.0)
    with mcore_memory.on_cpu():
        optimizer = get_megatron_optimizer(opt_config, [ddp])
        optimizer.step()
    return names, mcore_memory.state_bytes([ddp], optimizer)


@pytest.mark.parametrize("distributed_optimizer, model_trains, bucket_size",
                         [(True, True, None), (True, False, 20000), (False, True, 20000)],
                         ids=["distributed optimizer", "frozen blocks, 2 buckets", "DDP, 3 buckets"])
def test_states_match_megatron_core(distributed_optimizer, model_trains, bucket_size):
    pytest.importorskip("megatron.core")
    names, measured = _megatron_vlm_states(distributed_optimizer, model_trains, bucket_size)
    spec, options, _, _ = _report_setup()
    par = Parallelism(distributed_optimizer=distributed_optimizer)
    training = Training(seq_length=16, micro_batch_size=2, bucket_size=bucket_size)
    tower = vision_memory(_tower("qwen2_5_vl"), None, act_bytes=2, attention="eager", model_trains=model_trains)
    ours = rank_memory(spec, options, par, training, pp_rank=0, vision=tower)
    from megatron_flops.memory.decoder import chunk_parameters

    listed = tower.params + chunk_parameters(spec, options, par, pp_rank=0, chunk=0, seq_length=16)
    assert [(p.name, p.numel) for p in listed] == [(n.removeprefix("language_model."), k) for n, k in names]
    assert ours.states == measured


def _tp_finalize_worker(rank: int, world_size: int) -> dict:
    """TP 2: the tower's gradients as ``finalize_model_grads`` reduces them (Megatron-Bridge marks
    every tower parameter ``average_gradients_across_tp_domain``), trained and with frozen blocks."""
    import mcore_dist

    mcore_dist.init_worker(tp=2)
    return {trains: _tp_finalize(trains) for trains in (True, False)}


def _tp_finalize(model_trains: bool) -> dict:
    import mcore_dist
    import mcore_memory
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.module import MegatronModule

    (gpt,), config = mcore_dist.build_model_chunks({k: v for k, v in SPEC.items() if k != "vocab_size"}, 256, 16)
    cls, hf_config = _hf_tower("qwen2_5_vl", QWEN25)

    class VLM(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.visual = cls._from_config(hf_config)
            self.language_model = gpt

    vlm = VLM()
    for p in vlm.visual.parameters():
        p.average_gradients_across_tp_domain = True
    for p in list(vlm.visual.blocks.parameters()) + list(vlm.visual.patch_embed.parameters()):
        p.requires_grad_(model_trains)
    ddp = DistributedDataParallel(config=config, module=vlm,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    meter = mcore_memory.CommMeter(mcore_memory.megatron_groups())
    with meter, mcore_memory.on_cpu():
        finalize_model_grads([ddp])
    return dict(meter.bytes)


@pytest.mark.dist
def test_tp_all_reduce_of_the_tower_gradients():
    pytest.importorskip("megatron.core")
    import mcore_dist

    measured = mcore_dist.run_distributed(_tp_finalize_worker, 2, timeout=600)
    for model_trains, numel in ((True, 47480), (False, 19640)):  # frozen blocks: the merger's 19,640
        tower = vision_memory(_tower("qwen2_5_vl"), None, act_bytes=4, attention="eager",
                              model_trains=model_trains)
        assert tower.communication(2, 4, True) == {"tp/all_reduce": 4 * numel}  # fp32 gradients
        assert [m[model_trains] for m in measured] == [tower.communication(2, 4, True)] * 2


def test_placeholder_mask_is_one_byte_per_token():
    import mcore_memory

    # Megatron-Bridge: inputs_embeds [b, s, h].masked_scatter(mask [b, s, 1] bool, image_embeds).
    b, s, h = 2, 8, 16
    ids = torch.zeros(b, s, dtype=torch.long)
    ids[0, :3] = 7
    mask = (ids == 7).unsqueeze(-1)
    embeds = torch.randn(b, s, h, requires_grad=True)
    meter = mcore_memory.SavedTensorMeter([])
    with meter.tracking(), meter.one_forward():
        embeds.masked_scatter(mask, torch.randn(3, h, requires_grad=True))
    tower = vision_memory(_tower("qwen2_5_vl"), [[1, 4, 4], [2, 4, 4]], act_bytes=4, attention="eager", tokens=b * s)
    assert meter.forward == [b * s]
    assert tower.activations["vit/placeholder_mask"] == 2 * b * s  # an image and a video: two masks
    frozen = vision_memory(_tower("qwen2_5_vl"), [[1, 4, 4]], act_bytes=4, attention="eager", tokens=b * s,
                           model_trains=False, projection_trains=False, embedding_trains=False)
    assert frozen.activations == {}


def test_qwen3_towers_are_labelled():
    # Their activations are the Hugging Face module's (measured above); Bridge's megatron-core tower is labelled.
    for family, name in (("qwen3_vl", "Qwen3-VL"), ("qwen3_omni_moe", "Qwen3-Omni")):
        tower = vision_memory(_tower(family), [[1, 4, 4]], act_bytes=2, attention="sdpa")
        assert tower.needs_input == () and set(tower.activations) >= {"vit/pos_embed", "vit/deepstack_merger"}
        assert f"the {name} vision tower as the Hugging Face module" in tower.unmeasured[0]
    assert vision_memory(_tower("qwen3_vl"), None, act_bytes=2, attention="sdpa").needs_input == (GRIDS_NEEDED,)
    flash = vision_memory(_tower("qwen2_5_vl"), [[1, 4, 4]], act_bytes=2, attention="flash_attention_2", cp=2,
                          tokens=32)
    assert any("flash_attention_2" in u for u in flash.unmeasured) and any("context" in u for u in flash.unmeasured)
    assert any("placeholder_mask" in a for a in flash.assumptions)
    sdpa = vision_memory(_tower("qwen2_5_vl"), [[1, 4, 4]], act_bytes=2, attention="sdpa")
    assert sdpa.unmeasured == () and any("CPU kernel" in a for a in sdpa.assumptions)


def test_cli_vision_flags_need_a_vlm(capsys):
    from megatron_flops.cli import main

    argv = ["memory", "--model", "examples/llama3_8b.json", "--seq-length", "128", "--grid-thw", "[[1, 4, 4]]"]
    assert main(argv) == 2
    assert "vision_config" in capsys.readouterr().err
    vlm = ["memory", "--model", "examples/qwen2_5_vl_7b_config.json", "--seq-length", "128", "--grid-thw", "[[1, 3, 4]]"]
    assert main(vlm) == 2
    assert "multiples of spatial_merge_size=2" in capsys.readouterr().err


def test_docs_vlm_example(capsys, monkeypatch):
    import shlex
    from pathlib import Path

    from megatron_flops.cli import main

    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    block = (root / "docs" / "memory.md").read_text().split("```text\n$ megatron-flops memory ")[1].split("\n```")[0]
    command, *shown = block.splitlines()
    assert main(["memory", *shlex.split(command)]) == 0
    printed = iter(capsys.readouterr().out.splitlines())
    for line in (s for s in shown if s != "..."):
        assert line in printed, line


def test_docs_vlm_tower_per_image(capsys, monkeypatch):
    # docs/memory.md: "One 896 x 896 image ... costs the trained tower X GB": the vit/ rows of one
    # micro-batch of the documented command without --freeze-vision-model (bf16, sdpa); with it, the
    # merger's (and the placeholder mask's) only.
    import re
    import shlex
    from pathlib import Path

    from megatron_flops.cli import main

    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    text = (root / "docs" / "memory.md").read_text()
    shown = float(re.search(r"One 896 x 896 image \(4,096 patches\) costs the trained tower ([\d.]+) GB", text)[1])
    command = text.split("```text\n$ megatron-flops memory ")[1].split("\n")[0]
    argv = ["memory", *shlex.split(command), "--json"]

    def tower_rows(args: list) -> dict:
        assert main(args) == 0
        report = json.loads(capsys.readouterr().out)
        report = report if "per_gpu" in report else next(iter(report.values()))
        return {k: v for k, v in report["per_gpu"]["activations_per_microbatch"][0].items() if k.startswith("vit/")}

    trained = tower_rows([a for a in argv if a != "--freeze-vision-model"])
    assert round(sum(trained.values()) / 1e9, 1) == shown == 8.7
    assert set(tower_rows(argv)) == {"vit/merger", "vit/placeholder_mask"}


IMAGE_TOKEN = 255


def vlm_module(gpt, grids: list, tower_fields: dict, image_token: int = IMAGE_TOKEN):
    """A GPT behind the Hugging Face Qwen2.5-VL tower (``tower_fields``, eager attention) in one
    ``MegatronModule``, ``visual`` registered first, each forward as Megatron-Bridge's
    ``Qwen25VLModel.forward`` runs it over one micro-batch of ``grids``: word embeddings, ``[b, s, h]``,
    the tower, ``masked_scatter`` of its output at the image tokens, the decoder from ``decoder_input``."""
    from megatron.core.transformer.module import MegatronModule

    cls, config = _hf_tower("qwen2_5_vl", tower_fields)
    config._attn_implementation = "eager"

    class VLM(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=gpt.config)
            self.visual = cls._from_config(config)
            self.language_model = gpt
            self.model_type = gpt.model_type

        def set_input_tensor(self, tensor) -> None:
            self.language_model.set_input_tensor(tensor)

        def forward(self, input_ids, position_ids, attention_mask, labels=None, loss_mask=None):
            grid = torch.tensor(grids)
            pixels = torch.randn(int(grid.prod(dim=1).sum()), 24)
            embeds = self.language_model.embedding(input_ids=input_ids, position_ids=None).transpose(1, 0).contiguous()
            image = self.visual(pixels, grid_thw=grid).pooler_output
            embeds = embeds.masked_scatter((input_ids == image_token).unsqueeze(-1), image).transpose(1, 0)
            return self.language_model(None, position_ids, attention_mask, decoder_input=embeds, labels=labels,
                                       loss_mask=loss_mask)

    return VLM()


def vlm_batches(grids: list, num_microbatches: int, micro_batch_size: int, seq_length: int, seed: int = 0,
                image_token: int = IMAGE_TOKEN):
    """mcore_memory.batches (tokens below ``image_token``) with the first row's leading tokens the
    image tokens of ``grids``."""
    import mcore_memory

    for batch in mcore_memory.batches(num_microbatches, micro_batch_size, seq_length, image_token, seed=seed):
        batch["input_ids"][0, :sum(t * h * w // 4 for t, h, w in grids)] = image_token
        yield batch


def _vlm_schedule(grids: list, num_microbatches: int):
    """Megatron-core's no-pipelining schedule over :func:`vlm_module` (fp32, local spec). Returns
    the bytes each forward saves and the peak held."""
    import mcore_cpu
    import mcore_dist
    import mcore_memory

    mcore_cpu.init_single_process()
    torch.manual_seed(0)
    gpt = mcore_cpu.build_gpt({k: v for k, v in SPEC.items() if k != "vocab_size"}, vocab_size=256, max_seq_len=16)
    vlm = vlm_module(gpt, grids, dict(QWEN25, out_hidden_size=64))
    meter = mcore_memory.SavedTensorMeter(vlm.parameters())
    with meter.tracking():
        mcore_dist.run_schedule([vlm], num_microbatches=num_microbatches, micro_batch_size=2, seq_length=16,
                                vocab_size=256, forward_step_func=mcore_memory.metered_forward_step(meter, [vlm]),
                                data_iterators=[vlm_batches(grids, num_microbatches, 2, 16)], count_flops=False)
    return meter.forward, meter.peak


def test_vlm_forward_saves_decoder_plus_tower():
    pytest.importorskip("megatron.core")
    grids = [[1, 4, 4], [1, 4, 8]]  # 4 + 8 image tokens in the first of 2 rows of 16
    forwards, peak = _vlm_schedule(grids, num_microbatches=2)
    spec, options, par, _ = _report_setup()
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2, params_dtype="fp32")
    tower = vision_memory(_tower("qwen2_5_vl", dict(QWEN25, out_hidden_size=64)), grids, act_bytes=4,
                          attention="eager", tokens=2 * 16)
    ours = rank_memory(spec, options, par, training, pp_rank=0, vision=tower)
    plain = rank_memory(spec, options, par, training, pp_rank=0)
    assert ours.activations_per_microbatch is not None and plain.activations is not None
    per_mb = sum(ours.activations_per_microbatch[0].values())
    assert per_mb - plain.activations == sum(tower.activations.values())  # one micro-batch in flight
    assert forwards == [per_mb] * 2 and peak == ours.activations


def test_attention_from_the_model_file():
    from megatron_flops.memory.vision import default_attention

    assert default_attention({"model_type": "qwen2_5_vl", "vision_config": QWEN25}) == "sdpa"  # transformers' default
    assert default_attention({"model_type": "qwen2_5_vl", "vision_config": dict(QWEN25, _attn_implementation="eager"),
                              "attn_implementation": "sdpa"}) == "eager"
    with pytest.raises(ValueError, match="flex_attention"):
        default_attention({"model_type": "qwen2_5_vl", "vision_config": QWEN25,
                           "attn_implementation": "flex_attention"})
