"""`vectorisable`: the mark of an objective that clients trained together as one vectorised model can run."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def vectorisable(objective: Callable[..., dict[str, Tensor]]) -> Callable[..., dict[str, Tensor]]:
    """Mark a method's `objective` as one that reads of its client only what clients trained
    together as one vectorised model offer (`hfl.client.train_clients_together`): `client.model`
    and any of its modules (their weights are the client's own), `client.initial`,
    `client.trainable_parameters()`, `client.stage`, `client.classes` and the task (whose round,
    settings and stages the clients share); `client.peers` is empty. Such clients train beside
    others of their sub-model's shape and stages under `backend.batch_clients`."""
    objective.vectorisable = True  # type: ignore[attr-defined]
    return objective
