"""Memory per GPU and bytes moved per training step (stdlib only: ints in, ints out).

Conventions, written once (each module's NB comments say where they apply):

- Bytes are those of distinct storages on the rank, padding included, as megatron-core and torch
  allocate them: megatron-core's DDP buffers (:mod:`.states`; a DiT: :mod:`.dit_layouts`), FSDP2's dim-0
  shards (:mod:`.fsdp` for a DiT, :mod:`.decoder_fsdp` for a decoder as Megatron-LM's ``--use-torch-fsdp2``).
- bf16/fp16 weights train with fp32 gradients (``grad_reduce_in_fp32``) and fp32 main copies in
  the optimizer; fp32 weights are their own main copy. Adam keeps ``exp_avg`` and ``exp_avg_sq``
  (its per-tensor ``step`` scalar is not counted); SGD one ``momentum_buffer``.
- Activations (:mod:`.activations`): bytes saved for backward by one micro-batch as megatron-core's
  local layer spec saves them on CUDA, times the micro-batches in flight at the schedule's peak.
- Communication (:mod:`.comm`): the payload each GPU hands to each collective per step, keyed
  ``<group>/<kind>``; one-rank groups and one-element collectives are not counted.

Measured against megatron-core and torch FSDP2 on CPU with gloo to the byte:
``tests/test_memory_dist.py``, ``tests/test_memory_activations.py``, ``tests/test_memory_fsdp.py``,
``tests/test_memory_dit_activations.py``, ``tests/test_memory_decoder_fsdp.py``,
``tests/test_memory_dit_layouts.py``.
"""

from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.fsdp import dit_memory_report, fsdp_rank_memory
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import MemoryReport, RankMemory, decoder_memory, rank_memory, report_dict

__all__ = [
    "DecoderOptions",
    "MemoryReport",
    "Parallelism",
    "RankMemory",
    "Training",
    "decoder_memory",
    "dit_memory_report",
    "fsdp_rank_memory",
    "rank_memory",
    "report_dict",
]
