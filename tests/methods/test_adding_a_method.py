"""The extending guide's worked example of a new method runs as written: it plugs into the ladder, keeps
budgets, scores every width and uses its own loss."""

import pytest
import torch
import torch.nn.functional as F

from hfl.registry import METHODS
from hfl.server import run_experiment
from tests.conftest import ROOT, small_config
from tests.markdown import code_blocks


GUIDE = ROOT / "docs" / "extending.md"


def readme_example() -> str:
    (code,) = code_blocks(GUIDE, "## A method", "python")
    return code


@pytest.fixture(scope="module")
def registered():
    code = readme_example()
    assert len(code.strip().splitlines()) < 40
    namespace: dict = {}
    if "smooth_widths" not in METHODS.names():
        exec(compile(code, str(GUIDE), "exec"), namespace)  # noqa: S102 - registers the method, as its module would
    return METHODS.get("smooth_widths")


@pytest.mark.slow  # an end-to-end run of 3-5 s: CI runs it, the fast lane does not
def test_the_readme_method_runs_within_budgets_and_scores_every_width(registered, tmp_path):
    config = small_config(method={"name": "smooth_widths", "smoothing": 0.2}, model={"name": "preresnet20"},
                          budgets={"scenario": "fair"}, fl={"rounds": 2, "clients": 8, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert summary["budget_violations"] == 0 and summary["client_rounds"] > 0
    assert set(summary["submodel_accuracy"]) == {"x0.25", "x0.5", "x1"}


def test_the_readme_method_uses_its_own_loss(registered):
    from tests.conftest import method_for

    method = method_for({"name": "smooth_widths", "smoothing": 0.3})
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])

    class Client:
        model = method.build(1.0)

    expected = F.cross_entropy(Client.model(x), y, label_smoothing=0.3)
    torch.testing.assert_close(method.objective(Client, x, y)["loss"], expected)
