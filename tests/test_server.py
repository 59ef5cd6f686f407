"""The round loop end to end on digits: metrics files, determinism, drivers, resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hfl.config import load_config
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.server import run_experiment, sample_cohort
from tests.conftest import QUICKSTART, ROOT, cli_env, small_config


def scores(out):
    return [(r["round"], r["accuracy"], r["loss"], [c["train_loss"] for c in r["clients"]]) for r in read_metrics(out)]


def test_run_writes_metrics_and_summary(tmp_path):
    summary = run_experiment(small_config(fl={"eval_every": 2}), tmp_path)
    records = read_metrics(tmp_path)
    assert [r["round"] for r in records] == [1, 2, 3]
    assert records[0]["accuracy"] is None and records[1]["accuracy"] is not None  # eval every 2, and the last
    for record in records:
        assert len(record["clients"]) == 3 and record["wall_seconds"] > 0
        for client in record["clients"]:
            assert {"id", "num_samples", "train_loss", "bytes_down", "bytes_up"} <= client.keys()
            assert client["bytes_up"] == client["bytes_down"] > 0  # FedAvg: the whole model both ways
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == summary
    assert summary["final_accuracy"] == records[-1]["accuracy"]
    assert summary["best_accuracy"] == max(r["accuracy"] for r in records if r["accuracy"] is not None)
    assert (tmp_path / "checkpoint.pt").is_file() and (tmp_path / "config.yaml").is_file()


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path):
    run_experiment(small_config(), tmp_path / "a")
    run_experiment(small_config(), tmp_path / "b")
    run_experiment(small_config(seed=1), tmp_path / "c")
    assert scores(tmp_path / "a") == scores(tmp_path / "b")
    assert scores(tmp_path / "a") != scores(tmp_path / "c")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_trainer_gives_the_same_weights_as_the_fast_driver(tmp_path, precision):
    """PreResNet-20 (batch norms with running statistics): the final weights and buffers are equal
    bit for bit, and so is every round's metrics line, in float32 and under bf16 autocast (Lightning's
    precision plugin against the fast driver's `Precision`). 16-mixed needs CUDA (tests marked gpu)."""
    import torch

    for trainer in ("fast", "lightning"):
        run_experiment(small_config(model={"name": "preresnet20"}, fl={"rounds": 2, "precision": precision},
                                    backend={"device": "cpu", "trainer": trainer}), tmp_path / trainer)
    assert scores(tmp_path / "fast") == scores(tmp_path / "lightning")
    fast, pl = (torch.load(tmp_path / t / "checkpoint.pt", weights_only=False)["global_state"] for t in ("fast", "lightning"))
    assert set(fast) == set(pl) and any("running_mean" in k for k in fast)
    for key in fast:
        assert torch.equal(fast[key], pl[key]), key


def test_cohort_is_a_seeded_fraction():
    config = small_config(fl={"clients": 10, "fraction": 0.3})
    cohorts = [sample_cohort(config, r) for r in range(1, 6)]
    assert all(len(c) == 3 and len(set(c)) == 3 for c in cohorts)
    assert cohorts == [sample_cohort(config, r) for r in range(1, 6)]
    assert len({tuple(c) for c in cohorts}) > 1


