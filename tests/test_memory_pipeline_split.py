"""Uneven pipeline splits (first/last stage layers, the embedding and loss counted as layers, a
layout string): every virtual stage's decoder layers against megatron-core 0.16.1's own
``get_num_layers_to_build`` / ``get_transformer_layer_offset`` and ``PipelineParallelLayerLayout``
(its parallel state mocked: one process, any pp_rank and vp_stage), the refusals against
``TransformerConfig``'s, and the CLI reading the split from flags, ``--megatron-args`` and model
files. The bytes of an uneven PP2 step are measured in tests/test_memory_pipeline_split_dist.py."""

from __future__ import annotations

import json

import pytest

import mcore_cpu
from megatron_flops.cli import main
from megatron_flops.memory.layout import Parallelism
from megatron_flops.flops.pipeline_split import PipelineSplit, parse_layout, split_stages
from megatron_flops.memory.pipeline_split import uneven_stages
from megatron_flops.model.spec import ModelSpec

needs_mcore = pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)

FIRST, LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
EMB, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
LAYOUT = "pipeline_model_parallel_layout"
# (num_layers, PP, VPP, MTP layers, split fields) -> decoder layers per virtual stage (v x PP + r).
CASES = [
    # first only: 2, then 6 - 2 = 4 on the one other rank.
    ((6, 2, None, 0, {FIRST: 2}), (2, 4)),
    # last only: (6 - 2) / 1 = 4 on rank 0.
    ((6, 2, None, 0, {LAST: 2}), (4, 2)),
    # DeepSeek-V3's 61 layers: 13 + 2 x 16 + 16; 5 + 6 x 8 + 8; 3 + 14 x 4 + 2.
    ((61, 4, None, 0, {FIRST: 13, LAST: 16}), (13, 16, 16, 16)),
    ((61, 8, None, 0, {FIRST: 5, LAST: 8}), (5,) + (8,) * 7),
    ((61, 16, None, 0, {FIRST: 3, LAST: 2}), (3,) + (4,) * 14 + (2,)),
    # VPP 2: rank 0 holds 2 (1 per chunk), rank 1 the other 6 (3 per chunk).
    ((8, 2, 2, 0, {FIRST: 2}), (1, 3, 1, 3)),
    # PP 3 x VPP 2: 2 | (10 - 2 - 4) / 1 = 4 | 4, halved per chunk.
    ((10, 3, 2, 0, {FIRST: 2, LAST: 4}), (1, 2, 2, 1, 2, 2)),
    # the embedding as a layer: (7 + 1) / 4 = 2 per rank, rank 0 builds 2 - 1.
    ((7, 4, None, 0, {EMB: True}), (1, 2, 2, 2)),
    # embedding and loss: (6 + 2) / 4 = 2 per rank, the first and last build one fewer.
    ((6, 4, None, 0, {EMB: True, LOSS: True}), (1, 2, 2, 1)),
    # ... under VPP 2: (6 + 2) / 2 / 2 = 2 per chunk; chunk 0 of rank 0 and chunk 1 of rank 1 build 1.
    ((6, 2, 2, 0, {EMB: True, LOSS: True}), (1, 2, 2, 1)),
    ((5, 2, None, 0, {LOSS: True}), (3, 2)),
    # a layout: 4 stages over PP 2 make VPP 2; MTP with the loss.
    ((5, 2, None, 1, {LAYOUT: "Et|tt|t|tmL"}), (1, 2, 1, 1)),
    ((9, 2, None, 0, {LAYOUT: "Et*3|(tt|)*2,ttL"}), (3, 2, 2, 2)),
    ((4, 2, None, 0, {LAYOUT: "Ett|ttL"}), (2, 2)),
    # an embedding-only first stage and a loss-only last one.
    ((4, 4, None, 0, {LAYOUT: "E|tt|tt|L"}), (0, 2, 2, 0)),
    # empty stages before E or after L (validate_layer_layout reads the flattened layout only):
    # the same decoder counts; megatron-core builds the embedding and loss on the edge stages anyway.
    ((4, 3, None, 0, {LAYOUT: "|Ett|ttL"}), (0, 2, 2)),
    ((4, 3, None, 0, {LAYOUT: "Ett|ttL|"}), (2, 2, 0)),
    ((4, 2, None, 0, {LAYOUT: "|Ett|ttL|"}), (0, 2, 2, 0)),
    ((4, 3, None, 1, {LAYOUT: "Ett|ttmL|"}), (2, 2, 0)),
]
# Splits megatron-core refuses (num_layers, PP, VPP, MTP, fields).
REFUSED = [
    (7, 2, None, 0, {FIRST: 2, EMB: True}),  # first/last with account-for
    (7, 3, None, 0, {FIRST: 2}),  # 5 middle layers on 2 middle ranks
    (6, 2, 2, 0, {FIRST: 3}),  # 3 first-stage layers over VPP 2
    (6, 2, None, 0, {FIRST: 2, LAST: 2}),  # 2 middle layers, no middle rank
    (6, 4, None, 0, {EMB: True}),  # 7 over PP 4
    (6, 2, 2, 0, {EMB: True}),  # 7 over PP 2
    (4, 2, None, 0, {LAYOUT: "tE|tL"}),  # embedding not first
    (4, 2, None, 0, {LAYOUT: "Et|tL"}),  # 2 decoder layers, not 4
    (4, 2, None, 0, {LAYOUT: "Ett|ttL", FIRST: 2}),  # layout with another split field
    (4, 2, None, 1, {LAYOUT: "Ettm|ttL"}),  # MTP before decoder layers
    (4, 3, None, 0, {LAYOUT: "Ett|ttL"}),  # 2 stages over PP 3
    (4, 2, None, 1, {LAYOUT: "Ett|ttm|L|"}),  # MTP in rank 1's first model chunk, not its last
    (4, 2, None, 2, {LAYOUT: "Ett|tt|m|mL"}),  # MTP layers on two stages
]


