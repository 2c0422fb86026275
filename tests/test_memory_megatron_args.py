"""``memory --megatron-args``: the command line's valued layer options, batch and CP/EP sizes are read, each
equal to the same model given as megatron-core fields (``--model``) with the same flags, exactly."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_flops.cli import main

DENSE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
         "--max-position-embeddings 16 --vocab-size 100 --bf16")
# Megatron-LM's defaults as megatron-core fields (fused bias-GELU, softmax in the activation dtype).
DENSE_FIELDS: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                    vocab_size=100, bias_activation_fusion=True, attention_softmax_in_fp32=False)
MOE = f"{DENSE} --swiglu --num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2"
MOE_FIELDS = dict(DENSE_FIELDS, gated_linear_unit=True, activation_func="silu", num_moe_experts=4,
                  moe_ffn_hidden_size=32, moe_router_topk=2)
MLA = (f"{DENSE} --multi-latent-attention --q-lora-rank 24 --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
       "--v-head-dim 16 --position-embedding-type rope --tensor-model-parallel-size 2")
MLA_FIELDS = dict(DENSE_FIELDS, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16,
                  qk_pos_emb_head_dim=8, v_head_dim=16, position_embedding_type="rope")
LOCAL = f"{DENSE} --attention-backend local"  # (a flash kernel keeps no attention-dropout mask)
LOCAL_FIELDS = dict(DENSE_FIELDS, attention_backend="local")

# (base command line, its fields, layout flags, the option given, the same as fields, the same as flags)
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...], str, dict[str, Any], tuple[str, ...]]] = {
    "normalization": (DENSE, DENSE_FIELDS, (), "--normalization RMSNorm", {"normalization": "RMSNorm"}, ()),
    "position_embedding_type": (DENSE, DENSE_FIELDS, (), "--position-embedding-type rope",
                                {"position_embedding_type": "rope"}, ()),
    "rotary_percent": (f"{DENSE} --position-embedding-type rope", dict(DENSE_FIELDS, position_embedding_type="rope"),
                       (), "--rotary-percent 0.5", {"rotary_percent": 0.5}, ()),
    "max_position_embeddings": (DENSE.replace(" --max-position-embeddings 16", ""), DENSE_FIELDS, (),
                                "--max-position-embeddings 40", {"max_position_embeddings": 40}, ()),
    "hidden_dropout": (DENSE, DENSE_FIELDS, (), "--hidden-dropout 0", {"hidden_dropout": 0.0}, ()),
    "attention_dropout": (LOCAL, LOCAL_FIELDS, (), "--attention-dropout 0.0", {"attention_dropout": 0.0}, ()),
    "attention_backend": (DENSE, DENSE_FIELDS, (), "--attention-backend local", {"attention_backend": "local"}, ()),
    "moe_token_dispatcher_type": (MOE, MOE_FIELDS, ("--dp", "2", "--ep", "2"), "--moe-token-dispatcher-type alltoall",
                                  {"moe_token_dispatcher_type": "alltoall"}, ()),
    "moe_router_score_function": (MOE, MOE_FIELDS, (), "--moe-router-score-function sigmoid",
                                  {"moe_router_score_function": "sigmoid"}, ()),
    "moe_router_pre_softmax": (MOE, MOE_FIELDS, (), "--moe-router-pre-softmax", {"moe_router_pre_softmax": True}, ()),
    "context_parallel_size": (DENSE, DENSE_FIELDS, (), "--context-parallel-size 2", {}, ("--cp", "2")),
    "expert_model_parallel_size": (MOE, MOE_FIELDS, ("--dp", "2"), "--expert-model-parallel-size 2", {},
                                   ("--ep", "2")),
    # The experts' own TP size (ETP): TP2 + SP with whole experts over EP2.
    "expert_tensor_parallel_size": (f"{MOE} --disable-bias-linear --tensor-model-parallel-size 2 --sequence-parallel "
                                    "--expert-model-parallel-size 2", dict(MOE_FIELDS, add_bias_linear=False),
                                    ("--dp", "2"), "--expert-tensor-parallel-size 1", {},
                                    ("--tp", "2", "--sequence-parallel", "--ep", "2", "--etp", "1")),
    # (MLA's down projections: whole on every TP rank with Transformer Engine's spec, split with the local one)
    "transformer_impl": (MLA, MLA_FIELDS, ("--tp", "2"), "--transformer-impl local", {"transformer_impl": "local"}, ()),
    "micro_batch_size": (DENSE, DENSE_FIELDS, (), "--micro-batch-size 3", {}, ("--micro-batch-size", "3")),
    # 24 / (micro-batch 3 x DP 2) = 4 micro-batches per step: 2 in flight on the first of 2 stages
    "global_batch_size": (f"{DENSE} --micro-batch-size 3 --pipeline-model-parallel-size 2", DENSE_FIELDS,
                          ("--dp", "2"), "--global-batch-size 24", {},
                          ("--micro-batch-size", "3", "--pp", "2", "--num-microbatches", "4")),
}


def _memory(*argv: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _file(tmp_path: Path, fields: dict[str, Any]) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(fields))
    return str(path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_option_read_as_the_same_model_file(name, tmp_path):
    base, fields, layout, option, as_fields, as_flags = CASES[name]
    from_args = _memory("--megatron-args", f"{base} {option}", *layout)
    from_file = _memory("--model", _file(tmp_path, {**fields, **as_fields}), "--seq-length", "16", *layout, *as_flags)
    assert from_args == from_file
    # ... and the option counts: without it the report is Megatron-LM's default's.
    assert from_args != _memory("--megatron-args", base, *layout)


def test_no_global_batch_is_one_micro_batch_per_step():
    # Megatron-LM's default global batch: micro-batch size x DP, one micro-batch per step.
    report = _memory("--megatron-args", f"{DENSE} --micro-batch-size 2", "--dp", "4")
    assert "1 micro-batches of 2 x 16 tokens" in report["assumptions"]
    # Flags given override the command line (24 / (4 x 2) = 3).
    report = _memory("--megatron-args", f"{DENSE} --micro-batch-size 2 --global-batch-size 24", "--dp", "2",
                     "--micro-batch-size", "4")
    assert "3 micro-batches of 4 x 16 tokens" in report["assumptions"]
    assert "5 micro-batches of 1 x 16 tokens" in _memory(
        "--megatron-args", f"{DENSE} --global-batch-size 24", "--num-microbatches", "5")["assumptions"]


def test_global_batch_not_divisible_is_refused():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["memory", "--megatron-args", f"{DENSE} --micro-batch-size 2 --global-batch-size 10",
                     "--dp", "2"]) == 2
    assert "--global-batch-size 10 is not divisible by the micro-batch size 2 x DP 2" in err.getvalue()


def test_attention_backend_of_an_args_dump(tmp_path):
    # vars(args) holds the AttnBackend enum; a JSON dump writes it as its str(). (A dump's layout
    # switches are read too: --bf16 is left out on both sides.)
    dump = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 16,
            "max_position_embeddings": 16, "vocab_size": 100, "micro_batch_size": 2, "global_batch_size": 8}
    path = tmp_path / "args.json"
    path.write_text(json.dumps({**dump, "attention_backend": "AttnBackend.local"}))
    line = f"{DENSE.replace(' --bf16', '')} --attention-backend local --micro-batch-size 2 --global-batch-size 8"
    assert _memory("--megatron-args", str(path)) == _memory("--megatron-args", line)


def test_an_args_dump_keeps_its_switches(tmp_path):
    # vars(args) of a bf16, sequence-parallel, distributed-optimizer run: the dump prices what the
    # command line does (before, only the valued keys were read and the run was priced fp32/DDP).
    dump = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 16,
            "max_position_embeddings": 16, "vocab_size": 100, "tensor_model_parallel_size": 2, "bf16": True,
            "sequence_parallel": True, "use_distributed_optimizer": True, "data_parallel_size": 2}
    path = tmp_path / "args.json"
    path.write_text(json.dumps(dump))
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
            "--max-position-embeddings 16 --vocab-size 100 --tensor-model-parallel-size 2 --bf16 "
            "--sequence-parallel --use-distributed-optimizer")
    assert _memory("--megatron-args", str(path), "--dp", "2") == _memory("--megatron-args", line, "--dp", "2")
    assert _memory("--megatron-args", str(path), "--dp", "2") != _memory("--megatron-args", line.replace(" --bf16", ""),
                                                                         "--dp", "2")


@pytest.mark.parametrize("line, reason", [
    # With EP 1 megatron-core reduces expert gradients over the dense DP group: no training layout.
    (f"{MOE} --disable-bias-linear --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1",
     "an expert TP (1) other than TP (2) needs --ep > 1"),
    # megatron-core's TransformerConfig: biases in MoE layers only with ETP 1.
    (f"{MOE} --tensor-model-parallel-size 2 --sequence-parallel", "refuses linear biases in MoE layers with expert TP 2"),
])
def test_expert_tp_layouts_megatron_core_refuses_are_refused(line, reason):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["memory", "--megatron-args", line]) == 2
    assert reason in err.getvalue()


def test_expert_tp_of_a_dense_model_changes_nothing():
    line = f"{DENSE} --tensor-model-parallel-size 2"
    assert _memory("--megatron-args", f"{line} --expert-tensor-parallel-size 1") == _memory("--megatron-args", line)
