"""Lightning as its users know it: the Trainer's training settings honoured by both client drivers
with the same numbers, callbacks run in a client's training, a client-round fitted with your own
Trainer, and a lightning run that prints no more than a fast one plus one line."""

import subprocess
import sys

import lightning as L
import pytest
import torch

from hfl.backends.base import ClientEnvironment
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.server import initial_state, run_experiment, train_settings
from hfl.types import RoundContext
from tests.conftest import QUICKSTART, ROOT, cli_env, small_config
from tests.test_server import scores


def weights(out):
    return torch.load(out / "checkpoint.pt", weights_only=False)["global_state"]


@pytest.mark.parametrize("settings", [{"gradient_clip_val": 0.05}, {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"},
                                      {"accumulate_grad_batches": 3}], ids=["clip-norm", "clip-value", "accumulate"])
def test_each_training_setting_gives_the_same_numbers_under_both_drivers_and_changes_them(tmp_path, settings):
    """Each setting changes the run (so neither driver may ignore it) and both drivers apply it alike:
    the fast driver's clipping and accumulation against lightning.Trainer's own."""
    runs = {}
    for name, fl, trainer in [("plain", {}, "fast"), ("fast", settings, "fast"), ("lightning", settings, "lightning")]:
        run_experiment(small_config(fl={"rounds": 2, **fl}, backend={"device": "cpu", "trainer": trainer}), tmp_path / name)
        runs[name] = weights(tmp_path / name)
    assert scores(tmp_path / "fast") == scores(tmp_path / "lightning")
    assert all(torch.equal(runs["fast"][k], runs["lightning"][k]) for k in runs["fast"])
    assert not all(torch.equal(runs["fast"][k], runs["plain"][k]) for k in runs["fast"])


def test_callbacks_run_in_every_clients_training_and_change_no_number(tmp_path):
    from tests import lightning_callbacks

    lightning_callbacks.BATCHES.clear()
    run_experiment(small_config(fl={"rounds": 2}), tmp_path / "plain")
    run_experiment(small_config(fl={"rounds": 2, "callbacks": ["tests.lightning_callbacks:CountingCallback"]}), tmp_path / "called")
    records = scores(tmp_path / "called")
    assert records == scores(tmp_path / "plain")
    config = small_config()
    env = ClientEnvironment.from_config(config)
    batches = [-(-len(env.partitions[c["id"]]) // config.fl.batch_size) for r in read_metrics(tmp_path / "called") for c in r["clients"]]
    assert len(lightning_callbacks.BATCHES) == sum(batches) > 0


def test_a_callback_that_cannot_be_imported_names_the_field():
    with pytest.raises(ConfigError, match=r"fl\.callbacks.*'tests\.nowhere'.*package\.module:Class"):
        small_config(fl={"callbacks": ["tests.nowhere"]})
    for path, allowed in [("tests.nowhere:Callback", "an importable class"), ("tests.lightning_callbacks:Missing", "a class")]:
        with pytest.raises(ConfigError, match=rf"fl\.callbacks.*{path}.*{allowed}"):
            ClientEnvironment.from_config(small_config(fl={"callbacks": [path]}))


@pytest.mark.parametrize("method", ["fedavg", "fedepth"])
def test_a_client_round_fitted_with_your_own_trainer_is_hfls_update(method):
    """The worked example of docs/extending.md: fit `module` once per stage under your own Trainer
    with `trainer_settings()`, and `update()` is what hfl's own training sends, bit for bit (FeDepth:
    several stages)."""
    config = small_config(model={"name": "preresnet20"}, method={"name": method},
                          budgets={"scenario": "fair" if method == "fedepth" else "none"}, fl={"clients": 8})
    env = ClientEnvironment.from_config(config)
    state = initial_state(config, env).global_state
    ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1), env.budgets[0])
    task = env.method.plan(ctx, {})
    expected = env.train(state, task)

    client = env.lightning_client(state, task)
    for _ in client.stages():
        L.Trainer(**client.trainer_settings()).fit(client.module, train_dataloaders=client.batches)
    update = client.update()

    assert method != "fedepth" or len(task.stages) > 1
    assert update.state.keys() == expected.state.keys()
    assert all(torch.equal(update.state[k], expected.state[k]) for k in update.state)
    assert update.metrics["train_loss"] == expected.metrics["train_loss"]
    assert update.metrics["estimated_peak_bytes"] == expected.metrics["estimated_peak_bytes"]


@pytest.mark.slow
def test_a_lightning_run_prints_what_a_fast_run_does_plus_one_line(tmp_path):
    lines = {}
    for trainer in ("fast", "lightning"):
        done = subprocess.run([sys.executable, "-m", "hfl.cli", "run", str(QUICKSTART), "fl.rounds=3", f"backend.trainer={trainer}",
                               "--out", str(tmp_path / trainer)], env=cli_env(), cwd=ROOT, check=True, capture_output=True, text=True)
        lines[trainer] = (done.stdout + done.stderr).splitlines()
    assert len(lines["lightning"]) <= len(lines["fast"]) + 1, "\n".join(lines["lightning"])
    assert not any("GPU available" in line for line in lines["lightning"])
