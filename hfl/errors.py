"""Errors that speak to the user: the CLI turns them into one line and exit code 2."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration value is not allowed: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is not allowed: expected {allowed}")


class DataNotFoundError(FileNotFoundError):
    """A dataset is missing locally; names the path looked in and the expected layout."""


def check(ok: bool, name: str, value: object, allowed: str) -> None:
    """Raise a ConfigError for field `name` unless `ok`; config dataclasses check their fields with it."""
    if not ok:
        raise ConfigError(name, value, allowed)


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    choices = list(choices)
    check(value in choices, name, value, f"one of {', '.join(choices)}")
