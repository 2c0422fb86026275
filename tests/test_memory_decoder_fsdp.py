"""A megatron-core ``GPTModel`` (local spec) under torch FSDP2 as Megatron-LM's ``--use-torch-fsdp2``
builds it (``Float16Module``, then megatron-core's ``TorchFullyShardedDataParallel``: ``fully_shard``
on every ``TransformerLayer`` and the embedding, then the root; ``get_megatron_optimizer``), one real
step of megatron-core's schedule in 2 gloo processes: parameter shards, gradient shards, the
optimizer's main copies and Adam moments, and the all-gather/reduce-scatter payloads, against
:func:`megatron_flops.memory.decoder_fsdp.fsdp_decoder_rank`, to the byte on every rank."""

from __future__ import annotations

import dataclasses
import math

import pytest

import mcore_cpu
import mcore_dist
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.decoder_fsdp import fsdp_decoder_rank, real_rows
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory
from megatron_flops.model.spec import ModelSpec

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

WORLD = 2
VOCAB = 96
SEQ = 16
MBS = 2
# Odd widths: dim 0 of most weights does not divide by 2 x ... (FSDP2 pads each to ceil(dim0 / DP) rows).
BASE = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=75, hidden_dropout=0.0,
            attention_dropout=0.0)

# name -> model fields, build options, micro-batches
RUNS = {
    "DP2, bf16, biases, learned positions, untied, Adam, M=2": dict(
        model=dict(BASE, add_bias_linear=True), m=2,
        build=dict(params_dtype="bf16", position_embedding_type="learned_absolute")),
    "DP2, fp32, GQA, SwiGLU, RoPE, LoRA on linear_qkv and linear_fc2 (rank 3), frozen base, M=1": dict(
        model=dict(BASE, num_query_groups=2, gated_linear_unit=True, add_bias_linear=False), m=1,
        build=dict(params_dtype="fp32", lora=(("linear_qkv", "linear_fc2"), 3))),
    # (The router [3, 48] and the shared experts' gate [1, 48]: rows 2 and 1 on rank 0, 1 and 0 on rank 1.)
    "DP2, bf16, MoE (3 experts, top-2, allgather) with a gated shared expert in layer 1, RMSNorm, M=1": dict(
        model=dict(BASE, normalization="RMSNorm", add_bias_linear=False, num_moe_experts=3, moe_router_topk=2,
                   moe_ffn_hidden_size=36, moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True,
                   moe_layer_freq=[0, 1]), m=1, build=dict(params_dtype="bf16"), step=False),
}
# step=False: no optimizer step (with MoE layers megatron-core 0.16.1's grad-norm asserts here that
# all gradient DTensors share one process group; not investigated): weights, gradients, payloads.


def _fsdp_training(model_kwargs: dict, *, params_dtype: str, position_embedding_type: str = "rope",
                   lora: tuple | None = None, wrap=None):
    """Megatron-LM's ``get_model`` + ``get_megatron_optimizer`` with ``--use-torch-fsdp2``
    (``wrap``: the GPT to the model FSDP2 wraps, e.g. a VLM holding it)."""
    import torch
    from megatron.core.distributed import TorchFullyShardedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from torch.distributed.device_mesh import DeviceMesh

    import mcore_memory

    class CpuMesh:  # (test-only) megatron-core builds the mesh for "cuda"
        @staticmethod
        def from_group(group, device_type):
            return DeviceMesh.from_group(group, "cpu")

    tfsdp.DeviceMesh = CpuMesh
    # megatron-core 0.16.1's finalize_model_grads passes force_all_reduce, which the FSDP2 wrapper's
    # (no-op) finish_grad_sync does not take: --use-torch-fsdp2 fails there as released.
    tfsdp.TorchFullyShardedDataParallel.finish_grad_sync = lambda self, **kwargs: None
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[params_dtype]
    kwargs = dict(model_kwargs, params_dtype=dtype, pipeline_dtype=dtype, bf16=params_dtype == "bf16",
                  transformer_impl="local")
    chunks, config = mcore_dist.build_model_chunks(kwargs, VOCAB, SEQ, share_embeddings=False,
                                                   position_embedding_type=position_embedding_type)
    model = chunks[0]
    if lora is not None:
        mcore_memory.apply_lora(model, *lora)
    if wrap is not None:
        model = wrap(model)
    if params_dtype != "fp32":
        model = Float16Module(config, model)
    model = tfsdp.TorchFullyShardedDataParallel(config=config, ddp_config=TorchFullyShardedDataParallelConfig(),
                                                module=model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=params_dtype == "bf16", params_dtype=dtype,
                                 clip_grad=1.0)
    with mcore_memory.on_cpu():
        optimizer = get_megatron_optimizer(opt_config, [model])
    return model, optimizer


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _states(model, optimizer) -> dict:
    import mcore_memory

    params = list(model.parameters())
    out = {"weights": mcore_memory.unique_bytes([_local(p) for p in params]),
           "gradients": mcore_memory.unique_bytes([_local(p.grad) for p in params if p.grad is not None])}
    return out


