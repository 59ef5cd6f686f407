"""`hfl report` compares finished runs in a Markdown table and two PNG plots."""

import pytest

from hfl.cli import main
from hfl.errors import ConfigError
from hfl.report import write_report
from hfl.server import run_experiment
from tests.conftest import small_config

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_compares_runs(tmp_path, capsys):
    run_experiment(small_config(budgets={"scenario": "fair"}, fl={"rounds": 2}), tmp_path / "avg")
    run_experiment(small_config(method={"name": "fedprox", "mu": 0.1}, model={"width": 0.5}, fl={"rounds": 2}), tmp_path / "prox")
    assert main(["report", str(tmp_path / "avg"), str(tmp_path / "prox"), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| avg", "| prox"))]
    assert len(rows) == 2
    assert "| fedavg | digits | dirichlet α=0.5 | fair |" in rows[0] and "| fedprox |" in rows[1]
    for name in ("accuracy_by_round.png", "accuracy_by_memory.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:8] == PNG
    assert "fedprox" in capsys.readouterr().out


def test_report_refuses_a_folder_that_is_not_a_finished_run(tmp_path):
    with pytest.raises(ConfigError, match="finished hfl run"):
        write_report([str(tmp_path)], tmp_path / "rep")
