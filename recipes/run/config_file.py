"""A RecipeConfig from a YAML file and `--key value` overrides (the command line), every key
checked: an unknown one anywhere raises ValueError naming it."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing

import yaml

from .config import RecipeConfig, field_types


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, but for exponent floats without a dot ("5e-2", "1E5"): floats,
    where PyYAML (YAML 1.1) reads them as strings; and a key given twice in one mapping, which
    PyYAML settles silently for the last, a ValueError. At every level, a lora or speculative
    dict's values included."""

    def construct_mapping(self, node, deep=False):
        _refuse_repeated_keys(self, node)
        return super().construct_mapping(node, deep)


def _refuse_repeated_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> None:
    """The mapping's own keys, each once: keys merged in (`<<: *base`) are meant to be
    overridden by them, and are not among them."""
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, typing.Hashable):
            continue  # PyYAML refuses it itself, naming it
        if key in seen:
            mark = key_node.start_mark
            raise ValueError(f"config: key {key!r} given twice in {mark.name}, line "
                             f"{mark.line + 1} (YAML would keep the last silently)")
        seen.add(key)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def read_yaml(text) -> object:
    """A YAML document (a string or an open file), read by _Loader."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (_Loader is a SafeLoader)


def load_config(path: str | None = None, overrides: dict | None = None) -> RecipeConfig:
    """YAML file (optional) then overrides; unknown keys anywhere raise ValueError."""
    values: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"config: file not found: {path!r}")
        with open(path) as f:
            loaded = read_yaml(f)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config: {path!r} must hold a mapping of keys to values")
        not_names = [k for k in loaded if not isinstance(k, str)]
        if not_names:
            raise ValueError(f"config: key(s) {not_names} in {path!r} are not names: YAML reads "
                             f"an unquoted on/off/yes/no/y/n as a boolean, digits as a number; "
                             f"quote them")
        values.update(loaded)
    values.update(overrides or {})
    known = {f.name for f in dataclasses.fields(RecipeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown}" + (f" in {path!r}" if path else ""))
    return RecipeConfig(**values)


_NULLS = ("", "~", "null", "Null", "NULL")  # YAML's nulls


def command_line_overrides(doc: str, argv: list[str] | None = None) -> dict:
    """parse_overrides of a recipe's command line (sys.argv's when `argv` is None); -h or
    --help prints the recipe's docstring `doc` and exits, as argparse does (it had been read
    as a key missing its value)."""
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(f"{doc.strip()}\n\nAny --key value overrides that key of the config (every key: "
              f"recipes/run/config.py).")
        raise SystemExit(0)
    return parse_overrides(args)


def parse_overrides(args: list[str]) -> dict:
    """`--key value` / `--key=value` pairs; values are read as YAML (read_yaml: 1e-4, true, null),
    a string field's as typed."""
    out: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"config: expected --key value, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ValueError(f"{key.replace('-', '_')}: missing value after {arg!r}")
            value = args[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        # A string field keeps the text as typed (`--run_name 7` is "7", not 7; a system prompt
        # "... after #### " keeps what YAML would read as a comment, quotes stay), null aside.
        if str in field_types(key) and value not in _NULLS:
            out[key] = value
            continue
        try:
            out[key] = read_yaml(value) if value != "" else None
        except yaml.YAMLError:  # e.g. a prompt template "{question}=" is not YAML: keep it
            out[key] = value
    return out
