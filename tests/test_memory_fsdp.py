"""A WAN-like DiT (``examples/wan_dit_fsdp2.py``) under torch FSDP2 in 4 gloo processes, LoRA and
full training: parameter shards, gradients, Adam (and SGD momentum) state and the all-gather/reduce-scatter payload
of one real step (two micro-batches, gradient sync on the last) against
:func:`megatron_flops.memory.fsdp.fsdp_rank_memory`, to the byte on every rank."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

import mcore_dist
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec, dit_block_parameters, dit_parameter_counts, dit_root_parameters
from megatron_flops.memory.fsdp import fsdp_rank_memory
from megatron_flops.memory.layout import Training

pytestmark = pytest.mark.dist

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD = 4
RAW = json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())
I2V = {"image_dim": 20, "image_len": 5}

# name -> (dit overrides, lora section or None, params dtype, micro-batches, optimizer)
RUNS = {
    "LoRA q,k,v,o rank 4, frozen base, bf16 compute (MixedPrecisionPolicy), blocks checkpointed": (
        {}, {"dim": 4, "target_modules": ["q", "k", "v", "o"]}, "bf16", 2, "adam"),
    "full training, image-to-video, fp32": (I2V, None, "fp32", 2, "adam"),
    "LoRA rank 3 (uneven shards) on q,k,v,o,k_img,v_img,ffn.0, image-to-video, bf16": (
        I2V, {"dim": 3, "target_modules": ["q", "k", "v", "o", "k_img", "v_img", "ffn.0"]}, "bf16", 1, "adam"),
    # SGD with momentum: one fp32 momentum buffer per real row of each trainable shard.
    "full training, bf16, SGD with momentum": ({}, None, "bf16", 1, "sgd"),
}


def _raw(name: str) -> dict:
    dit, lora = RUNS[name][:2]
    raw = copy.deepcopy(RAW)
    raw["dit"].update(dit)
    raw.pop("lora")
    if lora is not None:
        raw["lora"] = lora
    return raw


def fsdp_worker(rank: int, world_size: int, runs: dict) -> dict:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mcore_memory

    sys.path.insert(0, str(EXAMPLES))
    import wan_dit_fsdp2 as example

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, (raw, dtype, num_mb, optimizer_name) in runs.items():
        model = example.build_model(raw)
        bf16 = dtype == "bf16"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        params = list(model.parameters())
        trained = [p for p in params if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-3) if optimizer_name == "adam" \
            else torch.optim.SGD(trained, lr=1e-3, momentum=0.9)
        spec = DiTSpec.from_mapping(raw["dit"])
        stream = example.microbatches(spec, example.Options(), rank)
        comm = mcore_memory.CommMeter([("fsdp", mesh.get_group())])
        with comm:
            for m in range(num_mb):
                batch, t = next(stream)
                model.set_requires_gradient_sync(m == num_mb - 1)
                # bf16: the example computes its timestep sinusoid in fp32; autocast runs it in bf16.
                with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                    pred = model([c.latent for c in batch], t, [c.text for c in batch],
                                 None if spec.image_dim is None else [c.image for c in batch])
                torch.nn.functional.mse_loss(pred.float(), torch.cat([c.target for c in batch])).backward()
                if m < num_mb - 1:  # no sync: every unit's whole gradients, accumulated
                    accumulated = mcore_memory.unique_bytes(_unsharded_grads(model))
            grads = mcore_memory.unique_bytes([p.grad.to_local() for p in params if p.grad is not None])
            optimizer.step()
        state = {}
        for s in optimizer.state.values():
            for key, value in s.items():
                if key != "step":
                    local = value.to_local()
                    state[f"optimizer/{key}"] = state.get(f"optimizer/{key}", 0) + local.numel() * local.element_size()
        out[name] = dict(
            names=[(n, tuple(p.shape)) for n, p in model.named_parameters()],
            states={"weights": mcore_memory.unique_bytes([p.to_local() for p in params]), "gradients": grads, **state,
                    **({"gradients/unsharded_accumulation": accumulated} if num_mb > 1 else {})},
            comm=dict(comm.bytes),
        )
    return out


def _unsharded_grads(model) -> list:
    """The whole gradients FSDP2 keeps between micro-batches without sync: each parameter's
    accumulated gradient (upcast to the reduce dtype) or its unsharded parameter's ``grad``."""
    grads = []
    for module in (model, *model.blocks):
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            grad = fsdp_param.unsharded_accumulated_grad
            grads.append(grad if grad is not None else fsdp_param._unsharded_param.grad)
    return [g for g in grads if g is not None]


