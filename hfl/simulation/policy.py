"""Round policies in simulated time: which clients a synchronous round samples (those online) and
which of their updates it aggregates (sync, deadline, overselect)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hfl.config import ExperimentConfig
from hfl.errors import ConfigError
from hfl.seeding import COHORT_STREAM, derive_seed
from hfl.simulation.clock import Availability, RoundTiming, client_time, record_energy, sample_available, time_round
from hfl.simulation.devices import Device
from hfl.types import ClientUpdate


def cohort_size(config: ExperimentConfig) -> int:
    """Clients a round aggregates at most: `fl.fraction` of all, at least one."""
    return max(1, round(config.fl.fraction * config.fl.clients))


def sampled_size(config: ExperimentConfig) -> int:
    """Clients a round samples: the cohort, and under overselect `fl.overselect` more (rounded up)."""
    m = cohort_size(config)
    if config.fl.round_policy == "overselect":
        return min(config.fl.clients, math.ceil(m * (1 + config.fl.overselect) - 1e-9))
    return m


def wait_for_devices(availability: Availability, now: float) -> float:
    """`now`, or the first later time some device is online; a ConfigError if none ever is again."""
    start = availability.next_online(now)
    if start is None:
        raise ConfigError("devices.trace", f"online intervals ending before {now:.6g} s", "a trace in which some device is online "
                          "again (give it a period, or longer intervals): the run has outlived every device's last interval")
    return start


class SyncRounds:
    """The clock of the sync, deadline and overselect policies: each round starts when the last ended."""

    def __init__(self, config: ExperimentConfig, devices: Sequence[Device], saved: dict[str, Any] | None = None) -> None:
        self.config, self.devices = config, list(devices)
        self.availability = Availability(self.devices)
        self.now = float(saved["now"]) if saved else 0.0
        """When the next round starts (the end of the last)."""

    def cohort(self, round_: int) -> tuple[list[int], float]:
        """Round `round_`'s clients (drawn from those online when it starts) and its start."""
        start = wait_for_devices(self.availability, self.now)
        rng = np.random.default_rng(derive_seed(self.config.seed, round_, COHORT_STREAM))
        return sample_available(rng, self.config.fl.clients, self.availability.clients(start), sampled_size(self.config)), start

    def settle(self, start: float, updates: Sequence[ClientUpdate]) -> tuple[list[ClientUpdate], dict[str, Any]]:
        """The updates the round aggregates and what its record says about time; the clock moves to its end.
        Every update's metrics gain its simulated seconds (and, when dropped, why and when) and its energy."""
        fl = self.config.fl
        times = [client_time(self.devices[u.client_id], u.metrics, start, fl.local_epochs) for u in updates]
        timing = time_round(fl.round_policy, start, times, self.devices, fl.deadline_s, cohort_size(self.config))
        for u in updates:
            annotate(u.metrics, timing)
            record_energy(u.metrics, self.devices[u.client_id])
        self.now = timing.end
        kept = set(timing.kept)
        return [u for u in updates if u.client_id in kept], round_fields(timing)

    def saved(self) -> dict[str, Any]:
        return {"now": self.now}


def annotate(metrics: dict[str, Any], timing: RoundTiming) -> None:
    """A client-round's metrics with its simulated seconds: download, compute, upload, communication, finish."""
    t = timing.times[metrics["id"]]
    metrics.update({"sim_down_s": t.down_s, "sim_compute_s": t.compute_s, "sim_up_s": t.up_s,
                    "sim_comm_s": t.down_s + t.up_s, "sim_finish_s": t.finish})
    if metrics["id"] in timing.dropped:
        why, at = timing.dropped[metrics["id"]]
        metrics.update({"dropped": why, "dropped_at_s": at})


def round_fields(timing: RoundTiming) -> dict[str, Any]:
    """What a round's metrics line says about simulated time."""
    return {"sim_start_s": timing.start, "sim_end_s": timing.end,
            "stragglers": sorted(c for c, (why, _) in timing.dropped.items() if why == "deadline"),
            "dropped_clients": [{"id": c, "reason": why, "at_s": at} for c, (why, at) in sorted(timing.dropped.items())]}
