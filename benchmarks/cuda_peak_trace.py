"""What CUDA's caching allocator holds at the peak of one client-round, and which code asked for each
block: for a gap between `memory_accuracy.py`'s estimate and `torch.cuda.max_memory_allocated` that
no tensor explains (a kernel's scratch memory, like the unfolded convolution input that
`Accountant.conv_workspace` now counts). Needs CUDA; one row of the memory table per call.

    python benchmarks/cuda_peak_trace.py --model vit --width 1 --batch 32

The client-round runs twice: the first warms the process, the second is recorded with C++ and Python
stacks (`torch.cuda.memory._record_memory_history(stacks="all")`). Printed: the estimate, the
allocator's peak and the live tensors' peak of that round; the blocks alive at its peak, grouped by
size and origin (the nearest hfl frame, and the innermost `at::native` or `at::cuda` function when a
kernel asked for the block without a Python frame); and the allocations just before the peak.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from memory_accuracy import MiB, experiment

from hfl.accounting.memory import CUDA_ALLOCATION_UNIT, LiveStorageTracker
from hfl.experiment import ClientEnvironment
from hfl.server import initial_state, train_settings
from hfl.types import RoundContext

KERNEL_FRAMES = ("at::native", "at::cuda")


def origin(event: dict[str, Any]) -> str:
    """Where an allocation came from: hfl's innermost Python frames and the innermost ATen function."""
    frames = event.get("frames", [])
    python = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames
              if f["filename"].endswith(".py") and "torch" not in Path(f["filename"]).parts][:3]
    native = [f["name"] for f in frames if any(k in f["name"] for k in KERNEL_FRAMES)][:1]
    return " <- ".join(python) + (f"  [{native[0][:140]}]" if native else "")


def alive_at_peak(trace: list[dict[str, Any]]) -> tuple[int, int, list[dict[str, Any]]]:
    """(peak bytes, index of the event that reached it, the allocations alive then) of the blocks
    allocated during the recording: allocations count from `alloc` to `free_requested`."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = at = 0
    alive: list[dict[str, Any]] = []
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at, alive = total, i, list(live.values())
    return peak, at, alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--groups", type=int, default=25, help="how many groups of live blocks to print")
    parser.add_argument("--stacks", default="all", choices=["all", "python"],
                        help="all: C++ frames too (symbolised when the snapshot is taken, which can take a minute)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_peak_trace.py needs CUDA: the allocator's history exists only there", file=sys.stderr)
        sys.exit(2)
    config = experiment(args.model, args.width, args.batch, "cuda", "off")
    env = ClientEnvironment.from_config(config)
    state = initial_state(config, env).global_state
    ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1), env.budgets[0])
    task = env.method.plan(ctx, env.method.init_state())
    env.train(state, task)  # the process's first client-round: its one-off allocations stay out of the record
    with LiveStorageTracker("cuda", unit=CUDA_ALLOCATION_UNIT) as tracker:
        env.train(state, task)
    tracker.stop()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks=args.stacks)
    update = env.train(state, task)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    metrics = update.metrics
    print(f"{args.model} x{args.width:g} batch {args.batch}: estimated {metrics['estimated_peak_bytes'] / MiB:.3f} MiB, "
          f"allocator's peak {metrics['measured_peak_bytes'] / MiB:.3f} MiB (with the resident weights), "
          f"live tensors' peak {tracker.peak_bytes / MiB:.3f} MiB (without them)")
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, at, alive = alive_at_peak(trace)
    print(f"peak of the round's own allocations: {peak / MiB:.3f} MiB at event {at} of {len(trace)}; blocks alive then:")
    groups = Counter((event["size"], origin(event)) for event in alive)
    for (size, where), count in sorted(groups.items(), key=lambda item: -item[0][0] * item[1])[: args.groups]:
        print(f"  {size / MiB:9.4f} MiB x{count:4d}  {where}")
    print("the allocations just before the peak:")
    for event in trace[max(0, at - 15): at + 1]:
        print(f"  {event['action']:15s} {event['size'] / MiB:9.4f} MiB  {origin(event)}")


if __name__ == "__main__":
    main()
