"""The Backend protocol every backend implements (`hfl.backends.local`, `hfl.backends.ray`).

The client environment a backend trains in is assembled by `hfl.experiment`; its names stay importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hfl.experiment import (  # noqa: F401  (importable from here as before the assembly had its own module)
    SERVER_SPLIT_STREAM,
    ClientEnvironment,
    build_model_for,
    family_loader,
    model_norm,
    server_split,
    task_labels,
    uses_cudnn,
)
from hfl.types import ClientTask, ClientUpdate, StateDict


class Backend(Protocol):
    def submit(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> Any:
        """Start training every task, from `global_state`; returns what `collect` takes. A backend
        whose clients train elsewhere returns at once, so the driver can evaluate meanwhile."""
        ...

    def collect(self, submitted: Any) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        """The submitted round's updates (in task order) and its failed clients (`id`, `reason`)."""
        ...

    def close(self) -> None: ...


class ClusterError(RuntimeError):
    """The cluster can no longer run the experiment (its head is gone, or a tier's every node with
    `backend.tier_strict`): the run stops after its last complete round, which `hfl run --resume`
    continues. The message says why, in one line; the CLI adds the command that resumes the run."""
