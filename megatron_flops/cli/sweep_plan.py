"""One run of a sweep and the placeholders of its command: what ``sweep`` runs and
``sweep_results`` reads (both import this module; it imports neither).

A command's ``{NAME}`` is replaced by the value of ``--param NAME`` (or by the sweep's own
``{run_dir}`` and ``{trace}``); ``{{`` stands for a literal ``{``; ``${NAME}`` is left to a shell.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

BUILTINS = ("run_dir", "trace")  # placeholders the sweep fills in itself
# "{{" first, so that "{{x}" is a literal "{x}"; "${HOME}" is left to the shell.
_PLACEHOLDER = re.compile(r"\{\{|(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")


def placeholders(arg: str) -> list[str]:
    """The placeholder names in one argument of a command (escaped braces are none)."""
    return [m[1] for m in _PLACEHOLDER.finditer(arg) if m[1] is not None]


def substitute(arg: str, values: Mapping[str, str]) -> str:
    """``arg`` with every placeholder replaced and every ``{{`` made ``{``."""
    return _PLACEHOLDER.sub(lambda m: "{" if m[1] is None else values[m[1]], arg)


@dataclass(frozen=True, kw_only=True)
class Run:
    """One command to run: the combination's position in sweep order, its values, the repeat."""

    index: int
    params: Mapping[str, str]
    repeat: int
    dir: str  # relative to --out

    def argv(self, template: Sequence[str], out: Path) -> list[str]:
        values = {**self.params, "run_dir": str((out / self.dir).resolve()),
                  "trace": str((out / self.dir / "trace.jsonl").resolve())}
        return [substitute(arg, values) for arg in template]
