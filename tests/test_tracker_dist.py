"""FlopsTracker under megatron-core's real schedules in 4 local gloo processes.

Every data-parallel rank is fed different data (packed rows given by ``cu_seqlens`` and
dynamically padded rows given by ``seq_lengths``, lengths varying per micro-batch); the
tracker's totals on every rank, the last pipeline stage included, must equal the totals
computed directly from the data fed to all DP ranks. Layouts run one after the other inside one
process group: DP2 x PP2 x VPP2 (interleaved, megatron DDP), PP2 without VPP, DP4 (DDP), TP2.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

import mcore_cpu
import mcore_dist
from megatron_flops.flops.formulas import SeqStats, parse_rows, training_flops
from megatron_flops.model.spec import ModelSpec

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

WORLD = 4
VOCAB = 128
SEQ = 32
MBS = 2
NUM_MB = 4
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
# name -> (tp, pp, vpp, ddp)
LAYOUTS = {
    "DP2xPP2xVPP2+DDP": (1, 2, 2, True),
    "DP2xPP2": (1, 2, None, False),
    "DP4+DDP": (1, 1, None, True),
    "DP2xTP2": (2, 1, None, False),
}


def microbatch_rows(layout: str, dp_rank: int, index: int) -> list:
    """The rows of one micro-batch, as the pure estimator reads them (deterministic)."""
    rng = random.Random(f"{layout}/{dp_rank}/{index}")
    if index % 2 == 0:
        # Packed rows: documents of random lengths filling part of the SEQ slots.
        rows = []
        for _ in range(MBS):
            docs, left = [], SEQ - rng.randint(0, 5)
            while left > 0:
                docs.append(min(left, rng.randint(1, 14)))
                left -= docs[-1]
            rows.append({"seqlens": docs, "pad_to": SEQ})
        return rows
    # Dynamic padding: real lengths vary, every row padded to SEQ (fixed shapes for PP p2p).
    # Unpacked sequences (ints): each attended over the padded SEQ tokens, as a padded batch runs.
    return [{"seqlens": rng.randint(1, SEQ), "pad_to": SEQ} for _ in range(MBS)]


def _batch() -> dict:
    return dict(
        input_ids=torch.randint(0, VOCAB, (MBS, SEQ)),
        labels=torch.randint(0, VOCAB, (MBS, SEQ)),
        position_ids=torch.arange(SEQ).expand(MBS, SEQ).contiguous(),
        attention_mask=torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ),
        loss_mask=torch.ones(MBS, SEQ),
    )


def tracker_worker(rank: int, world_size: int, fail_rank: int | None) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_flops.tracking.tracker import FlopsTracker

    mcore_dist.init_worker(tp=1, pp=1)
    results = {}
    for name, (tp, pp, vpp, ddp) in LAYOUTS.items():
        mcore_dist.reinit_model_parallel(tp=tp, pp=pp, vpp=vpp)
        chunks, config = mcore_dist.build_model_chunks(dict(MODEL), VOCAB, SEQ, wrap_ddp=ddp)
        spec = ModelSpec.from_transformer_config(config, vocab_size=VOCAB)
        tracker = FlopsTracker(spec, seq_length=SEQ)
        dp_rank = ps.get_data_parallel_rank()
        batches = []
        for i in range(NUM_MB):
            torch.manual_seed(1000 * dp_rank + i)  # same batch on every TP/PP rank of a replica
            rows = microbatch_rows(name, dp_rank, i)
            batch = _batch()
            if i % 2 == 0:
                # The [MBS, SEQ] batch as one THD buffer: cu_seqlens over every row's documents.
                cu = [0]
                for r in rows:
                    for s in r["seqlens"]:
                        cu.append(cu[-1] + s)
                batch["tracker"] = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            else:
                batch["tracker"] = dict(seq_lengths=torch.tensor([r["seqlens"] for r in rows]))
            batches.append(batch)

        def forward_step(data_iterator, model, name=name):
            batch = next(data_iterator)
            inputs = dict(batch["tracker"])
            if fail_rank == rank and name == "DP2xTP2":
                inputs = dict(cu_seqlens=torch.tensor([0.0, 1.0]))  # a bad input on one rank only
            tracker.record(model=model, tokens=batch["input_ids"], **inputs)
            output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
            return output, partial(mcore_dist._gpt_loss_func, batch["loss_mask"])

        iterators = [iter(batches) for _ in chunks]
        mcore_dist.run_schedule(
            chunks, num_microbatches=NUM_MB, micro_batch_size=MBS, seq_length=SEQ, vocab_size=VOCAB,
            forward_step_func=forward_step, data_iterators=iterators, count_flops=False,
        )
        r = tracker.end_step()
        results[name] = dict(
            flops=r.flops, executed_flops=r.executed_flops, num_tokens=r.num_tokens,
            num_padded_tokens=r.num_padded_tokens, num_microbatches=r.num_microbatches,
            num_sequences=r.num_sequences, ok=r.ok, static_flops=r.static_flops,
            pp_rank=ps.get_pipeline_model_parallel_rank(), last_stage=ps.is_pipeline_last_stage(),
        )
        # A step in which nothing is recorded anywhere still joins the collective.
        empty = tracker.end_step()
        results[name]["empty_flops"] = empty.flops
    return results


def _expected(name: str, spec: ModelSpec) -> dict:
    tp, pp, _, _ = LAYOUTS[name]
    dp = WORLD // (tp * pp)
    rows = []
    for dp_rank in range(dp):
        for i in range(NUM_MB):
            mb = microbatch_rows(name, dp_rank, i)
            if i % 2 == 0:
                # Packed: the whole [MBS, SEQ] batch is one THD buffer; every row's documents are
                # sub-sequences, the row tails are padding slots.
                docs = [s for r in mb for s in r["seqlens"]]
                rows.append({"seqlens": docs, "pad_to": MBS * SEQ})
            else:
                rows += mb
    stats = SeqStats.from_rows(parse_rows(rows))
    return dict(
        flops=training_flops(spec, stats).total,
        executed_flops=training_flops(spec, stats, include_padding=True).total,
        num_tokens=stats.num_tokens,
        num_padded_tokens=stats.num_padded_tokens,
        num_microbatches=dp * NUM_MB,
        num_sequences=stats.num_sequences,
    )


@pytest.fixture(scope="module")
def dist_results():
    return mcore_dist.run_distributed(tracker_worker, WORLD, 2, timeout=240)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "DP2xTP2"])
def test_every_rank_gets_the_global_totals(dist_results, name):
    spec = ModelSpec.from_mapping(dict(MODEL, vocab_size=VOCAB))
    expected = _expected(name, spec)
    for rank, per_rank in enumerate(dist_results):
        got = per_rank[name]
        assert got["ok"], (rank, got)
        assert {k: got[k] for k in expected} == expected, (rank, name)
        assert got["empty_flops"] == 0
    # The last pipeline stage, the rank that prints the log, has the same numbers.
    assert any(r[name]["last_stage"] for r in dist_results)


def test_one_bad_rank_makes_every_rank_fall_back(dist_results):
    # Rank 2 (TP rank 0 of DP replica 1, an owner) fed a float cu_seqlens in the TP2 layout: every rank agrees to report the static
    # number for that step (ok=False), nobody hangs, and the next step is exact again.
    for per_rank in dist_results:
        got = per_rank["DP2xTP2"]
        assert not got["ok"] and got["flops"] == got["static_flops"]
        assert got["empty_flops"] == 0
