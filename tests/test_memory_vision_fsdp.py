"""A VLM under torch FSDP2 as Megatron-LM's ``--use-torch-fsdp2`` (megatron-core's
``TorchFullyShardedDataParallel``) wraps Megatron-Bridge's ``Qwen25VLModel``: the Hugging Face
Qwen2.5-VL tower (``visual``, registered first) before a megatron-core GPT, bf16
(``Float16Module``), one real step of megatron-core's schedule in 2 gloo processes, each forward
as Bridge's (tests/test_memory_vision.py::vlm_module). Checked against
:func:`megatron_flops.memory.decoder_fsdp.fsdp_decoder_rank` on every rank: which modules are
``fully_shard`` units (the tower has no ``TransformerLayer``: it joins the root), the parameter and
gradient shards, the optimizer's main copies and Adam moments, the all-gather/reduce-scatter
payloads, and the whole (unsharded) weights and gradients alive at once on CPU."""

from __future__ import annotations

import math

import pytest

import mcore_cpu
import mcore_dist
import test_memory_decoder_fsdp as fsdp_test
import test_memory_vision as vision_test
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.decoder_fsdp import fsdp_decoder_rank, fsdp_units, real_rows
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.vision import vision_parameters
from megatron_flops.model.spec import ModelSpec

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

WORLD, SEQ, MBS, M = 2, 16, 2, 2
VOCAB = fsdp_test.VOCAB
IMAGE = VOCAB - 1
GRIDS = [[1, 4, 4], [1, 4, 8]]  # 4 + 8 image tokens in the first of 2 rows of 16
DECODER = dict(fsdp_test.BASE, add_bias_linear=False, normalization="RMSNorm")
# An odd MLP width (45 rows: 23 and 22 per rank) and the merger out to the decoder's width.
TOWER = dict(vision_test.QWEN25, intermediate_size=45, out_hidden_size=DECODER["hidden_size"])
FREEZE = {"trained": True, "frozen blocks": False}
TRAINING = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=M, params_dtype="bf16")


def _worker(rank: int, world_size: int) -> dict:
    import torch

    import mcore_memory

    mcore_dist.init_worker()
    out = {}
    for freeze, model_trains in FREEZE.items():
        mcore_memory.reinit_parallel()
        torch.manual_seed(0)

        def wrap(gpt):
            vlm = vision_test.vlm_module(gpt, GRIDS, TOWER, image_token=IMAGE)
            for p in list(vlm.visual.blocks.parameters()) + list(vlm.visual.patch_embed.parameters()):
                p.requires_grad_(model_trains)
            return vlm

        model, optimizer = fsdp_test._fsdp_training(DECODER, params_dtype="bf16", wrap=wrap)
        from torch.distributed.fsdp import FSDPModule

        units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
        comm = mcore_memory.CommMeter(mcore_memory.megatron_groups())
        live = mcore_memory.WholeCopiesMeter(model)
        with comm, live:
            mcore_dist.run_schedule(
                [model], num_microbatches=M, micro_batch_size=MBS, seq_length=SEQ, vocab_size=VOCAB,
                data_iterators=[vision_test.vlm_batches(GRIDS, M, MBS, SEQ, seed=rank, image_token=IMAGE)],
                count_flops=False,
                forward_step_func=mcore_memory.metered_forward_step(mcore_memory.SavedTensorMeter([]), [model]))
        states = fsdp_test._states(model, optimizer)
        with mcore_memory.on_cpu():
            optimizer.step()
        states.update(fsdp_test._optimizer_states(optimizer))
        out[freeze] = dict(
            units=units, states=states, comm=dict(comm.bytes), live=live.peak, parts=live.parts,
            names=[(n, tuple(fsdp_test._local(p).shape), tuple(p.shape)) for n, p in model.named_parameters()])
        del model, optimizer
    return out


@pytest.fixture(scope="module")
def measured():
    results = mcore_dist.run_distributed(_worker, WORLD, timeout=600)
    return {freeze: [r[freeze] for r in results] for freeze in FREEZE}


