"""Seeds for every random stream, derived from (experiment seed, round, client, stream tag)."""

from __future__ import annotations

import numpy as np


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (experiment seed, round, client, stream tag...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))
