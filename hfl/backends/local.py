"""LocalBackend: clients train in this process, one after the other (debug with a breakpoint), or,
with `backend.batch_clients` > 1, several of one sub-model shape at once as one vectorised model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

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
        # A client's error stops the run here: in-process runs are for debugging, so it surfaces. Only
        # running out of CUDA memory under its budget's cap (`cap_client_memory`) is the client's
        # failure, as on Ray: the budget is the simulated device's memory.
        global_state, tasks = submitted
        env = self.environment
        updates: dict[int, ClientUpdate] = {}
        failed = []
        for unit in env.work_units(tasks, env.config.backend.batch_clients):
            try:
                updates.update(zip(unit, env.train_unit(global_state, [tasks[i] for i in unit])))
            except torch.cuda.OutOfMemoryError as error:
                budget = tasks[unit[0]].ctx.budget
                if budget is None or budget.memory_bytes is None or len(unit) > 1:  # uncapped (no memory budget, or clients trained together): a real error
                    raise
                reason = f"CUDA out of memory under its memory budget of {budget.memory_bytes / 2**20:.1f} MiB: {str(error).splitlines()[0]}"
                failed.append({"id": tasks[unit[0]].ctx.client_id, "reason": reason})
        return [updates[i] for i in range(len(tasks)) if i in updates], failed

    def close(self) -> None:
        pass
