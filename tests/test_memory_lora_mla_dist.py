"""LoRA adapters (Megatron-Bridge 0.3.1's ``ParallelLinearAdapter``, tests/mcore_memory.apply_lora) on
MLA's own projections, and selective ``mla_up_proj`` recompute of a frozen base under TP: one real
training step each on megatron-core 0.16.1's local spec in 2 gloo processes, against
:mod:`megatron_flops.memory` to the byte (parameters in order, states, every collective's payload,
the bytes each forward saves and the schedule's peak), with tests/test_memory_lora_tp_dist.py's
checks. fp32, 2 layers, s = 16, b = 2 (T = 32 tokens), h = 48, rank 4.

In the local spec every MLA projection is a column-parallel layer, so Bridge adapts each as one:
``linear_in`` [r/TP, in] gathering its [T, r] output, ``linear_out`` [out/TP, r]; under sequence
parallelism the adapter all-gathers its input slice itself ([T, h] for the down projections and
``linear_q_proj``, the latent for the up projections) and keeps it."""

from __future__ import annotations

import pytest

import mcore_cpu
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.activations import check_activations_supported
from megatron_flops.memory.decoder import DecoderOptions, check_supported
from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec
from test_memory_lora_tp_dist import (BASE, check_activations, check_parameters, check_states_and_communication,
                                      measure, setup)

MLA = dict(BASE, multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
           normalization="LayerNorm")
FOUR = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
UP = ("linear_q_up_proj", "linear_kv_up_proj")
DENSE = ("linear_proj", "linear_fc1", "linear_fc2")
UP_PROJ = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"])
CORE_ATTN = dict(recompute_granularity="selective", recompute_modules=["core_attn"])

