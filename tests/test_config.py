"""Config loading, overrides and the errors a user sees."""

import pytest
import torch

from hfl.cli import main as hfl_cli
from hfl.config import FLConfig, load_config
from hfl.errors import ConfigError
from tests.conftest import QUICKSTART, small_config


def test_quickstart_loads_with_typed_overrides():
    config = load_config(QUICKSTART, ["fl.rounds=3", "data.alpha=0.3", "method.name=fedprox", "method.mu=0.1"])
    assert config.fl.rounds == 3 and isinstance(config.fl.rounds, int)
    assert config.data.alpha == 0.3
    assert config.method.name == "fedprox" and config.method.mu == 0.1
    assert config.name == "quickstart"


@pytest.mark.parametrize(
    "override, field, allowed",
    [
        ("fl.roundz=3", "fl.roundz", "rounds"),
        ("data.alpha=-1", "data.alpha", "> 0"),
        ("fl.rounds=abc", "fl.rounds", "an integer"),
        ("fl.fraction=1.5", "fl.fraction", "(0, 1]"),
        ("method.name=nosuch", "method.name", "fedavg"),
        ("method.mu=0.1", "method.mu", "name"),  # fedavg has no mu
        ("model.name=vgg", "model.name", "preresnet20"),
        ("data.partition=weird", "data.partition", "dirichlet"),
        ("fl.lr_schedule=linear", "fl.lr_schedule", "cosine"),
        ("backend.name=spark", "backend.name", "local"),
        ("nosection.x=1", "nosection", "fl"),
        ("fl.rounds", "override", "key=value"),
    ],
)
def test_bad_values_name_field_value_and_allowed(override, field, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [override])
    assert info.value.field == field
    assert allowed in info.value.allowed


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="existing YAML"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_bad_config_in_one_line_with_exit_code_2(capsys):
    """In this process: `python -m hfl.cli` is `sys.exit(main())`, whose exit code and stderr a fresh
    process adds nothing to (the node-loss tests check a refused run's code and lines from outside)."""
    assert hfl_cli(["run", str(QUICKSTART), "data.alpha=-1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == ["hfl: error: data.alpha=-1.0 is not allowed: expected a number > 0"]


def test_learning_rate_schedules():
    step = FLConfig(rounds=8, lr=1.0, lr_schedule="step", lr_decay=0.1)
    assert [round(step.lr_at(r), 6) for r in range(1, 9)] == [1, 1, 1, 1, 0.1, 0.1, 0.01, 0.01]
    cosine = FLConfig(rounds=4, lr=1.0, lr_schedule="cosine")
    assert cosine.lr_at(1) == 1.0 and cosine.lr_at(3) == pytest.approx(0.5)
    assert FLConfig(lr=0.3).lr_at(7) == 0.3
    exponential = FLConfig(rounds=500, lr=1.0, lr_schedule="exponential", lr_decay=0.95)  # FedMef's schedule
    assert [exponential.lr_at(r) for r in (1, 2, 3)] == [1.0, 0.95, 0.95**2]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["fl.clients=2000"], "fl.clients"),  # digits has 1437 training samples
        (["data.server_fraction=0.99"], "fl.clients"),  # 14 samples left for 20 clients
        (["data.partition=pathological", "data.labels_per_client=20"], "data.partition"),  # 10 classes
        (["data.partition=pathological", "data.labels_per_client=10", "fl.clients=200"], "data.partition"),
        (["data.server_fraction=0.0001", "method.name=feddf"], "data.server_fraction"),  # no sample for the server
        (["data.test_fraction=0.999"], "data.test_fraction"),  # a class missing from the training set
        (["data.test_fraction=0.001"], "data.test_fraction"),
        (["seed=-1"], "seed"),
        (["fl.eval_mode=blockwise", "fl.eval_spill_dir=QUICKSTART/spill"], "fl.eval_spill_dir"),
        (["method.name=splitmix", "method.base_width=0.001"], "method.base_width"),
        (["budgets.scenario=tiers", "budgets.memory=[1MB,2MB]", "budgets.shares=[0.5,0.6]"], "budgets.shares"),
        (["method.weighting=mean"], "method.weighting"),
        (["method.name=fedrolex", "method.roll=sideways"], "method.roll"),
    ],
)
def test_values_the_data_or_machine_refuse_exit_2_with_one_line(tmp_path, capsys, overrides, field):
    from hfl.cli import main

    overrides = [o.replace("QUICKSTART", str(QUICKSTART)) for o in overrides]  # a file, where a folder is needed
    assert main(["run", str(QUICKSTART), "fl.rounds=1", *overrides, "--out", str(tmp_path / "run")]) == 2
    *before, error = capsys.readouterr().err.strip().splitlines()
    assert len(before) <= 1 and all(" round -> " in line for line in before), before  # at most the run's header line
    assert error.startswith(f"hfl: error: {field}=") and "is not allowed: expected" in error


def test_an_empty_config_file_is_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="the file is empty") as info:
        load_config(empty)
    assert "data, model, method, fl" in info.value.allowed


def test_a_yaml_syntax_error_is_one_line_saying_where(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nfl:\n  clients: [3\n")
    with pytest.raises(ConfigError) as info:
        load_config(broken)
    assert "\n" not in str(info.value) and "expected ',' or ']'" in str(info.value) and "at line 4, column 1" in str(info.value)


def test_run_needs_a_config_or_resume_and_a_writable_out(tmp_path, capsys):
    from hfl.cli import main

    assert main(["run"]) == 2
    assert "--resume DIR" in capsys.readouterr().err
    assert main(["run", str(QUICKSTART), "--out", str(QUICKSTART / "run")]) == 2
    assert "hfl: error: --out=" in capsys.readouterr().err


def test_exponent_notation_without_a_dot_is_a_number():
    """PyYAML reads `5e-4` as a string (YAML 1.1); users mean a number."""
    assert load_config(QUICKSTART, ["fl.lr=5e-4"]).fl.lr == 5e-4
    assert load_config(QUICKSTART, ["fl.lr=1E2"]).fl.lr == 100.0
    with pytest.raises(ConfigError, match="fl.lr"):
        load_config(QUICKSTART, ["fl.lr=fast"])


@pytest.mark.parametrize(("choice", "budgets", "enabled", "deterministic"), [
    ("auto", {}, True, True), ("auto", {"scenario": "fair"}, True, True), ("on", {"scenario": "fair"}, True, False),
    ("off", {"scenario": "fair"}, False, False)])
def test_cudnn_runs_unless_off_with_deterministic_heuristic_plans_under_auto(choice, budgets, enabled, deterministic):
    """Budgeted clients keep cuDNN (its workspace lives under the cap of their budget); auto picks
    deterministic plans by heuristics, with no timing search whose trial workspaces would count."""
    from hfl.experiment import configure_cudnn

    try:
        configure_cudnn(small_config(backend={"device": "cpu", "cudnn": choice}, budgets=budgets))
        cudnn = torch.backends.cudnn
        assert (cudnn.enabled, cudnn.deterministic, cudnn.benchmark) == (enabled, deterministic, False)
    finally:
        configure_cudnn(small_config())


def test_a_negative_cuda_headroom_names_the_field():
    with pytest.raises(ConfigError, match=r"backend\.cuda_headroom_mib.*-1"):
        small_config(backend={"cuda_headroom_mib": -1})


def test_an_unknown_cudnn_choice_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r"backend\.cudnn.*'sometimes'.*auto, on, off"):
        small_config(backend={"cudnn": "sometimes"})
