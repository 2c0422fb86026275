"""The most loaded data-parallel rank, found from shard step functions (memory/dp_ranks.py), against
the walk over every rank it replaced: the same rank and the same report on a grid of small layouts
(dense, tied, MoE with EP and expert DP, MLA with MTP, a frozen base with LoRA, PP x VPP, odd bucket
sizes; the distributed optimizer and Megatron-FSDP's strategies; DP 2 to 7), and a large data-parallel
group reported quickly. Stdlib and the CLI only: seconds."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from megatron_flops.cli import build_parser
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec
from megatron_flops.memory import megatron_fsdp, report
from megatron_flops.memory.decoder import DecoderOptions, Param, chunk_parameters
from megatron_flops.memory.dit_layouts import dit_layout_report, dit_rank_states
from megatron_flops.memory.dp_ranks import bucket_steps, most_loaded_rank, span_steps
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.states import buffer_buckets, shard_numel
from megatron_flops.memory.vision import VisionMemory
from megatron_flops.model.spec import ModelSpec, model_from_mapping

REPO = Path(__file__).resolve().parents[1]


# ---- the step functions against the per-rank sums ---------------------------------------------


def test_span_steps_by_hand():
    # Slices of 10 from 100: [103, 127) gives rank 0 seven elements, rank 1 ten, rank 2 seven.
    assert sorted(span_steps([(103, 127)], origin=100, part=10)) == [(0, 7), (1, 3), (2, -3), (3, -7)]
    # Inside one slice: one step up and one down.
    assert sorted(span_steps([(12, 15)], origin=0, part=10)) == [(1, 3), (2, -3)]


def test_most_loaded_rank_against_every_rank():
    # Random spans in random buckets: the step functions' choice is the per-rank sums' (lowest on a tie),
    # with an expert group whose rank is d x TP // (ETP x EP).
    rng = random.Random(19)
    for _ in range(300):
        ranks, tp, etp, ep = rng.randint(1, 9), rng.choice((1, 2)), 1, rng.choice((1, 2))
        expert_ranks = -(-ranks * tp // (etp * ep))
        dense, expert = _random_buckets(rng, ranks), _random_buckets(rng, expert_ranks)

        def real(buckets: list[tuple[int, int, list[tuple[int, int]]]], n: int, rank: int) -> int:
            total = 0
            for start, end, spans in buckets:
                part = (end - start) // n
                lo, hi = start + rank * part, start + (rank + 1) * part
                total += sum(max(0, min(hi, e) - max(lo, s)) for s, e in spans)
            return total

        def steps(buckets: list[tuple[int, int, list[tuple[int, int]]]], n: int) -> list[tuple[int, int]]:
            return [s for start, end, spans in buckets for s in span_steps(spans, origin=start, part=(end - start) // n)]

        def expert_rank(d: int) -> int:
            return d * tp // (etp * ep)

        want = max(range(ranks), key=lambda d: (real(dense, ranks, d) + real(expert, expert_ranks, expert_rank(d)), -d))
        assert most_loaded_rank(steps(dense, ranks), ranks=ranks, expert=steps(expert, expert_ranks),
                                expert_rank=expert_rank) == want


def _random_buckets(rng: random.Random, n: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """A few buckets back to back, each ``n x part`` long, with gapped spans inside."""
    out, start = [], rng.randint(0, 50)
    for _ in range(rng.randint(0, 3)):
        part = rng.randint(1, 40)
        end, spans, at = start + n * part, [], start
        while at < end:
            at += rng.choice((0, 0, rng.randint(1, 30)))  # (gaps: alignment and padding)
            hi = min(end, at + rng.randint(1, 3 * part))
            if at < hi:
                spans.append((at, hi))
            at = hi
        out.append((start, end, spans))
        start = end
    return out


def test_bucket_steps_match_shard_numel():
    rng = random.Random(7)
    for _ in range(100):
        dp = rng.randint(1, 7)
        params = [Param(f"p{i}", rng.randint(1, 700), shared_embedding=rng.random() < 0.1) for i in range(8)]
        buckets = buffer_buckets(params, dp=dp, distributed_optimizer=True, bucket_size=rng.choice((None, 100, 777)))
        want = max(range(dp), key=lambda d: (sum(shard_numel(b, dp, d) for b in buckets), -d))
        assert most_loaded_rank(bucket_steps(buckets, dp), ranks=dp) == want


# ---- the reports against the walk over every rank ----------------------------------------------


def _every_rank(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *, pp_rank: int,
                peft: Any = None, vision: VisionMemory | None = None) -> int:
    """The walk the step functions replace: every data-parallel rank's state bytes (the only figures
    that depend on it: test_other_figures_do_not_depend_on_the_rank), the largest, lowest on a tie;
    with context parallelism every one of the DP x CP ranks the buffers are sharded over."""
    if not par.distributed_optimizer:
        return 0
    vision = vision or VisionMemory(params=(), activations=None)
    totals = [sum(report._rank_states(spec, options, par, training, pp_rank=pp_rank, dp_rank=d, peft=peft,
                                      vision=vision)[0].values()) for d in range(par.dp * par.cp)]
    return max(range(par.dp * par.cp), key=lambda d: (totals[d], -d))


def _every_fsdp_rank(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *, pp_rank: int,
                     peft: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Megatron-FSDP's walk the step functions replace: every data-parallel rank's states and
    payloads, the rank with the largest states (the first of equals)."""
    assert par.megatron_fsdp is not None
    best: tuple[dict[str, int], dict[str, int]] | None = None
    for dp_rank in range(par.dp * par.cp):
        states: dict[str, int] = {}
        comm: dict[str, int] = {}
        for chunk in range(par.num_chunks):
            params = chunk_parameters(spec, options, par, pp_rank=pp_rank, chunk=chunk,
                                      seq_length=training.seq_length, peft=peft)
            more = megatron_fsdp.megatron_fsdp_rank(params, training, strategy=par.megatron_fsdp,
                                                    sizes={"dp": par.dp * par.cp, "expt_dp": par.expert_dp},
                                                    ranks={"dp": dp_rank, "expt_dp": par.expert_dp_rank(dp_rank)},
                                                    bucket_size=training.bucket_size if chunk == 0 else None)
            for into, extra in zip((states, comm), more):
                for key, value in extra.items():
                    into[key] = into.get(key, 0) + value
        if best is None or sum(states.values()) > sum(best[0].values()):
            best = (states, comm)
    assert best is not None
    return best


BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32,
           moe_layer_freq=[0, 1, 1, 1], moe_token_dispatcher_type="alltoall", add_bias_linear=False)
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16)
MODELS = {
    "dense": BASE,
    "tied": dict(BASE, share_embeddings_and_output_weights=True),
    "moe": dict(BASE, **MOE),
    "mla moe mtp": dict(BASE, **MLA, **MOE, mtp_num_layers=1, normalization="RMSNorm"),
    # Mostly routed experts of odd sizes (alignment gaps): the expert data-parallel shards decide the rank.
    "experts": dict(BASE, **dict(MOE, num_moe_experts=8, moe_ffn_hidden_size=93, moe_layer_freq=1)),
}
SETUPS = {
    "": [],
    "buckets of 777": ["--overlap-grad-reduce", "--bucket-size", "777"],
    # (targets every model here has: an MLA layer has no linear_qkv, which both commands refuse)
    "frozen LoRA": ["--frozen", "--lora-rank", "4", "--lora-targets", "linear_proj,linear_fc1,linear_fc2"],
}
SHARDING = {
    "distopt": ["--distributed-optimizer"],
    **{f"Megatron-FSDP {s}": ["--megatron-fsdp", s] for s in ("optim", "optim_grads", "optim_grads_params")},
}


def _layouts(model: str, dp: int) -> dict[str, list[str]]:
    tp2 = ["--tp", "2", "--sequence-parallel"]  # (MoE under TP: megatron-core wants sequence parallelism)
    out = {"DP": [], "TP2 SP": tp2, "PP2 VPP2": ["--pp", "2", "--vpp", "2", "--num-microbatches", "4"]}
    if model == "experts":
        del out["TP2 SP"]  # (an FFN of 93 does not split over TP 2; ETP 1 keeps the experts whole)
    if model in ("dense", "moe"):
        out["CP2"] = ["--cp", "2"]  # (the buffers sharded over DP x CP ranks)
    if "moe" in model:
        out.update({f"EP{ep}": ["--ep", str(ep)] for ep in (2, 4) if dp % ep == 0})
        out["TP2 SP ETP1 EP2"] = [*tp2, "--etp", "1", "--ep", "2"]  # (expert DP = TP x DP / 2 = DP)
    return out


CASES = [(model, setup, sharding, dp, layout)
         for model in MODELS for setup in SETUPS for sharding in SHARDING for dp in range(2, 8)
         for layout in _layouts(model, dp)
         if not (setup == "frozen LoRA" and sharding == "Megatron-FSDP optim")]  # (refused: memory/megatron_fsdp.py)
PARSER = build_parser()


def _json(argv: list[str]) -> str:
    out = io.StringIO()
    args = PARSER.parse_args(argv)
    try:
        with contextlib.redirect_stdout(out):
            args.func(args)
    except ValueError as exc:
        return f"refused: {exc}"
    return out.getvalue()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    files = {}
    for name, fields in MODELS.items():
        files[name] = root / f"{name}.json"
        files[name].write_text(json.dumps(fields))
    return files


