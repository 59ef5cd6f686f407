"""The Python API: `hfl.make_config`, `hfl.run` and `hfl.load_run`, as docs/python_api.md shows them."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import hfl
from hfl.backends.base import ClientEnvironment
from hfl.config import ExperimentConfig
from hfl.errors import ConfigError
from tests.conftest import QUICKSTART, ROOT, cli_env
from tests.markdown import code_blocks

SMALL = {"name": "api", "data": {"name": "digits"}, "model": {"name": "cnn"},
         "fl": {"rounds": 2, "clients": 4, "fraction": 1.0}, "backend": {"device": "cpu"}}


def fresh_python(code, cwd):
    return subprocess.run([sys.executable, "-c", code], env=cli_env(), cwd=cwd, capture_output=True, text=True, timeout=300, check=True)


def test_importing_hfl_imports_nothing_else(tmp_path):
    probe = "import sys, hfl; print(sorted(m for m in sys.modules if m.split('.')[0] in ('hfl', 'torch', 'yaml')))"
    assert fresh_python(probe, tmp_path).stdout.strip() == "['hfl']"


def test_the_api_names_are_the_api_modules_and_others_are_missing():
    from hfl import api

    assert (hfl.run, hfl.load_run, hfl.make_config, hfl.Run) == (api.run, api.load_run, api.make_config, api.Run)
    assert {"run", "load_run", "make_config", "Run"} <= set(dir(hfl))
    with pytest.raises(AttributeError, match="no attribute 'rn'"):
        hfl.rn  # noqa: B018


def test_overrides_are_keywords_with_double_underscores_or_dotted_keys_applied_in_that_order():
    config = hfl.make_config(QUICKSTART, {"fl.rounds": 3, "data.alpha": 0.3}, fl__rounds=2, method__name="fedprox", method__mu=0.01)
    assert isinstance(config, ExperimentConfig) and config.name == "quickstart"
    assert (config.fl.rounds, config.data.alpha, config.method.name, config.method.mu) == (2, 0.3, "fedprox", 0.01)
    assert config.fl.clients == 20  # the file's value, untouched
    assert hfl.make_config(SMALL, {"fl.lr": 0.2}).fl.lr == 0.2
    assert hfl.make_config(config, seed=3).seed == 3 and hfl.make_config(config, seed=3).data.alpha == 0.3
    assert hfl.make_config(fl__rounds=5).fl.rounds == 5  # nothing given: the defaults


def test_bad_overrides_are_config_errors_naming_the_field():
    with pytest.raises(ConfigError) as info:
        hfl.make_config(SMALL, fl__roundz=2)
    assert info.value.field == "fl.roundz"
    with pytest.raises(ConfigError) as info:
        hfl.make_config(SMALL, {"fl.rounds": "two"})
    assert (info.value.field, info.value.value) == ("fl.rounds", "two")
    with pytest.raises(ConfigError) as info:
        hfl.make_config(SMALL, name__x=1)
    assert info.value.field == "name.x" and "name is a value" in info.value.allowed


@pytest.mark.parametrize("method, model", [({"name": "fedavg"}, {"name": "cnn"}),
                                           pytest.param({"name": "heterofl"}, {"name": "preresnet20", "width": 0.25}, marks=pytest.mark.slow)])
def test_a_run_from_python_loads_back_with_its_numbers_and_a_model_that_scores_them(method, model, tmp_path, capsys):
    """HeteroFL's static batch norm is scored with statistics recomputed from the training data: the
    loaded model is that model, so its test accuracy is the run's to the last image."""
    run = hfl.run({**SMALL, "method": method, "model": model}, out=tmp_path / "run", progress=True)
    assert [line.split()[:2] for line in capsys.readouterr().err.splitlines()[-2:]] == [["round", "1/2"], ["round", "2/2"]]
    loaded = hfl.load_run(tmp_path / "run")
    assert loaded.config == run.config and loaded.summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert loaded.summary["final_accuracy"] == run.summary["final_accuracy"]
    assert list(loaded.metrics["round"]) == [1, 2]
    assert list(loaded.metrics["accuracy"]) == [r["accuracy"] for r in loaded.records]
    assert len(loaded.clients) == 8 and list(loaded.clients["train_loss"]) == [c["train_loss"] for r in loaded.records for c in r["clients"]]
    model = loaded.model()
    assert not model.training
    env = ClientEnvironment.from_config(loaded.config, torch.device("cpu"))
    with torch.no_grad():
        accuracy = (model(env.test_x).argmax(1) == env.test_y).double().mean().item()
    assert accuracy == run.summary["final_accuracy"]


