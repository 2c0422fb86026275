"""Test-only: one Megatron-FSDP training step of a tiny GPT with a frozen base (LoRA adapters on
``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, everything else frozen) or LoRA on a
trained base, in 2 gloo processes, in whichever environment runs it: this one (megatron-core
0.16.1, which cannot wrap a frozen parameter) or Megatron-Bridge 0.6.2's Python 3.12 venv
(megatron-core 0.19.2: ``python tests/mfsdp_frozen_step.py RUNS_JSON``, the results as JSON on the
last line of stdout). Used by tests/test_memory_megatron_fsdp_frozen.py."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frameworks.cpu_shims import install_nvrx_version  # noqa: E402

install_nvrx_version()  # (megatron-core >= 0.19 reads nvrx's version at import)

import mcore_dist  # noqa: E402

VOCAB = 96
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
RANK = 4
# 2 layers, GQA, untied: the tests' Megatron-FSDP step model.
MODEL = dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=72,
             hidden_dropout=0.0, attention_dropout=0.0)


def step_worker(rank: int, world_size: int, runs: dict) -> dict:
    """Per run name ``(strategy, micro-batches, frozen[, layers])``: the Megatron-FSDP buffers and optimizer
    shards after a step after the first, and that step's collectives per group (or the error)."""
    import torch
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    import mcore_memory

    mcore_dist.init_worker()
    mcore_memory.patch_megatron_fsdp_on_cpu()
    mcore_memory.bridge_peft = lambda module="utils": None  # (the stand-in adapter in every environment)
    out: dict = {}
    for name, (strategy, m, frozen, *layers) in runs.items():
        mcore_dist.reinit_model_parallel()
        kwargs = dict(MODEL, num_layers=layers[0] if layers else MODEL["num_layers"], params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True)
        chunks, config = mcore_dist.build_model_chunks(kwargs, VOCAB, 16, share_embeddings=False)
        mcore_memory.apply_lora(chunks[0], TARGETS, RANK)
        if not frozen:
            for p in chunks[0].parameters():
                p.requires_grad_(True)
        try:
            model = mcore_memory.wrap_megatron_fsdp(config, Float16Module(config, chunks[0]), strategy)
        except Exception as exc:  # (megatron-core 0.16.1 on a frozen parameter)
            out[name] = dict(error=f"{type(exc).__name__}: {exc}")
            continue
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                                     use_distributed_optimizer=True, clip_grad=1.0)
        with mcore_memory.on_cpu():
            optimizer = get_megatron_optimizer(opt_config, [model])
        comm = mcore_memory.CommMeter(mcore_memory.megatron_groups())
        try:
            for step in range(2):  # (the first step gathers once more: its buckets start empty)
                with comm if step else contextlib.nullcontext():
                    mcore_dist.run_schedule([model], num_microbatches=m, micro_batch_size=2, seq_length=16,
                                            vocab_size=VOCAB, count_flops=False, seed=step)
                    with mcore_memory.on_cpu():
                        optimizer.step()
        except Exception as exc:  # (megatron-core 0.19.2's optim strategy, in finish_grad_sync)
            out[name] = dict(error=f"{type(exc).__name__}: {exc}")
            continue
        out[name] = dict(states=mcore_memory.megatron_fsdp_state_bytes(model, optimizer), comm=dict(comm.bytes))
    return out


def main() -> None:
    runs = {name: tuple(run) for name, run in json.loads(sys.argv[1]).items()}
    print(json.dumps(mcore_dist.run_by_name(step_worker, 2, runs, timeout=600)))


if __name__ == "__main__":
    main()
