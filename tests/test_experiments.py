"""Every shipped experiment and sweep runs, and the claims made about them hold.

Which test covers what:
- every file in experiments/ (including the ScaleFL, FeDepth and NeFL comparisons) runs for two
  rounds in its reduced digits form in tests/golden/ (`tests/golden/runs.py`), which checks every
  round's metrics against recorded fixtures; here `test_every_experiment_config_loads` loads each
  file as written, and `test_the_reduced_scalefl_comparison_keeps_every_budget` checks from those
  fixtures that the equal-memory comparison's methods keep every client-round within its budget;
  `test_scalefl_paper_protocol_gives_every_level_an_equal_share_of_clients` checks the paper's
  protocol (experiments/scalefl_cifar10/): no budgets, clients split evenly over the levels, and
  levels at 12.5 / 25 / 50 / 100 % of the parameters;
- every sweep in tune_spaces/ runs here, `test_every_sweep_runs_every_value_for_one_round`: each
  value of each searched path in at least one trial configuration, one round on tiny settings,
  without Ray (tests/tune/ runs the Tune machinery itself on a tiny sweep).
"""

from pathlib import Path

import pytest

from hfl.config import config_from_dict, load_config
from hfl.server import run_experiment
from hfl.tune import load_sweep
from hfl.tune.space import trial_values
from tests.conftest import ROOT, write_shakespeare_corpus
from tests.golden.runs import REDUCED, experiment_files, facts, is_text_experiment, runs

EXPERIMENTS = experiment_files()
COMPARISON = sorted((ROOT / "experiments" / "scalefl_cifar10_equal_memory").glob("*.yaml"))
PAPER_PROTOCOL = sorted((ROOT / "experiments" / "scalefl_cifar10").glob("*.yaml"))
SWEEPS = sorted((ROOT / "tune_spaces").glob("*.yaml"))
TINY = {"data.name": "digits", "fl.rounds": 1, "fl.clients": 4, "fl.fraction": 1.0, "fl.batch_size": 16, "fl.local_epochs": 1}
"""What every sweep trial is cut to here: digits (the one dataset a test machine always has), one round, 4 clients."""


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_experiment_config_loads(path: Path):
    # A pretrained family is built by `hfl pretrain` (tests/test_pretrain.py); the config must load without one.
    load_config(path, ["model.pretrained=''"] if "pretrained:" in path.read_text() else [])


def test_golden_runs_cover_every_experiment():
    covered = {path for path, _ in runs().values()}
    assert set(EXPERIMENTS) <= covered


@pytest.mark.parametrize("path", COMPARISON, ids=lambda p: p.stem)
def test_the_reduced_scalefl_comparison_keeps_every_budget(path: Path):
    """tests/golden/ reproduces these fixtures exactly, so what they show is what the code does."""
    name = "experiment__" + str(path.relative_to(ROOT / "experiments").with_suffix("")).replace("/", "__")
    records = facts(name)  # budgets and estimated peaks are facts: equal on every machine
    clients = [c for r in records for c in r["clients"]]
    assert clients and len(records) == 1  # an experiment's golden run is one round (tests/golden/runs.py)
    for c in clients:
        assert c["budget_bytes"] and c["estimated_peak_bytes"] <= c["budget_bytes"], (path.stem, c["id"])


@pytest.mark.parametrize("path", [p for p in PAPER_PROTOCOL if p.stem != "fedavg"], ids=lambda p: p.stem)
def test_scalefl_paper_protocol_gives_every_level_an_equal_share_of_clients(path: Path):
    from collections import Counter

    from hfl.backends.base import ClientEnvironment
    from hfl.methods.base import MethodState
    from hfl.server import train_settings
    from hfl.types import RoundContext

    config = load_config(path, [*REDUCED, "fl.clients=16", "method.distill_steps=1"] if path.stem == "feddf" else [*REDUCED, "fl.clients=16"])
    assert not config.budgets.enabled
    env = ClientEnvironment.from_config(config)
    settings = train_settings(config.fl, 1)
    levels = [env.method.plan(RoundContext(1, c, config.seed, len(env.partitions[c]), settings), MethodState()).level for c in range(16)]
    counts = Counter(levels)
    assert len(counts) == len(env.method.ladder.levels)
    if path.stem == "scalefl":  # a level drawn per client, as the paper's experiments do
        rows = env.method.level_table(None)
        assert [r["target"] for r in rows] == [0.125, 0.25, 0.5, 1.0] and {r["cost"] for r in rows} == {"params"}
    else:  # tier_window 0 without budgets: equal shares by client
        assert max(counts.values()) - min(counts.values()) <= 1, counts
    if path.stem in ("heterofl", "fedrolex", "fjord", "decoupled", "feddf"):
        assert sorted(round(lv.options.rate if hasattr(lv.options, "rate") else lv.options.p_max, 3)
                      for lv in env.method.ladder.levels) == [0.354, 0.5, 0.707, 1.0]


def diagonal(sweep) -> list[dict]:
    """Trial parameters in which every value of every searched path appears at least once."""
    values = {path: domain.examples() for path, domain in sweep.space.items()}
    count = max(len(v) for v in values.values())
    return [{path: v[i % len(v)] for path, v in values.items()} for i in range(count)]


TRIALS = [(path, params) for path in SWEEPS for params in diagonal(load_sweep(path))]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "params"), TRIALS, ids=[f"{p.stem}-{'-'.join(map(str, t.values()))}" for p, t in TRIALS])
def test_every_sweep_runs_every_value_for_one_round(tmp_path, path: Path, params: dict):
    sweep = load_sweep(path)
    tiny = dict(TINY)
    if is_text_experiment(sweep.experiment):  # the golden runs' text reduction: a fixture corpus, a 2-block GPT from random weights
        tiny = {"data.seq_len": 8, "data.stride": 8, "model.name": "gpt", "model.depth": 2, "model.width": 0.5, "model.pretrained": "",
                "data.root": str(write_shakespeare_corpus(tmp_path / "corpus")), "data.cache_dir": str(tmp_path / "cache"),
                **{k: v for k, v in TINY.items() if k != "data.name"}}
    config = config_from_dict(trial_values(sweep.base, {**params, **tiny}))
    for key, value in params.items():  # the trial runs the point it was given
        found = config
        for part in key.split("."):
            found = getattr(found, part)
        assert found == (tuple(value) if isinstance(value, list) else value), key
    summary = run_experiment(config, tmp_path)
    assert summary["rounds"] == 1 and summary["client_rounds"] + summary["skipped_client_rounds"] == 4
    assert summary["client_rounds"] > 0
    if config.budgets.scenario == "fair" and config.method.name == "fedavg":
        # width_methods.yaml's point: full-width FedAvg breaks the budgets of the three narrow tiers ...
        assert summary["budget_violations"] == 3
    elif config.budgets.scenario != "none":
        assert summary["budget_violations"] == 0  # ... which every budget-fitting method keeps
