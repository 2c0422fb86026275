"""A frozen base whose first layer is MoE, adapted on the experts only (``linear_fc1``/``linear_fc2``,
no attention target: the gradient starts inside that layer, :mod:`megatron_flops.memory.moe_lora_start`)
under TP2 + sequence parallelism, EP2 (alltoall and allgather dispatchers) and TP2 x EP2 + SP: one real
training step each on megatron-core 0.16.1 in 2 gloo processes (4 for TP2 x EP2) with Megatron-Bridge
0.3.1's adapters (tests/test_memory_lora_tp_dist.py's scaffolding: top-k = experts, fp32), against
:mod:`megatron_flops.memory` to the byte: parameters, states, every collective's payload, the bytes each
forward saves and the schedule's peak. The runs cover an attention target beside the experts', gated
shared experts, an MLA first layer (also under selective ``mla_up_proj``, alone and with ``core_attn``),
MoE latent projections (``moe_latent_size``) at TP2 + SP and EP2, full recompute, selective
``core_attn`` and ``mlp`` recompute, and selective ``moe`` (refused: no backward runs in its checkpoint)."""

from __future__ import annotations

import pytest

import mcore_cpu
from megatron_flops.memory.activations import check_activations_supported
from test_memory_lora_tp_dist import (BASE, MLA, MOE, check_activations, check_parameters,
                                      check_states_and_communication, measure, setup)

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

SWIGLU = dict(gated_linear_unit=True, activation_func="silu")
MIXTRAL = "TP2 + SP, MoE every layer (alltoall), fused SwiGLU experts, LoRA on linear_fc1 + linear_fc2"
WITH_PROJ = "TP2 + SP, MoE every layer (alltoall), fused SwiGLU experts, LoRA on linear_proj + linear_fc1 + linear_fc2"
_MIXTRAL_LIKE = dict(BASE, **dict(MOE, moe_layer_freq=1), **SWIGLU, bias_activation_fusion=True,
                     moe_token_dispatcher_type="alltoall")
