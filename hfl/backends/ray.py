"""RayBackend: clients as long-lived Ray actors, pooled per budget tier.

Each actor builds the experiment's ClientEnvironment once (data, partitions, a model per sub-model
shape) and then only loads weights in place. The global weights go into the object store once per
round. Where the cluster advertises a tier's custom resource (`hfl_tier_<name>`, see cluster.yaml)
that tier's clients run on actors that hold it; otherwise every client shares one pool of CPU
actors. A client that raises, dies, runs out of memory or times out is recorded and left out of
the aggregate; its actor is replaced and the round goes on.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from hfl.backends.base import ClientEnvironment
from hfl.config import ExperimentConfig
from hfl.errors import ConfigError
from hfl.registry import BACKENDS
from hfl.types import ClientTask, ClientUpdate, StateDict

log = logging.getLogger(__name__)
SHARED_POOL = "any"
START_REPORT_S = 30.0  # how often a pool waiting for its actors says so


def tier_resource(tier: str) -> str:
    return f"hfl_tier_{tier}"


def cap_client_memory(env: ClientEnvironment, task: ClientTask) -> None:
    """On CUDA, let this process allocate at most the client's memory budget beyond what it holds
    for everything else (the data, other shapes' models), so that a client whose training exceeds
    its budget fails with an out-of-memory error instead of borrowing the device's memory.

    The budget covers the client model's weights, as the estimate and the measurement do. The
    allocator caps the memory it reserves from the device, so its cache is emptied first: free
    cached blocks would otherwise be headroom outside the cap."""
    device = env.device
    if device.type != "cuda":
        return
    torch.cuda.set_per_process_memory_fraction(1.0, device)  # the last client's cap must not bind this one's set-up
    budget = task.ctx.budget.memory_bytes if task.ctx.budget else None
    if budget is None:
        return
    model = env.model(task.spec)  # built first: its weights are part of the budget
    model.zero_grad(set_to_none=True)  # a failed client's gradients must not count as held
    torch.cuda.empty_cache()
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    held = torch.cuda.memory_reserved(device) - weights
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(held + budget, 1) / total), device)


class ClientActor:
    """One simulated-client worker; trains whichever client it is handed."""

    def __init__(self, config: ExperimentConfig) -> None:
        # Expandable segments keep the memory the allocator reserves close to what tensors use,
        # so a budget cap (see cap_client_memory) fails clients that exceed it, not fragmentation.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.env = ClientEnvironment.from_config(config)
        self.chaos = config.backend.chaos

    def train(self, global_state: StateDict, task: ClientTask) -> ClientUpdate:
        self._maybe_fail(task)
        cap_client_memory(self.env, task)
        return self.env.train(global_state, task)

    def _maybe_fail(self, task: ClientTask) -> None:
        for rule in self.chaos:
            round_, client, kind = rule.split(":")
            if int(round_) == task.ctx.round and int(client) == task.ctx.client_id:
                if kind == "raise":
                    raise RuntimeError(f"injected failure of client {client} in round {round_}")
                if kind == "exit":
                    os._exit(1)
                if kind == "hang":
                    time.sleep(3600)

    def ready(self) -> bool:
        return True


@dataclass
class Pool:
    """The actors serving one tier (or every client, on a cluster without tier resources)."""

    options: dict[str, Any]
    size: int
    actors: list[Any] = field(default_factory=list)


@BACKENDS.register("ray")
class RayBackend:
    def __init__(self, environment: ClientEnvironment) -> None:
        self.config = config = environment.config
        if not ray.is_initialized():
            # Joins the cluster in RAY_ADDRESS (set by `ray job submit`) or one started on this
            # machine by `ray start`; with neither, starts a local one.
            ray.init(
                include_dashboard=False,
                log_to_driver=config.backend.ray_log_to_driver,
                configure_logging=False,
            )
        self.remote_actor = ray.remote(ClientActor)
        self.pools: dict[str, Pool] = {}
        self.timeout = config.backend.client_timeout_s or None
        self.cluster: dict[str, float] | None = None

    # -- pools --------------------------------------------------------------------------------
    def _pool_name(self, task: ClientTask) -> str:
        """The pool serving `task`'s tier, created on first use."""
        tier = task.ctx.budget.tier if task.ctx.budget else None
        if self.cluster is None:  # a query to the cluster's control store: once, not per task
            self.cluster = ray.cluster_resources()
        name = tier if tier is not None and tier_resource(tier) in self.cluster else SHARED_POOL
        if name not in self.pools:
            self.pools[name] = self._new_pool(name, task, self.cluster)
        return name

    def _new_pool(self, name: str, task: ClientTask, cluster: dict[str, float]) -> Pool:
        backend = self.config.backend
        options: dict[str, Any] = {"num_cpus": backend.num_cpus_per_client}
        if name != SHARED_POOL:
            options["resources"] = {tier_resource(name): 1}
        device_memory = self._device_memory()
        # The driver may have no GPU (a CPU head node): "auto" asks for GPUs wherever the cluster has them.
        if cluster.get("GPU", 0) > 0 and device_memory and backend.device != "cpu":
            budget = task.ctx.budget.memory_bytes if task.ctx.budget and task.ctx.budget.memory_bytes else device_memory
            options["num_gpus"] = backend.num_gpus_per_client or min(1.0, budget / device_memory)
        size = backend.actors_per_pool or max(1, int(cluster.get("CPU", 1) // backend.num_cpus_per_client))
        log.info("ray pool %s: %d actors with %s", name, size, options)
        return Pool(options, size)

    def _device_memory(self) -> int | None:
        if self.config.backend.gpu_memory:
            from hfl.accounting.amounts import absolute_amount

            return absolute_amount(self.config.backend.gpu_memory)
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
        return None

    def _spawn(self, pool: Pool, count: int = 1) -> list[Any]:
        """Start actors and wait until they are built, so start-up never counts against a client's
        timeout. Actors the cluster cannot place (more CPUs asked than it has, more actors than fit)
        would wait forever: past `backend.actor_start_timeout_s` the pool goes on with those that
        started, and the run stops with a ConfigError if none did."""
        actors = [self.remote_actor.options(**pool.options).remote(self.config) for _ in range(count)]
        pending = {actor.ready.remote(): actor for actor in actors}
        started: list[Any] = []
        limit = self.config.backend.actor_start_timeout_s
        deadline = time.monotonic() + limit if limit else None
        while pending:
            wait = START_REPORT_S if deadline is None else max(0.0, min(START_REPORT_S, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait)
            for ref in ready:
                ray.get(ref)  # raises what an actor's constructor raised
                started.append(pending.pop(ref))
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            log.warning("waiting for %d of %d client actors (%s) to start; the Ray cluster has %s free",
                        len(pending), count, pool.options, ray.available_resources())
        if pending:
            for actor in pending.values():
                ray.kill(actor)
            if not started and not pool.actors:
                raise ConfigError("backend.actor_start_timeout_s", limit,
                                  f"time for the Ray cluster to start a client actor asking for {pool.options}, but none started "
                                  f"(the cluster has {ray.cluster_resources()}): lower backend.num_cpus_per_client or "
                                  "backend.actors_per_pool, or wait longer for a cluster that is scaling up")
            pool.size = len(pool.actors) + len(started)
            log.warning("only %d of %d client actors (%s) started within %gs: the pool goes on with %d",
                        len(started), count, pool.options, limit, pool.size)
        return started

    # -- a round ------------------------------------------------------------------------------
    def run(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        state_ref = ray.put({k: v.cpu() for k, v in global_state.items()})  # once per round
        queues: dict[str, deque[int]] = {}
        for i, task in enumerate(tasks):
            queues.setdefault(self._pool_name(task), deque()).append(i)
        for name, queue in queues.items():
            pool = self.pools[name]
            # Replacements started late last round may still be starting: wait, so no client's
            # timeout includes an actor's start-up.
            ray.get([actor.ready.remote() for actor in pool.actors])
            pool.actors += self._spawn(pool, max(min(pool.size, len(queue)) - len(pool.actors), 0))
        results: dict[int, ClientUpdate] = {}
        failed: list[dict[str, Any]] = []
        in_flight: dict[Any, tuple[int, str, Any, float]] = {}  # ref -> (task, pool, actor, started)
        starting: dict[Any, tuple[str, Any]] = {}  # ready ref of a replacement actor -> (pool, actor)
        idle = {name: list(self.pools[name].actors) for name in queues}

        def submit(name: str) -> None:
            while queues[name] and idle[name]:
                i, actor = queues[name].popleft(), idle[name].pop()
                ref = actor.train.remote(state_ref, tasks[i])
                in_flight[ref] = (i, name, actor, time.monotonic())

        def replace(name: str, dead: Any) -> None:
            """Start a fresh actor in the dead one's place; it takes work once it is ready, so its
            start-up never counts against a client's timeout."""
            pool = self.pools[name]
            fresh = self.remote_actor.options(**pool.options).remote(self.config)
            pool.actors[pool.actors.index(dead)] = fresh
            starting[fresh.ready.remote()] = (name, fresh)

        for name in queues:
            submit(name)
        while in_flight or (starting and any(queues.values())):
            done, _ = ray.wait([*in_flight, *starting], num_returns=1, timeout=1.0)
            for ref in done:
                if ref in starting:
                    name, actor = starting.pop(ref)
                    idle[name].append(actor)
                    submit(name)
                    continue
                i, name, actor, _ = in_flight.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    idle[name].append(actor)
                except ray.exceptions.RayActorError as error:
                    failed.append(self._failure(tasks[i], "actor died", error))
                    replace(name, actor)
                except Exception as error:  # noqa: BLE001 - the client's own error (including CUDA out of memory)
                    failed.append(self._failure(tasks[i], "raised", error))
                    idle[name].append(actor)
                submit(name)
            now = time.monotonic()
            for ref, (i, name, actor, started) in list(in_flight.items()):
                if self.timeout and now - started > self.timeout:
                    del in_flight[ref]
                    ray.kill(actor)
                    failed.append({"id": tasks[i].ctx.client_id, "reason": f"timed out after {self.timeout:g}s"})
                    replace(name, actor)
        return [results[i] for i in sorted(results)], failed

    @staticmethod
    def _failure(task: ClientTask, kind: str, error: BaseException) -> dict[str, Any]:
        cause = getattr(error, "cause", None) or error
        lines = str(cause).strip().splitlines() or [type(cause).__name__]
        first_line = lines[-1].split(". ")[0]  # Ray's death notices run on for a paragraph
        log.warning("client %d %s in round %d: %s", task.ctx.client_id, kind, task.ctx.round, first_line)
        return {"id": task.ctx.client_id, "reason": f"{kind}: {type(cause).__name__}: {first_line}"[:500]}

    def close(self) -> None:
        for pool in self.pools.values():
            for actor in pool.actors:
                ray.kill(actor)
        self.pools.clear()
