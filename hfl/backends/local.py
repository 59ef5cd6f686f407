"""LocalBackend: clients train in this process, one after the other (debug with a breakpoint), or,
with `backend.batch_clients` > 1, several of one sub-model shape at once as one vectorised model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfl.experiment import ClientEnvironment
from hfl.registry import BACKENDS
from hfl.types import ClientTask, ClientUpdate, StateDict


@BACKENDS.register("local")
class LocalBackend:
    def __init__(self, environment: ClientEnvironment) -> None:
        self.environment = environment

    def submit(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> tuple[StateDict, Sequence[ClientTask]]:
        return global_state, tasks  # trained in `collect`: in this process there is nothing to overlap

    def collect(self, submitted: tuple[StateDict, Sequence[ClientTask]]) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        # A client's error stops the run here: in-process runs are for debugging, so it surfaces.
        global_state, tasks = submitted
        env = self.environment
        updates: dict[int, ClientUpdate] = {}
        for unit in env.work_units(tasks, env.config.backend.batch_clients):
            updates.update(zip(unit, env.train_unit(global_state, [tasks[i] for i in unit])))
        return [updates[i] for i in range(len(tasks))], []

    def close(self) -> None:
        pass
