"""Memory per GPU and bytes moved per step of a megatron-core GPT, per pipeline stage and for the
most loaded GPU (stdlib only). See :mod:`megatron_flops.memory` for the conventions."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from megatron_flops.memory.activations import (
    ChunkActivations,
    check_activations_supported,
    chunk_activations,
    in_flight,
    received_bounds,
    schedule_peak,
)
from megatron_flops.memory.comm import (
    bus_bytes,
    sequence_parallel_slice,
    step_communication,
)
from megatron_flops.memory.decoder import (DecoderOptions, Param, check_supported, chunk_parameters,
                                          experts_take_adapters, parameter_counts)
from megatron_flops.memory.dp_ranks import bucket_steps, most_loaded_rank
from megatron_flops.memory.hybrid_pipeline import hybrid_stages, is_hybrid
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.hf_layers import hf_layer_assumptions
from megatron_flops.memory.hf_parallel import parallel_layer_assumptions, parallel_layer_unmeasured
from megatron_flops.memory.hf_qk_norms import hf_attention_notes
from megatron_flops.memory.lora import lora_duplicated_unmeasured, lora_fused_norm_unmeasured
from megatron_flops.memory.lora_layers import expert_lora_unmeasured, lora_tp_communication
from megatron_flops.memory.mla_mtp import mla_mtp_assumptions, mla_unmeasured
from megatron_flops.memory.mtp_layers import mtp_moe_layers
from megatron_flops.memory.moe import (
    all_to_all_range,
    check_moe,
    expert_tp_group,
    layer_is_moe,
    moe_communication,
    moe_unmeasured,
    rerun_moe_layers,
)
from megatron_flops.memory.moe_lora_start import first_adapter_ep_skip, first_adapter_unmeasured
from megatron_flops.memory.moe_grouped import check_grouped, grouped_lora_communication, grouped_unmeasured
from megatron_flops.memory.recompute import selective_rerun_communication, selective_unmeasured
from megatron_flops.memory.kda_fla import kda_fla_unmeasured
from megatron_flops.memory.mtp_stage import standalone_mtp_unmeasured
from megatron_flops.memory.linear_cp import gdn_cp_head_permutation, linear_cp_notes
from megatron_flops.memory.ssm import ssm_notes
from megatron_flops.memory.states import Bucket, chunk_buffers, chunk_state_bytes
from megatron_flops.memory.vision import NeededInput, VisionMemory
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.model.spec import ModelSpec

# Megatron-LM's default DDP bucket size with overlap_grad_reduce: max(40M, 1M x DP) parameters.
DEFAULT_BUCKET_SIZE = 40_000_000


def default_bucket_size(dp: int) -> int:
    return max(DEFAULT_BUCKET_SIZE, 1_000_000 * dp)


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One GPU: state bytes (``weights``, ``gradients``, ``optimizer/...``), the saved-for-backward
    peak (None where not modelled) with the micro-batches in flight then and one micro-batch's
    breakdown per model chunk, and the step's communication payload per ``group/kind``."""

    pp_rank: int
    dp_rank: int
    states: dict[str, int]
    activations: int | None
    in_flight: int | None
    activations_per_microbatch: tuple[dict[str, int], ...] | None
    communication: dict[str, int]
    communication_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    activations_range: tuple[int, int] | None = None

    @property
    def total(self) -> int:
        return sum(self.states.values()) + (self.activations or 0)


