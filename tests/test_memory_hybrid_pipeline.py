"""Pipeline and virtual pipeline stages of a hybrid layer pattern (its '|' separators), and the
FLOPs side reading the same pattern.

Measured: every stage's layers against megatron-core 0.19's own ``select_pipeline_segment`` (its
Python 3.12 venv, tests/frameworks/envs.py), which ``HybridModel`` calls to build each model chunk;
the per-layer parameters and saved bytes are those measured elsewhere (tests/test_memory_ssm.py)."""

from __future__ import annotations

import json
import re

import pytest

from megatron_flops.cli import main
from megatron_flops.flops.formulas import estimate, parse_rows
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.hybrid_pipeline import hybrid_stages
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory
from megatron_flops.model.spec import ModelSpec

SMALL = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, normalization="RMSNorm",
             add_bias_linear=False, vocab_size=256, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
OPTIONS = DecoderOptions(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
                         padded_vocab_size=256, attention_backend="unfused")
TRAINING = Training(seq_length=16, micro_batch_size=2, num_microbatches=4, params_dtype="bf16")
# (main pattern, PP): uneven segments, an empty one (a stage of embeddings only), PP = segments.
CASES = [("M*-|M-|*-M|-", 2), ("M*-|M-|*-M|-", 4), ("|M*-M|*-|M-", 2), ("M*-M|*-M*", 2), ("M*-M*-", 2)]


def _spec(pattern: str) -> ModelSpec:
    return ModelSpec.from_mapping(dict(SMALL, hybrid_override_pattern=pattern))


def _stage_layers(pattern: str, pp: int) -> dict[tuple[int, int], str]:
    """(pp_rank, chunk) -> the pattern symbols of that model chunk's layers, as this report places them."""
    spec = _spec(pattern)
    par = hybrid_stages(spec, Parallelism(pp=pp))
    flat = pattern.replace("|", "")
    return {(r, c): "".join(flat[i] for i in par.chunk_layers(spec.num_layers, r, c))
            for r in range(pp) for c in range(par.num_chunks)}


