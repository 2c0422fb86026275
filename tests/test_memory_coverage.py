"""Issue 19's "done when", checked: every model ``megatron-flops estimate`` accepts (each file in
examples/, each Hugging Face family the reader knows, megatron-core field files of each layer kind),
on a grid of parallel layouts and training setups, gets a ``megatron-flops memory`` report whose
every figure is an integer, or which names what it leaves out (``not_modelled``) or prices by an
unmeasured formula (``unmeasured``). What is left out is listed in FRAMEWORK_REFUSES (layouts the
frameworks themselves refuse or cannot train: not gaps) and GAPS (ours): issue 19 is done when GAPS
is empty. A gap closed elsewhere makes its entry stale, and the test fails until it is deleted.

In-process through the CLI's ``main`` (the path users take), no gloo: seconds."""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megatron_flops.cli import build_parser
from megatron_flops.cli.memory import format_reports
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.model.hf_config import is_hf_config
from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.model.spec import ModelSpec, load_model_file

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SEQ = 16  # divisible by TP 2 (sequence parallel) and 2 x CP 2

# megatron-core field files, one per layer kind the FLOPs side prices (tiny: 4 layers, 4 heads).
BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100)
_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32,
            moe_layer_freq=[0, 1, 1, 1])
_MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
            v_head_dim=16)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
MCORE = {
    "dense LayerNorm bias dropout": dict(BASE, hidden_dropout=0.1, attention_dropout=0.1),
    "gqa swiglu RMSNorm": dict(BASE, num_query_groups=2, gated_linear_unit=True, activation_func="silu",
                               normalization="RMSNorm", add_bias_linear=False),
    "tied": dict(BASE, share_embeddings_and_output_weights=True),
    "qk_layernorm": dict(BASE, qk_layernorm=True),
    "sliding window": dict(BASE, window_size=[5, 0], window_attn_skip_freq=2),
    "gated attention": dict(BASE, attention_output_gate=True),
    "moe alltoall": dict(BASE, **_MOE, moe_token_dispatcher_type="alltoall"),
    "moe allgather": dict(BASE, **_MOE, moe_token_dispatcher_type="allgather"),
    # Grouped-GEMM experts (TEGroupedMLP; with selective moe_act recompute), the flex dispatcher
    # (memory/moe_grouped.py: formulas, listed in unmeasured).
    "moe grouped gemm": dict(BASE, **_MOE, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
                             add_bias_linear=False),
    "moe grouped gemm moe_act": dict(BASE, **_MOE, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
                                     add_bias_linear=False, recompute_granularity="selective",
                                     recompute_modules=["moe_act"]),
    # Every layer MoE (the first adapter a routed expert's under --lora-targets linear_fc1,linear_fc2; memory/
    # grouped_start.py: formulas): TEGroupedMLP, and legacy GroupedMLP (no expert adapter: the shared experts' first).
    "moe grouped gemm all moe": dict(BASE, **{**_MOE, "moe_layer_freq": 1}, moe_token_dispatcher_type="alltoall",
                                     moe_grouped_gemm=True, add_bias_linear=False),
    "moe grouped gemm legacy all moe": dict(BASE, **{**_MOE, "moe_layer_freq": 1}, moe_token_dispatcher_type="alltoall",
                                            moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True,
                                            add_bias_linear=False),
    # Legacy GroupedMLP without shared experts, a dense layer second: the leading MoE layer has no adapter, the
    # gradient starts at the dense layer's linear_fc1 adapter (memory/grouped_start.py: a formula).
    "moe grouped gemm legacy moe first then dense": dict(
        BASE, **dict(_MOE, moe_layer_freq=[1, 0, 1, 0], moe_shared_expert_intermediate_size=None),
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True,
        add_bias_linear=False),
    "moe flex deepep": dict(BASE, **_MOE, moe_token_dispatcher_type="flex"),
    # A dispatcher megatron-core no longer builds (FRAMEWORK_REFUSES).
    "moe alltoall_seq": dict(BASE, **_MOE, moe_token_dispatcher_type="alltoall_seq"),
    "moe flex hybridep grouped": dict(BASE, **_MOE, moe_token_dispatcher_type="flex",
                                      moe_flex_dispatcher_backend="hybridep", moe_grouped_gemm=True,
                                      add_bias_linear=False),
    # A frozen MoE first layer adapted on its experts (memory/moe_lora_start.py): with latent projections (measured
    # with a stand-in for TELinear), and before dense layers (selective mlp checkpoints those only).
    "moe first latent": dict(BASE, **dict(_MOE, moe_layer_freq=1), moe_latent_size=32, moe_token_dispatcher_type="alltoall",
                             add_bias_linear=False),
    "moe first then dense": dict(BASE, **dict(_MOE, moe_layer_freq=[1, 0, 1, 0], moe_shared_expert_intermediate_size=None),
                                 moe_token_dispatcher_type="alltoall", add_bias_linear=False),
    # An MLA + MoE first layer (memory/moe_lora_start.py: its up-projection checkpoint runs before any expert adapter).
    "mla moe first": dict(BASE, **_MLA, **dict(_MOE, moe_layer_freq=1), moe_token_dispatcher_type="alltoall",
                          normalization="RMSNorm", add_bias_linear=False),
    "mla": dict(BASE, **_MLA),
    "mtp": dict(BASE, mtp_num_layers=1),
    "mla moe mtp": dict(BASE, **_MLA, **_MOE, mtp_num_layers=1, normalization="RMSNorm"),
    "untied mla moe mtp": dict(BASE, **_MLA, **_MOE, mtp_num_layers=1, normalization="RMSNorm",
                               share_embeddings_and_output_weights=False, add_bias_linear=False),
    "dsa": dict(BASE, **_MLA, experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
                dsa_indexer_topk=5),
    # Layers 2 and 4 reuse layer 1's and 3's top-k (megatron-core 0.19's dsa_indexer_topk_freq); one MTP layer.
    "dsa shared top-k mtp": dict(BASE, **_MLA, experimental_attention_variant="dsa", dsa_indexer_n_heads=2,
                                 dsa_indexer_head_dim=8, dsa_indexer_topk=5, dsa_indexer_topk_freq=2, mtp_num_layers=1),
    "gdn": dict(BASE, **_LINEAR, experimental_attention_variant="gated_delta_net", linear_attention_freq=2),
    # A list: 1 marks softmax attention; the last layer (and so the MTP layer) is GDN.
    "gdn mtp": dict(BASE, **_LINEAR, experimental_attention_variant="gated_delta_net", linear_attention_freq=[0, 1, 0, 1],
                    mtp_num_layers=1),
    # A hybrid pattern's MTP part after '/' (megatron-core 0.19).
    "hybrid mamba mtp": dict(BASE, hybrid_override_pattern="M*-M/*-", mamba_state_dim=16, mamba_head_dim=16,
                             mamba_num_groups=2),
    "hybrid mamba": dict(BASE, hybrid_override_pattern="M*-M", mamba_state_dim=16, mamba_head_dim=16,
                         mamba_num_groups=2),
    # '|' marks megatron-core 0.19's pipeline stages: 4 segments, VPP 2 on PP 2 (no layout without PP).
    "hybrid mamba piped": dict(BASE, num_layers=8, hybrid_override_pattern="M*|-M|*-|M-", mamba_state_dim=16,
                               mamba_head_dim=16, mamba_num_groups=2),
    # megatron-core's uneven pipeline split (2 layers on the first pipeline rank, 6 on the last), and a
    # pipeline layout string.
    "uneven pipeline": dict(BASE, num_layers=8, num_layers_in_first_pipeline_stage=2),
    "pipeline layout": dict(BASE, pipeline_model_parallel_layout="Ettt|tL"),
    # MTP on pipeline rank 0's second model chunk, the loss on rank 1's (megatron-core's mtp_standalone; tied: a
    # labelled formula, memory/mtp_stage.py).
    "mtp standalone layout": dict(BASE, mtp_num_layers=1, pipeline_model_parallel_layout="Ett|tt|m|L"),
    "lora and recompute in the file": dict(BASE, lora={"dim": 4}, recompute_granularity="full",
                                           recompute_method="uniform", recompute_num_layers=1),
}