def rank_memory(
    spec: ModelSpec,
    options: DecoderOptions,
    par: Parallelism,
    training: Training,
    *,
    pp_rank: int,
    dp_rank: int = 0,
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
    vision: VisionMemory | None = None,
) -> RankMemory:
    """Everything on the GPU of pipeline rank ``pp_rank`` and data-parallel rank ``dp_rank``
    (``vision``: a VLM's tower, on model chunk 0 of pipeline rank 0)."""
    par = hybrid_stages(spec, par)
    check_moe(spec, options, par)
    check_grouped(spec, options, par, training, recompute, peft)
    vision = vision or VisionMemory(params=(), activations=None)
    states, buffers = _rank_states(spec, options, par, training, pp_rank=pp_rank, dp_rank=dp_rank, peft=peft,
                                   vision=vision)
    local, options = context_parallel_view(par, training, options)
    comm = step_communication(spec, options, par, local, pp_rank=pp_rank, buffers=buffers, recompute=recompute)
    moe_layers = sum(sum(layer_is_moe(spec, par.chunk_layers(spec.num_layers, pp_rank, c)))
                     + mtp_moe_layers(spec, par.holds_mtp(pp_rank, c)) for c in range(par.num_chunks))
    _add_payloads(comm, _lora_tp(spec, options, par, local, pp_rank=pp_rank, peft=peft, recompute=recompute),
                  selective_rerun_communication(spec, par, local, pp_rank=pp_rank, recompute=recompute, peft=peft,
                                                fused=options.fused_norm_targets,
                                                expert_adapters=experts_take_adapters(options)),
                  vision.communication(par.tp, training.grad_bytes, pp_rank == 0),
                  first_adapter_ep_skip(spec, options, par, local, pp_rank=pp_rank, peft=peft, recompute=recompute),
                  grouped_lora_communication(spec, options, par, local, peft, moe_layers=moe_layers))
    peak = count = None
    per_mb = None
    bounds = None
    if _activation_reason(spec, options, par, recompute, peft) is None:
        permutation = gdn_cp_head_permutation(spec, par, pp_rank=pp_rank)  # (GDN under CP: one per rank)

        def peak_of(received: int | None) -> tuple[int, int, list[ChunkActivations]]:
            chunks = [chunk_activations(spec, options, par, local, pp_rank=pp_rank, chunk=c, recompute=recompute,
                                        peft=peft, received=received) for c in range(par.num_chunks)]
            chunks = [replace(c, components={**c.components,
                                             **vision.chunk_activations(par.is_first_stage(pp_rank, i))})
                      for i, c in enumerate(chunks)]
            peak, count = schedule_peak(chunks, in_flight(par, training.num_microbatches, pp_rank))
            return peak + permutation, count, chunks

        peak, count, chunks = peak_of(None)
        per_mb = tuple(dict(c.components) for c in chunks)
        if par.ep > 1 and spec.moe is not None:
            lo, hi = received_bounds(spec, par, local)
            bounds = (peak_of(lo)[0], peak_of(hi)[0])
    return RankMemory(pp_rank=pp_rank, dp_rank=dp_rank, states=states, activations=peak, in_flight=count,
                      activations_per_microbatch=per_mb, communication=comm,
                      communication_ranges=_routing_ranges(spec, options, par, local, pp_rank, recompute, comm, peft),
                      activations_range=bounds)


def _rank_states(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *, pp_rank: int,
                 dp_rank: int, peft: PeftSpec | None,
                 vision: VisionMemory) -> tuple[dict[str, int], dict[str, list[Bucket]]]:
    """(state bytes, gradient buffers' buckets by group) of every model chunk of pipeline rank
    ``pp_rank`` on data-parallel rank ``dp_rank`` (a VLM's tower on the first stage's chunk 0)."""
    states: dict[str, int] = {}
    buffers: dict[str, list[Bucket]] = {"dp": [], "expt_dp": []}
    sizes = {"dp": par.dp * par.cp, "expt_dp": par.expert_dp}
    ranks = {"dp": dp_rank, "expt_dp": par.expert_dp_rank(dp_rank)}
    for params, chunk_buckets in _stage_buffers(spec, options, par, training, pp_rank=pp_rank, peft=peft,
                                                vision=vision):
        for group, buckets in chunk_buckets.items():
            buffers[group] += buckets
        chunk_states = chunk_state_bytes(params, chunk_buckets, training, sizes=sizes, ranks=ranks,
                                         distributed_optimizer=par.distributed_optimizer)
        for key, value in chunk_states.components.items():
            states[key] = states.get(key, 0) + value
    return states, buffers


def _stage_buffers(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *, pp_rank: int,
                   peft: PeftSpec | None,
                   vision: VisionMemory) -> list[tuple[tuple[Param, ...], dict[str, tuple[Bucket, ...]]]]:
    """(parameters, buckets by group) of each model chunk of pipeline rank ``pp_rank``."""
    out = []
    for chunk in range(par.num_chunks):
        params = chunk_parameters(spec, options, par, pp_rank=pp_rank, chunk=chunk,
                                  seq_length=training.seq_length, peft=peft)
        params = vision.chunk_params(par.is_first_stage(pp_rank, chunk)) + params
        # NB: megatron-core buckets only the first model chunk of the first pipeline rank.
        bucket_size = training.bucket_size if chunk == 0 and pp_rank == 0 else None
        out.append((params, chunk_buffers(params, dp=par.dp * par.cp, expert_dp=par.expert_dp,
                                          distributed_optimizer=par.distributed_optimizer, bucket_size=bucket_size)))
    return out


