"""Simulated clients per second on one GPU: one at a time, and several at once.

Work: FeDepth's client setting (Zhang et al., AAAI 2024): CIFAR-10, PreResNet-20, 500 samples per
client (IID shards), 1 local epoch, SGD lr 0.1, momentum 0.9, weight decay 5e-4, batch 32 or 64.

1. `setting`: LocalBackend, one client after the other, 10 clients per round, batch 32 and 128 (the
   paper's), each with cuDNN and without it (`backend.cudnn` on and off; without cuDNN the
   convolutions unfold one image at a time): client-rounds per second and the GPU's mean
   utilisation (NVML) over the steady rounds.
2. `concurrency`: 16 clients per round with n = 1, 2, 4, 8, 16 clients at once (`--sizes`), batch 32,
   for each of `--methods` (those whose clients train together: FedAvg, FedProx, DepthFL, HeteroFL,
   FedRolex, ScaleFL, NeFL, SplitMix, FeDepth; `method:scenario` gives it budgets, e.g. `heterofl:fair`, whose clients of one width train together), by
   - `batched`: LocalBackend with `backend.batch_clients=n` (one vectorised model, torch.func);
   - `ray`: RayBackend with n actors, each reserving 1/n of the GPU (`backend.num_gpus_per_client`);
   each against one-at-a-time LocalBackend on the same rounds (speedup), with the largest difference
   of the final global weights from it.

Steady rounds are rounds 2..R-1 (round 1 starts actors and caches, round R evaluates).

    python benchmarks/gpu_clients.py [--data cifar10_jpeg] [--device cuda] [--rounds 5] [--ray] [--json out.json]
        [--methods fedavg,fedprox,heterofl:fair] [--sizes 1,8,16]

`--data synthetic` runs on generated CIFAR-shaped images (nothing to download).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hfl.checkpoint import load_checkpoint
from hfl.config import config_from_dict
from hfl.loggers import read_metrics
from hfl.server import run_experiment

if TYPE_CHECKING:
    from typing_extensions import Self

class Utilisation:
    """Samples the GPU's utilisation (NVML, percent) every 20 ms in a thread, with timestamps."""

    def __init__(self, device: str) -> None:
        self.enabled = device == "cuda"
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), torch.cuda.utilization()))
            time.sleep(0.02)

    def __enter__(self) -> Self:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()

    def mean(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.samples if start <= t <= end]
        return statistics.mean(inside) if inside else None


