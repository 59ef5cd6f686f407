"""A config written out for a reader: every section and field with its value, its docstring and, for
a method's fields, what its checks allow (`hfl config`, `hfl methods NAME`).

Field docstrings are the string literals that follow each field in the config dataclasses' source,
read with `ast` (Python keeps no attribute docstrings at run time).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import sys
import typing
from typing import Any

import yaml

from hfl.errors import ConfigError


@functools.cache
def _module_docs(module: str) -> dict[str, dict[str, str]]:
    """Class name -> field -> docstring, for every class defined at the top of `module`."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for statement, following in zip(node.body, node.body[1:]):
            is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and is_doc:
                fields[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Field -> docstring of dataclass `cls`, inherited fields included (a subclass's own wins)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_module_docs(base.__module__).get(base.__name__, {}))
    return docs


_PROBES: dict[Any, tuple[Any, ...]] = {str: ("\x00",), int: (-(10**9), 10**9), float: (math.nan, -1e18, 1e18)}
"""Values of each type that a check on a field is expected to refuse, so that it says what it allows."""


def _probes(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (tuple, list):
        items = [(probe,) for probe in _probes(typing.get_args(hint)[0])]
        return (*items, ())
    options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return _PROBES.get(options[0] if options else hint, ())


def allowed_values(cls: type) -> dict[str, str]:
    """Field -> what the checks in `cls.__post_init__` allow, in their own words (e.g. `one of
    samples, clients`, `an integer >= -1`), for each field whose check refuses some value of its type."""
    default = cls()
    hints = typing.get_type_hints(cls)
    allowed: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        for probe in _probes(hints[f.name]):
            try:
                dataclasses.replace(default, **{f.name: probe})
            except ConfigError as error:
                if error.field == f.name:
                    allowed[f.name] = error.allowed
                    break
            except (TypeError, ValueError, ArithmeticError):  # a check that cannot take the probe says nothing
                continue
    return allowed


def _yaml_value(value: Any) -> str:
    """`value` as YAML on one line (lists in flow style, strings quoted where YAML needs it)."""
    return yaml.safe_dump([_plain(value)], default_flow_style=True, width=2**31).strip()[1:-1]  # the one item of a flow list


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in text.splitlines()]


def describe(config: Any, indent: str = "", allowed: bool = False) -> list[str]:
    """Dataclass `config` as YAML lines, each field under its docstring (and, with `allowed`, what
    its checks allow); a value that is not the field's default says the default beside it."""
    docs, defaults = field_docs(type(config)), type(config)()
    limits = allowed_values(type(config)) if allowed else {}
    lines: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        lines += _comment(docs.get(f.name, ""), indent)
        if dataclasses.is_dataclass(value):
            lines += [f"{indent}{f.name}:", *describe(value, indent + "  ", allowed)]
            continue
        if f.name in limits:
            lines += _comment(f"allowed: {limits[f.name]}", indent)
        line = f"{indent}{f.name}: {_yaml_value(value)}"
        default = getattr(defaults, f.name)
        lines.append(line if value == default else f"{line}  # default: {_yaml_value(default)}")
    return lines