def _optimizer_states(optimizer) -> dict:
    import mcore_memory

    out: dict = {}
    inner = mcore_memory._inner_optimizers(optimizer)
    main = [_local(p) for opt in inner for g in getattr(opt, "fp32_from_float16_groups", []) for p in g]
    if main:
        out["optimizer/main_params"] = mcore_memory.unique_bytes(main)
    for state in (s for opt in inner for s in opt.optimizer.state.values()):
        for key, value in state.items():
            value = _local(value)
            if value.numel() > 1:
                out[f"optimizer/{key}"] = out.get(f"optimizer/{key}", 0) + value.numel() * value.element_size()
    return out


def fsdp_worker(rank: int, world_size: int, runs: dict) -> dict:
    import torch

    import mcore_memory

    mcore_dist.init_worker()
    mcore_memory.patch_alltoall_dispatcher()
    out = {}
    for name, run in runs.items():
        mcore_memory.reinit_parallel()
        model, optimizer = _fsdp_training(run["model"], **run["build"])
        comm = mcore_memory.CommMeter(mcore_memory.megatron_groups())
        live = mcore_memory.WholeCopiesMeter(model)
        m = run["m"]
        with comm, live:
            mcore_dist.run_schedule(
                [model], num_microbatches=m, micro_batch_size=MBS, seq_length=SEQ, vocab_size=VOCAB,
                data_iterators=[mcore_memory.batches(m, MBS, SEQ, VOCAB, seed=rank)], count_flops=False,
                forward_step_func=mcore_memory.metered_forward_step(mcore_memory.SavedTensorMeter([]), [model]))
            states = _states(model, optimizer)
            if run.get("step", True):
                with mcore_memory.on_cpu():
                    optimizer.step()
                states.update(_optimizer_states(optimizer))
        out[name] = dict(
            names=[(n, tuple(_local(p).shape), tuple(p.shape)) for n, p in model.named_parameters()],
            states=states, comm=dict(comm.bytes), calls=dict(comm.calls), live=live.peak)
        del model, optimizer
        torch.manual_seed(0)
    return out


@pytest.fixture(scope="module")
def measured():
    return mcore_dist.run_by_name(fsdp_worker, WORLD, RUNS, timeout=600)


def setup(name: str):
    """The pure description of run ``name``: parameters (one chunk, untied), training."""
    run = RUNS[name]
    model, build = run["model"], run["build"]
    spec = ModelSpec.from_mapping(dict(model, vocab_size=VOCAB, share_embeddings_and_output_weights=False))
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type=build.get("position_embedding_type", "rope"),
                                               add_bias_linear=model.get("add_bias_linear", True)))
    lora = build.get("lora")
    peft = PeftSpec(frozen=True, lora_rank=lora[1], lora_targets=lora[0]) if lora else None
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=run["m"],
                        params_dtype=build["params_dtype"])
    params = chunk_parameters(spec, options, Parallelism(dp=WORLD, fsdp=True), pp_rank=0, chunk=0, seq_length=SEQ,
                              peft=peft)
    return spec, options, peft, training, params


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_and_shards(measured, name):
    *_, params = setup(name)
    for rank, result in enumerate(measured[name]):
        # (Float16Module and the FSDP wrapper prefix every name with "module.".)
        got = [(n.replace("module.", ""), local, whole) for n, local, whole in result["names"]]
        want = [(p.name, real_rows(p, WORLD, rank), p.numel) for p in params]
        assert [(n, shape[0] if shape else 0, math.prod(whole)) for n, shape, whole in got] == want


@pytest.mark.parametrize("name", list(RUNS))
def test_states_and_communication_every_rank(measured, name):
    *_, training, params = setup(name)
    for rank, result in enumerate(measured[name]):
        states, comm = fsdp_decoder_rank(params, training, dp=WORLD, rank=rank)
        states.pop("fsdp/unsharded_working_copies")  # (a formula: the overlap needs CUDA streams)
        if not RUNS[name].get("step", True):
            states = {k: v for k, v in states.items() if not k.startswith("optimizer/")}
        assert states == result["states"], rank
        assert comm == result["comm"], rank


def test_bf16_run_by_hand():
    # Run 1 on rank 0, in elements of the padded shards (rows ceil(dim0 / 2)): the embedding
    # 48 x 48 + positions 8 x 48 = 2,688; a layer: norms 4 x 24, linear_proj 24 x 48 + 24,
    # linear_qkv 72 x 48 + 72, linear_fc1 38 x 48 + 38 (75 rows: 38 and 37), linear_fc2 24 x 75 + 24
    # = 8,486; the root: final norm 2 x 24 + output layer 48 x 48 = 2,352. Total 2,688 + 2 x 8,486 +
    # 2,352 = 22,012 elements.
    *_, training, params = setup("DP2, bf16, biases, learned positions, untied, Adam, M=2")
    states, comm = fsdp_decoder_rank(params, training, dp=2, rank=0)
    assert states["weights"] == states["gradients"] == 22_012 * 2  # bf16 shards, padding included
    assert states["optimizer/main_params"] == states["optimizer/exp_avg"] == 22_012 * 4  # rank 0: all real rows
    # rank 1 holds 37 of linear_fc1's 38 rows: 2 layers x (48 + 1) = 98 elements fewer.
    assert fsdp_decoder_rank(params, training, dp=2, rank=1)[0]["optimizer/exp_avg"] == (22_012 - 98) * 4
    # Per micro-batch (2) each of the 4 units is gathered twice (2 ranks x its shard, bf16) and its
    # gradient reduce-scattered once.
    assert comm == {"dp/all_gather": 2 * 2 * 2 * 22_012 * 2, "dp/reduce_scatter": 2 * 2 * 22_012 * 2}
    # Working copies: the root gathered (2 x 2,352) and its gradients (2 x 2,352) all backward, beside the
    # heaviest neighbouring units, the two layers (gathered: 2 x 2 x 8,486; the embedding + layer 0 weigh
    # less), and one unsharded layer gradient (2 x 8,486), bf16.
    assert states["fsdp/unsharded_working_copies"] == (2 * 2 * 2_352 + 3 * 2 * 8_486) * 2


def test_root_gathered_all_step_on_cpu(measured):
    # Run 1, measured: on CPU each collective runs to completion (no prefetch overlap), and the peak of
    # whole copies is layer 1's backward, first: the root's gathered weights (2 x 2,352: the final norm
    # 2 x 48 and the output layer 96 x 48, no padding) and their gradients (4,704), layer 1 gathered
    # (2 x 8,486) and its gradients (16,972 less linear_fc1's padding row, 49: 16,923), bf16.
    name = "DP2, bf16, biases, learned positions, untied, Adam, M=2"
    assert [r["live"] for r in measured[name]] == [(2 * 4_704 + 2 * 8_486 + 16_923) * 2] * WORLD


