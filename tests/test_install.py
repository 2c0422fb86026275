"""The README's test command installs on a Linux GPU machine: the ``[test]`` extra resolves together
with PyPI's CUDA build of the pinned torch (whose own pins, ``triton`` and the ``nvidia-*``
packages, the extra must not contradict).

pip's resolver in dry-run mode, for a manylinux x86_64 wheel of this Python: nothing is installed,
and torch's metadata is read with HTTP range requests where pip can (``fast-deps``). ``torch===V``
(string equality) excludes local builds such as ``V+cpu``, so the resolver must take PyPI's. It
needs the package registry: where it cannot be reached the test skips and says so; under CI
(``CI=true``) it runs or fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Registry unreachable (not a resolution failure): then skip, except under CI.
OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                     r"Could not fetch URL|Network is unreachable|ConnectTimeout|ReadTimeout")


def pinned_torch() -> str:
    """The torch version the README's test command pins (``pip install torch==V && ...``)."""
    match = re.search(r"^pip install torch==(\S+) && pip install -e \"\.\[test\]\"", (ROOT / "README.md").read_text(), re.M)
    assert match, "README.md: no `pip install torch==V && pip install -e \".[test]\"` command"
    return match[1]


def requirements() -> list[str]:
    """The package's dependencies and its ``[test]`` extra, as pyproject.toml lists them."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["test"]]


def test_test_extra_pins_no_triton() -> None:
    # torch pins its triton (2.13.0: 3.7.1); a pin of ours made the CUDA build unresolvable.
    triton = [r for r in requirements() if re.match(r"triton\b", r)]
    assert triton and all(not re.search(r"[=<>~!]=?\s*\d", r.split(";")[0]) for r in triton), triton


def _resolve(args: list[str], fast_deps: bool) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
               *(["--use-feature=fast-deps"] if fast_deps else []), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=ROOT)


def test_test_extra_resolves_with_pypi_cuda_torch(tmp_path: Path) -> None:
    version = pinned_torch()
    tag = f"{sys.version_info.major}{sys.version_info.minor}"
    platforms = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)]
    args = ["--only-binary=:all:", "--target", str(tmp_path / "never-written"), *platforms,
            "--platform=manylinux2014_x86_64", f"--python-version={tag}", "--implementation=cp", f"--abi=cp{tag}",
            f"torch==={version}", *requirements()]
    done = _resolve(args, fast_deps=True)
    if done.returncode != 0 and "fast-deps" in done.stderr:  # a pip without the feature
        done = _resolve(args, fast_deps=False)
    if done.returncode != 0 and OFFLINE.search(done.stderr) and os.environ.get("CI") != "true":
        pytest.skip("the package registry cannot be reached (pip: "
                    + OFFLINE.search(done.stderr)[0] + "); run with network access, as CI does")
    assert done.returncode == 0, f"pip cannot resolve the [test] extra with PyPI's torch {version}:\n{done.stderr[-4000:]}"
    report = json.loads(done.stdout)
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
    assert chosen["torch"] == version  # PyPI's build, no local label
    assert "megatron-core" in chosen and "triton" in chosen, sorted(chosen)


# ---- the Megatron-LM snapshots ------------------------------------------------------------------


SCRIPT = ROOT / "scripts" / "get_megatron_lm_snapshots.sh"
TAGS = {"core_v0.16.1": ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron/training/__init__.py"),
        "core_v0.14.0": ("pretrain_gpt.py", "megatron/legacy/__init__.py", "megatron/inference/__init__.py"),
        "core_v0.19.0": ("pretrain_gpt.py", "hybrid_builders.py", "megatron/elastification/__init__.py")}


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_snapshot_script_extracts_every_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script on a stand-in for NVIDIA/Megatron-LM (a local repository with the three tags):
    each folder gets its listed files and the LICENSE, nothing else of the tree, and the tests
    find them through MEGATRON_FLOPS_MLM_SNAPSHOTS."""
    upstream = tmp_path / "Megatron-LM"
    for path in ["LICENSE", "README.md", "megatron/core/__init__.py", "tests/unit_tests/x.py", "mamba_builders.py",
                 "megatron/post_training/__init__.py", "megatron/rl/__init__.py",
                 *(p for files in TAGS.values() for p in files)]:
        (upstream / path).parent.mkdir(parents=True, exist_ok=True)
        (upstream / path).write_text(f"# {path}\n")
    _git("init", "-q", ".", cwd=upstream)
    _git("add", "-A", cwd=upstream)
    _git("commit", "-qm", "stand-in", cwd=upstream)
    for tag in TAGS:
        _git("tag", tag, cwd=upstream)
    dest = tmp_path / "snapshots"
    done = subprocess.run(["bash", str(SCRIPT), str(dest)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MEGATRON_LM_GIT_URL": upstream.as_uri()})
    assert done.returncode == 0, done.stderr
    for tag, files in TAGS.items():
        assert (dest / tag / "LICENSE").is_file() and all((dest / tag / f).is_file() for f in files), tag
        assert not (dest / tag / "megatron" / "core").exists() and not (dest / tag / "README.md").exists()
    assert sorted(p.name for p in dest.iterdir()) == sorted(TAGS)  # no partial folder left behind
    from frameworks import envs

    monkeypatch.setenv(envs.SNAPSHOTS_ENV, str(dest))
    assert envs.snapshot("0.16.1") == dest / "core_v0.16.1"
    monkeypatch.setenv(envs.SNAPSHOTS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(envs.Unavailable, match="scripts/get_megatron_lm_snapshots.sh"):
        envs.snapshot("0.16.1")


def test_snapshot_script_names_the_documented_commits() -> None:
    # The commits the script checks are those of the snapshots' README (where the developers have it).
    readme = ROOT.parent / "shared" / "upstream" / "megatron-lm" / "README.md"
    if not readme.is_file():
        pytest.skip(f"{readme} is not here")
    rows = dict(re.findall(r"^\| (core_v[\d.]+) \| core_v[\d.]+ \| ([0-9a-f]{40}) \|", readme.read_text(), re.M))
    script = SCRIPT.read_text()
    assert rows and all(f'"{tag} {commit} ' in script for tag, commit in rows.items()), rows
