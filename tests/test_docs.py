"""The docs hold: every relative link of README.md and docs/ resolves, every docs page is reachable
from the README, and the extending guide's worked examples (a model, a dataset, a backend) run as
written, on digits. The method and plug-in examples are run by tests/methods/test_adding_a_method.py
and tests/test_plugins.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hfl.data import load_dataset
from hfl.errors import DataNotFoundError
from hfl.loggers import read_metrics
from hfl.registry import BACKENDS, DATASETS, METHODS, MODELS
from hfl.server import run_experiment
from tests.conftest import ROOT, small_config
from tests.markdown import anchors, code_blocks, links

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
EXTENDING = ROOT / "docs" / "extending.md"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{fragment} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_readme_is_short_and_links_every_docs_page():
    assert len(README.read_text().splitlines()) <= 200
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    assert [page.name for page in DOCS if page.resolve() not in linked] == []


def test_ci_runs_the_readme_test_command():
    """The README's second command is what `.ci/run` runs, up to quieter output and a --durations report."""

    def words(command: str) -> list[str]:
        return [w for w in command.split() if w != "-q" and not w.startswith("--durations")]

    readme_command = code_blocks(README, "# hfl", "bash")[0].splitlines()[1].split("  #", 1)[0]
    (ci_command,) = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert words(ci_command) == words(readme_command)


@pytest.fixture
def example(request):
    """The extending guide's Python block under the heading given as this fixture's parameter, run as
    its module would be: what it registers is registered for the test, and forgotten afterwards."""
    registries = (METHODS, MODELS, DATASETS, BACKENDS)
    before = [set(registry._entries) for registry in registries]
    (code,) = code_blocks(EXTENDING, request.param, "python")
    namespace: dict = {}
    exec(compile(code, str(EXTENDING), "exec"), namespace)  # noqa: S102 - registers the example, as its module would
    added = [(registry, set(registry._entries) - names) for registry, names in zip(registries, before)]
    yield namespace
    for registry, names in added:
        for name in names:
            del registry._entries[name]


@pytest.mark.parametrize("example", ["## A model"], indirect=True)
def test_the_model_example_declares_its_widths_and_blocks(example):
    half = MODELS.get("plain_cnn")(1, 10, width=0.5, norm="bn")
    assert {m.out_channels for m in half.modules() if isinstance(m, nn.Conv2d)} == {16}  # ⌈0.5 · 32⌉ in every layer
    assert [b.droppable for b in half.blocks()] == [True, True, True]
    half.drop_blocks({1, 2})
    assert half(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["## A model"], indirect=True)
def test_the_model_example_trains_under_width_and_depth_methods(example, tmp_path):
    fl = {"rounds": 2, "clients": 8, "fraction": 1.0}
    widths = run_experiment(small_config(model={"name": "plain_cnn"}, method={"name": "heterofl"},
                                         budgets={"scenario": "fair"}, fl=fl), tmp_path / "heterofl")
    assert widths["budget_violations"] == 0
    assert set(widths["submodel_accuracy"]) == {"x0.0625", "x0.125", "x0.25", "x0.5", "x1"}
    depths = run_experiment(small_config(model={"name": "plain_cnn"}, method={"name": "scalefl"}, fl=fl), tmp_path / "scalefl")
    assert depths["budget_violations"] == 0 and len(depths["submodel_accuracy"]) == 4  # ScaleFL's four levels, all scored


@pytest.mark.parametrize("example", ["## A dataset"], indirect=True)
def test_the_dataset_example_reads_its_npz_file(example, tmp_path):
    digits = load_dataset("digits", str(tmp_path), str(tmp_path / "cache"))
    folder = tmp_path / "data" / "npz_images"
    folder.mkdir(parents=True)
    np.savez(folder / "images.npz", train_x=digits.train_x[:, 0].numpy(), train_y=digits.train_y.numpy(),
             test_x=digits.test_x[:, 0].numpy(), test_y=digits.test_y.numpy())  # N x H x W: the example adds the channel
    mine = load_dataset("npz_images", str(tmp_path / "data"), str(tmp_path / "cache"))
    assert torch.equal(mine.train_x, digits.train_x) and torch.equal(mine.test_y, digits.test_y) and mine.num_classes == 10
    assert mine.mean == pytest.approx(digits.mean, abs=1e-6) and mine.std == pytest.approx(digits.std, rel=1e-3)

    config = small_config(data={"name": "npz_images", "root": str(tmp_path / "data")}, fl={"rounds": 2, "clients": 4, "fraction": 1.0})
    run_experiment(config, tmp_path / "run")
    for record in read_metrics(tmp_path / "run"):
        # dirichlet gives every client as many samples: 4 x 359 of the 1,437 training images
        assert sum(c["num_samples"] for c in record["clients"]) == len(digits.train_y) // 4 * 4
    with pytest.raises(DataNotFoundError, match=str(tmp_path / "nowhere" / "npz_images" / "images.npz")):
        load_dataset("npz_images", str(tmp_path / "nowhere"), str(tmp_path / "cache"))


@pytest.mark.parametrize("example", ["## A backend"], indirect=True)
def test_the_backend_example_equals_local_without_a_deadline_and_drops_late_clients(example, tmp_path):
    def run(name, deadline):
        config = small_config(backend={"name": name, "client_timeout_s": deadline}, fl={"rounds": 2, "clients": 4, "fraction": 1.0})
        run_experiment(config, tmp_path / f"{name}-{deadline}")
        return read_metrics(tmp_path / f"{name}-{deadline}")

    def numbers(records):
        return [(r["accuracy"], r["loss"], [(c["id"], c["train_loss"]) for c in r["clients"]]) for r in records]

    assert numbers(run("deadline", 0)) == numbers(run("local", 0))
    late = run("deadline", 1e-9)  # no client trains in a nanosecond
    assert [[c["id"] for c in r["failed_clients"]] for r in late] == [[0, 1, 2, 3]] * 2
    assert all(c["reason"].startswith("missed the deadline") for r in late for c in r["failed_clients"])
    assert all(r["clients"] == [] for r in late)