def _most_loaded_dp_rank(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *,
                         pp_rank: int, peft: PeftSpec | None = None, vision: VisionMemory | None = None) -> int:
    """The rank of pipeline rank ``pp_rank``'s data-parallel group (with context parallelism: DP x
    CP ranks, which the buffers are sharded over) with the most optimizer state, the lowest on a tie
    (0 without the distributed optimizer): every other figure is the same on each."""
    if not par.distributed_optimizer:
        return 0
    chunks = _stage_buffers(spec, options, par, training, pp_rank=pp_rank, peft=peft,
                            vision=vision or VisionMemory(params=(), activations=None))
    ranks = par.dp * par.cp
    return most_loaded_rank((s for _, b in chunks for s in bucket_steps(b["dp"], ranks)), ranks=ranks,
                            expert=(s for _, b in chunks for s in bucket_steps(b["expt_dp"], par.expert_dp)),
                            expert_rank=par.expert_dp_rank)


def _lora_tp(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *, pp_rank: int,
             peft: PeftSpec | None, recompute: RecomputeSpec | None, received: int | None = None) -> dict[str, int]:
    """:func:`~megatron_flops.memory.lora_layers.lora_tp_communication` with what ``options`` says of
    the layers (Transformer Engine's duplicated MLA down projections and fused norms, the experts'
    module, the dispatcher): one call for the balanced figures and the routing ranges alike."""
    return lora_tp_communication(spec, par, training, pp_rank=pp_rank, peft=peft, recompute=recompute,
                                 received=received, duplicated=options.duplicated_mla_down,
                                 fused=options.fused_norm_targets, expert_adapters=experts_take_adapters(options),
                                 dispatcher=options.moe_token_dispatcher_type)


def _add_payloads(total: dict[str, int], *extras: dict[str, int]) -> None:
    for extra in extras:
        for key, value in extra.items():
            total[key] = total.get(key, 0) + value
    for key in [key for key, value in total.items() if not value]:
        del total[key]  # (a frozen first stage's embedding gather less its skip: none runs)


