"""The golden runs: every experiment in experiments/ in its reduced digits form for one round, every
method on digits with PreResNet-20 under `fair` budgets and the portable runs for two rounds each,
and what they must reproduce. The method runs carry each method's state from one round into the
next (masks adjusted, windows rolled, tiers tracked); an experiment run adds what its file sets on
top of its method, which one round exercises at 60 % of two rounds' CPU time.

Runs are deterministic, so a change that should not change numbers is proven by these. What a run
records is split (tests/golden/compare.py) into *facts* (bytes, FLOPs, estimated peaks, budgets,
tiers, the sub-model and level trained, skipped and failed clients, masks' counts, which scores
exist), equal on every machine, and *measured floats* (losses, accuracies), which a fixture holds
per platform it was recorded on (tests/golden/platforms.py: processor, instruction set, torch build,
BLAS). On a recorded platform every float must be equal bit for bit; elsewhere within a tolerance
(`tolerance_for`). Timings are left out. The runs use AVX2 kernels in torch, oneDNN and MKL
(`PINNED_ISA`), which every x86-64 machine of the last decade has: the instruction set is part of a
platform, and pinning it lets machines of one processor family share fixtures.

The reduced runs train PreResNet-20 (and ViTs, GPTs) at lr 0.1 with momentum 0.9, where float32
training is chaotic: a rounding difference in one step grows to per cent of a loss within an epoch.
Off a recorded platform their floats are therefore held only to a loose bound
(`CHAOTIC_TOLERANCE`); their facts are still exact. The *portable* runs (`PORTABLE_REGIME`, the
quickstart's CNN) drift near rounding and are held tightly (`PORTABLE_TOLERANCE`), so that a real
change fails them on any machine, and `test_golden.py` runs them under a second numerical path
(`OTHER_PATH`) on whatever machine runs the suite.

    python -m tests.golden.runs --record          # record this platform's fixtures (a deliberate change of numbers)
    python -m tests.golden.runs --out runs.json   # what the test compares
    python -m tests.golden.runs --record --only fedmef   # re-record the runs whose names contain fedmef
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

from tests.golden.compare import Tolerance, first_difference, float_differences, only_gained, split

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1"}
OTHER_PATH = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}
"""Another numerical path on the same machine: torch's scalar kernels, oneDNN's SSE4.1 ones and
MKL's compatibility code path, each summing in another order than the pinned AVX2 ones."""
PLATFORMS = Path(__file__).resolve().parent / "fixtures" / "platforms.json"
REDUCED = ["data.name=digits", "model.name=preresnet20", "fl.clients=8", "fl.fraction=0.5", "fl.rounds=2",
           "fl.batch_size=16", "fl.local_epochs=1"]
"""The reduced form of a method run (as tests/test_experiments.py runs ScaleFL's comparison)."""
ONE_ROUND = "fl.rounds=1"
"""What an experiment's reduced form changes of the method runs' (`runs`)."""
REDUCED_TEXT = ["data.seq_len=8", "data.stride=8", "model.name=gpt", "model.depth=2", "model.width=0.5", "model.pretrained=''",
                "fl.clients=6", "fl.fraction=0.5", "fl.rounds=2", "fl.batch_size=16", "fl.local_epochs=1"]
"""The reduced form of a text experiment: the Shakespeare fixture corpus (`tests.conftest`, written
for the run), a 2-block half-width GPT from random weights (CI has no pretrained family)."""
REDUCED_VIT = ["data.name=digits", "model.name=vit", "model.pretrained=''", *REDUCED[2:]]
"""The reduced form of a ViT-family experiment (CAFF's CIFAR task): digits, the 6-block `vit` from random weights."""
METHODS = ("decoupled", "depthfl", "fedavg", "feddf", "feddst", "fedepth", "fedmef", "fedprox", "fedtiny", "flpqsu", "fedrolex", "fjord",
           "heterofl", "mfedepth", "nefl", "scalefl", "splitmix")
TIMINGS = ("wall_seconds", "seconds")
PORTABLE_REGIME = [o for o in REDUCED if not o.startswith("model.name=")]
"""The reduced form on the quickstart's own small CNN (no batch norm), at its lr 0.1 and momentum
0.9: there float32 rounding differences stay near rounding over two rounds (at most 7.6e-7 of a loss
between numerical paths, docs/development.md), where PreResNet-20 amplifies them to per cent."""
PORTABLE = {"fedavg": [], "fedprox": ["method.name=fedprox"], "heterofl": ["method.name=heterofl", "budgets.scenario=fair"],
            "fedrolex": ["method.name=fedrolex", "budgets.scenario=fair"]}
