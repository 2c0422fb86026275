"""``megatron-flops memory``: bytes per GPU (weights, gradients, optimizer state, activations) and
bytes moved per training step, for a megatron-core GPT (DDP or distributed optimizer, TP/PP/VPP/EP)
or a WAN-style DiT (FSDP2 with TP/CP, or megatron-core DDP / distributed optimizer with TP/PP/CP); LoRA and full
training side by side with ``--compare-full``."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from megatron_flops.cli._memory_model import decoder_options, layout_defaults, num_microbatches
from megatron_flops.cli._pipeline_split import SPLIT_FIELDS, add_split_arguments, pipeline_split
from megatron_flops.cli._model_args import LoadedModel, add_model_arguments, load_model
from megatron_flops.memory.decoder import ATTENTION_BACKENDS, backend_convention
from megatron_flops.memory.hybrid_pipeline import hybrid_stages, is_hybrid
from megatron_flops.memory.mla_mtp import TRANSFORMER_IMPLS
from megatron_flops.memory.pipeline_split import dit_split_note, dit_uneven_stages, split_note, uneven_stages
from megatron_flops.memory.layout import DTYPE_BYTES, FSDP_STRATEGIES, OPTIMIZERS, Parallelism, Training
from megatron_flops.flops.passes import (GROUPED_EXPERT_ADAPTERS, LORA_TARGETS, RECOMPUTE_GRANULARITIES,
                                         RECOMPUTE_METHODS)

NOT_COUNTED = ("allocator caching and fragmentation", "workspaces (cuBLAS, NCCL, kernels)", "the CUDA context",
               "temporaries freed inside an op", "gradients of activations during backward")


def _gb(value: int | None) -> str:
    return "n/m" if value is None else f"{value / 1e9:,.3f}"


def _table(columns: dict[str, dict[str, int | None]], title: str) -> list[str]:
    keys = list(dict.fromkeys(k for col in columns.values() for k in col))
    width = max(len(k) for k in keys + [title]) + 2
    lines = [f"{title:<{width}}" + "".join(f"{name:>18}" for name in columns)]
    for key in keys:
        lines.append(f"{key:<{width}}" + "".join(f"{_gb(col.get(key)):>18}" for col in columns.values()))
    return lines


def _columns(report: dict[str, Any]) -> tuple[dict[str, int | None], dict[str, int | None]]:
    gpu = report["per_gpu"]
    # NB: without an input it needs (a VLM's --grid-thw), the activations and the total leave out what
    # that input prices; where activations are not modelled the total is the states' alone: the rows say so.
    excluded = " and ".join(n["excluded"] for n in report.get("needs_input", []))
    without = f", without {excluded}" if excluded else ""
    memory: dict[str, int | None] = {("activations" + without if k == "activations" else k): v
                                     for k, v in gpu["components"].items()}
    memory.setdefault("activations" + without, gpu["activations_bytes"])
    memory["total" + without if gpu["activations_bytes"] is not None else "total, activations not included"] = \
        gpu["total_bytes"]
    comm = dict(report["communication_per_step"])
    comm["total"] = comm.pop("total_bytes")
    comm["total, bus bytes"] = report["bus_bytes_per_step"]["total_bytes"]
    return memory, comm


def format_reports(reports: dict[str, dict[str, Any]], assumptions: list[str]) -> str:
    """Human tables (GB = 10^9 bytes), one column per report."""
    first = next(iter(reports.values()))
    lines = [f"parameters: {first['parameters']['total']:,} total"]
    for name, report in reports.items():
        trainable = report["parameters"]["trainable"]
        lines.append(f"  {name}: {trainable:,} trainable ({trainable / report['parameters']['total']:.2%})")
    memory = {name: _columns(r)[0] for name, r in reports.items()}
    comm = {name: _columns(r)[1] for name, r in reports.items()}
    lines += ["", *_table(memory, "per GPU (GB), most loaded"), "",
              *_table(comm, "communication per step (GB)"), "",
              "payload = the tensor handed to the collective on this GPU (all-reduce tensor, reduce-scatter "
              "input, all-gather output, all-to-all input, p2p sent + received); bus bytes = what a ring moves "
              "per GPU ((n-1)/n of the payload, 2(n-1)/n for all-reduce)"]
    stages = first.get("per_stage") or []
    if len(stages) > 1:
        lines.append("per pipeline stage (" + next(iter(reports)) + "): " + ", ".join(
            f"stage {s['pp_rank']} {_gb(s['total_bytes'])} GB ({_in_flight(s)})" for s in stages))
    span = first["per_gpu"].get("activations_range_bytes")
    if span:
        lines.append(f"activations per GPU with unbalanced routing: {_gb(span[0])} to {_gb(span[1])} GB "
                     "(table: balanced)")
    for key, (lo, hi) in first.get("communication_ranges_per_step", {}).items():
        lines.append(f"{key} per GPU with unbalanced routing: {_gb(lo)} to {_gb(hi)} GB (table: balanced)")
    for name, report in reports.items():
        for reason in report["not_modelled"]:
            lines.append(f"not modelled ({name}): {reason}")
        for what in report.get("unmeasured", []):
            lines.append(f"unmeasured formula ({name}): {what}")
        for need in report.get("needs_input", []):
            lines.append(f"needs {need['flag']} ({name}): {need['excluded']} are left out of the total: give "
                         f"{need['give']}")
    lines.append("assumptions: " + "; ".join(assumptions + first.get("modelling_assumptions", [])))
    lines.append("not counted: " + ", ".join(NOT_COUNTED))
    return "\n".join(lines)


def _in_flight(stage: dict[str, Any]) -> str:
    count = stage["forward_passes_in_flight"]
    if count is None:
        return "activations not modelled"
    return f"{count} forward pass{'' if count == 1 else 'es'} in flight"


def _training(args: argparse.Namespace, seq_length: int) -> Training:
    bucket = args.bucket_size
    if args.overlap_grad_reduce and bucket is None:
        from megatron_flops.memory.report import default_bucket_size

        bucket = default_bucket_size(args.dp)
    return Training(seq_length=seq_length, micro_batch_size=args.micro_batch_size,
                    num_microbatches=args.num_microbatches, params_dtype=args.params_dtype,
                    grad_reduce_in_fp32=not args.no_grad_reduce_in_fp32, optimizer=args.optimizer,
                    bucket_size=bucket)


def _resolve_layout(args: argparse.Namespace, model: LoadedModel) -> None:
    """Fill the layout and batch flags left unset from a Megatron-LM command line, else their defaults."""
    for name, value in layout_defaults(model).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.num_microbatches is None:
        args.num_microbatches = num_microbatches(model, micro_batch_size=args.micro_batch_size, dp=args.dp)


def _parallelism(args: argparse.Namespace) -> Parallelism:
    return Parallelism(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep, dp=args.dp, etp=args.etp,
                       sequence_parallel=args.sequence_parallel,
                       distributed_optimizer=bool(args.distributed_optimizer), fsdp=bool(args.fsdp),
                       megatron_fsdp=args.megatron_fsdp)


def _dit(args: argparse.Namespace, model: LoadedModel, training: Training, par: Parallelism) -> dict[str, dict]:
    from megatron_flops.flops.dit_passes import dit_setup
    from megatron_flops.memory.fsdp import dit_memory_report

    megatron = _dit_megatron(par)
    setup = dit_setup(model.raw, frozen=args.frozen, lora_rank=args.lora_rank,
                      lora_targets=None if args.lora_targets is None else args.lora_targets.split(","),
                      recompute=args.recompute, recompute_method=args.recompute_method,
                      recompute_num_layers=args.recompute_num_layers, source=model.source)
    backend = "flash" if args.attention_backend is None else backend_convention(args.attention_backend)
    attention = "local" if backend == "unfused" else backend
    # (the largest stage's: memory/dit_layouts.py caps each stage's checkpointing at its blocks)
    stage_blocks = max(par.stage_layers) if par.stage_layers else setup.spec.num_layers // (par.pp if megatron else 1)
    checkpointed, group = _checkpointed_dit_blocks(stage_blocks, setup.recompute)
    name = "LoRA" if setup.peft is not None and setup.peft.lora_rank else "this setup"
    if par.fsdp and (par.world_size > par.dp or par.vpp):  # FSDP2 beside TP/CP (PP, EP refused there)
        from megatron_flops.memory.dit_fsdp_layouts import dit_fsdp_layout_report

        return {n: dit_fsdp_layout_report(setup.spec, par, training, peft=p, attention=attention,
                                          checkpointed_blocks=checkpointed, checkpoint_group=group)
                for n, p in ((name, setup.peft), ("full", None)) if n == name or args.compare_full}
    if megatron:
        from megatron_flops.memory.dit_layouts import dit_layout_report

        return {n: dit_layout_report(setup.spec, par, training, peft=p, attention=attention,
                                     checkpointed_blocks=checkpointed, checkpoint_group=group)
                for n, p in ((name, setup.peft), ("full", None)) if n == name or args.compare_full}
    reports = {name: dit_memory_report(setup.spec, training, dp=par.dp, peft=setup.peft, attention=attention,
                                       checkpointed_blocks=checkpointed, checkpoint_group=group)}
    if args.compare_full:
        reports["full"] = dit_memory_report(setup.spec, training, dp=par.dp, attention=attention,
                                            checkpointed_blocks=checkpointed, checkpoint_group=group)
    return reports


def _dit_megatron(par: Parallelism) -> bool:
    """A DiT under megatron-core DDP / distributed optimizer / Megatron-FSDP, as Megatron-Bridge
    trains WAN (memory/dit_layouts.py): any layout but one GPU without a parallel flag (the
    example's module alone) and --fsdp."""
    return not par.fsdp and (par.world_size > 1 or par.distributed_optimizer or par.ep > 1
                             or par.megatron_fsdp is not None)


def _checkpointed_dit_blocks(num_layers: int, recompute: Any) -> tuple[int, int]:
    """(blocks checkpointed, blocks per checkpoint): block: the first ``recompute_num_layers`` one
    by one; uniform: all, in groups of ``recompute_num_layers`` (megatron-core's methods)."""
    if recompute is None:
        return 0, 1
    if recompute.method == "uniform":
        return num_layers, min(recompute.num_layers or 1, num_layers)
    return min(recompute.num_layers or num_layers, num_layers), 1


def _decoder(args: argparse.Namespace, model: LoadedModel, training: Training, par: Parallelism) -> dict[str, dict]:
    from megatron_flops.cli.estimate import _training_setup
    from megatron_flops.memory.report import decoder_memory, report_dict

    spec, raw = model.spec, model.raw
    if spec is None:
        raise ValueError(f"{model.source}: holds no decoder (a vision tower alone is not modelled)")
    options, differences = decoder_options(args, model)
    if raw.get("pipeline_model_parallel_layout") is not None:  # (megatron-core sets mtp_standalone from it)
        options = replace(options, mtp_standalone=False)
    peft, recompute = _training_setup(args, raw, model.source)
    if training.optimizer != "adam" and par.distributed_optimizer:
        raise ValueError("megatron-core's distributed optimizer supports Adam only (DistributedOptimizer asserts "
                         "'Only Adam and HybridDeviceOptimizer currently supported')")
    name = "LoRA" if peft is not None and peft.lora_rank else "this setup"
    frozen = peft is not None and peft.frozen
    reports = {name: report_dict(decoder_memory(spec, options, par, training, peft=peft, recompute=recompute,
                                                vision=_vision(args, raw, training, par, frozen=frozen)))}
    if args.compare_full:
        reports["full"] = report_dict(decoder_memory(spec, options, par, training, recompute=recompute,
                                                     vision=_vision(args, raw, training, par, full=True)))
    for report in reports.values():
        report["not_modelled"] += differences
    return reports


def _vision(args: argparse.Namespace, raw: dict[str, Any], training: Training, par: Parallelism, *,
            frozen: bool = False, full: bool = False) -> Any:
    """A VLM's tower (None without one): trained unless ``--frozen`` or Megatron-Bridge's freeze
    flags say otherwise (``full``: everything trains); activations over ``--grid-thw``."""
    from megatron_flops.cli._common import json_list_arg
    from megatron_flops.memory.vision import default_attention, vision_memory, vision_tower

    tower = vision_tower(raw)
    if tower is None:
        if args.grid_thw or args.vision_attention or args.freeze_vision_model or args.freeze_vision_projection:
            raise ValueError("--grid-thw, --vision-attention and --freeze-vision-* apply to a model file with a "
                             "'vision_config'")
        return None
    grids = None if args.grid_thw is None else json_list_arg("--grid-thw", args.grid_thw)
    attention = args.vision_attention or default_attention(raw)
    return vision_memory(tower, grids, act_bytes=training.param_bytes, attention=attention, cp=par.cp,
                         tokens=training.seq_length * training.micro_batch_size,
                         embedding_trains=not frozen, model_trains=full or not (frozen or args.freeze_vision_model),
                         projection_trains=full or not (frozen or args.freeze_vision_projection))


def _cmd_memory(args: argparse.Namespace) -> int:
    model = load_model(args)
    if model.seq_length is None:
        raise ValueError("give --seq-length N (or a --megatron-args command line with --seq-length)")
    _resolve_layout(args, model)
    training, par = _training(args, model.seq_length), _parallelism(args)
    dit = "dit" in model.raw
    split = pipeline_split(args, model)
    if dit:  # (a DiT file holds no split fields: the flags give them)
        from megatron_flops.flops.dit import DiTSpec

        par = dit_uneven_stages(split, par, num_layers=DiTSpec.from_mapping(model.raw["dit"], source=model.source)
                                .num_layers)
        split_notes = dit_split_note(split, par)
    else:
        if split.uneven:  # the split fields reach RecomputeSpec, which re-runs each uneven chunk's first layers
            model = replace(model, raw={**model.raw, **{k: getattr(split, k) for k in SPLIT_FIELDS}})
        if model.spec is not None:  # a hybrid pattern's '|' segments make its VPP
            par = uneven_stages(split, hybrid_stages(model.spec, par), spec=model.spec)
        split_notes = split_note(split, par, hybrid=model.spec is not None and is_hybrid(model.spec))
    reports = (_dit if dit else _decoder)(args, model, training, par)
    assumptions = [
        f"{args.params_dtype} weights" + (" (fp32 shards cast for compute)" if dit and not _dit_megatron(par)
                                          and args.params_dtype != "fp32"
                                          else " + fp32 main copies" if args.params_dtype != "fp32" else ""),
        # NB: Megatron-LM's --use-torch-fsdp2 reduces in the params dtype (no MixedPrecisionPolicy).
        f"gradients reduced in {'fp32' if training.grad_bytes == 4 and (dit or not par.fsdp) else args.params_dtype}",
        f"{args.optimizer} ({'exp_avg, exp_avg_sq' if args.optimizer == 'adam' else 'momentum'}, fp32)",
        f"{par.world_size} GPUs (TP {par.tp} x PP {par.pp}" + (f" x CP {par.cp}" if par.cp > 1 else "")
        + f" x DP {par.dp}" + (f", VPP {par.vpp}" if par.vpp else "") + (f", EP {par.ep}" if par.ep > 1 else "")
        + (f", expert TP {par.expert_tp}" if par.expert_tp != par.tp and par.ep > 1 else "")
        + (", sequence parallel" if par.sequence_parallel and par.tp > 1 else "") + ")",  # (split_note: the split)
        "FSDP2" if par.fsdp else f"Megatron-FSDP ({par.megatron_fsdp})" if par.megatron_fsdp
        else "distributed optimizer" if par.distributed_optimizer else "DDP",
        f"{args.num_microbatches} micro-batches of {args.micro_batch_size} x {training.seq_length} tokens",
        *split_notes,
    ]
    if args.json:
        out = dict(next(iter(reports.values())))
        if len(reports) > 1:
            out["compare"] = reports
        out["assumptions"] = assumptions + out.get("modelling_assumptions", [])
        out["not_counted"] = list(NOT_COUNTED)
        print(json.dumps(out))
    else:
        print(format_reports(reports, assumptions))
    return 0


def add_parser(sub: Any) -> None:
    """Register ``memory`` on the top-level subparsers."""
    mem = sub.add_parser(
        "memory", help="bytes per GPU and bytes moved per training step",
        description="Weights, gradients, optimizer state and saved activations per GPU, and the payload of every "
                    "collective per training step, as megatron-core (DDP, distributed optimizer) or torch FSDP2 "
                    "allocate and send them.",
    )
    add_model_arguments(mem, model_help="a JSON/YAML model file (megatron-core TransformerConfig fields, a Hugging "
                                        "Face config.json, or a DiT file with a 'dit' section)")
    mem.add_argument("--seq-length", type=int, metavar="S",
                     help="tokens per sequence (a DiT: video tokens per sample; default: --megatron-args' "
                          "--seq-length)")
    mem.add_argument("--micro-batch-size", type=int, metavar="B",
                     help="sequences per micro-batch (default: --megatron-args' --micro-batch-size, else 1)")
    mem.add_argument("--num-microbatches", type=int, metavar="N",
                     help="micro-batches per step per DP rank (default: --megatron-args' --global-batch-size / "
                          "(B x DP), else 1)")
    # NB: --tp, --pp, --cp, --ep, --vpp, --sequence-parallel, --distributed-optimizer and --params-dtype
    # default to a --megatron-args command line's, else 1, 1, 1, 1, none, off, off, bf16.
    for flag, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert"), ("dp", "data")):
        mem.add_argument(f"--{flag}", type=int, default=1 if flag == "dp" else None, metavar="N",
                         help=f"{what}-parallel size")
    mem.add_argument("--etp", type=int, metavar="N",
                     help="the routed experts' tensor-parallel size (megatron-core's expert_tensor_parallel_size; "
                          "default: --megatron-args' --expert-tensor-parallel-size, else --tp)")
    mem.add_argument("--vpp", type=int, metavar="N", help="model chunks per pipeline rank (interleaved 1F1B)")
    add_split_arguments(mem)
    mem.add_argument("--sequence-parallel", action="store_true", default=None,
                     help="sequence parallelism (the activations between layers split over TP)")
    shard = mem.add_mutually_exclusive_group()
    shard.add_argument("--distributed-optimizer", action="store_true", default=None,
                       help="megatron-core's DistributedOptimizer (optimizer state sharded over DP)")
    shard.add_argument("--fsdp", action="store_true", default=None,
                       help="torch FSDP2 (a DiT file: the example's; a decoder: Megatron-LM's --use-torch-fsdp2)")
    shard.add_argument("--megatron-fsdp", choices=FSDP_STRATEGIES, metavar="STRATEGY",
                       help="Megatron-FSDP (Megatron-LM's --use-megatron-fsdp) with this "
                            "--data-parallel-sharding-strategy: " + ", ".join(FSDP_STRATEGIES) + " (a formula)")
    mem.add_argument("--params-dtype", choices=sorted(DTYPE_BYTES),
                     help="weight dtype (16-bit: fp32 main copies; FSDP2: the compute dtype over fp32 shards; "
                          "default bf16)")
    mem.add_argument("--no-grad-reduce-in-fp32", action="store_true",
                     help="accumulate and reduce gradients in the parameter dtype")
    mem.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="Adam (two moments) or SGD (momentum)")
    mem.add_argument("--overlap-grad-reduce", action="store_true",
                     help="DDP buckets of --bucket-size parameters (default Megatron-LM's max(40M, 1M x DP))")
    mem.add_argument("--bucket-size", type=int, metavar="N", help="DDP bucket size in parameters")
    mem.add_argument("--attention-backend", choices=sorted(ATTENTION_BACKENDS),
                     help="saved-activation convention: local/unfused (megatron-core's DotProductAttention) or "
                          "flash/fused/auto (default: the model file's attention_backend or --megatron-args' "
                          "--attention-backend, else auto)")
    mem.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS,
                     help="Megatron-LM's layer spec: moves multi-latent attention's down projections under TP "
                          "(transformer_engine: whole on every TP rank, a formula; local: split, measured; "
                          "default: the model file's transformer_impl, else transformer_engine as Megatron-LM)")
    mem.add_argument("--moe-token-dispatcher", choices=("alltoall", "allgather", "flex"),
                     help="megatron-core's moe_token_dispatcher_type (default: the model file's or --megatron-args'; Hugging Face MoE "
                          "configs: alltoall, as Megatron-Bridge sets it)")
    mem.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES,
                     help="activation recompute granularity (default: the model file's)")
    mem.add_argument("--recompute-method", choices=RECOMPUTE_METHODS,
                     help="full recompute: uniform (groups of layers) or block (the first N layers per chunk)")
    mem.add_argument("--recompute-num-layers", type=int, metavar="N", help="full recompute: layers per group or block")
    mem.add_argument("--recompute-modules", metavar="NAMES",
                     help="comma-separated selective recompute modules (default core_attn); activations modelled "
                          "for core_attn, mlp, layernorm, moe, shared_experts and mla_up_proj, "
                          "and as a formula for moe_act (grouped-GEMM experts only)")
    mem.add_argument("--frozen", action="store_true", help="freeze every base weight")
    mem.add_argument("--lora-rank", type=int, metavar="R", help="add rank-R LoRA adapters")
    mem.add_argument("--lora-targets", metavar="NAMES",
                     help=f"decoder: of {','.join(LORA_TARGETS)}; DiT: WAN module names (q,k,v,o,k_img,...)")
    mem.add_argument("--lora-grouped-experts", choices=GROUPED_EXPERT_ADAPTERS,
                     help="Megatron-Bridge 0.6's adapters on grouped-GEMM (TEGroupedMLP) experts: shared by the "
                          "local experts (default), per-expert or shared-outer (formulas: CUDA-only)")
    mem.add_argument("--grid-thw", metavar="GRIDS",
                     help="a VLM: JSON list of the [t, h, w] vision grids of one micro-batch (inline or a file): "
                          "the vision tower's activations")
    mem.add_argument("--vision-attention", choices=("eager", "sdpa", "flash_attention_2"),
                     help="a VLM: the tower's attn_implementation (default: the model file's, else transformers' "
                          "sdpa, which Megatron-Bridge keeps)")
    mem.add_argument("--freeze-vision-model", action="store_true",
                     help="a VLM: freeze the tower's patch embedding and blocks (Megatron-Bridge's "
                          "freeze_vision_model)")
    mem.add_argument("--freeze-vision-projection", action="store_true",
                     help="a VLM: freeze the tower's merger (Megatron-Bridge's freeze_vision_projection)")
    mem.add_argument("--compare-full", action="store_true", help="also show full training (no LoRA, nothing frozen)")
    mem.add_argument("--json", action="store_true", help="print one JSON object")
    mem.set_defaults(func=_cmd_memory)
