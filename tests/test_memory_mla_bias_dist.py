"""Multi-latent attention with megatron-core's linear biases (``add_bias_linear``): megatron-core
0.16.1's MLA builds every projection but ``linear_proj`` with bias=False, so the biases are
``linear_proj``'s (row parallel: whole on every TP rank, its gradient all-reduced over TP under
sequence parallelism) and the MLP's. One real training step on the local spec in 4 gloo processes
(tests/test_memory_dist.py's worker and checks), against :mod:`megatron_flops.memory` to the byte:
parameters in order, weights, gradient buffers, optimizer state, every collective's payload, the
bytes each forward saves and the schedule's peak. (Hugging Face's ``attention_bias`` on the down
projections, which megatron-core lacks: tests/test_memory_hf_biases.py.)"""

from __future__ import annotations

import pytest

import mcore_cpu
import mcore_dist
from test_memory_dist import (WORLD, check_activations, check_communication, check_parameters, check_states,
                              memory_worker)
from test_memory_mla_mtp_dist import MLA

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

RUNS = {
    # Per layer beyond the run without biases: linear_proj's bias [h] = 48 and the MLP's [ffn/TP] = 36
    # and [h] = 48; under SP the whole ones (48 + 48) join the norms' gradient all-reduce over TP.
    "TP2 x DP2 + SP, MLA (q_lora, latent norms), linear biases, fp32": dict(
        layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, add_bias_linear=True), m=2,
        build=dict(params_dtype="fp32")),
}


@pytest.fixture(scope="module")
def measured():
    return mcore_dist.run_by_name(memory_worker, WORLD, RUNS, timeout=600)


@pytest.mark.parametrize("name", list(RUNS))
def test_mla_with_linear_biases_against_megatron_core(measured, name):
    check_parameters(RUNS[name], measured[name])
    check_states(RUNS[name], measured[name])
    check_communication(RUNS[name], measured[name])
    check_activations(RUNS[name], measured[name])