def test_metrics_are_lists_of_dicts_without_pandas(tmp_path, monkeypatch):
    hfl.run(SMALL, out=tmp_path, fl__rounds=1)
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    run = hfl.load_run(tmp_path)
    assert [row["round"] for row in run.metrics] == [1] and run.metrics[0]["accuracy"] == run.summary["final_accuracy"]
    assert [row["id"] for row in run.clients] == [0, 1, 2, 3]


def test_an_unfinished_run_has_no_summary_and_a_folder_without_a_run_is_refused(tmp_path):
    hfl.run(SMALL, out=tmp_path / "run", fl__rounds=1)
    (tmp_path / "run" / "summary.json").unlink()
    (tmp_path / "run" / "checkpoint.pt").unlink()
    unfinished = hfl.load_run(tmp_path / "run")
    assert unfinished.summary is None and len(unfinished.records) == 1
    with pytest.raises(ConfigError, match="checkpoint.pt"):
        unfinished.model()
    with pytest.raises(ConfigError) as info:
        hfl.load_run(tmp_path / "nothing")
    assert info.value.field == "folder" and "config.yaml" in info.value.allowed


@pytest.mark.slow
def test_the_readme_example_runs_in_a_fresh_python(tmp_path):
    """... and its run (training, accounting, evaluation) never imports torch._dynamo, 1.5 CPU-seconds a
    process (`hfl.optim`): torch.optim's optimisers or an unmarked dispatch mode would."""
    code = code_blocks(ROOT / "docs" / "python_api.md", "# Python API", "python")[0]
    (tmp_path / "experiments").mkdir()
    shutil.copy(QUICKSTART, tmp_path / "experiments")
    result = fresh_python(code + "\nimport sys\nprint('torch._dynamo' in sys.modules, file=sys.stderr)\n", tmp_path)
    assert result.stderr.splitlines()[-1] == "False"
    out = tmp_path / "runs" / "notebook"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and "alpha: 0.3" in (out / "config.yaml").read_text()
    printed = result.stdout.splitlines()
    assert float(printed[0]) == summary["final_accuracy"]
    assert printed[1].split() == ["round", "accuracy", "loss"] and printed[3].split()[:3] == ["1", "2", f"{summary['final_accuracy']:.6f}"]
    assert "round 2/2" in result.stderr


@pytest.mark.slow
def test_the_evaluation_example_gives_each_models_recorded_accuracy_in_a_fresh_python(tmp_path):
    """docs/python_api.md's block, in a fresh process: `evaluate()` is `final_accuracy`, each sub-model's
    `evaluate(submodel=)` its recorded accuracy, and `model(submodel=)` on `test_data()` the same. The
    two widths score differently here, so a sub-model evaluated as the global model would show."""
    code = code_blocks(ROOT / "docs" / "python_api.md", "## Evaluating a run's models", "python")[0]
    (tmp_path / "experiments").mkdir()
    shutil.copy(QUICKSTART, tmp_path / "experiments")
    printed = [line.split() for line in fresh_python(code, tmp_path).stdout.splitlines()]
    summary = json.loads((tmp_path / "runs" / "widths" / "summary.json").read_text())
    assert printed[0] == [repr(summary["final_accuracy"])] * 2
    assert [line[0] for line in printed[1:3]] == ["x0.5", "x1"] and all(line[1] == line[2] for line in printed[1:3])
    assert printed[3] == [repr(summary["submodel_accuracy"]["x0.5"])] * 2
    assert summary["submodel_accuracy"]["x0.5"] != summary["submodel_accuracy"]["x1"]


def test_exits_and_wrong_names_evaluate_or_name_what_the_run_has(tmp_path):
    """DepthFL's exits: `evaluate(exit=)` is the recorded exit accuracy and `model(exit=)` gives that
    exit's logits; an unknown sub-model, exit or data split is an error naming what the run has."""
    run = hfl.run({**SMALL, "method": {"name": "depthfl"}}, out=tmp_path / "run")
    last = run.records[-1]
    x, y = run.test_data()
    for name, recorded in last["exit_accuracy"].items():
        assert run.evaluate(exit=name)["accuracy"] == recorded
        with torch.no_grad():
            assert (run.model(exit=name)(x).argmax(1) == y).double().mean().item() == recorded
    assert run.evaluate()["accuracy"] == run.summary["final_accuracy"] == last["exit_accuracy"]["head"]
    assert len(set(last["exit_accuracy"].values())) > 1  # an exit scored as the head would show
    with pytest.raises(ConfigError) as info:
        run.evaluate(submodel="x0.5")
    assert info.value.field == "submodel" and all(name in info.value.allowed for name in run.submodels)
    with pytest.raises(ConfigError, match="exit0, head"):
        run.model(exit="exit9")
    with pytest.raises(ConfigError, match="'test'"):
        run.evaluate(data="train")
    plain = hfl.run(SMALL, out=tmp_path / "plain", fl__rounds=1)
    with pytest.raises(ConfigError, match="none"):
        plain.evaluate(exit="head")