# name -> world size, layout (tp, sp), model, micro-batches, LoRA (targets, rank), live-storage meter
RUNS = {
    # Per MLA layer and micro-batch (TP2): forward, each adapter all-gathers [T, r] = 32 * 4 * 4 = 512 B;
    # backward, each all-reduces [T, r] and its input gradient: [T, h] = 6144 B for a down projection,
    # [T, q_lora] = 3072 B and [T, kv_lora] = 4096 B for the up projections. Layer 0 of the frozen base:
    # the base down projections' input gradients (the hidden states) are never reduced; the latents
    # require grad (both down projections adapted), so the up projections' are.
    "TP2, MLA (q_lora, latent norms), LoRA on the four MLA projections + linear_proj": dict(
        world=2, layout=dict(tp=2), model=dict(MLA, q_lora_rank=24, qk_layernorm=True), m=2,
        lora=(FOUR + ("linear_proj",), 4)),
    # Under SP each down-projection adapter keeps its own all-gathered [T, h] (6144 B), each
    # up-projection adapter its all-gathered latent; in layer 0 the down adapters' input-gradient
    # reduce-scatters do not run (the hidden states require no grad).
    "TP2 + SP, MLA (q_lora, latent norms), LoRA on the four MLA projections + linear_proj": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True), m=2,
        lora=(FOUR + ("linear_proj",), 4)),
    # Up projections only: in layer 0 the latents require no grad (no base up-projection input
    # gradient, no latent gradient all-gather, no adapter input reduce-scatter), nor does k_pos_emb
    # (RoPE keeps no cos and sin for k there).
    "TP2 + SP, MLA (q_lora), LoRA on the up projections": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24), m=2, lora=(UP, 4)),
    # Moonlight's recipe (direct q): kv_up's adapter copies its latent, a view of kv_down's output,
    # contiguous [T, kv_lora].
    "TP2, MLA (direct q), LoRA on linear_q_proj, linear_kv_down_proj, linear_kv_up_proj, linear_proj": dict(
        world=2, layout=dict(tp=2), model=dict(MLA, q_lora_rank=None), m=2,
        lora=(("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"), 4)),
    # One branch adapted: in layer 0 the other branch requires no grad. kv only: q needs none, so
    # q @ k^T keeps no k (for q's gradient) and RoPE no cos and sin for q: 32 * 2 heads * (16 + 8) * 4
    # = 6144 and 2 * 16 * 8 * 4 = 1024 B less than with both.
    "TP2, MLA (q_lora), LoRA on linear_kv_down_proj": dict(
        world=2, layout=dict(tp=2), model=dict(MLA, q_lora_rank=24), m=2, lora=(("linear_kv_down_proj",), 4)),
    # q only: k and v need none (no q kept, no cos and sin for k), nor the kv latent and its norm.
    "TP2 + SP, MLA (q_lora, latent norms), LoRA on linear_q_down_proj + linear_proj": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True), m=2,
        lora=(("linear_q_down_proj", "linear_proj"), 4)),
    # One branch adapted under selective core_attn: its CheckpointFunction saves its inputs q, k and v
    # whether they require grad or not, so layer 0 keeps the q or k [T, heads, qk + rope] that an
    # unrecomputed q @ k^T would not (q branch only, TP1: q, 32 * 4 heads * (16 + 8) * 4 = 12288 B;
    # kv branch only, TP2: k, 32 * 2 heads * 24 * 4 = 6144 B), and re-runs the core attention (its peak).
    "TP1 x DP2, MLA (q_lora, latent norms), selective core_attn, LoRA on linear_q_down_proj + linear_fc1": dict(
        world=2, layout=dict(tp=1), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, **CORE_ATTN), m=2,
        lora=(("linear_q_down_proj", "linear_fc1"), 4), live=True),
    "TP2 + SP, MLA (q_lora), selective core_attn, LoRA on linear_kv_up_proj": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, **CORE_ATTN), m=2,
        lora=(("linear_kv_up_proj",), 4), live=True),
    "TP2, MLA (direct q), LoRA on linear_q_proj + linear_fc1": dict(
        world=2, layout=dict(tp=2), model=dict(MLA, q_lora_rank=None), m=2, lora=(("linear_q_proj", "linear_fc1"), 4)),
    # An MTP layer's MLA projections are adapted as a main layer's.
    "TP2 + SP, MLA (q_lora, latent norms) + 1 MTP layer, LoRA on the four MLA projections + linear_proj": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, mtp_num_layers=1),
        m=2, lora=(FOUR + ("linear_proj",), 4)),
    # Full recompute (Bridge makes the decoder's input require grad): every layer as a later one; the
    # adapters' forward collectives run again in each re-run layer (the MTP layer's too).
    "TP2, MLA (q_lora) + 1 MTP layer, full recompute (uniform 1), LoRA on the up projections": dict(
        world=2, layout=dict(tp=2), model=dict(MLA, q_lora_rank=24, mtp_num_layers=1, recompute_granularity="full",
                                               recompute_method="uniform", recompute_num_layers=1),
        m=2, lora=(UP, 4)),
    "TP1 x DP2, MLA (q_lora, latent norms), LoRA on the four MLA projections": dict(
        world=2, layout=dict(tp=1), model=dict(MLA, q_lora_rank=24, qk_layernorm=True), m=2, lora=(FOUR, 4)),
    # Selective mla_up_proj on a frozen base (live-storage meter): layer 0's checkpoint inputs
    # require no grad (it never re-runs); layer 1's checkpoint keeps its latent inputs.
    "TP2, MLA (q_lora, latent norms), selective mla_up_proj, LoRA on linear_proj, linear_fc1, linear_fc2": dict(
        world=2, layout=dict(tp=2), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, **UP_PROJ), m=2,
        lora=(DENSE, 4), live=True),
    # Under SP layer 1's checkpoint keeps the latent norms' [T/TP] outputs and k_pos_emb, a view of
    # the all-gathered kv_down output [T, kv_lora + rope] = 32 * 40 * 4 = 5120 B; only layer 1 re-runs
    # its up projections' all-gathers: 2 * 32 * (24 + 32) * 4 = 14336 B per step.
    "TP2 + SP, MLA (q_lora, latent norms), selective mla_up_proj, LoRA on linear_proj, linear_fc1, linear_fc2": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, **UP_PROJ), m=2,
        lora=(DENSE, 4), live=True),
    # With adapters on MLA's projections: the up projections' adapters run inside the checkpoint (kept
    # nothing in forward; re-saved, with their gathered latents, when it re-runs: the peak in backward),
    # and re-run their forward collectives; layer 0 re-runs (its down projections' adapters start the
    # gradient there).
    "TP2 + SP, MLA (q_lora, latent norms), selective mla_up_proj, LoRA on the four MLA projections + linear_proj": dict(
        world=2, layout=dict(tp=2, sp=True), model=dict(MLA, q_lora_rank=24, qk_layernorm=True, **UP_PROJ), m=2,
        lora=(FOUR + ("linear_proj",), 4), live=True),
}


@pytest.fixture(scope="module")
def measured():
    return measure(RUNS)


@pytest.mark.dist
@pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)
@pytest.mark.parametrize("name", list(RUNS))
def test_lora_on_mla_against_megatron_core(measured, name):
    check_parameters(measured[name], *setup(name, RUNS))
    check_states_and_communication(measured[name], *setup(name, RUNS))
    check_activations(measured[name], *setup(name, RUNS))


