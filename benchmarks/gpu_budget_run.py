"""One `hfl run` on Ray and a GPU in which client 0's memory budget (20 MB) is below what its
training needs (PreResNet-20 at batch 32 on 32x32 images: about 50 MiB): it should fail with CUDA
out of memory, be recorded in `failed_clients`, and the other three clients should train within
their 1 GB budgets, round after round.

    python benchmarks/gpu_budget_run.py [--device cuda]

Prints each round's failed clients and each trained client's measured peak against its budget;
exits 1 if the run does not behave so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hfl.cli import main as hfl_main
from hfl.loggers import read_metrics

QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        overrides = ["data.name=synthetic", "model.name=preresnet20", "fl.rounds=2", "fl.clients=4", "fl.fraction=1",
                     "fl.batch_size=32", "budgets.scenario=per_client", "budgets.memory=[20MB,1GB,1GB,1GB]",
                     "backend.name=ray", f"backend.device={args.device}", "backend.actors_per_pool=2"]
        code = hfl_main(["run", str(QUICKSTART), *overrides, "--out", str(out)])
        if code:
            return code
        ok = True
        for record in read_metrics(out):
            failed = {f["id"]: f["reason"] for f in record["failed_clients"]}
            trained = [(c["id"], c["measured_peak_bytes"], c["budget_bytes"]) for c in record["clients"]]
            print(f"round {record['round']}: failed {failed}; trained (id, measured peak, budget) {trained}")
            ok &= set(failed) == {0} and "OutOfMemoryError" in failed[0]
            ok &= all(peak is not None and peak <= budget for _, peak, budget in trained)
        print(json.dumps(json.loads((out / "summary.json").read_text()), indent=1))
    print("as expected" if ok else "NOT as expected: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
