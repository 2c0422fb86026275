"""Validated reading of user input (stdlib only): JSON/YAML documents with one-line errors and a
nesting limit, short one-line reprs for messages, and typed reads of a source's fields that name
each field as that source spells it."""

from __future__ import annotations

import difflib
import json
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Nesting deeper than this in a model or rows file is malformed (and would exhaust recursion).
MAX_NESTING = 32
MAX_FILE_BYTES = 16 * 2**20

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
            data = yaml.safe_load(text)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{name}: invalid YAML{where}: {exc.problem or exc.context}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{name}: invalid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        except RecursionError:
            raise ValueError(f"{name}: nested deeper than {MAX_NESTING} levels") from None
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


def read_document(path: str | Path, *, what: str) -> Any:
    """Read a JSON or YAML (``.yaml``/``.yml``) file of at most :data:`MAX_FILE_BYTES`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{what} {str(path)!r} is {size / 2**20:.0f} MiB; the limit is "
                             f"{MAX_FILE_BYTES // 2**20} MiB")
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text") from None
    return parse_document(text, name=path.name, yaml_format=path.suffix in (".yaml", ".yml"))


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
