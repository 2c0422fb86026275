"""A WAN-like DiT under Megatron-FSDP (:mod:`megatron_flops.memory.dit_megatron_fsdp`) against
megatron-core 0.16.1: the example's module (``examples/wan_dit_fsdp2.py``) wrapped as Megatron-LM's
``--use-megatron-fsdp`` wraps a model (``Float16Module``, then ``FullyShardedDataParallel`` with each
``WanAttentionBlock`` an FSDP unit, as Bridge's ``WanLayerWithAdaLN`` is a ``TransformerLayer``) with
``get_megatron_optimizer``, in 2 gloo processes (tests/mcore_memory's CPU stubs for its CUDA streams).
A step after the first (``no_sync`` but for the last micro-batch, ``finalize_model_grads``, the
optimizer step): the model-weight, main-weight and main-gradient buffers, the optimizer's shards and
the payload of every collective per rank, to the byte, per strategy; fully trained and LoRA on a
frozen base. Then each strategy against the distributed optimizer, one term at a time."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path

import pytest

import mcore_cpu
import mcore_dist
from megatron_flops.flops.dit import DiTSpec
from megatron_flops.memory.dit_layouts import dit_layout_report, dit_rank_params
from megatron_flops.memory.dit_megatron_fsdp import dit_megatron_fsdp_states, most_loaded_rank
from megatron_flops.memory.layout import Parallelism, Training

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD = 2
RAW = json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())
I2V = {"image_dim": 20, "image_len": 5}
# name -> (dit overrides, every block checkpointed, strategy, micro-batches)
RUNS = {
    "optim": ({}, False, "optim", 2),
    "optim_grads": ({}, False, "optim_grads", 2),
    "optim_grads_params": ({}, False, "optim_grads_params", 3),
    "optim_grads_params, image-to-video (img_emb widths 20: lcm chunk factors)": (I2V, False, "optim_grads_params", 1),
    "optim_grads_params, every block checkpointed": ({}, True, "optim_grads_params", 2),
}


def _raw(name: str) -> dict:
    dit, checkpointed, *_ = RUNS[name]
    raw = copy.deepcopy(RAW)
    raw["dit"].update(dit)
    raw.pop("lora")
    if not checkpointed:
        raw.pop("recompute_granularity")
    return raw


def fsdp_worker(rank: int, world_size: int, runs: dict) -> dict:
    import torch
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    import mcore_memory

    sys.path.insert(0, str(EXAMPLES))
    import wan_dit_fsdp2 as example

    mcore_dist.init_worker()
    mcore_memory.patch_megatron_fsdp_on_cpu()
    out = {}
    for name, (raw, strategy, num_mb) in runs.items():
        spec = DiTSpec.from_mapping(raw["dit"])
        config = mcore_cpu.make_config(dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                                            num_attention_heads=spec.num_heads, ffn_hidden_size=spec.ffn_hidden_size,
                                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True))
        model = mcore_memory.wrap_megatron_fsdp(config, Float16Module(config, example.build_model(raw)), strategy,
                                                [example.WanAttentionBlock])
        with mcore_memory.on_cpu():
            optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                clip_grad=1.0), [model])
        stream = example.microbatches(spec, example.Options(), rank)
        comm = mcore_memory.CommMeter(mcore_memory.megatron_groups())
        for step in range(2):  # (the first step gathers once more: its buffers start empty)
            with comm if step else contextlib.nullcontext(), mcore_cpu.cuda_to_cpu_mode():
                model.zero_grad_buffer()
                for m in range(num_mb):
                    batch, t = next(stream)
                    with model.no_sync() if m < num_mb - 1 else contextlib.nullcontext():
                        pred = model([c.latent for c in batch], t, [c.text for c in batch], None)
                        torch.nn.functional.mse_loss(pred.float(), torch.cat([c.target for c in batch])).backward()
                finalize_model_grads([model])
                with mcore_memory.on_cpu():
                    optimizer.step()
        out[name] = dict(states=mcore_memory.megatron_fsdp_state_bytes(model, optimizer), comm=dict(comm.bytes))
    return out


@pytest.fixture(scope="module")
def measured():
    if not mcore_cpu.HAVE_MCORE:
        pytest.skip(mcore_cpu.SKIP_REASON)
    runs = {name: (_raw(name), *RUNS[name][2:]) for name in RUNS}
    return mcore_dist.run_by_name(fsdp_worker, WORLD, runs, timeout=600)


def _setup(name: str):
    _, checkpointed, strategy, num_mb = RUNS[name]
    return (DiTSpec.from_mapping(_raw(name)["dit"]), checkpointed, Parallelism(dp=WORLD, megatron_fsdp=strategy),
            Training(seq_length=16, micro_batch_size=2, num_microbatches=num_mb))


@pytest.mark.dist
@pytest.mark.parametrize("name", list(RUNS))
def test_states_and_collectives_every_rank(measured, name):
    from megatron_flops.memory.megatron_fsdp import megatron_fsdp_rank
    from megatron_flops.memory.dit_megatron_fsdp import DIT_UNIT

    spec, _, par, training = _setup(name)
    params = dit_rank_params(spec, par, pp_rank=0)
    assert par.megatron_fsdp is not None
    for rank, result in enumerate(measured[name]):
        states, comm = megatron_fsdp_rank(params, training, strategy=par.megatron_fsdp, sizes={"dp": WORLD, "expt_dp": 1},
                                          ranks={"dp": rank, "expt_dp": 0}, bucket_size=None, unit=DIT_UNIT)
        states.pop("megatron_fsdp/unsharded_working_copies", None)  # (a formula: not measurable here)
        assert states == result["states"], rank
        assert comm == result["comm"], rank
    # The report's rank is the one whose shards hold the most moments.
    most = max(range(WORLD), key=lambda r: (measured[name][r]["states"]["optimizer/exp_avg"], -r))
    assert most_loaded_rank(params, strategy=par.megatron_fsdp, size=WORLD, bucket_size=None) == most


SPEC = DiTSpec.from_mapping(RAW["dit"])  # h 32, f 64, 2 blocks: 36,976 parameters (69 tensors)
TRAINING = Training(seq_length=16, micro_batch_size=1, num_microbatches=4)


def _report(**par) -> dict:
    return dit_layout_report(SPEC, Parallelism(dp=2, **par), TRAINING)


def test_buckets_each_block_a_unit():
    # optim, optim_grads: one group of all 69 tensors, chunk size factor 192 (the lcm of their row sizes:
    # the adaLN tables' 6 x 32, ffn.2's 64, text_embedding.0's 24, the patch embedding's 16, the rest 32
    # or 1), laid out with gaps and padding into 37,248 = 97 x (DP 2 x 192) elements. optim_grads_params:
    # the 15 tensors outside the blocks (10,928 elements -> 11,136 = 29 x 384) and each block's 27
    # (13,024 -> 13,056 = 34 x 384).
    from megatron_flops.memory.dit_megatron_fsdp import DIT_UNIT
    from megatron_flops.memory.megatron_fsdp import bucket_layout, fsdp_buckets

    params = dit_rank_params(SPEC, Parallelism(dp=2), pp_rank=0)
    for strategy, want in (("optim", [(None, 69, 37_248)]),
                           ("optim_grads_params", [(None, 15, 11_136), ("blocks.0.", 27, 13_056),
                                                   ("blocks.1.", 27, 13_056)])):
        buckets = fsdp_buckets(params, strategy=strategy, bucket_size=None, unit=DIT_UNIT)
        assert [(b.unit, len(b.params), bucket_layout(b, 2)[0]) for b in buckets] == want
        assert {b.chunk for b in buckets} == {192}


def test_each_strategy_shards_one_more_term():
    optim, grads, params = (_report(megatron_fsdp=s) for s in ("optim", "optim_grads", "optim_grads_params"))
    # optim: bf16 weights and fp32 gradients whole (37,248 elements), fp32 main weights over this rank's
    # 18,624 (rank 0's half holds no padding: moments over all of them); once per step the gradients
    # reduce-scattered twice (the last backward, finish_grad_sync: no overlap) and the weights all-gathered.
    assert optim["per_gpu"]["components"] == {
        "weights": 2 * 37_248, "gradients": 4 * 37_248, "optimizer/main_params": 4 * 18_624,
        "optimizer/exp_avg": 4 * 18_624, "optimizer/exp_avg_sq": 4 * 18_624,
        "activations": optim["per_gpu"]["activations_bytes"]}
    assert optim["communication_per_step"] == {"dp/reduce_scatter": 2 * 4 * 37_248, "dp/all_gather": 2 * 37_248,
                                               "total_bytes": 10 * 37_248}
    # optim_grads: the gradients sharded too (one term), reduce-scattered every micro-batch (4), one
    # unsharded gradient bucket alive (a formula).
    delta = {k: v - optim["per_gpu"]["components"].get(k, 0) for k, v in grads["per_gpu"]["components"].items()}
    assert {k: v for k, v in delta.items() if v} == {"gradients": -4 * 18_624,
                                                     "megatron_fsdp/unsharded_working_copies": 4 * 37_248}
    assert grads["communication_per_step"]["dp/reduce_scatter"] == 4 * 4 * 37_248
    # optim_grads_params: the weights sharded too (37,248 / 2 bf16), all-gathered once outside the
    # blocks (11,136) and per block every forward and backward (2 x 4 micro-batches x 13,056 each); the
    # working copies (a formula): two neighbouring gathered blocks (2 x 13,056 bf16) and one block's
    # unsharded fp32 gradients (13,056) in place of the whole gradient bucket.
    delta = {k: v - grads["per_gpu"]["components"][k] for k, v in params["per_gpu"]["components"].items()}
    copies = 2 * 2 * 13_056 + 4 * 13_056
    assert {k: v for k, v in delta.items() if v} == {"weights": -2 * 18_624,
                                                     "megatron_fsdp/unsharded_working_copies": copies - 4 * 37_248}
    assert params["communication_per_step"]["dp/all_gather"] == 2 * (11_136 + 2 * 2 * 4 * 13_056)


def test_against_the_distributed_optimizer():
    # The same parameters, other padding: the distributed optimizer aligns each parameter to 64 elements
    # (38,144 in all), Megatron-FSDP packs them into chunks of 192 (37,248). Over both ranks each keeps
    # Adam moments for every one of the 36,976 elements once; fp32 main weights: the distributed
    # optimizer for its real elements, Megatron-FSDP for its whole shard, padding included.
    distopt = _report(distributed_optimizer=True)
    optim = _report(megatron_fsdp="optim")
    assert distopt["per_gpu"]["weights_bytes"] - optim["per_gpu"]["weights_bytes"] == 2 * (38_144 - 37_248)
    assert distopt["per_gpu"]["gradients_bytes"] - optim["per_gpu"]["gradients_bytes"] == 4 * (38_144 - 37_248)
    params = dit_rank_params(SPEC, Parallelism(dp=2), pp_rank=0)
    from megatron_flops.memory.dit_megatron_fsdp import DIT_UNIT
    from megatron_flops.memory.megatron_fsdp import megatron_fsdp_rank

    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        moments = sum(megatron_fsdp_rank(params, TRAINING, strategy=strategy, sizes={"dp": 2, "expt_dp": 1},
                                         ranks={"dp": r, "expt_dp": 0}, bucket_size=None,
                                         unit=DIT_UNIT)[0]["optimizer/exp_avg"] for r in range(2))
        assert moments == 4 * 36_976
    # Everything outside the data-parallel states is the same report: activations, labels of the attention.
    assert optim["per_gpu"]["activations_bytes"] == distopt["per_gpu"]["activations_bytes"]


def test_labels(capsys):
    from megatron_flops.cli import main

    report = _report(megatron_fsdp="optim_grads_params")
    assert "Megatron-FSDP (optim_grads_params)" in report["modelling_assumptions"][-1]
    assert any(u.startswith("megatron_fsdp/unsharded_working_copies") for u in report["unmeasured"])
    assert not any("Megatron-FSDP with" in u for u in report["unmeasured"])
    tp = dit_layout_report(SPEC, Parallelism(tp=2, dp=2, megatron_fsdp="optim_grads_params"), TRAINING)
    assert any(u.startswith("Megatron-FSDP with TP 2") for u in tp["unmeasured"])
    # The tiny file's LoRA on a frozen base: megatron-core 0.16.1 cannot wrap frozen parameters.
    assert main(["memory", "--model", str(EXAMPLES / "wan_tiny_dit.json"), "--seq-length", "16", "--dp", "2",
                 "--megatron-fsdp", "optim_grads", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert any(u.startswith("Megatron-FSDP with a frozen base") for u in cli["unmeasured"])
    assert "Megatron-FSDP (optim_grads)" in cli["assumptions"]
