"""An expert TP other than TP (megatron-core's ``expert_tensor_parallel_size``), measured as
tests/test_memory_dist.py measures every layout (its worker and checks, on its ``ETP_RUNS``) in a
process group of its own: parameters, weights, gradient buffers, optimizer state, every
collective's payload per rank (the routing-dependent ones within their bounds, exact per expert
group), and the MoE activations (exact in total, bounded per rank)."""

from __future__ import annotations

import pytest

import mcore_cpu
import mcore_dist
import test_memory_dist as base

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]


@pytest.fixture(scope="module")
def measured():
    return mcore_dist.run_by_name(base.memory_worker, base.WORLD, base.ETP_RUNS, timeout=600)


@pytest.mark.parametrize("name", list(base.ETP_RUNS))
def test_parameters_in_megatron_order(measured, name):
    base.check_parameters(base.ETP_RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(base.ETP_RUNS))
def test_weights_gradients_optimizer_state(measured, name):
    base.check_states(base.ETP_RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(base.ETP_RUNS))
def test_communication_per_step(measured, name):
    base.check_communication(base.ETP_RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(base.ETP_RUNS))
def test_moe_activations_balanced_in_total_bounded_per_rank(measured, name):
    base.check_moe_activations_balanced(base.ETP_RUNS[name], measured[name])
