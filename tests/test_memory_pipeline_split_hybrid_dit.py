"""Uneven pipeline splits of a hybrid layer pattern and of a DiT's blocks, against the frameworks'
own placement functions (memory/pipeline_split.py):

- a hybrid pattern without '|': the first/last stage sizes as megatron-core 0.16.1's
  ``MambaStack._select_layers_for_pipeline_parallel`` (this environment) and 0.19's
  ``select_pipeline_segment`` (its Python 3.12 venv) place the layers; the account-for fields and a
  layout as 0.16.1 ignores them (an even split that drops the remainder) and Megatron-LM 0.19's
  ``validate_args`` refuses them, which the report does with its reason; first/last beside '|' as
  0.19 refuses them;
- a DiT: Megatron-Bridge 0.6.2's ``WanModelProvider`` (a ``TransformerConfig``) with each split,
  through megatron-core 0.19.2's ``get_num_layers_to_build`` / ``get_transformer_layer_offset``,
  which ``WanModel``'s ``TransformerBlock`` calls (``provide`` passes no ``vp_stage``: a layout
  with VPP fails there); and the DiT report's stages, exact against the even reports of the same
  blocks per stage (its PP figures are formulas, labelled unmeasured: Bridge's WanModel builds
  Transformer Engine layers only).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import mcore_cpu
from megatron_flops.cli import main
from megatron_flops.flops.dit import DiTSpec, dit_parameter_counts
from megatron_flops.flops.pipeline_split import PipelineSplit
from megatron_flops.memory.hybrid_pipeline import hybrid_stages
from megatron_flops.memory.layout import Parallelism
from megatron_flops.memory.pipeline_split import dit_uneven_stages, uneven_stages
from megatron_flops.model.spec import ModelSpec

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
FIRST, LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
EMB, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
LAYOUT = "pipeline_model_parallel_layout"
HYBRID = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256, mamba_state_dim=16,
              mamba_head_dim=16, mamba_num_groups=2, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8)
# (pattern, PP, split fields) -> the pattern's symbols per pipeline rank.
HYBRID_CASES = [
    (("M*-M", 2, {FIRST: 1}), ["M", "*-M"]),
    (("M*-M", 2, {LAST: 1}), ["M*-", "M"]),
    # (8 - 2) / 2 = 3 on each of the two other ranks.
    (("M*-M*-M*", 3, {FIRST: 2}), ["M*", "-M*", "-M*"]),
    # 1 | (8 - 1 - 3) / 2 = 2 | 2 | 3.
    (("M*-M*-M-", 4, {FIRST: 1, LAST: 3}), ["M", "*-", "M*", "-M-"]),
]
# GDN symbols: megatron-core 0.19 only (0.16.1's pattern has M, *, -, E).
HYBRID_CASES_019 = [(("G*-G-M", 2, {FIRST: 2}), ["G*", "-G-M"])]


def _hybrid_ranks(pattern: str, pp: int, fields: dict) -> list[str]:
    """This report's layers per pipeline rank, as pattern symbols."""
    spec = ModelSpec.from_mapping(dict(HYBRID, hybrid_override_pattern=pattern))
    par = uneven_stages(PipelineSplit.from_mapping(fields), hybrid_stages(spec, Parallelism(pp=pp)), spec=spec)
    return ["".join(pattern[i] for i in par.chunk_layers(spec.num_layers, r, 0)) for r in range(pp)]


def test_hybrid_first_last_stages_as_our_split():
    for (pattern, pp, fields), want in HYBRID_CASES + HYBRID_CASES_019:
        assert _hybrid_ranks(pattern, pp, fields) == want, pattern


def _mamba_stack_0_16_1(pattern: str, pp: int, fields: dict) -> list[str]:
    """megatron-core 0.16.1's ``MambaStack`` stage selection per pipeline rank (its method on a
    stand-in holding what it reads: the config and the pipeline group's rank and size)."""
    import torch
    from megatron.core.ssm.mamba_block import MambaStack
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=len(pattern), hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **fields)
    out = []
    for r in range(pp):
        stack = SimpleNamespace(config=config, pp_group=SimpleNamespace(rank=lambda r=r: r, size=lambda: pp))
        offset, layers = MambaStack._select_layers_for_pipeline_parallel(stack, list(pattern))
        assert pattern[offset:offset + len(layers)] == "".join(layers)
        out.append("".join(layers))
    return out


@pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)
def test_hybrid_first_last_stages_as_megatron_core_0_16_1_builds_them():
    for (pattern, pp, fields), want in HYBRID_CASES:
        assert _mamba_stack_0_16_1(pattern, pp, fields) == want, pattern


@pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)
def test_megatron_core_0_16_1_ignores_the_other_split_fields_of_a_hybrid_pattern():
    # 7 layers + the embedding = 8 over PP 2 passes TransformerConfig, but MambaStack takes 7 // 2 = 3
    # layers per rank: layer 7 is never built. A layout's 1 + 3 is built 2 + 2.
    assert _mamba_stack_0_16_1("M*-M*-M", 2, {EMB: True}) == ["M*-", "M*-"]
    assert _mamba_stack_0_16_1("M*-M", 2, {LAYOUT: "Et|tttL"}) == ["M*", "-M"]


def _error(capsys, *argv: str) -> str:
    assert main(["memory", *argv]) == 2
    return capsys.readouterr().err


def test_hybrid_account_for_and_layout_refused_with_megatron_lms_reason(tmp_path, capsys):
    path = tmp_path / "hybrid.json"
    path.write_text(json.dumps(dict(HYBRID, hybrid_override_pattern="M*-M")))
    base = ["--model", str(path), "--seq-length", "16", "--pp", "2"]
    for flags, named in ((["--account-for-loss-in-pipeline-split"], "--account-for-loss-in-pipeline-split"),
                         (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
                          "--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split"),
                         (["--pipeline-model-parallel-layout", "Ett|ttL"], "--pipeline-model-parallel-layout")):
        err = _error(capsys, *base, *flags)
        assert f"Megatron-LM 0.19 refuses {named} with a hybrid layer pattern" in err
        assert "Pipeline stage layout is defined by | separators in the pattern" in err
    piped = tmp_path / "piped.json"
    piped.write_text(json.dumps(dict(HYBRID, hybrid_override_pattern="M*|-M")))
    err = _error(capsys, "--model", str(piped), "--seq-length", "16", "--pp", "2", "--decoder-first-pipeline-num-layers",
                 "1")
    assert "already explicitly defined by the pipe separators" in err


# megatron-core 0.19's select_pipeline_segment with first/last sizes (stand-in pipeline group: it reads
# only the rank and size), its refusal beside '|', and Megatron-LM 0.19's validate_args on a hybrid pattern.
_MLM_019 = r"""
import json, sys
import torch.distributed as dist
from megatron.core.models.hybrid import hybrid_layer_allocation as h
dist.get_rank = lambda group=None: group[0]
dist.get_world_size = lambda group=None: group[1]
h.log_on_each_pipeline_stage = h.log_single_rank = lambda *a, **k: None
cases = json.loads(sys.argv[1])
stages = [[h.select_pipeline_segment(p, (r, pp), None, first_stage_layers=f.get("num_layers_in_first_pipeline_stage"),
                                     last_stage_layers=f.get("num_layers_in_last_pipeline_stage"))
           for r in range(pp)] for p, pp, f in cases]
try:
    h.select_pipeline_segment("M*|-M", (0, 2), None, first_stage_layers=1)
    piped = None
except ValueError as exc:
    piped = str(exc)
from megatron.training.arguments import parse_args, validate_args
base = ["x", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings",
        "16", "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "M*-M",
        "--vocab-size", "100"]
refusals = {}
for extra in (["--account-for-embedding-in-pipeline-split"], ["--account-for-loss-in-pipeline-split"],
              ["--pipeline-model-parallel-layout", "Ett|ttL"], ["--decoder-first-pipeline-num-layers", "1"]):
    sys.argv = base + extra
    args = parse_args()
    args.rank, args.world_size = 0, 2
    try:
        validate_args(args)
        refusals[extra[0]] = None
    except AssertionError as exc:
        refusals[extra[0]] = str(exc)
print(json.dumps({"stages": [[["".join(layers), offset] for layers, offset in s] for s in stages],
                  "piped": piped, "refusals": refusals}))
"""


def _venv_python(name: str) -> Path:
    venvs = Path(os.environ.get("MEGATRON_FLOPS_TEST_VENVS") or Path.home() / ".cache" / "megatron-flops" / "venvs")
    python = venvs / name / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"needs the {name} venv ({python} absent; tests/frameworks/envs.py makes it)")
    return python


