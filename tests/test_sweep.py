"""``megatron-flops sweep`` and ``compare`` end to end, with ``fake_train.py`` as the training
command (it writes a trace with given numbers, or fails, hangs, runs out of memory, writes none).

Expected medians are computed here from the trace files directly (json + statistics), not with
``megatron_flops.reporting.runs``.
"""

from __future__ import annotations

import csv
import json
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fake_train import alive, header, step, wait_for
from megatron_flops import cli
from megatron_flops.cli.sweep import check_command, parse_params, plan

FAKE = str(Path(__file__).with_name("fake_train.py"))
ROOT = Path(__file__).resolve().parent.parent
T = 10**12


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C's default disposition, whatever the test process inherited
    (Python installs its KeyboardInterrupt handler only where SIGINT is not ignored at start-up)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sweep(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["sweep", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _hand_median(trace: Path, key: str = "flops") -> float:
    """Median TFLOP/s/GPU (or tokens/s/GPU with key="num_tokens") of a one-segment trace."""
    text = trace.read_text()
    if not text.endswith("\n"):  # a run killed while writing a line
        text = text[:text.rfind("\n") + 1]
    lines = [json.loads(line) for line in text.splitlines()]
    run, steps = lines[0]["run"], lines[1:]
    used = [s for s in steps[run["warmup_iterations"]:] if s["ok"]]
    scale = 1e12 if key == "flops" else 1.0
    return statistics.median(s[key] / s["elapsed_s"] / run["world_size"] / scale for s in used)


def test_every_status_is_recorded(tmp_path, capsys) -> None:
    # No time limit for the runs that end by themselves (a busy machine may start them slowly);
    # the run that hangs gets a sweep of its own with a short one, which it always exceeds.
    out = tmp_path / "sw"
    code, stdout, _ = _sweep(capsys, "--param", "mode=ok,fail,oom,no-trace", "--timeout", "0", "--out", str(out),
                             "--", sys.executable, FAKE, "--mode", "{mode}")
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    statuses = {r["params"]["mode"]: r["status"] for r in results["runs"]}
    assert statuses == {"ok": "ok", "fail": "failed", "oom": "oom", "no-trace": "no-trace"}
    reasons = {r["params"]["mode"]: r["reason"] for r in results["runs"]}
    assert reasons["fail"] == "exit code 3"
    assert "CUDA out of memory" in reasons["oom"]
    assert "no trace.jsonl written" in reasons["no-trace"]
    assert results["recommendation"]["params"] == {"mode": "ok"}
    for run in results["runs"]:  # each run in its own directory with its command and log
        run_dir = out / run["dir"]
        assert (run_dir / "command.txt").read_text().startswith(sys.executable)
        assert "fake training starting" in (run_dir / "log.txt").read_text()
    assert (out / "001_mode-fail" / "r1" / "trace.jsonl").exists() is False
    hung = tmp_path / "hung"
    code, stdout, _ = _sweep(capsys, "--param", "mode=hang", "--timeout", "2", "--out", str(hung),
                             "--", sys.executable, FAKE, "--mode", "{mode}")
    assert code == 1  # no configuration with every repeat ok: no recommendation
    (run,) = json.loads((hung / "results.json").read_text())["runs"]
    assert run["status"] == "timeout" and run["reason"].startswith("stopped after")
    assert "timeout: stopped after" in stdout


def test_medians_and_recommendation(tmp_path, capsys) -> None:
    out = tmp_path / "sw"
    # Steps take 1, 2, 0.5, 1, 2, 0.5 s; the header's warm-up is 2, so steps 3-6 are used:
    # F / [0.5, 1, 2, 0.5] -> [2F, F, F/2, 2F], median 1.5 F: 150, 147 and 151.5 TFLOP/s/GPU.
    # Repeat 2 of the first configuration fails, so only 98e12 (147) and 101e12 (151.5) are fully ok:
    # the fastest is 151.5; 3 % below it is 146.955; 147 is the first within: flops=98e12.
    args = ["--param", f"flops={100 * T},{98 * T},{101 * T}", "--repeats", "2", "--out", str(out),
            "--", sys.executable, FAKE, "--flops", "{flops}", "--elapsed", "1,2,0.5",
            "--fail-in", f"000_flops-{100 * T}/r2", "{run_dir}"]
    code, stdout, _ = _sweep(capsys, *args)
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert [(r["params"]["flops"], r["repeat"], r["status"]) for r in results["runs"]] == [
        (str(100 * T), 1, "ok"), (str(100 * T), 2, "failed"),
        (str(98 * T), 1, "ok"), (str(98 * T), 2, "ok"), (str(101 * T), 1, "ok"), (str(101 * T), 2, "ok"),
    ]
    for run in results["runs"]:
        if run["status"] == "ok":
            trace = out / run["dir"] / "trace.jsonl"
            assert run["median_tflops_per_gpu"] == _hand_median(trace)
            assert run["median_tokens_per_s_per_gpu"] == _hand_median(trace, "num_tokens")
            assert run["num_steps"] == 4
    assert [r["median_tflops_per_gpu"] for r in results["runs"] if r["status"] == "ok"] == [150, 147, 147, 151.5, 151.5]
    rec = results["recommendation"]
    assert rec["params"] == {"flops": str(98 * T)} and rec["value"] == 147
    assert rec["fastest"] == {"index": 2, "params": {"flops": str(101 * T)}, "value": 151.5}
    assert results["warnings"] == []
    assert rec["margin"] == pytest.approx(4.5 / 151.5) and rec["tolerance"] == 0.03
    assert "within 3% of the best" in rec["rule"]
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["flops"], r["num_ok"], r["statuses"], r["median_tflops_per_gpu"], r["recommended"]) for r in rows] == [
        (str(100 * T), "1", "ok failed", "150.0", ""),  # the median of its ok repeats only
        (str(98 * T), "2", "ok ok", "147.0", "yes"),
        (str(101 * T), "2", "ok ok", "151.5", ""),
    ]
    assert "recommendation (*): flops=98000000000000" in stdout

    # Resumable: a rerun skips every finished run and leaves them untouched.
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/r*/run.json")}
    code, stdout, _ = _sweep(capsys, *args)
    assert code == 0 and stdout.count("(finished before; skipped)") == 6
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("*/r*/run.json")}
    # More repeats extend the same sweep: only repeat 3 of each configuration runs.
    code, stdout, _ = _sweep(capsys, *[a if a != "2" else "3" for a in args])
    assert stdout.count("(finished before; skipped)") == 6 and stdout.count(": ok, 4 steps") == 3

    # compare on two of the sweep's traces gives the same medians.
    assert cli.main(["compare", "--json", str(out / "001_flops-98000000000000/r1/trace.jsonl"),
                     str(out / "002_flops-101000000000000/r2/trace.jsonl")]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["median_tflops_per_gpu"] for r in runs] == [147, 151.5]
    assert runs[1]["ratio_tflops_per_gpu"] == 151.5 / 147


