"""Memory and communication per GPU of one real training step, measured on megatron-core in 4
gloo processes and compared with :mod:`megatron_flops.memory` to the byte.

Every layout below runs one step inside one process group: megatron-core's schedule (1F1B,
interleaved 1F1B, or no pipelining) over its ``DistributedDataParallel`` (+ distributed
optimizer) and ``get_megatron_optimizer``'s optimizer step. Measured per rank (tests/mcore_memory):
weights (distinct parameter storages), gradient buffers, optimizer state (main copies and the
torch optimizer's state tensors), the payload of every collective (a ``TorchDispatchMode`` over
the c10d ops), the bytes each forward saves for backward and the time-resolved peak of saved
storages (``saved_tensors_hooks``).
"""

from __future__ import annotations

import dataclasses

import pytest

import mcore_cpu
import mcore_dist
from megatron_flops.memory.activations import chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.flops.pipeline_split import PipelineSplit
from megatron_flops.memory.pipeline_split import uneven_stages
from megatron_flops.memory.report import rank_memory
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.model.spec import ModelSpec

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

WORLD = 4
VOCAB = 96
SEQ = 16
MBS = 2
# Widths that are not multiples of 64 exercise the distributed optimizer's alignment padding.
BASE = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72,
            hidden_dropout=0.0, attention_dropout=0.0)

MOE_AG = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=56, moe_layer_freq=[0, 1],
              moe_token_dispatcher_type="allgather")

