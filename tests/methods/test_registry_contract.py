"""Every registered method runs 2 rounds on digits with 4 clients on the CNN (a transformer-only
method on the tiny GPT of the Shakespeare fixture instead), and every method that fits clients to
their budgets keeps every client-round within it, also on PreResNet-20 (its golden run)."""


import pytest

from hfl.errors import ConfigError
from hfl.registry import METHODS
from hfl.server import run_experiment
from tests.conftest import method_for, run_with_env, small_config
from tests.data.test_tokens import text_config

TRAINS_THE_FULL_MODEL_REGARDLESS = {"fedavg", "fedprox", "feddst", "flpqsu", "fedtiny", "fedmef"}
NEEDS_A_SERVER_SPLIT = {"feddf"}
SHORTER = {"feddf": {"distill_steps": 5}, "caff": {"depths": [1]}}  # seconds matter here; the method's own tests cover its defaults
ADJUSTING = {"fedtiny": {"adjust_every": 1}, "fedmef": {"adjust_every": 1}, "feddst": {"adjust_every": 1}}  # both rounds change the mask (and resume must keep it)
TRANSFORMER_ONLY = {"hetlora", "caff", "fedhm"}
"""Methods that adapt transformer blocks: they refuse the CNNs and run on the tiny GPT of the
Shakespeare fixture (`text_config`) instead."""
BUDGETS = {"caff": {"scenario": "tiers", "memory": ["width:1/2"]},
           "fedhm": {"scenario": "tiers", "memory": ["width:1/2", "width:1"], "upload": ["width:1/4", "width:1"]}}
"""Budgets other than `fair`: CAFF refuses budgets in which some client fits no block (Eq. 1);
FedHM's factors save upload and FLOPs, hardly memory, so under `fair` no client would train factors."""
CONTRACT_RUNS = [(m, "gpt" if m in TRANSFORMER_ONLY else "cnn") for m in METHODS.names()]
"""Every method on the CNN (on the GPT where it needs transformer blocks). On PreResNet-20, where
the `fair` budgets bind, the golden runs stand in for a second run (see the next test)."""


@pytest.mark.parametrize(("method", "model"), CONTRACT_RUNS)
def test_every_method_runs_two_rounds(tmp_path, monkeypatch, method, model):
    """Two rounds change the global weights, and the summary's final accuracy is the score of the
    method's global model on the final checkpoint's weights."""
    import torch

    from hfl.evaluation import Evaluator
    from hfl.server import initial_state

    config = fair_config(method, model=model, tmp_path=tmp_path)
    summary, env, final = run_with_env(config, tmp_path / "run", monkeypatch)
    start = initial_state(config, env).global_state
    assert summary["rounds"] == final["round"] == 2
    assert any(not torch.equal(final["global_state"][k], start[k]) for k in start)
    scored = Evaluator(env)(final["global_state"], env.method.global_model_spec(final["method_state"]))
    assert summary["final_accuracy"] == scored["accuracy"] and summary["final_loss"] == scored["loss"]
    assert summary["client_rounds"] + summary["skipped_client_rounds"] == 8
    assert summary["client_rounds"] > 0
    if method not in TRAINS_THE_FULL_MODEL_REGARDLESS:
        assert summary["budget_violations"] == 0


@pytest.mark.parametrize("method", sorted(set(METHODS.names()) - TRANSFORMER_ONLY))
def test_on_preresnet20_every_method_trains_each_round_and_keeps_clients_within_budget(method):
    """The contract where the `fair` budgets bind, read from the golden run `method__<name>`
    (PreResNet-20 on digits, 2 rounds of 4 of 8 clients), which tests/golden/test_golden.py
    reproduces exactly: clients train and the model is scored in every round, each sampled client
    trains or is skipped, and no client-round exceeds its memory budget (methods that train the full
    model regardless excepted)."""
    from hfl.server import over_budget
    from tests.golden.runs import facts

    records = facts(f"method__{method}")  # scored or not, trained or skipped, peaks and budgets: facts
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["clients"] and r["accuracy"] is not None and not r["failed_clients"] for r in records)
    clients = [c for r in records for c in r["clients"]]
    assert len(clients) + sum(len(r.get("skipped_clients", [])) for r in records) == 8
    if method not in TRAINS_THE_FULL_MODEL_REGARDLESS:
        assert not [c["id"] for c in clients if over_budget(c)["memory"]]


