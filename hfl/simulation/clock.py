"""The virtual clock: a client-round's simulated duration from what accounting counts, and which
clients a round's policy keeps (sync, deadline, overselect).

duration = bytes_down / down + training FLOPs / speed + bytes_up / up, from the client-round's
metrics (never the host's clock), so every backend gives the same timeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hfl.simulation.devices import Device


@dataclass(frozen=True)
class ClientTime:
    """One client-round in simulated seconds."""

    client: int
    start: float
    down_s: float
    compute_s: float
    up_s: float

    @property
    def finish(self) -> float:
        return self.start + self.down_s + self.compute_s + self.up_s


def client_time(device: Device, metrics: Mapping[str, Any], start: float, local_epochs: int) -> ClientTime:
    """The simulated times of a client-round whose metrics (bytes_down, flops, bytes_up, num_samples) are given."""
    down, compute, up = device.durations(metrics["bytes_down"], metrics["flops"], metrics["num_samples"], local_epochs, metrics["bytes_up"])
    return ClientTime(int(metrics["id"]), start, down, compute, up)


def record_energy(metrics: dict[str, Any], device: Device) -> None:
    """A client-round's metrics with `energy_j`, the joules its training FLOPs and its bytes down and up
    took (all of them, also where it was dropped: that work was spent), where its device has energy figures."""
    energy = device.energy(metrics["flops"], metrics["bytes_down"] + metrics["bytes_up"])
    if energy is not None:
        metrics["energy_j"] = energy


@dataclass(frozen=True)
class RoundTiming:
    """A synchronous round in simulated time: who was kept, who was dropped, when and why."""

    start: float
    end: float
    times: dict[int, ClientTime]
    kept: tuple[int, ...]
    """Clients whose updates are aggregated, in the order they finished."""
    dropped: dict[int, tuple[str, float]]
    """Client -> (why, when): deadline (a straggler), offline (its device left mid-round) or late
    (overselect: the round had its first K)."""


def time_round(policy: str, start: float, times: Sequence[ClientTime], devices: Sequence[Device],
               deadline_s: float = 0.0, keep: int | None = None) -> RoundTiming:
    """Which of a round's client-rounds (all started at `start`) the policy aggregates, and when the round ends.

    sync waits for every client; deadline drops those finishing after start + deadline_s (the round
    then lasts the whole deadline); overselect keeps the first `keep` to finish (ties: lower id) and
    ends when the last of them does. A device going offline before its client finishes drops it then.
    """
    leaves = {t.client: devices[t.client].online_until(start) for t in times}
    finishing = sorted((t for t in times if t.finish <= leaves[t.client]), key=lambda t: (t.finish, t.client))
    offline = {t.client: leaves[t.client] for t in times if t.finish > leaves[t.client]}
    cut, reason = math.inf, "late"
    if policy == "deadline":
        cut, reason = start + deadline_s, "deadline"
    elif policy == "overselect" and keep is not None and len(finishing) >= keep:
        cut = finishing[keep - 1].finish if keep else start
        finishing = finishing[:keep]  # ties at the cut beyond the K-th are late too
    kept = [t for t in finishing if t.finish <= cut]
    dropped = {t.client: (reason, cut) for t in times if t.client not in offline and t not in kept}
    for client, at in offline.items():
        dropped[client] = ("offline", at) if at <= cut else (reason, cut)
    events = [t.finish for t in kept] + [at for _, at in dropped.values()]
    end = max(events, default=start)
    return RoundTiming(start, end, {t.client: t for t in times}, tuple(t.client for t in kept), dropped)


def available(devices: Sequence[Device], t: float) -> list[int]:
    """Clients whose device is online at `t`."""
    return Availability(devices).clients(t)


def next_online(devices: Sequence[Device], t: float) -> float | None:
    """The earliest time >= t some device is online; None if none ever is again."""
    times = [x for x in (d.next_online(t) for d in devices) if x is not None]
    return min(times, default=None)


class Availability:
    """Which devices are online at a time, tested for all of them at once: one numpy comparison over
    every device's intervals instead of a Python call per device, which cost a run of 10,000 clients
    tens of ms per cohort and per async arrival (benchmarks/simulation_scale.py). It agrees with
    `Device.online_until(t) is not None`: the same `t % period`, the same half-open intervals."""

    def __init__(self, devices: Sequence[Device]) -> None:
        self.devices = list(devices)
        owned = [(c, start, end, d.period) for c, d in enumerate(self.devices) for start, end in d.online]
        self.owner = np.array([o[0] for o in owned], dtype=np.int64)
        self.start = np.array([o[1] for o in owned], dtype=np.float64)
        self.end = np.array([o[2] for o in owned], dtype=np.float64)
        period = np.array([o[3] for o in owned], dtype=np.float64)
        self.periodic = period > 0
        self.period = np.where(self.periodic, period, 1.0)  # 1.0 where there is no period: its remainder is not used
        self.always = np.array([not d.online for d in self.devices], dtype=bool)

    def online(self, t: float) -> np.ndarray:
        """A mask over the clients: True where the device is online at `t`."""
        local = np.where(self.periodic, np.remainder(t, self.period), t)
        mask = self.always.copy()
        mask[self.owner[(self.start <= local) & (local < self.end)]] = True
        return mask

    def clients(self, t: float) -> list[int]:
        """Clients whose device is online at `t`, ascending."""
        return np.flatnonzero(self.online(t)).tolist()

    def next_online(self, t: float) -> float | None:
        """The earliest time >= t some device is online; None if none ever is again."""
        return t if self.online(t).any() else next_online(self.devices, t)


def sample_available(rng: np.random.Generator, clients: int, online: Sequence[int], size: int) -> list[int]:
    """`size` clients (or all online ones, if fewer) drawn from those online. With every client online
    the draw equals the cohort sampler's, so devices that are always online change no cohort."""
    if len(online) == clients:
        return sorted(int(c) for c in rng.choice(clients, size=min(size, clients), replace=False))
    return sorted(int(c) for c in rng.choice(np.asarray(online, dtype=np.int64), size=min(size, len(online)), replace=False))