# name -> layout (tp, pp, vpp, ep), model, training, build options
RUNS = {
    "DP4, distributed optimizer, bf16, biases, learned positions, 3 buckets, Adam": dict(
        layout=dict(), model=dict(BASE, add_bias_linear=True), m=2,
        build=dict(distributed_optimizer=True, position_embedding_type="learned_absolute", bucket_size=6000)),
    "DP2 x TP2, DDP, bf16, GQA, fused SwiGLU, RoPE, full recompute (block 1)": dict(
        layout=dict(tp=2), model=dict(BASE, num_query_groups=2, gated_linear_unit=True, bias_activation_fusion=True,
                                      recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        m=2, build=dict(params_dtype="fp32")),
    "DP2 x PP2 (1F1B), distributed optimizer, bf16, tied embeddings, M=3": dict(
        layout=dict(pp=2), model=dict(BASE), m=3, build=dict(distributed_optimizer=True)),
    "DP2 x PP2 x VPP2 (interleaved), distributed optimizer, fp32, selective core_attn, M=4": dict(
        layout=dict(pp=2, vpp=2), model=dict(BASE, num_layers=4, recompute_granularity="selective"), m=4,
        build=dict(distributed_optimizer=True, params_dtype="fp32")),
    "DP2 x PP2 (1F1B), DDP, fp32, full recompute (uniform 2), M=3": dict(
        layout=dict(pp=2), model=dict(BASE, num_layers=4, recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=2), m=3, build=dict(params_dtype="fp32")),
    "DP4 x EP2, MoE (alltoall), distributed optimizer, bf16": dict(
        layout=dict(ep=2), model=dict(BASE, num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                                      moe_layer_freq=[0, 1]), m=2, build=dict(distributed_optimizer=True)),
    # Sequence parallelism: megatron-core's local layers with the torch norm marked as TE marks
    # it (mcore_memory.patch_sequence_parallel_norm).
    "DP2 x TP2 + SP, DDP, fp32, RoPE": dict(
        layout=dict(tp=2, sp=True), model=dict(BASE), m=2, build=dict(params_dtype="fp32")),
    "DP2 x TP2 + SP, distributed optimizer, bf16, biases, learned positions": dict(
        layout=dict(tp=2, sp=True), model=dict(BASE, add_bias_linear=True), m=2,
        build=dict(distributed_optimizer=True, position_embedding_type="learned_absolute")),
    "TP2 x PP2 + SP, DDP, fp32, full recompute (uniform 1), M=3": dict(
        layout=dict(tp=2, pp=2, sp=True), model=dict(BASE, num_layers=4, recompute_granularity="full",
                                                     recompute_method="uniform", recompute_num_layers=1),
        m=3, build=dict(params_dtype="fp32")),
    # Issue 19's report: 3 layers, LayerNorm + biases, tied embeddings, learned positions, fp32,
    # seq 24 (exact here; PP3 of the same model was exact too, measured once in 3 processes).
    "DP4, 3 layers, LayerNorm + biases, tied, learned positions, fp32, seq 24": dict(
        layout=dict(), seq=24, model=dict(BASE, num_layers=3, add_bias_linear=True), m=2,
        build=dict(params_dtype="fp32", position_embedding_type="learned_absolute")),
    "DP4 x EP4, MoE top-2 of 8 (alltoall), fused SwiGLU experts, shared experts, DDP, fp32": dict(
        layout=dict(ep=4), model=dict(BASE, num_moe_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                                      moe_ffn_hidden_size=56, moe_shared_expert_intermediate_size=40,
                                      gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True),
        m=2, build=dict(params_dtype="fp32")),
    # The alltoall dispatcher under TP all-gathers uneven per-rank token counts over expert TP
    # (= TP 2), which gloo cannot: mcore_memory.patch_uneven_collectives runs it as gloo's uneven
    # all-to-all and counts the payload NCCL's all-gather / reduce-scatter would be handed.
    # (Full recompute, block 2: the peak holds both layers re-run, the MoE layer's TP traffic runs
    # forward twice.)
    "DP2 x TP2 + SP, MoE every other layer (alltoall), full recompute (block 2), DDP, fp32": dict(
        layout=dict(tp=2, sp=True), model=dict(BASE, **dict(MOE_AG, moe_token_dispatcher_type="alltoall"),
                                               recompute_granularity="full", recompute_method="block",
                                               recompute_num_layers=2), m=2, build=dict(params_dtype="fp32")),
    "TP2 x EP2 + SP, MoE top-2 of 4 (alltoall), shared experts, distributed optimizer, bf16": dict(
        layout=dict(tp=2, sp=True, ep=2), model=dict(BASE, num_moe_experts=4, moe_router_topk=2,
                                                     moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=48,
                                                     moe_shared_expert_intermediate_size=40),
        m=2, build=dict(distributed_optimizer=True)),
    # MoE under TP + SP (megatron-core requires SP for MoE with TP): the allgather dispatcher
    # gathers over the expert TP x EP group (even all-gathers: gloo runs them), experts split
    # over TP; EP1 is exact per rank, EP2 in total (routing).
    "DP2 x TP2 + SP, MoE top-2 of 4 every other layer (allgather), DDP, fp32": dict(
        layout=dict(tp=2, sp=True), model=dict(BASE, **MOE_AG), m=2, build=dict(params_dtype="fp32")),
    "TP2 x EP2 + SP, MoE (allgather), gated shared experts, distributed optimizer, bf16": dict(
        layout=dict(tp=2, sp=True, ep=2), model=dict(BASE, **MOE_AG, moe_shared_expert_intermediate_size=40,
                                                     moe_shared_expert_gate=True),
        m=2, build=dict(distributed_optimizer=True)),
    # Full recompute runs each MoE layer's forward again: the all-to-all and token counts too.
    "DP4 x EP2, MoE (alltoall), full recompute (uniform 1), DDP, fp32": dict(
        layout=dict(ep=2), model=dict(BASE, **dict(MOE_AG, moe_token_dispatcher_type="alltoall"),
                                      recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1), m=2, build=dict(params_dtype="fp32")),
    # A MoE multi-token-prediction layer (the last layer's kind) under TP + SP, checkpointed by
    # full recompute (uniform 1): its dispatcher's TP traffic runs forward twice, as the main
    # MoE layer's does.
    "DP2 x TP2 + SP, MoE every other layer (alltoall) + 1 MoE MTP layer, full recompute (uniform 1), DDP, fp32":
        dict(layout=dict(tp=2, sp=True), model=dict(BASE, **dict(MOE_AG, moe_token_dispatcher_type="alltoall"),
                                                    mtp_num_layers=1, recompute_granularity="full",
                                                    recompute_method="uniform", recompute_num_layers=1),
             m=2, build=dict(params_dtype="fp32")),
    # Selective recompute of layernorm (CheckpointWithoutOutput: measured with the live-storage meter),
    # moe (the whole layer: the dispatcher's traffic and the shared experts' all-gather and
    # reduce-scatter run forward again) and shared_experts (inside a re-run moe checkpoint, twice), the
    # MoE MTP layer's too.
    "DP2 x TP2 + SP, MoE every other layer (alltoall) + 1 MoE MTP layer, shared experts, selective layernorm + "
    "moe + shared_experts, DDP, fp32": dict(
        layout=dict(tp=2, sp=True), model=dict(BASE, **dict(MOE_AG, moe_token_dispatcher_type="alltoall"),
                                               moe_shared_expert_intermediate_size=40, mtp_num_layers=1,
                                               recompute_granularity="selective",
                                               recompute_modules=["layernorm", "moe", "shared_experts"]),
        m=2, build=dict(params_dtype="fp32"), live=True),
    "TP2 x EP2 + SP, MoE top-2 of 4 (alltoall), shared experts, selective moe, DDP, fp32": dict(
        layout=dict(tp=2, sp=True, ep=2), model=dict(BASE, num_moe_experts=4, moe_router_topk=2,
                                                     moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=48,
                                                     moe_shared_expert_intermediate_size=40,
                                                     recompute_granularity="selective", recompute_modules=["moe"]),
        m=2, build=dict(params_dtype="fp32")),
    # Activations: stage 0 saves nothing before layer 0's linear_qkv adapter; stage 1's received
    # hidden states require grad, so it saves as in full training but the frozen linears' inputs.
    "DP2 x PP2, LoRA rank 4 on linear_qkv/linear_fc2, frozen base, DDP, bf16, SGD, M=3": dict(
        layout=dict(pp=2), model=dict(BASE, num_layers=4), m=3,
        build=dict(optimizer="sgd", lora=(("linear_qkv", "linear_fc2"), 4))),
    # LoRA under TP (Megatron-Bridge's ParallelLinearAdapter: column-parallel targets split
    # linear_in's rows and all-gather its output, row-parallel ones split linear_out's rows).
    # Selective mlp recompute re-runs each MLP's forward (fc2's all-reduce) in backward.
    "DP2 x TP2, LoRA rank 4 on all four targets, frozen base, selective core_attn + mlp, DDP, bf16, Adam": dict(
        layout=dict(tp=2), model=dict(BASE, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
        m=2, build=dict(lora=(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), 4))),
    # Under sequence parallelism a column-parallel target's adapter all-gathers its input itself;
    # layer 0's linear_qkv and linear_proj run before the first adapter (no backward collectives).
    "DP2 x TP2 + SP, LoRA rank 4 on linear_proj + linear_fc1, frozen base, DDP, bf16": dict(
        layout=dict(tp=2, sp=True), model=dict(BASE), m=2, build=dict(lora=(("linear_proj", "linear_fc1"), 4))),
    # Full recompute: Bridge makes the decoder's input require grad (no collective skipped in layer
    # 0), and the re-run layer runs its adapters' forward collectives again.
    "DP2 x TP2, LoRA rank 4 on linear_qkv + linear_fc2, frozen base, full recompute (block 1), DDP, fp32": dict(
        layout=dict(tp=2), model=dict(BASE, recompute_granularity="full", recompute_method="block",
                                      recompute_num_layers=1),
        m=2, build=dict(params_dtype="fp32", lora=(("linear_qkv", "linear_fc2"), 4))),
}

# Measured by tests/test_memory_etp_dist.py in a process group of its own (this module's one
# group runs every RUNS entry within one timeout).
ETP_RUNS = {
    # An expert TP other than TP (megatron-core's expert_tensor_parallel_size): the experts' own
    # grid ETP x EP x expert DP over the TP x DP ranks. TP2 + SP with ETP1: each TP rank routes its
    # sequence slice over EP, the experts whole (biases: megatron-core allows them with ETP 1
    # only); TP1 with ETP2: the experts split over two DP ranks, which gather each other's tokens.
    "TP2 x EP2 + SP, expert TP 1, MoE top-2 of 4 (alltoall), biases, distributed optimizer, bf16": dict(
        layout=dict(tp=2, sp=True, ep=2, etp=1), model=dict(BASE, num_moe_experts=4, moe_router_topk=2,
                                                             moe_token_dispatcher_type="alltoall",
                                                             moe_ffn_hidden_size=48, add_bias_linear=True),
        m=2, build=dict(distributed_optimizer=True)),
    "DP4 x expert TP2 x EP2, MoE every other layer (alltoall), shared experts, DDP, fp32": dict(
        layout=dict(ep=2, etp=2), model=dict(BASE, **dict(MOE_AG, moe_token_dispatcher_type="alltoall"),
                                             moe_shared_expert_intermediate_size=40),
        m=2, build=dict(params_dtype="fp32")),
    "DP4 x expert TP2 x EP2, MoE every other layer (allgather), distributed optimizer, bf16": dict(
        layout=dict(ep=2, etp=2), model=dict(BASE, **MOE_AG), m=2, build=dict(distributed_optimizer=True)),
}


def _inner(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def memory_worker(rank: int, world_size: int, runs: dict) -> dict:
    import torch

    import mcore_memory

    mcore_dist.init_worker()
    mcore_memory.patch_alltoall_dispatcher()
    mcore_memory.patch_sequence_parallel_norm()
    mcore_memory.patch_uneven_collectives()
    out = {}
    for name, run in runs.items():
        layout = run["layout"]
        ep, etp = layout.get("ep", 1), layout.get("etp")
        mcore_memory.reinit_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), vpp=layout.get("vpp"), ep=ep,
                                     etp=etp, embedding_ranks=layout.get("embedding_ranks", ()))
        model = dict(run["model"])
        if ep > 1:
            model["expert_model_parallel_size"] = ep
        if etp is not None:
            model["expert_tensor_parallel_size"] = etp
        if layout.get("sp"):
            model["sequence_parallel"] = True
        if model.get("activation_func") == "silu":
            model["activation_func"] = torch.nn.functional.silu
        seq = run.get("seq", SEQ)
        chunks, optimizer, config = mcore_memory.build_training(model, vocab_size=VOCAB, seq_length=seq, **run["build"])
        groups = mcore_memory.megatron_groups()
        comm = mcore_memory.CommMeter(groups)
        meter = mcore_memory.LiveStorageMeter if run.get("live") else mcore_memory.SavedTensorMeter
        saved = meter([p for c in chunks for p in c.parameters()])
        m = run["m"]
        with comm, saved.tracking():
            mcore_dist.run_schedule(
                chunks, num_microbatches=m, micro_batch_size=MBS, seq_length=seq, vocab_size=VOCAB,
                forward_step_func=mcore_memory.metered_forward_step(saved, chunks),
                data_iterators=[mcore_memory.batches(m, MBS, seq, VOCAB, seed=rank) for _ in chunks],
                count_flops=False)
            with mcore_memory.on_cpu():
                optimizer.step()

        from megatron.core import parallel_state as ps

        out[name] = dict(
            sizes=mcore_dist.parallel_sizes(),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            names=[[(n, p.numel()) for n, p in _inner(c).named_parameters()] for c in chunks],
            states=mcore_memory.state_bytes(chunks, optimizer),
            comm=dict(comm.bytes),
            forward=list(zip(saved.forward_chunks, saved.forward)),
            peak=saved.peak,
        )
        del chunks, optimizer
        torch.manual_seed(0)
    return out


