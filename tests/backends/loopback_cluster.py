"""A Ray cluster of several nodes on one machine's loopback, each node a `ray start` process in a
process group of its own, so that killing a group SIGKILLs that node's raylet and workers and
nothing else. Shared by the multi-node and node-loss tests.

Ports are picked free just before a node starts, so another process (another test's cluster, a
Ray worker) can take one in between; a node that exits, or is stuck, before it joins is therefore
started again with fresh ports, and a node that never joins fails the test with the tail of what it
printed.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))
ATTEMPTS = 3
ATTEMPT_S = 90
"""How long one attempt may take to join: Ray gives up on a node that cannot start in about 30 s, so
a node still not listed after this is stuck and is started again."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ports() -> list[str]:
    names = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "metrics-export-port", "runtime-env-agent-port")
    return [f"--{name}={free_port()}" for name in names]


def list_nodes(address: str, token: str) -> list[dict]:
    """The cluster's nodes, from the dashboard's state API over HTTP with the cluster's token."""
    request = urllib.request.Request(f"{address}/api/v0/nodes?detail=1", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["data"]["result"]["result"]


class LoopbackCluster:
    """Nodes started one at a time (nodes starting at once on one machine pick the same socket and
    log names). Token authentication, as Ray >= 2.59 clusters have it by default and docs/cluster.md
    submits: every node and `ray job submit` hold the cluster's token; this process asks the
    dashboard's HTTP API with it (Ray's own client here keeps whatever auth mode an earlier test set up).

    `block_head=False` starts the head as `ray up` does, without `--block`: `ray start --block` would
    take the whole head down with its GCS, and a driver with its raylet, before it could say a word.
    """

    def __init__(self, temp: Path, env: dict, block_head: bool = True) -> None:
        self.token = os.urandom(32).hex()
        self.env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0"}
        self.temp, self.block_head = temp, block_head  # Ray limits socket path lengths: keep `temp` short
        self.logs = temp.with_name(f"{temp.name}-logs")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port, self.dashboard = free_port(), free_port()
        self.nodes: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[list[str], list[str]]] = {}

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def alive(self) -> list[dict]:
        try:
            return [n for n in list_nodes(self.address, self.token) if n["state"] == "ALIVE"]
        except Exception:  # noqa: BLE001 - the dashboard is not up yet
            return []

    def command(self, name: str) -> list[str]:
        wrapper, options = self.commands[name]
        if name == "head":
            self.port, self.dashboard = free_port(), free_port()
            node = [RAY, "start", "--head", *(["--block"] if self.block_head else []), "--node-ip-address=127.0.0.1",
                    f"--port={self.port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard}",
                    f"--ray-client-server-port={free_port()}", f"--temp-dir={self.temp}"]
        else:
            node = [RAY, "start", "--block", f"--address=127.0.0.1:{self.port}", "--node-ip-address=127.0.0.1"]
        return [*wrapper, *node, *options, *node_ports()]

    def start(self, name: str, *options: str, wrapper: tuple[str, ...] = (), limit: float = 240) -> None:
        """Start node `name` ("head" first) with `ray start` `options`, run under `wrapper`, and wait
        until the cluster lists it alive."""
        if options or wrapper or name not in self.commands:
            self.commands[name] = (list(wrapper), list(options))
        want = len(self.alive()) + 1 if self.nodes else 1
        deadline = time.time() + limit
        for attempt in range(1, ATTEMPTS + 1):
            log = self.logs / f"{name}-{attempt}.log"
            with open(log, "w") as out:
                node = subprocess.Popen(self.command(name), env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            self.nodes[name] = node
            stuck = min(deadline, time.time() + ATTEMPT_S)
            while len(self.alive()) < want:
                # A blocking `ray start` exits only when its node failed; a non-blocking head exits 0 once started.
                failed = node.poll() is not None and (node.returncode != 0 or (name != "head" or self.block_head))
                if failed or time.time() > stuck:
                    break
                time.sleep(1)
            else:
                return
            self.kill(name)
            if attempt == ATTEMPTS or time.time() > deadline:
                why = f"exited with {node.returncode}" if failed else f"did not join (an attempt may take {ATTEMPT_S:g} s, all {limit:g} s)"
                pytest.fail(f"Ray node {name} {why} (attempt {attempt} of {ATTEMPTS}); it printed:\n"
                            + log.read_text(errors="replace")[-3000:])

    def kill(self, name: str) -> None:
        """SIGKILL node `name`: its raylet, its workers and its `ray start`, all at once."""
        node = self.nodes.pop(name)
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.wait()

    def kill_gcs(self) -> None:
        """SIGKILL the head's GCS server alone (its raylet and dashboard stay, as when the GCS crashes)."""
        head = self.nodes["head"].pid
        out = subprocess.run(["pgrep", "-g", str(head), "-x", "gcs_server"], capture_output=True, text=True, check=False).stdout
        pids = [int(p) for p in out.split()]
        assert pids, "no gcs_server in the head's process group"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    def stop(self, gracefully: bool = True) -> None:
        """Stop every node: SIGTERM first (`gracefully`), then SIGKILL to its process group. SIGTERM
        goes to `ray start --block` alone: it stops its node's processes in ~3 s, whereas signalling
        its whole group kills them under it and it then waits ~30 s for them to report. A node whose
        head is gone waits out the whole SIGTERM timeout: there, not `gracefully`."""
        for name in reversed(list(self.nodes)):
            node = self.nodes[name]
            if gracefully and node.poll() is None:
                node.terminate()
                try:
                    node.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            self.kill(name)  # what outlived it: the head's daemons, a GCS-less raylet's workers
        for folder in (self.temp, self.logs):
            shutil.rmtree(folder, ignore_errors=True)
