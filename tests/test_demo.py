"""``megatron-flops demo``: real megatron-core training on CPU, the tracker's totals, the CLI.

The in-process tests call ``train()`` directly (one rank, world size 1); the smoke tests run the
command as a user would, in a subprocess.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flops import cli
from megatron_flops.demo.data import DataConfig, microbatches
from megatron_flops.flops.formulas import Row, SeqStats, training_flops

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
needs_mcore = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed")

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(
    r"iteration +(\d+)/ +(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \|"
    r" throughput per GPU \(TFLOP/s/GPU\): ([\d.e+-]+) \|"
    r" corrected throughput per GPU \(TFLOP/s/GPU\): ([\d.e+-]+) \| over-report factor vs static: ([\d.]+)x \|"
    r" tokens per GPU \(tokens/s/GPU\): [\d.]+ \| lm loss: [\d.E+-]+ \|"
)


def _run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_flops", "demo", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )


def _steps(config: DataConfig, *, seed: int, dp_rank: int, num_microbatches: int, iterations: int) -> list[list[Row]]:
    """The rows each iteration of one data-parallel rank reads."""
    stream = microbatches(config, seed=seed, dp_rank=dp_rank)
    return [
        [row for batch in itertools.islice(stream, num_microbatches) for row in batch.rows]
        for _ in range(iterations)
    ]


def _check_lines(stdout: str, iterations: int) -> list[re.Match]:
    lines = [m for m in map(LINE.search, stdout.splitlines()) if m]
    assert [int(m[1]) for m in lines] == list(range(1, iterations + 1))
    for m in lines:
        static, corrected, factor = float(m[3]), float(m[4]), float(m[5])
        assert corrected < static
        assert factor > 1.0
    assert "steady state: iterations 3-" in stdout
    assert "MFU: not reported" in stdout
    return lines


@needs_mcore
def test_demo_command_single_process() -> None:
    done = _run_cli("--iterations", "4", timeout=900)
    assert done.returncode == 0, done.stderr
    _check_lines(done.stdout, 4)
    assert "Traceback" not in done.stderr


@needs_mcore
def test_tracker_totals_equal_the_generated_data() -> None:
    from megatron_flops.demo.run import DemoOptions, train

    options = DemoOptions(iterations=3, num_microbatches=4)
    lines: list[str] = []
    run = train(options, out=lines.append)
    steps = _steps(options.data, seed=0, dp_rank=0, num_microbatches=4, iterations=3)
    # Both kinds of micro-batch occur: packed rows (several documents) and padded rows.
    rows = [row for step in steps for row in step]
    assert any(len(r.seqlens) > 1 for r in rows) and any(r.padded_seqlens[0] > r.seqlens[0] for r in rows)
    assert len(run.results) == 3
    for result, step in zip(run.results, steps):
        stats = SeqStats.from_rows(step)
        assert result.ok
        assert result.num_microbatches == 4
        assert (result.num_sequences, result.num_tokens, result.num_padded_tokens, result.sum_seqlen_squared) == (
            stats.num_sequences, stats.num_tokens, stats.num_padded_tokens, stats.sum_seqlen_squared)
        assert result.flops == training_flops(run.spec, stats).total
        assert result.executed_flops == training_flops(run.spec, stats, include_padding=True).total
        # The stock formula: every row one seq_length-token sequence.
        static = SeqStats.full_length(stats.num_rows, options.data.seq_length)
        assert result.static_flops == training_flops(run.spec, static).total
    assert sum(LINE.search(line) is not None for line in lines) == 3


@needs_mcore
def test_cpu_executes_every_row_unpacked() -> None:
    # The local attention runs each row as one sequence of its padded length (a packed row under a
    # block-diagonal mask): FlopCounterMode over the whole run equals the formulas priced that way.
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_flops.demo.run import DemoOptions, train

    options = DemoOptions(iterations=2, num_microbatches=2, attention="full")
    counter = FlopCounterMode(display=False)
    with counter:
        run = train(options, out=lambda line: None)
    steps = _steps(options.data, seed=0, dp_rank=0, num_microbatches=2, iterations=2)
    unpacked = [
        Row(seqlens=(row.num_padded_tokens,), padded_seqlens=(row.num_padded_tokens,),
            num_padded_tokens=row.num_padded_tokens)
        for step in steps for row in step
    ]
    measured = counter.get_total_flops()
    assert measured == training_flops(run.spec, SeqStats.from_rows(unpacked), attention="full").total
    # The tracker prices packed rows as THD attention (sum of s_i^2 pairs); the CPU also ran the
    # masked pairs across documents: exactly row_len^2 - sum s_i^2 more pairs per packed row.
    masked_pairs = sum(r.num_padded_tokens**2 - sum(s * s for s in r.padded_seqlens) for step in steps for r in step)
    assert masked_pairs > 0
    executed = sum(r.executed_flops for r in run.results)
    assert measured - executed == training_flops(run.spec, SeqStats(sum_seqlen_squared=masked_pairs), attention="full").total


@needs_mcore
@pytest.mark.dist
def test_demo_command_interleaved_pipeline_with_data_parallel() -> None:
    done = _run_cli("--pp", "2", "--vpp", "2", "--iterations", "4", timeout=900)
    assert done.returncode == 0, done.stderr
    _check_lines(done.stdout, 4)
    assert "4 processes (PP=2 x VPP=2 x DP=2)" in done.stdout
    # The summary's real tokens are both data-parallel replicas' (different data), steady state only.
    config = DataConfig()
    expected = sum(
        SeqStats.from_rows(step).num_tokens
        for dp_rank in (0, 1)
        for step in _steps(config, seed=0, dp_rank=dp_rank, num_microbatches=4, iterations=4)[2:]
    )
    assert re.search(r"real tokens, all GPUs: +(\d+)\n", done.stdout)[1] == str(expected)


def test_demo_rejects_bad_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--pp", "3"]) == 2
    assert capsys.readouterr().err == "megatron-flops: error: pp x vpp = 3 must divide the model's 4 layers\n"
    assert cli.main(["demo", "--vpp", "2"]) == 2
    assert "vpp needs pp >= 2" in capsys.readouterr().err


def test_demo_without_megatron_core(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli.demo, "_have_megatron_core", lambda: False)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install megatron-core" in err


@pytest.mark.frameworks
def test_demo_command_on_megatron_core_0_19(tmp_path) -> None:
    # The demo in the Python 3.12 venv of megatron-core 0.19.0 (tests/frameworks/envs.py), the
    # package from this checkout (PYTHONPATH): its DDP grad sync asks for torch.cuda.current_stream().
    from frameworks import checks, envs, procs

    python = checks.require(lambda: envs.ensure("megatron-lm-0.19.0"))
    done = subprocess.run([str(python), "-m", "megatron_flops", "demo", "--iterations", "3"], cwd=tmp_path,
                          env=procs.child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    _check_lines(done.stdout, 3)
    assert "Traceback" not in done.stderr
