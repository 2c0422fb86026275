"""Every fenced code block in README.md and docs/*.md runs as written (or says why not).

A block is checked by its kind, or by a marker: an HTML comment (invisible when rendered) on the
line right before its fence, indented like the fence:

- ``<!-- docs-test: skip (REASON) -->``: not run (it installs packages, needs a GPU cluster or a
  framework this machine lacks, or is an excerpt); a ``python`` block is still compiled.
- ``<!-- docs-test: output-varies -->``: run as an unmarked console block, but its output is
  compared with every number masked and runs of spaces collapsed (times and rates).
- ``<!-- docs-test: checked by tests/FILE.py::TEST -->``: that test runs it (it must exist).

Unmarked blocks:

- ``python``: run as a script in a subprocess, from a temporary directory holding a link to
  ``examples/``; it must exit 0.
- a console block, whose first line is ``$ COMMAND`` (``megatron-flops ...`` or ``python ...``,
  continued over lines ending in ``\\``): run from the same kind of directory; its output, stdout
  and stderr as a terminal shows them, must be the block's lines after the command, where a line
  ``...`` stands for any number of lines and ``...`` within a line for any text.
- anything else fails, so that a new block is either runnable or says why it is not.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^ *<!-- docs-test: (?P<kind>skip|output-varies|checked by)(?: (?P<arg>.+?))? -->$")
TIMEOUT_S = 300  # per block: the demo trains for ~10-20 s on a shared 2-core machine


@dataclass(frozen=True, kw_only=True)
class Block:
    document: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    text: str  # without the fence's indentation
    marker: str | None
    arg: str | None

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the marker on the line before it."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence)
        marker = MARKER.match(lines[i - 1]) if i else None
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        blocks.append(Block(document=str(path.relative_to(ROOT)), line=i + 1, lang=opening["lang"],
                            text="\n".join(body) + "\n", marker=marker and marker["kind"],
                            arg=marker and marker["arg"]))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in read_blocks(path)]


def test_markers_are_well_formed() -> None:
    # A comment naming docs-test that the test would not read (a typo, a marker away from its
    # fence) fails rather than leaving its block unchecked.
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "docs-test" in line and line.lstrip().startswith("<!--"):
                where = f"{path.name}:{i + 1}"
                marker = MARKER.match(line)
                assert marker, f"{where}: not a docs-test marker: {line.strip()}"
                assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{where}: a marker must precede a fence"
                assert (marker["kind"] == "output-varies") == (marker["arg"] is None), f"{where}: {line.strip()}"
                if marker["kind"] == "skip":
                    assert re.fullmatch(r"\(.+\)", marker["arg"]), f"{where}: skip needs a (reason)"


def test_blocks_are_found() -> None:
    # The parser sees the blocks: the README's set-up commands and the custom loop.
    assert len(BLOCKS) >= 20
    assert sum(b.document == "README.md" and b.lang == "bash" for b in BLOCKS) >= 4
    assert any(b.document == "docs/adapters.md" and "tracker.end_step(step=iteration)" in b.text for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.marker == "skip":
        if block.lang == "python":
            compile(block.text, block.name, "exec")
        return
    if block.marker == "checked by":
        _check_reference(block.arg or "")
        return
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    if block.lang == "python":
        (tmp_path / "snippet.py").write_text(block.text)
        done = _run([sys.executable, "snippet.py"], tmp_path)
        assert done.returncode == 0, f"{block.name} failed:\n{done.stdout[-4000:]}"
        return
    if not block.text.startswith("$ "):
        pytest.fail(f"{block.name}: a block the test cannot run (not python, no `$ command`): "
                    "make it runnable or mark it (see tests/test_docs.py)")
    for command, shown in _commands(block.text):
        done = _run(_argv(command, block.name), tmp_path)
        assert done.returncode == 0, f"{block.name}: `{command}` exited {done.returncode}:\n{done.stdout[-4000:]}"
        _compare(shown, done.stdout, masked=block.marker == "output-varies", name=block.name)


def test_ci_runs_the_readme_test_command() -> None:
    # The README's test command is what .ci/run runs, verbatim, and only that.
    commands = [b.text.strip() for b in BLOCKS if b.document == "README.md" and b.lang == "bash"]
    (test,) = [c for c in commands if "pytest" in c]
    run = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert [line for line in run if "pip install" in line or "pytest" in line] == [test]


def test_readme_set_up_comes_in_order() -> None:
    # Read top-down, the set-up works: the virtual environment first (an externally managed
    # Python refuses pip outside one), the optional CPU build of torch, then the two commands.
    commands = [b.text.strip() for b in BLOCKS if b.document == "README.md" and b.lang == "bash"]
    assert commands[0].startswith("python3 -m venv .venv && . .venv/bin/activate")
    assert "--index-url https://download.pytorch.org/whl/cpu" in commands[1]
    assert commands[2].endswith("megatron-flops demo") and commands[3].endswith("python -m pytest -q")


# ---- helpers -------------------------------------------------------------------------------


def _check_reference(reference: str) -> None:
    path, _, name = reference.partition("::")
    source = ROOT / path
    assert source.is_file() and f"def {name}(" in source.read_text(), f"no test {reference}"


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """Each ``$ command`` of a console block (continuation lines joined) with the lines shown after it."""
    found: list[tuple[str, list[str]]] = []
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command += "\n" + next(lines)
            found.append((command, []))
        else:
            found[-1][1].append(line)
    return found


def _argv(command: str, name: str) -> list[str]:
    # As a shell reads it: a backslash-newline continues the line, inside double quotes too.
    argv = shlex.split(command.replace("\\\n", ""))
    if argv[0] == "megatron-flops":
        return [sys.executable, "-m", "megatron_flops", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    pytest.fail(f"{name}: cannot run `{argv[0]}` (megatron-flops or python only)")


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_FLOPS")}
    return subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT_S)


NUMBER = re.compile(r"\d+(?:[.,:]\d+)*(?:[eE][-+]?\d+)?")


def _normal(line: str, masked: bool) -> str:
    line = line.rstrip()
    return re.sub(" +", " ", NUMBER.sub("0", line)) if masked else line


def _compare(shown: list[str], output: str, *, masked: bool, name: str) -> None:
    """The output equals the shown lines, ``...`` standing for any lines (a line of its own) or
    any text (within a line)."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line.strip() == "..." else ".*".join(map(re.escape, line.split("..."))) + r"\n"
        for line in (_normal(s, masked) for s in shown)
    )
    printed = "".join(_normal(line, masked) + "\n" for line in output.splitlines())
    if re.fullmatch(pattern, printed) is None:
        diff = difflib.unified_diff([_normal(s, masked) for s in shown], printed.splitlines(), "block", "output",
                                    lineterm="")
        pytest.fail(f"{name}: the output differs from the block (masked={masked}):\n" + "\n".join(diff))
