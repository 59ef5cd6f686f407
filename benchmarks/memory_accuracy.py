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
a frozen prefix (the stem and the first half of the blocks frozen, CAFF-style) for each model at
width 1; FedMef's client (PreResNet-20 at density 0.1, scaled activation pruning s = 0.9); and
CAFF's GPT family (l = 3, 6, 9, 12 blocks, whole and with a frozen prefix) on Shakespeare windows
of 256 characters, read from $HFL_DATA/shakespeare; and the transformer methods CAFF compares with,
on the 3-block GPT and the ViT at batch 32: HetLoRA's adapters (`hetlora`, the smallest and the
largest rank) and FedHM's low-rank factors (`fedhm`, likewise), each a ladder level as `plan` would
pick it for a client whose budget holds that level.

    python benchmarks/memory_accuracy.py [--device cuda] [--cudnn off|on] [--precision 32-true|bf16-mixed] [--json out.json] [--quick] [--kinds whole,gpt,hetlora,...]

`--cudnn on` measures with cuDNN's convolutions, whose workspace the estimate of an unbudgeted client
does not count (budgeted clients cap it and the estimate counts the cap: `benchmarks/gpu_budgets.py`);
this table runs without cuDNN by default. `--precision bf16-mixed` trains and estimates every row
under bf16 autocast (`fl.precision`).

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
from hfl.budget import describe_task
from hfl.methods.fedepth import Layout
from hfl.server import initial_state, train_settings
from hfl.submodel.spec import freeze, full_spec
from hfl.types import ClientTask, RoundContext

MODELS = ("preresnet20", "resnet18", "vit")
GPTS = ("gpt_l3", "gpt_l6", "gpt_l9", "gpt")
KINDS = ("whole", "frozen prefix", "fedepth", "fedmef", "gpt", "hetlora", "fedhm")
LOW_RANK = ("hetlora", "fedhm")
"""Kinds whose rows are the method's own ladder levels (ranks), on a transformer."""
LOW_RANK_MODELS = ("gpt_l3", "vit")
WIDTHS = (1.0, 0.5, 0.25)
BATCHES = (32, 128)
MiB = 2**20


def experiment(model: str, width: float, batch: int, device: str, cudnn: str, method: str = "fedavg", budgets: str = "none",
               precision: str = "32-true"):
    # Text: one window per 256 characters (stride = seq_len) keeps a client-round to a few batches.
    data = ({"name": "shakespeare", "partition": "natural", "seq_len": 256, "stride": 256} if model.startswith("gpt")
            else {"name": "synthetic", "partition": "iid"})
    return config_from_dict({
        "name": "memory-accuracy",
        "data": data,
        "model": {"name": model, "width": width},
        "method": {"name": method},
        "budgets": {"scenario": budgets},
        "fl": {"rounds": 1, "clients": 4, "fraction": 1.0, "local_epochs": 1, "batch_size": batch, "lr": 0.05,
               "momentum": 0.9, "weight_decay": 5e-4, "precision": precision},
        "backend": {"device": device, "threads": 8, "cudnn": cudnn},
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
    return ClientTask(ctx, freeze(full_spec(), untrained), Layout(1, ((block, block),), ()))


def low_rank_levels(env: ClientEnvironment, kind: str, ctx: RoundContext) -> list[tuple[str, ClientTask]]:
    """The smallest and the largest rank of HetLoRA's adapters or FedHM's factors, as the ladder hands them out."""
    ladder, what = env.method.ladder, "HetLoRA adapters" if kind == "hetlora" else "FedHM factors"
    return [(f"{what}, rank {level.options.rank}", ladder.task_for(ctx, level)) for level in (ladder.levels[0], ladder.levels[-1])]


def rows(device: str, quick: bool, kinds: tuple[str, ...] = KINDS, cudnn: str = "off", precision: str = "32-true") -> list[dict[str, Any]]:
    models = MODELS[:1] if quick else MODELS
    widths = WIDTHS[:1] if quick else WIDTHS
    batches = BATCHES[:1] if quick else BATCHES
    gpts = GPTS[:1] if quick else GPTS
    plans = [(m, w, b, "whole") for m in models for w in widths for b in batches]
    plans += [(m, 1.0, b, "frozen prefix") for m in models for b in batches]
    plans += [(m, 1.0, b, "fedepth") for m in models[:1] for b in batches]
    plans += [(m, 1.0, b, "fedmef") for m in models[:1] for b in batches]
    plans += [(m, 1.0, b, "whole") for m in gpts for b in batches[:1]] + [("gpt", 1.0, b, "whole") for b in batches[1:]]
    plans += [("gpt", 1.0, b, "frozen prefix") for b in batches]
    plans = [p for p in plans if (p[3] if not p[0].startswith("gpt") else "gpt") in kinds]
    plans += [(m, 1.0, 32, k) for k in LOW_RANK if k in kinds for m in (LOW_RANK_MODELS[:1] if quick else LOW_RANK_MODELS)]
    out = []
    for model, width, batch, kind in plans:
        started = time.perf_counter()
        fedepth = kind == "fedepth"
        method = kind if kind in ("fedepth", "fedmef", *LOW_RANK) else "fedavg"
        config = experiment(model, width, batch, device, cudnn, method, "fair" if fedepth else "none", precision)
        env = ClientEnvironment.from_config(config)
        state = initial_state(config, env).global_state  # on the device, as the server holds it
        settings = train_settings(config.fl, 1)
        method_state = env.method.init_state()
        tasks = low_rank_levels(env, kind, RoundContext(1, 0, config.seed, len(env.partitions[0]), settings, None)) if kind in LOW_RANK else []
        for client in range(config.fl.clients) if fedepth else range(0 if kind in LOW_RANK else 1):
            ctx = RoundContext(1, client, config.seed, len(env.partitions[client]), settings, env.budgets[client])
            task = env.method.plan(ctx, method_state)
            if task is None:
                print(f"{model} b{batch} fedepth {ctx.budget.tier}: sits out (no block fits its budget)", file=sys.stderr)
                continue
            tasks.append((f"FeDepth {ctx.budget.tier}: {describe_task(task)}" if fedepth
                          else "FedMef, density 0.1, SAP s=0.9" if kind == "fedmef" else kind,
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
    parser.add_argument("--cudnn", default="off", choices=["off", "on"],
                        help="backend.cudnn: off, as hfl trains clients with budgets; on adds cuDNN's workspace to the measurement")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"], help="fl.precision of every row")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds {args.kinds!r}: a comma-separated subset of {', '.join(KINDS)}")
    found = rows(args.device, args.quick, kinds, args.cudnn, args.precision)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": found}, f, indent=1)
    print(table(found))
    worst = max(found, key=lambda r: abs(r["ratio"] - 1))
    print(f"worst estimate/measured = {worst['ratio']:.3f} ({worst['model']} x{worst['width']:g} b{worst['batch']} {worst['what']})")


if __name__ == "__main__":
    main()