"""The portable runs: what the aggregate, the step, a client objective (FedProx's proximal term at
its default mu) and width slices (static and rolling) compute."""


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
            found[f"experiment__{name}"] = (path, [*REDUCED_TEXT, *extra, ONE_ROUND])
            continue
        if is_vit_family_experiment(path):
            extra = ["method.depths=[1,2]"] if path.stem == "caff" else []
            found[f"experiment__{name}"] = (path, [*REDUCED_VIT, *extra, ONE_ROUND])
            continue
        found[f"experiment__{name}"] = (path, [*REDUCED, *extra, ONE_ROUND])
    quickstart = ROOT / "experiments" / "quickstart.yaml"
    for method in METHODS:
        extra = ["data.server_fraction=0.1", "method.distill_steps=5"] if method == "feddf" else []
        if method in ("fedtiny", "fedmef", "feddst"):  # adjust the masks in both rounds, so the fixtures pin prune/grow
            extra = ["method.adjust_every=1"]
        found[f"method__{method}"] = (quickstart, [*REDUCED, f"method.name={method}", "budgets.scenario=fair", *extra])
    for name, overrides in PORTABLE.items():
        found[f"portable__{name}"] = (quickstart, [*PORTABLE_REGIME, *overrides])
    return found


def tolerance_for(name: str) -> Tolerance:
    """The tolerance of a run's measured floats off its recorded platforms."""
    return PORTABLE_TOLERANCE if name.startswith("portable__") else CHAOTIC_TOLERANCE


CHAOTIC_TOLERANCE = Tolerance(loss_rel=(0.15, 0.7), accuracy_abs=(0.17, 0.26))
"""A bound, not a sensitivity: about twice the largest drift measured between the pinned AVX2 path of
an AMD EPYC (family 25) and three others (CI's machine, the same EPYC's AVX-512 kernels, and its
scalar/SSE4.1/MKL-compatible path): round 1 up to 7.3 % of a loss and 8.3 points of accuracy,
round 2 up to 33.5 % and 12.8 points. It catches a run that diverges or computes something else
entirely; the facts and the portable runs catch the rest."""
PORTABLE_TOLERANCE = Tolerance(loss_rel=(1e-5, 1e-5), accuracy_abs=(0.003, 0.003))
"""13 times the largest drift measured between numerical paths on the portable runs (7.6e-7 of a
loss over two rounds; no accuracy moved), and one test image (of 360) for a prediction that lies on
a class boundary. Every deliberate break in docs/development.md moves a loss by 1e-3 or more."""


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


def run_pinned(out: Path, only: list[str] | None = None, exact: bool = False,
               path: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]]]:
    """(the platform, the metrics of the golden runs `selected_names(only, exact)`), computed in a
    fresh process on the numerical path `path` (`PINNED_ISA` unless given; set before torch loads)."""
    env = {**os.environ, **(path or PINNED_ISA), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subset = [arg for part in only or [] for arg in ("--only", part)] + (["--exact"] if exact else [])
    subprocess.run([sys.executable, "-m", "tests.golden.runs", "--out", str(out), *subset], env=env, cwd=ROOT, check=True)
    found = json.loads(out.read_text())
    return found["platform"], found["runs"]


def pinned_platform() -> dict[str, str]:
    """This machine's platform as the golden runs see it: described in a fresh process with `PINNED_ISA`."""
    code = "import json; from tests.golden.platforms import describe; print(json.dumps(describe()))"
    env = {**os.environ, **PINNED_ISA, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout)


def fixture(name: str) -> dict[str, Any]:
    """A run's fixture: `facts` (the records, each measured float a placeholder) and `floats`
    (platform key -> path -> value)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def facts(name: str) -> list[dict[str, Any]]:
    """A run's recorded facts: its records with each measured float a placeholder (every other value
    is the same on every machine)."""
    return fixture(name)["facts"]


def platforms() -> dict[str, dict[str, str]]:
    """The recorded platforms: key -> what identifies it (tests/golden/platforms.py) and a note."""
    return json.loads(PLATFORMS.read_text())


def differences(name: str, records: list[dict[str, Any]], platform: str) -> list[str]:
    """How a run's records differ from its fixture: any fact; on a recorded platform any float; on
    another platform a float beyond `tolerance_for(name)` from any platform's recorded one."""
    recorded = fixture(name)
    found_facts, found_floats = split(records)
    if (where := first_difference(recorded["facts"], found_facts)) is not None:
        return [f"a fact differs (equal on every machine): {where}"]
    if platform in recorded["floats"]:
        return [f"on {platform}, where it was recorded, a float differs: {d}"
                for d in float_differences(recorded["floats"][platform], found_floats, None)]
    tolerance = tolerance_for(name)
    return [f"off its recorded platforms, a float lies beyond {tolerance} from {other}'s: {d}"
            for other, floats in recorded["floats"].items() for d in float_differences(floats, found_floats, tolerance)]


