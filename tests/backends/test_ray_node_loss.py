"""A run on a loopback Ray cluster that loses what clusters lose (issue 46): a worker node of each
tier in the middle of a round, then the head's GCS. The cluster is built as in
test_ray_multinode.py (head 1 CPU; `small`: 1 CPU + `hfl_tier_small`; `large`: 1 CPU, 1 declared
GPU + `hfl_tier_large: 1`), once for the module: the tests run in order and each leaves the
cluster as the next expects it.

The driver is `hfl run` joining the cluster (RAY_ADDRESS), as a user on the head runs it. A round is
"in the middle" by construction, not by timing: a chaos rule makes one client of the tier hang in
round 2, and round 2 is in flight once round 1's line is written (the driver starts a round's
training before it logs the last one). The GCS health checks are fast here (FAST_HEALTH_CHECKS) so
that a dead node is noticed in seconds rather than Ray's default half a minute.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfl.cli import main as hfl_cli
from hfl.config import load_config
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.backends.loopback_cluster import LoopbackCluster
from tests.backends.test_ray_multinode import TIERS
from tests.conftest import QUICKSTART, ROOT, cli_env

pytestmark = pytest.mark.slow
RUN = ["fl.clients=8", "fl.fraction=1.0", "fl.local_epochs=1", *TIERS]
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                      "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}
"""A dead node noticed in ~3-6 s instead of ~30 s; loose enough that a node of a 2-core machine
under load (other tests, other users) is not taken for dead."""


@pytest.fixture(scope="module")
def cluster():
    cluster = LoopbackCluster(Path("/tmp") / f"hfl-nl-{os.getpid()}", {**cli_env(), **FAST_HEALTH_CHECKS}, block_head=False)
    try:
        cluster.start("head", "--num-cpus=1")
        cluster.start("small", "--num-cpus=1", '--resources={"hfl_tier_small": 1}')
        cluster.start("large", "--num-cpus=1", "--num-gpus=1", '--resources={"hfl_tier_large": 1}')
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (local backend: the same numbers as Ray's, tests/backends/test_ray.py)
    and each client's tier."""
    out = tmp_path_factory.mktemp("reference")
    run_experiment(load_config(QUICKSTART, [*RUN, "fl.rounds=6"]), out)
    records = read_metrics(out)
    return records, {c["id"]: c["tier"] for c in records[0]["clients"]}


def driver(cluster, out, *args, resume=False):
    command = [sys.executable, "-m", "hfl.cli", "run", *(["--resume", str(out)] if resume else [str(QUICKSTART), "--out", str(out)]), *args]
    env = {**cluster.env, "RAY_ADDRESS": f"127.0.0.1:{cluster.port}", "HFL_DATA": str(out.parent / "data")}
    log = open(out.parent / f"{out.name}-driver.log", "a")  # noqa: SIM115 - closed by the caller through finish()
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def rounds_done(out) -> int:
    return len(read_metrics(out)) if (out / "metrics.jsonl").exists() else 0


def wait_for_round(process, out, round_, limit=300):
    """Wait until the run has written round `round_`'s line (a safety limit, not the event: the line is)."""
    deadline = time.time() + limit
    while rounds_done(out) < round_:
        assert process.poll() is None, f"the driver ended (exit {process.returncode}) before round {round_}:\n{output(out)}"
        assert time.time() < deadline, f"round {round_} not written within {limit} s:\n{output(out)}"
        time.sleep(0.1)


def output(out) -> str:
    return (out.parent / f"{out.name}-driver.log").read_text()


def finish(process, out, limit=240) -> str:
    try:
        process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the driver hung for {limit} s:\n{output(out)[-3000:]}")
    return output(out)


def numbers(record):
    return record["accuracy"], record["loss"], [(c["id"], c["train_loss"]) for c in record["clients"]]