@pytest.mark.slow
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    overrides = ["fl.rounds=6", "fl.clients=6", "fl.fraction=1.0", "fl.local_epochs=4", "backend.device=cpu"]
    command = [sys.executable, "-m", "hfl.cli", "run", str(QUICKSTART), *overrides]
    full, killed = tmp_path / "full", tmp_path / "killed"
    # The uninterrupted run in this process: a run computes the same in any process (two fresh ones: below).
    run_experiment(load_config(QUICKSTART, overrides), full)

    proc = subprocess.Popen([*command, "--out", str(killed)], cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(read_metrics(killed)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rounds_before_kill = len(read_metrics(killed))
    assert 3 <= rounds_before_kill < 6, "the run must be killed part-way"

    subprocess.run([*command, "--resume", str(killed)], check=True, cwd=ROOT, env=cli_env(), capture_output=True)
    assert scores(killed) == scores(full)
    assert json.loads((killed / "summary.json").read_text())["final_accuracy"] == json.loads((full / "summary.json").read_text())["final_accuracy"]


def test_a_round_line_cut_mid_write_is_not_a_round_and_resume_rewrites_it(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_experiment(small_config(fl={"rounds": 3}), full)
    run_experiment(small_config(fl={"rounds": 2}), cut)
    third_line = (full / "metrics.jsonl").read_text().splitlines()[2]
    with open(cut / "metrics.jsonl", "a") as f:  # what a poller or a SIGKILL sees between two writes
        f.write(third_line[: len(third_line) // 2])
    assert [r["round"] for r in read_metrics(cut)] == [1, 2]
    run_experiment(small_config(fl={"rounds": 3}), cut, resume=True)
    assert scores(cut) == scores(full)


def test_a_diverged_run_is_flagged_once_and_goes_on(tmp_path, caplog):
    summary = run_experiment(small_config(fl={"lr": 1e6}), tmp_path / "diverged")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "diverged" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("round 1: clients [") and "lr 1e+06" in warnings[0]
    assert summary["rounds"] == 3  # the run goes on, as a failed client's does
    caplog.clear()
    run_experiment(small_config(), tmp_path / "fine")
    assert not [r for r in caplog.records if "diverged" in r.getMessage()]


def test_resume_refuses_a_changed_config(tmp_path):
    run_experiment(small_config(fl={"rounds": 1}), tmp_path)
    from hfl.cli import main

    config_path = tmp_path / "config.yaml"
    assert main(["run", str(config_path), "fl.rounds=2", "--resume", str(tmp_path)]) == 0  # more rounds is fine
    assert len(read_metrics(tmp_path)) == 2
    assert main(["run", str(config_path), "data.alpha=0.9", "--resume", str(tmp_path)]) == 2


def test_resume_accepts_a_run_written_before_a_field_existed(tmp_path):
    import yaml

    run_experiment(small_config(fl={"rounds": 1}), tmp_path)
    from hfl.cli import main

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["model"]["pretrained"]  # as written by an hfl that had no such field
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert main(["run", str(tmp_path / "config.yaml"), "fl.rounds=2", "--resume", str(tmp_path)]) == 0
    # a field the run had, changed, is still refused
    assert main(["run", str(tmp_path / "config.yaml"), "fl.rounds=3", "fl.lr=0.5", "--resume", str(tmp_path)]) == 2


def test_resume_continues_the_saved_run_not_the_config_file(tmp_path, capsys):
    from hfl.cli import main
    from hfl.config import dump_config

    yaml_file, out = tmp_path / "exp.yaml", tmp_path / "run"
    dump_config(small_config(fl={"rounds": 3}), yaml_file)
    assert main(["run", str(yaml_file), "fl.rounds=1", "--out", str(out)]) == 0
    capsys.readouterr()
    # The file says 3 rounds, the run was started with 1: resuming continues the run, and says so.
    assert main(["run", str(yaml_file), "--resume", str(out)]) == 0
    assert len(read_metrics(out)) == 1
    assert "fl.rounds=3 not taken" in capsys.readouterr().err
    # No config file is needed; an explicit override extends the run.
    assert main(["run", "--resume", str(out), "fl.rounds=2"]) == 0
    assert len(read_metrics(out)) == 2
    assert main(["run", "--resume", str(out), "data.alpha=0.9"]) == 2
    assert "differs in data.alpha" in capsys.readouterr().err


def test_budgets_no_client_fits_are_refused_before_round_1(tmp_path):
    config = small_config(method={"name": "heterofl"}, fl={"rounds": 1}, budgets={"scenario": "tiers", "memory": ["1B"]})
    with pytest.raises(ConfigError, match=r"budgets.memory=\('1B',\).*none of the 6 clients' does"):
        run_experiment(config, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_round_no_sampled_client_can_train_says_so(tmp_path, caplog):
    """One client of six fits; a round whose cohort misses it trains nothing and says so."""
    config = small_config(method={"name": "heterofl"}, fl={"rounds": 3, "fraction": 1 / 6},
                          budgets={"scenario": "tiers", "memory": ["1B", "width:1"], "shares": [5 / 6, 1 / 6]})
    with caplog.at_level("WARNING", logger="hfl.server"):
        summary = run_experiment(config, tmp_path)
    assert summary["skipped_client_rounds"] > 0
    assert "no sampled client's budget fits any sub-model of heterofl; the round trains nothing" in caplog.text


def test_resuming_with_fewer_rounds_than_were_run_is_refused_and_leaves_the_run_as_it_was(tmp_path):
    import dataclasses

    config = small_config(fl={"rounds": 2})
    run_experiment(config, tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json")}
    shorter = dataclasses.replace(config, fl=dataclasses.replace(config.fl, rounds=1))
    with pytest.raises(ConfigError, match=r"fl.rounds=1 .*at least 2"):
        run_experiment(shorter, tmp_path, resume=True)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


GLOBAL_DRAWS = '''"""A method that draws from the process-global generators, which hfl itself never does. hfl does not
seed them, so the plug-in seeds them when it is imported, as a user's code that wants repeatable runs would."""
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from hfl.methods.base import Method, MethodConfig
from hfl.registry import METHODS

random.seed(0)
np.random.seed(0)
torch.manual_seed(0)


@dataclass(frozen=True)
class GlobalDrawsConfig(MethodConfig):
    name: str = "global_draws"


@METHODS.register("global_draws")
class GlobalDraws(Method):
    """FedAvg, then every weight nudged by draws from numpy's and random's global generators; torch's
    global draw of each round is written to $GLOBAL_DRAWS_LOG."""

    Config = GlobalDrawsConfig

    def aggregate(self, global_state, updates, state):
        mean, state = super().aggregate(global_state, updates, state)
        with open(os.environ["GLOBAL_DRAWS_LOG"], "a") as log:
            log.write(f"{float(torch.rand(())).hex()}\\n")
        nudge = float(np.random.rand()) + random.random()
        return {k: v + 1e-2 * nudge if v.is_floating_point() else v for k, v in mean.items()}, state
'''


@pytest.mark.slow
def test_resume_in_a_fresh_process_restores_the_global_generators(tmp_path):
    """A plug-in method whose aggregate draws from numpy's, Python's and torch's global generators:
    2 rounds, then a fresh process (which seeds them again on importing the plug-in) resumes to 4, and
    its numbers equal 4 rounds uninterrupted only if the checkpoint restored numpy's and Python's
    generators and torch's (hfl's own draws come from seeded generators of their own, and the models
    it builds lazily, in round 1 here and in round 3 after the resume, are built aside from torch's)."""
    (tmp_path / "draws_plugin.py").write_text(GLOBAL_DRAWS)
    env = {**cli_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{cli_env()['PYTHONPATH']}"}
    base = [sys.executable, "-m", "hfl.cli", "run", str(QUICKSTART), "plugins=[draws_plugin]", "method.name=global_draws",
            "fl.clients=4", "fl.fraction=1.0", "fl.local_epochs=1", "backend.device=cpu"]

    def hfl(log, *args):
        subprocess.run([*base, *args], check=True, cwd=ROOT, env={**env, "GLOBAL_DRAWS_LOG": str(tmp_path / log)}, capture_output=True)

    hfl("full.log", "fl.rounds=4", "--out", str(tmp_path / "full"))
    hfl("resumed.log", "fl.rounds=2", "--out", str(tmp_path / "resumed"))
    hfl("resumed.log", "fl.rounds=4", "--resume", str(tmp_path / "resumed"))
    assert [r["round"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3, 4]
    assert scores(tmp_path / "resumed") == scores(tmp_path / "full")
    full, resumed = ((tmp_path / log).read_text().split() for log in ("full.log", "resumed.log"))
    assert len(full) == 4 and resumed == full  # one torch draw per round, the resumed process's rounds 3-4 included


@pytest.mark.slow
def test_the_same_run_in_two_fresh_processes_is_bit_identical(tmp_path):
    """Nothing a run computes depends on the process it runs in (hash seeds, import order, the
    global generators' start): two `hfl run`s under HeteroFL's width sub-models write
    the same metrics and the same final weights, bit for bit. This holds on any machine."""
    import torch

    command = [sys.executable, "-m", "hfl.cli", "run", str(QUICKSTART), "method.name=heterofl",
               "budgets.scenario=fair", "fl.rounds=2", "fl.clients=4", "fl.fraction=1.0", "fl.local_epochs=1", "backend.device=cpu"]
    for name, seed in (("a", "1"), ("b", "2")):  # another hash seed: a set's order must not reach a number
        subprocess.run([*command, "--out", str(tmp_path / name)], check=True, cwd=ROOT, env={**cli_env(), "PYTHONHASHSEED": seed},
                       capture_output=True)
    assert scores(tmp_path / "a") == scores(tmp_path / "b")
    a, b = (torch.load(tmp_path / n / "checkpoint.pt", weights_only=False)["global_state"] for n in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
