"""What is measured of a standalone MTP stage and what is not (stdlib only).

A ``--pipeline-model-parallel-layout`` whose MTP layers sit in the last model chunk of a pipeline
rank other than the last is megatron-core's ``mtp_standalone``: that virtual stage
(:attr:`~megatron_flops.memory.layout.Parallelism.mtp_stage`) builds an embedding copy and the MTP
layers and sends ``[(1 + k) s, b, h]`` on; the last stage computes every loss. Measured on gloo
(``tests/test_memory_pipeline_split_dist.py``) with TP 1, dense layers, no recompute or LoRA; the
rest of what the reports price there is the formula, named here.
"""

from __future__ import annotations

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec


def standalone_mtp_unmeasured(spec: ModelSpec, par: Parallelism, *, recompute: RecomputeSpec | None,
                              peft: PeftSpec | None) -> list[str]:
    """The report's ``unmeasured`` lines for a standalone MTP stage (none otherwise)."""
    if par.mtp_stage is None:
        return []
    out = []
    on_rank0 = par.mtp_stage % par.pp == 0 and par.mtp_stage > 0
    if spec.tied_output and on_rank0:
        out.append("a standalone MTP stage in pipeline rank 0's last model chunk with tied embeddings: megatron-core "
                   "0.16.1's setup_embeddings_and_output_layer all-reduces rank 0's embedding twice at build time (its "
                   "first chunk and the MTP chunk) and the last rank's once, so on gloo the step never starts; its "
                   "figures are the formula, unmeasured (untied, measured)")
    beyond = [what for what, on in (("TP", par.tp > 1), ("CP", par.cp > 1), ("EP", par.ep > 1),
                                    ("MoE", spec.moe is not None), ("MLA", spec.mla is not None),
                                    ("recompute", recompute is not None), ("LoRA/frozen", peft is not None)) if on]
    if beyond:
        out.append(f"a standalone MTP stage (its embedding copy, MTP layers and [(1 + k) s, b, h] sends measured with TP "
                   f"1, dense layers, no recompute or LoRA): its {', '.join(beyond)} collectives and saved tensors "
                   "are the formula, unmeasured")
    return out