def test_pipe_segments_are_the_virtual_stages():
    spec = _spec("M*-|M-|*-M|-")
    par = hybrid_stages(spec, Parallelism(pp=2))
    # 4 segments over PP 2: VPP 2; segment v x 2 + r on chunk v of rank r.
    assert spec.pipeline_segments == (3, 2, 3, 1) and par.vpp == 2
    assert _stage_layers("M*-|M-|*-M|-", 2) == {(0, 0): "M*-", (1, 0): "M-", (0, 1): "*-M", (1, 1): "-"}
    names = [p.name for p in chunk_parameters(spec, OPTIONS, par, pp_rank=1, chunk=1, seq_length=16)]
    # Rank 1's last chunk: its one MLP layer (local index 0), the final norm and the output layer.
    assert names == ["decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                     "decoder.layers.0.mlp.linear_fc2.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    report = decoder_memory(spec, OPTIONS, Parallelism(pp=2), TRAINING)
    assert any("'|' segments [3, 2, 3, 1]" in a for a in report.assumptions) and not report.not_modelled
    # Interleaved: rank 0 runs more forward passes ahead than under 1F1B.
    assert [r.in_flight for r in report.stages] == [5, 3]


def test_even_pipes_equal_the_even_split():
    # 'M*-|M*-' on PP 2 places the layers as megatron-core's even split of 'M*-M*-' does: the same report.
    piped, plain = (decoder_memory(_spec(p), OPTIONS, Parallelism(pp=2), TRAINING) for p in ("M*-|M*-", "M*-M*-"))
    assert piped.stages == plain.stages and piped.parameters == plain.parameters


def test_flops_read_the_pattern_without_its_pipes():
    # estimate prices layers, not stages: '|' changes nothing (6 layers either way).
    piped, plain = _spec("M*-|M*-"), _spec("M*-M*-")
    assert piped.num_layers == plain.num_layers == 6 and piped.layer_runs == plain.layer_runs
    assert estimate(piped, parse_rows([16])) == estimate(plain, parse_rows([16]))
    assert _spec("|M*-M*-|").num_layers == 6  # empty stages hold no layers


def test_megatron_lm_019_pattern_flag_is_read():
    # Megatron-LM 0.19's --hybrid-layer-pattern (no --num-layers: the pattern gives it) is the same model
    # as 0.16.1's --hybrid-override-pattern with --num-layers; it was read as a GPT before.
    from megatron_flops.model.megatron_args import load_megatron_args, model_spec

    common = ("--hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --mamba-state-dim 16 "
              "--mamba-head-dim 16 --mamba-num-groups 2 --vocab-size 256 ")
    new = model_spec(*load_megatron_args(common + "--hybrid-layer-pattern 'M*-|M*-'"))
    old = model_spec(*load_megatron_args(common + "--num-layers 6 --hybrid-override-pattern 'M*-M*-'"))
    assert new.layer_runs == old.layer_runs and new.pipeline_segments == (3, 3) and new.mamba is not None


@pytest.mark.parametrize("pattern, flags, message", [
    ("M*-|M*-", [], "need --pp > 1"),
    ("M*-|M*-|M-", ["--pp", "2"], "3 '|'-delimited pipeline segments are not divisible by --pp 2"),
    ("M*-|M*-|M-|*", ["--pp", "2", "--vpp", "4"], "make VPP 2 .* not --vpp 4"),
    ("M*-M", ["--pp", "2", "--vpp", "2"], "takes virtual pipeline stages of a hybrid pattern from its '|'"),
])
def test_layouts_megatron_refuses_are_refused(tmp_path, capsys, pattern, flags, message):
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(dict(SMALL, hybrid_override_pattern=pattern)))
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--num-microbatches", "4", *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_prints_the_derived_vpp(tmp_path, capsys):
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(dict(SMALL, hybrid_override_pattern="M*-|M-|*-M|-")))
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--pp", "2", "--num-microbatches", "4"]) == 0
    assert "TP 1 x PP 2 x DP 1, VPP 2" in capsys.readouterr().out


# megatron-core 0.19's own stage selection, with a stand-in pipeline group (rank, size): the
# function reads only the group's rank and size (its log call needs no process group either).
_MCORE_SELECT = r"""
import json, sys
import torch.distributed as dist
from megatron.core.models.hybrid import hybrid_layer_allocation as h
dist.get_rank = lambda group=None: group[0]
dist.get_world_size = lambda group=None: group[1]
h.log_on_each_pipeline_stage = h.log_single_rank = lambda *a, **k: None
out = []
for pattern, pp in json.loads(sys.argv[1]):
    n = h.get_hybrid_total_pipeline_segment_count(pattern)
    vpp = n // pp if n > pp else None  # Megatron-LM 0.19's validate_args (arguments.py) derives it so
    stages = {}
    for v in range(vpp or 1):
        for r in range(pp):
            layers, offset = h.select_pipeline_segment(pattern, (r, pp), v if vpp else None)
            stages[f"{r} {v}"] = ["".join(layers), offset]
    out.append(stages)
print(json.dumps(out))
"""


def test_stages_match_megatron_core_019():
    from frameworks import procs

    measured = procs.run_json("megatron-lm-0.19.0", _MCORE_SELECT, CASES)
    for (pattern, pp), stages in zip(CASES, measured):
        spec = _spec(pattern)
        par = hybrid_stages(spec, Parallelism(pp=pp))
        theirs = {tuple(map(int, key.split())): (layers, offset) for key, (layers, offset) in stages.items()}
        ours = {key: (layers, par.chunk_layers(spec.num_layers, *key).start)
                for key, layers in _stage_layers(pattern, pp).items()}
        assert ours == theirs, pattern
