"""The golden runs: every experiment in experiments/ in its reduced digits form, and every method on
digits with PreResNet-20 under `fair` budgets, two rounds each, and what they must reproduce.

Runs are deterministic, so a change that should not change numbers is proven by these: the
metrics of every round (accuracies, losses, sub-model and exit accuracies, per-client losses, bytes,
FLOPs, estimated peaks, budgets, tiers, skipped clients) equal the recorded ones exactly. Timings
are left out. The CPU's instruction set changes float results (a 2-round PreResNet-20 run ends at
0.600 with AVX-512 kernels and 0.656 with AVX2 ones), so the runs use AVX2 kernels in torch, oneDNN
and MKL (`PINNED_ISA`), which every x86-64 machine of the last decade has.

    python -m tests.golden.runs --record          # rewrite tests/golden/fixtures/ (a deliberate change of numbers)
    python -m tests.golden.runs --out runs.json   # what the test compares
    python -m tests.golden.runs --record --only fedmef   # rewrite the fixtures of the runs whose names contain fedmef
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1"}
REDUCED = ["data.name=digits", "model.name=preresnet20", "fl.clients=8", "fl.fraction=0.5", "fl.rounds=2",
           "fl.batch_size=16", "fl.local_epochs=1"]
"""The reduced form of an experiment (as tests/test_experiments.py runs ScaleFL's comparison)."""
REDUCED_TEXT = ["data.seq_len=8", "data.stride=8", "model.name=gpt", "model.depth=2", "model.width=0.5", "model.pretrained=''",
                "fl.clients=6", "fl.fraction=0.5", "fl.rounds=2", "fl.batch_size=16", "fl.local_epochs=1"]
"""The reduced form of a text experiment: the Shakespeare fixture corpus (`tests.conftest`, written
for the run), a 2-block half-width GPT from random weights (CI has no pretrained family)."""
REDUCED_VIT = ["data.name=digits", "model.name=vit", "model.pretrained=''", *REDUCED[2:]]
"""The reduced form of a ViT-family experiment (CAFF's CIFAR task): digits, the 6-block `vit` from random weights."""
METHODS = ("decoupled", "depthfl", "fedavg", "feddf", "feddst", "fedepth", "fedmef", "fedprox", "fedtiny", "flpqsu", "fedrolex", "fjord",
           "heterofl", "mfedepth", "nefl", "scalefl", "splitmix")
TIMINGS = ("wall_seconds", "seconds")


PRETRAIN_CONFIGS = ROOT / "experiments" / "pretrain"
"""`hfl pretrain`'s configs: pretraining families, not experiments (tests/test_pretrain.py loads them)."""


def experiment_files() -> list[Path]:
    """Every experiment YAML in experiments/."""
    return [p for p in sorted((ROOT / "experiments").rglob("*.yaml")) if PRETRAIN_CONFIGS not in p.parents]


def is_text_experiment(path: Path) -> bool:
    import yaml

    return (yaml.safe_load(path.read_text()).get("data") or {}).get("name") == "shakespeare"


def is_vit_family_experiment(path: Path) -> bool:
    import yaml

    return str((yaml.safe_load(path.read_text()).get("model") or {}).get("name", "")).startswith("vit_caff")


def runs() -> dict[str, tuple[Path, list[str]]]:
    """Run name -> (experiment file, overrides)."""
    found: dict[str, tuple[Path, list[str]]] = {}
    for path in experiment_files():
        name = str(path.relative_to(ROOT / "experiments").with_suffix("")).replace("/", "__")
        extra = ["method.distill_steps=5"] if "feddf" in path.stem else []
        if is_text_experiment(path):
            extra = ["method.depths=[1,2]"] if path.stem == "caff" else []
            found[f"experiment__{name}"] = (path, REDUCED_TEXT + extra)
            continue
        if is_vit_family_experiment(path):
            extra = ["method.depths=[1,2]"] if path.stem == "caff" else []
            found[f"experiment__{name}"] = (path, REDUCED_VIT + extra)
            continue
        found[f"experiment__{name}"] = (path, REDUCED + extra)
    quickstart = ROOT / "experiments" / "quickstart.yaml"
    for method in METHODS:
        extra = ["data.server_fraction=0.1", "method.distill_steps=5"] if method == "feddf" else []
        if method in ("fedtiny", "fedmef", "feddst"):  # adjust the masks in both rounds, so the fixtures pin prune/grow
            extra = ["method.adjust_every=1"]
        found[f"method__{method}"] = (quickstart, [*REDUCED, f"method.name={method}", "budgets.scenario=fair", *extra])
    return found


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def run(path: Path, overrides: list[str]) -> list[dict[str, Any]]:
    from hfl.config import load_config
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    with tempfile.TemporaryDirectory() as out:
        if is_text_experiment(path):
            from tests.conftest import write_shakespeare_corpus

            corpus = write_shakespeare_corpus(Path(out) / "corpus")
            overrides = [*overrides, f"data.root={corpus}", f"data.cache_dir={Path(out) / 'cache'}"]
        run_experiment(load_config(path, overrides), Path(out) / "run")
        return without_timings(read_metrics(Path(out) / "run"))


def run_all(names: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    selected = runs()
    return {name: run(*selected[name]) for name in (names or selected)}


def selected_names(only: list[str] | None, exact: bool = False) -> list[str]:
    """The golden runs whose names contain one of `only` (are one of them, `exact`), all without it."""
    names = list(runs())
    return [n for n in names if not only or any(part == n if exact else part in n for part in only)]


def run_pinned(out: Path, only: list[str] | None = None, exact: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The golden runs (`selected_names(only, exact)`) in a fresh process with the pinned instruction
    set (set before torch loads)."""
    env = {**os.environ, **PINNED_ISA, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subset = [arg for part in only or [] for arg in ("--only", part)] + (["--exact"] if exact else [])
    subprocess.run([sys.executable, "-m", "tests.golden.runs", "--out", str(out), *subset], env=env, cwd=ROOT, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="rewrite the fixtures from a pinned run")
    parser.add_argument("--out", help="write every run's metrics to this JSON file (run in this process)")
    parser.add_argument("--only", action="append", metavar="PART", help="only the runs whose names contain PART (repeatable)")
    parser.add_argument("--exact", action="store_true", help="--only names whole runs")
    args = parser.parse_args()
    names = selected_names(args.only, args.exact)
    if not names:
        sys.exit(f"--only {args.only} matches no golden run")
    logging.disable(logging.WARNING)
    if args.out:
        missing = {k: v for k, v in PINNED_ISA.items() if os.environ.get(k) != v}
        if missing:
            sys.exit(f"set {missing} before starting Python (run_pinned does)")
        Path(args.out).write_text(json.dumps(run_all(names)))
        return
    if args.record:
        with tempfile.TemporaryDirectory() as tmp:
            found = run_pinned(Path(tmp) / "runs.json", args.only, args.exact)
        FIXTURES.mkdir(exist_ok=True)
        for old in FIXTURES.glob("*.json"):
            if not args.only or old.stem in found:
                old.unlink()
        for name, records in found.items():
            (FIXTURES / f"{name}.json").write_text(json.dumps(records, indent=1) + "\n")
        print(f"recorded {len(found)} runs in {FIXTURES}")


if __name__ == "__main__":
    main()
