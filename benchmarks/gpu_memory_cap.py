"""Where to put the allocator's cap on a budgeted CUDA client: what each choice fails and lets through.

A budgeted client on CUDA trains under `torch.cuda.set_per_process_memory_fraction` (see
`hfl.experiment.cap_client_memory`). The allocator holds that cap against the memory it has
*reserved*, while the budget, the estimate and `measured_peak_bytes` count *allocated* memory; the
two differ by the allocator's fragmentation (free parts of partly used 2 MiB pages). This script
runs FeDepth under `fair` budgets at batch 128 (the paper's; CIFAR-10, PreResNet-20, 100 clients of
500 images, 10 per round, 3 rounds), float32 and bf16, once per cap rule, each in a fresh process:

- `allocated+S`: the cap is what the process had allocated before the client (less its model's
  weights) plus the budget plus S MiB (S = 0 was hfl's rule between the fourth and fifth GPU leases);
- `reserved`: the cap is what the process had reserved before the client (less its model's weights)
  plus the budget (hfl's rule since the fifth lease, and in the fourth lease's third call);
- `pool`: as `reserved`, with the client's allocations in a private `torch.cuda.MemPool`, so that
  they cannot fill free parts of pages the process already held (the fifth lease's over-budget
  clients); whether that fails clients through the pool's own fragmentation is what it measures.

For each rule it reports the client-rounds that failed (CUDA out of memory), those whose measured
peak exceeds the budget, and the largest growth of reserved memory over allocated (the
fragmentation the cap had to hold).

    python benchmarks/gpu_memory_cap.py [--data cifar10_jpeg] [--rules allocated+0,allocated+8,reserved,pool] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MiB = 2**20


def patch_cap(rule: str, growth: list[dict[str, int]]) -> None:
    """Replace hfl's cap on this process's budgeted clients with `rule`, recording each client's
    reserved and allocated growth under it."""
    import torch

    from hfl import experiment

    base, _, slack = rule.partition("+")

    @contextlib.contextmanager
    def cap(env: Any, task: Any) -> Iterator[None]:
        budget = task.ctx.budget.memory_bytes if task.ctx.budget else None
        if env.device.type != "cuda" or budget is None:
            yield
            return
        device = torch.cuda.current_device()
        model = env.model(task.spec)
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        start = (allocated if base == "allocated" else reserved) - weights
        limit = start + budget + int(slack or 0) * MiB
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        private = torch.cuda.use_mem_pool(torch.cuda.MemPool()) if base == "pool" else contextlib.nullcontext()
        try:
            with private:
                yield
        finally:
            growth.append({"budget": budget, "reserved_before": reserved, "allocated_before": allocated,
                           "max_reserved": torch.cuda.max_memory_reserved(device), "max_allocated": torch.cuda.max_memory_allocated(device)})
            torch.cuda.set_per_process_memory_fraction(1.0, device)

    experiment.cap_client_memory = cap


def child(rule: str, values: dict[str, Any]) -> dict[str, Any]:
    growth: list[dict[str, int]] = []
    patch_cap(rule, growth)
    from hfl.config import config_from_dict
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    with tempfile.TemporaryDirectory() as out:
        summary = run_experiment(config_from_dict(values), out)
        records = read_metrics(out)
    clients = [c for r in records for c in r["clients"] if c.get("measured_peak_bytes")]
    over = [c["measured_peak_bytes"] / c["budget_bytes"] for c in clients if c.get("budget_bytes")]
    return {
        "failed": summary["failed_client_rounds"],
        "trained": len(clients),
        "over_budget": sum(r > 1 for r in over),
        "max_measured_over_budget": max(over, default=None),
        "max_measured_over_estimate": max((c["measured_peak_bytes"] / c["estimated_peak_bytes"] for c in clients), default=None),
        "max_fragmentation_mib": max(((g["max_reserved"] - g["max_allocated"]) / MiB for g in growth), default=None),
        "final_accuracy": summary["final_accuracy"],
        "growth": growth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="cifar10_jpeg")
    parser.add_argument("--rules", default="reserved,pool")
    parser.add_argument("--json", default="")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return
    rows = []
    for rule in args.rules.split(","):
        for precision in ("32-true", "bf16-mixed"):
            values = {
                "name": "gpu-memory-cap", "data": {"name": args.data, "partition": "iid"}, "model": {"name": "preresnet20"},
                "method": {"name": "fedepth"}, "budgets": {"scenario": "fair"}, "backend": {"device": "cuda", "cudnn": "auto"},
                "fl": {"rounds": 3, "clients": 100, "fraction": 0.1, "local_epochs": 1, "batch_size": 128, "lr": 0.1,
                       "momentum": 0.9, "weight_decay": 5e-4, "eval_every": 3, "precision": precision},
            }
            proc = subprocess.run([sys.executable, __file__, "--child", rule, json.dumps(values)], capture_output=True, text=True, check=False)
            found = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                     else {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]})
            rows.append({"rule": rule, "precision": precision, **found})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "growth"}), file=sys.stderr, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print("| cap rule | precision | failed | over budget (of trained) | max measured / budget | max reserved − allocated (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['rule']} | {r['precision']} | error: {r['error']} | | | |")
            continue
        ratio = "" if r["max_measured_over_budget"] is None else f"{r['max_measured_over_budget']:.3f}"
        frag = "" if r["max_fragmentation_mib"] is None else f"{r['max_fragmentation_mib']:.1f}"
        print(f"| {r['rule']} | {r['precision']} | {r['failed']} | {r['over_budget']} of {r['trained']} | {ratio} | {frag} |")


if __name__ == "__main__":
    main()
