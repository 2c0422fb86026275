"""Validated reading of user input (stdlib only): JSON/YAML documents with one-line errors and a
nesting limit, short one-line reprs for messages, and typed reads of a source's fields that name
each field as that source spells it."""

from __future__ import annotations

import difflib
import json
import os
import reprlib
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Nesting deeper than this in a model or rows file is malformed (and would exhaust recursion).
MAX_NESTING = 32
MAX_FILE_BYTES = 16 * 2**20
# PyYAML parses ~0.1-1 MiB/s: a larger YAML file would take longer than a user waits.
MAX_YAML_BYTES = 2**20
# Nodes of a YAML document counted with every alias expanded, beyond the text's length: aliases
# that multiply the document past this (an alias bomb) are refused before it is built.
MAX_YAML_EXPANSION = 2**16

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = 6
_SHORT.maxlevel = 2
_SHORT.maxlong = 40


def show(value: Any) -> str:
    """A short, always one-line ``repr`` of a user value for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        return _SHORT.repr(value).replace("\n", " ")
    except ValueError:  # an integer past Python's digit limit inside a container
        return f"a {type(value).__name__}"


def parse_document(text: str, *, name: str, yaml_format: bool = False) -> Any:
    """Parse JSON (or YAML) text; every failure is one ``ValueError`` line naming ``name``, and
    nesting deeper than :data:`MAX_NESTING` is refused."""
    if yaml_format:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{name}: YAML files need PyYAML: pip install 'megatron-flops[yaml]'") from None
        try:
            data = _load_yaml(yaml, text, name)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{name}: invalid YAML{where}: {exc.problem or exc.context}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{name}: invalid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        except RecursionError:
            raise ValueError(f"{name}: nested deeper than {MAX_NESTING} levels") from None
        except _Refused:
            raise
        except ValueError as exc:  # an integer past Python's digit limit
            raise ValueError(f"{name}: invalid YAML: {str(exc).splitlines()[0]}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        except RecursionError:
            raise ValueError(f"{name}: nested deeper than {MAX_NESTING} levels") from None
        except ValueError as exc:  # an integer past Python's digit limit
            raise ValueError(f"{name}: invalid JSON: {str(exc).split(';')[0]}") from None
    check_nesting(data, name)
    return data


class _Refused(ValueError):
    """A document refused before it is built (its message names the file)."""


def _load_yaml(yaml: Any, text: str, name: str) -> Any:
    """``yaml.safe_load(text)``, but the node graph is checked before any object is built: nesting
    past :data:`MAX_NESTING` and aliases that expand it past :data:`MAX_YAML_EXPANSION` nodes
    more than the text's length are refused without expanding them."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(yaml, node, name, limit=len(text) + MAX_YAML_EXPANSION)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_nodes(yaml: Any, root: Any, name: str, *, limit: int) -> None:
    stack, count = [(root, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > limit:
            raise _Refused(f"{name}: YAML aliases expand to more than {limit:,} nodes (an alias bomb?)")
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            continue
        if depth >= MAX_NESTING:
            raise _Refused(f"{name}: nested deeper than {MAX_NESTING} levels")
        stack.extend((child, depth + 1) for child in children)


def read_text(path: str | Path, *, what: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; one ``ValueError`` line naming
    the file otherwise. A FIFO, a device (``/dev/zero``) or a directory is refused before anything
    is read (a FIFO is opened without waiting for a writer)."""
    shown = repr(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise ValueError(f"cannot read {what} {shown}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {shown} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{what} {shown} is {info.st_size / 2**20:.1f} MiB; the limit is {limit / 2**20:g} MiB")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{what} {shown} is larger than the limit of {limit / 2**20:g} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {shown} is not UTF-8 text (byte {exc.start})") from None


def read_document(path: str | Path, *, what: str) -> Any:
    """Read a JSON or YAML (``.yaml``/``.yml``) file of at most :data:`MAX_FILE_BYTES`
    (:data:`MAX_YAML_BYTES` for YAML)."""
    path = Path(path)
    yaml_format = path.suffix in (".yaml", ".yml")
    text = read_text(path, what=what, limit=MAX_YAML_BYTES if yaml_format else MAX_FILE_BYTES)
    return parse_document(text, name=path.name, yaml_format=yaml_format)


def check_nesting(data: Any, name: str) -> None:
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            if depth >= MAX_NESTING:
                raise ValueError(f"{name}: nested deeper than {MAX_NESTING} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


class Fields:
    """Typed reads of one source's fields; errors name each field as the source spells it."""

    def __init__(self, fields: Mapping[str, Any], source: str, names: Mapping[str, str]) -> None:
        self.fields, self.source, self.names = fields, source, names

    def name(self, key: str) -> str:
        return self.names.get(key, key)

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def integer(self, key: str, *, minimum: int = 1, default: int | None = None) -> int:
        value = self.fields.get(key)
        if value is None:
            if default is None:
                raise self.missing([key])
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{self.name(key)!r} must be an integer, got {show(value)}")
        if value < minimum:
            raise self.error(f"{self.name(key)!r} must be >= {minimum}, got {value}")
        return value

    def missing(self, keys: list[str]) -> ValueError:
        """Required keys absent; a key of the file that is a near miss of one is named as a typo."""
        present = [k for k in self.fields if isinstance(k, str)]
        parts = []
        for key in map(self.name, keys):
            close = difflib.get_close_matches(key, present, n=1, cutoff=0.8)
            parts.append(repr(key) + (f" (the file has {close[0]!r}: a typo?)" if close else ""))
        return self.error(f"missing required key(s) {', '.join(parts)}")

    def opt_integer(self, key: str, *, minimum: int = 1) -> int | None:
        return None if self.fields.get(key) is None else self.integer(key, minimum=minimum)

    def boolean(self, key: str, default: bool = False) -> bool:
        value = self.fields.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"{self.name(key)!r} must be true or false, got {show(value)}")
        return value