def fair_config(method, rounds=2, model="preresnet20", tmp_path=None):
    """4 clients, all in every round, under the fair budgets: on digits with `model`, or for a
    transformer-only method on the Shakespeare fixture (written under `tmp_path`)."""
    sections = {"method": {"name": method, **SHORTER.get(method, {}), **ADJUSTING.get(method, {})}, "budgets": BUDGETS.get(method, {"scenario": "fair"}),
                "fl": {"rounds": rounds, "clients": 4, "fraction": 1.0}}
    if method in TRANSFORMER_ONLY:
        return text_config(tmp_path, **sections)
    data = {"server_fraction": 0.1} if method in NEEDS_A_SERVER_SPLIT else {}
    return small_config(model={"name": model}, data=data, **sections)


@pytest.mark.parametrize("method", sorted(TRANSFORMER_ONLY))
@pytest.mark.parametrize("model", ["cnn", "preresnet20"])
def test_transformer_only_methods_refuse_models_without_transformer_blocks(method, model):
    with pytest.raises(ConfigError, match=r"model\.name=.* expected a transformer: gpt\*, vit\*"):
        method_for({"name": method}, model)


RESUME = """
import sys
from pathlib import Path
from hfl.config import load_config
from hfl.server import run_experiment
for run in sys.argv[1:]:
    run_experiment(load_config(Path(run) / "config.yaml", ["fl.rounds=2"]), run, resume=True)
"""


@pytest.mark.slow
def test_every_method_resumes_exactly_in_a_fresh_process(tmp_path):
    """2 rounds straight = 1 round, checkpoint, a fresh process, 1 more round: every metric equal."""
    import subprocess
    import sys

    from hfl.loggers import read_metrics
    from tests.conftest import ROOT, cli_env
    from tests.golden.runs import without_timings

    shipped = [name for name in METHODS.names() if METHODS.info(name)]  # not the README's example, when registered
    for method in shipped:
        run_experiment(fair_config(method, rounds=2, model="cnn", tmp_path=tmp_path), tmp_path / "straight" / method)
        run_experiment(fair_config(method, rounds=1, model="cnn", tmp_path=tmp_path), tmp_path / "resumed" / method)
    resumed = [str(tmp_path / "resumed" / m) for m in shipped]
    subprocess.run([sys.executable, "-c", RESUME, *resumed], env=cli_env(), cwd=ROOT, check=True)
    for method in shipped:
        straight = without_timings(read_metrics(tmp_path / "straight" / method))
        assert without_timings(read_metrics(tmp_path / "resumed" / method)) == straight, method


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "mfedepth" else m  # ~5 s: its peer models
                                    for m in METHODS.names()])
def test_specs_load_strictly_and_equal_shapes_hold_equal_keys(tmp_path, method):
    """What every spec a method evaluates or hands a client receives (`client_state`) loads strictly
    into the model built for it, and specs of one shape (rolled windows, other bases, other rounds)
    hold exactly the same keys."""
    from dataclasses import replace

    from hfl.backends.base import ClientEnvironment
    from hfl.server import initial_state, train_settings
    from hfl.types import RoundContext

    config = fair_config(method, tmp_path=tmp_path)
    env = ClientEnvironment.from_config(config)
    global_state = initial_state(config, env).global_state
    m = env.method
    everything = replace(m.init_state(), trained_levels=frozenset(lv.name for lv in m.ladder.levels) if m.ladder else frozenset())
    specs = [m.global_model_spec(m.init_state()), m.global_model_spec(everything), *m.submodels(everything).values()]
    for r in (1, 2, 3):
        for c in range(4):
            task = m.plan(RoundContext(r, c, config.seed, len(env.partitions[c]), train_settings(config.fl, r), env.budgets[c]), m.init_state())
            if task is not None:
                specs.append(task.spec)
    keys_by_shape: dict[tuple, set[str]] = {}
    for spec in specs:
        held = m.client_state(global_state, spec)
        m.client_model(spec).load_state_dict(held, strict=True)
        assert keys_by_shape.setdefault(spec.shape, set(held)) == set(held), spec.shape


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_runs_a_round_on_cuda(tmp_path, method):
    """The CPU contract on a GPU: every method's state, masks and aggregation meet the weights on
    the device (the sparse methods' CPU masks against CUDA weights once stopped every such run), and
    every client-round's peak is measured there."""
    import dataclasses

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = fair_config(method, rounds=1, model="cnn", tmp_path=tmp_path)
    config = dataclasses.replace(config, backend=dataclasses.replace(config.backend, device="cuda"))
    summary = run_experiment(config, tmp_path / "run")
    assert summary["client_rounds"] > 0 and summary["failed_client_rounds"] == 0
    assert summary["max_measured_peak_bytes"] > 0