def test_tolerance_and_objective_options(tmp_path, capsys) -> None:
    # 100, 98, 101 TFLOP/s/GPU with 1 s steps; tolerance 0: the fastest, 101e12.
    code, _, _ = _sweep(capsys, "--param", f"flops={100 * T},{98 * T},{101 * T}", "--tolerance", "0", "--out",
                        str(tmp_path / "a"), "--", sys.executable, FAKE, "--flops", "{flops}")
    assert code == 0
    rec = json.loads((tmp_path / "a" / "results.json").read_text())["recommendation"]
    assert rec["params"] == {"flops": str(101 * T)} and rec["metric"] == "median_tflops_per_gpu"
    # By tokens/s: 2000 > 1000 tokens per 1 s step.
    code, _, _ = _sweep(capsys, "--param", "tokens=1000,2000", "--objective", "tokens", "--out", str(tmp_path / "b"),
                        "--", sys.executable, FAKE, "--tokens", "{tokens}")
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["recommendation"]["params"] == {"tokens": "2000"} and results["recommendation"]["value"] == 2000.0
    # One warning per configuration, naming the traces (not one per pair of repeats).
    a, b = (str(tmp_path / "b" / d / "r1" / "trace.jsonl") for d in ("000_tokens-1000", "001_tokens-2000"))
    assert results["warnings"] == [f"{b} differs from {a}: tokens per step 1000 vs 2000 at iteration 1 "
                                   "(other data or global batch)"]


def test_no_recommendation_exits_1(tmp_path, capsys) -> None:
    code, stdout, _ = _sweep(capsys, "--param", "mode=fail", "--out", str(tmp_path / "sw"),
                             "--", sys.executable, FAKE, "--mode", "{mode}")
    assert code == 1
    assert "recommendation: none" in stdout
    code, stdout, _ = _sweep(capsys, "--param", "a=1", "--out", str(tmp_path / "nx"), "--", "/nonexistent/train", "{a}")
    assert code == 1
    assert "failed: cannot start '/nonexistent/train': No such file or directory" in stdout
    assert json.loads((tmp_path / "sw" / "results.json").read_text())["recommendation"] is None