@pytest.mark.parametrize("model", list(MODELS))
def test_reports_equal_the_walk_over_every_rank(model, model_files, monkeypatch):
    # Every case of this model twice through the CLI's --json: as now, then with the walk over every rank.
    cases = [case for case in CASES if case[0] == model]
    argvs = [["memory", "--model", str(model_files[model]), "--seq-length", "16", "--json", "--dp", str(dp),
              *SETUPS[setup], *SHARDING[sharding], *_layouts(model, dp)[layout]]
             for _, setup, sharding, dp, layout in cases]
    chosen: list[int] = []

    def recording(*args: Any, **kwargs: Any) -> int:
        chosen.append(find(*args, **kwargs))
        return chosen[-1]

    find = report._most_loaded_dp_rank
    monkeypatch.setattr(report, "_most_loaded_dp_rank", recording)
    now = [_json(argv) for argv in argvs]
    assert len(set(chosen)) > 2  # (not only rank 0: the shards differ)
    monkeypatch.setattr(report, "_most_loaded_dp_rank", _every_rank)
    monkeypatch.setattr(megatron_fsdp, "megatron_fsdp_stage", _every_fsdp_rank)
    walked = [_json(argv) for argv in argvs]
    for case, a, b in zip(cases, now, walked):
        assert a == b, case
    assert not [case for case, a in zip(cases, now) if a.startswith("refused")]


def test_other_figures_do_not_depend_on_the_rank():
    # rank_memory takes dp_rank only for the optimizer shards: every other field is the same on each rank
    # (activations, their breakdown, payloads and their ranges), so comparing state bytes chooses the rank.
    spec = model_from_mapping(dict(BASE, **MOE), source="moe")
    assert spec is not None
    options = DecoderOptions(add_bias_linear=False, position_embedding_type="rope", hidden_dropout=0.0,
                             attention_dropout=0.0, attention_backend="unfused", moe_token_dispatcher_type="alltoall")
    training = Training(seq_length=16, micro_batch_size=1, num_microbatches=4)
    for par in (Parallelism(dp=6, ep=2, distributed_optimizer=True),
                Parallelism(tp=2, sequence_parallel=True, etp=1, ep=2, dp=3, pp=2, vpp=2,
                            distributed_optimizer=True)):
        ranks = [report.rank_memory(spec, options, par, training, pp_rank=par.pp - 1, dp_rank=d)
                 for d in range(par.dp)]
        assert len({json.dumps(r.states, sort_keys=True) for r in ranks}) > 1
        assert all(dataclasses.replace(r, dp_rank=0, states={}) == dataclasses.replace(ranks[0], states={})
                   for r in ranks)


def test_large_data_parallel_groups(monkeypatch):
    # Llama 3 8B under the distributed optimizer on 4,096 data-parallel ranks (32 layers x 4,096 ranks, refused
    # while every rank was walked). One bucket (no --overlap-grad-reduce) of 8,030,261,248 parameters, each a
    # multiple of 64 elements (no alignment gap), padded to a multiple of lcm(4,096, 128) = 4,096 (none): every
    # shard holds 8,030,261,248 / 4,096 = 1,960,513 real elements, so rank 0; fp32 main copies and two Adam
    # moments of them: 4 x 1,960,513 = 7,842,052 B each.
    llama = ["memory", "--model", str(REPO / "examples" / "llama3_8b.json"), "--seq-length", "8192", "--json",
             "--distributed-optimizer"]
    top = json.loads(_json([*llama, "--dp", "4096"]))["per_gpu"]["components"]
    assert [top[k] for k in ("optimizer/main_params", "optimizer/exp_avg", "optimizer/exp_avg_sq")] == [7_842_052] * 3
    # Odd buckets (300,000,007 parameters) over DP 96 (padded to multiples of lcm(96, 128) = 384): the walk's report.
    odd = [*llama, "--dp", "96", "--overlap-grad-reduce", "--bucket-size", "300000007"]
    now = _json(odd)
    monkeypatch.setattr(report, "_most_loaded_dp_rank", _every_rank)
    assert _json(odd) == now


def test_dit_distributed_optimizer_reports_the_most_loaded_rank():
    # A DiT under the distributed optimizer: the rank whose shards hold the most (rank 0 before, which the tiny
    # DiT's alignment gaps leave short on most of these layouts), as a walk over the DP x CP ranks finds it.
    raw = json.loads((REPO / "examples" / "wan_tiny_dit.json").read_text())["dit"]
    spec = DiTSpec.from_mapping(raw)
    lora = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("self_attn.q",))
    moved = 0
    for peft, bucket, dp, cp in itertools.product((None, lora), (None, 777), range(2, 8), (1, 2)):
        par, training = Parallelism(dp=dp, cp=cp, distributed_optimizer=True), Training(seq_length=16,
                                                                                        micro_batch_size=1,
                                                                                        bucket_size=bucket)
        every = [dit_rank_states(spec, par, training, pp_rank=0, dp_rank=d, peft=peft)[0].components
                 for d in range(dp * cp)]
        best = max(range(dp * cp), key=lambda d: (sum(every[d].values()), -d))
        got = dit_layout_report(spec, par, training, peft=peft)["per_gpu"]["components"]
        assert {k: v for k, v in got.items() if k != "activations"} == every[best]
        moved += every[best] != every[0]
    assert moved > 10
