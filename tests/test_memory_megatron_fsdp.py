"""Megatron-FSDP (:mod:`megatron_flops.memory.megatron_fsdp`): a formula, as its buffers and
collectives need CUDA. What runs on CPU is checked against megatron-core 0.16.1 itself: its
parameter grouping, bucketing and chunk size factors (``_get_parameter_groups`` on a real
``GPTModel``) and each bucket's layout and padding (``build_data_parallel_buffer_index``, which
takes the DP size as an argument: DP 1, 2, 4 and 8 without a process group). The rest is held to
what must hold: ``no_shard`` equals DDP, the optimizer shards add up to DDP's optimizer state,
each strategy shards what it names."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import mcore_cpu
from megatron_flops.cli import main
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import FSDP_STRATEGIES, Parallelism, Training
from megatron_flops.memory.megatron_fsdp import bucket_layout, fsdp_buckets, megatron_fsdp_rank
from megatron_flops.memory.report import decoder_memory
from megatron_flops.model.spec import ModelSpec

VOCAB = 96
# Row sizes that are not multiples of each other (48, 72, 56): lcm chunk factors and gap filling.
MODELS = {
    "dense GQA SwiGLU, untied": dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2,
                                     ffn_hidden_size=72, gated_linear_unit=True,
                                     share_embeddings_and_output_weights=False),
    "MoE every other layer, shared experts, LayerNorm biases": dict(
        num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, num_moe_experts=4,
        moe_router_topk=2, moe_ffn_hidden_size=56, moe_shared_expert_intermediate_size=40, moe_layer_freq=[0, 1]),
}


def _spec_options(fields: dict) -> tuple[ModelSpec, DecoderOptions]:
    spec = ModelSpec.from_mapping(dict(fields, vocab_size=VOCAB))
    options = DecoderOptions.from_mapping(dict(fields, padded_vocab_size=VOCAB, position_embedding_type="rope",
                                               add_bias_linear=False))
    return spec, options


@pytest.fixture(scope="module")
def megatron_layouts():
    """Per model, strategy, bucket size and DP: megatron-core's buckets as (names, expert,
    requires_grad, chunk size factor, padded size, each parameter's start)."""
    if not mcore_cpu.HAVE_MCORE:
        pytest.skip(mcore_cpu.SKIP_REASON)
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer

    mcore_cpu.init_single_process()
    out = {}
    for name, fields in MODELS.items():
        config = dict(fields)
        if config.pop("gated_linear_unit", False):
            config.update(gated_linear_unit=True)
        model = mcore_cpu.build_gpt(config, vocab_size=VOCAB, max_seq_len=16,
                                    share_embeddings=config.pop("share_embeddings_and_output_weights", True))
        names = {p: n for n, p in model.named_parameters()}
        for strategy in FSDP_STRATEGIES:
            units = [TransformerLayer] if strategy == "optim_grads_params" else []
            for bucket_size in (None, 5000):
                policy = pgb.BucketingPolicy(suggested_bucket_size=bucket_size, fsdp_unit_modules=units,
                                             data_parallel_sharding_strategy=strategy)
                groups, _, _ = pgb._get_parameter_groups(model, policy, {})
                ddp = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
                for dp in (1, 2, 4, 8):
                    rows = []
                    for g in groups:
                        items, bucket, _ = pgb.build_data_parallel_buffer_index(
                            [p.shape for p in g.params], 0, dp, strategy != "no_shard", ddp,
                            chunk_size_factor=g.chunk_size_factor)
                        rows.append(([names[p] for p in g.params], g.is_expert_param, g.requires_grad,
                                     g.chunk_size_factor, bucket.size,
                                     [items[i].global_data_index for i in range(len(g.params))]))
                    out[name, strategy, bucket_size, dp] = rows
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("strategy", FSDP_STRATEGIES)
def test_buckets_and_layouts_are_megatron_cores(megatron_layouts, name, strategy):
    spec, options = _spec_options(MODELS[name])
    params = chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=16)
    for bucket_size in (None, 5000):
        for dp in (1, 2, 4, 8):
            ours = []
            for b in fsdp_buckets(params, strategy=strategy, bucket_size=bucket_size):
                size, spans = bucket_layout(b, dp, strategy)
                ours.append(([p.name for p in b.params], b.group == "expt_dp", b.trainable, b.chunk, size,
                             [start for start, _ in spans]))
            assert ours == megatron_layouts[name, strategy, bucket_size, dp], (bucket_size, dp)


LAYOUTS = {
    "DP2 bf16": (dict(dp=2), "bf16"),
    "DP4 fp32, 3 micro-batches": (dict(dp=4), "fp32"),
    "TP2 SP DP2": (dict(tp=2, dp=2, sequence_parallel=True), "bf16"),
    "DP4 EP2": (dict(dp=4, ep=2), "bf16"),
}


