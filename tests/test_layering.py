"""Imports point only toward lighter modules: the pure layers load without torch or megatron,
and importing the package or its adapters patches and imports no framework."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["megatron_flops.model.spec", "megatron_flops.flops.formulas", "megatron_flops.flops.vision",
                                    "megatron_flops.reporting.peaks", "megatron_flops.reporting.meter", "megatron_flops.tracking.result",
                                    "megatron_flops.flops.passes", "megatron_flops.flops.dit", "megatron_flops.flops.dit_passes",
                                    "megatron_flops.model.hf_config", "megatron_flops.model.megatron_args",
                                    "megatron_flops.reporting.trace", "megatron_flops.reporting.runs", "megatron_flops.memory",
                                    "megatron_flops.cli.memory", "megatron_flops.cli"])
def test_pure_layers_import_without_torch(module):
    loaded = _modules_after(f"import {module}")
    assert "torch" not in loaded and not any(m.startswith("megatron.") for m in loaded)


def test_tracker_and_adapters_import_no_framework():
    loaded = _modules_after("import megatron_flops, megatron_flops.tracking.tracker, megatron_flops.reporting.session, "
                            "megatron_flops.tracking.dit_tracker, "
                            "megatron_flops.adapters.megatron_lm, megatron_flops.adapters.megatron_bridge")
    assert not any(m.startswith("megatron.") or m == "transformers" for m in loaded)


# The stages a number passes through, and what each may import (docs/architecture.md):
# model -> flops -> tracking -> reporting; memory beside flops; adapters, cli and demo on top.
ALLOWED = {
    "model": {"model"},
    "flops": {"model", "flops"},
    "memory": {"model", "flops", "memory"},
    "tracking": {"model", "flops", "tracking"},
    "reporting": {"model", "flops", "tracking", "reporting"},
}
PACKAGE = Path(__file__).resolve().parents[1] / "megatron_flops"


def _imports() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports (anywhere in its body)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("megatron_flops", *path.relative_to(PACKAGE).with_suffix("").parts))
        name = name.removesuffix(".__init__")
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_flops"):
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("megatron_flops"))
        found[name] = targets
    return {name: {t for t in targets if t in found and t not in ("megatron_flops", name)} for name, targets in found.items()}


def _stage(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_imports_point_one_way_through_the_stages():
    wrong = [f"{m} -> {t}" for m, targets in _imports().items() if _stage(m) in ALLOWED
             for t in targets if _stage(t) not in ALLOWED[_stage(m)]]
    assert not wrong, wrong


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles
