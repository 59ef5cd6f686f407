"""The plain FedAvg loop (benchmarks/plain_fedavg.py: the small CNN on digits) with one intra-op
thread against more, alternated in one process: why `backend.threads` defaults to 1.

    python benchmarks/threads.py [--repeats 3] [--rounds 5] [--threads 2]

The last line is `slowdown=<median seconds with --threads / seconds with one thread>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from plain_fedavg import run_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads to compare with one")
    args = parser.parse_args()
    run_plain(rounds=1)  # warm-up: imports, allocator, data cache
    ratios = []
    for i in range(args.repeats):
        seconds = {}
        for threads in (1, args.threads):
            torch.set_num_threads(threads)
            seconds[threads], _, _ = run_plain(rounds=args.rounds)
        ratios.append(seconds[args.threads] / seconds[1])
        print(f"repeat {i}: 1 thread {seconds[1]:.2f}s  {args.threads} threads {seconds[args.threads]:.2f}s  "
              f"ratio {ratios[-1]:.2f}", file=sys.stderr, flush=True)
    print(f"cpus={os.cpu_count()} slowdown={statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
