"""A Ray cluster of three nodes on loopback, driven as a user drives one: `ray job submit` (the
README's single-head form is the same submission to a smaller cluster, so it has no cluster of its own).

The head has 1 CPU and runs the driver; worker `small` has 1 CPU and `hfl_tier_small: 1`; worker
`large` has 2 CPUs, 2 (declared) GPUs and `hfl_tier_large: 2`. Custom resources and GPUs are only
declarations to Ray's scheduler, so the placement hfl asks for is tested for real without GPUs. The
`small` worker runs in its own mount namespace in which the folder holding the data is empty: a
node without the data.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hfl.config import load_config
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.conftest import QUICKSTART, ROOT, cli_env
from tests.data.test_datasets import fake_mnist

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))
TIERS = ["budgets.scenario=tiers", "budgets.memory=[width:1,width:1]", "budgets.names=[small,large]"]
RUN = ["fl.rounds=2", "fl.clients=8", "fl.fraction=1.0", "fl.local_epochs=1", *TIERS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ports() -> list[str]:
    names = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "metrics-export-port", "runtime-env-agent-port")
    return [f"--{name}={free_port()}" for name in names]


def can_hide_folders() -> bool:
    """Whether this machine lets us start a process in a mount namespace of its own (root, unshare)."""
    probe = ["unshare", "--mount", "--propagation", "private", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(dashboard address, env, {tier: node id}, the folder the `small` node cannot see)."""
    hidden = tmp_path_factory.mktemp("hidden")  # data and cache of the job that must fail
    # Token authentication, as Ray >= 2.59 clusters have it by default and docs/cluster.md submits:
    # every node and `ray job submit` hold the cluster's token; this process asks the dashboard's
    # HTTP API with it (Ray's own client here keeps whatever auth mode an earlier test set up).
    token = secrets.token_hex(32)
    env = {**cli_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}
    port, dashboard = free_port(), free_port()
    temp = Path("/tmp") / f"hfl-mn-{os.getpid()}"  # Ray limits socket path lengths: keep it short
    quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    head = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}", "--num-cpus=1", f"--temp-dir={temp}",
            *node_ports()]
    join = [RAY, "start", "--block", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"]
    small = [*join, "--num-cpus=1", '--resources={"hfl_tier_small": 1}', *node_ports()]
    if can_hide_folders():
        small = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f'mount -t tmpfs none "{hidden}" && exec "$@"', "sh", *small]
    large = [*join, "--num-cpus=2", "--num-gpus=2", '--resources={"hfl_tier_large": 2}', *node_ports()]
    address = f"http://127.0.0.1:{dashboard}"

    nodes, alive, deadline = [], [], time.time() + 240
    try:
        # One node at a time: nodes starting at once on one machine pick the same socket and log names.
        for command in (head, small, large):
            nodes.append(subprocess.Popen(command, **quiet))
            while len(alive) < len(nodes):
                if time.time() > deadline:
                    pytest.fail(f"the 3-node Ray cluster did not start within 240 s ({len(alive)} nodes up)")
                time.sleep(2)
                try:
                    alive = [n for n in list_nodes(address, token) if n["state"] == "ALIVE"]
                except Exception:  # noqa: BLE001 - the dashboard is not up yet
                    continue
        tiers = {k[len("hfl_tier_"):]: n["node_id"] for n in alive for k in n["resources_total"] if k.startswith("hfl_tier_")}
        yield address, env, tiers, hidden
    finally:
        # SIGTERM to `ray start --block` alone: it stops its node's processes in ~3 s. Signalling its
        # whole process group kills them under it, and it then waits ~30 s for them to report.
        for node in reversed(nodes):
            node.terminate()
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        shutil.rmtree(temp, ignore_errors=True)


def list_nodes(address: str, token: str) -> list[dict]:
    """The cluster's nodes, from the dashboard's state API over HTTP with the cluster's token."""
    request = urllib.request.Request(f"{address}/api/v0/nodes?detail=1", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["data"]["result"]["result"]


def submit(address, env, command, runtime_env=None):
    runtime = ["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []
    job = [RAY, "job", "submit", "--address", address, "--working-dir", str(ROOT), *runtime, "--", *command]
    return subprocess.run(job, env=env, capture_output=True, text=True, timeout=900, check=False)


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
    # The large tier's pool was sized by its node (2 actors), not by the cluster's 4 CPUs: none of
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
