"""Reliability of the trace writer, ``compare``, ``sweep`` and model-file reading (issue 20).

Each test here failed before its fix. The accounting never raises into, blocks or desynchronises
training; every CLI input ends in exit 0 or exit 2 with one line naming the file or flag; no
printed number is NaN or infinite; two writers or two sweeps on one path are refused. Nothing
here depends on a wall-clock limit that a slow machine could miss: fake commands and fake clocks.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_train import alive, header, step, wait_for

from megatron_flops.tracking.result import StepResult
from megatron_flops.reporting.session import Session, install_session, uninstall_session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.reporting.trace import TraceWriter
from megatron_flops.tracking.tracker import FlopsTracker

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C's default disposition, whatever the test process inherited
    (Python installs its KeyboardInterrupt handler only where SIGINT is not ignored at start-up)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tracker() -> FlopsTracker:
    return FlopsTracker(ModelSpec.from_mapping(MODEL), seq_length=16)


def _header() -> dict:
    return {"format": "megatron-flops-trace/1", "world_size": 1}


# ---- the trace writer ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["directory", "under a file", "disk full", "fifo"])
def test_a_trace_that_cannot_be_written_installs_the_session_anyway(tmp_path, caplog, where):
    # Before: install_session raised on the writing rank only (the other ranks then met the
    # framework's collective with their reduction), or waited forever for a FIFO's reader. Now it
    # warns and installs the session.
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    path = {"directory": tmp_path, "under a file": tmp_path / "file" / "trace.jsonl", "disk full": "/dev/full",
            "fifo": tmp_path / "fifo"}[where]
    if where == "disk full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        session = install_session(_tracker(), world_size=1, peak_flops_per_s=10**15, trace=path)
    try:
        assert session.trace is None
        assert [r.getMessage() for r in caplog.records if "no per-step trace" in r.getMessage()]
    finally:
        uninstall_session()


def test_a_second_writer_on_one_trace_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    first = TraceWriter(path, _header())
    try:
        before = path.read_text()
        with pytest.raises(ValueError, match="being written by another run"):
            TraceWriter(path, _header())
        assert path.read_text() == before  # the refused writer wrote nothing
    finally:
        first.close()
    TraceWriter(path, _header()).close()  # free again once the first closed
    headers = [json.loads(line)["run"] for line in path.read_text().splitlines()]
    assert len({h["run_id"] for h in headers}) == 2


def test_reinstalling_a_session_on_the_same_trace_reuses_the_file(tmp_path):
    path = tmp_path / "t.jsonl"
    install_session(_tracker(), world_size=1, peak_flops_per_s=10**15, trace=path)
    session = install_session(_tracker(), world_size=1, peak_flops_per_s=10**15, trace=path)
    try:
        assert session.trace is not None  # the previous session let go of the file first
    finally:
        uninstall_session()


class _SlowTrace:
    """A trace whose every write takes 5 s of the session's (fake) clock."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.lines: list[float] = []

    def write_step(self, *, elapsed_s: float, **_: object) -> None:
        self.clock[0] += 5.0
        self.lines.append(elapsed_s)

    def close(self) -> None:
        pass


def test_the_trace_line_is_written_before_the_step_clock_starts():
    # Each step takes 1 s of the fake clock; writing the previous step's line takes 5 s. Before:
    # the write ran after the clock started, so steps 2.. read 6 s.
    now = [0.0]
    trace = _SlowTrace(now)
    session = Session(_tracker(), peak_flops_per_s=10**15, warmup_iterations=0, world_size=1,
                      clock=lambda: now[0], trace=trace)  # type: ignore[arg-type]
    result = StepResult(flops=10, executed_flops=10, num_tokens=4, num_padded_tokens=4, num_sequences=1,
                        sum_seqlen_squared=16, num_microbatches=1)
    session.tracker.end_step = lambda **_: result  # type: ignore[method-assign]
    for _ in range(4):
        session.begin_step()
        now[0] += 1.0
        session.end_step()
    session.close()
    assert trace.lines == [1.0, 1.0, 1.0, 1.0]