def _spec(**fields):
    model = dict(MLA, q_lora_rank=24, **fields, vocab_size=96)
    return ModelSpec.from_mapping(model), RecomputeSpec.from_mapping(model)


@pytest.mark.parametrize("targets, fields, reason", [
    # One branch adapted, under selective mla_up_proj: megatron-core fails (test_frozen_recompute_fails_in_megatron_core).
    (("linear_kv_down_proj",), UP_PROJ, "0.19.0's CheckpointWithoutOutput fail in backward"),
    (UP + ("linear_proj",), UP_PROJ, "adapters on MLA's up projections (['linear_kv_up_proj', 'linear_q_up_proj']) "
                                     "and none on a down projection"),
    (DENSE, dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
     "megatron-core 0.16.1's and 0.19.0's CheckpointWithoutOutput fail"),
])
def test_what_is_not_modelled_says_why(targets, fields, reason):
    spec, recompute = _spec(**fields)
    options = DecoderOptions(transformer_impl="local")
    got = check_activations_supported(spec, options, Parallelism(tp=2), recompute,
                                      PeftSpec(frozen=True, lora_rank=4, lora_targets=targets))
    assert got is not None and reason in got


def test_transformer_engine_down_projections_under_sequence_parallelism_are_refused():
    # (Without sequence parallelism: a formula, tests/test_memory_lora_mla_te.py.)
    spec, _ = _spec()
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=FOUR)
    par = Parallelism(tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="Megatron-Bridge .*duplicated TELinear"):
        check_supported(spec, par, peft, DecoderOptions(transformer_impl="transformer_engine"))
    check_supported(spec, par, peft, DecoderOptions(transformer_impl="local"))


# Selective layernorm recompute of a frozen base (one adapter, on linear_proj): the first layer's
# norm input requires no grad, so CheckpointWithoutOutput saves no input and its re-run in backward
# calls the norm with none. Selective mla_up_proj recompute of a frozen MLA base adapted on one latent
# branch (here linear_q_down_proj): in the first layer k and v require no grad, and the checkpoint's
# backward hands every output (q, k, v) to torch.autograd.backward, which raises. Run on megatron-core's
# local spec, CPU, one process, in the test environment (0.16.1) and in Megatron-LM 0.19.0's venv: both
# fail alike, so the memory report says so (a layout the framework cannot train).
_FROZEN_RECOMPUTE_STEP = """
import sys
sys.path.insert(0, "tests")
import mcore_cpu, mcore_dist, mcore_memory
mcore_cpu.init_single_process()
model = mcore_cpu.build_gpt(dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72,
                                 hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity="selective",
                                 **{fields}), vocab_size=96, max_seq_len=16)
for p in model.parameters():
    p.requires_grad_(False)
for prefix, parent in list(model.named_modules()):
    for name, child in list(parent.named_children()):
        if name == "{target}":
            setattr(parent, name, mcore_memory.LoRALinear(child, mcore_memory._StandInAdapter(child, 4)))
try:
    mcore_dist.run_schedule([model], num_microbatches=1, micro_batch_size=2, seq_length=16, vocab_size=96,
                            count_flops=False)
    print("RESULT ok")
except (TypeError, RuntimeError) as exc:
    print("RESULT", type(exc).__name__, exc)
"""
_FAILS = {
    "layernorm": (dict(recompute_modules=["layernorm"]), "linear_proj",
                  "RESULT TypeError LayerNorm.forward() missing 1 required positional argument: 'input'"),
    "mla_up_proj, one branch": (
        dict({k: v for k, v in MLA.items() if k not in BASE}, q_lora_rank=24, recompute_modules=["mla_up_proj"]),
        "linear_q_down_proj",
        "RESULT RuntimeError element 1 of tensors does not require grad and does not have a grad_fn"),
}


@pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)
@pytest.mark.parametrize("release", ["megatron-lm-0.16.1", "megatron-lm-0.19.0"])
@pytest.mark.parametrize("case", list(_FAILS))
def test_frozen_recompute_fails_in_megatron_core(release, case):
    import subprocess
    import sys
    from pathlib import Path

    from frameworks import envs

    python: str | Path = sys.executable
    if release != "megatron-lm-0.16.1":
        try:
            python = envs.ensure(release)
        except envs.Unavailable as exc:
            pytest.skip(str(exc))
    fields, target, expected = _FAILS[case]
    step = _FROZEN_RECOMPUTE_STEP.format(fields=repr(fields), target=target)
    done = subprocess.run([str(python), "-c", step], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
    assert expected in done.stdout, \
        done.stdout[-2000:] + done.stderr[-2000:]
