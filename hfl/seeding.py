"""Seeds for every random stream, derived from (experiment seed, round, client, stream tag)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (experiment seed, round, client, stream tag...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


# Tags of the run-level streams, one place so no two collide; they sit above every client id.
PARTITION_STREAM = 2**31 - 1
"""The data partition."""
COHORT_STREAM = 2**31 - 2
"""Each round's cohort."""
MODEL_STREAM = 2**31 - 3
"""The initial global weights."""
BUDGET_STREAM = 2**31 - 4
"""The assignment of budget tiers to clients."""
SERVER_SPLIT_STREAM = 2**31 - 5
"""The server's unlabelled share of the training set."""
DISTILL_STREAM = 2**31 - 6
"""Server-side distillation batches (FedDF)."""
SBN_STREAM = 2**31 - 7
"""The training sample static batch-norm statistics are recomputed from."""
BASE_ORDER_STREAM = 2**31 - 9
"""Each round's order of SplitMix's base models (which base each client trains first)."""
MASK_STREAM = 2**31 - 10
"""The random initial mask of dynamic sparse training (FedTiny, FedMef, FedDST)."""
PRETRAIN_DATA_STREAM = 2**31 - 11
"""`hfl pretrain`: each step's text windows, or each epoch's order of the images."""
PRETRAIN_AUGMENT_STREAM = 2**31 - 12
"""`hfl pretrain`: each step's image augmentation."""
DEVICE_STREAM = 2**31 - 13
"""The spread of simulated devices within a tier (hfl.simulation)."""


@contextlib.contextmanager
def aside_from_torch_stream() -> Iterator[None]:
    """Run a block without moving torch's global generator: for the models hfl builds lazily (the
    client and evaluation model caches, the accountant's probes), whose first use falls in another
    round in a resumed process than in an uninterrupted one. Their weights never reach a number
    (clients and evaluation load the global state's), and user code drawing from torch's global
    generator then sees the same stream after a resume, as it does numpy's and Python's."""
    with torch.random.fork_rng(devices=[]):
        yield
