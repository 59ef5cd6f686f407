"""YAML files and dotted `key=value` overrides into frozen dataclasses: the one loader that experiment
configs (`hfl.config`) and pretraining configs (`hfl.pretrain`) share, so neither imports the other.

A bad key or value is a ConfigError naming its dotted path, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from hfl.errors import ConfigError, check


def parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent notation, which YAML 1.2 and users read as a number and PyYAML, without a dot, as a string."""


def coerce(name: str, value: Any, hint: Any) -> Any:
    """Check `value` against the field's annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return coerce(name, value, option)
            except ConfigError:
                continue
        raise ConfigError(name, value, f"a value of type {hint}")
    if hint is Any:
        return value
    if hint is type(None):
        check(value is None, name, value, "null")
        return None
    if hint is bool:
        check(isinstance(value, bool), name, value, "true or false")
        return value
    if hint is int:
        check(isinstance(value, int) and not isinstance(value, bool), name, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, str) and SCIENTIFIC.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 5e-4 without a dot as a string
        check(isinstance(value, (int, float)) and not isinstance(value, bool), name, value, "a number")
        return float(value)
    if hint is str:
        check(isinstance(value, (str, int, float)) and not isinstance(value, bool), name, value, "a string")
        return str(value)
    if origin in (tuple, list):
        check(isinstance(value, (list, tuple)), name, value, "a list")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return tuple(coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value))
    return value


def build_dataclass(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """Build dataclass `cls` from a plain dict, naming the dotted path of any bad key or value."""
    if not isinstance(values, dict):
        raise ConfigError(prefix.rstrip(".") or "config", values, "a mapping of fields")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{prefix}{key}", value, f"a field of {prefix.rstrip('.') or 'the config'}: {', '.join(sorted(known))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_dataclass(hint, value, f"{prefix}{key}.")
        else:
            kwargs[key] = coerce(f"{prefix}{key}", value, hint)
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise ConfigError(f"{prefix}{error.field}", error.value, error.allowed) from None


def apply_overrides(values: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides to a nested dict; values are parsed as YAML scalars."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError("override", item, "key=value, e.g. fl.rounds=3")
        set_dotted(values, key, parse_value(text))
    return values


def set_dotted(values: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """`values` with the dotted `key` set to `value` (sections created where missing)."""
    *parents, leaf = key.split(".")
    node = values
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(key, value, f"a path into a section, but {part} is a value")
        node = child
    node[leaf] = value
    return values


def read_yaml_mapping(path: Path, field: str, what: str) -> dict[str, Any]:
    """The mapping in YAML file `path`; a missing file, bad YAML or a non-mapping is a ConfigError
    naming `field` (what the file is for) and describing `what` it should hold."""
    if not path.is_file():
        raise ConfigError(field, str(path), f"a path to an existing YAML file ({what})")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(field, str(path), f"valid YAML ({yaml_problem(error)})") from None
    if not isinstance(values, dict):
        raise ConfigError(field, str(path), f"a YAML mapping ({what})")
    return values


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's complaint in one line, with where: "expected ',' or ']', but got '<stream end>' at
    line 7, column 1" (its own text spans lines and quotes the source)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
