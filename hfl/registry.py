"""One registry type for methods, models, datasets, partitioners and backends.

An entry is registered by its module (`@REGISTRY.register(name)`), or declared ahead with the
module that registers it and a line of information (`declare`): a declared entry's module is imported
on first use, so that listing names (`hfl methods`, config checks) imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from hfl.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object table; registering a name twice is an error."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._declared: dict[str, tuple[str, dict[str, str]]] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
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


METHODS: Registry = Registry("method")
MODELS: Registry = Registry("model")
DATASETS: Registry = Registry("dataset")
PARTITIONERS: Registry = Registry("partition")
BACKENDS: Registry = Registry("backend")
