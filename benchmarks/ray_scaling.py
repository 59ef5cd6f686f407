"""hfl's RayBackend against a plain serial PyTorch loop on the same FedAvg work.

Two workloads: `digits` (throughput.py's: the small CNN, 100 clients of ~14 digits, 10 a round,
20 rounds; the plain side is plain_fedavg.py) and `preresnet` (PreResNet-20 on 32x32 images,
20 clients of 500, 4 a round, 8 rounds; the plain side is plain_preresnet.py, hfl's side trains on
CIFAR-10 classes 0 and 1 from $HFL_DATA or ../shared/datasets).

Reports, measured in one run: the whole process (interpreter start to exit, Ray's start-up
included) and a steady round (median of rounds 3..), each as ray/plain; the memory of each client
actor (resident, proportional and unique set size: USS is what the actor alone holds, PSS adds its
share of the pages actors share, such as torch's libraries); and the processes each side ran
(plain: one; Ray: the driver, the client actors, and everything else the driver started).

A round is the same span on both sides: from its start to the next round's start, so it holds all
of a round's work (planning, training, aggregation, evaluation, and on hfl's side the metrics line
and the checkpoint). On hfl's side the start of round r + 1 is the moment round r's callbacks run
(the last thing a round does before the loop starts the next), taken as a timestamp.

    python benchmarks/ray_scaling.py [--workload digits|preresnet] [--repeats 3] [--actors 2] [--batch-clients N] [--warm]

`--batch-clients` is hfl's backend.batch_clients on the Ray side (default 5 for digits: an actor
trains its share of a round's clients of one shape as one vectorised model; 1 for preresnet, whose
batch-norm clients train one by one); the plain side always trains one client after the other.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent


def actor_memory() -> list[dict[str, int]]:
    """Resident, proportional and unique set bytes of every Ray client-actor process on this machine (Linux /proc)."""
    sizes = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"ClientActor" not in (proc / "cmdline").read_bytes():
                continue
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in (proc / "smaps_rollup").read_text().splitlines()[1:]}
        except (OSError, ValueError, IndexError):
            continue
        sizes.append({"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]})
    return sizes


def descendants(pid: int) -> list[int]:
    """Every live process started, directly or not, by `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def data_root() -> str:
    return os.environ.get("HFL_DATA") or str(HERE.parent.parent / "shared" / "datasets")


def hfl_workload(workload: str):
    """hfl's config for `workload` on the local backend (the Ray side changes the backend only)."""
    from hfl.config import config_from_dict

    if workload == "digits":
        from throughput import hfl_config

        return hfl_config("fast")
    from plain_preresnet import BATCH, CLIENTS, EPOCHS, EVAL_EVERY, LR, PER_ROUND, ROUNDS

    return config_from_dict({
        "name": "ray-scaling-preresnet",
        "data": {"name": "cifar10_jpeg", "root": data_root(), "classes": [0, 1], "partition": "iid", "augment": "none"},
        "model": {"name": "preresnet20", "norm": "bn"},
        "method": {"name": "fedavg"},
        "fl": {"rounds": ROUNDS, "clients": CLIENTS, "fraction": PER_ROUND / CLIENTS, "local_epochs": EPOCHS, "batch_size": BATCH,
               "lr": LR, "eval_every": EVAL_EVERY},
        "backend": {"device": "cpu"},
    })


def child_plain(workload: str) -> dict:
    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(1)
    if workload == "digits":
        from plain_fedavg import run_plain
    else:
        from plain_preresnet import run_plain
    _, accuracy, rounds = run_plain()  # each round from its start to the next round's start
    return {"accuracy": accuracy, "steady_round": statistics.median(rounds[2:]), "processes": 1 + len(descendants(os.getpid()))}


def child_ray(workload: str, actors: int, batch_clients: int) -> dict:
    sys.path.insert(0, str(HERE))
    import dataclasses

    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    config = hfl_workload(workload)
    config = dataclasses.replace(config, backend=dataclasses.replace(config.backend, name="ray", actors_per_pool=actors,
                                                                     batch_clients=batch_clients))
    memory: list[dict[str, int]] = []
    processes: list[int] = []
    next_starts: list[float] = []  # next_starts[k]: when round k + 1 ended, i.e. round k + 2 starts

    class RoundClock:
        def on_round(self, record: dict) -> None:
            next_starts.append(time.perf_counter())
            if record["round"] == 5:
                memory.extend(actor_memory())
                processes.append(1 + len(descendants(os.getpid())))

        def on_end(self, summary: dict) -> None:
            pass

    with tempfile.TemporaryDirectory() as out:
        summary = run_experiment(config, out, callbacks=[RoundClock()])
        # hfl's own wall_seconds stops before the metrics line and the checkpoint: shown beside, not compared
        wall = [r["wall_seconds"] for r in read_metrics(out)]
    # rounds[k]: round k + 2, from its start to the next round's start (the callbacks of round 1 are
    # the first start this clock sees, so round 1 itself, which includes the actors' start, is not timed)
    rounds = [b - a for a, b in itertools.pairwise(next_starts)]
    return {"accuracy": summary["final_accuracy"], "steady_round": statistics.median(rounds[1:]), "actor_memory": memory,
            "actors": len(memory), "processes": processes[0] if processes else None, "wall_seconds": statistics.median(wall[2:])}


@contextmanager
def ray_environment(warm: bool, cpus: int) -> Iterator[dict[str, str]]:
    """The environment of the Ray side's processes. Cold (the default), each starts and stops Ray
    itself. Warm, they join one head node started here first, as after `ray start --head` on a
    laptop or on a running cluster, so Ray's own start (2.5-3.5 s here) and stop (1.4 s) are not
    paid per run; client actors still start with each run."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    if not warm:
        yield env
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    temp = tempfile.mkdtemp(prefix="hfl-rs-", dir="/tmp")  # Ray limits socket path lengths: keep it short
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             f"--num-cpus={cpus}", "--include-dashboard=false", f"--temp-dir={temp}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        while subprocess.run([ray_cli, "status", f"--address={address}"], env=env, capture_output=True, check=False).returncode:
            if head.poll() is not None:
                raise RuntimeError("the Ray head node did not start")
            time.sleep(1)
        yield {**env, "RAY_ADDRESS": address}
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def timed_child(kind: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    command = [sys.executable, __file__, "--child", kind, "--workload", args.workload, "--actors", str(args.actors),
               "--batch-clients", str(args.batch_clients)]
    result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    outcome["process"] = time.perf_counter() - start
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["digits", "preresnet"], default="digits")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--batch-clients", type=int, default=None, help="hfl's backend.batch_clients (default: 5 digits, 1 preresnet)")
    parser.add_argument("--warm", action="store_true", help="the Ray side joins a head node started once, instead of starting Ray per run")
    parser.add_argument("--child", choices=["plain", "ray"])
    args = parser.parse_args()
    if args.batch_clients is None:
        args.batch_clients = 5 if args.workload == "digits" else 1
    if args.child:
        outcome = child_plain(args.workload) if args.child == "plain" else child_ray(args.workload, args.actors, args.batch_clients)
        print(json.dumps(outcome))
        return
    process, steady, memory = [], [], []
    with ray_environment(args.warm, args.actors) as ray_env:
        for i in range(args.repeats):
            plain, ray = timed_child("plain", args, dict(os.environ)), timed_child("ray", args, ray_env)
            process.append(ray["process"] / plain["process"])
            steady.append(ray["steady_round"] / plain["steady_round"])
            memory += ray["actor_memory"]
            print(f"repeat {i}: process ray {ray['process']:.1f}s plain {plain['process']:.1f}s; steady round ray "
                  f"{ray['steady_round'] * 1000:.0f}ms (its wall_seconds {ray['wall_seconds'] * 1000:.0f}ms) plain "
                  f"{plain['steady_round'] * 1000:.0f}ms; accuracy ray {ray['accuracy']:.3f} plain {plain['accuracy']:.3f}; "
                  f"processes ray {ray['processes']} ({ray['actors']} client actors) plain {plain['processes']}", file=sys.stderr, flush=True)
    mib = {kind: statistics.median(m[kind] for m in memory) / 2**20 for kind in ("rss", "pss", "uss")}
    print(f"workload={args.workload} ray={'warm' if args.warm else 'cold'} actors={args.actors} batch_clients={args.batch_clients} "
          f"actor_uss_mib={mib['uss']:.0f} actor_pss_mib={mib['pss']:.0f} actor_rss_mib={mib['rss']:.0f} "
          f"process_ratio={statistics.median(process):.3f} steady_round_ratio={statistics.median(steady):.3f} "
          f"processes_ray={ray['processes']} client_actors={ray['actors']} processes_plain={plain['processes']}")


if __name__ == "__main__":
    main()
