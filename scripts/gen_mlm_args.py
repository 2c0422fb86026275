"""Regenerate megatron_flops/model/_mlm_args.py from Megatron-LM's argument parser at every release tag.

Run: MEGATRON_FLOPS_TEST_VENVS=~/.cache/megatron-flops/venvs python scripts/gen_mlm_args.py
It reads each snapshot's ``megatron/training/arguments.py`` (``../shared/upstream/megatron-lm``) in
the framework tests' environment for that release (``tests/frameworks/envs.py``: megatron-core
0.16.1 here, the 0.14.0 and 0.19.0 venvs, made on first use), one subprocess per release
(``--dump``), and writes the union of the option tables (the output is committed).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RELEASES = ("0.14.0", "0.16.1", "0.19.0")  # oldest first


def dump() -> dict:
    """This interpreter's table: {options: {option: [dest, kind]}, defaults: {dest: value}, types: {dest: name}}."""
    warnings.filterwarnings("ignore")
    from megatron.training.arguments import add_megatron_arguments

    from megatron_flops.model.megatron_args import READ

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options: dict[str, tuple[str, str]] = {}
    defaults: dict[str, object] = {}
    types: dict[str, str] = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            options[option] = (action.dest, _kind(action, option))
        if action.dest in READ:
            default = action.default
            if isinstance(default, enum.Enum):  # --attention-backend: AttnBackend.auto, stored by its name
                default = default.name
            assert default is None or isinstance(default, (bool, int, float, str, list)), (action.dest, default)
            defaults[action.dest] = default
            types[action.dest] = _type_name(action)
    return {"options": options, "defaults": defaults, "types": types}


def _kind(action: argparse.Action, option: str) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "false" if option.startswith("--no-") else "true"
    if isinstance(action, argparse._StoreTrueAction):
        return "true"
    if isinstance(action, argparse._StoreFalseAction):
        return "false"
    if action.nargs in ("+", "*"):
        return "list"
    if isinstance(action.nargs, int):
        return str(action.nargs)
    if action.nargs is None:
        return "value"
    raise SystemExit(f"unhandled nargs {action.nargs!r} of {option}")


def _type_name(action: argparse.Action) -> str:
    if isinstance(action.default, enum.Enum):  # a name looked up in the enum (AttnBackend[...])
        return type(action.default).__name__
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        return "bool"
    if action.type in (int, float, str) or action.type is None:
        return (action.type or str).__name__
    return action.type.__name__  # moe_freq_type, tuple_type, ...


def table_of(version: str) -> dict:
    """Release ``version``'s table, dumped by a subprocess in its environment."""
    sys.path.insert(0, str(REPO / "tests"))
    from frameworks import envs

    env = envs.megatron_lm(version)
    path = os.pathsep.join(str(p) for p in (*env.pythonpath, REPO))
    done = subprocess.run([str(env.python), __file__, "--dump"], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": path})
    if done.returncode != 0:
        raise SystemExit(f"core_v{version}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _dict(items: dict, indent: str = "    ") -> str:
    return "{\n" + "".join(f"{indent}{k!r}: {v!r},\n" for k, v in sorted(items.items())) + indent[4:] + "}"


def write(tables: dict[str, dict]) -> None:
    from megatron_flops.model.megatron_args import READ

    tags = [f"core_v{v}" for v in RELEASES]
    options: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # the newest release's dest and kind
    kinds: dict[str, dict[int, str]] = {}  # option -> release index -> kind
    dests: set[str] = set()
    for index, version in enumerate(RELEASES):
        for option, (dest, kind) in tables[version]["options"].items():
            dests.add(dest)
            old_dest = options.get(option, (dest,))[0]
            if old_dest != dest and (old_dest in READ or dest in READ):
                raise SystemExit(f"{option}: dest {old_dest} in an older release, {dest} in core_v{version}")
            options[option] = (dest, kind, options.get(option, ("", "", ()))[2] + (index,))
            kinds.setdefault(option, {})[index] = kind
    # Where an older release takes another number of values (--rampup-batch-size): its kind. A
    # flag's stored value or a renamed dest that megatron-flops does not read (--norm-epsilon)
    # follows the newest release.
    flags = {"true", "false"}
    older_kinds = {}
    for option, per_release in kinds.items():
        newest_kind = options[option][1]
        differ = {i: k for i, k in per_release.items() if k != newest_kind and not {k, newest_kind} <= flags}
        if differ:
            older_kinds[option] = differ
    types: dict[str, str] = {}
    for version in RELEASES:
        for dest, name in tables[version]["types"].items():
            if types.setdefault(dest, name) != name:
                raise SystemExit(f"{dest}: type {types[dest]} in an older release, {name} in core_v{version}")
    missing = sorted(set(READ) - set(types))
    assert not missing, f"not Megatron-LM arguments: {missing}"
    # A dest an older release does not have gets the newest release's default (the feature off).
    newest = tables[RELEASES[-1]]["defaults"]
    defaults = {f"core_v{v}": {**{k: newest[k] for k in READ if k in newest}, **tables[v]["defaults"]}
                for v in RELEASES}
    assert all(set(values) == set(READ) for values in defaults.values()), "a dest read has no default"
    text = f'''"""Megatron-LM command-line arguments of {", ".join(tags)}: each option's dest, arity and
releases, and the defaults and types of the ones megatron-flops reads. Generated by
scripts/gen_mlm_args.py from each tag's megatron/training/arguments.py: do not edit.
"""

from typing import Any

RELEASES: tuple[str, ...] = {tuple(tags)!r}  # oldest first
# option string -> (dest, kind, releases), dest and kind as in the newest release that has it:
# kind "true"/"false" (a flag storing that value), "value" (one value), "list" (one or more
# values), or a number of values; releases: the indices into RELEASES of the releases that have it.
OPTIONS: dict[str, tuple[str, str, tuple[int, ...]]] = {_dict(options)}
# option -> {{release index: kind}} where an older release takes another number of values
OLDER_KINDS: dict[str, dict[int, str]] = {_dict(older_kinds)}
# every release's dests (an args dump's keys)
DESTS: frozenset[str] = frozenset((
{"".join(f"    {d!r},{chr(10)}" for d in sorted(dests))}))
# release -> the defaults of the dests megatron-flops reads (a dest that an older release does not
# have: the newest release's default, the feature off)
DEFAULTS: dict[str, dict[str, Any]] = {{
{"".join(f"    {tag!r}: {_dict(values, '        ')},{chr(10)}" for tag, values in defaults.items())}}}
TYPES: dict[str, str] = {_dict(types)}
'''
    out = REPO / "megatron_flops" / "model" / "_mlm_args.py"
    out.write_text(text)
    print(f"wrote {len(options)} options of {len(RELEASES)} releases to {out}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--dump"]:
        print(json.dumps(dump()))
    else:
        write({version: table_of(version) for version in RELEASES})
