"""Asynchronous buffered aggregation in simulated time: FedBuff (Nguyen et al., "Federated Learning
with Buffered Asynchronous Aggregation", AISTATS 2022).

`fl.async_concurrency` clients train at once, each from the global model current when it started.
A client that finishes (in simulated time) joins the buffer, and a new client starts in its place;
every `fl.async_buffer` arrivals are one server step. An arrival trained from version v and applied
at version V has staleness s = V - v and its change Delta = trained - received counts with weight
1 / sqrt(1 + s): it enters the method's masked weighted mean as the update
extract(current global) + Delta / sqrt(1 + s), so each held entry moves by
sum_i w_i Delta_i / sqrt(1 + s_i) / sum_i w_i over the clients that held it (w_i: the method's weight).
With no staleness this is the method's own mean of the trained weights; a sub-model's stale update
moves only the entries it held. Methods whose server step is not that mean refuse async.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from hfl.config import ExperimentConfig
from hfl.errors import ConfigError
from hfl.methods.base import Method
from hfl.seeding import COHORT_STREAM, derive_seed
from hfl.simulation.clock import Availability, client_time, record_energy
from hfl.simulation.devices import Device
from hfl.simulation.policy import cohort_size, wait_for_devices
from hfl.submodel.spec import extract
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

ASYNC_TAG = 1
"""Mixed into the cohort stream's seed of each async dispatch, apart from synchronous cohorts."""


def staleness_weight(staleness: int) -> float:
    """FedBuff's polynomial staleness weight, 1 / sqrt(1 + s)."""
    return 1.0 / math.sqrt(1.0 + staleness)


def refuse_stale_server_steps(config: ExperimentConfig, method: Method) -> None:
    """A ConfigError naming the method and the policy unless its server step is the masked weighted mean."""
    if type(method).aggregate is not Method.aggregate:
        raise ConfigError("fl.round_policy", config.fl.round_policy, f"sync, deadline or overselect for method {config.method.name}: "
                          f"its server step ({type(method).__name__}.aggregate) is not the masked weighted mean, so it cannot "
                          "take stale updates")


@dataclass(frozen=True, order=True)
class InFlight:
    """A client-round that started from global version `version` and ends at `at`: when its update
    arrives, or when its device goes offline before that (then it is dropped)."""

    at: float
    client: int
    version: int = field(compare=False)
    update: ClientUpdate = field(compare=False)
    """Float tensors hold the change (trained - received); integer buffers their trained value."""


def delta(update: ClientUpdate, received: StateDict) -> ClientUpdate:
    """`update` with each float tensor replaced by its change from what the client received."""
    state = {k: (v - received[k].to(v.device)) if v.is_floating_point() else v for k, v in update.state.items()}
    return replace(update, state=state)


def stale_update(update: ClientUpdate, global_state: StateDict, staleness: int) -> ClientUpdate:
    """The update that, in the masked weighted mean over the current global state, moves every entry
    it holds by its change times the staleness weight."""
    current = extract(global_state, update.spec)
    factor = staleness_weight(staleness)
    state = {k: (current[k] + factor * v.to(current[k].device)) if v.is_floating_point() else v for k, v in update.state.items()}
    return replace(update, state=state)


Train = Callable[[StateDict, Sequence[ClientTask]], tuple[list[ClientUpdate], list[dict[str, Any]]]]
"""Trains tasks from a global state now (the backend's submit and collect): updates and failures."""
Plan = Callable[[RoundContext], ClientTask | None]


