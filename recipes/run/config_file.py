"""A RecipeConfig from a YAML file and `--key value` overrides (the command line), every key
checked: an unknown one anywhere raises ValueError naming it."""

from __future__ import annotations

import dataclasses
import os

import yaml

from .config import RecipeConfig, field_types


def load_config(path: str | None = None, overrides: dict | None = None) -> RecipeConfig:
    """YAML file (optional) then overrides; unknown keys anywhere raise ValueError."""
    values: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"config: file not found: {path!r}")
        with open(path) as f:
            loaded = yaml.safe_load(f)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config: {path!r} must hold a mapping of keys to values")
        values.update(loaded)
    values.update(overrides or {})
    known = {f.name for f in dataclasses.fields(RecipeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown}" + (f" in {path!r}" if path else ""))
    return RecipeConfig(**values)


_NULLS = ("", "~", "null", "Null", "NULL")  # YAML's nulls


def parse_overrides(args: list[str]) -> dict:
    """`--key value` / `--key=value` pairs; values are read as YAML (so 1e-4, true, null work),
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
            out[key] = yaml.safe_load(value) if value != "" else None
        except yaml.YAMLError:  # e.g. a prompt template "{question}=" is not YAML: keep it
            out[key] = value
    return out