class RoundClock:
    """Records when each round ended (a RoundCallback)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_round(self, record: dict[str, Any]) -> None:
        self.ends.append(time.perf_counter())

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


def config(data: str, device: str, clients: int, per_round: int, batch: int, rounds: int, backend: dict[str, Any], method: str = "fedavg",
           scenario: str = "none"):
    return config_from_dict({
        "name": "gpu-clients",
        "data": {"name": data, "partition": "iid"},
        "model": {"name": "preresnet20"},
        "method": {"name": method},
        "budgets": {"scenario": scenario},
        "fl": {"rounds": rounds, "clients": clients, "fraction": per_round / clients, "local_epochs": 1, "batch_size": batch,
               "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "eval_every": rounds},
        "backend": {"device": device, **backend},
    })


def run(cfg, device: str) -> dict[str, Any]:
    clock = RoundClock()
    with tempfile.TemporaryDirectory() as out, Utilisation(device) as util:
        started = time.perf_counter()
        summary = run_experiment(cfg, out, callbacks=[clock])
        records = read_metrics(out)
        state, _ = load_checkpoint(Path(out), torch.device("cpu"))
    steady = [r["wall_seconds"] for r in records[1:-1]]
    per_round = len(records[1]["clients"])
    return {
        "client_rounds_per_s": per_round / statistics.median(steady),
        "gpu_utilisation": util.mean(clock.ends[0], clock.ends[-2]),
        "final_accuracy": summary["final_accuracy"],
        "failed": summary["failed_client_rounds"],
        "seconds": time.perf_counter() - started,
        "state": state.global_state,
    }


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="cifar10_jpeg")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=100, help="clients the training set is split over (CIFAR-10's 50,000 images: 500 each)")
    parser.add_argument("--ray", action="store_true", help="also run the Ray actors (needs Ray)")
    parser.add_argument("--methods", default="fedavg", help="comma-separated methods for the concurrency part, each with an optional "
                        "budget scenario (e.g. fedavg,fedprox,heterofl:fair)")
    parser.add_argument("--sizes", default="1,2,4,8,16", help="comma-separated numbers of clients at once")
    parser.add_argument("--skip-setting", action="store_true")
    parser.add_argument("--skip-batched", action="store_true", help="with --ray: only the Ray actors against one at a time")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results: dict[str, Any] = {"setting": [], "concurrency": []}

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        if args.json:  # after every run: a step stopped by a time limit keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))

    if not args.skip_setting:
        for batch in (32, 128):
            for cudnn in ("on", "off"):
                found = run(config(args.data, args.device, args.clients, min(10, args.clients), batch, args.rounds, {"cudnn": cudnn}),
                            args.device)
                found.pop("state")
                results["setting"].append({"batch": batch, "cudnn": cudnn, **found})
                log(f"setting batch {batch}, cuDNN {cudnn}: {found['client_rounds_per_s']:.2f} client-rounds/s, "
                    f"utilisation {found['gpu_utilisation']}")

    results["sequential"] = {}
    modes = [*([] if args.skip_batched else ["batched"]), *(["ray"] if args.ray else [])]
    for label in args.methods.split(","):
        method, _, scenario = label.partition(":")
        sequential = run(config(args.data, args.device, args.clients, min(16, args.clients), 32, args.rounds, {}, method, scenario or "none"),
                         args.device)
        base = sequential["client_rounds_per_s"]
        results["sequential"][label] = {k: v for k, v in sequential.items() if k != "state"}
        log(f"{label} one at a time: {base:.2f} client-rounds/s, utilisation {sequential['gpu_utilisation']}")
        for mode in modes:
            for n in (int(size) for size in args.sizes.split(",")):
                backend = ({"batch_clients": n} if mode == "batched"
                           else {"name": "ray", "actors_per_pool": n, "num_gpus_per_client": 1 / n if args.device == "cuda" else 0})
                found = run(config(args.data, args.device, args.clients, min(16, args.clients), 32, args.rounds, backend, method, scenario or "none"),
                            args.device)
                found["max_weight_difference"] = difference(found.pop("state"), sequential["state"])
                found["speedup"] = found["client_rounds_per_s"] / base
                results["concurrency"].append({"method": label, "mode": mode, "clients_at_once": n, **found})
                log(f"{label} {mode} n={n}: {found['client_rounds_per_s']:.2f} client-rounds/s ({found['speedup']:.2f}x), utilisation "
                    f"{found['gpu_utilisation']}, max weight difference {found['max_weight_difference']:.3g}, failed {found['failed']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("| method | mode | clients at once | client-rounds/s | speedup | GPU util % | max |Δw| vs one at a time | final acc |")
    print("|---|---|---|---|---|---|---|---|")
    for method, sequential in results["sequential"].items():
        print(f"| {method} | one at a time | 1 | {sequential['client_rounds_per_s']:.2f} | 1.00 | {sequential['gpu_utilisation']} | 0 | "
              f"{sequential['final_accuracy']:.4f} |")
    for r in results["concurrency"]:
        print(f"| {r['method']} | {r['mode']} | {r['clients_at_once']} | {r['client_rounds_per_s']:.2f} | {r['speedup']:.2f} | "
              f"{r['gpu_utilisation']} | {r['max_weight_difference']:.3g} | {r['final_accuracy']:.4f} |")


if __name__ == "__main__":
    main()