def _ours(case: tuple) -> tuple[int, ...]:
    num_layers, pp, vpp, mtp, fields = case
    stages, _ = split_stages(PipelineSplit.from_mapping(fields), num_layers=num_layers, pp=pp, vpp=vpp,
                             mtp_num_layers=mtp)
    return stages


def _megatron(case: tuple, monkeypatch) -> list[tuple[int, int]]:
    """(layers, offset) per virtual stage in the order v x PP + r, from megatron-core 0.16.1."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers, pp, vpp, mtp, fields = case
    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               pipeline_dtype=torch.float32, mtp_num_layers=mtp or None, **fields)
    vpp = config.virtual_pipeline_model_parallel_size  # (a layout sets it)
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
    out = []
    for v in range(vpp or 1):
        for r in range(pp):
            vp_stage = v if vpp else None
            monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda r=r: r)
            if config.pipeline_model_parallel_layout is not None:
                layout = config.pipeline_model_parallel_layout
                out.append((layout.get_num_layers_to_build(LayerType.decoder, vp_stage=vp_stage, pp_rank=r),
                            layout.get_layer_offset(LayerType.decoder, vp_stage=vp_stage, pp_rank=r)))
            else:
                out.append((get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=r),
                            get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=r)))
    return out


@needs_mcore
@pytest.mark.parametrize("case,want", CASES, ids=[str(c[0][:3] + (c[0][4],)) for c in CASES])
def test_stage_layers_as_megatron_core_builds_them(case, want, monkeypatch):
    ours = _ours(case)
    assert ours == want
    # megatron-core's count per (pp_rank, vp_stage), and each stage starts where the one before ends.
    offsets = [sum(ours[:i]) for i in range(len(ours))]
    assert _megatron(case, monkeypatch) == list(zip(ours, offsets))


@needs_mcore
@pytest.mark.parametrize("case", REFUSED, ids=[str(c[:3] + (c[4],)) for c in REFUSED])
def test_refused_where_megatron_core_refuses(case, monkeypatch):
    with pytest.raises((ValueError, AssertionError)):
        _megatron(case, monkeypatch)
    with pytest.raises(ValueError):
        _ours(case)


def test_layout_string_grammar():
    # "(tt|)*2" unrolls to "tt|tt|", "t*3" to "ttt"; commas are cosmetic.
    assert parse_layout("Et*3|(tt|)*2,mL") == [["embedding"] + ["decoder"] * 3, ["decoder"] * 2, ["decoder"] * 2,
                                                 ["mtp", "loss"]]
    with pytest.raises(ValueError, match="invalid layer character 'x'"):
        parse_layout("Ex|tL")


@needs_mcore
@pytest.mark.parametrize("layout", ["Et|t|t|mL", "Et|tt|t|tmL", "Ett|ttmL", "E|tt|tt|mL", "|Ett|ttmL|", "Ett|t|mL|"])
@pytest.mark.parametrize("mtp", [0, 1])
def test_final_norm_stage_is_megatron_cores(layout, mtp, monkeypatch):
    # megatron-core 0.16.1's TransformerBlock.has_final_layernorm_in_this_stage on each virtual stage's layers
    # (numbered from its layout's offsets): with MTP layers the stage of the last decoder layer, else the last.
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_block import TransformerBlock

    if not mtp:
        layout = layout.replace("m", "")
    num_layers = layout.count("t")
    case = (num_layers, 2, None, mtp, {LAYOUT: layout})
    stages = _megatron(case, monkeypatch)
    par = uneven_stages(PipelineSplit(pipeline_model_parallel_layout=layout), Parallelism(pp=2),
                        spec=ModelSpec.from_mapping(dict(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                                         vocab_size=128, mtp_num_layers=mtp or None)))
    for stage, (count, offset) in enumerate(stages):
        block = SimpleNamespace(
            config=SimpleNamespace(mtp_num_layers=mtp or None, num_layers=num_layers),
            layers=[SimpleNamespace(layer_number=offset + i + 1) for i in range(count)],
            submodules=SimpleNamespace(layer_norm=True), post_layer_norm=True, post_process=stage == len(stages) - 1)
        want = bool(TransformerBlock.has_final_layernorm_in_this_stage(block))
        assert par.holds_final_norm(num_layers, stage % 2, stage // 2, mtp=bool(mtp)) == want, stage


@needs_mcore
@pytest.mark.parametrize("layout, pp, stage", [("Ett|m|L", 3, 1), ("Et|tm|L", 3, 1), ("Etttm|L", 2, 0),
                                               ("Ett|tt|m|L", 2, 2), ("Et|t|m|L", 2, 2), ("Ett|m||L", 4, 1),
                                               ("Et|t|t|mL", 2, None), ("Ett|mL", 2, None), ("Ett|ttmL|", 3, 1),
                                               ("|Ett|tmL", 3, None), ("|Ett|ttmL|", 2, 2)])
def test_standalone_mtp_stage_where_megatron_sets_mtp_standalone(layout, pp, stage):
    # megatron-core 0.16.1's validate_layer_layout returns mtp_standalone: MTP in the last model chunk of a
    # pipeline rank other than the last; the reports place the MTP layers (and an embedding copy) on that
    # virtual stage, the loss on the last.
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    num_layers = layout.count("t")
    standalone = PipelineParallelLayerLayout(layout, pp).validate_layer_layout(num_layers=num_layers, mtp_num_layers=1)
    spec = ModelSpec.from_mapping(dict(num_layers=num_layers, hidden_size=64, num_attention_heads=4, vocab_size=128,
                                       mtp_num_layers=1))
    par = uneven_stages(PipelineSplit(pipeline_model_parallel_layout=layout), Parallelism(pp=pp), spec=spec)
    assert (par.mtp_stage is not None) == standalone
    assert par.mtp_stage == stage
    where = pp * par.num_chunks - 1 if stage is None else stage  # (virtual stage v x PP + r)
    assert [(r, c) for c in range(par.num_chunks) for r in range(pp) if par.holds_mtp(r, c)] == [(where % pp,
                                                                                              where // pp)]


def test_layout_makes_the_vpp_and_sets_stage_layers():
    spec = ModelSpec.from_mapping(dict(num_layers=5, hidden_size=64, num_attention_heads=4, vocab_size=128))
    par = uneven_stages(PipelineSplit(pipeline_model_parallel_layout="Et|tt|t|tL"), Parallelism(pp=2), spec=spec)
    assert (par.vpp, par.stage_layers) == (2, (1, 2, 1, 1))
    # chunk 1 of rank 0 is virtual stage 2: layer 3 (after 1 + 2).
    assert par.chunk_layers(5, 0, 1) == range(3, 4)
    with pytest.raises(ValueError, match="conflicts"):
        uneven_stages(PipelineSplit(pipeline_model_parallel_layout="Et|tt|t|tL"), Parallelism(pp=2, vpp=3), spec=spec)


TINY = ("--num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--vocab-size 128 --micro-batch-size 1 --global-batch-size 4 --pipeline-model-parallel-size 2")


def _memory(capsys, *argv: str) -> dict:
    assert main(["memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_reads_the_split_from_megatron_args_and_flags(capsys):
    even = _memory(capsys, "--megatron-args", TINY)
    from_args = _memory(capsys, "--megatron-args", TINY + " --decoder-first-pipeline-num-layers 2")
    from_flag = _memory(capsys, "--megatron-args", TINY, "--decoder-first-pipeline-num-layers", "2")
    assert from_args == from_flag
    assert any("[2, 4]" in a for a in from_args["assumptions"])
    # 2 + 4 layers: the first stage loses one layer's weights and the second gains one.
    e0, e1 = (s["weights_bytes"] for s in even["per_stage"])
    u0, u1 = (s["weights_bytes"] for s in from_args["per_stage"])
    assert e0 - u0 == u1 - e1 > 0


def test_cli_reads_the_split_from_a_model_file(tmp_path, capsys):
    fields = dict(num_layers=6, hidden_size=64, num_attention_heads=4, vocab_size=128,
                  num_layers_in_last_pipeline_stage=2)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(fields))
    report = _memory(capsys, "--model", str(path), "--seq-length", "32", "--pp", "2")
    flags = _memory(capsys, "--model", str(path), "--seq-length", "32", "--pp", "2",
                    "--decoder-last-pipeline-num-layers", "2")
    assert report == flags and any("[4, 2]" in a for a in report["assumptions"])


def test_cli_refuses_with_megatron_cores_reason(capsys):
    assert main(["memory", "--megatron-args", TINY, "--decoder-first-pipeline-num-layers", "2",
                 "--account-for-loss-in-pipeline-split"]) == 2
    assert "cannot be set at the same time" in capsys.readouterr().err


def test_block_recompute_over_an_uneven_split(capsys):
    # 2 + 4 layers, block 1: each stage checkpoints its first layer (the report's per-stage
    # activations are measured in tests/test_memory_pipeline_split_dist.py).
    report = _memory(capsys, "--megatron-args", TINY, "--decoder-first-pipeline-num-layers", "2", "--recompute",
                     "full", "--recompute-method", "block", "--recompute-num-layers", "1")
    assert all(s["activations_bytes"] for s in report["per_stage"])


@pytest.mark.parametrize("pp,first,last", [(4, 13, 16), (8, 5, 8), (16, 3, 2)])
def test_deepseek_v3_uneven_stages_reported(pp, first, last, capsys):
    report = _memory(capsys, "--model", "examples/deepseek_v3_hf_config.json", "--seq-length", "4096",
                     "--pp", str(pp), "--ep", "8", "--dp", "8", "--distributed-optimizer", "--num-microbatches", "8",
                     "--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last))
    middle = (61 - first - last) // (pp - 2)
    assert any(str([first] + [middle] * (pp - 2) + [last]) in a for a in report["assumptions"])
    assert report["per_gpu"]["activations_bytes"] is not None


def test_megatron_args_virtual_stage_options_as_megatron_lm_validates_them(capsys):
    # --num-layers-per-virtual-pipeline-stage 2 with the embedding and loss counted: (6 + 2) / 2 = 4
    # per rank, VPP 4 / 2 = 2, then 2 - 1, 2, 2, 2 - 1 layers per virtual stage.
    report = _memory(capsys, "--megatron-args", TINY + " --account-for-embedding-in-pipeline-split "
                     "--account-for-loss-in-pipeline-split --num-layers-per-virtual-pipeline-stage 2")
    assert any("[1, 2, 2, 1]" in a for a in report["assumptions"])
    for extra, reason in (
            (" --decoder-first-pipeline-num-layers 2 --num-layers-per-virtual-pipeline-stage 2", "uneven first/last"),
            (" --pipeline-model-parallel-layout 'Ett|tt|t|tL' --num-virtual-stages-per-pipeline-rank 2",
             "more than one of"),
            (" --num-layers-per-virtual-pipeline-stage 1 --num-virtual-stages-per-pipeline-rank 3", "more than one of"),
            # 6 / PP 2 = 3 layers per rank, not a multiple of 2; 6 + the embedding = 7 over PP 2
            (" --num-layers-per-virtual-pipeline-stage 2", "3 layers per pipeline stage"),
            (" --num-layers-per-virtual-pipeline-stage 1 --account-for-embedding-in-pipeline-split", "refuses 7 layers")):
        assert main(["memory", "--megatron-args", TINY + extra]) == 2
        assert "Megatron-LM refuses " in (err := capsys.readouterr().err) and reason in err


@pytest.mark.parametrize("edge,plain,moved", [("|Ett|ttttL", "E|tt|ttttL", "the embedding on virtual stage 0, not stage 1"),
                                              ("Ett|ttttL|", "Ett|tttt|L", "the output layer and loss on virtual "
                                                                           "stage 2, not stage 1")])
def test_empty_edge_stages_report_as_megatron_core_builds_them(edge, plain, moved, capsys):
    # megatron-core 0.16.1 builds the embedding where pre_process is true (the first virtual stage) and
    # the output layer and loss where post_process is (the last), whatever the layout writes: a layout
    # with empty edge stages reports as the one with E and L on the edges, and says where they are
    # (measured: tests/test_memory_pipeline_split_dist.py's '|Ett|ttL', 'Ett|ttL|' and '|Ett|ttL|').
    args = TINY.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 3")
    ours = _memory(capsys, "--megatron-args", args, "--pipeline-model-parallel-layout", edge)
    theirs = _memory(capsys, "--megatron-args", args, "--pipeline-model-parallel-layout", plain)
    notes = [a for a in ours["assumptions"] if "pipeline stages" in a]
    assert len(notes) == 1 and f"megatron-core builds {moved} where the layout writes" in notes[0]
    assert {k: v for k, v in ours.items() if k != "assumptions"} == {k: v for k, v in theirs.items()
                                                                    if k != "assumptions"}
