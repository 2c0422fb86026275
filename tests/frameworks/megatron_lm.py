"""Megatron-LM's stock ``pretrain_gpt.py`` on CPU: the model, the scenarios and their expected
numbers (test-only).

Every scenario trains the same small dense GPT (the local, non-Transformer-Engine layers, fp32)
for ``ITERATIONS`` steps of ``GLOBAL_BATCH`` rows of ``SEQ`` tokens, through
``python -m megatron_flops.launch --flops-accounting corrected pretrain_gpt.py ...``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from frameworks import data

# The model: 4 layers, hidden 64, 4 heads (MHA), GELU MLP 256, RoPE, tied embeddings.
LAYERS, HIDDEN, HEADS, FFN, SEQ = 4, 64, 4, 256, 64
# NullTokenizer(4095) has 4096 ids (4095 + EOD), already a multiple of Megatron's padding (128 x TP) for
# TP 1 and 2. core_v0.14.0's mock documents hold ids up to 4095, so the vocabulary must cover them.
VOCAB_ARG, PADDED_VOCAB = 4095, 4096
ITERATIONS = 3
PACKED_SEED = 11
EVAL_INTERVAL = 2
# core_v0.19.0's own FLOPs for iteration 3 over the closed form, measured in the packed runs with one
# evaluation after iteration 2 (the README's faults table): 1,439,668,224 / 720,070,656 (micro-batch
# size 1, 4 rows) and 2,885,799,936 / 1,440,251,904 (micro-batch size 2, 8 rows).
MEASURED_EVAL_FAULT = {"packed-eval": 1.999, "packed-mbs2-eval": 2.004}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    micro_batch: int = 2
    global_batch: int = 8
    packed: bool = False
    evaluate: bool = False  # one evaluation after iteration EVAL_INTERVAL (global-batch rows)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of one step, all data-parallel ranks together."""
        return self.global_batch // self.micro_batch


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(name="1proc", world_size=1),
        Scenario(name="tp2", world_size=2, tp=2),
        Scenario(name="pp2-vpp2-dp2", world_size=4, pp=2, vpp=2, global_batch=16),
        Scenario(name="packed", world_size=1, micro_batch=1, global_batch=4, packed=True),
        Scenario(name="packed-pp2-vpp2-dp2", world_size=4, pp=2, vpp=2, micro_batch=1, global_batch=8, packed=True),
        # core_v0.19.0: packed rows whose offsets the dataset pads to S + 1 entries, [mbs, S + 1] per
        # micro-batch, with an evaluation after iteration 2 (core_v0.19.0 counts its batches into
        # iteration 3's own FLOPs).
        Scenario(name="packed-eval", world_size=1, micro_batch=1, global_batch=4, packed=True, evaluate=True),
        Scenario(name="packed-mbs2-eval", world_size=1, micro_batch=2, global_batch=8, packed=True, evaluate=True),
    )
}