# name -> flags. Micro-batches enough to fill the pipeline.
LAYOUTS = {
    "1 GPU": [],
    "DP2": ["--dp", "2"],
    "DP2 distopt": ["--dp", "2", "--distributed-optimizer"],
    "DP2 FSDP": ["--dp", "2", "--fsdp"],
    "TP2": ["--tp", "2"],
    "TP2 SP": ["--tp", "2", "--sequence-parallel"],
    "PP2": ["--pp", "2", "--num-microbatches", "4"],
    "PP2 VPP2": ["--pp", "2", "--vpp", "2", "--num-microbatches", "4"],
    "CP2": ["--cp", "2"],
    "DP2 EP2": ["--dp", "2", "--ep", "2"],
    "TP2 SP DP2 EP2": ["--tp", "2", "--sequence-parallel", "--dp", "2", "--ep", "2"],
    "TP2 SP DP2 EP2 ETP1": ["--tp", "2", "--sequence-parallel", "--dp", "2", "--ep", "2", "--etp", "1"],
    "DP2 Megatron-FSDP": ["--dp", "2", "--megatron-fsdp", "optim_grads_params"],
}
# name -> flags, each also given to `estimate`; crossed with the layouts in SETUP_LAYOUTS.
SETUPS = {
    "": [],
    "full recompute": ["--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective recompute": ["--recompute", "selective"],
    "selective recompute of every module": ["--recompute", "selective", "--recompute-modules",
                                            "core_attn,layernorm,moe,shared_experts"],
    "LoRA": ["--lora-rank", "4"],
    "LoRA proj, fc1, fc2": ["--lora-rank", "4", "--lora-targets", "linear_proj,linear_fc1,linear_fc2"],
    "frozen LoRA": ["--frozen", "--lora-rank", "4"],
    "LoRA, selective recompute of layernorm, moe, shared_experts": [
        "--lora-rank", "4", "--recompute", "selective", "--recompute-modules", "core_attn,layernorm,moe,shared_experts"],
    # (MLA's projections, with a q latent: `estimate` refuses the targets on other models.)
    "frozen LoRA on MLA's projections": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                         "linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,linear_kv_up_proj,"
                                         "linear_proj"],
    "frozen LoRA, selective recompute of moe, shared_experts": [
        "--frozen", "--lora-rank", "4", "--recompute", "selective", "--recompute-modules", "moe,shared_experts"],
}
SETUP_LAYOUTS = ("1 GPU", "DP2 distopt", "DP2 FSDP", "TP2 SP", "PP2", "DP2 Megatron-FSDP")
# Setups and layouts run on a few models only (SPOT_CHECKS: model glob, setup, layouts): the setups or
# layouts a gap needs, where crossing them with every model would only repeat other rows.
SPOT_SETUPS = {
    "frozen LoRA proj, selective recompute of mla_up_proj": [
        "--frozen", "--lora-rank", "4", "--lora-targets", "linear_proj", "--recompute", "selective",
        "--recompute-modules", "mla_up_proj"],
    "LoRA q_down, proj": ["--lora-rank", "4", "--lora-targets", "linear_q_down_proj,linear_proj"],
    "frozen LoRA q_down, fc1, selective recompute": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                                     "linear_q_down_proj,linear_fc1", "--recompute", "selective"],
    # MLA's up projections only, under Transformer Engine's spec + SP (tests/test_memory_lora_mla_te.py).
    "frozen LoRA q_up, kv_up, proj": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                      "linear_q_up_proj,linear_kv_up_proj,linear_proj"],
    "frozen LoRA fc1, fc2": ["--frozen", "--lora-rank", "4", "--lora-targets", "linear_fc1,linear_fc2"],
    # (tests/test_memory_moe_lora_start_dist.py: EP2, TP2 x EP2 + SP, full recompute; selective 'moe' is refused,
    # by `estimate` too: no backward runs in the checkpointed layer.)
    "frozen LoRA fc1, fc2, full recompute": ["--frozen", "--lora-rank", "4", "--lora-targets", "linear_fc1,linear_fc2",
                                             "--recompute", "full", "--recompute-method", "uniform",
                                             "--recompute-num-layers", "1"],
    # (Selective shared_experts with shared experts is refused by both: their adapters would get no gradient.)
    "frozen LoRA fc1, fc2, selective mlp, shared_experts": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                                            "linear_fc1,linear_fc2", "--recompute", "selective",
                                                            "--recompute-modules", "core_attn,mlp,shared_experts"],
    # (tests/test_memory_recompute_modules.py at TP 1, tests/test_memory_moe_lora_start_dist.py under TP2 + SP:
    # layer 0's checkpoint saves nothing and never re-runs. Selective layernorm: megatron-core fails, FRAMEWORK_REFUSES.)
    "frozen LoRA fc1, fc2, selective mla_up_proj": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                                    "linear_fc1,linear_fc2", "--recompute", "selective",
                                                    "--recompute-modules", "mla_up_proj"],
    "frozen LoRA fc1, fc2, selective layernorm, mla_up_proj": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                                               "linear_fc1,linear_fc2", "--recompute", "selective",
                                                               "--recompute-modules", "layernorm,mla_up_proj"],
    "frozen LoRA fc1, fc2, flex dispatcher": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                              "linear_fc1,linear_fc2", "--moe-token-dispatcher", "flex"],
    "full recompute of 2-block groups": ["--recompute", "full", "--recompute-method", "uniform",
                                         "--recompute-num-layers", "2"],
    "vision grids": ["--grid-thw", str(EXAMPLES / "vlm_grids.json")],
    # Megatron-Bridge 0.6.2's other adapter layouts on TEGroupedMLP experts (memory/grouped_lora.py).
    "LoRA per-expert grouped": ["--lora-rank", "4", "--lora-grouped-experts", "per-expert"],
    "frozen LoRA shared-outer grouped": ["--frozen", "--lora-rank", "4", "--lora-grouped-experts", "shared-outer"],
    # The same and selective moe_act with the first adapter a routed expert's (memory/grouped_start.py; rank 8: every
    # per-expert dimension a multiple of 8, grouped_mm's path).
    **{f"frozen LoRA fc1, fc2 {layout} grouped": ["--frozen", "--lora-rank", "8", "--lora-targets",
                                                  "linear_fc1,linear_fc2", "--lora-grouped-experts", layout]
       for layout in ("per-expert", "shared-outer")},
    "frozen LoRA fc1, fc2, selective moe_act": ["--frozen", "--lora-rank", "4", "--lora-targets",
                                               "linear_fc1,linear_fc2", "--recompute", "selective",
                                               "--recompute-modules", "moe_act"],
    "frozen LoRA fc2, selective moe_act": ["--frozen", "--lora-rank", "4", "--lora-targets", "linear_fc2",
                                           "--recompute", "selective", "--recompute-modules", "moe_act"],
    # Modules megatron-core cannot recompute on some models (FRAMEWORK_REFUSES), and an MTP layer from the flag.
    "selective recompute of mlp": ["--recompute", "selective", "--recompute-modules", "mlp"],
    "one MTP layer": ["--mtp-num-layers", "1"],
    "frozen LoRA, selective recompute of layernorm": ["--frozen", "--lora-rank", "4", "--recompute", "selective",
                                                      "--recompute-modules", "layernorm"],
}
SPOT_LAYOUTS = {
    "TP2 SP DP2 FSDP": ["--tp", "2", "--sequence-parallel", "--dp", "2", "--fsdp"],
    "CP2 DP2 FSDP": ["--cp", "2", "--dp", "2", "--fsdp"],
    "DP2 FSDP SGD": ["--dp", "2", "--fsdp", "--optimizer", "sgd"],
    # Uneven pipeline splits of a hybrid pattern and of a DiT's blocks (a GPT's: the "uneven pipeline" and
    # "pipeline layout" files); a layout names each model's layer count.
    "PP2 first stage 1 layer": ["--pp", "2", "--num-microbatches", "4", "--decoder-first-pipeline-num-layers", "1"],
    "PP2 embedding and loss in the split": ["--pp", "2", "--num-microbatches", "4",
                                            "--account-for-embedding-in-pipeline-split",
                                            "--account-for-loss-in-pipeline-split"],
    "PP2 layout Ett|ttL": ["--pp", "2", "--num-microbatches", "4", "--pipeline-model-parallel-layout", "Ett|ttL"],
    "PP2 layout Et*8|t*32L": ["--pp", "2", "--num-microbatches", "4", "--pipeline-model-parallel-layout",
                              "Et*8|t*32L"],
    "PP2 layout E|t*40L": ["--pp", "2", "--num-microbatches", "4", "--pipeline-model-parallel-layout", "E|t*40L"],
    "PP2 layout Et*40|L": ["--pp", "2", "--num-microbatches", "4", "--pipeline-model-parallel-layout", "Et*40|L"],
    # Empty stages before E or after L (megatron-core builds the embedding and loss on the edge stages anyway).
    **{f"PP2 layout {layout}": ["--pp", "2", "--num-microbatches", "4", "--pipeline-model-parallel-layout", layout]
       for layout in ("|Et*4L", "Et*4L|", "|Ett|ttL|", "|Et*4mL", "Et*4mL|", "|Ett|ttmL|")},
    # A frozen base's first stage holding no layer under TP2 + SP (and EP2): layer 0's input is received and
    # requires grad, so no frozen-first-layer skip applies on any rank (Parallelism.holds_frozen_first_layer).
    "TP2 SP PP2 layout E|ttttL": ["--tp", "2", "--sequence-parallel", "--pp", "2", "--num-microbatches", "4",
                                  "--pipeline-model-parallel-layout", "E|ttttL"],
    "TP2 SP DP2 EP2 PP2 layout E|ttttL": ["--tp", "2", "--sequence-parallel", "--dp", "2", "--ep", "2", "--pp", "2",
                                          "--num-microbatches", "4", "--pipeline-model-parallel-layout", "E|ttttL"],
    "TP2 SP PP2 layout |Ett|ttL|": ["--tp", "2", "--sequence-parallel", "--pp", "2", "--num-microbatches", "4",
                                    "--pipeline-model-parallel-layout", "|Ett|ttL|"],
    "TP2 SP CP2": ["--tp", "2", "--sequence-parallel", "--cp", "2"],
    "TP2 CP2": ["--tp", "2", "--cp", "2"],
    "DP2 distopt SGD": ["--dp", "2", "--distributed-optimizer", "--optimizer", "sgd"],
    # A large data-parallel group under the distributed optimizer (32 layers x 4096 ranks; refused while the memory
    # model walked every rank: memory/dp_ranks.py finds the most loaded one).
    "DP4096 distopt": ["--dp", "4096", "--distributed-optimizer"],
}
SPOT_CHECKS = [
    ("mcore:mla", "frozen LoRA proj, selective recompute of mla_up_proj", ("1 GPU", "TP2 SP")),
    ("mcore:mla", "LoRA q_down, proj", ("1 GPU", "TP2 SP")),
    ("mcore:mla", "frozen LoRA q_down, fc1, selective recompute", ("1 GPU",)),
    ("mcore:mla", "frozen LoRA q_up, kv_up, proj", ("TP2 SP",)),  # (up projections: TEColumnParallelLinear)
    ("hf:deepseek_v3", "frozen LoRA q_up, kv_up, proj", ("TP2 SP",)),  # (latent norms fused into them)
    ("hf:mixtral", "frozen LoRA fc1, fc2", ("1 GPU", "TP2 SP", "DP2 EP2", "TP2 SP DP2 EP2")),
    ("hf:mixtral", "frozen LoRA fc1, fc2, full recompute", ("DP2 EP2", "TP2 SP DP2 EP2")),
    ("mcore:moe first latent", "frozen LoRA fc1, fc2", ("1 GPU", "TP2 SP", "DP2 EP2", "TP2 SP DP2 EP2")),
    ("mcore:moe first then dense", "frozen LoRA fc1, fc2, selective mlp, shared_experts", ("1 GPU", "TP2 SP", "DP2 EP2")),
    ("hf:mixtral", "frozen LoRA fc1, fc2, selective mlp, shared_experts", ("1 GPU", "TP2 SP DP2 EP2")),
    ("mcore:mla moe first", "frozen LoRA fc1, fc2, selective mla_up_proj", ("1 GPU", "TP2 SP")),
    ("mcore:mla moe first", "frozen LoRA fc1, fc2, selective layernorm, mla_up_proj", ("1 GPU",)),
    ("hf:mixtral", "frozen LoRA fc1, fc2, flex dispatcher", ("DP2 EP2", "TP2 SP DP2 EP2")),  # (a formula)
    ("mcore:moe alltoall", "LoRA", ("TP2 SP DP2 EP2 ETP1",)),
    ("examples/wan_tiny_dit.json", "full recompute of 2-block groups", ("1 GPU", "DP2")),
    ("examples/wan_tiny_dit.json", "", ("TP2 SP DP2 FSDP", "CP2 DP2 FSDP", "DP2 FSDP SGD")),
    ("mcore:untied mla moe mtp", "", ("TP2 SP DP2 FSDP", "CP2 DP2 FSDP", "DP2 FSDP SGD")),
    *[("mcore:moe grouped gemm*", setup, ("1 GPU", "DP2 EP2", "TP2 SP DP2 EP2", "TP2 SP DP2 EP2 ETP1", "PP2"))
      for setup in ("LoRA per-expert grouped", "frozen LoRA shared-outer grouped")],
    *[("mcore:moe grouped gemm*all moe", setup, ("1 GPU", "DP2 EP2", "TP2 SP DP2 EP2", "TP2 SP DP2 EP2 ETP1", "PP2"))
      for setup in ("frozen LoRA fc1, fc2 per-expert grouped", "frozen LoRA fc1, fc2 shared-outer grouped",
                    "frozen LoRA fc1, fc2, selective moe_act", "frozen LoRA fc1, fc2")],
    ("mcore:moe grouped gemm all moe", "frozen LoRA fc2, selective moe_act", ("1 GPU",)),
    *[("mcore:moe grouped gemm legacy moe first then dense", setup, ("1 GPU", "DP2 EP2", "TP2 SP DP2 EP2", "PP2"))
      for setup in ("frozen LoRA fc1, fc2", "frozen LoRA fc1, fc2, full recompute")],
    ("mcore:dsa*", "", ("TP2 SP CP2", "TP2 CP2")),  # (megatron-core 0.19.0's DSA layer under TP x CP)
    ("examples/qwen2_5_vl_7b_config.json", "vision grids", ("1 GPU", "DP2 distopt", "DP2 FSDP", "TP2 SP", "PP2")),
    ("mcore:hybrid mamba", "", ("PP2 first stage 1 layer", "PP2 embedding and loss in the split", "PP2 layout Ett|ttL")),
    ("mcore:hybrid mamba piped", "", ("PP2 first stage 1 layer",)),
    ("mcore:gdn", "", ("PP2 first stage 1 layer",)),
    ("mcore:dense*", "selective recompute of mlp", ("1 GPU",)),  # (linear biases)
    ("mcore:gqa*", "selective recompute of mlp", ("1 GPU", "TP2 SP")),  # (none: measured)
    ("hf:kimi_linear", "one MTP layer", ("1 GPU",)),
    ("mcore:gqa*", "frozen LoRA, selective recompute of layernorm", ("1 GPU",)),
    ("mcore:gqa*", "", ("DP2 distopt SGD",)),
    ("examples/wan_tiny_dit.json", "", ("DP2 distopt SGD",)),
    ("examples/llama3_8b.json", "", ("DP4096 distopt",)),
    ("mcore:pipeline layout", "", ("PP2 layout |Et*4L", "PP2 layout Et*4L|", "PP2 layout |Ett|ttL|")),
    ("mcore:mtp", "", ("PP2 layout |Et*4mL", "PP2 layout Et*4mL|", "PP2 layout |Ett|ttmL|")),
    ("examples/wan21_14b_dit.json", "", ("PP2 first stage 1 layer", "PP2 embedding and loss in the split",
                                         "PP2 layout Et*8|t*32L", "PP2 layout E|t*40L", "PP2 layout Et*40|L")),
    # A frozen base whose first stage holds no block (memory/dit_layouts.py: megatron-core skips its backward).
    ("examples/wan21_14b_dit.json", "frozen LoRA", ("PP2 layout E|t*40L",)),
    ("mcore:gqa*", "frozen LoRA", ("TP2 SP PP2 layout E|ttttL", "TP2 SP PP2 layout |Ett|ttL|")),
    ("mcore:moe first latent", "frozen LoRA fc1, fc2", ("TP2 SP PP2 layout E|ttttL", "TP2 SP DP2 EP2 PP2 layout E|ttttL")),
    ("mcore:moe grouped gemm all moe", "frozen LoRA fc1, fc2", ("TP2 SP DP2 EP2 PP2 layout E|ttttL",)),
]
# What a report leaves out until the user gives an input no model file holds (``needs_input``): not
# a gap. A VLM without --grid-thw: the vision tower's activations (the survey passes no grids but in
# the "vision grids" spot check).
NEEDS_INPUT = {"examples/qwen2_5_vl_7b_config.json": "--grid-thw"}


