"""Helpers the ``estimate`` command and its DiT part share: list arguments and the component table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_flops.model.inputs import MAX_FILE_BYTES, parse_document, read_document, show


def json_list_arg(flag: str, value: str) -> Any:
    """A JSON list given inline, or a JSON/YAML file holding one."""
    text = value.strip()
    if text.startswith(("[", "{")):
        if len(text) > MAX_FILE_BYTES:
            raise ValueError(f"{flag}: longer than {MAX_FILE_BYTES // 2**20} MiB")
        return parse_document(text, name=flag)
    if not Path(value).is_file():
        raise ValueError(f"{flag}: {show(value)} is neither a JSON list nor a readable file")
    return read_document(value, what=f"{flag} file")


def format_components(components: dict[str, int], total: int) -> list[str]:
    lines = [f"{'component':<24}{'FLOPs (fwd+bwd)':>26}{'share':>9}"]
    for name, value in components.items():
        lines.append(f"{name:<24}{value:>26,}{value / total:>9.1%}")
    lines.append(f"{'total':<24}{total:>26,}")
    return lines
