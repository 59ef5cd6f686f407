"""RayBackend: clients as long-lived Ray actors, pooled per budget tier.

Each actor builds the experiment's ClientEnvironment once (data, partitions, a model per sub-model
shape) and then only loads weights in place. The global weights go into the object store once per
round, and each actor reads them once per round. Where the cluster advertises a tier's custom
resource (`hfl_tier_<name>`, see cluster.yaml) that tier's clients run on actors that hold it;
otherwise they share one pool of CPU actors. Placement is decided from the nodes the cluster
advertises, not from the driver's machine (often a CPU head): a pool holds as many actors as the
nodes that can host it have room for, and asks for GPUs where those nodes have them.

A round's clients go to their pool's actors as work units (a client, or with `backend.batch_clients`
several of one shape trained as one vectorised model), two queued per actor so that none idles
between units. A client that raises, dies, runs out of memory or times out is recorded and left
out of the aggregate; its actor is replaced and the round goes on. Every client's metrics record
the node it ran on and what Ray reserved for its actor.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from hfl.accounting.amounts import ClientBudget, absolute_amount
from hfl.backends.placement import SHARED_POOL, PoolDemand, gpus_per_actor, pool_sizes, tier_resource
from hfl.config import ExperimentConfig
from hfl.errors import ConfigError, DataNotFoundError
from hfl.experiment import ClientEnvironment
from hfl.registry import BACKENDS
from hfl.types import ClientTask, ClientUpdate, StateDict

log = logging.getLogger(__name__)
START_REPORT_S = 30.0  # how often a pool waiting for its actors says so


def cap_client_memory(env: ClientEnvironment, task: ClientTask | None) -> None:
    """On CUDA, let this process allocate at most the client's memory budget beyond what it holds
    for everything else (the data, other shapes' models), so that a client whose training exceeds
    its budget fails with an out-of-memory error instead of borrowing the device's memory; with no
    task (or no budget), lift the cap.

    The budget covers the client model's weights, as the estimate and the measurement do. The
    allocator caps the memory it reserves from the device, so its cache is emptied first: free
    cached blocks would otherwise be headroom outside the cap."""
    if env.device.type != "cuda":
        return
    # An index: set_per_process_memory_fraction refuses a bare torch.device("cuda").
    device = env.device.index if env.device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(1.0, device)  # the last client's cap must not bind this one's set-up
    budget = task.ctx.budget.memory_bytes if task is not None and task.ctx.budget else None
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
    """One simulated-client worker; trains whichever clients it is handed."""

    def __init__(self, config: ExperimentConfig) -> None:
        context = ray.get_runtime_context()
        self.placement = {"ray_node": context.get_node_id(), "ray_resources": context.get_assigned_resources(),
                          "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
        """Where Ray put this actor and what it reserved for it: recorded with every client it trains."""
        self.setup_error: str | None = None
        try:
            self.env = ClientEnvironment.from_config(config)
        except DataNotFoundError as error:
            # Kept, not raised: the driver stops the run with this one line and the node it happened on
            # (a node without the data) instead of Ray's paragraph about a dead actor.
            self.setup_error = f"on Ray node {ray.util.get_node_ip_address()} ({self.placement['ray_node'][:12]}): {error}"
        self.chaos = config.backend.chaos
        self.state_ref: ray.ObjectRef | None = None
        self.global_state: StateDict = {}

    def train(self, state: list[ray.ObjectRef], tasks: Sequence[ClientTask]) -> list[ClientUpdate]:
        """Train one work unit (a client, or several of one shape at once; see `ClientEnvironment.work_units`)
        from the round's global state, `state[0]`: a reference, in a list so that Ray hands it over
        unresolved, read once per round and kept (unpickling it costs milliseconds per client)."""
        if state[0] != self.state_ref:
            self.state_ref, self.global_state = state[0], ray.get(state[0])
        global_state = self.global_state
        for task in tasks:
            self._maybe_fail(task)
        # Clients trained together share one stacked model, which no single budget covers: uncapped.
        cap_client_memory(self.env, tasks[0] if len(tasks) == 1 else None)
        updates = self.env.train_unit(global_state, tasks)
        for update in updates:
            update.metrics.update(self.placement)
        return updates

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

    def ready(self) -> str | None:
        """None once the actor can train; else why it cannot: the data is missing on its node."""
        return self.setup_error


@dataclass
class Pool:
    """The actors serving one tier (or every client whose tier the cluster does not advertise)."""

    options: dict[str, Any]
    size: int
    actors: list[Any] = field(default_factory=list)


@BACKENDS.register("ray")
class RayBackend:
    PIPELINE = 2
    """Work units queued on an actor at once: the next one waits in the actor while it trains the
    current one, so no actor idles for a round trip to the driver between clients."""

    def __init__(self, environment: ClientEnvironment) -> None:
        self.environment = environment
        self.config = config = environment.config
        # The first optimiser step and the first evaluation import torch._dynamo (about a second on
        # 2 cores): a thread does it while this one waits for Ray to start, instead of in round 1.
        warm = threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True)
        warm.start()
        if not ray.is_initialized():
            # Joins the cluster in RAY_ADDRESS (set by `ray job submit`) or one started on this
            # machine by `ray start`; with neither, starts a local one.
            ray.init(
                include_dashboard=False,
                log_to_driver=config.backend.ray_log_to_driver,
                configure_logging=False,
            )
        self.remote_actor = ray.remote(ClientActor)
        self.timeout = config.backend.client_timeout_s or None
        self.pools = self._plan_pools()
        self.pool_of = [self._pool_name(budget) for budget in environment.budgets]
        """The pool serving each client."""
        # Every pool's actors start now, tier pools first (a shared-pool actor could otherwise take a
        # CPU only a tier's node offers), and build their environments while this process sets up
        # the run; the first round waits for them.
        clients = {name: self.pool_of.count(name) for name in self.pools}
        self.booting = {name: self._start(self.pools[name], min(self.pools[name].size, clients[name]))
                        for name in sorted(self.pools, key=lambda n: n == SHARED_POOL)}
        warm.join()

    # -- pools --------------------------------------------------------------------------------
    def _pool_name(self, budget: ClientBudget | None) -> str:
        return budget.tier if budget is not None and budget.tier in self.pools else SHARED_POOL

    def _plan_pools(self) -> dict[str, Pool]:
        """One pool per tier the cluster advertises (`hfl_tier_<name>`), one shared pool for the
        other clients; each sized by what the nodes can host, and asking for GPUs where its nodes
        have them. Decided from the cluster's alive nodes, never from the driver's own machine,
        which may be a head without GPUs."""
        backend = self.config.backend
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        advertised = {key for node in nodes for key in node}
        members: dict[str, list[ClientBudget | None]] = {}
        for budget in self.environment.budgets:
            tier = budget.tier if budget is not None and tier_resource(budget.tier) in advertised else SHARED_POOL
            members.setdefault(tier, []).append(budget)
        demands, options = {}, {}
        for name, budgets in members.items():
            resource = None if name == SHARED_POOL else tier_resource(name)
            hosts = [node for node in nodes if resource is None or node.get(resource, 0) > 0]
            gpus = gpus_per_actor(backend, name, budgets, hosts, self._device_memory(len(nodes)))
            demands[name] = PoolDemand(resource, gpus, len(budgets))
            options[name] = {"num_cpus": backend.num_cpus_per_client, **({"num_gpus": gpus} if gpus else {}),
                             **({"resources": {resource: 1}} if resource else {})}
        sizes = pool_sizes(nodes, demands, backend.num_cpus_per_client, backend.actors_per_pool)
        pools = {}
        for name, size in sizes.items():
            if size == 0:  # nothing can host it now: one actor, which an autoscaling cluster may yet place
                log.warning("ray pool %s: no node of the cluster (%s) can host an actor asking for %s now; asking for one "
                            "and waiting up to backend.actor_start_timeout_s for it", name, ray.cluster_resources(), options[name])
            pools[name] = Pool(options[name], max(size, 1))
            log.info("ray pool %s: %d actors with %s", name, pools[name].size, options[name])
        return pools

    def _device_memory(self, node_count: int) -> int | None:
        """`backend.gpu_memory`; else, on a one-node cluster (the driver's own), its GPU's memory."""
        if self.config.backend.gpu_memory:
            return absolute_amount(self.config.backend.gpu_memory)
        if node_count == 1 and torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
        return None

    def _start(self, pool: Pool, count: int) -> list[Any]:
        return [self.remote_actor.options(**pool.options).remote(self.config) for _ in range(count)]

    def _spawn(self, pool: Pool, actors: list[Any]) -> list[Any]:
        """Wait until started `actors` are built, so start-up never counts against a client's
        timeout. Actors the cluster cannot place (more CPUs asked than it has, more actors than fit)
        would wait forever: past `backend.actor_start_timeout_s` the pool goes on with those that
        started, and the run stops with a ConfigError if none did. An actor that cannot build the
        experiment (no data on its node) stops the run with that actor's one-line reason."""
        count = len(actors)
        pending = {actor.ready.remote(): actor for actor in actors}
        started: list[Any] = []
        limit = self.config.backend.actor_start_timeout_s
        deadline = time.monotonic() + limit if limit else None
        while pending:
            wait = START_REPORT_S if deadline is None else max(0.0, min(START_REPORT_S, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait)
            for ref in ready:
                started.append(pending.pop(ref))
                problem = ray.get(ref)  # raises what an actor's constructor raised
                if problem is not None:
                    for actor in [*actors, *pool.actors]:
                        ray.kill(actor)
                    raise DataNotFoundError(problem)
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
    def submit(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> RayRound:
        """Start the round's clients on their pools' actors and return at once: the driver may
        evaluate the last round meanwhile. `collect` waits for them."""
        state_ref = ray.put({k: v.cpu() for k, v in global_state.items()})  # once per round
        members: dict[str, list[int]] = {}
        for i, task in enumerate(tasks):
            members.setdefault(self.pool_of[task.ctx.client_id], []).append(i)
        queues: dict[str, deque[list[int]]] = {}
        # Tier pools start first: an actor of the shared pool could otherwise take a CPU that only a
        # tier's node offers.
        for name in sorted(members, key=lambda n: n == SHARED_POOL):
            pool = self.pools[name]
            # Replacements started late last round may still be starting: wait, so no client's
            # timeout includes an actor's start-up.
            ray.get([actor.ready.remote() for actor in pool.actors])
            booting = self.booting.pop(name, [])
            more = max(min(pool.size, len(members[name])) - len(pool.actors) - len(booting), 0)
            pool.actors += self._spawn(pool, booting + self._start(pool, more))
            mine = [tasks[i] for i in members[name]]
            units = self.environment.work_units(mine, self.config.backend.batch_clients, spread=len(pool.actors))
            queues[name] = deque([members[name][j] for j in unit] for unit in units)
        round_ = RayRound(self, tasks, state_ref, queues)
        for name in queues:
            round_.submit(name)
        return round_

    def collect(self, round_: RayRound) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        """The updates of a submitted round (in task order) and its failed clients."""
        return round_.wait()

    @staticmethod
    def _failure(task: ClientTask, kind: str, error: BaseException) -> dict[str, Any]:
        cause = getattr(error, "cause", None) or error
        lines = str(cause).strip().splitlines() or [type(cause).__name__]
        first_line = lines[-1].split(". ")[0]  # Ray's death notices run on for a paragraph
        log.warning("client %d %s in round %d: %s", task.ctx.client_id, kind, task.ctx.round, first_line)
        return {"id": task.ctx.client_id, "reason": f"{kind}: {type(cause).__name__}: {first_line}"[:500]}

    def close(self) -> None:
        for actor in [a for pool in self.pools.values() for a in pool.actors] + [a for b in self.booting.values() for a in b]:
            ray.kill(actor)
        self.pools.clear()


class RayRound:
    """One round's clients in flight on a RayBackend's actors, with what a failure needs to requeue them."""

    def __init__(self, backend: RayBackend, tasks: Sequence[ClientTask], state_ref: ray.ObjectRef, queues: dict[str, deque[list[int]]]) -> None:
        self.backend, self.tasks, self.state_ref, self.queues = backend, tasks, state_ref, queues
        self.results: dict[int, ClientUpdate] = {}
        self.failed: list[dict[str, Any]] = []
        self.sent: dict[Any, deque[tuple[Any, list[int]]]] = {}
        """Per actor, the units sent to it in order: the first is training (since `since`), the
        others wait in the actor's queue, which runs them in order."""
        self.since: dict[Any, float] = {}
        self.owner: dict[Any, tuple[str, Any]] = {}  # ref of a unit -> (pool, actor)
        self.starting: dict[Any, tuple[str, Any]] = {}  # ready ref of a replacement actor -> (pool, actor)

    def submit(self, name: str) -> None:
        """Fill the pool's ready actors up to PIPELINE units each, one unit per actor at a time."""
        ready = [a for a in self.backend.pools[name].actors if (name, a) not in self.starting.values()]
        for depth in range(1, self.backend.PIPELINE + 1):
            for actor in ready:
                if not self.queues[name]:
                    return
                if len(self.sent.setdefault(actor, deque())) >= depth:
                    continue
                unit = self.queues[name].popleft()
                ref = actor.train.remote([self.state_ref], [self.tasks[i] for i in unit])
                if not self.sent[actor]:
                    self.since[actor] = time.monotonic()
                self.sent[actor].append((ref, unit))
                self.owner[ref] = (name, actor)

    def lose(self, name: str, actor: Any, failure: Callable[[ClientTask], dict[str, Any]]) -> None:
        """The actor is gone: its training unit failed, the units waiting on it go back to the
        pool's queue, and a fresh actor takes its place once it is ready, so its start-up never
        counts against a client's timeout."""
        units = self.sent.pop(actor)
        self.failed.extend(failure(self.tasks[i]) for i in units[0][1])
        for ref, unit in reversed(units):
            self.owner.pop(ref, None)
            if unit is not units[0][1]:
                self.queues[name].appendleft(unit)
        pool = self.backend.pools[name]
        fresh = self.backend.remote_actor.options(**pool.options).remote(self.backend.config)
        pool.actors[pool.actors.index(actor)] = fresh
        self.starting[fresh.ready.remote()] = (name, fresh)

    def wait(self) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        timeout = self.backend.timeout
        while self.owner or (self.starting and any(self.queues.values())):
            done, _ = ray.wait([*self.owner, *self.starting], num_returns=1, timeout=1.0)
            for ref in done:
                if ref in self.starting:
                    self.submit(self.starting.pop(ref)[0])
                    continue
                if ref not in self.owner:  # a unit requeued when its actor died
                    continue
                name, actor = self.owner.pop(ref)
                unit = next(u for r, u in self.sent[actor] if r == ref)
                try:
                    self.results.update(zip(unit, ray.get(ref)))
                except ray.exceptions.RayActorError as error:
                    self.lose(name, actor, lambda task, error=error: RayBackend._failure(task, "actor died", error))
                    self.submit(name)
                    continue
                except Exception as error:  # noqa: BLE001 - the client's own error (including CUDA out of memory)
                    self.failed.extend(RayBackend._failure(self.tasks[i], "raised", error) for i in unit)
                self.sent[actor].remove((ref, unit))
                self.since[actor] = time.monotonic()  # the actor's next unit starts now
                self.submit(name)
            if timeout:
                now = time.monotonic()
                for actor, units in list(self.sent.items()):
                    if units and now - self.since[actor] > timeout * len(units[0][1]):
                        name, _ = self.owner[units[0][0]]
                        ray.kill(actor)
                        self.lose(name, actor, lambda task: {"id": task.ctx.client_id, "reason": f"timed out after {timeout:g}s"})
                        self.submit(name)
        return [self.results[i] for i in sorted(self.results)], self.failed