def _layouts(model: str, setup: str) -> list[str]:
    """Every layout without a setup; with one, a few (the full-size example files: one GPU, as
    each report lists every expert's parameters, thousands of them); then the spot checks'."""
    spots = [layout for glob, name, layouts in SPOT_CHECKS if name == setup and fnmatch.fnmatchcase(model, glob)
             for layout in layouts]
    if setup in SPOT_SETUPS:
        return spots
    if not setup:
        return list(LAYOUTS) + spots
    return (["1 GPU"] if model.startswith("examples/") else list(SETUP_LAYOUTS)) + spots

# Flags `estimate` takes that `memory` has no use for (rows, the FLOPs convention).
FLOPS_ONLY_FLAGS = {"--seqlens", "--batch-size", "--attention", "--kv-seqlens", "--image-seqlens",
                    "--convention"}
# Flags `estimate` takes to read a model that `memory` lacks: a model estimate reads only with them
# has no memory report. (None: both take cli/_model_args.py's arguments.)
MISSING_MEMORY_FLAGS: set[str] = set()
# Flags (each with one value) `memory` takes that `estimate` has no use for: left out of the setup's
# `estimate` run (the dispatcher moves no FLOPs).
MEMORY_ONLY_FLAGS = {"--moe-token-dispatcher"}


