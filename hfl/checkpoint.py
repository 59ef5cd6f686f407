"""Atomic, resumable checkpoints of the whole run state.

Every random choice of a round derives from (seed, round, client), so the round number carries the
cohort sampler's and the clients' random state; the process-global RNGs are saved as well so that
code drawing from them (a user's method, a library) resumes identically too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfl.errors import ConfigError
from hfl.storage import atomic_write
from hfl.types import StateDict

CHECKPOINT = "checkpoint.pt"


@dataclass
class RunState:
    round: int
    global_state: StateDict
    method_state: Any
    """The method's `State` (a frozen dataclass)."""
    elapsed_seconds: float
    simulation: Any = None
    """The simulated clock (hfl.simulation): the time of the next round's start, and under the
    async policy the clients in flight; None without devices."""


def save_checkpoint(out_dir: Path, state: RunState, config: dict[str, Any]) -> None:
    """Write the checkpoint next to its final name, then rename: a crash never leaves half a file."""
    payload = {
        "round": state.round,
        "global_state": {k: v.detach().cpu() for k, v in state.global_state.items()},
        "method_state": state.method_state,
        "elapsed_seconds": state.elapsed_seconds,
        "simulation": state.simulation,
        "config": config,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    atomic_write(out_dir / CHECKPOINT, lambda f: torch.save(payload, f))


def load_checkpoint(out_dir: Path, device: torch.device) -> tuple[RunState, dict[str, Any]]:
    """Load a checkpoint, restore the global RNGs; returns the run state and the saved config."""
    payload = torch.load(out_dir / CHECKPOINT, map_location=device, weights_only=False)
    if isinstance(payload["method_state"], dict):  # before methods had a typed State
        raise ConfigError("--resume", str(out_dir), "a run written by this version of hfl: its checkpoint keeps the "
                          "method state of an older one (untyped); start the run again")
    torch.set_rng_state(payload["rng"]["torch"])
    np.random.set_state(payload["rng"]["numpy"])
    random.setstate(payload["rng"]["python"])
    state = RunState(payload["round"], payload["global_state"], payload["method_state"], payload["elapsed_seconds"], payload.get("simulation"))
    return state, payload["config"]


def has_checkpoint(out_dir: Path) -> bool:
    return (out_dir / CHECKPOINT).is_file()