# ---- model files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1e308, float("inf"), float("nan"), -1.0])
def test_a_vision_mlp_ratio_out_of_range_names_the_field(ratio):
    from megatron_flops.flops.vision import VisionSpec

    config = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=2, mlp_ratio=ratio)
    with pytest.raises(ValueError, match="mlp_ratio"):
        VisionSpec.from_hf_vision_config("qwen2_vl", config)


# 342 bytes: 9 levels of 9 aliases, 9^9 (387 million) strings once expanded.
ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=100)


def _cli(*argv: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, so that a hang fails the test (a generous bound) instead of the run."""
    return subprocess.run([sys.executable, "-m", "megatron_flops", *argv], capture_output=True, text=True,
                          timeout=180, stdin=stdin)


def _one_line_error(proc: subprocess.CompletedProcess, *names: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    err = proc.stderr
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, err
    return err


def test_a_yaml_alias_bomb_is_refused_without_expanding(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    model = tmp_path / "model.json"
    model.write_text(json.dumps(LLAMA))
    _one_line_error(_cli("estimate", "--model", str(bomb), "--seq-length", "16"), "bomb.yaml", "alias")
    _one_line_error(_cli("memory", "--model", str(bomb), "--seq-length", "16"), "bomb.yaml", "alias")
    _one_line_error(_cli("estimate", "--model", str(model), "--seqlens", str(bomb)), "bomb.yaml", "alias")
    with pytest.raises(ValueError, match="alias"):
        FlopsTracker.from_model_file(bomb)


def test_a_self_referencing_yaml_alias_is_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [*a]\n")
    _one_line_error(_cli("estimate", "--model", str(loop), "--seq-length", "16"), "loop.yaml", "nested")


def test_yaml_anchors_that_do_not_multiply_still_load(tmp_path):
    model = tmp_path / "model.yaml"
    model.write_text("num_layers: 2\nhidden_size: &h 64\nnum_attention_heads: 4\nffn_hidden_size: *h\n"
                     "vocab_size: 100\n")
    assert FlopsTracker.from_model_file(model).spec.ffn_hidden_size == 64


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "fifo", "directory"])
def test_a_model_file_that_is_not_a_regular_file_is_refused_before_reading(tmp_path, device):
    if device == "fifo":
        path = str(tmp_path / "model.json")
        os.mkfifo(path)  # nobody writes it: opening it for reading the usual way waits forever
    elif device == "directory":
        path = str(tmp_path)
    else:
        path = device
        if not os.path.exists(path):
            pytest.skip(f"no {path}")
    _one_line_error(_cli("estimate", "--model", path, "--seq-length", "16"), path, "not a regular file")
    _one_line_error(_cli("memory", "--model", path, "--seq-length", "16"), path, "not a regular file")
    _one_line_error(_cli("estimate", "--megatron-args", path), path, "not a regular file")


# ---- compare ---------------------------------------------------------------------------------------


def _lines(*objs: dict) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def _compare(capsys, tmp_path: Path, text: str | bytes, *flags: str) -> tuple[int, str, str]:
    from megatron_flops.cli import main

    path = tmp_path / "t.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    rc = main(["compare", str(path), *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _compare_error(capsys, tmp_path: Path, text: str | bytes, *flags: str) -> str:
    rc, _, err = _compare(capsys, tmp_path, text, *flags)
    assert rc == 2 and err.count("\n") == 1 and "t.jsonl" in err, err
    return err


def test_two_runs_interleaved_in_one_trace_are_refused_not_pooled(capsys, tmp_path):
    # Run A (1 s/step) and run B (4 s/step) append to one file at once. Before: one segment with
    # every iteration twice, median 2.5 s.
    a, b = header(warmup=0), header(warmup=0)
    text = _lines(a, b, *[step(i, flops=10**12, tokens=1, elapsed_s=e) for i in range(1, 6) for e in (1.0, 4.0)])
    assert "iteration 1 after 1" in _compare_error(capsys, tmp_path, text)


@pytest.mark.parametrize("iterations", [(1, 2, 2, 3), (1, 3, 2, 4)])
def test_repeated_or_backwards_iterations_in_one_segment_are_refused(capsys, tmp_path, iterations):
    text = _lines(header(warmup=0), *[step(i, flops=1, tokens=1, elapsed_s=1.0) for i in iterations])
    assert "line 4" in _compare_error(capsys, tmp_path, text)


def test_a_restart_still_pools_its_segments(capsys, tmp_path):
    text = _lines(header(warmup=0), *[step(i, flops=1, tokens=1, elapsed_s=1.0) for i in (1, 2)],
                  header(warmup=0), *[step(i, flops=1, tokens=1, elapsed_s=1.0) for i in (2, 3)])
    assert _compare(capsys, tmp_path, text)[0] == 0


OK_STEP = step(1, flops=10**12, tokens=1, elapsed_s=1.0)
BAD_LINES = {
    "integer past float range": _lines(header(warmup=0), {**OK_STEP, "flops": 10**400}),
    "integer past int64": _lines(header(warmup=0), {**OK_STEP, "num_tokens": 2**63}),
    "integer past the digit limit": _lines(header(warmup=0)) + '{"iteration": 1, "flops": ' + "9" * 5000 + "}\n",
    "deeply nested": _lines(header(warmup=0)) + "[" * 100_000 + "]" * 100_000 + "\n",
    "NaN elapsed": _lines(header(warmup=0)) + json.dumps({**OK_STEP, "elapsed_s": float("nan")}) + "\n",
    "Infinity elapsed": _lines(header(warmup=0)) + json.dumps({**OK_STEP, "elapsed_s": float("inf")}) + "\n",
    "denormal elapsed": _lines(header(warmup=0), {**OK_STEP, "elapsed_s": 5e-324}),
    "NaN peak": json.dumps({"run": {**header(warmup=0)["run"], "peak_flops_per_s": float("nan")}}) + "\n" + _lines(OK_STEP),
    "Infinity peak": json.dumps({"run": {**header(warmup=0)["run"], "peak_flops_per_s": float("inf")}}) + "\n"
                     + _lines(OK_STEP),
    "denormal peak": _lines({"run": {**header(warmup=0)["run"], "peak_flops_per_s": 5e-324}}, OK_STEP),
    "not UTF-8": _lines(header(warmup=0)).encode() + b"\xff\xfe\n",
}


@pytest.mark.parametrize("case", BAD_LINES)
@pytest.mark.parametrize("as_json", [False, True])
def test_compare_refuses_numbers_that_are_not_measurements(capsys, tmp_path, case, as_json):
    _compare_error(capsys, tmp_path, BAD_LINES[case], *(["--json"] if as_json else []))


@pytest.mark.parametrize("peak", ["nan", "inf", "1e300", "-1", "0"])
def test_compare_refuses_a_peak_that_is_not_finite(capsys, tmp_path, peak):
    rc, _, err = _compare(capsys, tmp_path, _lines(header(warmup=0), OK_STEP), "--peak-tflops", peak)
    assert rc == 2 and "--peak-tflops" in err


def test_compare_output_is_finite_json(capsys, tmp_path):
    text = _lines({"run": {**header(warmup=0)["run"], "peak_flops_per_s": 10**15}},
                  *[step(i, flops=10**12, tokens=1, elapsed_s=1e-290) for i in (1, 2)])
    rc, out, err = _compare(capsys, tmp_path, text, "--json")
    assert rc == 0, err
    json.loads(out, parse_constant=lambda token: pytest.fail(f"{token} in the JSON"))


def test_compare_bounds_what_it_reads(capsys, tmp_path):
    from megatron_flops.cli import main
    from megatron_flops.reporting.runs import MAX_TRACE_BYTES

    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)  # sparse: nothing is written
    assert main(["compare", str(big)]) == 2
    assert "big.jsonl" in capsys.readouterr().err
    half = tmp_path / "half.jsonl"
    with open(half, "wb") as f:
        f.truncate(MAX_TRACE_BYTES // 2 + 1)
    assert main(["compare", str(half), str(half)]) == 2
    assert "compare reads at most" in capsys.readouterr().err
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    proc = _cli("compare", str(fifo))
    _one_line_error(proc, "fifo.jsonl", "not a regular file")


@pytest.mark.parametrize("argv", [["compare", "{trace}", "--json"], ["memory", "--model", "{model}", "--seq-length", "16"],
                                  ["estimate", "--model", "{model}", "--seq-length", "16", "--batch-size", "1"]])
def test_a_closed_stdout_ends_quietly(tmp_path, argv):
    # `... | head -1`: the reader is gone before the output is written. Before: a BrokenPipeError traceback.
    trace = tmp_path / "t.jsonl"
    trace.write_text(_lines(header(warmup=0), *[step(i, flops=10**12, tokens=1, elapsed_s=1.0) for i in (1, 2)]))
    model = tmp_path / "model.json"
    model.write_text(json.dumps(LLAMA))
    argv = [a.format(trace=trace, model=model) for a in argv]
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_flops", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=180)
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


# ---- sweep -----------------------------------------------------------------------------------------

FAKE = str(Path(__file__).with_name("fake_train.py"))
ROOT = Path(__file__).resolve().parent.parent


def _sweep(capsys, *args: str) -> tuple[int, str, str]:
    from megatron_flops.cli import main

    code = main(["sweep", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_sweep_modules_import_one_way():
    import ast

    for name in ("sweep_results", "sweep_files", "sweep_plan", "plot", "compare"):
        tree = ast.parse((ROOT / "megatron_flops" / "cli" / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "megatron_flops.cli.sweep" not in imported, name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_sweep_on_a_running_sweeps_out_is_refused(tmp_path, capsys):
    import signal

    out = tmp_path / "sw"
    args = ["--param", "mode=hang", "--timeout", "600", "--out", str(out), "--", sys.executable, FAKE, "--mode", "{mode}"]
    first = subprocess.Popen(  # (Ctrl-C as a user's terminal delivers it)
        preexec_fn=_sigint_default, args=[sys.executable, "-m", "megatron_flops", "sweep", *args], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = out / "000_mode-hang" / "r1" / "log.txt"
        wait_for(lambda: log.exists() and "hanging" in log.read_text(), "the first sweep's run to hang")
        code, _, err = _sweep(capsys, *args)
        assert code == 2 and "is in use by another sweep" in err and str(out) in err, err
        assert "hanging" in log.read_text()  # before: the second sweep deleted the running run's folder
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130


def test_sweep_out_problems_are_one_line_naming_the_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    cmd = ["--", sys.executable, FAKE, "--mode", "{mode}"]
    code, _, err = _sweep(capsys, "--param", "mode=ok", "--out", str(tmp_path / "file" / "sw"), *cmd)
    assert code == 2 and err.count("\n") == 1 and "--out" in err, err
    out = tmp_path / "sw"
    assert _sweep(capsys, "--param", "mode=ok", "--out", str(out), *cmd)[0] == 0
    record = out / "000_mode-ok" / "r1" / "run.json"
    for bad in ("{not json", "[]", json.dumps({"returncode": "0", "timed_out": False, "wall_s": 1.0})):
        record.write_text(bad)
        code, _, err = _sweep(capsys, "--param", "mode=ok", "--out", str(out), *cmd)
        assert code == 2 and err.count("\n") == 1 and "run.json" in err, err
    record.unlink()
    for bad in ("{not json", "[1]", "NaN"):
        (out / "sweep.json").write_text(bad)
        code, _, err = _sweep(capsys, "--param", "mode=ok", "--out", str(out), *cmd)
        assert code == 2 and err.count("\n") == 1 and "sweep.json" in err, err


@pytest.mark.parametrize("plot, message", [("missing/p.png", "does not exist"), ("p", "name a file ending in"),
                                           (".", "is a directory"), ("p.nope", "name a file ending in")])
def test_the_plot_destination_is_checked_before_any_run(tmp_path, capsys, monkeypatch, plot, message):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    code, _, err = _sweep(capsys, "--param", "mode=ok", "--out", "sw", "--plot", plot,
                          "--", sys.executable, FAKE, "--mode", "{mode}")
    assert code == 2 and message in err and "--plot" in err, err
    assert not (tmp_path / "sw").exists()  # no run started
    trace = tmp_path / "t.jsonl"
    trace.write_text(_lines(header(warmup=0), OK_STEP))
    from megatron_flops.cli import main

    assert main(["compare", str(trace), "--plot", plot]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"),
                                            (["--repeats", str(10**9)], "--repeats"),
                                            (["--param", "b=" + ",".join(map(str, range(20_000)))], "combinations")])
def test_sweep_bounds_its_inputs(tmp_path, capsys, flags, message):
    command = ["--", "x", "{a}"] + (["{b}"] if "b=0,1" in " ".join(flags) else [])
    code, _, err = _sweep(capsys, "--param", "a=1", *flags, "--out", str(tmp_path / "sw"), *command)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_brace_is_escaped_by_doubling_it():
    from megatron_flops.cli.sweep import check_command, plan

    command = ["echo", "{{a}", "{a}", "${HOME}", "{{", "}}"]
    check_command(command, {"a": ["1"]})
    assert plan({"a": ["1"]}, 1)[0].argv(command, Path("."))[1:] == ["{a}", "1", "${HOME}", "{", "}}"]


def test_oom_needs_a_real_out_of_memory_signature(tmp_path, capsys, monkeypatch):
    from megatron_flops.cli import sweep

    out = tmp_path / "sw"
    code, _, _ = _sweep(capsys, "--param", "mode=banner,killed,oom", "--out", str(out),
                        "--", sys.executable, FAKE, "--mode", "{mode}")
    statuses = {r["params"]["mode"]: (r["status"], r["reason"])
                for r in json.loads((out / "results.json").read_text())["runs"]}
    assert statuses["banner"] == ("failed", "exit code 1")  # before: oom, from the hint's words
    assert statuses["killed"] == ("failed", "killed by SIGKILL")
    assert statuses["oom"][0] == "oom"
    # A SIGKILL while the kernel's out-of-memory killer counted a kill: oom.
    counts = iter(range(100))
    monkeypatch.setattr(sweep, "oom_kill_count", lambda: next(counts))
    code, _, _ = _sweep(capsys, "--param", "mode=killed", "--out", str(tmp_path / "sw2"),
                        "--", sys.executable, FAKE, "--mode", "{mode}")
    run = json.loads((tmp_path / "sw2" / "results.json").read_text())["runs"][0]
    assert (run["status"], run["reason"]) == ("oom", "killed by SIGKILL by the kernel's out-of-memory killer")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_ctrl_c_kills_a_run_that_ignores_sigterm(tmp_path):
    import signal

    out = tmp_path / "sw"
    sweep = subprocess.Popen(  # (Ctrl-C as a user's terminal delivers it)
        preexec_fn=_sigint_default, args=[sys.executable, "-m", "megatron_flops", "sweep", "--param", "mode=stubborn",
                              "--timeout", "600", "--out", str(out), "--", sys.executable, FAKE, "--mode", "{mode}"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = out / "000_mode-stubborn" / "r1" / "log.txt"
        wait_for(lambda: log.exists() and "child ready" in log.read_text(), "the run to start its child")
        pids = [int(p) for p in log.read_text().split("stubborn ")[1].split()[:2]]
        sweep.send_signal(signal.SIGINT)
        # The sweep is now in its 10 s SIGTERM grace period, which the run ignores.
        wait_for(lambda: "SIGTERM ignored" in log.read_text(), "the run to ignore SIGTERM")
        sweep.send_signal(signal.SIGINT)
        sweep.communicate(timeout=120)
    finally:
        sweep.kill()
    assert sweep.returncode == 130
    for pid in pids:  # before: both outlived the sweep
        wait_for(lambda: not alive(pid), f"pid {pid} to be gone", timeout_s=60)
