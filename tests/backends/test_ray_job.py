"""`ray job submit` against a real single-node cluster on loopback, as the README describes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # noqa: F401  (a hard dependency: a broken install fails here, it does not skip)

from hfl.config import load_config
from hfl.server import run_experiment
from tests.conftest import QUICKSTART, ROOT, cli_env

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(tmp_path_factory):
    """A head node in its own process group and temp dir, so stopping it touches no other Ray."""
    env = {**cli_env(), "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    dashboard = free_port()
    temp = Path("/tmp") / f"hfl-ray-{os.getpid()}"  # Ray limits socket path lengths: keep it short
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2", f"--temp-dir={temp}",
         "--resources={\"hfl_tier_w1\": 2}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.time() + 120
    while time.time() < deadline:
        probe = subprocess.run([RAY, "job", "list", "--address", address], env=env, capture_output=True, check=False)
        if probe.returncode == 0:
            break
        time.sleep(2)
    else:
        os.killpg(head.pid, signal.SIGTERM)
        pytest.fail("the Ray head did not start within 120 s")
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    head.wait(timeout=60)


def test_ray_job_submit_runs_an_experiment(cluster, tmp_path):
    address, env = cluster
    out = tmp_path / "job"
    overrides = ["fl.rounds=2", "fl.clients=8", "budgets.scenario=tiers", "budgets.memory=[width:1]", "budgets.names=[w1]"]
    command = [RAY, "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
               "hfl", "run", "experiments/quickstart.yaml", "backend.name=ray", *overrides, "--out", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tiers"]["w1"]["client_rounds"] == 8  # every client ran on the tier's actors
    # The job ran the experiment it was given: the same numbers as that config run here, locally.
    local = run_experiment(load_config(QUICKSTART, overrides), tmp_path / "local")
    assert summary["rounds"] == 2
    assert (summary["final_accuracy"], summary["final_loss"]) == (local["final_accuracy"], local["final_loss"])
