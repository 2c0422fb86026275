"""States and data-parallel traffic per GPU of a WAN-style DiT under Megatron-FSDP (Megatron-LM's
``--use-megatron-fsdp``), by sharding strategy (stdlib only).

NB: megatron-core's ``MegatronFSDP`` does not depend on the model beyond its parameter list and
its FSDP unit modules, so a DiT's figures are :mod:`megatron_flops.memory.megatron_fsdp`'s (parameter
groups, buckets and their layout, buffers per strategy, ``dp/reduce_scatter`` and ``dp/all_gather``)
over the DiT's parameters on this rank (:func:`megatron_flops.memory.dit_layouts.dit_rank_params`,
the example module's order), sharded over DP x CP. With ``optim_grads_params`` each block is an FSDP
unit: Megatron-Bridge's ``WanLayerWithAdaLN`` is a ``TransformerLayer``, megatron-core's default
unit (the example's ``WanAttentionBlock``, given as ``fsdp_unit_modules``, when measured); the
embeddings, head and ``img_emb`` make one group outside units, cut into buckets of the DDP bucket
size; a frozen base and its adapters make two groups per unit.

Measured (tests/test_memory_dit_megatron_fsdp.py: the example's module in megatron-core 0.16.1's
``FullyShardedDataParallel`` on 2 gloo ranks, a step after the first): the states and the ``dp/``
collectives per strategy, fully trained and LoRA on a frozen base.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from megatron_flops.memory.decoder import Param
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.dp_ranks import most_loaded_rank as loaded_rank
from megatron_flops.memory.megatron_fsdp import megatron_fsdp_rank, shard_steps

DIT_UNIT = re.compile(r"^(blocks\.\d+\.)")


def most_loaded_rank(params: Sequence[Param], *, strategy: str, size: int, bucket_size: int | None) -> int:
    """The data-parallel rank whose shards hold the most real (not padding) trainable elements,
    the lowest on a tie: every rank's buffers are the same size, so its optimizer moments make it
    the most loaded."""
    steps = shard_steps(params, strategy=strategy, sizes={"dp": size, "expt_dp": 1}, bucket_size=bucket_size,
                        unit=DIT_UNIT)
    return loaded_rank(steps["dp"], ranks=size)


def dit_megatron_fsdp_states(params: Sequence[Param], par: Parallelism,
                             training: Training) -> tuple[dict[str, int], dict[str, int]]:
    """(state bytes, ``dp/`` payload per step) of the most loaded data-parallel rank holding
    ``params`` (one pipeline stage: one model chunk, bucketed)."""
    assert par.megatron_fsdp is not None
    size = par.dp * par.cp
    rank = most_loaded_rank(params, strategy=par.megatron_fsdp, size=size, bucket_size=training.bucket_size)
    return megatron_fsdp_rank(params, training, strategy=par.megatron_fsdp, sizes={"dp": size, "expt_dp": 1},
                              ranks={"dp": rank, "expt_dp": 0}, bucket_size=training.bucket_size, unit=DIT_UNIT)