def script_args(s: Scenario, version: str) -> list[str]:
    """``pretrain_gpt.py`` arguments of release ``version``: the model, the parallel layout, mock
    data, no checkpoints, evaluation only where the scenario asks, and the CPU switches (local
    layers, no fusions, gloo, no gradient clipping)."""
    args = [
        "--num-layers", LAYERS, "--hidden-size", HIDDEN, "--num-attention-heads", HEADS, "--ffn-hidden-size", FFN,
        "--seq-length", SEQ, "--max-position-embeddings", SEQ, "--position-embedding-type", "rope",
        "--micro-batch-size", s.micro_batch, "--global-batch-size", s.global_batch, "--train-iters", ITERATIONS,
        "--tensor-model-parallel-size", s.tp, "--pipeline-model-parallel-size", s.pp,
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB_ARG,
        "--num-workers", 0,
        "--lr", "1e-4", "--min-lr", "1e-5", "--seed", 1234, "--log-interval", 1, "--log-throughput",
        "--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend", "gloo",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--clip-grad", 0,
        "--attention-dropout", 0, "--hidden-dropout", 0,
    ]
    if s.vpp:
        args += ["--num-layers-per-virtual-pipeline-stage", LAYERS // (s.pp * s.vpp)]
    if s.evaluate:
        args += ["--split", "98,2,0", "--eval-iters", 1, "--eval-interval", EVAL_INTERVAL]
    else:
        args += ["--split", "100,0,0", "--eval-iters", 0, "--eval-interval", 1000]
    if s.packed and row_local(version):
        args.append("--dataloader-inter-document-masking")  # core_v0.19.0's switch for cu_seqlens batches
    return [str(a) for a in args]


def row_local(version: str) -> bool:
    """Whether release ``version``'s packed batches carry offsets padded to ``S + 1`` entries."""
    return tuple(map(int, version.split("."))) >= (0, 19)


def rank_args(s: Scenario, snapshot: Path, version: str, *, framework_flops: bool = False) -> list[str]:
    shim = ["megatron-lm"]
    if s.packed:
        shim += ["--packed", str(PACKED_SEED)] + (["--row-local"] if row_local(version) else [])
    if framework_flops:
        shim.append("--print-framework-flops")
    return [*shim, "--", "--flops-accounting", "corrected", str(snapshot / "pretrain_gpt.py"),
            *script_args(s, version)]


# ---- expected numbers, from the model's shapes and the dataset's document lengths ------------------


def per_token_flops() -> int:
    """Training FLOPs per token of everything but core attention: 3 passes (forward, input gradient,
    weight gradient) x 2 FLOPs per multiply-add x the GEMMs' multiply-adds per token:
    QKV h x 3h, attention output h x h, MLP h x f and f x h, per layer; logits h x V."""
    return 3 * 2 * (LAYERS * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN) + HIDDEN * PADDED_VOCAB)


def attention_flops(sum_seqlen_squared: int) -> int:
    """Core attention, causal convention (half the s x s product, as Megatron-LM counts it): per layer
    and sequence QK^T and PV are 2 x s^2/2 x h multiply-adds each; x 2 FLOPs x 3 passes."""
    return 3 * 2 * 2 * LAYERS * HIDDEN * sum_seqlen_squared // 2


def rows_of_step(s: Scenario, iteration: int) -> list[list[int]]:
    """The document lengths of every row trained at ``iteration`` (1-based), all DP ranks together.

    Megatron-LM's sampler hands out indices in order: step k trains rows (k-1)G .. kG-1."""
    first = (iteration - 1) * s.global_batch
    if not s.packed:
        return [[SEQ]] * s.global_batch
    return [data.doc_lengths(PACKED_SEED, i, SEQ) for i in range(first, first + s.global_batch)]


def validation_rows(s: Scenario) -> list[list[int]]:
    """The document lengths of the rows of the one evaluation (``--eval-iters 1``: one global
    batch, the validation split's rows 0 .. G-1, from the same packed mock dataset)."""
    return [data.doc_lengths(PACKED_SEED, i, SEQ) for i in range(s.global_batch)]


def rows_flops(rows: list[list[int]]) -> int:
    """Training FLOPs of full rows holding these documents."""
    tokens = sum(map(sum, rows))
    return tokens * per_token_flops() + attention_flops(sum(n * n for row in rows for n in row))


def expected_step(s: Scenario, iteration: int) -> dict[str, int]:
    """The trace integers of one step. Rows are full (documents fill them exactly), so executed =
    model FLOPs, and the static number prices every row as one ``SEQ``-token sequence."""
    rows = rows_of_step(s, iteration)
    tokens = sum(map(sum, rows))
    flops = rows_flops(rows)
    static = s.global_batch * SEQ * per_token_flops() + attention_flops(s.global_batch * SEQ * SEQ)
    return {
        "iteration": iteration,
        "flops": flops,
        "executed_flops": flops,
        "static_flops": static,
        "num_tokens": tokens,
        "num_padded_tokens": s.global_batch * SEQ,
        "num_sequences": sum(map(len, rows)),
        "num_microbatches": s.num_microbatches,
    }


# ---- the log line ----------------------------------------------------------------------------------

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|")
_FIELD = re.compile(r" ([^|:]+): ([^|]+) \|")


def log_lines(output: str) -> dict[int, dict[str, str]]:
    """Megatron's iteration log lines in ``output``: iteration -> {field: text}."""
    lines = {}
    for line in output.splitlines():
        match = _ITERATION.search(line)
        if match and "elapsed time per iteration (ms)" in line:
            lines[int(match.group(1))] = {k.strip(): v.strip() for k, v in _FIELD.findall(line[match.end() - 1:])}
    return lines
