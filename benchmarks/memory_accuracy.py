"""Estimated peak training memory against what a real client-round uses, per model, width and batch.

Every row trains real hfl clients (`ClientEnvironment.train`, the path every run takes) on synthetic
CIFAR-shaped data (3x32x32, 10 classes; memory does not depend on pixel values), SGD with momentum
0.9 and weight decay 5e-4, and compares the accountant's estimate (`estimated_peak_bytes`) with:
- on CUDA, `measured_peak_bytes`: `torch.cuda.max_memory_allocated` during the client-round above
  what was allocated before it, plus the model's resident weights; and, as a diagnostic, the peak of
  the live tensors themselves on the device (a `LiveStorageTracker` over the same client-round),
  whose gap to the allocator's count is workspace memory and allocator rounding;
- on the CPU, the live-tensor peak of the client-round (no allocator count exists there).

Rows: PreResNet-20, ResNet-18 and the ViT at widths 1, 1/2, 1/4 and batches 32 and 128 (FedAvg:
the client trains the whole model); FeDepth's block groups under `fair` budgets (each tier's
client, PreResNet-20) and its unit, one block trained alone (the first, a middle and the last);
and a frozen prefix (the stem and the first half of the blocks
frozen, CAFF-style) for each model at width 1.

    python benchmarks/memory_accuracy.py [--device cuda] [--json out.json] [--quick]

Prints a Markdown table; the last line gives the largest |estimate/measured - 1|.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import torch

from hfl.accounting.memory import CUDA_ALLOCATION_UNIT, LiveStorageTracker
from hfl.backends.base import ClientEnvironment
from hfl.config import config_from_dict
from hfl.server import initial_state, train_settings
from hfl.submodel.spec import freeze, full_spec
from hfl.types import ClientTask, RoundContext

MODELS = ("preresnet20", "resnet18", "vit")
WIDTHS = (1.0, 0.5, 0.25)
BATCHES = (32, 128)
MiB = 2**20


def experiment(model: str, width: float, batch: int, device: str, method: str = "fedavg", budgets: str = "none"):
    return config_from_dict({
        "name": "memory-accuracy",
        "data": {"name": "synthetic", "partition": "iid"},
        "model": {"name": model, "width": width},
        "method": {"name": method},
        "budgets": {"scenario": budgets},
        "fl": {"rounds": 1, "clients": 4, "fraction": 1.0, "local_epochs": 1, "batch_size": batch, "lr": 0.05,
               "momentum": 0.9, "weight_decay": 5e-4},
        "backend": {"device": device, "threads": 8},
    })


def frozen_prefix(env: ClientEnvironment, task: ClientTask) -> ClientTask:
    """The task with the stem and the first half of the body blocks frozen."""
    model = env.method.model
    modules = [model.stem, *list(model.body)[: len(model.body) // 2]]
    held = {id(t) for m in modules for t in (*m.parameters(), *m.buffers())}
    names = [k for k, t in model.state_dict(keep_vars=True).items() if id(t) in held]
    return dataclasses.replace(task, spec=freeze(task.spec, names))


def measure(env: ClientEnvironment, state: dict, task: ClientTask) -> dict[str, Any]:
    """One client-round: the estimate, the allocator's measurement and the live-tensor peak."""
    device = env.device
    update = env.train(state, task)
    model = env.model(task.spec)
    resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    unit = CUDA_ALLOCATION_UNIT if device.type == "cuda" else 1
    with LiveStorageTracker(device.type, unit=unit) as tracker:
        env.train(state, task)
    tracker.stop()
    return {
        "estimated": update.metrics["estimated_peak_bytes"],
        "measured": update.metrics["measured_peak_bytes"],
        "tensors": tracker.peak_bytes + resident,
    }


