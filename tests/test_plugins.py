"""A user's own method, model and dataset, in a package outside hfl, named by the config's `plugins`,
run through the `hfl` command on the local and the Ray backend (the plug-in module of docs/extending.md, as written)."""

import json
import subprocess
import sys

import pytest

from hfl.cli import main
from hfl.config import config_from_dict
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.registry import DATASETS, METHODS, MODELS, Registry, defined_at, import_plugins
from tests.conftest import ROOT, cli_env
from tests.markdown import code_blocks

SECTION = "## Your own methods, models and datasets (plug-ins)"
ONE_CONV_PARAMETERS = 1 * 16 * 9 + 16 + 16 * 4 + 4
"""docs/extending.md's one_conv on stripes: a 3x3 convolution from 1 to 16 channels and a 16 -> 4 classifier."""


def readme_blocks() -> tuple[str, str]:
    """The extending guide's plug-in module and its experiment YAML."""
    guide = ROOT / "docs" / "extending.md"
    (module,), (experiment,) = code_blocks(guide, SECTION, "python"), code_blocks(guide, SECTION, "yaml")
    return module, experiment


@pytest.fixture
def project(tmp_path):
    """A user's project folder, outside hfl: my_project/fl.py holds the guide's plug-in module,
    my_experiment.yaml its experiment (made small)."""
    module, experiment = readme_blocks()
    package = tmp_path / "project" / "my_project"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "fl.py").write_text(module)
    experiment += "fl: {rounds: 2, clients: 4, fraction: 1.0, batch_size: 16}\nbackend: {device: cpu}\n"
    (package.parent / "my_experiment.yaml").write_text(experiment)
    return package.parent


@pytest.fixture
def importable_project(project, monkeypatch):
    """`project` importable in this process; what its plug-in registers is forgotten afterwards."""
    monkeypatch.syspath_prepend(str(project))
    yield project
    for registry in (METHODS, MODELS, DATASETS):
        for name in [n for n, obj in registry._entries.items() if str(defined_at(obj)[0]).startswith("my_project")]:
            del registry._entries[name]
    for module in [m for m in sys.modules if m.split(".")[0] == "my_project"]:
        del sys.modules[module]


def hfl_run(project, out, *overrides, timeout=300):
    """`hfl run my_experiment.yaml` in a fresh process whose PYTHONPATH holds the project."""
    env = cli_env()
    env.update(PYTHONPATH=f"{project}:{env['PYTHONPATH']}", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    command = [sys.executable, "-m", "hfl.cli", "run", str(project / "my_experiment.yaml"), *overrides, "--out", str(out)]
    return subprocess.run(command, env=env, cwd=project, capture_output=True, text=True, timeout=timeout, check=False)


def per_round(out):
    return [(r["round"], r["accuracy"], r["loss"], [(c["id"], c["train_loss"]) for c in r["clients"]]) for r in read_metrics(out)]


@pytest.mark.slow
def test_a_plugin_method_model_and_dataset_run_through_the_cli(project, tmp_path):
    frozen, learning = tmp_path / "frozen", tmp_path / "learning"
    assert hfl_run(project, frozen, "method.server_lr=0").returncode == 0
    result = hfl_run(project, learning)
    assert result.returncode == 0, result.stderr
    for out in (frozen, learning):
        for record in read_metrics(out):
            clients = record["clients"]
            assert sum(c["num_samples"] for c in clients) == 160  # stripes: 160 training images over the clients
            assert {c["bytes_down"] for c in clients} == {4 * ONE_CONV_PARAMETERS}  # one_conv's float32 weights
    # server_step's own aggregation: with server_lr=0 the global model never moves, with 0.5 it learns.
    frozen_losses = [r["loss"] for r in read_metrics(frozen)]
    assert frozen_losses[0] == frozen_losses[1]
    assert [r["loss"] for r in read_metrics(learning)][1] < frozen_losses[1]
    assert "plugins:\n- my_project.fl" in (learning / "config.yaml").read_text()


@pytest.mark.slow
def test_ray_workers_import_the_plugins(project, tmp_path):
    """FedAvg, a built-in method, on the plug-in's model and dataset: its workers learn of stripes and
    one_conv only from `plugins` (a plug-in method's class would bring its module along when pickled)."""
    local = hfl_run(project, tmp_path / "local", "method={name: fedavg}")
    remote = hfl_run(project, tmp_path / "ray", "method={name: fedavg}", "backend.name=ray", "backend.actors_per_pool=1")  # one imports as well as two
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr[-3000:]
    assert per_round(tmp_path / "ray") == per_round(tmp_path / "local")
    clients = [c for r in read_metrics(tmp_path / "ray") for c in r["clients"]]
    assert len(clients) == 8 and all(c["ray_node"] for c in clients)  # every client trained in a Ray actor
    assert json.loads((tmp_path / "ray" / "summary.json").read_text())["failed_client_rounds"] == 0


def test_an_unknown_plugin_module_is_a_config_error_naming_the_field_and_module(project, tmp_path, capsys):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"plugins": ["my_project.nowhere"]})
    assert (info.value.field, info.value.value) == ("plugins", "my_project.nowhere")
    assert "no module named 'my_project'" in info.value.allowed
    assert main(["run", str(project / "my_experiment.yaml"), "plugins=[no_such_package.methods]", "--out", str(tmp_path / "x")]) == 2
    assert "plugins='no_such_package.methods' is not allowed" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("value", ["my project", ".relative", "", 3])
def test_a_plugin_that_is_no_module_name_is_refused(value):
    with pytest.raises(ConfigError) as info:
        import_plugins([value])
    assert (info.value.field, info.value.value) == ("plugins", value)


def test_a_plugin_that_imports_a_missing_module_shows_its_own_error(tmp_path, monkeypatch):
    """The plug-in was found; what it imports is not: the traceback, not a config error, says what."""
    (tmp_path / "broken_plugin.py").write_text("import a_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        import_plugins(["broken_plugin"])
    assert info.value.name == "a_dependency_nobody_installed"


def test_plugins_are_imported_before_the_names_they_register_are_checked(importable_project):
    config = config_from_dict({"plugins": ["my_project.fl"], "data": {"name": "stripes", "partition": "iid"},
                               "model": {"name": "one_conv"}, "method": {"name": "server_step", "server_lr": 0.25}})
    assert (config.data.name, config.model.name, config.method.server_lr) == ("stripes", "one_conv", 0.25)
    assert type(config.method).__module__ == "my_project.fl" and "server_step" in METHODS.names()


def test_running_a_definition_again_replaces_it_but_another_one_is_refused():
    registry = Registry("thing")

    def define():  # the same source run twice, as a re-run notebook cell does
        @registry.register("mine")
        class Mine:
            pass

        return Mine

    first, second = define(), define()
    assert first is not second and registry.get("mine") is second

    with pytest.raises(ValueError, match="registered twice"):

        @registry.register("mine")
        class Other:
            pass

    assert registry.get("mine") is second