@pytest.fixture(scope="module")
def measured():
    runs = {name: (_raw(name), *RUNS[name][2:]) for name in RUNS}
    return mcore_dist.run_by_name(fsdp_worker, WORLD, runs, timeout=600)


def _setup(name: str):
    raw = _raw(name)
    spec = DiTSpec.from_mapping(raw["dit"])
    lora = raw.get("lora")
    peft = DiTPeftSpec(frozen=True, lora_rank=lora["dim"], lora_targets=tuple(lora["target_modules"])) if lora else None
    dtype, num_mb, optimizer = RUNS[name][2:]
    return spec, peft, Training(seq_length=1, micro_batch_size=1, num_microbatches=num_mb, params_dtype=dtype,
                                optimizer=optimizer)


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_and_units(measured, name):
    spec, peft, _ = _setup(name)
    blocks = [dataclasses.replace(p, name=f"blocks.{i}.{p.name}")
              for i in range(spec.num_layers) for p in dit_block_parameters(spec, peft)]
    root = list(dit_root_parameters(spec, peft))
    # named_parameters(): the root's embeddings, the blocks, then the head (and img_emb).
    late = [p for p in root if p.name.startswith(("head.", "img_emb."))]
    order = [p for p in root if p not in late] + blocks + late
    assert [(p.name, p.shape) for p in order] == [(n, tuple(s)) for n, s in measured[name][0]["names"]]
    counts = dit_parameter_counts(spec, peft)
    assert sum(math.prod(p.shape) for p in order) == counts.num_params
    assert sum(math.prod(p.shape) for p in order if p.trainable) == counts.num_trainable_params


@pytest.mark.parametrize("name", list(RUNS))
def test_states_and_communication_every_rank(measured, name):
    spec, peft, training = _setup(name)
    for rank, result in enumerate(measured[name]):
        want = fsdp_rank_memory(spec, training, dp=WORLD, rank=rank, peft=peft)
        assert want.states == result["states"], rank
        assert want.communication == result["comm"], rank


def test_lora_against_full_training():
    # Same model, one step of 2 micro-batches on 4 ranks: LoRA keeps the base shards but has
    # almost no gradients, optimizer state or reduce-scatter; the all-gathers are the same plus
    # the adapters.
    spec = DiTSpec.from_mapping(RAW["dit"])
    training = Training(seq_length=1, micro_batch_size=1, num_microbatches=2, params_dtype="bf16")
    lora = fsdp_rank_memory(spec, training, dp=WORLD, peft=DiTPeftSpec(frozen=True, lora_rank=4))
    full = fsdp_rank_memory(spec, training, dp=WORLD)
    adapters = dit_parameter_counts(spec, DiTPeftSpec(frozen=True, lora_rank=4)).num_adapter_params  # 4096
    # Adapters: A [4, 32] and B [32, 4]: 1 and 8 rows per rank, 256 elements per adapter over 4 ranks.
    assert lora.states["weights"] - full.states["weights"] == adapters * 4 // WORLD
    assert lora.states["gradients"] == adapters * 4 // WORLD
    assert lora.communication["fsdp/reduce_scatter"] == adapters * 4
    # The first micro-batch runs without sync: every adapter's whole fp32 gradient until the
    # second's reduce-scatter (16,384 B); full training: every parameter's.
    assert lora.states["gradients/unsharded_accumulation"] == adapters * 4
    assert full.states["gradients/unsharded_accumulation"] == dit_parameter_counts(spec).num_params * 4
    assert lora.communication["fsdp/all_gather"] - full.communication["fsdp/all_gather"] == 2 * 2 * adapters * 2