def _estimate_flags(setup_flags: list[str]) -> list[str]:
    """``setup_flags`` without MEMORY_ONLY_FLAGS and their values."""
    out, it = [], iter(setup_flags)
    for flag in it:
        if flag in MEMORY_ONLY_FLAGS:
            next(it)
        else:
            out.append(flag)
    return out

# What is not reported, in two lists of (model | layout | setup glob, reason regex). Every observed
# refusal or not-modelled reason must match an entry of one of them, and every entry must match one:
# delete an entry when its gap is closed (the test fails while it is stale).
# FRAMEWORK_REFUSES: layouts megatron-core, Megatron-LM, Megatron-Bridge or transformers themselves refuse
# or cannot train (each with the framework's reason): not gaps of ours; the report names the refusal.
FRAMEWORK_REFUSES: list[tuple[str, str]] = [
    # megatron-core refuses a --vpp other than the VPP a pipeline_model_parallel_layout makes.
    ("mcore:pipeline layout | PP2 VPP2 | *", r"refused: .*conflicts with pipeline_model_parallel_layout"),
    # Kimi Delta Attention at TP 1 only (no KDA layer has tensor parallelism: not megatron-core through
    # 0.19.2, not Megatron-Bridge 0.6.2, not transformers) and without context parallelism (transformers'
    # KDA layer has none). (GDN and DSA under CP: megatron-core 0.19.0's layers, memory/linear_cp.py.)
    ("hf:kimi_linear | CP2 | ", r"refused: .*KimiLinearDeltaAttention, which has no context parallelism"),
    ("hf:kimi_linear | TP2* | ", r"refused: .*Kimi Delta Attention is modelled with --tp 1"),
    # olmo2's and olmo3's q/k norms over the whole q and k projections under TP (memory/hf_qk_norms.py): their
    # statistics span every head, and no framework splits them over TP (transformers' TP plan gathers q, k and v
    # whole on every rank instead), so there is no layout to measure or count.
    *[(f"hf:{model} | TP2* | *", r"refused: .*no framework splits them over TP") for model in ("olmo2", "olmo3")],
    # torch FSDP2 for a decoder with tied embeddings, which Megatron-LM's --use-torch-fsdp2 refuses (megatron-core
    # field files tie by default: "mcore:untied mla moe mtp" is the one decoder file FSDP2 reports on).
    ("* | *DP2 FSDP* | *", r"refused: .*--use-torch-fsdp2 \(--fsdp\) is not supported with tied embeddings"),
    # MoE under TP without sequence parallelism: megatron-core's MoELayer raises in training.
    ("* | TP2 | *", r"refused: .*megatron-core refuses to train MoE layers under tensor parallelism without "
                    r"sequence parallelism"),
    # LoRA on MLA's down projections under TP + SP as Transformer Engine's spec (the CLI's default) builds them:
    # Megatron-Bridge's ParallelLinearAdapter on a duplicated TELinear (0.3.1 to 0.6.2) skips the sequence
    # all-gather, so its linear_in gather mixes ranks' tokens and its input gradient is unreduced (without SP:
    # a formula, tests/test_memory_lora_mla_te.py; --transformer-impl local is measured).
    ("* | TP2 SP* | *LoRA*", r"refused: .*Megatron-Bridge .* cannot train LoRA adapters on MLA's .*duplicated "
                             r"TELinear"),
    # Megatron-Bridge 0.6.2's shared-outer grouped-expert adapters size their per-expert side to the whole expert
    # width: under expert TP > 1 it does not match the base linear (read in its source; memory/grouped_lora.py).
    ("mcore:moe grouped gemm* | TP2 SP DP2 EP2 | *shared-outer*", r"refused: .*shared-outer grouped-expert LoRA"),
    # DiT (memory/dit_layouts.py) with virtual pipeline stages: Megatron-Bridge 0.6.2 itself cannot build them
    # (WanModelProvider.provide ignores vp_stage), so there is no layout to model.
    ("examples/wan* | PP2 VPP2 | ", r"refused: .*Megatron-Bridge 0.6.2 cannot interleave WAN itself"),
    # A hybrid pattern with the account-for flags or a layout: Megatron-LM 0.19's validate_args refuses them
    # (megatron-core 0.16.1's MambaStack ignores them); with '|' separators, first/last sizes too (0.19's
    # select_pipeline_segment). tests/test_memory_pipeline_split_hybrid_dit.py runs both.
    ("mcore:hybrid mamba | PP2 embedding and loss in the split | ", r"refused: .*Megatron-LM 0.19 refuses "
                                                                    r"--account-for-.* with a hybrid layer pattern"),
    ("mcore:hybrid mamba | PP2 layout Ett|ttL | ", r"refused: .*Megatron-LM 0.19 refuses --pipeline-model-parallel-"
                                                   r"layout with a hybrid layer pattern"),
    ("mcore:hybrid mamba piped | PP2 first stage 1 layer | ", r"refused: .*megatron-core 0.19 refuses num_layers_in_"
                                                              r"first/last_pipeline_stage when the hybrid pattern"),
    # DSA under CP needs megatron-core 0.19.0's AbsorbedMLASelfAttention, which asserts sequence parallelism under TP.
    ("mcore:dsa* | TP2 CP2 | ", r"refused: .*AbsorbedMLASelfAttention asserts it"),
    # Selective mlp recompute with linear biases: megatron-core 0.16.1's and 0.19.0's backward never ends (fc2's bias,
    # returned through the checkpoint, gets it as its grad_fn; seen on CPU with both: a 2-layer GPT steps in seconds
    # without biases and runs on for minutes with them). The report keeps the states and leaves activations out.
    ("* | * | selective recompute of mlp", r"not modelled: .*selective mlp recompute with linear biases: megatron-core "
                                           r"0.16.1's and 0.19.0's backward never ends"),
    # An MTP layer after a KDA layer: no framework trains it (no KDA layer in megatron-core or Bridge; transformers'
    # Kimi Linear has no MTP).
    ("hf:kimi_linear | 1 GPU | one MTP layer", r"refused: .*multi-token prediction after a Kimi Delta Attention layer: "
                                               r"no framework trains it"),
    # A frozen base under selective layernorm recompute: megatron-core 0.16.1's and 0.19.0's CheckpointWithoutOutput fail
    # in backward where a norm's input requires no grad, as the first layer's does (memory/recompute.py; seen with
    # both; tests/test_memory_recompute_modules.py measures it on an MoE-first layer, whose own reason does not hide it).
    ("* | * | frozen LoRA*selective*layernorm*", r"not modelled: activations under selective recompute of layernorm "
                                                 r"with a frozen base: .*CheckpointWithoutOutput fail in backward"),
    # A dispatcher megatron-core 0.14.0 to 0.19.0 does not build: MoELayer raises.
    ("mcore:moe alltoall_seq | * | *", r"not modelled: .*MoELayer raises 'Unsupported token dispatcher type'"),
    # megatron-core's DistributedOptimizer asserts Adam (or HybridDeviceOptimizer).
    ("* | DP2 distopt SGD | ", r"refused: .*'Only Adam and HybridDeviceOptimizer currently supported'"),
    # Selective moe_act around a frozen first MoE layer adapted on its experts' linear_fc2 alone: fc1's output requires
    # no grad there, and megatron-core 0.16.1's CheckpointWithoutOutput fails in backward (seen on CPU:
    # tests/test_memory_grouped_start.py).
    ("mcore:moe grouped gemm all moe | 1 GPU | frozen LoRA fc2, selective moe_act",
     r"not modelled: .*CheckpointWithoutOutput saves no input and its recompute fails in backward"),
]

