"""Uneven pipeline splits (memory/pipeline_split.py): every virtual stage's layers against
megatron-core 0.16.1's own ``get_num_layers_to_build`` and ``get_transformer_layer_offset``, and
each stage of an uneven split's memory report equal to the same stage of an even split with as many
layers there (the even PP layouts are measured on gloo: tests/test_memory_dist.py)."""

from __future__ import annotations

import io
import itertools
import json
from contextlib import redirect_stdout

import pytest

from megatron_flops.memory.pipeline_split import uneven_stage_layers

# (num_layers, PP, VPP, first, last, embedding, loss): each way megatron-core splits unevenly.
SPLITS = [
    (6, 2, None, 2, None, False, False), (6, 2, None, None, 1, False, False), (10, 4, None, 1, 3, False, False),
    (14, 3, 2, 2, None, False, False), (14, 4, 2, 2, 4, False, False), (7, 2, None, None, None, True, False),
    (6, 2, None, None, None, True, True), (14, 4, 2, None, None, True, True),
]


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_stage_layers_are_megatron_cores(split):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers, pp, vpp, first, last, embedding, loss = split
    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                               account_for_embedding_in_pipeline_split=embedding,
                               account_for_loss_in_pipeline_split=loss, pipeline_dtype=torch.float32)
    stages = uneven_stage_layers(num_layers, pp, vpp, first=first, last=last, embedding=embedding, loss=loss)
    for v, r in itertools.product(range(vpp or 1), range(pp)):
        stage = v * pp + r
        vp = v if vpp else None
        assert stages[stage] == get_num_layers_to_build(config, vp_stage=vp, pp_rank=r)
        if stages[stage]:  # (megatron-core's offset of an empty stage is not a layer index)
            assert sum(stages[:stage]) == get_transformer_layer_offset(config, vp_stage=vp, pp_rank=r)


def test_megatron_cores_refusals_are_refused():
    with pytest.raises(ValueError, match="do not divide"):
        uneven_stage_layers(7, 4, None, first=2)  # 5 layers over 3 middle stages
    with pytest.raises(ValueError, match="does not support"):
        uneven_stage_layers(8, 2, None, first=2, embedding=True)
    with pytest.raises(ValueError, match="not divisible by VPP"):
        uneven_stage_layers(8, 2, 2, first=3)
    with pytest.raises(ValueError, match="larger than 0"):
        uneven_stage_layers(8, 2, None, first=0)


def _memory(tmp_path, fields: dict, *flags: str) -> dict:
    from megatron_flops.cli import main

    path = tmp_path / "model.json"
    path.write_text(json.dumps(fields))
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["memory", "--model", str(path), "--seq-length", "16", "--num-microbatches", "4",
                     "--pp", "2", *flags, "--json"]) == 0
    return json.loads(out.getvalue())


BASE = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100)
KEYS = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "total_bytes",
        "forward_passes_in_flight", "activations_per_microbatch")


@pytest.mark.parametrize("flags", [(), ("--tp", "2", "--sequence-parallel", "--dp", "2", "--distributed-optimizer")],
                         ids=["1 x PP2", "TP2 SP x PP2 x DP2 distopt"])
@pytest.mark.parametrize("uneven, even", [
    # 6 layers as 2 + 4: stage 0 as a 4-layer model's (2 + 2), stage 1 as an 8-layer model's (4 + 4).
    (dict(num_layers=6, num_layers_in_first_pipeline_stage=2), (4, 8)),
    # 7 layers and the embedding as 3 + 4: stage 0 as a 6-layer model's, stage 1 as an 8-layer model's.
    (dict(num_layers=7, account_for_embedding_in_pipeline_split=True), (6, 8)),
], ids=["first stage 2 of 6", "embedding in the split of 7"])
def test_each_stage_is_an_even_splits_stage(tmp_path, uneven, even, flags):
    report = _memory(tmp_path, {**BASE, **uneven}, *flags)
    for rank, num_layers in enumerate(even):
        stage = _memory(tmp_path, {**BASE, "num_layers": num_layers}, *flags)["per_stage"][rank]
        assert {k: report["per_stage"][rank][k] for k in KEYS} == {k: stage[k] for k in KEYS}
        assert report["communication_per_stage"][rank] == _memory(
            tmp_path, {**BASE, "num_layers": num_layers}, *flags)["communication_per_stage"][rank]