def fedepth_stage(env: ClientEnvironment, ctx: RoundContext, block: int) -> ClientTask:
    """FeDepth's training of one block alone (its unit of decomposition): the earlier blocks frozen
    and run without saving activations, the block, then the skip connection into the head."""
    method = env.method
    trained = method.stage_parameters(method.model, (block, block))
    untrained = [k for k in method.model.state_dict() if k not in trained]
    return ClientTask(ctx, freeze(full_spec(), untrained), {"groups": ((block, block),), "models": 1, "skipped": ()})


def rows(device: str, quick: bool) -> list[dict[str, Any]]:
    models = MODELS[:1] if quick else MODELS
    widths = WIDTHS[:1] if quick else WIDTHS
    batches = BATCHES[:1] if quick else BATCHES
    plans = [(m, w, b, "whole") for m in models for w in widths for b in batches]
    plans += [(m, 1.0, b, "frozen prefix") for m in models for b in batches]
    plans += [(m, 1.0, b, "fedepth") for m in models[:1] for b in batches]
    out = []
    for model, width, batch, kind in plans:
        started = time.perf_counter()
        fedepth = kind == "fedepth"
        config = experiment(model, width, batch, device, "fedepth" if fedepth else "fedavg", "fair" if fedepth else "none")
        env = ClientEnvironment.from_config(config)
        state = {k: v.to(env.device) for k, v in initial_state(config, env).global_state.items()}
        settings = train_settings(config.fl, 1)
        tasks = []
        for client in range(config.fl.clients) if fedepth else range(1):
            ctx = RoundContext(1, client, config.seed, len(env.partitions[client]), settings, env.budgets[client])
            task = env.method.plan(ctx, {})
            if task is None:
                print(f"{model} b{batch} fedepth {ctx.budget.tier}: sits out (no block fits its budget)", file=sys.stderr)
                continue
            tasks.append((f"FeDepth {ctx.budget.tier}: {env.method.describe_task(task)}" if fedepth else kind,
                          frozen_prefix(env, task) if kind == "frozen prefix" else task))
        if fedepth:
            ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), settings, None)
            last = len(env.method.model.body) - 1
            tasks += [(f"FeDepth block {b + 1} alone", fedepth_stage(env, ctx, b)) for b in sorted({0, last // 2, last})]
        for what, task in tasks:
            row = {"model": model, "width": width, "batch": batch, "kind": kind, "what": what, **measure(env, state, task)}
            reference = row["measured"] or row["tensors"]
            row["ratio"] = row["estimated"] / reference
            out.append(row)
            measured = "-" if row["measured"] is None else f"{row['measured'] / MiB:.2f}"
            print(f"{model} x{width:g} b{batch} {what}: estimated {row['estimated'] / MiB:.2f} MiB, measured {measured} MiB, "
                  f"live tensors {row['tensors'] / MiB:.2f} MiB, ratio {row['ratio']:.3f} ({time.perf_counter() - started:.1f}s)",
                  file=sys.stderr, flush=True)
    return out


def table(found: list[dict[str, Any]]) -> str:
    lines = ["| model | width | batch | client trains | estimated MiB | measured MiB | live tensors MiB | estimate / measured (CPU: / live tensors) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in found:
        measured = "-" if r["measured"] is None else f"{r['measured'] / MiB:.2f}"
        what = r["what"].replace(" | ", " / ")
        lines.append(f"| {r['model']} | {r['width']:g} | {r['batch']} | {what} | {r['estimated'] / MiB:.2f} | {measured} | "
                     f"{r['tensors'] / MiB:.2f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", default="")
    parser.add_argument("--quick", action="store_true", help="one model, width and batch per kind")
    args = parser.parse_args()
    found = rows(args.device, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": found}, f, indent=1)
    print(table(found))
    worst = max(found, key=lambda r: abs(r["ratio"] - 1))
    print(f"worst estimate/measured = {worst['ratio']:.3f} ({worst['model']} x{worst['width']:g} b{worst['batch']} {worst['what']})")


if __name__ == "__main__":
    main()