def context_parallel_view(par: Parallelism, training: Training,
                          options: DecoderOptions) -> tuple[Training, DecoderOptions]:
    """What one context-parallel rank runs: ``s / CP`` tokens per sequence through a fused
    (flash-convention) attention, as megatron-core's CP needs Transformer Engine's attention.
    NB: a formula, not measured here (no context-parallel attention on CPU). CP 1: unchanged."""
    if par.cp == 1:
        return training, options
    if training.seq_length % (2 * par.cp):
        raise ValueError(f"context parallelism splits each sequence into 2 x CP chunks: --seq-length "
                         f"{training.seq_length} is not divisible by {2 * par.cp}")
    return (replace(training, seq_length=training.seq_length // par.cp),
            replace(options, attention_backend="flash"))


def _routing_ranges(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                    pp_rank: int, recompute: RecomputeSpec | None, comm: dict[str, int],
                    peft: PeftSpec | None = None) -> dict[str, tuple[int, int]]:
    """Per-rank bounds over every routing of the payloads that follow it: the expert all-to-all,
    and under TP x EP the TP all-gather and reduce-scatter of the routed tokens (alltoall) and
    the routed experts' LoRA adapters' all-gathers."""
    if par.ep == 1 or spec.moe is None:
        return {}
    out: dict[str, tuple[int, int]] = {}
    m, fewest, most = training.num_microbatches, *received_bounds(spec, par, training)
    for c in range(par.num_chunks):
        layers = par.chunk_layers(spec.num_layers, pp_rank, c)
        mtp_here = par.holds_mtp(pp_rank, c)
        moe_layers = sum(layer_is_moe(spec, layers)) + mtp_moe_layers(spec, mtp_here)
        rerun = rerun_moe_layers(spec, recompute, layers, last=mtp_here)
        span = all_to_all_range(spec, options, par, sequence_parallel_slice(training, par), moe_layers,
                                rerun) if moe_layers else None
        if span is not None:
            lo, hi = out.get("ep/all_to_all", (0, 0))
            out["ep/all_to_all"] = (lo + m * span[0], hi + m * span[1])
        if moe_layers and par.expert_tp > 1 and options.moe_token_dispatcher_type == "alltoall":
            at = [moe_communication(spec, options, par, training, moe_layers, rerun, received)
                  for received in (None, fewest, most)]
            group = expert_tp_group(par)
            for key in (f"{group}/all_gather", f"{group}/reduce_scatter"):
                lo, hi = out.get(key, (comm[key], comm[key]))
                balanced = at[0].get(key, 0)
                out[key] = (lo + m * (at[1].get(key, 0) - balanced), hi + m * (at[2].get(key, 0) - balanced))
    if peft is not None and peft.lora_rank is not None and par.expert_tp > 1:
        payloads = [_lora_tp(spec, options, par, training, pp_rank=pp_rank, peft=peft, recompute=recompute,
                             received=received) for received in (None, fewest, most)]
        for key in (f"{expert_tp_group(par)}/all_gather", f"{expert_tp_group(par)}/reduce_scatter"):
            lora = [p.get(key, 0) for p in payloads]
            if lora[1] != lora[2]:
                lo, hi = out.get(key, (comm.get(key, 0), comm.get(key, 0)))
                out[key] = (lo + lora[1] - lora[0], hi + lora[2] - lora[0])
    return out


# Bounds on the work of one report (each is about a second here at its limit): every layer's
# parameters are listed (the data-parallel rank compared is found without listing them again per
# rank: memory/dp_ranks.py), and the pipeline schedule is stepped through forward pass by forward pass.
MAX_LAYERS = 1 << 16
MAX_FORWARD_PASSES = 1 << 16


def _check_size(spec: ModelSpec, par: Parallelism, training: Training) -> None:
    if spec.num_layers > MAX_LAYERS:
        raise ValueError(f"the memory model lists every layer's parameters: num_layers must be at most "
                         f"{MAX_LAYERS:,}, got {spec.num_layers:,}")
    passes = training.num_microbatches * par.num_chunks
    if passes > MAX_FORWARD_PASSES:
        raise ValueError(f"the memory model steps through the schedule's forward passes: --num-microbatches x VPP "
                         f"must be at most {MAX_FORWARD_PASSES:,}, got {passes:,}")


def _activation_reason(spec: ModelSpec, options: DecoderOptions, par: Parallelism,
                       recompute: RecomputeSpec | None, peft: PeftSpec | None) -> str | None:
    return check_activations_supported(spec, options, par, recompute, peft)


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Per pipeline stage, the most loaded GPU of that stage; ``per_gpu`` the most loaded of all."""

    parameters: dict[str, int]
    stages: tuple[RankMemory, ...]
    group_sizes: dict[str, int] = field(default_factory=dict)
    not_modelled: tuple[str, ...] = field(default_factory=tuple)
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    unmeasured: tuple[str, ...] = field(default_factory=tuple)
    needs_input: tuple[NeededInput, ...] = field(default_factory=tuple)  # left out until the user gives it

    @property
    def per_gpu(self) -> RankMemory:
        return max(self.stages, key=lambda r: (r.total, -r.pp_rank))


def decoder_memory(
    spec: ModelSpec,
    options: DecoderOptions,
    par: Parallelism,
    training: Training,
    *,
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
    vision: VisionMemory | None = None,
) -> MemoryReport:
    """Memory and traffic of every pipeline stage (the data-parallel rank whose optimizer shard
    is largest) of a megatron-core GPT trained as ``training`` says on ``par`` (with a VLM's
    ``vision`` tower on the first stage; a hybrid pattern's ``|`` segments make its stages)."""
    par = hybrid_stages(spec, par)
    check_supported(spec, par, peft, options)
    _check_size(spec, par, training)
    if spec.mla is not None and is_hybrid(spec):  # megatron-core's hybrid MLA layers: IdentityOp latent norms
        options = replace(options, qk_layernorm=False)
    fsdp = None
    if par.fsdp:  # torch FSDP2 (Megatron-LM's --use-torch-fsdp2): its states and dp/ traffic, the rest as DDP's
        from megatron_flops.memory.decoder_fsdp import fsdp_notes, fsdp_stage

        fsdp = fsdp_stage(spec, options, par, training, peft=peft, vision=vision.params if vision else ())
        par = replace(par, fsdp=False)
    recompute = _on_pipeline(recompute, par)
    stages = []
    for pp_rank in range(par.pp):
        d = _most_loaded_dp_rank(spec, options, par, training, pp_rank=pp_rank, peft=peft, vision=vision)
        stages.append(rank_memory(spec, options, par, training, pp_rank=pp_rank, dp_rank=d, peft=peft,
                                  recompute=recompute, vision=vision))
    if par.megatron_fsdp is not None:  # Megatron-FSDP: its states and dp/ traffic, the rest as DDP's
        from megatron_flops.memory.megatron_fsdp import megatron_fsdp_stage

        stages = [_with_states(r, *megatron_fsdp_stage(spec, options, par, training, pp_rank=r.pp_rank, peft=peft))
                  for r in stages]
    reason = _activation_reason(spec, options, par, recompute, peft)
    assumptions, unmeasured = modelling_notes(spec, options, par, activations=reason is None,
                                              lora=peft is not None and peft.lora_rank is not None)
    unmeasured += _formula_labels(spec, options, par, training, recompute, peft, activations=reason is None)
    if par.megatron_fsdp is not None:
        from megatron_flops.memory.megatron_fsdp import megatron_fsdp_notes

        more = megatron_fsdp_notes(par, peft)
        assumptions, unmeasured = assumptions + tuple(more[0]), unmeasured + tuple(more[1])
    if fsdp is not None:
        comm = {k: v for k, v in stages[0].communication.items() if not k.startswith("dp/")}
        stages = [replace(stages[0], states=fsdp[0], communication={**fsdp[1], **comm})]
        more = fsdp_notes(par, recompute, vision=bool(vision and vision.params))
        assumptions, unmeasured = assumptions + tuple(more[0]), unmeasured + tuple(more[1])
    tower = vision or VisionMemory(params=(), activations=None)
    counts = parameter_counts(spec, options, seq_length=training.seq_length, peft=peft, tp=par.tp)
    return MemoryReport(
        parameters={k: v + tower.parameter_counts()[k] for k, v in counts.items()},
        stages=tuple(stages),
        group_sizes=_group_sizes(par),
        not_modelled=(reason,) if reason else (),
        assumptions=assumptions + tower.assumptions,
        unmeasured=unmeasured + tower.unmeasured,
        needs_input=tower.needs_input,
    )


def _on_pipeline(recompute: RecomputeSpec | None, par: Parallelism) -> RecomputeSpec | None:
    """``recompute`` on ``par``'s pipeline (its ``block`` method counts layers per model chunk)."""
    if recompute is None or recompute.pipeline_model_parallel_size == par.pp:
        return recompute
    return RecomputeSpec(granularity=recompute.granularity, method=recompute.method, num_layers=recompute.num_layers,
                         modules=recompute.modules, pipeline_model_parallel_size=par.pp,
                         virtual_pipeline_model_parallel_size=par.vpp)


def _group_sizes(par: Parallelism) -> dict[str, int]:
    """Ranks in each process group the communication keys name."""
    return {"dp": par.dp * par.cp, "expt_dp": par.expert_dp, "tp": par.tp, "ep": par.ep, "embd": 2,
            "tp_ep": par.expert_tp * par.ep, "etp": par.expert_tp, "cp": par.cp, "tp_dp_cp": par.tp * par.dp * par.cp}


def _formula_labels(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training,
                    recompute: RecomputeSpec | None, peft: PeftSpec | None, *, activations: bool) -> tuple[str, ...]:
    """The labels of a decoder's figures that are formulas (no CPU step runs them), beyond
    :func:`modelling_notes`' (``activations``: activations are modelled)."""
    out = [*lora_duplicated_unmeasured(spec, par, peft, duplicated=options.duplicated_mla_down,
                                       fused=options.fused_norm_targets),
           *lora_fused_norm_unmeasured(spec, par, peft, fused=options.fused_norm_targets)]
    if activations:
        out += [*selective_unmeasured(options, recompute, sequence_parallel=par.sequence_parallel),
                *kda_fla_unmeasured(spec, training)]
    out += [*grouped_unmeasured(spec, options, recompute, activations=activations, peft=peft),
            *expert_lora_unmeasured(spec, par, peft), *first_adapter_unmeasured(spec, options, peft, recompute),
            *standalone_mtp_unmeasured(spec, par, recompute=recompute, peft=peft),
            *parallel_layer_unmeasured(options.parallel_layer_norms, tp=par.tp, sequence_parallel=par.sequence_parallel,
                                       peft=peft is not None,
                                       selective=activations and recompute is not None
                                       and recompute.granularity == "selective" and "layernorm" in recompute.modules)]
    return tuple(out)


def _with_states(rank: RankMemory, states: dict[str, int], data_parallel: dict[str, int]) -> RankMemory:
    """``rank`` with other states and ``dp``/``expt_dp`` payloads."""
    comm = {k: v for k, v in rank.communication.items() if not k.startswith(("dp/", "expt_dp/"))}
    return replace(rank, states=states, communication={**data_parallel, **comm})


def modelling_notes(spec: ModelSpec, options: DecoderOptions, par: Parallelism,
                    *, activations: bool, lora: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What can make a figure differ from a real run (``assumptions``), and which figures are
    formulas that could not be measured on CPU (``unmeasured``)."""
    assumptions, unmeasured = _kernel_notes(options, par) if activations else ([], [])
    more_assumptions, more_unmeasured = hf_attention_notes(
        qk_norm=options.hf_qk_norm if options.qk_layernorm else None, alibi=options.alibi, tp=par.tp,
        fused=options.attention_backend == "flash" or par.cp > 1, activations=activations)
    assumptions += more_assumptions
    unmeasured += more_unmeasured
    assumptions += hf_layer_assumptions(post_layernorms=options.post_layernorms and activations,
                                        attn_cap=bool(options.attn_logit_softcapping) and activations,
                                        final_cap=bool(options.final_logit_softcapping) and activations,
                                        pre_layernorms=options.pre_layernorms or not activations)
    assumptions += parallel_layer_assumptions(options.parallel_layer_norms)
    more_assumptions, more_unmeasured = ssm_notes(spec, par, activations=activations)
    cp_assumptions, cp_unmeasured = linear_cp_notes(spec, par)
    assumptions += more_assumptions + cp_assumptions
    unmeasured += more_unmeasured + cp_unmeasured
    assumptions += _lora_notes(spec, par, activations=activations, lora=lora)
    assumptions += _moe_notes(spec, options, par, activations=activations)
    assumptions += mla_mtp_assumptions(spec, par, duplicated=options.duplicated_mla_down)
    unmeasured += mla_unmeasured(spec, par, duplicated=options.duplicated_mla_down,
                                  down_bias=options.hf_mla_down_bias) + moe_unmeasured(spec, options)
    if par.cp > 1 and any(mixer in ("attention", "window") for (mixer, _), _ in spec.layer_runs):  # GDN, DSA: measured
        unmeasured.append(f"context parallelism (CP {par.cp}): activations and collectives as s/CP tokens per rank "
                          "through a fused attention, and the cp/send_recv ring of K/V (no context-parallel "
                          "attention on CPU)")
    return tuple(assumptions), tuple(unmeasured)


def _kernel_notes(options: DecoderOptions, par: Parallelism) -> tuple[list[str], list[str]]:
    """(assumptions, unmeasured) of the kernels whose saved tensors the activations follow: norm
    statistics, the attention kernel, dropout masks."""
    assumptions = ["norm statistics saved in fp32 per token, as CUDA kernels keep them (torch's CPU LayerNorm keeps "
                   "them in the input dtype; its CPU RMSNorm also saves x * rstd)"]
    unmeasured = []
    if options.attention_backend == "flash" or par.cp > 1:
        assumptions.append("attention saves q, k, v, its output and an fp32 log-sum-exp per query and head, "
                           "as flash/cuDNN kernels do")
        unmeasured.append("activations of the fused attention kernel (no Transformer Engine on CPU; the local "
                          "unfused attention is measured: --attention-backend local)")
    else:
        assumptions.append("attention as megatron-core's local unfused DotProductAttention (the [s, s] softmax "
                           "is saved)")
    if options.hidden_dropout > 0 or options.attention_dropout > 0:
        assumptions.append("dropout masks saved as bool (CUDA's native_dropout; torch's CPU dropout keeps an "
                           "activation-dtype mask)")
    return assumptions, unmeasured


def _lora_notes(spec: ModelSpec, par: Parallelism, *, activations: bool, lora: bool) -> list[str]:
    """Assumptions about LoRA adapters (Megatron-Bridge's): what they save, and how they split and
    communicate over TP (the routed experts' too)."""
    out = []
    if activations and lora:
        out.append("LoRA adapters as Megatron-Bridge's (linear_in, linear_out; no adapter dropout): each saves the "
                   "projection's input and the [tokens, rank] intermediate; under full recompute of a frozen base "
                   "the decoder's input requires grad, as Bridge makes it")
    if lora and par.tp > 1:
        out.append("LoRA adapters split over TP and communicate as Bridge's ParallelLinearAdapter around "
                   "megatron-core's local linear layers (column-parallel targets split linear_in and "
                   "all-gather [tokens, rank]; row-parallel ones all-reduce it and all-gather their output)")
        if spec.moe is not None:
            split = "expert TP = TP" if par.expert_tp == par.tp else "the expert TP group"
            out.append("routed experts' LoRA adapters as Bridge 0.3.1 wraps SequentialMLP experts (one per "
                       f"expert, split over {split}, all-gathering [tokens, rank] and their output per "
                       "routed token); every expert's token count divisible by TP (Bridge pads an odd count "
                       "under no_grad, which detaches that adapter's output)"
                       + ("; under EP, the adapter traffic selective moe recompute re-runs assumes balanced "
                          "routing and is not in the per-rank range" if par.ep > 1 else ""))
    return out


def _moe_notes(spec: ModelSpec, options: DecoderOptions, par: Parallelism, *, activations: bool) -> list[str]:
    """Assumptions about the routed experts: the module they save as, and balanced routing under EP."""
    out = []
    if activations and spec.moe is not None and not options.moe_grouped_gemm:
        out.append("routed experts save as megatron-core's SequentialMLP (moe_grouped_gemm off; measured with "
                   "the local spec)")
    if par.ep > 1 and spec.moe is not None:
        out.append("ep/all_to_all (with TP, the TP all-gather and reduce-scatter of routed tokens too) and "
                   "the routed experts' activations assume balanced routing (each EP rank receives as many "
                   "routed tokens as it sends): a rank's figures move with the router (measured: within "
                   "+/-6.3% per rank on 4-rank tests), the EP group's total is exact; the per-rank range "
                   "over all routings is shown")
    return out


def report_dict(report: MemoryReport, *, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON form (see the CLI's ``--json``)."""
    def rank(r: RankMemory) -> dict[str, Any]:
        optimizer = sum(v for k, v in r.states.items() if k.startswith("optimizer/"))
        return {
            "pp_rank": r.pp_rank,
            "weights_bytes": r.states["weights"],
            "gradients_bytes": r.states["gradients"],
            "optimizer_bytes": optimizer,
            "activations_bytes": r.activations,
            "total_bytes": r.total,
            "components": {**r.states, **({"activations": r.activations} if r.activations is not None else {})},
            "forward_passes_in_flight": r.in_flight,
            "activations_per_microbatch": list(r.activations_per_microbatch) if r.activations_per_microbatch else None,
            "activations_range_bytes": list(r.activations_range) if r.activations_range else None,
        }

    def comm(r: RankMemory) -> dict[str, int]:
        return {**r.communication, "total_bytes": sum(r.communication.values())}

    def ranges(r: RankMemory) -> dict[str, list[int]]:
        return {k: [lo, hi] for k, (lo, hi) in r.communication_ranges.items()}

    busiest = max(report.stages, key=lambda r: sum(r.communication.values()))
    bus = bus_bytes(busiest.communication, report.group_sizes)

    top = report.per_gpu
    out: dict[str, Any] = {
        "parameters": dict(report.parameters),
        "per_gpu": rank(top),
        "per_stage": [rank(r) for r in report.stages],
        "communication_per_step": comm(busiest),
        "bus_bytes_per_step": {**bus, "total_bytes": sum(bus.values())},
        "communication_per_stage": [comm(r) for r in report.stages],
        "communication_ranges_per_step": ranges(busiest),
        "not_modelled": list(report.not_modelled),
        "modelling_assumptions": list(report.assumptions),
        "unmeasured": list(report.unmeasured),
        "needs_input": [{"flag": n.flag, "excluded": n.excluded, "give": n.give} for n in report.needs_input],
    }
    out.update(extra or {})
    return out
