"""Pool sizes and GPU shares from the nodes a cluster advertises (hfl/backends/placement.py): decided without Ray."""

import pytest

from hfl.accounting.amounts import ClientBudget
from hfl.backends.placement import SHARED_POOL, PoolDemand, gpus_per_actor, pool_sizes
from hfl.config import BackendConfig
from hfl.errors import ConfigError

HEAD = {"CPU": 1.0}
GPU_WORKER = {"CPU": 2.0, "GPU": 2.0, "hfl_tier_w1": 2.0}


def budget(tier, mib):
    return ClientBudget(tier, None if mib is None else mib * 2**20, None, None)


def test_a_tier_pool_is_sized_by_the_nodes_that_advertise_it_not_by_the_whole_cluster():
    # The stall of issue 31: sized by the cluster's 3 CPUs, the w1 pool asked for 3 actors and 2 fit.
    sizes = pool_sizes([HEAD, GPU_WORKER], {"w1": PoolDemand("hfl_tier_w1", 0.5, clients=8)}, num_cpus=1)
    assert sizes == {"w1": 2}


def test_tier_units_cpus_and_gpus_each_bound_a_pool():
    demand = {"w1": PoolDemand("hfl_tier_w1", 0.0, clients=8)}
    assert pool_sizes([{"CPU": 8.0, "hfl_tier_w1": 3.0}], demand, num_cpus=1) == {"w1": 3}  # tier units
    assert pool_sizes([{"CPU": 8.0, "hfl_tier_w1": 3.0}], demand, num_cpus=4) == {"w1": 2}  # CPUs
    gpus = {"w1": PoolDemand("hfl_tier_w1", 0.4, clients=8)}
    assert pool_sizes([{"CPU": 8.0, "GPU": 1.0, "hfl_tier_w1": 8.0}], gpus, num_cpus=1) == {"w1": 2}  # GPU shares
    assert pool_sizes([{"CPU": 8.0, "hfl_tier_w1": 8.0}], demand, num_cpus=1) == {"w1": 8}
    assert pool_sizes([{"CPU": 8.0, "hfl_tier_w1": 8.0}], {"w1": PoolDemand("hfl_tier_w1", 0.0, clients=3)}, num_cpus=1) == {"w1": 3}
    assert pool_sizes([{"CPU": 8.0, "hfl_tier_w1": 8.0}], demand, num_cpus=1, limit=5) == {"w1": 5}  # backend.actors_per_pool


def test_tiers_on_one_node_share_it_and_the_shared_pool_takes_what_is_left():
    nodes = [{"CPU": 4.0, "hfl_tier_a": 4.0, "hfl_tier_b": 4.0}, {"CPU": 3.0}]
    demands = {SHARED_POOL: PoolDemand(None, 0.0, 10), "a": PoolDemand("hfl_tier_a", 0.0, 10), "b": PoolDemand("hfl_tier_b", 0.0, 10)}
    assert pool_sizes(nodes, demands, num_cpus=1) == {SHARED_POOL: 3, "a": 2, "b": 2}
    assert pool_sizes([{"CPU": 0.0, "hfl_tier_a": 4.0}], {"a": PoolDemand("hfl_tier_a", 0.0, 4)}, num_cpus=1) == {"a": 0}


def test_gpu_shares_come_from_the_cluster_and_the_budget_not_from_the_driver():
    backend = BackendConfig()
    tier = [budget("w1", 300), budget("w1", 300)]
    assert gpus_per_actor(backend, "w1", tier, [GPU_WORKER], device_memory=1024 * 2**20) == pytest.approx(0.293)  # 300/1024, rounded up
    assert gpus_per_actor(backend, "w1", [budget("w1", None)], [GPU_WORKER], device_memory=None) == 1.0  # no budget: a whole GPU
    assert gpus_per_actor(BackendConfig(num_gpus_per_client=0.25), "w1", tier, [GPU_WORKER], device_memory=None) == 0.25
    assert gpus_per_actor(backend, "w1", tier, [HEAD], device_memory=None) == 0.0  # nodes without GPUs
    assert gpus_per_actor(BackendConfig(device="cpu"), "w1", tier, [GPU_WORKER], device_memory=2**30) == 0.0


def test_a_gpu_share_that_cannot_be_decided_or_placed_is_a_config_error():
    with pytest.raises(ConfigError) as info:  # a CPU head, GPU workers, budgets, and no GPU memory given
        gpus_per_actor(BackendConfig(), "w1", [budget("w1", 300)], [GPU_WORKER], device_memory=None)
    assert info.value.field == "backend.gpu_memory" and "hfl_tier_w1" in info.value.allowed
    with pytest.raises(ConfigError) as info:  # a tier's own share where its nodes have no GPU
        gpus_per_actor(BackendConfig(num_gpus_per_tier=("w1:0.5",)), "w1", [budget("w1", 300)], [HEAD], device_memory=None)
    assert info.value.field == "backend.num_gpus_per_tier" and "advertise no GPU" in info.value.allowed
    with pytest.raises(ConfigError) as info:  # the one pool of a cluster without GPUs: honoured nowhere
        gpus_per_actor(BackendConfig(num_gpus_per_client=0.5), SHARED_POOL, [budget("w1", 300)], [HEAD], device_memory=None)
    assert info.value.field == "backend.num_gpus_per_client" and "advertise no GPU" in info.value.allowed


