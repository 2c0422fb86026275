"""Seeded fault injection and fuzz of the trace writer, ``compare``, ``sweep`` and model-file
reading (issue 20). The counts here are the ones docs/reliability.md states.

Contracts: the session never raises whatever the trace file does; every CLI call ends in exit 0
or exit 2 with one line; no printed or JSON number is NaN or infinite.
"""

from __future__ import annotations

import errno
import json
import random
import re
import sys
from pathlib import Path

import pytest
from fake_train import header, step

from megatron_flops.cli import main
from megatron_flops.tracking.result import StepResult
from megatron_flops.reporting.runs import read_trace
from megatron_flops.reporting.session import Session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.reporting.trace import TraceWriter
from megatron_flops.tracking.tracker import FlopsTracker

FAKE = str(Path(__file__).with_name("fake_train.py"))
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=100)
WRITER_CASES = 200
COMPARE_CASES = 600
SWEEP_FILE_CASES = 150
SWEEP_FLAG_CASES = 300
MODEL_FILE_CASES = 300
_NOT_FINITE = re.compile(r"\b(?:nan|inf|infinity)\b", re.IGNORECASE)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except BaseException as exc:  # noqa: BLE001 - nothing may escape main()
        pytest.fail(f"{argv!r} raised {exc!r}")
    out = capsys.readouterr()
    assert rc in (0, 2), (argv, out.err)
    if rc == 2:
        assert out.err.count("\n") == 1 and out.err.startswith("megatron-flops") and "Traceback" not in out.err, (argv, out.err)
    return rc, out.out, out.err


# ---- the trace writer: a file that fails at any byte ----------------------------------------------


class _FailingFile:
    """A text file that writes ``budget`` characters, then fails (with ``error``; half of the
    failed writes torn), then may work again: a disk that fills up and frees up."""

    def __init__(self, real, budget: int, error: int, rng: random.Random) -> None:
        self.real, self.budget, self.error, self.rng = real, budget, error, rng

    def write(self, text: str) -> int:
        if self.budget >= len(text):
            self.budget -= len(text)
            return self.real.write(text)
        if self.budget > 0 and self.rng.random() < 0.5:
            self.real.write(text[: self.budget])  # a torn line
            self.real.flush()
        self.budget = 0 if self.rng.random() < 0.5 else 10**6  # the disk may free up again
        raise OSError(self.error, "injected")

    def flush(self) -> None:
        self.real.flush()
        if self.budget == 0 and self.rng.random() < 0.3:
            self.budget = 10**6 if self.rng.random() < 0.5 else 0
            raise OSError(self.error, "injected at flush")

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


def test_a_failing_trace_file_never_reaches_training(tmp_path):
    rng = random.Random(20261201)
    tracker = FlopsTracker(ModelSpec.from_mapping(MODEL), seq_length=16)
    result = StepResult(flops=10**9, executed_flops=10**9, num_tokens=16, num_padded_tokens=16, num_sequences=1,
                        sum_seqlen_squared=256, num_microbatches=1)
    tracker.end_step = lambda **_: result  # type: ignore[method-assign]
    for case in range(WRITER_CASES):
        path = tmp_path / f"{case}.jsonl"
        writer = TraceWriter(path, header(warmup=0)["run"])
        assert writer._file is not None
        writer._file = _FailingFile(writer._file, rng.randrange(0, 3000),
                                    rng.choice([errno.ENOSPC, errno.EIO, errno.EDQUOT]), rng)  # type: ignore[assignment]
        session = Session(tracker, peak_flops_per_s=10**15, warmup_iterations=0, world_size=1,
                          clock=iter(range(10**6)).__next__, trace=writer)
        for _ in range(rng.randint(1, 12)):  # nothing may raise into the loop
            session.begin_step()
            session.end_step()
        session.close()
        trace = read_trace(path)  # never a torn line mid-file: the writer stops at its first failure
        assert len(trace.segments) == 1, case


# ---- compare: mutated traces --------------------------------------------------------------------


def _trace_lines(rng: random.Random) -> list[str]:
    lines = [json.dumps({"run": {**header(warmup=rng.randint(0, 2))["run"], "peak_flops_per_s": 10**15}})]
    for i in range(1, rng.randint(2, 8)):
        lines.append(json.dumps(step(i, flops=rng.choice([1, 10**12, 2**62]), tokens=rng.randint(0, 10**6),
                                     elapsed_s=rng.choice([0.5, 1.0, 1e-9, 3.0]), ok=rng.random() < 0.9,
                                     static=rng.choice([None, 10**12]))))
    return lines


INJECT = ["NaN", "Infinity", "-Infinity", "1e999", "5e-324", "-1", "0", "2" * 30, "9" * 5000, "true", "null", '"1"',
          "[]", "{}", "[" * 3000 + "]" * 3000, '{"run": {}}', "1.5"]