def record(platform: dict[str, str], found: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Write this platform's floats (and the facts) into the fixtures of the runs in `found`, and
    return what changed, a line per run. A run whose facts or whose floats on this platform changed
    is a change of numbers: the other platforms' floats of that run are dropped (they are stale;
    those platforms compare within the tolerance until recorded again)."""
    from tests.golden.platforms import key

    here = key(platform)
    known = platforms() if PLATFORMS.is_file() else {}
    known[here] = {**platform, **({"note": known[here]["note"]} if "note" in known.get(here, {}) else {})}
    PLATFORMS.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    changes = []
    for name, records in found.items():
        new_facts, new_floats = split(records)
        path = FIXTURES / f"{name}.json"
        old = json.loads(path.read_text()) if path.is_file() else None
        if old is None:
            changes.append(f"{name}: new")
            floats = {here: new_floats}
        elif old["facts"] != new_facts and old["floats"].get(here) == new_floats and only_gained(old["facts"], new_facts):
            # A run that records a new fact and computes what it did: every platform's floats still hold.
            changes.append(f"{name}: facts gained fields ({first_difference(old['facts'], new_facts)}); kept every platform's floats")
            floats = old["floats"]
        elif old["facts"] != new_facts:
            changes.append(f"{name}: facts changed ({first_difference(old['facts'], new_facts)}); dropped the floats of "
                           f"{sorted(set(old['floats']) - {here}) or 'no other platform'}")
            floats = {here: new_floats}
        elif here in old["floats"] and old["floats"][here] != new_floats:
            changes.append(f"{name}: floats changed; dropped the floats of {sorted(set(old['floats']) - {here}) or 'no other platform'}")
            floats = {here: new_floats}
        elif here not in old["floats"]:
            beyond = [f"{other}: {d}" for other, floats in old["floats"].items()
                      for d in float_differences(floats, new_floats, tolerance_for(name))]
            changes.append(f"{name}: floats of {here} added" + (f", {len(beyond)} beyond the tolerance ({beyond[0]})" if beyond else ""))
            floats = {**old["floats"], here: new_floats}
        else:
            continue
        path.write_text(json.dumps({"facts": new_facts, "floats": floats}, indent=1) + "\n")
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="record this platform's fixtures from a pinned run")
    parser.add_argument("--out", help="write the platform and every run's metrics to this JSON file (run in this process)")
    parser.add_argument("--only", action="append", metavar="PART", help="only the runs whose names contain PART (repeatable)")
    parser.add_argument("--exact", action="store_true", help="--only names whole runs")
    args = parser.parse_args()
    names = selected_names(args.only, args.exact)
    if not names:
        sys.exit(f"--only {args.only} matches no golden run")
    logging.disable(logging.WARNING)
    if args.out:
        from tests.golden.platforms import describe

        paths = (PINNED_ISA, OTHER_PATH)
        if not any(all(os.environ.get(k) == v for k, v in path.items()) for path in paths):
            sys.exit(f"set {PINNED_ISA} (or {OTHER_PATH}) before starting Python (run_pinned does)")
        Path(args.out).write_text(json.dumps({"platform": describe(), "runs": run_all(names)}))
        return
    if args.record:
        with tempfile.TemporaryDirectory() as tmp:
            platform, found = run_pinned(Path(tmp) / "runs.json", args.only, args.exact)
        FIXTURES.mkdir(exist_ok=True)
        changes = record(platform, found)
        print(f"recorded {len(found)} runs on {platform}; {len(changes)} changed:", *changes, sep="\n  ")


if __name__ == "__main__":
    main()