def test_report_and_refusals():
    spec, options, peft, training, _ = setup("DP2, bf16, biases, learned positions, untied, Adam, M=2")
    par = Parallelism(dp=WORLD, fsdp=True)
    report = decoder_memory(spec, options, par, training)
    ddp = decoder_memory(spec, options, Parallelism(dp=WORLD), training)
    top = report.per_gpu
    assert top.activations == ddp.per_gpu.activations  # FSDP2 saves what DDP saves
    assert set(top.communication) == {"dp/all_gather", "dp/reduce_scatter"}
    assert any("fsdp/unsharded_working_copies" in u for u in report.unmeasured)
    with pytest.raises(ValueError, match="--pp 2"):
        decoder_memory(spec, options, dataclasses.replace(par, pp=2), training)
    with pytest.raises(ValueError, match="tied embeddings"):
        decoder_memory(dataclasses.replace(spec, tied_output=True), options, par, training)
    with pytest.raises(ValueError, match="fp16"):
        decoder_memory(spec, options, par, dataclasses.replace(training, params_dtype="fp16"))


def test_megatron_args_use_torch_fsdp2(tmp_path):
    # A Megatron-LM command line with --use-torch-fsdp2 is the model file with --fsdp.
    import contextlib
    import io
    import json

    from megatron_flops.cli import main

    def memory(*argv: str) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["memory", *argv, "--json"]) == 0
        return json.loads(out.getvalue())

    args = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
            "--max-position-embeddings 16 --vocab-size 100 --untie-embeddings-and-output-weights --bf16 "
            "--use-torch-fsdp2")
    path = tmp_path / "model.json"
    path.write_text(json.dumps(dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                    vocab_size=100, share_embeddings_and_output_weights=False,
                                    bias_activation_fusion=True, attention_softmax_in_fp32=False)))
    from_args = memory("--megatron-args", args, "--dp", "2")
    from_file = memory("--model", str(path), "--seq-length", "16", "--fsdp", "--dp", "2")
    assert "FSDP2" in from_args["assumptions"]
    assert {**from_args, "not_modelled": []} == {**from_file, "not_modelled": []}


def _cli_report(*extra: str) -> dict:
    import contextlib
    import io
    import json
    from pathlib import Path

    from megatron_flops.cli import main

    model = str(Path(__file__).resolve().parent.parent / "examples" / "llama3_8b.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", "--model", model, "--seq-length", "4096", "--dp", "8", "--num-microbatches", "4",
                     "--params-dtype", "bf16", "--json", *extra]) == 0
    report = json.loads(out.getvalue())
    return report if "per_gpu" in report else next(iter(report.values()))


@pytest.mark.parametrize("extra, shown", [
    (("--fsdp",), {"weights": 2.0, "gradients": 2.0, "fsdp/unsharded_working_copies": 4.6, "activations": 21.9,
                   "total": 42.6, "dp/all_gather": 128.5, "dp/reduce_scatter": 64.2}),
    (("--distributed-optimizer",), {"weights": 16.1, "gradients": 32.1, "total": 82.1, "moved": 48.2}),
    (("--fsdp", "--frozen", "--lora-rank", "16"), {"total": 26.5, "dp/reduce_scatter": 0.3}),
])
def test_docs_llama3_fsdp_figures(extra, shown):
    # docs/memory.md's Llama-3-8B paragraph (8 GPUs, 4 micro-batches of 4096 tokens, bf16), in GB.
    report = _cli_report(*extra)
    gpu, comm = report["per_gpu"], report["communication_per_step"]
    got = {**gpu["components"], **comm, "total": gpu["total_bytes"], "moved": comm["total_bytes"]}
    assert {key: round(got[key] / 1e9, 1) for key in shown} == shown