# GAPS: ours. Each is a refusal or a not-modelled row for a layout the frameworks train.
GAPS: list[tuple[str, str]] = []


# Hugging Face families whose layers save tensors a megatron-core GPT layer with the same sizes does
# not, while their memory report is exactly that of the file read as model_type llama, with no label:
# silent gaps. Delete an entry when the family's figure is modelled (it changes) or labelled.
# (None now: cohere, olmo, olmo2, hunyuan_v1_dense, stablelm, glm, glm4, starcoder2, nemotron,
# gpt_neox, apertus and falcon are read with their norms, biases, rotary fraction and q/k norms, or
# labelled; tests/test_memory_hf_families.py checks their parameters against transformers'.)
SILENT_HF_GAPS: dict[str, str] = {}


def _hf_cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """Each family's tiny config (tests/test_hf_config.py; the families measured with remainders
    from their own tests), as model_type and AutoConfig keywords."""
    import test_hf_config
    import test_linear_attention
    import test_sparse_attention

    cases = dict(test_hf_config.CASES)
    cases.update({
        "qwen3_next": ("qwen3_next", test_linear_attention.QWEN3_NEXT),
        "kimi_linear": ("kimi_linear", test_linear_attention.KIMI),
        "deepseek_v32": ("deepseek_v32", test_sparse_attention.V32),
        "glm_moe_dsa": ("glm_moe_dsa", dict(test_sparse_attention.V32, num_hidden_layers=4)),
        # The down projections' biases (q_a_proj, kv_a_proj_with_mqa: tests/test_memory_hf_biases.py).
        "deepseek_v3 attention_bias": ("deepseek_v3", dict(test_hf_config.FAMILIES["deepseek_v3"], attention_bias=True)),
    })
    return cases