def _run(python: Path, script: str, arg: object, pythonpath: list[Path]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    done = subprocess.run([str(python), "-c", script, json.dumps(arg)], capture_output=True, text=True, env=env,
                          timeout=900, stdin=subprocess.DEVNULL, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hybrid_stages_and_refusals_as_megatron_0_19():
    from frameworks import envs

    try:
        snapshot = envs.snapshot("0.19.0")
    except envs.Unavailable as exc:
        pytest.skip(str(exc))
    got = _run(_venv_python("megatron-lm-0.19.0"), _MLM_019, [case for case, _ in HYBRID_CASES + HYBRID_CASES_019],
               [snapshot])
    for ((pattern, pp, fields), want), stages in zip(HYBRID_CASES + HYBRID_CASES_019, got["stages"]):
        ours = _hybrid_ranks(pattern, pp, fields)
        assert ours == want and stages == [[s, sum(map(len, ours[:r]))] for r, s in enumerate(ours)], pattern
    assert "already explicitly defined by the pipe separators" in got["piped"]
    for flag in ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                 "--pipeline-model-parallel-layout"):
        assert got["refusals"][flag] == (f"{flag} should not be used with --hybrid-layer-pattern. Pipeline stage "
                                         "layout is defined by | separators in the pattern.")
    assert got["refusals"]["--decoder-first-pipeline-num-layers"] is None  # (modelled above)


# Megatron-Bridge 0.6.2's WanModelProvider with a split, finalized (TransformerConfig's checks), through
# megatron-core 0.19.2's placement functions as WanModel's TransformerBlock calls them (vp_stage None;
# the layout path reads the pipeline rank from parallel_state).
_BRIDGE = r"""
import json, sys, types
from frameworks.cpu_shims import import_megatron_bridge, install_nvrx_version
install_nvrx_version()
import_megatron_bridge()
for name in ("diffusers", "diffusers.models", "diffusers.models.embeddings"):  # (imported, not used here)
    sys.modules[name] = types.ModuleType(name)
def _stub(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})
sys.modules["diffusers.models.embeddings"].__getattr__ = _stub
import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.bridge.diffusion.models.wan.wan_provider import WanModelProvider
out = []
for num_layers, pp, fields in json.loads(sys.argv[1]):
    try:
        p = WanModelProvider(num_layers=num_layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                             crossattn_emb_size=64, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                             apply_rope_fusion=False, **fields)
        p.finalize()
        vpp = p.virtual_pipeline_model_parallel_size
        parallel_state.get_virtual_pipeline_model_parallel_world_size = lambda: vpp
        stages = []
        for r in range(pp):
            parallel_state.get_pipeline_model_parallel_rank = lambda r=r: r
            stages.append([get_num_layers_to_build(p, vp_stage=None, pp_rank=r),
                           get_transformer_layer_offset(p, None, r)])
        out.append(stages)
    except (AssertionError, ValueError) as exc:
        out.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(out))
"""
# (blocks, PP, split fields) -> blocks per stage.
DIT_CASES = [
    ((4, 2, {FIRST: 1}), (1, 3)),
    ((40, 4, {FIRST: 4, LAST: 12}), (4, 12, 12, 12)),
    ((7, 2, {EMB: True}), (3, 4)),
    ((5, 2, {LOSS: True}), (3, 2)),
    ((6, 2, {LAYOUT: "Ett|ttttL"}), (2, 4)),
]
DIT_VPP_LAYOUT = (4, 2, {LAYOUT: "Et|t|t|tL"})


def test_dit_stages_as_megatron_bridge_builds_wan():
    got = _run(_venv_python("megatron-bridge-0.6.2"), _BRIDGE, [case for case, _ in DIT_CASES] + [DIT_VPP_LAYOUT],
               [TESTS.parent, TESTS])
    for ((num_layers, pp, fields), want), theirs in zip(DIT_CASES, got):
        par = dit_uneven_stages(PipelineSplit.from_mapping(fields), Parallelism(pp=pp), num_layers=num_layers)
        assert par.stage_layers == want and par.vpp is None
        assert theirs == [[n, sum(want[:r])] for r, n in enumerate(want)], fields
    # A layout with 4 stages on PP 2 makes VPP 2, and WanModel's block (vp_stage None) fails to build.
    assert got[-1] == "AssertionError: vp_stage must be passed if virtual pipeline is enabled"
    num_layers, pp, fields = DIT_VPP_LAYOUT
    assert dit_uneven_stages(PipelineSplit.from_mapping(fields), Parallelism(pp=pp), num_layers=num_layers).vpp == 2


def _dit_file(tmp_path: Path, num_layers: int) -> str:
    dit = json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())["dit"]  # (without its LoRA and recompute)
    raw = {"dit": dict(dit, num_layers=num_layers)}
    path = tmp_path / f"dit{num_layers}.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _memory(capsys, *argv: str) -> dict:
    assert main(["memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


LAYOUT_FLAGS = ["--seq-length", "16", "--pp", "2", "--dp", "2", "--num-microbatches", "4"]  # (megatron-core DDP)


def test_dit_uneven_stages_priced_as_their_blocks(tmp_path, capsys):
    # 4 blocks as 1 + 3: stage 0 holds one block fewer than the even 2 + 2, stage 1 one more; the
    # example's block: q, k, v, o of self- and cross-attention 8 x (32 x 32 + 32), their q/k norms
    # 4 x 32, the FFN 32 x 64 + 64 + 64 x 32 + 32, the cross-attention norm 2 x 32, the adaLN table
    # 6 x 32: 13,024 parameters (dit_parameter_counts), 2 bf16 bytes each.
    four = _dit_file(tmp_path, 4)
    even = _memory(capsys, "--model", four, *LAYOUT_FLAGS)
    uneven = _memory(capsys, "--model", four, *LAYOUT_FLAGS, "--decoder-first-pipeline-num-layers", "1")
    spec = DiTSpec.from_mapping(json.loads(Path(four).read_text())["dit"])
    block = dit_parameter_counts(spec).num_block_params
    assert block == 8 * (32 * 32 + 32) + 4 * 32 + (32 * 64 + 64 + 64 * 32 + 32) + 2 * 32 + 6 * 32 == 13_024
    (e0, e1), (u0, u1) = ([s["weights_bytes"] for s in r["per_stage"]] for r in (even, uneven))
    assert (e0 - u0, u1 - e1) == (2 * block, 2 * block)
    assert any("blocks per stage [1, 3]" in a for a in uneven["assumptions"])
    assert any("blocks split [1, 3]" in u for u in uneven["unmeasured"])
    # Each stage prices its blocks as a stage of an even split with that many blocks does: stage 0 as
    # 2 blocks on PP 2's first stage (1 each), stage 1 as 6 blocks' last stage (3 each); block recompute
    # of 2 checkpoints min(2, blocks) of each.
    recompute = ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    for extra in ([], recompute):
        split = _memory(capsys, "--model", four, *LAYOUT_FLAGS, *extra, "--decoder-first-pipeline-num-layers", "1")
        two = _memory(capsys, "--model", _dit_file(tmp_path, 2), *LAYOUT_FLAGS, *extra)
        six = _memory(capsys, "--model", _dit_file(tmp_path, 6), *LAYOUT_FLAGS, *extra)
        for key in ("activations_bytes", "forward_passes_in_flight"):
            assert [s[key] for s in split["per_stage"]] == [two["per_stage"][0][key], six["per_stage"][1][key]]


def test_dit_even_split_fields_equal_the_even_report(tmp_path, capsys):
    four = _dit_file(tmp_path, 4)
    even = _memory(capsys, "--model", four, *LAYOUT_FLAGS)
    for flags in (["--decoder-first-pipeline-num-layers", "2"], ["--pipeline-model-parallel-layout", "Ett|ttL"]):
        split = _memory(capsys, "--model", four, *LAYOUT_FLAGS, *flags)
        for key in ("per_gpu", "per_stage", "communication_per_step", "bus_bytes_per_step", "parameters"):
            assert split[key] == even[key], (flags, key)


def test_dit_splits_the_frameworks_cannot_run_are_refused(tmp_path, capsys):
    four = _dit_file(tmp_path, 4)
    # 4 stages on PP 2: VPP 2, which WanModelProvider.provide cannot build.
    assert "cannot interleave WAN itself" in _error(capsys, "--model", four, *LAYOUT_FLAGS,
                                                    "--pipeline-model-parallel-layout", "Et|t|t|tL")
    # megatron-core's own refusals: 4 + the embedding over PP 2; 1 + 1 blocks first and last leave 2 for no
    # middle rank.
    assert "must be divisible by pipeline_model_parallel_size" in _error(
        capsys, "--model", four, *LAYOUT_FLAGS, "--account-for-embedding-in-pipeline-split")
    assert "Mismatch" in _error(capsys, "--model", four, *LAYOUT_FLAGS, "--decoder-first-pipeline-num-layers", "1",
                                "--decoder-last-pipeline-num-layers", "1")
    # (An empty stage, built by megatron-core: tests/test_memory_dit_empty_stage.py.)
