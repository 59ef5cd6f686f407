"""Budgeted clients on one GPU: as fast as unbudgeted ones, every budget held, and what bf16 buys.

Work: FeDepth's client setting (Zhang et al., AAAI 2024): CIFAR-10, PreResNet-20, 100 clients of 500
images (IID shards), 10 per round, 1 local epoch, SGD lr 0.1, momentum 0.9, weight decay 5e-4.
Every run is a fresh process (its CUDA allocator, cuDNN plans and caches start clean), on the local backend.

1. `speed`: FedAvg at batch 32 and 128, client-rounds per second over the steady rounds, for
   - `unbudgeted`: no budgets, `backend.cudnn=on` (cuDNN as PyTorch sets it up: the fastest reference);
   - `budgeted`: every client under a 1 GB budget (all train the whole model), `backend.cudnn=auto`
     (cuDNN with deterministic plans; each client under the allocator's cap of its budget);
   - `cudnn off` (with `--all`): the same budgets without cuDNN (what budgeted clients ran before);
   - bf16: the unbudgeted run again at `fl.precision=bf16-mixed`.
   Each row reports the largest measured/estimated peak of its clients.
2. `fedepth`: FeDepth under `fair` budgets at batch 128 (the paper's), 3 rounds, float32 and bf16:
   every client's measured peak (`torch.cuda.max_memory_allocated`) against its budget and its
   estimate, and the clients that failed.

    python benchmarks/gpu_budgets.py [--data cifar10_jpeg] [--rounds 4] [--json out.json] [--only speed|fedepth] [--all]

Prints a Markdown table per part. Needs CUDA (`--device cpu` runs the same rows as a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 2**20


def experiment(data: str, device: str, method: str, batch: int, rounds: int, budgets: dict[str, Any], backend: dict[str, Any],
               precision: str) -> dict[str, Any]:
    return {
        "name": "gpu-budgets",
        "data": {"name": data, "partition": "iid"},
        "model": {"name": "preresnet20"},
        "method": {"name": method},
        "budgets": budgets,
        "fl": {"rounds": rounds, "clients": 100, "fraction": 0.1, "local_epochs": 1, "batch_size": batch, "lr": 0.1,
               "momentum": 0.9, "weight_decay": 5e-4, "eval_every": rounds, "precision": precision},
        "backend": {"device": device, **backend},
    }


def child(values: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: its rate and every client-round's memory against budget and estimate."""
    from hfl.config import config_from_dict
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        summary = run_experiment(config_from_dict(values), out)
        records = read_metrics(out)
    steady = [r["wall_seconds"] for r in records[1:-1]] or [records[-1]["wall_seconds"]]
    clients = [c for r in records for c in r["clients"]]
    measured = [c for c in clients if c.get("measured_peak_bytes")]
    budgeted = [c for c in measured if c.get("budget_bytes")]
    return {
        "client_rounds_per_s": len(records[min(1, len(records) - 1)]["clients"]) / statistics.median(steady),
        "seconds": time.perf_counter() - started,
        "final_accuracy": summary["final_accuracy"],
        "client_rounds": len(clients),
        "failed": summary["failed_client_rounds"],
        "skipped": summary["skipped_client_rounds"],
        "max_measured_over_estimate": max((c["measured_peak_bytes"] / c["estimated_peak_bytes"] for c in measured), default=None),
        "min_measured_over_estimate": min((c["measured_peak_bytes"] / c["estimated_peak_bytes"] for c in measured), default=None),
        "over_budget": sum(c["measured_peak_bytes"] > c["budget_bytes"] for c in budgeted),
        "max_measured_over_budget": max((c["measured_peak_bytes"] / c["budget_bytes"] for c in budgeted), default=None),
        "clients": [{k: c.get(k) for k in ("id", "level", "budget_bytes", "estimated_peak_bytes", "measured_peak_bytes")} for c in clients],
    }


def run(label: str, values: dict[str, Any], results: list[dict[str, Any]], log: Any) -> None:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(values)], capture_output=True, text=True)
    if proc.returncode != 0:
        row = {"label": label, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    else:
        row = {"label": label, **json.loads(proc.stdout.strip().splitlines()[-1])}
    results.append(row)
    log(row)


def ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="cifar10_jpeg")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--only", default="", choices=["", "speed", "fedepth"])
    parser.add_argument("--json", default="")
    parser.add_argument("--all", action="store_true", help="also budgeted clients without cuDNN, and bf16 budgeted")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    results: dict[str, list[dict[str, Any]]] = {"speed": [], "fedepth": []}

    def log(row: dict[str, Any]) -> None:
        brief = {k: v for k, v in row.items() if k != "clients"}
        print(json.dumps(brief), file=sys.stderr, flush=True)
        if args.json:  # after every run: a script stopped by a time limit keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))

    everyone_fits = {"scenario": "tiers", "memory": ["1GB"]}
    if args.only in ("", "speed"):
        for batch in (32, 128):
            for precision in ("32-true", "bf16-mixed"):
                rows = [("unbudgeted, cudnn on", {"scenario": "none"}, {"cudnn": "on"})]
                if precision == "32-true" or args.all:
                    rows.append(("budgeted, cudnn auto", everyone_fits, {"cudnn": "auto"}))
                if precision == "32-true" and args.all:
                    rows.append(("budgeted, cudnn off", everyone_fits, {"cudnn": "off"}))
                for label, budgets, backend in rows:
                    values = experiment(args.data, args.device, "fedavg", batch, args.rounds, budgets, backend, precision)
                    run(f"batch {batch}, {precision}, {label}", values, results["speed"], log)
    if args.only in ("", "fedepth"):
        for precision in ("32-true", "bf16-mixed"):
            values = experiment(args.data, args.device, "fedepth", 128, 3, {"scenario": "fair"}, {"cudnn": "auto"}, precision)
            run(f"fedepth fair, batch 128, {precision}, cudnn auto", values, results["fedepth"], log)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("| run | client-rounds/s | measured / estimated (min–max) | over budget | failed | final acc |")
    print("|---|---|---|---|---|---|")
    for row in results["speed"] + results["fedepth"]:
        if "error" in row:
            print(f"| {row['label']} | error: {row['error']} | | | | |")
            continue
        print(f"| {row['label']} | {row['client_rounds_per_s']:.2f} | {ratio(row['min_measured_over_estimate'])}–"
              f"{ratio(row['max_measured_over_estimate'])} | {row['over_budget']} of {row['client_rounds']} | {row['failed']} | "
              f"{row['final_accuracy']:.4f} |")


if __name__ == "__main__":
    main()
