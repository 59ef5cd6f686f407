"""One registry type for methods, models, datasets and partitioners."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from hfl.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object table; registering a name twice is an error."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str, field: str | None = None) -> T:
        if name not in self._entries:
            raise ConfigError(field or f"{self.kind}.name", name, f"one of {', '.join(sorted(self._entries))}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))


METHODS: Registry = Registry("method")
MODELS: Registry = Registry("model")
DATASETS: Registry = Registry("dataset")
PARTITIONERS: Registry = Registry("partition")
BACKENDS: Registry = Registry("backend")
