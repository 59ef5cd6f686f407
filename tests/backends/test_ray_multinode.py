"""A Ray cluster of three nodes on loopback, driven as a user drives one: `ray job submit` (the
README's single-head form is the same submission to a smaller cluster, so it has no cluster of its own).

The head has 1 CPU and runs the driver; worker `small` has 1 CPU and `hfl_tier_small: 1`; worker
`large` has 1 CPU, 1 (declared) GPU and `hfl_tier_large: 1`. Custom resources and GPUs are only
declarations to Ray's scheduler, so the placement hfl asks for is tested for real without GPUs. The
`small` worker runs in its own mount namespace in which the folder holding the data is empty: a
node without the data.
"""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from hfl.config import load_config
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.backends.loopback_cluster import RAY, LoopbackCluster
from tests.conftest import QUICKSTART, ROOT, cli_env
from tests.data.test_datasets import fake_mnist

pytestmark = pytest.mark.slow
TIERS = ["budgets.scenario=tiers", "budgets.memory=[width:1,width:1]", "budgets.names=[small,large]"]
RUN = ["fl.rounds=2", "fl.clients=8", "fl.fraction=1.0", "fl.local_epochs=1", *TIERS]


def can_hide_folders() -> bool:
    """Whether this machine lets us start a process in a mount namespace of its own (root, unshare)."""
    probe = ["unshare", "--mount", "--propagation", "private", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(dashboard address, env, {tier: node id}, the folder the `small` node cannot see)."""
    hidden = tmp_path_factory.mktemp("hidden")  # data and cache of the job that must fail
    cluster = LoopbackCluster(Path("/tmp") / f"hfl-mn-{os.getpid()}", cli_env())
    hide = ("unshare", "--mount", "--propagation", "private", "sh", "-c", f'mount -t tmpfs none "{hidden}" && exec "$@"', "sh")
    try:
        cluster.start("head", "--num-cpus=1")
        cluster.start("small", "--num-cpus=1", '--resources={"hfl_tier_small": 1}', wrapper=hide if can_hide_folders() else ())
        cluster.start("large", "--num-cpus=1", "--num-gpus=1", '--resources={"hfl_tier_large": 1}')
        alive = cluster.alive()
        tiers = {k[len("hfl_tier_"):]: n["node_id"] for n in alive for k in n["resources_total"] if k.startswith("hfl_tier_")}
        yield cluster.address, cluster.env, tiers, hidden
    finally:
        cluster.stop()


REFUSED_BEFORE_SUBMISSION = "Request failed with status code 500"
"""What the dashboard answers while the head's job agent cannot take a job yet (ray-project/ray's
"No available agent to submit job, please try again later", or its agent's aiohttp error): the job
was never created, so submitting again is what a user would do."""


def submit(address, env, command, runtime_env=None):
    runtime = ["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []
    job = [RAY, "job", "submit", "--address", address, "--working-dir", str(ROOT), *runtime, "--", *command]
    for _ in range(3):
        result = subprocess.run(job, env=env, capture_output=True, text=True, timeout=900, check=False)
        if REFUSED_BEFORE_SUBMISSION not in result.stdout + result.stderr or "submitted successfully" in result.stdout:
            return result
        time.sleep(5)
    return result


def test_tiers_run_on_their_nodes_gpu_tiers_get_gpus_and_results_outlive_the_job(cluster, tmp_path):
    address, env, tiers, _ = cluster
    out = tmp_path / "shared" / "run"  # a file:// URI, as s3:// or gs:// would be on a real cluster
    # The head has no GPU, so the large tier's share of a GPU comes from the GPU memory given here.
    command = ["hfl", "run", "experiments/quickstart.yaml", "backend.name=ray", "backend.gpu_memory=4MB",
               "backend.actor_start_timeout_s=120", *RUN, "--out", f"file://{out}"]
    result = submit(address, env, command, {"env_vars": {"HFL_DATA": str(tmp_path / "data")}})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout + result.stderr

    records = read_metrics(out)
    clients = [c for r in records for c in r["clients"]]
    assert len(clients) == 16 and all(c["ray_node"] == tiers[c["tier"]] for c in clients)  # every client on its tier's node
    large = [c for c in clients if c["tier"] == "large"]
    small = [c for c in clients if c["tier"] == "small"]
    assert large and small
    assert all(0 < c["ray_resources"]["GPU"] <= 1 and c["ray_gpu_ids"] for c in large)  # Ray assigned them GPUs
    assert all("GPU" not in c["ray_resources"] and not c["ray_gpu_ids"] for c in small)
    # The large tier's pool was sized by its node (1 actor), not by the cluster's 3 CPUs: none of
    # its actors waited for room, so round 1 did not wait out backend.actor_start_timeout_s.
    assert records[0]["wall_seconds"] < 120
    assert len({c["ray_node"] for c in clients}) == 2

    local = run_experiment(load_config(QUICKSTART, RUN), tmp_path / "local")
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["final_accuracy"], summary["final_loss"]) == (local["final_accuracy"], local["final_loss"])
    assert [[(c["id"], c["train_loss"]) for c in r["clients"]] for r in records] == \
        [[(c["id"], c["train_loss"]) for c in r["clients"]] for r in read_metrics(tmp_path / "local")]


def test_a_relative_out_under_a_job_is_refused_naming_where_results_would_go(cluster):
    address, env, _, _ = cluster
    result = submit(address, env, ["hfl", "run", "experiments/quickstart.yaml", "backend.name=ray", "--out", "runs/x"])
    assert result.returncode != 0
    assert "hfl: error: --out='runs/x' is not allowed" in result.stdout + result.stderr
    assert "deletes with the job" in result.stdout + result.stderr


def test_an_actor_on_a_node_without_the_data_stops_the_run_naming_the_node_and_the_path(cluster):
    address, env, tiers, hidden = cluster
    if not can_hide_folders():
        pytest.skip("needs a mount namespace of its own (unshare as root) to hide the data from one node")
    data, cache = hidden / "data", hidden / "cache"
    fake_mnist(data, n_train=80)  # a folder MNIST's loader reads; the test needs its presence on one node, not real digits
    command = ["hfl", "run", "experiments/quickstart.yaml", "data.name=mnist", "data.partition=iid", f"data.cache_dir={cache}",
               "backend.name=ray", "backend.gpu_memory=4MB", *RUN, "--out", str(hidden / "run")]
    result = submit(address, env, command, {"env_vars": {"HFL_DATA": str(data)}})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    line = next(line for line in output.splitlines() if line.startswith("hfl: error:"))
    assert f"({tiers['small'][:12]})" in line and "mnist not found" in line and str(data) in line
    assert "Traceback" not in output