def test_gpu_shares_are_per_tier_and_a_cpu_tier_forbids_no_other_tier_its_share():
    # Issue 46: one CPU-only tier used to refuse backend.num_gpus_per_client for every tier.
    backend = BackendConfig(num_gpus_per_client=0.25, num_gpus_per_tier=("big:0.5", "w1:0"))
    assert gpus_per_actor(backend, "small", [budget("small", 100)], [HEAD], device_memory=None) == 0.0  # CPU-only tier
    assert gpus_per_actor(backend, "mid", [budget("mid", 100)], [GPU_WORKER], device_memory=None) == 0.25
    assert gpus_per_actor(backend, "big", [budget("big", 100)], [GPU_WORKER], device_memory=None) == 0.5  # its own share
    assert gpus_per_actor(backend, "w1", [budget("w1", 100)], [GPU_WORKER], device_memory=None) == 0.0  # share 0: CPU actors


def test_the_fallback_pool_of_a_tiered_cluster_asks_for_cpus_only_unless_cuda_is_asked_for():
    # Issue 46: clients of a tier no node advertises asked for GPU shares and waited while CPUs sat free.
    tier = [budget("gone", 300)]
    assert gpus_per_actor(BackendConfig(), SHARED_POOL, tier, [HEAD, GPU_WORKER], device_memory=2**30, fallback=True) == 0.0
    assert gpus_per_actor(BackendConfig(device="cuda"), SHARED_POOL, tier, [HEAD, GPU_WORKER], device_memory=2**30, fallback=True) > 0
    assert gpus_per_actor(BackendConfig(), SHARED_POOL, tier, [HEAD, GPU_WORKER], device_memory=2**30) > 0  # an untiered cluster's GPUs


def planner(backend, budgets, *, started):
    """A RayBackend that only plans pools (no Ray): what `_plan_pools` reads of one."""
    from types import SimpleNamespace

    from hfl.backends.ray import RayBackend

    plan = object.__new__(RayBackend)
    plan.config = SimpleNamespace(backend=backend)
    plan.environment = SimpleNamespace(budgets=budgets)
    plan.tiered, plan.started = False, started
    return plan


def test_a_tier_no_live_node_advertises_runs_on_cpu_actors_with_a_warning_or_stops_a_strict_run(caplog):
    from hfl.backends.base import ClusterError

    nodes = [HEAD, GPU_WORKER]  # w1 is advertised, w2 (its node gone) is not
    budgets = [budget("w1", 300), budget("w2", 300), budget("w2", 300)]
    backend = BackendConfig(gpu_memory="1GB")
    pools = planner(backend, budgets, started=True)._plan_pools(nodes)
    assert pools["w1"].options["num_gpus"] > 0 and "num_gpus" not in pools[SHARED_POOL].options  # CPU actors for w2
    assert "no live node advertises hfl_tier_w2: the clients of tier w2 run on CPU actors" in caplog.text
    strict = BackendConfig(gpu_memory="1GB", tier_strict=True)
    with pytest.raises(ConfigError) as info:  # before the first round: a config the cluster cannot run
        planner(strict, budgets, started=False)._plan_pools(nodes)
    assert info.value.field == "backend.tier_strict" and "hfl_tier_w2" in info.value.allowed
    with pytest.raises(ClusterError, match="hfl_tier_w2 .*backend.tier_strict"):  # mid-run: the run stops, to be resumed
        planner(strict, budgets, started=True)._plan_pools(nodes)


def test_clients_with_a_time_budget_alone_run_on_the_shared_pool_without_a_warning_even_when_strict(caplog):
    from hfl.simulation.devices import DEADLINE_TIER

    nodes = [HEAD, GPU_WORKER]
    budgets = [budget("w1", 300), budget(DEADLINE_TIER, None), budget(DEADLINE_TIER, None)]
    pools = planner(BackendConfig(gpu_memory="1GB", tier_strict=True), budgets, started=False)._plan_pools(nodes)
    assert set(pools) == {"w1", SHARED_POOL} and "no live node advertises" not in caplog.text


def test_a_ray_call_under_way_when_the_head_dies_stops_the_run_within_the_grace_instead_of_waiting_for_it():
    """`HeadWatch.call`: the head answered before the call (a socket listens) and dies during it (the
    socket closes); the call would wait for it (here, until the test lets it go), and the run
    stops with a ClusterError once the head has not answered for the grace instead. A call that
    returns, or raises, while the head answers gives its value, or its error."""
    import socket
    import threading

    from hfl.backends.base import ClusterError
    from hfl.backends.ray import HeadWatch

    head = socket.create_server(("127.0.0.1", 0))
    watch = HeadWatch(f"127.0.0.1:{head.getsockname()[1]}", grace_s=0.5)
    assert watch.call(lambda: "nodes") == "nodes"
    with pytest.raises(KeyError):
        watch.call(lambda: {}["missing"])

    released = threading.Event()

    def blocked_on_a_dead_head():
        head.close()  # the head dies once the call is under way
        released.wait(60)  # a call that waits for a head that is gone: let go only once the test is done
        return "answered late"

    try:
        with pytest.raises(ClusterError, match="stopped answering for 0.5s"):
            watch.call(blocked_on_a_dead_head)
    finally:
        released.set()
    assert watch.lost
