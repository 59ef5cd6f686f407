"""One registry type for methods, models, datasets, partitioners and backends.

An entry is registered by its module (`@REGISTRY.register(name)`), or declared ahead with the
module that registers it and a line of information (`declare`): a declared entry's module is imported
on first use, so that listing names (`hfl methods`, config checks) imports no torch.

A user's own entries live in their own modules, outside hfl, registered with the same decorators;
the config's `plugins` names those modules and `import_plugins` imports them before any name is
checked, in the driver and in every worker that assembles the experiment.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from hfl.errors import ConfigError, check

T = TypeVar("T")
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class Registry(Generic[T]):
    """A name -> object table; registering a name twice is an error."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._declared: dict[str, tuple[str, dict[str, str]]] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            # The same definition run again (a notebook cell re-run, a module reloaded) replaces itself.
            if name in self._entries and defined_at(self._entries[name]) != defined_at(obj):
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return add

    def declare(self, name: str, module: str, **info: str) -> None:
        """Name an entry that `module` registers when imported, with information shown without importing it."""
        if name in self._declared:
            raise ValueError(f"{self.kind} {name!r} is declared twice")
        self._declared[name] = (module, info)

    def get(self, name: str, field: str | None = None) -> T:
        if name not in self._entries and name in self._declared:
            importlib.import_module(self._declared[name][0])
        if name not in self._entries:
            raise ConfigError(field or f"{self.kind}.name", name, f"one of {', '.join(self.names())}")
        return self._entries[name]

    def info(self, name: str) -> dict[str, str]:
        """What `declare` says of an entry (empty for one registered only)."""
        return dict(self._declared[name][1]) if name in self._declared else {}

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._declared))

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._declared

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def defined_at(obj: object) -> tuple[object, object]:
    """Where a registered object is defined: (module, qualified name); an object without a name is only where it is."""
    return getattr(obj, "__module__", None), getattr(obj, "__qualname__", id(obj))


METHODS: Registry = Registry("method")
MODELS: Registry = Registry("model")
DATASETS: Registry = Registry("dataset")
PARTITIONERS: Registry = Registry("partition")
BACKENDS: Registry = Registry("backend")


def import_plugins(modules: Iterable[str], field: str = "plugins") -> None:
    """Import the user's modules that register methods, models, datasets or partitioners (the
    config's `plugins`); a module that cannot be found is a ConfigError naming `field` and the module."""
    for module in modules:
        check(isinstance(module, str) and MODULE_NAME.fullmatch(module) is not None, field, module,
              "a dotted module name such as my_project.methods")
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or not (module == error.name or module.startswith(f"{error.name}.")):
                raise  # the plug-in was found, but a module it imports is missing: its own traceback says which
            raise ConfigError(field, module, f"a module importable here that registers methods, models or datasets "
                              f"(no module named {error.name!r}: install its package or put its folder on PYTHONPATH)") from None


def import_class(path: str, field: str) -> type:
    """The class `package.module:Class` names (a config's `fl.callbacks`); one that cannot be
    imported is a ConfigError naming `field` and the path."""
    module, _, name = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as error:
        raise ConfigError(field, path, f"an importable class ({error})") from None
    if not isinstance(found, type):
        raise ConfigError(field, path, f"a class: {module} has no class {name}")
    return found
