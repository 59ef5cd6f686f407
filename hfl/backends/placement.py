"""Where a Ray cluster can put hfl's client actors, decided from the resources its nodes advertise.

Pure functions of node resource dicts (as `ray.nodes()` reports them), so that placement is
decided, and tested, without a cluster, and never from the driver's own machine: a CPU head node
must still ask GPUs for the tiers whose nodes have them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hfl.accounting.amounts import ClientBudget
from hfl.config import BackendConfig
from hfl.errors import ConfigError

SHARED_POOL = "any"
"""The pool of the clients whose tier the cluster does not advertise."""


def tier_resource(tier: str) -> str:
    return f"hfl_tier_{tier}"


@dataclass(frozen=True)
class PoolDemand:
    """What one pool's actors each ask of a node, and how many clients it serves."""

    resource: str | None
    """The tier's custom resource (one unit per actor); None for the shared pool."""
    num_gpus: float
    clients: int


def pool_sizes(nodes: Sequence[Mapping[str, float]], demands: Mapping[str, PoolDemand], num_cpus: float, limit: int = 0) -> dict[str, int]:
    """How many actors of each pool the nodes (their advertised resources) can host at once.

    Actors are placed one at a time, first fit, on what earlier ones left: the tier pools take turns
    so that tiers advertised by one node share it, then the shared pool takes what is left. A pool
    never gets more actors than it has clients, nor more than `limit` (0: no limit). Sizing by the
    whole cluster's CPUs instead would ask for actors that only some nodes can host, and a round
    would wait for them until `backend.actor_start_timeout_s`."""
    free = [dict(node) for node in nodes]
    sizes = dict.fromkeys(demands, 0)
    cap = {name: min(d.clients, limit) if limit else d.clients for name, d in demands.items()}

    def fits(node: dict[str, float], d: PoolDemand) -> bool:
        wants = {"CPU": num_cpus, "GPU": d.num_gpus, **({d.resource: 1.0} if d.resource else {})}
        return all(node.get(key, 0.0) >= amount - 1e-9 for key, amount in wants.items() if amount > 0)

    for turn in ([n for n, d in demands.items() if d.resource], [n for n, d in demands.items() if not d.resource]):
        while turn:
            for name in list(turn):
                d = demands[name]
                node = next((node for node in free if fits(node, d)), None) if sizes[name] < cap[name] else None
                if node is None:
                    turn.remove(name)
                    continue
                node["CPU"] = node.get("CPU", 0.0) - num_cpus
                node["GPU"] = node.get("GPU", 0.0) - d.num_gpus
                if d.resource:
                    node[d.resource] -= 1.0
                sizes[name] += 1
    return sizes


def tier_gpu_shares(backend: BackendConfig) -> dict[str, float]:
    """`backend.num_gpus_per_tier` as {tier: share}."""
    return {rule.rpartition(":")[0]: float(rule.rpartition(":")[2]) for rule in backend.num_gpus_per_tier}


def gpus_per_actor(backend: BackendConfig, pool: str, budgets: Sequence[ClientBudget | None], hosts: Sequence[Mapping[str, float]],
                   device_memory: int | None, *, fallback: bool = False) -> float:
    """The GPUs each actor of `pool` asks for: the tier's share in `backend.num_gpus_per_tier`, else
    `backend.num_gpus_per_client` where set, else the largest memory budget of its clients over
    `device_memory`, the memory of one GPU (a whole GPU without budgets); 0 where the pool's nodes,
    `hosts`, advertise no GPU or the run is on the CPU. A `fallback` pool (the shared pool of a tiered
    cluster: clients of tiers no node advertises, or whose nodes are gone) asks for GPUs only where
    `backend.device=cuda` requires them: its clients were meant for other hardware, and a GPU share
    would keep its actors from starting on the CPUs the cluster has free."""
    has_gpus = any(node.get("GPU", 0) > 0 for node in hosts)
    where = "the cluster's nodes" if pool == SHARED_POOL else f"the nodes advertising {tier_resource(pool)}"
    share = tier_gpu_shares(backend).get(pool)
    if share and not has_gpus:
        raise ConfigError("backend.num_gpus_per_tier", list(backend.num_gpus_per_tier), f"{pool}:0 (or no rule for it): {where} advertise no GPU")
    if backend.num_gpus_per_client and not has_gpus and pool == SHARED_POOL and not fallback and backend.device != "cpu":
        # The one pool of an untiered cluster: the share would be honoured nowhere. (A tier whose
        # nodes have no GPU runs on CPU actors instead, so that one CPU tier forbids no other's share.)
        raise ConfigError("backend.num_gpus_per_client", backend.num_gpus_per_client, f"0: {where} advertise no GPU")
    if backend.device == "cpu" or not has_gpus or share == 0 or (fallback and backend.device != "cuda"):
        return 0.0
    if share or backend.num_gpus_per_client:
        return share or backend.num_gpus_per_client
    memory = [b.memory_bytes for b in budgets if b is not None]
    if not memory or None in memory:
        return 1.0
    if device_memory is None:
        raise ConfigError("backend.gpu_memory", backend.gpu_memory,
                          f"the memory of one GPU of {where} (e.g. 24GB), from which each actor's share of a GPU is its "
                          f"clients' memory budget over it (or set backend.num_gpus_per_client): the cluster advertises "
                          f"GPUs there, but the driver has none to read it from")
    return min(1.0, math.ceil(max(memory) / device_memory * 1e4) / 1e4)  # Ray counts GPU shares in steps of 1e-4