EP_ALLTOALL = "EP2, MoE every layer (alltoall), fused SwiGLU experts, LoRA on linear_fc1 + linear_fc2"
LATENT_TP = "TP2 + SP, Mixtral-like with latent 24 (alltoall), LoRA on linear_fc1 + linear_fc2"
MLA_MOE_FIRST = "TP2 + SP, MLA (q_lora) + MoE every layer (alltoall), shared experts, LoRA on linear_fc1 + linear_fc2"
LATENT_EP = "EP2, Mixtral-like with latent 24 (alltoall), LoRA on linear_fc1 + linear_fc2"
RUNS = {
    # Mixtral's layer: every layer MoE, fused SwiGLU experts, alltoall, no shared experts.
    MIXTRAL: dict(world=2, layout=dict(tp=2, sp=True), model=_MIXTRAL_LIKE, m=2,
                  lora=(("linear_fc1", "linear_fc2"), 4)),
    # The same with an attention target: the gradient starts before the dispatcher.
    WITH_PROJ: dict(world=2, layout=dict(tp=2, sp=True), model=_MIXTRAL_LIKE, m=2,
                    lora=(("linear_proj", "linear_fc1", "linear_fc2"), 4)),
    # The shared experts' fc2 adapter comes first (they run before the router), then the routed experts'.
    "TP2 + SP, MoE first of 2 layers (allgather), unfused SwiGLU, gated shared experts, LoRA on linear_fc2": dict(
        world=2, layout=dict(tp=2, sp=True),
        model=dict(BASE, **dict(MOE, moe_layer_freq=[1, 0]), **SWIGLU, moe_token_dispatcher_type="allgather",
                   moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True),
        m=2, lora=(("linear_fc2",), 4)),
    # An MLA first layer: its projections, as attention's, run no backward before the experts' adapters.
    "TP2 + SP, MLA (q_lora) + MoE every layer (alltoall), LoRA on linear_fc1": dict(
        world=2, layout=dict(tp=2, sp=True),
        model=dict(BASE, **MLA, q_lora_rank=24, **dict(MOE, moe_layer_freq=1), moe_token_dispatcher_type="alltoall"),
        m=2, lora=(("linear_fc1",), 4)),
    # Selective mla_up_proj: layer 0's up-projection checkpoint runs before any adapter (its inputs require no
    # grad): it saves nothing and never re-runs, so layer 1's up projections alone all-gather their latents again.
    **{f"{MLA_MOE_FIRST}, selective {' + '.join(modules)}": dict(
        world=2, layout=dict(tp=2, sp=True), m=2, lora=(("linear_fc1", "linear_fc2"), 4), live=True,
        model=dict(BASE, **MLA, q_lora_rank=24, **dict(MOE, moe_layer_freq=1), moe_token_dispatcher_type="alltoall",
                   moe_shared_expert_intermediate_size=40, recompute_granularity="selective",
                   recompute_modules=list(modules)))
       for modules in (("mla_up_proj",), ("core_attn", "mla_up_proj"))},
    # EP2 (TP 1): the alltoall dispatcher's all-to-all carries tokens that need no gradient (the first
    # adapter is behind it), the combine's does; allgather gathers over the EP group.
    EP_ALLTOALL: dict(world=2, layout=dict(tp=1, ep=2), model=_MIXTRAL_LIKE, m=2, lora=(("linear_fc1", "linear_fc2"), 4)),
    "EP2, MoE every layer (allgather), fused SwiGLU experts, LoRA on linear_fc1 + linear_fc2": dict(
        world=2, layout=dict(tp=1, ep=2), model=dict(_MIXTRAL_LIKE, moe_token_dispatcher_type="allgather"), m=2,
        lora=(("linear_fc1", "linear_fc2"), 4)),
    "EP2, Mixtral-like, LoRA on linear_fc1 + linear_fc2, full recompute (uniform 1)": dict(
        world=2, layout=dict(tp=1, ep=2), m=2, lora=(("linear_fc1", "linear_fc2"), 4),
        model=dict(_MIXTRAL_LIKE, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    # Layer 0's checkpointed core attention runs before any adapter: it saves nothing, re-runs nothing.
    "EP2, Mixtral-like, LoRA on linear_fc1 + linear_fc2, selective core_attn": dict(
        world=2, layout=dict(tp=1, ep=2), m=2, lora=(("linear_fc1", "linear_fc2"), 4), live=True,
        model=dict(_MIXTRAL_LIKE, recompute_granularity="selective")),
    # Latent projections (tests/mcore_cpu.DuplicatedLinearStandIn for TELinear): the dispatcher moves latent
    # tokens; the frozen projections keep nothing (fc1's runs before any adapter).
    LATENT_TP: dict(world=2, layout=dict(tp=2, sp=True), model=dict(_MIXTRAL_LIKE, moe_latent_size=24), m=2,
                    lora=(("linear_fc1", "linear_fc2"), 4)),
    LATENT_EP: dict(world=2, layout=dict(tp=1, ep=2), model=dict(_MIXTRAL_LIKE, moe_latent_size=24), m=2,
                    lora=(("linear_fc1", "linear_fc2"), 4)),
    # Selective mlp checkpoints the dense layer 1 only (megatron-core's TransformerLayer: not is_moe_layer).
    "TP2 + SP, MoE first of 2 layers (alltoall), LoRA on linear_fc1 + linear_fc2, selective mlp": dict(
        world=2, layout=dict(tp=2, sp=True), m=2, lora=(("linear_fc1", "linear_fc2"), 4), live=True,
        model=dict(_MIXTRAL_LIKE, moe_layer_freq=[1, 0], recompute_granularity="selective", recompute_modules=["mlp"])),
    "TP2 x EP2 + SP, Mixtral-like (alltoall), LoRA on linear_fc1 + linear_fc2": dict(
        world=4, layout=dict(tp=2, sp=True, ep=2), model=_MIXTRAL_LIKE, m=2, lora=(("linear_fc1", "linear_fc2"), 4)),
}
# Refused (flops.passes.check_checkpointed_regions, as estimate refuses it): selective 'moe' wraps each MoE
# layer in a checkpoint whose input requires no grad, so no backward runs in it.
SELECTIVE_MOE = "EP2, Mixtral-like, LoRA on linear_fc1 + linear_fc2, selective moe"
REFUSED = {SELECTIVE_MOE: dict(world=2, layout=dict(tp=1, ep=2), m=2, lora=(("linear_fc1", "linear_fc2"), 4), live=True,
                               model=dict(_MIXTRAL_LIKE, recompute_granularity="selective", recompute_modules=["moe"]))}


@pytest.fixture(scope="module")
def measured():
    return measure(dict(RUNS, **REFUSED))


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_in_megatron_order(measured, name):
    check_parameters(measured[name], *setup(name, RUNS))


@pytest.mark.parametrize("name", list(RUNS))
def test_states_and_communication(measured, name):
    check_states_and_communication(measured[name], *setup(name, RUNS))


@pytest.mark.parametrize("name", list(RUNS))
def test_activations_per_forward_and_schedule_peak(measured, name):
    check_activations(measured[name], *setup(name, RUNS))


def test_dispatcher_runs_no_backward_before_the_experts_adapters(measured):
    # Layer 0's alltoall dispatcher all-gathers over TP the routed tokens [n, h] and probabilities [n]
    # (n = s/TP x b x TP x k = 8 x 2 x 2 x 4 = 128); with linear_proj adapted they require grad, and their
    # gradients [n, h + 1] = 128 x 49 fp32 = 25,088 B are reduce-scattered per micro-batch, x 2. linear_proj's
    # adapter and base add no reduce-scatter (all-gathers and all-reduces only): the one term between them.
    for experts, proj in zip(measured[MIXTRAL], measured[WITH_PROJ]):
        assert dict(proj["comm"])["tp/reduce_scatter"] - dict(experts["comm"])["tp/reduce_scatter"] == 2 * 25_088


def test_ep_dispatcher_all_to_all_runs_no_backward_before_the_experts_adapters(measured):
    # EP2, TP 1, alltoall: per MoE layer and micro-batch this rank's T_l x k = 16 x 2 x 4 = 128 routed tokens
    # [128, h] and probabilities [128] go to the experts, their output [128, h] comes back: 128 x (2 x 48 + 1)
    # x 4 B = 49,664 B forward, as much backward. Layer 0's dispatch needs no gradient: 128 x 49 x 4 =
    # 25,088 B fewer. 2 layers x 2 micro-batches: 4 x 2 x 49,664 - 2 x 25,088 = 347,136 B.
    for result in measured[EP_ALLTOALL]:
        assert dict(result["comm"])["ep/all_to_all"] == 347_136


def test_latent_dispatcher_all_to_all_moves_latent_tokens(measured):
    # As above with moe_latent_size 24: the routed tokens are latent-wide, 128 x (24 + 1) x 4 B = 12,800 B
    # dispatched and 128 x 24 x 4 = 12,288 B combined per MoE layer and micro-batch, as much backward but
    # layer 0's dispatch: 4 x 2 x 25,088 - 2 x 12,800 = 175,104 B.
    for result in measured[LATENT_EP]:
        assert dict(result["comm"])["ep/all_to_all"] == 175_104


def test_selective_moe_recompute_runs_no_backward_in_the_moe_layers(measured):
    # Selective 'moe' checkpoints each MoE layer around an input that requires no grad: forward only,
    # 4 x 49,664 = 198,656 B of ep/all_to_all (none in backward; no adapter trains), and refused.
    for result in measured[SELECTIVE_MOE]:
        assert dict(result["comm"])["ep/all_to_all"] == 198_656
    spec, options, par, _, peft, recompute = setup(SELECTIVE_MOE, REFUSED)
    # (one rule with estimate's: flops/passes.py check_checkpointed_regions)
    with pytest.raises(ValueError, match="selective recompute of 'moe' with a frozen base: megatron-core's reentrant "
                                         "checkpoint gives the trainable weights of .* no gradient"):
        check_activations_supported(spec, options, par, recompute, peft)


@pytest.mark.parametrize("modules", [("mla_up_proj",), ("core_attn", "mla_up_proj")])
def test_mla_up_proj_reruns_only_the_later_layers_all_gathers(modules):
    # Under TP2 + SP each re-run up projection all-gathers its latent again: q [s, b, 24] and kv [s, b, 32], T = 16 x 2
    # = 32 tokens, fp32: 32 x 56 x 4 = 7,168 B per MLA layer and micro-batch. Layer 0's checkpoint never re-runs (its
    # inputs require no grad): layer 1 only, x 2 micro-batches = 14,336 B (in the measured tp/all_gather above).
    from megatron_flops.memory.recompute import selective_rerun_communication

    spec, _, par, training, peft, recompute = setup(f"{MLA_MOE_FIRST}, selective {' + '.join(modules)}", RUNS)
    assert selective_rerun_communication(spec, par, training, pp_rank=0, recompute=recompute, peft=peft) == \
        {"tp/all_gather": 14_336}