@pytest.fixture(scope="module")
def measured():
    return mcore_dist.run_by_name(memory_worker, WORLD, RUNS, timeout=600)


# The checks of one run (a RUNS entry: layout, model, m, build; tests/test_memory_mla_mtp_dist.py's
# runs too) against what memory_worker measured on every rank.


def setup(run: dict):
    """The pure description of one run: spec, options, layout, training, PEFT, recompute."""
    model, build, layout = run["model"], run["build"], run["layout"]
    fields = {k: v for k, v in model.items() if k != "moe_token_dispatcher_type"}
    spec = ModelSpec.from_mapping(dict(fields, vocab_size=VOCAB,
                                       share_embeddings_and_output_weights=build.get("share_embeddings", True)))
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               transformer_impl="local",  # (the spec memory_worker builds)
                                               position_embedding_type=build.get("position_embedding_type", "rope"),
                                               add_bias_linear=model.get("add_bias_linear", False)))
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    par = Parallelism(tp=tp, pp=pp, vpp=layout.get("vpp"), ep=layout.get("ep", 1),
                      dp=layout.get("world", WORLD) // (tp * pp),
                      etp=layout.get("etp"),
                      sequence_parallel=layout.get("sp", False),
                      distributed_optimizer=build.get("distributed_optimizer", False))
    par = uneven_stages(PipelineSplit.from_mapping(model), par, spec=spec)  # (an uneven split's stages)
    training = Training(seq_length=run.get("seq", SEQ), micro_batch_size=MBS, num_microbatches=run["m"],
                        params_dtype=build.get("params_dtype", "bf16"), optimizer=build.get("optimizer", "adam"),
                        bucket_size=build.get("bucket_size"))
    lora = build.get("lora")
    peft = PeftSpec(frozen=True, lora_rank=lora[1], lora_targets=lora[0]) if lora else None
    recompute = RecomputeSpec.from_mapping(dict(model, pipeline_model_parallel_size=pp,
                                                virtual_pipeline_model_parallel_size=layout.get("vpp")))
    return spec, options, par, training, peft, recompute