KEYS = ["iteration", "flops", "executed_flops", "static_flops", "num_tokens", "elapsed_s", "ok", "world_size",
        "peak_flops_per_s", "warmup_iterations", "format"]


def _mutate_trace(rng: random.Random, lines: list[str]) -> bytes:
    lines = list(lines)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        if not lines:
            break
        op = rng.random()
        i = rng.randrange(len(lines))
        if op < 0.3:  # a field set to a hostile value (in the header or a step)
            key = rng.choice(KEYS)
            pattern = re.compile(rf'("{key}": )(?:[^,}}]+)')
            lines[i] = pattern.sub(lambda m: m[1] + rng.choice(INJECT), lines[i], count=1)
        elif op < 0.45:
            lines.insert(i, lines[rng.randrange(len(lines))])  # duplicated (a repeated iteration, a 2nd header)
        elif op < 0.55:
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif op < 0.65:
            del lines[i]
        elif op < 0.8:
            cut = rng.randrange(len(lines[i]) + 1)
            lines[i] = lines[i][:cut]
        else:
            lines.insert(i, rng.choice(INJECT))
    data = ("\n".join(lines) + ("\n" if rng.random() < 0.8 else "")).encode()
    if rng.random() < 0.05:
        k = rng.randrange(len(data) + 1)
        data = data[:k] + bytes([rng.randrange(128, 256)]) + data[k:]
    return data


def test_fuzzed_traces_exit_0_or_2_with_finite_numbers(tmp_path, capsys):
    rng = random.Random(20261202)
    outcomes = {0: 0, 2: 0}
    for case in range(COMPARE_CASES):
        paths = []
        for k in range(rng.choice([1, 1, 2])):
            path = tmp_path / f"t{k}.jsonl"
            path.write_bytes(_mutate_trace(rng, _trace_lines(rng)))
            paths.append(str(path))
        flags = rng.choice([[], ["--json"], ["--segments", "last"], ["--warmup", "0"], ["--peak-tflops", "1e-300"],
                            ["--peak-tflops", "nan"], ["--json", "--warmup", "1"]])
        rc, out, _ = _cli(capsys, "compare", *paths, *flags)
        outcomes[rc] += 1
        if rc == 0:
            if "--json" in flags:
                json.loads(out, parse_constant=lambda token: pytest.fail(f"case {case}: {token} in the JSON"))
            assert not _NOT_FINITE.search(out), (case, out)
    assert outcomes[0] > 50 and outcomes[2] > 100, outcomes


# ---- sweep: mutated files of a finished sweep, and fuzzed flags -------------------------------------


def test_fuzzed_sweep_files_exit_0_1_or_2(tmp_path, capsys):
    rng = random.Random(20261203)
    out = tmp_path / "sw"
    args = ["--param", "mode=ok,fail", "--out", str(out), "--", sys.executable, FAKE, "--mode", "{mode}"]
    assert main(["sweep", *args]) == 0
    capsys.readouterr()
    files = [out / "sweep.json", out / "000_mode-ok" / "r1" / "run.json", out / "001_mode-fail" / "r1" / "run.json",
             out / "000_mode-ok" / "r1" / "trace.jsonl"]
    originals = {path: path.read_bytes() for path in files}
    outcomes: dict[int, int] = {}
    for case in range(SWEEP_FILE_CASES):
        path = rng.choice(files)
        text = originals[path].decode()
        if path.suffix == ".jsonl":
            data = _mutate_trace(rng, text.splitlines())
        else:
            data = _mutate_trace(rng, [text.replace("\n", " ")]) if rng.random() < 0.7 else \
                json.dumps(rng.choice([[], 1, None, {"returncode": "0"}, {"returncode": 0, "timed_out": 0, "wall_s": 1},
                                       {"returncode": 0, "timed_out": False, "wall_s": float("inf")}])).encode()
        path.write_bytes(data)
        try:
            rc = main(["sweep", *args])
        except BaseException as exc:  # noqa: BLE001
            pytest.fail(f"case {case}: {path.name} = {data[:200]!r} raised {exc!r}")
        err = capsys.readouterr().err
        assert rc in (0, 1, 2), (case, err)
        if rc == 2:
            assert err.count("\n") == 1 and "Traceback" not in err, (case, err)
            assert path.name in err or str(out) in err, (case, path.name, err)
        outcomes[rc] = outcomes.get(rc, 0) + 1
        path.write_bytes(originals[path])
        for stale in out.glob("*/r1/run.json"):  # a run the sweep ran again is finished again: put it back
            if stale in originals:
                stale.write_bytes(originals[stale])
    assert outcomes.get(0, 0) > 20 and outcomes.get(2, 0) > 20, outcomes


