"""Properties of the formulas on seeded random data (every family: dense, GQA/SwiGLU, sliding
window, MoE, MLA, hybrid Mamba, MTP; with and without PEFT and recompute):

- more tokens never cost less (monotone in every sequence length, strictly for model FLOPs);
- splitting a packed sub-sequence in two never raises model FLOPs (attention pairs only drop);
- components are non-negative and sum to the total (the tracker's too, vision included);
- executed FLOPs >= model FLOPs, component by component (default ``needed`` convention);
- the tracker's device statistics equal the pure estimator's on random micro-batches.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_flops.flops.formulas import SeqStats, parse_rows
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec, price
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker
from megatron_flops.flops.vision import VisionSpec, VisionStats, vision_training_flops

CASES = 40
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100)
FAMILIES = {
    "dense": {},
    "gqa_swiglu": dict(num_attention_heads=8, num_query_groups=2, gated_linear_unit=True, activation_func="silu"),
    "window": dict(num_layers=4, window_size=[5, 0], window_attn_skip_freq=2),
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32,
                moe_layer_freq=[0, 1]),
    "mla": dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                v_head_dim=16),
    "hybrid": dict(num_layers=4, hybrid_override_pattern="M*-M", mamba_state_dim=16, mamba_head_dim=16,
                   mamba_num_groups=2),
    "mtp": dict(mtp_num_layers=1),
}
PASSES = {
    "plain": dict(),
    "lora": dict(peft=PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_proj", "linear_fc1", "linear_fc2"))),
    "recompute": dict(recompute=RecomputeSpec(granularity="full", method="uniform", num_layers=1)),
}


def _spec(family: str) -> ModelSpec:
    return ModelSpec.from_mapping({**BASE, **FAMILIES[family]})


def _row(rng: random.Random) -> dict:
    seqlens = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
    padded = [s + rng.randint(0, 4) for s in seqlens]
    return {"seqlens": seqlens, "padded_seqlens": padded, "pad_to": sum(padded) + rng.randint(0, 8)}


def _priced(spec: ModelSpec, rows: list, attention: str, passes: str):
    stats = SeqStats.from_rows(parse_rows(rows), window=spec.window_size)
    return price(spec, stats, attention=attention, **PASSES[passes])


def _cases(*names: str):
    rng = random.Random("/".join(names))
    for _ in range(CASES):
        yield rng, [_row(rng) for _ in range(rng.randint(1, 3))]


# PEFT and recompute are modelled for GPT decoders only (hybrid Mamba: a ValueError at set-up).
GRID = [(family, attention, passes) for family in FAMILIES for attention in ("causal", "full") for passes in PASSES
        if family != "hybrid" or passes == "plain"]


@pytest.mark.parametrize("family, attention, passes", GRID)
def test_more_tokens_never_cost_less(family, attention, passes):
    spec = _spec(family)
    for rng, rows in _cases("grow", family, attention, passes):
        before = _priced(spec, rows, attention, passes)
        row = rng.choice(rows)
        i, d = rng.randrange(len(row["seqlens"])), rng.randint(1, 30)
        row["seqlens"][i] += d
        row["padded_seqlens"][i] += d
        row["pad_to"] += d
        after = _priced(spec, rows, attention, passes)
        assert after.model.total > before.model.total, (rows, i, d)
        assert after.executed.total > before.executed.total, (rows, i, d)


@pytest.mark.parametrize("family, attention, passes", GRID)
def test_splitting_a_packed_sequence_never_raises_model_flops(family, attention, passes):
    spec = _spec(family)
    for rng, rows in _cases("split", family, attention, passes):
        for row in rows:  # no sub-sequence padding: the split keeps every token slot
            row["padded_seqlens"] = list(row["seqlens"])
        row = rng.choice(rows)
        i = rng.randrange(len(row["seqlens"]))
        if row["seqlens"][i] < 2:
            row["seqlens"][i] = row["padded_seqlens"][i] = 2
            row["pad_to"] = max(row["pad_to"], sum(row["seqlens"]))
        whole = _priced(spec, rows, attention, passes)
        a = rng.randint(1, row["seqlens"][i] - 1)
        for key in ("seqlens", "padded_seqlens"):
            s = row[key][i]
            row[key][i : i + 1] = [a, s - a]
        split = _priced(spec, rows, attention, passes)
        assert split.model.total <= whole.model.total, rows
        assert split.executed.total <= whole.executed.total, rows
        # Only the attention terms can move: every other component is per token.
        moved = {k for k, v in split.model.components.items() if v != whole.model.components[k]}
        assert all(k.endswith("/core") for k in moved), moved


@pytest.mark.parametrize("family, attention, passes", GRID)
def test_components_sum_to_the_total_and_executed_covers_model(family, attention, passes):
    spec = _spec(family)
    for _, rows in _cases("sum", family, attention, passes):
        priced = _priced(spec, rows, attention, passes)
        for breakdown in (priced.model, priced.executed):
            assert all(v >= 0 for v in breakdown.components.values()), breakdown.components
            assert breakdown.total == sum(breakdown.components.values())
        assert priced.model.components.keys() == priced.executed.components.keys()
        assert all(priced.executed.components[k] >= v for k, v in priced.model.components.items()), rows


VIT = VisionSpec(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, gated_mlp=True, patch_size=2,
                 out_hidden_size=64, window_size=8, fullatt_block_indexes=(1,))


def test_vision_flops_grow_with_every_grid_dimension():
    rng = random.Random("vision")
    for _ in range(CASES):
        grid = [rng.randint(1, 4), 2 * rng.randint(1, 8), 2 * rng.randint(1, 8)]
        before = vision_training_flops(VIT, VisionStats.from_grids(VIT, [grid]))
        bigger = list(grid)
        dim = rng.randrange(3)
        bigger[dim] += 1 if dim == 0 else 2  # h and w stay multiples of the merge size
        after = vision_training_flops(VIT, VisionStats.from_grids(VIT, [bigger]))
        assert after.total > before.total, (grid, bigger)
        assert after.total == sum(after.components.values())


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)


@pytest.mark.parametrize("family", ["dense", "window"])
def test_tracker_equals_the_estimator_on_random_micro_batches(family):
    spec = _spec(family)
    rng = random.Random(f"tracker/{family}")
    tracker = FlopsTracker(spec, vision=VIT)
    for _ in range(CASES // 4):
        rows, grids = [], []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["packed", "padded_packed", "dynamic", "full"])
            if kind in ("packed", "padded_packed"):
                row = _row(rng)
                if kind == "packed":
                    row["padded_seqlens"] = list(row["seqlens"])
                tokens = torch.zeros(1, row["pad_to"], dtype=torch.long)
                tracker.record(tokens=tokens, cu_seqlens=_cu(row["seqlens"]), cu_seqlens_padded=_cu(row["padded_seqlens"]))
                rows.append(row)
            else:
                b, s = rng.randint(1, 3), rng.randint(1, 40)
                lengths = [rng.randint(1, s) for _ in range(b)] if kind == "dynamic" else [s] * b
                grid = [[1, 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)]]
                tracker.record(tokens=torch.zeros(b, s, dtype=torch.long), grid_thw=torch.tensor(grid),
                               **({"seq_lengths": torch.tensor(lengths)} if kind == "dynamic" else {}))
                # Unpacked sequences (ints) padded to the batch length: attended over it.
                rows += [{"seqlens": n, "pad_to": s} for n in lengths]
                grids += grid
        r = tracker.end_step()
        stats = SeqStats.from_rows(parse_rows(rows), window=spec.window_size)
        vision = vision_training_flops(VIT, VisionStats.from_grids(VIT, grids)).total if grids else 0
        expected = price(spec, stats)
        assert r.ok and r.flops == expected.model.total + vision and r.executed_flops == expected.executed.total + vision
        assert r.flops == sum(r.components.values())