def expected(run: dict, result: dict):
    spec, options, par, training, peft, recompute = setup(run)
    sizes = result["sizes"]
    return rank_memory(spec, options, par, training, pp_rank=sizes["pp_rank"], dp_rank=sizes["dp_rank"],
                       peft=peft, recompute=recompute)


def check_parameters(run: dict, results: list) -> None:
    """Every rank's parameters of every chunk, names and sizes in megatron-core's order."""
    spec, options, par, training, peft, _ = setup(run)
    for result in results:
        for chunk, names in enumerate(result["names"]):
            params = chunk_parameters(spec, options, par, pp_rank=result["sizes"]["pp_rank"], chunk=chunk,
                                      seq_length=training.seq_length, peft=peft)
            assert [(p.name, p.numel) for p in params] == [tuple(n) for n in names]


def check_states(run: dict, results: list) -> None:
    """Weights, gradient buffers and optimizer state on every rank."""
    for result in results:
        # (a rank without trainable parameters has a stub optimizer: no state keys at all, the report's are 0)
        want = expected(run, result).states
        assert want == {**dict.fromkeys(want, 0), **result["states"]}, result["sizes"]


def check_communication(run: dict, results: list) -> None:
    """Every key equal per rank, but those whose per-rank bytes follow the routing (the expert
    all-to-all; under TP x EP the TP all-gather and reduce-scatter of the routed tokens): their
    total over each expert group equals the balanced figure's, and each rank lies within the
    bounds over every routing."""
    per_group: dict = {}
    for result in results:
        report = expected(run, result)
        want, got = dict(report.communication), dict(result["comm"])
        for key, (lo, hi) in report.communication_ranges.items():
            assert lo <= got[key] <= hi, (key, result["sizes"])
            group = (result["sizes"]["pp_rank"], result["expert_dp_rank"], key)
            per_group.setdefault(group, []).append((got.pop(key), want.pop(key)))
        assert want == got, result["sizes"]
    for pairs in per_group.values():
        assert sum(a for a, _ in pairs) == sum(w for _, w in pairs)


