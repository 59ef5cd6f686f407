"""Where a client process's memory goes: resident memory (VmRSS) of a fresh interpreter after
`import torch`, after `import torch, lightning`, and after building hfl's client environment for
throughput.py's work (what every Ray client actor builds before its first client). Each step runs
in its own fresh process, `--repeats` times; the median is printed, in MiB (2^20 bytes).

    python benchmarks/import_memory.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = ("torch", "lightning", "client_env")


def rss_bytes() -> int:
    kb = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(kb.split()[1]) * 1024


def child(step: str) -> int:
    import torch  # noqa: F401  (imported for its memory)

    if step in ("lightning", "client_env"):
        import lightning  # noqa: F401
    if step == "client_env":
        sys.path.insert(0, str(HERE))
        from throughput import hfl_config

        from hfl.backends.base import ClientEnvironment

        ClientEnvironment.from_config(hfl_config("fast"))
    return rss_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=STEPS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    results = {}
    for step in STEPS:
        sizes = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--child", step], capture_output=True, text=True, check=True)
            sizes.append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[step] = statistics.median(sizes) / 2**20
        print(f"{step}: {', '.join(f'{s / 2**20:.0f}' for s in sizes)} MiB", file=sys.stderr, flush=True)
    print(" ".join(f"{step}_mib={mib:.0f}" for step, mib in results.items()))


if __name__ == "__main__":
    main()