def _params(model_trains: bool):
    spec = ModelSpec.from_mapping(dict(DECODER, vocab_size=VOCAB, share_embeddings_and_output_weights=False))
    options = DecoderOptions.from_mapping(dict(DECODER, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope"))
    tower = vision_test._tower("qwen2_5_vl", TOWER)
    return (vision_parameters(tower, model_trains=model_trains)
            + chunk_parameters(spec, options, Parallelism(dp=WORLD, fsdp=True), pp_rank=0, chunk=0, seq_length=SEQ))


def test_the_tower_joins_the_root_unit(measured):
    # megatron-core's wrapper shards TransformerLayer, LanguageModelEmbedding and RotaryEmbedding (no
    # parameters) units, then the root: the Hugging Face tower holds none of them.
    for results in measured.values():
        assert [r["units"] for r in results] == [["FSDPFloat16Module", "FSDPLanguageModelEmbedding",
                                                  "FSDPRotaryEmbedding", "FSDPTransformerLayer",
                                                  "FSDPTransformerLayer"]] * WORLD
    root = fsdp_units(_params(True))[-1]
    assert [p.name for p in root][-2:] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert all(p.name.startswith("visual.") for p in root[:-2])


@pytest.mark.parametrize("freeze", list(FREEZE))
def test_shards_states_and_communication_every_rank(measured, freeze):
    params = _params(FREEZE[freeze])
    for rank, result in enumerate(measured[freeze]):
        # (Float16Module and the FSDP wrapper prefix every name with "module."; the VLM the decoder's.)
        got = [(n.replace("module.", "").replace("language_model.", ""), local, whole)
               for n, local, whole in result["names"]]
        want = [(p.name, real_rows(p, WORLD, rank), p.numel) for p in params]
        assert [(n, shape[0] if shape else 0, math.prod(whole)) for n, shape, whole in got] == want
        states, comm = fsdp_decoder_rank(params, TRAINING, dp=WORLD, rank=rank)
        states.pop("fsdp/unsharded_working_copies")  # (below: the CPU's, without overlap)
        assert states == result["states"], rank
        assert comm == result["comm"], rank


def test_whole_copies_by_hand(measured):
    # In elements (whole, padded to 2 x ceil(rows / 2)): the embedding 96 x 48 = 4,608; a layer: norms
    # 2 x 48, linear_proj 48 x 48, linear_qkv 144 x 48, linear_fc1 75 x 48 (padded: 76 x 48), linear_fc2
    # 48 x 75 = 16,512 (16,560); the root: the tower 49,694 (each block's gate_proj and up_proj of 45 rows
    # padded to 46: 49,892), the final norm 48 and the output layer 96 x 48 = 4,608: 54,350 (54,548). bf16.
    # On CPU each collective runs to completion: the root's weights are gathered all step. Trained: the
    # peak is the embedding's backward, last, beside all the root's (unpadded) gradients:
    # 2 x (54,548 + 54,350 + 4,608 + 4,608) = 236,228. Frozen blocks: layer 1's backward, first, beside
    # the root's output layer and final norm gradients: 2 x (54,548 + 4,656 + 16,560 + 16,512) = 184,552.
    assert [r["live"] for r in measured["trained"]] == [236_228] * WORLD
    assert [r["live"] for r in measured["frozen blocks"]] == [184_552] * WORLD
    # GPU (a formula: the next unit prefetched, gradients as their padded reduce-scatter input): the root
    # gathered + max(its head's gradients + two layers gathered + one layer's gradients, all its
    # gradients + the embedding's weights and gradients) = 2 x (54,548 + max(4,656 + 3 x 16,560,
    # 54,548 + 2 x 4,608)) = 236,624; frozen blocks: the tower's gradients are the merger's 22,736:
    # 2 x (54,548 + max(4,656 + 3 x 16,560, 4,656 + 22,736 + 2 x 4,608)) = 217,768.
    for freeze, want in (("trained", 236_624), ("frozen blocks", 217_768)):
        states, _ = fsdp_decoder_rank(_params(FREEZE[freeze]), TRAINING, dp=WORLD)
        assert states["fsdp/unsharded_working_copies"] == want


def test_cli_vlm_under_fsdp(capsys):
    import json

    from megatron_flops.cli import main

    base = ["memory", "--model", "examples/qwen2_5_vl_7b_config.json", "--seq-length", "4096", "--json",
            "--grid-thw", "[[1, 64, 64]]"]
    assert main([*base, "--dp", "2", "--fsdp"]) == 0
    fsdp = json.loads(capsys.readouterr().out)
    assert main([*base, "--dp", "2"]) == 0
    ddp = json.loads(capsys.readouterr().out)
    assert fsdp["parameters"] == ddp["parameters"] and fsdp["not_modelled"] == []
    gpu = fsdp["per_gpu"]
    # The tower's activations as without FSDP; its 676,550,144 parameters (bf16) sharded with the rest.
    assert gpu["activations_bytes"] == ddp["per_gpu"]["activations_bytes"]
    assert gpu["components"]["weights"] < ddp["per_gpu"]["components"]["weights"] / 2 + 2 * 10**6
    assert set(fsdp["communication_per_step"]) >= {"dp/all_gather", "dp/reduce_scatter"}