def check_node_loss(cluster, reference, tmp_path, tier, rounds=3, restart_after=None):
    """Kill `tier`'s node in the middle of round 2: the run finishes; round 2 lists that node's
    unfinished clients as failed with the reason; round 3 runs them on CPU actors of the other
    nodes, with a warning naming the tier; round 1 is the uninterrupted run's. With
    `restart_after`, the node starts again once that round is written, while the driver is
    stopped (SIGSTOP), so that every round it submits from then on sees it."""
    records, tiers = reference
    hung = min(c for c, t in tiers.items() if t == tier)
    out = tmp_path / "run"
    process = driver(cluster, out, "backend.name=ray", "backend.gpu_memory=4MB", *RUN, f"fl.rounds={rounds}", f"backend.chaos=[2:{hung}:hang]")
    wait_for_round(process, out, 1)
    cluster.kill(tier)
    if restart_after:
        wait_for_round(process, out, restart_after)
        os.killpg(process.pid, signal.SIGSTOP)
        try:
            cluster.start(tier)
        finally:
            os.killpg(process.pid, signal.SIGCONT)
    text = finish(process, out)
    assert process.returncode == 0, text[-3000:]
    assert "Traceback" not in text
    got = read_metrics(out)
    assert numbers(got[0]) == numbers(records[0])  # the round before the kill
    failed = {f["id"]: f["reason"] for f in got[1]["failed_clients"]}
    assert hung in failed and set(failed) <= {c for c, t in tiers.items() if t == tier}, failed
    assert all("actor died" in r or "node lost" in r for r in failed.values()), failed
    assert set(failed) | {c["id"] for c in got[1]["clients"]} == set(tiers)  # every client trained or is listed
    assert not got[2]["failed_clients"] and len(got[2]["clients"]) == 8  # round 3 on the nodes left
    moved = [c for c in got[2]["clients"] if c["tier"] == tier]
    assert moved and all(f"hfl_tier_{tier}" not in c["ray_resources"] and "GPU" not in c["ray_resources"] for c in moved)
    assert f"no live node advertises hfl_tier_{tier}" in text
    return out


def test_a_small_node_that_dies_mid_round_fails_its_clients_for_that_round_only_and_its_pool_grows_back(cluster, reference, tmp_path):
    out = check_node_loss(cluster, reference, tmp_path, "small", rounds=7, restart_after=2)
    # On Ray a round is submitted while the one before is logged, and these rounds take well under a
    # second once the pools are up: rounds 4 and 5 have gone out before the driver was stopped for the
    # restart (round 5 did once in CI). Seven rounds leave four to go out after it.
    later = read_metrics(out)[3:]
    assert not any(r["failed_clients"] for r in later)
    assert all(c["ray_resources"].get("hfl_tier_small") == 1 for c in later[-1]["clients"] if c["tier"] == "small")


def test_a_large_node_that_dies_mid_round_fails_its_clients_and_a_resume_runs_without_it(cluster, reference, tmp_path):
    out = check_node_loss(cluster, reference, tmp_path, "large")
    # A resume while the tier's node is gone: its clients run on CPU actors, without backend.device=cpu,
    # and with a longer actor start timeout (a setting that changes no number).
    process = driver(cluster, out, "fl.rounds=4", "backend.actor_start_timeout_s=100", resume=True)
    text = finish(process, out)
    assert process.returncode == 0, text[-3000:]
    last = read_metrics(out)[-1]
    assert last["round"] == 4 and len(last["clients"]) == 8 and not last["failed_clients"]
    # Where the run must not go on without the tier: one line, before any actor starts.
    process = driver(cluster, tmp_path / "strict", "backend.name=ray", "backend.gpu_memory=4MB", "backend.tier_strict=true", *RUN)
    text = finish(process, tmp_path / "strict")
    assert process.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert [line for line in text.splitlines() if line.startswith("hfl: error:")] == [
        next(line for line in text.splitlines() if "backend.tier_strict=True is not allowed" in line and "hfl_tier_large" in line)]


def test_a_head_whose_gcs_dies_stops_the_run_in_one_line_that_says_how_to_resume_it(cluster, reference, tmp_path):
    records, _ = reference
    out = tmp_path / "run"
    process = driver(cluster, out, "backend.name=ray", "backend.gpu_memory=4MB", "backend.head_grace_s=5", *RUN, f"fl.rounds={len(records)}")
    wait_for_round(process, out, 1)
    cluster.kill_gcs()
    killed = time.monotonic()
    assert rounds_done(out) < len(records)  # the GCS died while the run had rounds to go
    text = finish(process, out, limit=120)
    took = time.monotonic() - killed
    errors = [line for line in text.splitlines() if line.startswith("hfl: error:")]
    assert took < 60 and process.returncode not in (0, None), (took, text[-3000:])
    assert len(errors) == 1 and "head" in errors[0] and f"hfl run --resume {out}" in errors[0], text[-3000:]
    assert "Traceback" not in text
    cluster.stop(gracefully=False)
    # The head is gone: the run continues on this machine (local and Ray compute the same numbers;
    # the large node's test resumes on a cluster), with the command the error printed, in this
    # process (a fresh one would only add torch's start-up; the drivers above are the fresh processes).
    assert hfl_cli(["run", "--resume", str(out), "backend.name=local"]) == 0
    assert [numbers(r) for r in read_metrics(out)] == [numbers(r) for r in records]  # as if it had never stopped
