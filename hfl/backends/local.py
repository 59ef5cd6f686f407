"""LocalBackend: clients train in this process, one after the other (debug with a breakpoint), or,
with `backend.batch_clients` > 1, several of one sub-model shape at once as one vectorised model."""

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
        env = self.environment
        size = env.config.backend.batch_clients
        if size == 1:
            return [env.train(global_state, task) for task in tasks], []
        groups: dict[tuple, list[int]] = {}
        updates: dict[int, ClientUpdate] = {}
        for i, task in enumerate(tasks):
            key = env.together_key(task)
            if key is None:
                updates[i] = env.train(global_state, task)
            else:
                groups.setdefault(key, []).append(i)
        for members in groups.values():
            for lo in range(0, len(members), size):
                chunk = members[lo : lo + size]
                if len(chunk) == 1:
                    updates[chunk[0]] = env.train(global_state, tasks[chunk[0]])
                else:
                    updates.update(zip(chunk, env.train_together(global_state, [tasks[i] for i in chunk])))
        return [updates[i] for i in range(len(tasks))], []

    def close(self) -> None:
        pass
