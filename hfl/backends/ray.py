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

A cluster loses nodes. Every wait on it has a deadline, so a node that dies fails the clients on
it for that round (`failed_clients`, with the reason), never the run: pools are planned again from
the nodes alive at each round, a tier whose every node is gone runs on CPU actors of the others
(or stops the run, with `backend.tier_strict`), and its pool grows back when a node returns. A
head that stops answering stops the run within `backend.head_grace_s` with a `ClusterError`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from hfl.accounting.amounts import ClientBudget, absolute_amount
from hfl.backends.base import ClusterError
from hfl.backends.placement import SHARED_POOL, PoolDemand, gpus_per_actor, pool_sizes, tier_resource
from hfl.config import ExperimentConfig
from hfl.errors import ConfigError, DataNotFoundError
from hfl.experiment import ClientEnvironment
from hfl.registry import BACKENDS
from hfl.simulation.devices import DEADLINE_TIER
from hfl.types import ClientTask, ClientUpdate, StateDict

log = logging.getLogger(__name__)
START_REPORT_S = 30.0  # how often a pool waiting for its actors says so


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


class HeadWatch:
    """Whether the cluster's head still answers: a TCP connection to its GCS port, which, unlike a
    Ray call, cannot block on a head that is gone."""

    def __init__(self, address: str, grace_s: float) -> None:
        self.address, self.grace_s = address, grace_s
        self.lost_since: float | None = None
        self.checked = -1.0

    def answers(self) -> bool:
        host, _, port = self.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2.0).close()
            return True
        except OSError:
            return False

    def check(self) -> None:
        """Raise a ClusterError once the head has not answered for `grace_s` (asked at most once a second)."""
        now = time.monotonic()
        if now - self.checked < 1.0:
            return
        self.checked = now
        if self.answers():
            self.lost_since = None
            return
        if self.lost_since is None:
            self.lost_since = now
            log.warning("the Ray cluster's head (GCS at %s) does not answer; the run stops unless it answers within %gs",
                        self.address, self.grace_s)
        if now - self.lost_since >= self.grace_s:
            raise ClusterError(f"the Ray cluster's head (GCS at {self.address}) stopped answering for {self.grace_s:g}s: "
                               "the run stopped after its last complete round")

    def wait(self) -> None:
        """Return once the head answers (at once, normally); a ClusterError past `grace_s`."""
        while True:
            self.checked = -1.0
            self.check()
            if self.lost_since is None:
                return
            time.sleep(1.0)

    def call(self, ask: Callable[[], Any]) -> Any:
        """`ask()`, a Ray call that needs the head (`ray.nodes()`, `ray.kill`), once the head
        answers; a ClusterError once it has not answered for `grace_s`, also while `ask` is under
        way. The head can die between answering and the call, which then waits for it (Ray ends
        the process after a minute, with a message of its own): the call runs in a daemon thread of
        its own, which a process that stops does not wait for."""
        self.wait()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = ask()
            except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
                outcome["error"] = error

        asking = threading.Thread(target=run, daemon=True, name="hfl-ray-head-call")
        asking.start()
        while asking.is_alive():
            asking.join(min(1.0, self.grace_s))
            if asking.is_alive():
                self.checked = -1.0
                self.check()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    @property
    def lost(self) -> bool:
        return self.lost_since is not None and time.monotonic() - self.lost_since >= self.grace_s


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
        if not ray.is_initialized():
            # Joins the cluster in RAY_ADDRESS (set by `ray job submit`) or one started on this
            # machine by `ray start`; with neither, starts a local one.
            ray.init(
                include_dashboard=False,
                log_to_driver=config.backend.ray_log_to_driver,
                configure_logging=False,
            )
        self.head = HeadWatch(ray.get_runtime_context().gcs_address, config.backend.head_grace_s)
        self.remote_actor = ray.remote(ClientActor)
        self.timeout = config.backend.client_timeout_s or None
        self.started = False
        """Whether a round has been submitted: before it, a pool that cannot start is a config error."""
        self.nodes = self._alive_nodes()
        self.tiered = False
        """Whether the cluster has advertised a tier: then the shared pool is a fallback, on CPU actors."""
        self.pools: dict[str, Pool] = {}
        self.booting: dict[str, list[Any]] = {}
        self.pool_of: list[str] = []
        """The pool serving each client."""
        self._replan(self.nodes)
        # Every pool's actors start now, tier pools first (a shared-pool actor could otherwise take a
        # CPU only a tier's node offers), and build their environments while this process sets up
        # the run; the first round waits for them.
        clients = {name: self.pool_of.count(name) for name in self.pools}
        self.booting = {name: self._start(self.pools[name], min(self.pools[name].size, clients[name]))
                        for name in sorted(self.pools, key=lambda n: n == SHARED_POOL)}

    # -- pools --------------------------------------------------------------------------------
    def _alive_nodes(self) -> dict[str, dict[str, float]]:
        """The resources of every node alive now, by node id (after the head answers: `ray.nodes()`
        would block on a head that is gone)."""
        return {node["NodeID"]: node["Resources"] for node in self.head.call(ray.nodes) if node.get("Alive")}

    def _replan(self, nodes: dict[str, dict[str, float]]) -> None:
        """Plan the pools for `nodes` and move to them: a pool whose actors ask for the same keeps
        them (its size may change), any other's actors stop."""
        plan = self._plan_pools(list(nodes.values()))
        for name, pool in list(self.pools.items()):
            if name not in plan or plan[name].options != pool.options:
                for actor in pool.actors + self.booting.pop(name, []):
                    self.kill(actor)
                del self.pools[name]
        for name, pool in plan.items():
            kept = self.pools.setdefault(name, pool)
            kept.size = pool.size
            for actor in kept.actors[kept.size:]:
                self.kill(actor)
            del kept.actors[kept.size:]
        self.pool_of = [self._pool_name(budget) for budget in self.environment.budgets]
        self.nodes = nodes

    def _pool_name(self, budget: ClientBudget | None) -> str:
        return budget.tier if budget is not None and budget.tier in self.pools else SHARED_POOL

    def _plan_pools(self, nodes: list[dict[str, float]]) -> dict[str, Pool]:
        """One pool per tier the cluster advertises (`hfl_tier_<name>`), one shared pool for the
        other clients; each sized by what the nodes can host, and asking for GPUs where its nodes
        have them. Decided from the cluster's alive nodes, never from the driver's own machine,
        which may be a head without GPUs. A tier that no node advertises, on a cluster that has
        advertised tiers, runs on the shared pool's CPU actors, with a warning naming it; with
        `backend.tier_strict`, it stops the run."""
        backend = self.config.backend
        advertised = {key for node in nodes for key in node}
        self.tiered = self.tiered or any(key.startswith(tier_resource("")) for key in advertised)
        members: dict[str, list[ClientBudget | None]] = {}
        for budget in self.environment.budgets:
            tier = budget.tier if budget is not None and tier_resource(budget.tier) in advertised else SHARED_POOL
            members.setdefault(tier, []).append(budget)
        # A time budget alone (fl.deadline_plans, no other budgets: tier `all`) names no node's tier: the shared pool is its home.
        homeless = sorted({b.tier for b in members.get(SHARED_POOL, []) if b is not None and b.tier and b.tier != DEADLINE_TIER}) if self.tiered else []
        if homeless:
            missing = ", ".join(tier_resource(t) for t in homeless)
            if backend.tier_strict:
                why = f"no live node of the Ray cluster advertises {missing} (tier {', '.join(homeless)})"
                if not self.started:
                    raise ConfigError("backend.tier_strict", True, f"false (its clients then run on CPU actors of other nodes), or a "
                                      f"cluster with such a node: {why}")
                raise ClusterError(f"{why}, and backend.tier_strict is set: the run stopped after its last complete round")
            log.warning("ray: no live node advertises %s: the clients of tier %s run on CPU actors of the other nodes until one does",
                        missing, ", ".join(homeless))
        demands, options = {}, {}
        for name, budgets in members.items():
            resource = None if name == SHARED_POOL else tier_resource(name)
            hosts = [node for node in nodes if resource is None or node.get(resource, 0) > 0]
            gpus = gpus_per_actor(backend, name, budgets, hosts, self._device_memory(len(nodes)), fallback=name == SHARED_POOL and self.tiered)
            demands[name] = PoolDemand(resource, gpus, len(budgets))
            options[name] = {"num_cpus": backend.num_cpus_per_client, **({"num_gpus": gpus} if gpus else {}),
                             **({"resources": {resource: 1}} if resource else {})}
        sizes = pool_sizes(nodes, demands, backend.num_cpus_per_client, backend.actors_per_pool)
        pools = {}
        for name, size in sizes.items():
            if size == 0:  # nothing can host it now: one actor, which an autoscaling cluster may yet place
                log.warning("ray pool %s: no node of the cluster (%s) can host an actor asking for %s now; asking for one "
                            "and waiting up to backend.actor_start_timeout_s for it", name, self.head.call(ray.cluster_resources), options[name])
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

    def can_host(self, pool: Pool) -> bool:
        """Whether a node alive now advertises all that an actor of `pool` asks for (free or not)."""
        wants = {"CPU": pool.options["num_cpus"], "GPU": pool.options.get("num_gpus", 0), **pool.options.get("resources", {})}
        return any(all(node.get(k, 0.0) >= v - 1e-9 for k, v in wants.items() if v > 0) for node in self._alive_nodes().values())

    def kill(self, actor: Any) -> None:
        """Stop `actor` (Ray's kill asks the head: `HeadWatch.call`)."""
        self.head.call(lambda: ray.kill(actor))

    def _start(self, pool: Pool, count: int) -> list[Any]:
        return [self.remote_actor.options(**pool.options).remote(self.config) for _ in range(count)]

    def _spawn(self, name: str, actors: list[Any]) -> tuple[list[Any], int]:
        """Wait until started `actors` are built, so start-up never counts against a client's
        timeout, and return those that are. Actors the cluster cannot place (more CPUs asked than it
        has, more actors than fit) would wait forever: past `backend.actor_start_timeout_s` the pool
        goes on with those that started. Before the first round, while none of the pool has started
        and a live node can host one, they are booting, not waiting for room (on a loaded machine,
        importing torch takes minutes), and the limit waits for the first; the run stops with a
        ConfigError if none started and no node can host one; later (a node went away), the pool's
        clients fail for the round. An actor that died (its node did) is left out. An actor that
        cannot build the experiment (no data on its node) stops the run with that actor's one-line
        reason. Returns the started actors and how many died."""
        pool = self.pools[name]
        count = len(actors)
        pending = {actor.ready.remote(): actor for actor in actors}
        started: list[Any] = []
        died = 0
        limit = self.config.backend.actor_start_timeout_s
        deadline = time.monotonic() + limit if limit else None

        def past_deadline() -> bool:
            if deadline is None or time.monotonic() < deadline:
                return False
            return bool(started or pool.actors or self.started) or not self.can_host(pool)

        while pending:
            left = START_REPORT_S if deadline is None else deadline - time.monotonic()
            report = time.monotonic() + (START_REPORT_S if left <= 0 else min(START_REPORT_S, left))
            while pending and time.monotonic() < report and not (started and past_deadline()):
                self.head.check()
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(1.0, max(0.0, report - time.monotonic())))
                for ref in ready:
                    actor = pending.pop(ref)
                    try:
                        problem = ray.get(ref)  # raises what an actor's constructor raised
                    except ray.exceptions.RayActorError as error:
                        log.warning("ray pool %s: an actor did not start: %s", name, RayBackend._first_line(error))
                        died += 1
                        continue
                    if problem is not None:
                        for other in [*actors, *pool.actors]:
                            self.kill(other)
                        raise DataNotFoundError(problem)
                    started.append(actor)
                # Mid-run, actors no live node can host were meant for a node that went away (before
                # the first round, an autoscaling cluster may still be adding theirs).
                if pending and self.started and not self.can_host(pool):
                    log.warning("ray pool %s: no live node can host an actor asking for %s now", name, pool.options)
                    deadline = time.monotonic()
                    break
            if not pending or past_deadline():
                break
            log.warning("waiting for %d of %d client actors (%s) to start; the Ray cluster has %s free",
                        len(pending), count, pool.options, self.head.call(ray.available_resources))
        if pending:
            for actor in pending.values():
                self.kill(actor)
            if not started and not pool.actors and not self.started:
                raise ConfigError("backend.actor_start_timeout_s", limit,
                                  f"time for the Ray cluster to start a client actor asking for {pool.options}, but none started "
                                  f"(the cluster has {self.head.call(ray.cluster_resources)}): lower {self._what_to_lower(pool)}, or wait "
                                  "longer for a cluster that is scaling up")
            log.warning("only %d of %d client actors (%s) started within %gs: the pool goes on with %d",
                        len(started), count, pool.options, limit, len(pool.actors) + len(started))
        return started, died

    def _what_to_lower(self, pool: Pool) -> str:
        """The settings behind what `pool`'s actors ask for, for a hint when none could start."""
        settings = ["backend.num_cpus_per_client", "backend.actors_per_pool"]
        if pool.options.get("num_gpus"):
            settings.insert(1, "the GPU share (backend.num_gpus_per_client, backend.num_gpus_per_tier, or the budget over backend.gpu_memory)")
        return " or ".join(settings)

    # -- a round ------------------------------------------------------------------------------
    def submit(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> RayRound:
        """Start the round's clients on their pools' actors and return at once: the driver may
        evaluate the last round meanwhile. `collect` waits for them."""
        state_ref = ray.put({k: v.cpu() for k, v in global_state.items()})  # once per round
        for attempt in (1, 2):
            nodes = self._alive_nodes()
            # Resources too, not only node ids: a node that has just joined may list its custom
            # resources (hfl_tier_*) a moment after it is alive.
            if nodes != self.nodes:
                log.warning("ray: the cluster's live nodes or their resources changed (%d -> %d nodes): planning the pools again",
                            len(self.nodes), len(nodes))
                self._replan(nodes)
            members: dict[str, list[int]] = {}
            for i, task in enumerate(tasks):
                members.setdefault(self.pool_of[task.ctx.client_id], []).append(i)
            # Tier pools start first: an actor of the shared pool could otherwise take a CPU that only a
            # tier's node offers.
            empty = [name for name in sorted(members, key=lambda n: n == SHARED_POOL) if not self._fill(name, len(members[name]))]
            # A pool none of whose actors started may have lost its nodes since they were counted:
            # planned again, its clients may go to another pool.
            if not empty or attempt == 2 or self._alive_nodes() == self.nodes:
                break
        queues: dict[str, deque[list[int]]] = {}
        failed: list[dict[str, Any]] = []
        for name, indices in members.items():
            pool = self.pools[name]
            if not pool.actors:
                reason = f"node lost: no actor of Ray pool {name} ({pool.options}) could start"
                failed.extend(self._lost(tasks[i], reason) for i in indices)
                continue
            units = self.environment.work_units([tasks[i] for i in indices], self.config.backend.batch_clients, spread=len(pool.actors))
            queues[name] = deque([indices[j] for j in unit] for unit in units)
        self.started = True
        round_ = RayRound(self, tasks, state_ref, queues)
        round_.failed.extend(failed)
        for name in queues:
            round_.submit(name)
        return round_

    def _fill(self, name: str, clients: int) -> bool:
        """Bring pool `name` to as many ready actors as it may have for `clients` clients; whether it has any.
        Started actors answer at once, unless they died with their node; replacements started late
        last round may still be starting: waited for, so no client's timeout includes an actor's start-up."""
        pool = self.pools[name]
        want = min(pool.size, clients)
        booting = self.booting.pop(name, [])
        more = max(want - len(pool.actors) - len(booting), 0)
        actors, pool.actors = pool.actors, []
        pool.actors, died = self._spawn(name, actors + booting + self._start(pool, more))
        # Actors that died since the last round (alone, or with a node whose loss the cluster has
        # not noticed yet) are replaced once, where a live node can host them.
        if died and len(pool.actors) < want and self.can_host(pool):
            pool.actors += self._spawn(name, self._start(pool, min(died, want - len(pool.actors))))[0]
        return bool(pool.actors)

    def collect(self, round_: RayRound) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        """The updates of a submitted round (in task order) and its failed clients."""
        return round_.wait()

    @staticmethod
    def _first_line(error: BaseException) -> str:
        cause = getattr(error, "cause", None) or error
        lines = str(cause).strip().splitlines() or [type(cause).__name__]
        return f"{type(cause).__name__}: {lines[-1].strip().split('. ')[0]}"  # Ray's death notices run on for a paragraph

    @staticmethod
    def _failure(task: ClientTask, kind: str, error: BaseException) -> dict[str, Any]:
        return RayBackend._lost(task, f"{kind}: {RayBackend._first_line(error)}")

    @staticmethod
    def _lost(task: ClientTask, reason: str) -> dict[str, Any]:
        log.warning("client %d failed in round %d: %s", task.ctx.client_id, task.ctx.round, reason)
        return {"id": task.ctx.client_id, "reason": reason[:500]}

    def close(self) -> None:
        if not self.head.lost:  # ray.kill would wait for a head that is gone
            try:
                for actor in [a for pool in self.pools.values() for a in pool.actors] + [a for b in self.booting.values() for a in b]:
                    self.kill(actor)
            except ClusterError as error:  # the head went while the run was ending: its actors go with the cluster
                log.warning("ray: %s", error)
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
        self.starting: dict[Any, tuple[str, Any, float]] = {}  # ready ref of a replacement actor -> (pool, actor, when asked)
        self.why: dict[str, str] = {}
        """Per pool, why it lost an actor this round: the reason of the clients it can no longer train."""

    def submit(self, name: str) -> None:
        """Fill the pool's ready actors up to PIPELINE units each, one unit per actor at a time."""
        starting = {actor for _, actor, _ in self.starting.values()}
        ready = [a for a in self.backend.pools[name].actors if a not in starting]
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

    def lose(self, name: str, actor: Any, failure: Callable[[ClientTask], dict[str, Any]], why: str) -> None:
        """The actor is gone: its training unit failed, the units waiting on it go back to the
        pool's queue, and a fresh actor takes its place once it is ready, so its start-up never
        counts against a client's timeout; where no live node can host one (its node died), the
        pool goes on with the actors it has."""
        units = self.sent.pop(actor)
        self.failed.extend(failure(self.tasks[i]) for i in units[0][1])
        for ref, unit in reversed(units):
            self.owner.pop(ref, None)
            if unit is not units[0][1]:
                self.queues[name].appendleft(unit)
        pool = self.backend.pools[name]
        self.why[name] = why
        if self.backend.can_host(pool):
            fresh = self.backend.remote_actor.options(**pool.options).remote(self.backend.config)
            pool.actors[pool.actors.index(actor)] = fresh
            self.starting[fresh.ready.remote()] = (name, fresh, time.monotonic())
        else:
            log.warning("ray pool %s: no live node can host an actor asking for %s; the round goes on without it", name, pool.options)
            pool.actors.remove(actor)

    def started(self, ref: Any) -> None:
        """A replacement actor answered: it trains the pool's waiting units, or, where it failed
        to start (its node died too), the pool goes on without it for this round."""
        name, actor, _ = self.starting.pop(ref)
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as error:
            self.why[name] = f"its replacement did not start: {RayBackend._first_line(error)}"
            log.warning("ray pool %s: a replacement actor did not start: %s", name, self.why[name])
            self.backend.pools[name].actors.remove(actor)
            return
        self.submit(name)

    def wait(self) -> tuple[list[ClientUpdate], list[dict[str, Any]]]:
        timeout, start_limit = self.backend.timeout, self.backend.config.backend.actor_start_timeout_s
        while self.owner or (self.starting and any(self.queues.values())):
            self.backend.head.check()
            done, _ = ray.wait([*self.owner, *self.starting], num_returns=1, timeout=1.0)
            for ref in done:
                if ref in self.starting:
                    self.started(ref)
                    continue
                if ref not in self.owner:  # a unit requeued when its actor died
                    continue
                name, actor = self.owner.pop(ref)
                unit = next(u for r, u in self.sent[actor] if r == ref)
                try:
                    self.results.update(zip(unit, ray.get(ref)))
                except ray.exceptions.RayActorError as error:
                    self.lose(name, actor, lambda task, error=error: RayBackend._failure(task, "actor died", error),
                              f"its actor died: {RayBackend._first_line(error)}")
                    self.submit(name)
                    continue
                except Exception as error:  # noqa: BLE001 - the client's own error (including CUDA out of memory)
                    self.failed.extend(RayBackend._failure(self.tasks[i], "raised", error) for i in unit)
                self.sent[actor].remove((ref, unit))
                self.since[actor] = time.monotonic()  # the actor's next unit starts now
                self.submit(name)
            now = time.monotonic()
            for ref, (name, actor, asked) in list(self.starting.items()):
                pool = self.backend.pools[name]
                late = start_limit and now - asked > start_limit
                if late or not self.backend.can_host(pool):  # its node went away before it was placed
                    self.backend.kill(actor)
                    del self.starting[ref]
                    pool.actors.remove(actor)
                    self.why[name] = (f"its replacement did not start within backend.actor_start_timeout_s={start_limit:g}s" if late
                                      else "no live node can host its replacement")
            if timeout:
                for actor, units in list(self.sent.items()):
                    if units and now - self.since[actor] > timeout * len(units[0][1]):
                        name, _ = self.owner[units[0][0]]
                        self.backend.kill(actor)
                        self.lose(name, actor, lambda task: RayBackend._lost(task, f"timed out after {timeout:g}s"), "timed out")
                        self.submit(name)
        for name, queue in self.queues.items():  # units whose pool has no live actor left this round
            reason = f"node lost: Ray pool {name} has no live actor left ({self.why.get(name, 'none started')})"
            self.failed.extend(RayBackend._lost(self.tasks[i], reason) for unit in queue for i in unit)
        return [self.results[i] for i in sorted(self.results)], self.failed
