"""What crosses the backend boundary: frozen, cheap to serialise (tensors and numbers, no modules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hfl.accounting.amounts import ClientBudget
from hfl.seeding import derive_seed
from hfl.submodel.spec import SubmodelSpec

StateDict = dict[str, Tensor]


@dataclass(frozen=True)
class TrainSettings:
    """Optimiser and loop settings of one client-round."""

    lr: float
    momentum: float
    weight_decay: float
    local_epochs: int
    batch_size: int
    optimizer: str = "sgd"
    initial_lr: float | None = None
    """The schedule's rate at round 1 (η₀, for rates relative to it: FedMef's budgeted rate); None:
    this round's `lr`."""
    precision: str = "32-true"
    """`fl.precision`: float32, or the autocast (and gradient scaler) of mixed precision."""
    gradient_clip_val: float = 0.0
    gradient_clip_algorithm: str = "norm"
    agc: float = 0.0
    """`fl.agc`: unit-wise adaptive gradient clipping's λ (0: off)."""
    accumulate_grad_batches: int = 1
    callbacks: tuple[str, ...] = ()
    """`fl.callbacks`: Lightning callbacks' import paths (clients with any train under lightning.Trainer)."""


@dataclass(frozen=True)
class RoundContext:
    """Per-round facts about one client; every random choice of that client-round derives from it."""

    round: int
    client_id: int
    seed: int
    num_samples: int
    train: TrainSettings
    budget: ClientBudget | None = None

    def seed_for(self, *tags: int) -> int:
        return derive_seed(self.seed, self.round, self.client_id, *tags)

    def generator(self, *tags: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed_for(*tags))

    def rng(self, *tags: int) -> np.random.Generator:
        return np.random.default_rng(self.seed_for(*tags))


@dataclass(frozen=True)
class ClientTask:
    """What a client is asked to do: the sub-model it trains, how, and the method's settings."""

    ctx: RoundContext
    spec: SubmodelSpec
    options: Any = None
    """The method's own settings for this client-round (a frozen dataclass), read by its objective."""
    level: str | None = None
    """The ladder level the task trains (the server records it as trained)."""
    choices: tuple[str, ...] = ()
    """The levels the client could have drawn this round (dynamic tiers), for reports."""
    stages: tuple[frozenset[str] | None, ...] = (None,)
    """Parameter names trained one stage after the other, each stage for the round's local epochs
    with a fresh optimiser (FeDepth's block groups); None: every parameter the spec does not freeze.
    The objective reads the running stage's index as `client.stage`."""
    peers: int = 0
    """Models of the same shape trained beside the uploaded one, freshly initialised and discarded
    after the client-round (m-FeDepth's mutual learning); the objective reads them as `client.peers`."""
    present_classes_only: bool = False
    """Send back only the classifier rows of the classes in the client's data: the rows of absent
    classes are not held by the update, so they do not dilute those rows' average (HeteroFL's
    masking trick, whose rows of absent classes receive no gradient)."""


@dataclass(frozen=True)
class ClientUpdate:
    """What a client sends back: the tensors it trained (client shapes), its weight and metrics."""

    client_id: int
    state: StateDict
    weight: float
    spec: SubmodelSpec
    """What the update holds: the task's spec, with entries the client does not send back masked
    (`ClientTask.present_classes_only`)."""
    metrics: dict[str, Any]
    level: str | None = None
    """The task's ladder level."""
    extras: StateDict = field(default_factory=dict)
    """Tensors the method's `client_uploads` sent beside the weights (FedTiny's top-k gradients of
    pruned entries), counted in the client-round's bytes_up."""
