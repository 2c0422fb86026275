"""Memory and traffic per GPU of a megatron-core GPT under torch FSDP2, as Megatron-LM's
``--use-torch-fsdp2`` builds it (stdlib only).

NB: what runs (megatron-core's ``TorchFullyShardedDataParallel``, Megatron-LM's ``get_model``):
the model is cast to ``--params-dtype`` (``Float16Module``), then ``fully_shard`` is applied to the
embedding (``LanguageModelEmbedding``), to every ``TransformerLayer`` (MTP layers' included) and to
the root, which keeps the final norm and the output layer (``--transformer-impl local``; with
Transformer Engine the output layer is a unit of its own), all with ``reshard_after_forward=True``
and no ``MixedPrecisionPolicy``. So:

- weights: every parameter split along dim 0 into ``ceil(rows / DP)`` rows per rank, padding
  included, in ``--params-dtype`` (the FSDP data-parallel group is DP x CP);
- gradients: shards of the trainable parameters in ``--params-dtype``, padding included (views
  into each unit's reduce-scatter output): ``--accumulate-allreduce-grads-in-fp32`` has no effect;
- optimizer (``get_megatron_optimizer``): fp32 main copies of 16-bit shards and Adam moments over
  the real rows of this rank;
- ``dp/all_gather``: each unit's padded unsharded weights twice per micro-batch (forward, and
  again in backward after the reshard); ``dp/reduce_scatter``: each unit's padded unsharded
  gradients (trainable parameters) every micro-batch, as megatron-core's ``no_sync`` does not
  stop FSDP2's gradient sync;
- ``fsdp/unsharded_working_copies``: the root is gathered at its pre-forward, before any other
  unit runs, and resharded at its post-forward, after all of them; gathered again for the whole
  backward and reduce-scattered at its end. So its gathered weights stay while the other units
  gather, compute and reduce-scatter, beside its whole gradients as they appear (the output layer's
  and final norm's from the start of backward; those of a VLM's vision tower, which joins the root,
  once the tower's backward has run: after the decoder's, before the embedding's, which is last).
  Measured on CPU, where each collective runs to completion; on GPU (a formula, not measured) two neighbouring units are gathered at once (the one
  computing and the one prefetched) with the larger unsharded gradient of the two.

Megatron-LM refuses ``--use-torch-fsdp2`` with PP > 1, EP > 1, the distributed optimizer, tied
embeddings and fp16.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.decoder import DecoderOptions, Param, chunk_parameters
from megatron_flops.memory.fsdp_transients import unsharded_working_copies
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.states import optimizer_keys
from megatron_flops.model.spec import ModelSpec

_UNIT = re.compile(r"^(embedding\.|decoder\.layers\.\d+\.|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer\.layers\.\d+)\.)")


def check_fsdp_supported(spec: ModelSpec, par: Parallelism, training: Training) -> None:
    """ValueError for what Megatron-LM refuses with ``--use-torch-fsdp2``."""
    refused = [what for what, bad in (
        (f"--pp {par.pp} (pipeline parallelism)", par.pp > 1),
        (f"--ep {par.ep} (expert parallelism)", par.ep > 1),
        ("tied embeddings (it requires --untie-embeddings-and-output-weights)", spec.tied_output),
        ("fp16", training.params_dtype == "fp16")) if bad]
    if refused:
        raise ValueError(f"Megatron-LM's --use-torch-fsdp2 (--fsdp) is not supported with {', '.join(refused)}")


def fsdp_units(params: Sequence[Param]) -> list[tuple[Param, ...]]:
    """The parameters of each ``fully_shard`` unit, in forward order: the embedding, each
    decoder (and MTP) ``TransformerLayer``, then the root (everything else: the final norm, the
    output layer and a VLM's vision tower, which holds no ``TransformerLayer``), last."""
    units: dict[str, list[Param]] = {}
    for p in params:
        match = _UNIT.match(p.name)
        units.setdefault(match.group(1) if match else "", []).append(p)
    root = units.pop("", [])
    return [tuple(u) for u in units.values()] + [tuple(root)]


def shard_rows(param: Param, dp: int) -> int:
    """Rows each rank allocates: ``ceil(rows / dp)``."""
    return -(-(param.rows or param.numel) // dp)


def real_rows(param: Param, dp: int, rank: int) -> int:
    """Rows of real data on ``rank``."""
    per = shard_rows(param, dp)
    return max(0, min(per, (param.rows or param.numel) - rank * per))


def _row_numel(param: Param) -> int:
    return param.numel // (param.rows or param.numel)


def _padded(params: Sequence[Param], dp: int, trainable_only: bool = False) -> int:
    """Elements of ``params``' shards on any rank, padding included."""
    return sum(shard_rows(p, dp) * _row_numel(p) for p in params if p.trainable or not trainable_only)


def fsdp_decoder_rank(params: Sequence[Param], training: Training, *, dp: int,
                      rank: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """(state bytes, step payload per ``dp/<kind>``) on FSDP rank ``rank`` of ``dp`` (see the
    module NB)."""
    if not 0 <= rank < dp:
        raise ValueError(f"rank {rank} is outside the {dp} data-parallel ranks")
    units = fsdp_units(params)
    dtype = training.param_bytes
    real = sum(real_rows(p, dp, rank) * _row_numel(p) for p in params if p.trainable)
    states = {"weights": _padded(params, dp) * dtype, "gradients": _padded(params, dp, True) * dtype}
    for key in optimizer_keys(training):
        states[key] = real * 4
    gathered = [dp * _padded(u, dp) for u in units]
    states["fsdp/unsharded_working_copies"] = _working_copies(units, dp) * dtype
    if dp == 1:
        return states, {}
    m = training.num_microbatches
    comm = {"dp/all_gather": 2 * m * sum(gathered) * dtype,
            "dp/reduce_scatter": m * sum(dp * _padded(u, dp, True) for u in units) * dtype}
    return states, {k: v for k, v in comm.items() if v}


def _working_copies(units: Sequence[tuple[Param, ...]], dp: int) -> int:
    """Elements of whole weights and gradients alive at once (see the module NB): the root's gathered
    weights, and the larger of (its output layer's and final norm's gradients beside two neighbouring
    other units, as the decoder runs backward) and (all its gradients beside the embedding, whose
    backward runs last)."""
    *others, root = units
    gathered = [dp * _padded(u, dp) for u in others]
    grads = [dp * _padded(u, dp, True) for u in others]
    tower = dp * _padded([p for p in root if p.name.startswith("visual.")], dp, True)
    head = dp * _padded([p for p in root if not p.name.startswith("visual.")], dp, True)
    last = gathered[0] + grads[0] if others else 0
    return dp * _padded(root, dp) + max(head + unsharded_working_copies(gathered, grads), head + tower + last)


def fsdp_notes(par: Parallelism, recompute: RecomputeSpec | None, *,
               vision: bool = False) -> tuple[list[str], list[str]]:
    """(assumptions, unmeasured) that FSDP2 adds to a decoder's report (``vision``: a VLM's tower)."""
    assumptions = [
        "torch FSDP2 as Megatron-LM's --use-torch-fsdp2 (--transformer-impl local): fully_shard on the embedding, "
        "each TransformerLayer and the root" + (" (with the vision tower, which holds no TransformerLayer)" if vision
                                                 else "")
        + ", reshard after forward, no MixedPrecisionPolicy (gradients reduced and "
        "kept in the params dtype), megatron-core's no_sync not stopping the reduce-scatter of each micro-batch",
        "activations as without FSDP (the gathered weights autograd keeps are parameters, not counted)",
    ]
    unmeasured = ["fsdp/unsharded_working_copies: the root's gathered weights and whole gradients (measured on CPU) "
                  "beside two neighbouring units' gathered weights and one unsharded gradient alive at once (when "
                  "CUDA streams prefetch the next all-gather; gloo on CPU runs each collective to completion, so the "
                  "overlap cannot be measured here)"]
    if par.tp > 1:
        unmeasured.append(f"FSDP2 x TP {par.tp}: the tp/ collectives as without FSDP" + (
                          " (the vision tower's gradient all-reduce too, counted whole)" if vision else "")
                          + "; with sequence parallelism or qk_layernorm megatron-core all-gathers the TP-replicated "
                          "gradient shards over DP before their TP all-reduce and re-shards them after (not counted; "
                          "no TP x DP step measured)")
    if recompute is not None and recompute.granularity == "full":
        unmeasured.append("FSDP2 x full recompute: dp/all_gather counts two gathers per layer and micro-batch; the "
                          "re-run forward of checkpointed layers may gather them once more (not counted, not measured)")
    return assumptions, unmeasured


def fsdp_stage(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *,
               peft: PeftSpec | None, vision: Sequence[Param] = ()) -> tuple[dict[str, int], dict[str, int]]:
    """(states, FSDP payloads) of the most loaded rank (rank 0: the most real rows); ``vision``: a
    VLM's tower parameters, registered before the decoder's (Megatron-Bridge's ``visual``)."""
    check_fsdp_supported(spec, par, training)
    params = tuple(vision) + chunk_parameters(spec, options, replace(par, fsdp=False), pp_rank=0, chunk=0,
                                              seq_length=training.seq_length, peft=peft)
    return fsdp_decoder_rank(params, training, dp=par.dp * par.cp)
