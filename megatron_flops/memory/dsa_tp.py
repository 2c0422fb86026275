"""Tensor-parallel traffic of DeepSeek sparse attention beyond its MLA layer's (stdlib only).

megatron-core 0.16.1's ``DSAttention`` (measured in 2 gloo processes, TP 2 with and without
sequence parallelism: ``tests/test_memory_dsa_more.py``), per layer that runs its indexer and per
forward:

- ``tp/all_reduce``: the KL indexer loss's target, the attention probabilities summed over this
  rank's heads, fp32 [b, s, s], all-reduced over TP. Built only with grad enabled, so a full
  recompute's first (no-grad) forward skips it and its re-run sends it: once per micro-batch.
- ``tp/all_gather`` (sequence parallelism): the indexer's detached inputs, the norm output
  [T, h] and the q latent [T, q_lora] (without a q latent the norm output again), in the
  activation dtype; every forward, the re-run too. Nothing in backward (the inputs are detached,
  the target needs no grad).

A layer that reuses an earlier top-k (``dsa_shared``) runs no indexer and no loss: none.
Under CP: megatron-core 0.19.0's layer (:func:`.linear_cp.dsa_cp_traffic`).
"""

from __future__ import annotations

from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.layout import FP32_BYTES, Parallelism, Training
from megatron_flops.memory.mla_mtp import fully_recomputed_layers, mtp_recomputed
from megatron_flops.memory.mtp_layers import last_stage_mtp_kinds
from megatron_flops.model.spec import ModelSpec


def dsa_tensor_parallel(spec: ModelSpec, par: Parallelism, training: Training, *, layers: list[int], last: bool,
                        recompute: RecomputeSpec | None) -> dict[str, int]:
    """Bytes per micro-batch for a model chunk's ``layers`` (and its MTP layers when ``last``): full
    recompute re-runs all of them (``uniform``; the MTP layers as :func:`.mla_mtp.mtp_recomputed`
    says) or the first ``recompute_num_layers`` (``block``)."""
    mla = spec.mla
    mtp_mixers = [mixer for mixer, _ in last_stage_mtp_kinds(spec, last)]  # (:mod:`.mtp_layers`)
    mtp = len(mtp_mixers)
    kinds = [spec.layers[i][0] for i in layers] + mtp_mixers
    indexed = [kind == "dsa" for kind in kinds]
    if mla is None or not any(indexed) or par.tp == 1 or par.cp > 1:
        return {}
    rerun = fully_recomputed_layers(recompute, len(layers))
    reruns = [j < rerun for j in range(len(layers))] + [mtp_recomputed(spec, recompute)] * mtp
    s, b = training.seq_length, training.micro_batch_size
    out = {"tp/all_reduce": sum(indexed) * b * s * s * FP32_BYTES}
    if par.sequence_parallel:
        gathered = s * b * (spec.hidden_size + (mla.q_lora_rank or spec.hidden_size)) * training.param_bytes
        out["tp/all_gather"] = (sum(indexed) + sum(i and r for i, r in zip(indexed, reruns))) * gathered
    return out
