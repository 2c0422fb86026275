"""Memory and traffic per GPU of a WAN-style DiT under torch FSDP2 beside tensor, sequence and
context parallelism (stdlib only; a formula: Megatron-Bridge's ``WanModel`` builds Transformer
Engine layers, which do not run on CPU).

NB: FSDP2 shards what one TP rank holds (:func:`~megatron_flops.memory.dit_layouts.dit_rank_params`'s
split: column-parallel q/k/v, cross q/k/v and ``ffn.0`` by output rows, row-parallel o and ``ffn.2``
by input columns, the rest whole) over the DP x CP ranks of that TP rank, as megatron-core's FSDP2
mesh does for a decoder (:func:`~megatron_flops.memory.decoder_fsdp.fsdp_stage`: ``dp = DP x CP``):
the states, ``fsdp/all_gather`` and ``fsdp/reduce_scatter`` and the transient whole copies of
:mod:`megatron_flops.memory.fsdp` (measured over DP alone) with those slices and that group. The
activations and the ``tp/`` and ``cp/`` collectives are those of the megatron-core layouts
(:mod:`megatron_flops.memory.dit_layouts`): the gradients of the weights every TP rank holds whole
all-reduced over TP once per step, whole, as without FSDP.
With TP 1 and CP 1 every figure equals :func:`~megatron_flops.memory.fsdp.dit_memory_report`'s
(measured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from megatron_flops.flops.dit import DiTParam, DiTSpec, dit_parameter_counts
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.comm import bus_bytes
from megatron_flops.memory.dit_layouts import (
    dit_layout_reason,
    dit_rank_states,
    dit_stage_activations,
    dit_step_communication,
    layout_unmeasured,
    tp_rank_param,
)
from megatron_flops.memory.fsdp import FSDP_TRANSIENTS, dit_assumptions, fsdp_rank_memory, fsdp_working_copies
from megatron_flops.memory.layout import Parallelism, Training


def tp_slice(tp: int) -> Callable[[DiTParam], DiTParam]:
    """A parameter as one TP rank holds it: dim 0 FSDP2 shards, the rest of each row kept."""
    def shard(p: DiTParam) -> DiTParam:
        q = tp_rank_param(p, tp)
        rows = q.rows or q.numel
        return DiTParam(p.name, (rows,) if len(p.shape) == 1 else (rows, q.numel // rows), p.trainable)

    return shard


def dit_fsdp_layout_report(spec: DiTSpec, par: Parallelism, training: Training, *, peft: PeftSpec | None = None,
                           attention: str = "flash", checkpointed_blocks: int = 0,
                           checkpoint_group: int = 1) -> dict[str, object]:
    """The JSON form of :func:`~megatron_flops.memory.fsdp.dit_memory_report` for ``--fsdp`` with
    TP, sequence parallelism or CP (see the module NB): the most loaded rank (DP x CP rank 0)."""
    ddp = replace(par, fsdp=False, distributed_optimizer=False)
    reason = dit_layout_reason(spec, ddp, training, peft)
    if reason is not None or par.pp > 1 or par.vpp:
        raise ValueError(reason or f"a DiT under --fsdp (torch FSDP2) with --pp {par.pp} is not modelled (the "
                                   "example shards one whole model; Megatron-LM refuses --use-torch-fsdp2 with PP)")
    group, shard = par.dp * par.cp, tp_slice(par.tp)
    top = fsdp_rank_memory(spec, training, dp=group, peft=peft, shard=shard)
    _, buffers, params = dit_rank_states(spec, ddp, training, pp_rank=0, peft=peft)
    comm = {k: v for k, v in dit_step_communication(spec, ddp, training, pp_rank=0, buffers=buffers, params=params,
                                                    peft=peft, checkpointed_blocks=checkpointed_blocks).items()
            if not k.startswith("dp/")}
    comm = {**top.communication, **comm}
    activations, _ = dit_stage_activations(spec, ddp, training, pp_rank=0, peft=peft, attention=attention,
                                           checkpointed_blocks=checkpointed_blocks, checkpoint_group=checkpoint_group)
    transients = {"fsdp/unsharded_working_copies": fsdp_working_copies(spec, training, dp=group, peft=peft,
                                                                       shard=shard)} if group > 1 else {}
    counts = dit_parameter_counts(spec, peft)
    bus = bus_bytes(comm, {"fsdp": group, "tp": par.tp, "cp": par.cp})
    return {
        "parameters": {"total": counts.num_params, "trainable": counts.num_trainable_params,
                       "per_block": counts.num_block_params, "adapters": counts.num_adapters},
        "per_gpu": {
            "weights_bytes": top.states["weights"],
            "gradients_bytes": sum(v for k, v in top.states.items() if k.startswith("gradients")),
            "optimizer_bytes": sum(v for k, v in top.states.items() if k.startswith("optimizer/")),
            "activations_bytes": activations,
            "total_bytes": top.total + sum(transients.values()) + activations,
            "components": {**top.states, **transients},
        },
        "communication_per_step": {**comm, "total_bytes": sum(comm.values())},
        "bus_bytes_per_step": {**bus, "total_bytes": sum(bus.values())},
        "not_modelled": [],
        "needs_input": [],
        "unmeasured": fsdp_layout_unmeasured(par, attention, peft, transients=bool(transients)),
        "modelling_assumptions": dit_assumptions(attention, checkpointed_blocks, spec.num_layers),
    }


def fsdp_layout_unmeasured(par: Parallelism, attention: str, peft: PeftSpec | None, *, transients: bool) -> list[str]:
    """The formulas of :func:`dit_fsdp_layout_report`: FSDP2's transients, the TP/SP/CP figures and
    FSDP2 over each TP rank's slices and DP x CP ranks."""
    out = layout_unmeasured(replace(par, fsdp=False), attention, peft) + ([FSDP_TRANSIENTS] if transients else [])
    if par.tp > 1 or par.cp > 1:
        out.append(f"torch FSDP2 with TP {par.tp} x CP {par.cp}: each TP rank's parameter slices sharded over the "
                   f"DP x CP = {par.dp * par.cp} ranks (megatron-core's FSDP2 mesh), fsdp/all_gather and "
                   "fsdp/reduce_scatter over them, the TP-replicated weights' gradients all-reduced over TP as "
                   "without FSDP (whole; measured over DP alone, TP 1, CP 1)")
    return out
