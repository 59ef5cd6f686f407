"""Errors that speak to the user: the CLI turns them into one line and exit code 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is not allowed: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is not allowed: expected {allowed}")


class DataNotFoundError(FileNotFoundError):
    """A dataset is missing locally; names the path looked in and the expected layout."""
