"""Test-only worker, run in megatron-core 0.19.0's Python 3.12 venv (tests/frameworks/envs.py):
megatron-core 0.19.0's ``HybridModel`` with a hybrid pattern's MTP part after '/' (each MTP depth
a ``MultiTokenPredictionLayer`` around a ``HybridStack``), built from megatron-core's local layers
(``hybrid_stack_spec`` with Transformer Engine's classes swapped for ColumnParallelLinear,
RowParallelLinear, DotProductAttention and torch norms, the norms as separate modules; the
stack's final norm, which ``HybridStack`` builds as ``TENorm`` whatever the spec, a torch norm). Measured:

- ``params``: every parameter's name and size, in order (Mamba layers built with a stand-in for
  mamba_ssm's gated RMSNorm that allocates the same weight: mamba_ssm's kernels run in forward
  only), also for a pattern without '/' given ``mtp_num_layers`` and for MLA layers ('+');
- ``saved``/``flops``/``comm`` (patterns without Mamba layers, which run on CPU; TP 1, or TP 2
  with and without sequence parallelism): the distinct storages one forward (model and loss)
  keeps for backward, the GEMM FLOPs (``FlopCounterMode``) of a forward and backward, and every
  ``tp/*`` collective's payload.

Run: ``python -c 'import hybrid_mtp_019; hybrid_mtp_019.main()' JSON`` with tests/ on sys.path;
prints one JSON line: per case ``{"params"}`` and, where run, ``{"saved", "flops", "comm"}``
(rank 0's)."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import mcore_cpu
import mcore_dist


def local_hybrid_stack_spec() -> Any:
    """megatron-core 0.19.0's ``hybrid_stack_spec`` (Mamba, attention and MLP layers, the MTP
    block) from local layers."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock, MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = WrappedTorchNorm
    hybrid_block.TENorm = norm  # (HybridStack builds its final norm as TENorm, whatever the spec)
    mtp = ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[
        ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm))]))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=norm, mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)), mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=SelfAttentionSubmodules(
                                          linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                          linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add)),
        # ('+': the local spec's MLA projections, the hybrid spec's IdentityOp latent norms)
        mla_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=MLASelfAttentionSubmodules(
                                          linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                                          linear_q_up_proj=ColumnParallelLinear,
                                          linear_kv_down_proj=ColumnParallelLinear,
                                          linear_kv_up_proj=ColumnParallelLinear, core_attention=DotProductAttention,
                                          linear_proj=RowParallelLinear, q_layernorm=IdentityOp,
                                          kv_layernorm=IdentityOp)),
            self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add)),
        mtp_block_spec=mtp))


def _build(case: dict) -> Any:
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    import mcore_cpu

    pattern = case["pattern"]
    main, *mtp = pattern.split("/")
    # (a case's "mtp_num_layers": given beside a pattern without '/', as Megatron-LM passes --mtp-num-layers)
    config = mcore_cpu.make_config(dict(case["model"], num_layers=len(main),
                                        mtp_num_layers=case.get("mtp_num_layers", len(mtp) or None),
                                        tensor_model_parallel_size=case.get("tp", 1),
                                        sequence_parallel=case.get("sp", False)))
    with mcore_cpu.cuda_to_cpu_mode():
        return HybridModel(config, local_hybrid_stack_spec(), vocab_size=case["vocab"], max_sequence_length=case["seq"],
                           hybrid_layer_pattern=pattern, position_embedding_type="rope",
                           share_embeddings_and_output_weights=True,
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _step(model: Any, case: dict) -> dict:
    """One forward (the model and Megatron-LM's loss function) metered, then its backward, under
    ``FlopCounterMode`` and the collective meter: bytes saved for backward, GEMM FLOPs, payloads."""
    from megatron.core import parallel_state as ps
    from torch.utils.flop_counter import FlopCounterMode

    import mcore_cpu
    import mcore_memory

    batch = next(mcore_memory.batches(1, case["mbs"], case["seq"], case["vocab"]))
    meter = mcore_memory.SavedTensorMeter(model.parameters())
    counter = FlopCounterMode(display=False)
    comm = mcore_memory.CommMeter([("tp", ps.get_tensor_model_parallel_group())])
    with counter, comm, meter.tracking(), mcore_cpu.cuda_to_cpu_mode():
        with meter.one_forward():
            output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                           labels=batch["labels"], loss_mask=batch["loss_mask"])
            loss = torch.sum(output.float().view(-1) * batch["loss_mask"].view(-1))
        loss.backward()
    return dict(saved=meter.forward[0], flops=counter.get_total_flops(), comm=dict(comm.bytes))


def _worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    import mcore_memory

    mcore_dist.init_worker()
    mcore_memory.patch_sequence_parallel_norm()
    mcore_cpu.stub_mamba_ssm()
    out = []
    for case in cases:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=case.get("tp", 1))
        MTPLossLoggingHelper.tracker.clear()  # (sized by the first model's MTP depths: a new run's)
        torch.manual_seed(0)
        model = _build(case)
        params = [(name, p.numel()) for name, p in model.named_parameters()]
        out.append(dict(params=params, **(_step(model, case) if case["run"] else {})))
    return out


def main() -> None:
    """Every case in 2 gloo processes (TP 1: two copies); rank 0's results."""
    cases = json.loads(sys.argv[1])
    results = mcore_dist.run_distributed(_worker, 2, cases, timeout=900)
    print(json.dumps(results[0]))
