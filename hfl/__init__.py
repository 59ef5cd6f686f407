"""hfl: federated learning with heterogeneous, resource-constrained clients.

Importing the package imports nothing else, so that `hfl --help` and `hfl methods` answer at once;
each module imports what it uses (the config fills the registries it checks names against). The
Python API (`hfl.run`, `hfl.load_run`, `hfl.make_config`, `hfl.Run`, `hfl.tune(...)`,
`hfl.load_sweep`; see `hfl.api`) is imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
API = ("Run", "load_run", "load_sweep", "make_config", "run")
"""Names of `hfl.api` that `hfl.<name>` gives, imported when first asked for."""
__all__ = [*API, "__version__"]


def __getattr__(name: str) -> Any:
    if name == "tune":  # the package hfl.tune, which runs a sweep when called (`hfl.tune("tune_spaces/x.yaml")`)
        return importlib.import_module("hfl.tune")
    if name in API:
        return getattr(importlib.import_module("hfl.api"), name)
    raise AttributeError(f"module 'hfl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *API, "tune"})