@pytest.mark.parametrize("args, message", [
    (["--param", "mb=", "--", "x", "{mb}"], "--param mb has no values"),
    (["--param", "mb=1,,2", "--", "x", "{mb}"], "--param mb has an empty value"),
    (["--param", "mb=1,1", "--", "x", "{mb}"], "repeats a value"),
    (["--param", "1mb=1", "--", "x"], "expected NAME=v1,v2"),
    (["--param", "trace=1", "--", "x", "{trace}"], "reserved"),
    (["--param", "mb=1", "--", "x", "--mb", "1"], r"placeholder \{mb\} is not in COMMAND"),
    (["--param", "mb=1", "--", "x", "{mb}", "{pp}"], r"placeholder \{pp\} in COMMAND has no --param pp"),
    (["--param", "mb=1"], "no command to sweep"),
    (["--param", "mb=1", "--repeats", "0", "--", "x", "{mb}"], r"--repeats must be in \[1, 10000\]"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, args, message) -> None:
    code, _, err = _sweep(capsys, "--out", str(tmp_path / "sw"), *args)
    assert code == 2
    assert re.search(message, err), err
    assert not (tmp_path / "sw").exists()


def test_out_holding_something_else_exits_2(tmp_path, capsys) -> None:
    out = tmp_path / "sw"
    assert _sweep(capsys, "--param", "a=1", "--out", str(out), "--", sys.executable, FAKE, "--tokens", "{a}")[0] == 0
    code, _, err = _sweep(capsys, "--param", "a=2", "--out", str(out), "--", sys.executable, FAKE, "--tokens", "{a}")
    assert code == 2 and f"--out {out} holds another sweep's results (params: " in err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    code, _, err = _sweep(capsys, "--param", "a=1", "--out", str(tmp_path / "other"), "--", "x", "{a}")
    assert code == 2 and "is not a sweep directory" in err


def test_dry_run_prints_and_writes_nothing(tmp_path, capsys) -> None:
    code, stdout, _ = _sweep(capsys, "--param", "a=1,2", "--param", "b=x", "--dry-run", "--out", str(tmp_path / "sw"),
                             "--", "train", "--a", "{a}", "--b={b}", "${HOME}", "--dir", "{run_dir}")
    assert code == 0 and not (tmp_path / "sw").exists()
    lines = stdout.splitlines()
    assert lines[0] == f"[1/2] 000_a-1_b-x/r1: train --a 1 --b=x '${{HOME}}' --dir {tmp_path / 'sw' / '000_a-1_b-x' / 'r1'}"
    assert lines[1].startswith("[2/2] 001_a-2_b-x/r1: train --a 2 --b=x")


def test_plan_order_is_first_param_slowest_and_repeats_interleaved() -> None:
    params = parse_params(["mb=1,2", "pp=4,2"])
    check_command(["t", "{mb}", "{pp}"], params)
    assert [(r.index, dict(r.params), r.repeat) for r in plan(params, 1)] == [
        (0, {"mb": "1", "pp": "4"}, 1), (1, {"mb": "1", "pp": "2"}, 1),
        (2, {"mb": "2", "pp": "4"}, 1), (3, {"mb": "2", "pp": "2"}, 1),
    ]
    assert [(r.index, r.repeat, r.dir) for r in plan(parse_params(["a=x,y"]), 2)] == [
        (0, 1, "000_a-x/r1"), (1, 1, "001_a-y/r1"), (0, 2, "000_a-x/r2"), (1, 2, "001_a-y/r2"),
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_keeps_finished_runs_and_a_rerun_resumes(tmp_path) -> None:
    out, marker = tmp_path / "sw", tmp_path / "hung-once"
    command = [sys.executable, "-m", "megatron_flops", "sweep", "--param", "mode=ok,hang,ok2", "--timeout", "600",
               "--out", str(out), "--", sys.executable, FAKE, "--mode", "{mode}", "--hang-once", str(marker)]
    # fake_train knows no "ok2": that run would fail; the sweep must stop before it.
    sweep = subprocess.Popen(  # (Ctrl-C as a user's terminal delivers it)
        preexec_fn=_sigint_default, args=command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = out / "001_mode-hang" / "r1" / "log.txt"
        wait_for(lambda: log.exists() and "hanging" in log.read_text(), "the second run to hang")
        pid = int(log.read_text().split("pid ")[1].split()[0])
        sweep.send_signal(signal.SIGINT)
        _, stderr = sweep.communicate(timeout=600)
    finally:
        sweep.kill()
    assert sweep.returncode == 130, stderr
    assert "interrupted; 1 of 3 runs finished" in stderr
    wait_for(lambda: not alive(pid), "the hung run to be gone", timeout_s=300)
    results = json.loads((out / "results.json").read_text())
    assert [(r["params"], r["status"]) for r in results["runs"]] == [({"mode": "ok"}, "ok")]
    assert results["sweep"]["num_pending"] == 2
    assert not (out / "001_mode-hang" / "r1" / "run.json").exists()
    # The rerun skips the finished run and runs the other two (the marker now exists: no hang).
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "000_mode-ok/r1: ok (finished before; skipped)" in done.stdout
    statuses = [r["status"] for r in json.loads((out / "results.json").read_text())["runs"]]
    assert statuses == ["ok", "ok", "failed"]


# ---- compare -----------------------------------------------------------------------------------------


def _write(path: Path, *objs: dict) -> str:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def test_compare_prints_medians_spreads_and_ratios(tmp_path, capsys) -> None:
    a = _write(tmp_path / "a.jsonl", header(warmup=1), *[step(i, flops=2 * T, tokens=100, elapsed_s=e, static=4 * T)
                                                         for i, e in enumerate([5.0, 1.0, 2.0, 4.0], start=1)])
    b = _write(tmp_path / "b.jsonl", header(warmup=1), *[step(i, flops=2 * T, tokens=100, elapsed_s=e, static=4 * T)
                                                         for i, e in enumerate([5.0, 0.5, 1.0, 2.0], start=1)])
    assert cli.main(["compare", a, b]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    # a: 2e12 / [1, 2, 4] s -> [2, 1, 0.5], median 1; b: [4, 2, 1], median 2 (2x a); static: twice.
    assert f"run 1: {a} (custom, 1 GPU; 3 steps used, 1 warm-up, 0 fell back)" in out
    # Overall: a 6e12 FLOPs over 7 s = 0.8571, b over 3.5 s = 1.714; mean step 2333.3 and 1166.7 ms.
    # The IQRs touch (a 0.75-1.5, b 1.5-3): the doubling is within the steps' noise.
    assert "corrected TFLOP/s/GPU    median         1   IQR 0.75-1.5   min-max 0.5-2   overall 0.8571\n" in out
    assert ("corrected TFLOP/s/GPU    median         2   IQR 1.5-3   min-max 1-4   overall 1.714   2.000x run 1 "
            "(IQRs overlap: within the steps' noise)") in out
    assert "static TFLOP/s/GPU       median         4" in out
    assert ("step time (ms)           median    1000.0   IQR 750.0-1500.0   min-max 500.0-2000.0   mean 1166.7   "
            "0.500x run 1 (IQRs overlap") in out
    assert cli.main(["compare", "--json", a, b]) == 0
    first, second = json.loads(capsys.readouterr().out)["runs"]
    assert (first["overall_tflops_per_gpu"], second["overall_tflops_per_gpu"]) == (6e12 / 7 / 1e12, 6e12 / 3.5 / 1e12)
    assert second["overall_tokens_per_s_per_gpu"] == 300 / 3.5 and second["overall_step_time_s"] == 3.5 / 3
    assert second["iqr_overlap_tflops_per_gpu"] is True and "iqr_overlap_tflops_per_gpu" in first


def test_compare_warns_about_differences(tmp_path, capsys) -> None:
    a = _write(tmp_path / "a.jsonl", header(warmup=0), step(1, flops=T, tokens=100, elapsed_s=1.0))
    b = _write(tmp_path / "b.jsonl", header(warmup=0, num_layers=8), step(1, flops=T, tokens=200, elapsed_s=1.0))
    assert cli.main(["compare", a, b]) == 0
    assert (f"warning: {b} differs from {a}: model.num_layers 4 vs 8; tokens per step 100 vs 200 at "
            "iteration 1") in capsys.readouterr().err


@pytest.mark.parametrize("second, message", [
    ([header()], "has no steps"),
    ([header(warmup=0), step(1, flops=T, tokens=1, elapsed_s=1.0, ok=False)], "fell back"),
    ([header(warmup=0, attention="full"), step(1, flops=T, tokens=1, elapsed_s=1.0)], "other conventions"),
])
def test_compare_bad_traces_exit_2(tmp_path, capsys, second, message) -> None:
    a = _write(tmp_path / "a.jsonl", header(warmup=0), step(1, flops=T, tokens=1, elapsed_s=1.0))
    b = _write(tmp_path / "b.jsonl", *second)
    assert cli.main(["compare", a, b]) == 2
    assert message in capsys.readouterr().err
    assert cli.main(["compare", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_plots_render(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    a = _write(tmp_path / "a.jsonl", header(warmup=1), *[step(i, flops=T, tokens=1, elapsed_s=1.0 + i % 2, static=3 * T,
                                                              ok=i != 4) for i in range(1, 7)])
    png = tmp_path / "a.png"
    assert cli.main(["compare", a, a, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    png = tmp_path / "sweep.png"
    assert _sweep(capsys, "--param", "mode=ok,fail", "--out", str(tmp_path / "sw"), "--plot", str(png),
                  "--", sys.executable, FAKE, "--mode", "{mode}", "--static-flops", str(3 * T))[0] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec() then reports it missing
    a = _write(tmp_path / "a.jsonl", header(warmup=0), step(1, flops=T, tokens=1, elapsed_s=1.0))
    assert cli.main(["compare", a, "--plot", str(tmp_path / "a.png")]) == 2
    assert "--plot needs matplotlib: pip install 'megatron-flops[plot]'" in capsys.readouterr().err



def test_noise_is_reported_and_the_recommendation_not_confident(tmp_path, capsys) -> None:
    """The issue's case: two repeats of one configuration 4x apart. flops=100e12 runs at 100
    TFLOP/s/GPU twice; flops=101e12 at 101, then at 25.25 (step times x4). Medians: 100 and
    63.125; the fastest, 100, is chosen, but 101's repeats (25.25-101) overlap its range (100-100)
    though 63.125 is outside the 3% band: noise could have changed the choice."""
    out = tmp_path / "sw"
    code, stdout, err = _sweep(capsys, "--param", f"flops={100 * T},{101 * T}", "--repeats", "2", "--out", str(out),
                               "--", sys.executable, FAKE, "--flops", "{flops}",
                               "--slow-in", f"001_flops-{101 * T}/r2", "4", "{run_dir}")
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    quiet, noisy = results["configurations"]
    assert quiet["repeat_medians_tflops_per_gpu"] == [100, 100] and quiet["spread_percent"] == 0
    assert noisy["repeat_medians_tflops_per_gpu"] == [101, 25.25]
    assert noisy["spread_percent"] == pytest.approx(100 * 75.75 / 63.125)  # (max - min) / median: 120%
    assert noisy["repeat_medians_tokens_per_s_per_gpu"] == [1000, 250]
    rec = results["recommendation"]
    assert rec["params"] == {"flops": str(100 * T)} and rec["confident"] is False
    assert len(rec["doubts"]) == 1 and rec["doubts"][0].startswith(f"flops={101 * T}: its repeats (25.25-101) overlap")
    assert [w for w in results["warnings"] if "spread" in w] == [
        f"flops={101 * T}: the medians of its 2 repeats spread 120.0% (25.25-101 corrected TFLOP/s/GPU), more than "
        "the 3% tolerance: noise, not the setting, may decide; add repeats"]
    assert "not confident: noise could have changed the choice" in stdout and "--repeats 4 with the same --out" in stdout
    assert re.search(r"^flops +ok +spread \(%\)", stdout, re.M) and "120.0 !" in stdout
    assert "120.0%" in err
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["spread_percent"], r["repeat_medians_tflops_per_gpu"]) for r in rows] == [
        ("0.0", "100 100"), (str(noisy["spread_percent"]), "101 25.25")]


def test_confidence_rules() -> None:
    from megatron_flops.reporting.runs import Candidate, doubts, recommend

    def c(index: int, *values: float) -> Candidate:
        return Candidate(index=index, params={"x": str(index)}, all_ok=True, value=statistics.median(values),
                         repeat_values=values)

    # Quiet: every range apart from the fastest's, every in-band spread within 3%.
    quiet = [c(0, 100, 101), c(1, 90, 92), c(2, 99, 100.5)]
    rec = recommend(quiet, tolerance=0.03)
    assert rec is not None and rec.chosen.index == 0 and doubts(quiet, rec) == []
    # In the band but spreading 10.5% (101 and 112.2, median 106.6): noise could decide.
    noisy = [c(0, 100, 100), c(1, 101, 112.2)]
    rec = recommend(noisy, tolerance=0.03)
    assert rec is not None and rec.fastest.index == 1
    assert doubts(noisy, rec) == ["x=1: its repeats spread 10.5% (more than the 3% tolerance)"]
    # One repeat each: spread 0 (noise unmeasured; the text output says so), no doubt.
    single = [c(0, 100), c(1, 90)]
    rec = recommend(single, tolerance=0.03)
    assert rec is not None and single[0].spread == 0 and doubts(single, rec) == []