def _report(name: str, layout: str, strategy: str | None):
    spec, options = _spec_options(MODELS[name])
    sizes, dtype = LAYOUTS[layout]
    if spec.moe is None and sizes.get("ep", 1) > 1:
        pytest.skip("EP needs experts")
    par = Parallelism(**sizes, megatron_fsdp=strategy)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=3, params_dtype=dtype)
    return decoder_memory(spec, options, par, training)


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if "EP" not in k])
def test_no_shard_is_ddp(layout):
    # no_shard: no padding, nothing sharded, the gradients all-reduced once per step; with 16-bit
    # weights, fp32 main copies as DDP's optimizer keeps them. (fp32 weights: Megatron-FSDP keeps
    # an fp32 main copy beside them, preserve_fp32_weights, which DDP does not.) The dense model's
    # buckets have no gaps; the MoE model's do: even unsharded, megatron-core starts parameters on
    # chunk boundaries (the layouts above), so its buffers exceed DDP's by those gaps.
    name = "dense GQA SwiGLU, untied"
    fsdp, ddp = _report(name, layout, "no_shard"), _report(name, layout, None)
    fp32 = LAYOUTS[layout][1] == "fp32"
    for a, b in zip(fsdp.stages, ddp.stages):
        states = dict(a.states)
        if fp32:
            assert states.pop("optimizer/main_params") == b.states["gradients"]  # (fp32 grads: the same numel)
        assert states == b.states
        assert a.communication == b.communication


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("strategy", FSDP_STRATEGIES)
def test_optimizer_shards_add_up_to_ddps_and_each_strategy_shards_what_it_names(name, strategy):
    spec, options = _spec_options(MODELS[name])
    params = chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=16)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=3)
    dp = 4
    moments = 0
    for rank in range(dp):
        states, comm = megatron_fsdp_rank(params, training, strategy=strategy, sizes={"dp": dp, "expt_dp": dp},
                                          ranks={"dp": rank, "expt_dp": rank}, bucket_size=None)
        moments += states["optimizer/exp_avg"]
        if strategy == "no_shard":
            continue
        # Every bucket is padded to DP x its chunk factor: a sharded buffer is 1/DP of the whole
        # one, which the collectives move (bf16 weights, fp32 gradients and main weights).
        m = training.num_microbatches
        payload = {kind: sum(v for k, v in comm.items() if k.endswith(kind)) for kind in ("all_gather",
                                                                                        "reduce_scatter")}
        whole_weights = payload["all_gather"] // (2 * m if strategy == "optim_grads_params" else 1)
        whole_grads = payload["reduce_scatter"] // (1 if strategy == "optim" else m)
        assert states["optimizer/main_params"] * dp == 2 * whole_weights
        assert states["gradients"] * (1 if strategy == "optim" else dp) == whole_grads
        assert states["weights"] * (dp if strategy == "optim_grads_params" else 1) == whole_weights
    # Over the DP ranks, the moments of every trainable element once, as the distributed optimizer.
    assert moments == (dp if strategy == "no_shard" else 1) * 4 * sum(p.numel for p in params if p.trainable)


def _memory(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("strategy", FSDP_STRATEGIES)
def test_megatron_args_and_the_flag_agree_and_the_figures_are_labelled(strategy, tmp_path):
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
            "--max-position-embeddings 16 --vocab-size 100 --bf16 --use-megatron-fsdp "
            f"--data-parallel-sharding-strategy {strategy}")
    from_args = _memory("--megatron-args", line, "--dp", "2")
    base = _memory("--megatron-args", line.split(" --use-megatron-fsdp")[0], "--dp", "2", "--megatron-fsdp", strategy)
    assert from_args == base
    assert f"Megatron-FSDP ({strategy})" in from_args["assumptions"]
    assert any(u.startswith(f"Megatron-FSDP ({strategy})") for u in from_args["unmeasured"])


def test_megatron_lms_default_strategy_is_no_shard():
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
            "--max-position-embeddings 16 --vocab-size 100 --bf16 --use-megatron-fsdp")
    assert "Megatron-FSDP (no_shard)" in _memory("--megatron-args", line, "--dp", "2")["assumptions"]


def test_unsharded_working_copies_only_where_something_is_gathered_whole():
    spec, options = _spec_options(MODELS["dense GQA SwiGLU, untied"])
    params = chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=16)
    training = Training(seq_length=16, micro_batch_size=2)
    for strategy in FSDP_STRATEGIES:
        states, _ = megatron_fsdp_rank(params, training, strategy=strategy, sizes={"dp": 2, "expt_dp": 2},
                                       ranks={"dp": 0, "expt_dp": 0}, bucket_size=None)
        assert ("megatron_fsdp/unsharded_working_copies" in states) == (strategy in ("optim_grads",
                                                                                     "optim_grads_params"))