def cpu_delta(par: Parallelism, training: Training, num_norms: int) -> int:
    """Bytes torch's CPU kernels save beyond the CUDA convention: LayerNorm statistics in the
    input dtype (CUDA: fp32), per norm and token (of this rank's slice under sequence parallelism)."""
    tokens = training.seq_length * MBS // (par.tp if par.sequence_parallel else 1)
    return num_norms * tokens * 2 * (training.param_bytes - 4)


def check_activations(run: dict, results: list) -> None:
    """The bytes each forward of each chunk saves, and the schedule's peak, on every rank."""
    spec, options, par, training, peft, recompute = setup(run)
    for result in results:
        pp_rank = result["sizes"]["pp_rank"]
        chunks = []
        for c in range(par.num_chunks):
            act = chunk_activations(spec, options, par, training, pp_rank=pp_rank, chunk=c, recompute=recompute,
                                    peft=peft)
            layers = len(par.chunk_layers(spec.num_layers, pp_rank, c))
            # LayerNorms per forward: 2 per layer; on the last stage the final norm and 5 per MTP
            # layer (the latent norms of MLA run in fp32 runs only: no delta). (A frozen first stage:
            # layer 0's input norm runs before the first adapter.)
            last = par.is_last_stage(pp_rank, c)
            first_frozen = peft is not None and par.is_first_stage(pp_rank, c) and layers > 0
            # (a standalone MTP stage: its 5 norms per MTP layer there; the final norm with the last decoder layer)
            final = par.holds_final_norm(spec.num_layers, pp_rank, c, mtp=bool(spec.mtp_num_layers)) \
                if par.mtp_stage is not None else last
            norms = 2 * layers + final + 5 * spec.mtp_num_layers * par.holds_mtp(pp_rank, c) - first_frozen
            act = dataclasses.replace(act, components={**act.components, "cpu": cpu_delta(par, training, norms)})
            chunks.append(act)
            measured_forwards = {b for chunk, b in result["forward"] if chunk == c}
            assert measured_forwards == {act.forward + act.shared}, (result["sizes"], c)
        peak, _ = schedule_peak(chunks, in_flight(par, training.num_microbatches, pp_rank))
        assert peak == result["peak"], result["sizes"]


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_in_megatron_order(measured, name):
    check_parameters(RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(RUNS))