class FedBuffRounds:
    """The event queue of the async policy: who is training, from which version, arriving when."""

    def __init__(self, config: ExperimentConfig, devices: Sequence[Device], saved: dict[str, Any] | None = None) -> None:
        self.config, self.devices = config, list(devices)
        self.availability = Availability(self.devices)
        fl = config.fl
        self.concurrency = fl.async_concurrency or cohort_size(config)
        self.buffer_size = fl.async_buffer or max(1, self.concurrency // 2)
        saved = saved or {}
        self.now: float = saved.get("now", 0.0)
        self.version: int = saved.get("version", 0)
        """Server steps applied so far."""
        self.dispatched: int = saved.get("dispatched", 0)
        """Client-rounds started so far (each draws its client from its own seeded generator)."""
        self.in_flight: list[InFlight] = list(saved.get("in_flight", []))
        """A heap on (finish, client)."""

    def saved(self) -> dict[str, Any]:
        in_flight = [replace(e, update=replace(e.update, state={k: v.detach().cpu() for k, v in e.update.state.items()})) for e in self.in_flight]
        return {"now": self.now, "version": self.version, "dispatched": self.dispatched, "in_flight": in_flight}

    def _refill(self, global_state: StateDict, plan: Callable[[int], ClientTask | None], train: Train,
                skipped: list[dict[str, Any]], failed: list[dict[str, Any]]) -> None:
        """Start clients online now (and not training) until `concurrency` are in flight."""
        idle = self.availability.online(self.now)
        idle[[e.client for e in self.in_flight]] = False
        candidates = np.flatnonzero(idle).tolist()
        tasks: list[ClientTask] = []
        while len(self.in_flight) + len(tasks) < self.concurrency and candidates:
            rng = np.random.default_rng(derive_seed(self.config.seed, self.dispatched, COHORT_STREAM, ASYNC_TAG))
            self.dispatched += 1
            client = candidates.pop(int(rng.integers(len(candidates))))
            task = plan(client)
            if task is None:
                skipped.append({"id": client, "reason": "no sub-model of the method fits the budget"})
            else:
                tasks.append(task)
        if not tasks:
            return
        updates, failures = train(global_state, tasks)
        failed.extend(failures)
        for update in updates:
            t = client_time(self.devices[update.client_id], update.metrics, self.now, self.config.fl.local_epochs)
            update.metrics.update({"sim_start_s": self.now, "sim_down_s": t.down_s, "sim_compute_s": t.compute_s, "sim_up_s": t.up_s,
                                   "sim_comm_s": t.down_s + t.up_s, "sim_finish_s": t.finish, "version": self.version})
            record_energy(update.metrics, self.devices[update.client_id])
            leaves = self.devices[update.client_id].online_until(self.now)
            if t.finish > leaves:
                update.metrics.update({"dropped": "offline", "dropped_at_s": leaves})
            sent = delta(update, extract_for(update, global_state))
            heapq.heappush(self.in_flight, InFlight(min(t.finish, leaves), update.client_id, self.version, sent))

    def step(self, global_state: StateDict, plan: Callable[[int], ClientTask | None], train: Train
             ) -> tuple[list[ClientUpdate], list[ClientUpdate], dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
        """Run the clock to the next server step: (the arrivals as updates for the method's mean,
        every client-round that ended in this step (arrived or dropped), the step's time fields,
        skipped clients, failed clients)."""
        start, arrivals, ended, drops = self.now, [], [], []
        skipped: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        while len(arrivals) < self.buffer_size:
            before = len(skipped) + len(failed)
            self._refill(global_state, plan, train, skipped, failed)
            if not self.in_flight:
                if len(skipped) + len(failed) > before:  # every client online now sat out or failed: a step with what arrived, not a spin
                    break
                self.now = wait_for_devices(self.availability, math.nextafter(self.now, math.inf))
                continue
            entry = heapq.heappop(self.in_flight)
            self.now = entry.at
            ended.append(entry.update)
            if entry.update.metrics.get("dropped"):
                drops.append({"id": entry.client, "reason": "offline", "at_s": entry.at})
                continue
            staleness = self.version - entry.version
            entry.update.metrics["staleness"] = staleness
            arrivals.append(stale_update(entry.update, global_state, staleness))
        self.version += 1
        fields = {"sim_start_s": start, "sim_end_s": self.now, "staleness": [u.metrics["staleness"] for u in arrivals],
                  "dropped_clients": drops}
        return arrivals, ended, fields, skipped, failed


def extract_for(update: ClientUpdate, global_state: StateDict) -> StateDict:
    """What the client of `update` received from `global_state` (its spec's entries)."""
    with torch.no_grad():
        return extract(global_state, update.spec)
