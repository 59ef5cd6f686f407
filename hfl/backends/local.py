"""LocalBackend: clients train in this process, one after the other (debug with a breakpoint)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfl.backends.base import ClientEnvironment
from hfl.registry import BACKENDS
from hfl.types import ClientTask, ClientUpdate, StateDict


@BACKENDS.register("local")
class LocalBackend:
    def __init__(self, environment: ClientEnvironment) -> None:
        self.environment = environment

    def run(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        # A client's error stops the run here: in-process runs are for debugging, so it surfaces.
        return [self.environment.train(global_state, task) for task in tasks], []

    def close(self) -> None:
        pass