def test_weights_gradients_optimizer_state(measured, name):
    check_states(RUNS[name], measured[name])


@pytest.mark.parametrize("name", list(RUNS))
def test_communication_per_step(measured, name):
    check_communication(RUNS[name], measured[name])


def _routed(name: str) -> bool:
    """MoE under EP > 1: what one rank's experts save follows the routing."""
    return "MoE" in name and RUNS[name]["layout"].get("ep", 1) > 1


@pytest.mark.parametrize("name", [n for n in RUNS if not _routed(n)])
def test_activations_per_forward_and_schedule_peak(measured, name):
    check_activations(RUNS[name], measured[name])


@pytest.mark.parametrize("name", [n for n in RUNS if _routed(n)])
def test_moe_activations_balanced_in_total_bounded_per_rank(measured, name):
    check_moe_activations_balanced(RUNS[name], measured[name])


def check_moe_activations_balanced(run: dict, results: list) -> None:
    """What one rank's experts save follows the routing; over all ranks every routed token is
    saved once, so the measured sum equals the balanced figure times the ranks, and each rank
    (each forward, and the peak: with full recompute, the re-run MoE layer's) lies within the
    bounds over every routing."""
    spec, options, par, training, peft, recompute = setup(run)
    total_measured = total_formula = 0
    for result in results:
        act = chunk_activations(spec, options, par, training, pp_rank=0, chunk=0, recompute=recompute)
        delta = cpu_delta(par, training, 2 * spec.num_layers + 1)
        forwards = [b for _, b in result["forward"]]
        total_measured += sum(forwards)
        total_formula += (act.forward + act.shared + delta) * len(forwards)
        lo, hi = expected(run, result).activations_range
        held = [result["peak"]] + (forwards if recompute is None else [])  # (recompute: forwards keep inputs only)
        assert all(lo + delta <= b <= hi + delta for b in held), result["sizes"]
    assert total_measured == total_formula