FLAG_VALUES = {
    "--repeats": ["0", "1", "3", "-1", str(10**12), "x", "1e3"],
    "--timeout": ["0", "1", "nan", "inf", "-inf", "-1", "1e308", "x"],
    "--tolerance": ["0", "3", "99.9", "100", "nan", "-1", "inf"],
    "--warmup": ["0", "2", "-1", "x"],
    "--objective": ["tflops", "tokens", "mfu"],
    "--plot": ["p.png", "p", "missing/p.png", ".", "p.svg"],
}
PARAMS = ["mb=1,2", "mb=", "mb=1,,2", "mb=1,1", "1mb=1", "trace=1", "pp=1,2,4", "mb=" + ",".join(map(str, range(200))),
          "x=" + ",".join(map(str, range(5000))), "mb", "=1", "mb=a b,c;d", "mb={x}"]
COMMANDS = [["x", "{mb}"], ["x", "{mb}", "{pp}"], ["x"], [], ["x", "{{mb}", "{mb}"], ["bash", "-c", "echo {mb}"],
            ["x", "{mb}", "{trace}", "{run_dir}"], ["x", "${mb}", "{mb}"]]


def test_fuzzed_sweep_flags_exit_0_or_2(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    rng = random.Random(20261204)
    outcomes = {0: 0, 2: 0}
    for case in range(SWEEP_FLAG_CASES):
        argv = ["sweep", "--dry-run", "--out", f"sw{case}"]
        clean = rng.random() < 0.5  # a good sweep with at most one hostile flag
        for _ in range(1 if clean else rng.randint(0, 3)):
            argv += ["--param", PARAMS[0] if clean else rng.choice(PARAMS)]
        for flag in rng.sample(sorted(FLAG_VALUES), rng.randint(0, 1 if clean else 3)):
            argv += [flag, rng.choice(FLAG_VALUES[flag])]
        argv += ["--", *(COMMANDS[0] if clean else rng.choice(COMMANDS))]
        rc, _, _ = _cli(capsys, *argv)
        outcomes[rc] += 1
    assert outcomes[0] > 20 and outcomes[2] > 100, outcomes


# ---- model files: YAML with anchors and aliases, and bytes ------------------------------------------


def _yaml_case(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.2:  # a good file, anchors and aliases used the usual way
        return rng.choice(["", "# a comment\n"]) + "\n".join(f"{k}: &{k} {v}" for k, v in MODEL.items()) + "\n"
    if kind < 0.5:  # an alias bomb of random shape
        width, depth = rng.randint(2, 12), rng.randint(2, 12)
        text = f"l0: &l0 [{', '.join(['x'] * width)}]\n"
        text += "".join(f"l{d}: &l{d} [{', '.join(['*l' + str(d - 1)] * width)}]\n" for d in range(1, depth))
        return text + "\n".join(f"{k}: {v}" for k, v in MODEL.items()) + "\n"
    if kind < 0.55:  # anchors used a few times (fine), merge keys, a self-reference
        return rng.choice([
            "num_layers: &n 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 96\nvocab_size: 100\nx: *n\n",
            "base: &b {hidden_size: 64, num_attention_heads: 4}\nm:\n  <<: *b\n  num_layers: 2\n",
            "a: &a [*a]\n", "a: &a {b: *a}\n", "<<: [*x]\n", "&a [*a, *a]\n",
        ])
    text = "\n".join(f"{k}: {v}" for k, v in MODEL.items()) + "\n"
    for _ in range(rng.randint(1, 4)):  # byte-level damage
        k = rng.randrange(len(text) + 1)
        text = text[:k] + rng.choice(["&a ", "*a", "[", "{", ": ", "\t", "- ", "!!python/object:os.system ", "\x00",
                                      "!!binary ", "? ", "|", "%YAML 1.1\n", "---\n", "...\n"]) + text[k:]
    return text


def test_fuzzed_yaml_model_files_exit_0_or_2(tmp_path, capsys):
    rng = random.Random(20261205)
    outcomes = {0: 0, 2: 0}
    path = tmp_path / "model.yaml"
    for _ in range(MODEL_FILE_CASES):
        path.write_text(_yaml_case(rng))
        command = rng.choice([["estimate", "--model", str(path), "--seq-length", "16", "--batch-size", "1"],
                              ["memory", "--model", str(path), "--seq-length", "16"]])
        rc, out, _ = _cli(capsys, *command)
        outcomes[rc] += 1
        if rc == 0:
            assert not _NOT_FINITE.search(out), out
    assert outcomes[0] > 10 and outcomes[2] > 100, outcomes


def test_counts_are_the_documented_ones():
    text = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    for count in (WRITER_CASES, COMPARE_CASES, SWEEP_FILE_CASES, SWEEP_FLAG_CASES, MODEL_FILE_CASES):
        assert f"{count:,}" in text, count
