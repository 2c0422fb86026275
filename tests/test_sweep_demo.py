"""A sweep over the real demo (megatron-core on CPU) as the training command: statuses, medians
computed from the traces, the recommendation, ``compare`` on the same traces, the plot."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys

import pytest

from test_sweep import ROOT, _hand_median


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_sweep_over_the_demo(tmp_path) -> None:
    """The demo as the training command: 3 iterations train (ok), 0 is refused (failed), 100000
    cannot finish before the time-out (timeout). Medians equal those computed from the traces,
    and ``compare`` on the two traces gives the same ones."""
    out = tmp_path / "sw"
    command = [sys.executable, "-m", "megatron_flops", "sweep", "--param", "iters=3,0,100000", "--timeout", "45",
               "--out", str(out), "--plot", str(tmp_path / "sweep.png"), "--",
               sys.executable, "-m", "megatron_flops", "demo", "--iterations", "{iters}", "--warmup", "1",
               "--pack-length", "64", "--micro-batches", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    runs = {r["params"]["iters"]: r for r in results["runs"]}
    assert {k: r["status"] for k, r in runs.items()} == {"3": "ok", "0": "failed", "100000": "timeout"}
    assert "iterations must be >= 1" in (out / runs["0"]["dir"] / "log.txt").read_text()
    assert runs["3"]["num_steps"] == 2  # 3 iterations, 1 warm-up
    traces = [out / runs[k]["dir"] / "trace.jsonl" for k in ("3", "100000")]
    for key, trace in zip(("3", "100000"), traces):
        assert runs[key]["median_tflops_per_gpu"] == _hand_median(trace)
        assert runs[key]["median_tokens_per_s_per_gpu"] == _hand_median(trace, "num_tokens")
    assert results["recommendation"]["params"] == {"iters": "3"}
    with open(out / "summary.csv") as f:
        rows = {r["iters"]: r for r in csv.DictReader(f)}
    assert float(rows["3"]["median_tflops_per_gpu"]) == runs["3"]["median_tflops_per_gpu"]
    assert rows["3"]["recommended"] == "yes" and rows["100000"]["statuses"] == "timeout"
    compared = subprocess.run([sys.executable, "-m", "megatron_flops", "compare", "--json", *map(str, traces)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stderr
    medians = [r["median_tflops_per_gpu"] for r in json.loads(compared.stdout)["runs"]]
    assert medians == [runs["3"]["median_tflops_per_gpu"], runs["100000"]["median_tflops_per_gpu"]]
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_demo_trace_holds_the_tracker_totals(tmp_path) -> None:
    from megatron_flops.demo.run import DemoOptions, train
    from megatron_flops.reporting.runs import read_trace

    path = tmp_path / "demo.jsonl"
    run = train(DemoOptions(iterations=3, warmup=1, trace=str(path)), out=lambda line: None)
    (segment,) = read_trace(path).segments
    assert segment.header["framework"] == "demo" and segment.header["warmup_iterations"] == 1
    assert segment.header["conventions"]["attention"] == "causal" and segment.world_size == 1
    assert [(s.iteration, s.flops, s.num_tokens, s.static_flops, s.ok) for s in segment.steps] == [
        (i, r.flops, r.num_tokens, r.static_flops, True) for i, r in enumerate(run.results, start=1)
    ]