def _model_files(root: Path) -> dict[str, Path]:
    """name -> model file: examples/, then hf:<case> config.json files as save_pretrained writes
    them, then mcore:<kind> files."""
    files: dict[str, Path] = {}
    for path in sorted(EXAMPLES.glob("*.json")):
        if isinstance(json.loads(path.read_text()), dict):  # not a rows or grids list
            files[f"examples/{path.name}"] = path
    for case, (model_type, kw) in sorted(_hf_cases().items()):
        path = root / f"hf {case}.json"
        path.write_text(transformers.AutoConfig.for_model(model_type, **kw).to_json_string())
        files[f"hf:{case}"] = path
    for kind, fields in MCORE.items():
        path = root / f"mcore {kind}.json"
        path.write_text(json.dumps(fields))
        files[f"mcore:{kind}"] = path
    return files


PARSER = build_parser()  # built once: building it costs more than most reports


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` on one parser: exit status, stdout, and the one-line error of a ValueError
    (as ``main`` prints it); any other exception propagates."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            args = PARSER.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0), "", f"usage error: {argv}"
    try:
        with contextlib.redirect_stdout(out):
            rc = args.func(args)
    except ValueError as exc:
        return 2, "", f"megatron-flops: error: {' '.join(str(exc).split())}"
    return rc, out.getvalue(), ""


def _flag(argv: list[str], name: str, default: int = 1) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def megatron_core_refuses(spec: ModelSpec | None, flags: list[str], biases: bool = False,
                          flex: bool = False) -> str | None:
    """Why megatron-core itself would not build this layout (sizes that do not divide, ``biases``
    in MoE layers with an expert TP other than 1, the ``flex`` dispatcher over one rank), else None."""
    if spec is None:  # a DiT: no experts to parallelise
        return "EP without experts" if _flag(flags, "--ep") > 1 else None
    tp, pp, cp, ep, dp = (_flag(flags, f"--{n}") for n in ("tp", "pp", "cp", "ep", "dp"))
    if spec.moe is not None and biases and _flag(flags, "--etp", tp) > 1:
        return "biases in MoE layers with ETP > 1"
    if spec.moe is not None and flex and _flag(flags, "--etp", tp) * ep == 1:
        return "the flex dispatcher without expert TP x EP > 1"
    sizes = {"num_attention_heads": spec.num_attention_heads, "num_query_groups": spec.num_query_groups,
             "ffn_hidden_size": spec.ffn_hidden_size}
    if spec.moe is not None:
        sizes.update(moe_ffn_hidden_size=spec.moe.ffn_hidden_size,
                     moe_shared_expert_intermediate_size=spec.moe.shared_expert_ffn_hidden_size)
    for name, value in sizes.items():
        if value % tp:
            return f"{name} % TP"
    vpp, segments = _flag(flags, "--vpp"), len(spec.pipeline_segments)
    if segments and (pp == 1 or segments % pp or "--vpp" in flags and vpp != segments // pp):
        return "a hybrid pattern's '|' segments are not PP x VPP stages (VPP derived by Megatron-LM 0.19)"
    if not segments and "--vpp" in flags and is_hybrid(spec):
        return "VPP of a hybrid pattern without '|' separators"
    if not segments and spec.num_layers % (pp * vpp):
        return "num_layers % (PP x VPP)"
    if ep > 1 and (spec.moe is None or spec.moe.num_experts % ep or dp * cp % ep):
        return "EP without experts that divide"
    return None


def _walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")
    else:
        yield path, value


FIGURES = ("parameters", "per_gpu", "per_stage", "communication_per_step", "bus_bytes_per_step",
           "communication_per_stage", "communication_ranges_per_step")
# None where a feature does not apply (no EP: no per-rank range), or where activations are not
# modelled (then not_modelled must say so).
OPTIONAL = ("activations_range_bytes",)
ACTIVATION_FIGURES = ("activations_bytes", "forward_passes_in_flight", "activations_per_microbatch")


def unlabelled_figures(report: dict[str, Any]) -> list[str]:
    """Figures that are neither an integer nor named by not_modelled."""
    labelled = any("activations" in reason for reason in report["not_modelled"])
    bad = []
    for key in FIGURES:
        if key not in report:  # a DiT under FSDP2 has one stage and no routing ranges
            continue
        for path, value in _walk(report[key], key):
            name = re.sub(r"\[\d+\]", "", path).split(".")[-1]
            if value is None and (name in OPTIONAL or (labelled and name in ACTIVATION_FIGURES)):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                bad.append(f"{path}={value!r}")
    return bad


def _survey(files: dict[str, Path]) -> dict[str, Any]:
    """Run estimate and memory over every model x setup x layout."""
    gaps: dict[str, list[str]] = {}
    needs: dict[str, set[str]] = {}
    problems: list[str] = []
    skipped: list[str] = []
    for name, path in files.items():
        spec, raw = load_model_file(str(path))
        options = DecoderOptions.from_mapping(raw, hf=is_hf_config(raw)) if spec is not None else None
        biases = options is not None and options.add_bias_linear
        flex = options is not None and options.moe_token_dispatcher_type == "flex"
        for setup, setup_flags in {**SETUPS, **SPOT_SETUPS}.items():
            if not _layouts(name, setup):
                continue
            rc, _, err = _run(["estimate", "--model", str(path), "--seq-length", str(SEQ), *_estimate_flags(setup_flags),
                               "--json"])
            if rc != 0:
                if setup in SPOT_SETUPS:  # (a spot check estimate refuses would check nothing)
                    problems.append(f"{name} | {setup}: estimate refuses a spot check's setup: {err.strip()}")
                skipped.append(f"{name} | {setup}: estimate refuses: {err.strip()}")
                continue
            spots = {layout for glob, spot_setup, layouts in SPOT_CHECKS
                     if spot_setup == setup and fnmatch.fnmatchcase(name, glob) for layout in layouts}
            for layout in _layouts(name, setup):
                spot = layout in spots
                flags = {**LAYOUTS, **SPOT_LAYOUTS}[layout]
                key = f"{name} | {layout} | {setup}"
                argv = ["memory", "--model", str(path), "--seq-length", str(SEQ), *flags, *setup_flags]
                invalid = megatron_core_refuses(spec, flags, biases, flex)
                try:
                    rc, out, err = _run([*argv, "--json"])
                except Exception as exc:  # a traceback where a user error belongs
                    problems.append(f"{key}: raised {type(exc).__name__}: {exc}")
                    continue
                if invalid is not None:
                    if rc == 0:
                        problems.append(f"{key}: memory accepts a layout megatron-core refuses ({invalid})")
                    if spot:  # (a spot check megatron-core refuses would check nothing)
                        problems.append(f"{key}: a spot check of a layout megatron-core refuses ({invalid})")
                    continue
                if rc != 0:
                    gaps.setdefault(key, []).append(f"refused: {err.strip()}")
                    continue
                report = json.loads(out)
                for need in report["needs_input"]:
                    needs.setdefault(name, set()).add(need["flag"])
                    if f"total, without {need['excluded']}" not in format_reports({"r": report}, []):
                        problems.append(f"{key}: a total without {need['excluded']} printed as the total")
                gaps_here = [f"not modelled: {r}" for r in report["not_modelled"]]
                if gaps_here:
                    gaps.setdefault(key, []).extend(gaps_here)
                problems += [f"{key}: unlabelled figure {f}" for f in unlabelled_figures(report)]
                text = format_reports({setup or "this setup": report}, [])  # the text form of this report
                if "None" in text:
                    problems.append(f"{key}: 'None' in the text output")
                if report["per_gpu"]["activations_bytes"] is None and "total, activations not included" not in text:
                    problems.append(f"{key}: a total without activations printed as the total")
    return {"gaps": gaps, "needs": needs, "problems": problems, "skipped": skipped}


@pytest.fixture(scope="module")
def survey(tmp_path_factory) -> dict[str, Any]:
    return _survey(_model_files(tmp_path_factory.mktemp("models")))


def test_every_figure_is_an_integer_or_labelled_and_nothing_raises(survey):
    assert survey["problems"] == []


def test_gaps_are_exactly_the_expected_ones(survey):
    observed = [(key, reason) for key, reasons in survey["gaps"].items() for reason in reasons]

    def matches(key: str, reason: str, entries: list[tuple[str, str]]) -> bool:
        return any(fnmatch.fnmatchcase(key, glob) and re.search(pattern, reason) for glob, pattern in entries)

    unexpected = [f"{key}: {reason}" for key, reason in observed if not matches(key, reason, FRAMEWORK_REFUSES + GAPS)]
    assert unexpected == [], "new gaps (close them, or list them in GAPS, or in FRAMEWORK_REFUSES with the reason)"
    for name, entries in (("FRAMEWORK_REFUSES", FRAMEWORK_REFUSES), ("GAPS", GAPS)):
        stale = [entry for entry in entries if not any(matches(key, reason, [entry]) for key, reason in observed)]
        assert stale == [], f"gaps closed: delete these {name} entries"


def test_inputs_a_report_needs_are_named_not_gaps(survey):
    assert {name: sorted(flags) for name, flags in survey["needs"].items()} == \
        {name: [flag] for name, flag in NEEDS_INPUT.items()}


def test_silent_hf_gaps_are_still_silent(tmp_path):
    stale = []
    for case in SILENT_HF_GAPS:
        model_type, kw = _hf_cases()[case]
        raw = json.loads(transformers.AutoConfig.for_model(model_type, **kw).to_json_string())
        reports = []
        for name, data in (("family", raw), ("llama", {**raw, "model_type": "llama", "architectures": None})):
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(data))
            rc, out, err = _run(["memory", "--model", str(path), "--seq-length", str(SEQ), "--json"])
            assert rc == 0, err
            reports.append(json.loads(out))
        family, llama = reports
        if family["per_gpu"]["activations_bytes"] != llama["per_gpu"]["activations_bytes"] \
                or family["not_modelled"] or family["unmeasured"] != llama["unmeasured"]:
            stale.append(case)
    assert stale == [], "modelled or labelled now: delete these SILENT_HF_GAPS entries"


def test_memory_reads_every_model_estimate_reads_but_for_the_named_flags():
    def flags(command: str) -> set[str]:
        sub = next(a for a in PARSER._actions if a.dest == "command").choices[command]  # type: ignore[attr-defined]
        return {s for action in sub._actions for s in action.option_strings if s.startswith("--")}

    missing = flags("estimate") - flags("memory") - FLOPS_ONLY_FLAGS - {"--help"}
    assert missing == MISSING_MEMORY_FLAGS
