"""Pipeline stages of a hybrid layer pattern as megatron-core builds them (stdlib only).

megatron-core 0.19's ``HybridModel`` splits the main pattern at its ``|`` separators into
segments and builds segment ``v x PP + r`` as model chunk ``v`` of pipeline rank ``r``
(``select_pipeline_segment``); Megatron-LM 0.19 derives VPP = segments / PP (None when they are
equal) and refuses ``--num-virtual-stages-per-pipeline-rank`` beside a hybrid pattern. A pattern
without ``|`` is split evenly over PP and takes no VPP (megatron-core 0.16.1, which reads no
``|``, refuses interleaving for hybrid models altogether). ``tests/test_memory_hybrid_pipeline.py``
checks every stage's layers against megatron-core 0.19's own function.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec


def is_hybrid(spec: ModelSpec) -> bool:
    """Built by megatron-core's hybrid stack: Mamba layers, or layers with one sub-block."""
    return any(m in ("mamba", "none") or f == "none" for (m, f), _ in spec.layer_runs)


def hybrid_stages(spec: ModelSpec, par: Parallelism) -> Parallelism:
    """``par`` with the virtual stages megatron-core builds for ``spec``'s hybrid pattern: its
    ``|`` segments as ``stage_layers`` and the VPP they make (``par`` itself for other models).
    ValueError where megatron-core or Megatron-LM refuse the layout."""
    segments = spec.pipeline_segments
    if not segments:
        if par.vpp is not None and is_hybrid(spec):
            raise ValueError("megatron-core takes virtual pipeline stages of a hybrid pattern from its '|' "
                             "separators only (0.19: PP x VPP '|'-delimited segments; 0.16.1 has no interleaving "
                             "for hybrid models): add '|' separators to the pattern instead of --vpp")
        return par
    n = len(segments)
    if par.pp == 1:
        raise ValueError(f"the hybrid pattern has {n} '|'-delimited pipeline segments: megatron-core 0.19 builds "
                         f"segment v x PP + r on pipeline rank r, so they need --pp > 1 (Megatron-LM 0.19 derives "
                         f"VPP = {n} and refuses interleaving on one pipeline rank); remove the '|' separators to "
                         "report one stage")
    if n % par.pp:
        raise ValueError(f"the hybrid pattern's {n} '|'-delimited pipeline segments are not divisible by --pp "
                         f"{par.pp} (megatron-core 0.19 refuses this layout)")
    vpp = n // par.pp if n > par.pp else None
    if par.vpp is not None and par.vpp != (vpp or 1):
        raise ValueError(f"the hybrid pattern's {n} '|'-delimited segments over --pp {par.pp} make VPP {vpp or 1} "
                         f"(Megatron-LM 0.19 derives it from the pattern), not --vpp {par.vpp}")
    return replace(par, vpp=vpp, stage_layers=segments)


def hybrid_pipeline_notes(spec: ModelSpec, par: Parallelism) -> list[str]:
    """The assumption behind a hybrid pattern's stages under PP (none without PP)."""
    if not is_hybrid(spec) or par.pp == 1:
        return []
    if spec.pipeline_segments:
        vpp = f" x VPP {par.num_chunks}" if par.num_chunks > 1 else ""
        return [f"the hybrid pattern's '|' segments {list(spec.pipeline_segments)} (layers each) are the PP {par.pp}"
                f"{vpp} virtual stages, segment v x PP + r on model chunk v of pipeline rank r, as megatron-core 0.19 "
                "builds them (VPP = segments / PP, as Megatron-LM 0.19 derives it; megatron-core 0.16.1 reads no '|')"]
    if par.stage_layers is not None:  # an uneven split (memory/pipeline_split.py names it)
        return []
    return [f"the hybrid pattern's layers split evenly over the {par.pp} pipeline stages, as megatron-core splits a "
            "pattern without '|' separators"]
