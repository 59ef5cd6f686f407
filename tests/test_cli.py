"""The `hfl` command as a user runs it."""

import json

import pytest

from hfl.cli import main
from tests.conftest import QUICKSTART, ROOT, cli_env


def test_methods_lists_registered_methods_with_papers(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "fedprox" in out and "MLSys 2020" in out


def test_data_prints_histogram_and_writes_heatmap(tmp_path, capsys):
    png = tmp_path / "labels.png"
    assert main(["data", str(QUICKSTART), "fl.clients=5", "data.partition=pathological", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 5
    assert all(sum(int(v) > 0 for v in row[1:-1]) == 2 for row in rows)  # Λ = 2 labels per client
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_reports_missing_dataset_path(tmp_path, capsys):
    code = main(["run", str(QUICKSTART), "data.name=mnist", f"data.root={tmp_path}", f"data.cache_dir={tmp_path}/c", "--out", str(tmp_path / "o")])
    assert code == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_resume_needs_a_checkpoint(tmp_path, capsys):
    assert main(["run", str(QUICKSTART), "--resume", str(tmp_path)]) == 2
    assert "checkpoint" in capsys.readouterr().err


def test_wandb_logs_offline_into_the_run_folder(tmp_path):
    out = tmp_path / "run"
    assert main(["run", str(QUICKSTART), "fl.rounds=1", "fl.clients=4", "logging.wandb=true", "--out", str(out)]) == 0
    assert list((out / "wandb").glob("offline-run-*")), "an offline wandb run is written beside the metrics"


@pytest.mark.slow
def test_quickstart_reaches_what_the_readme_states(tmp_path):
    """`hfl run experiments/quickstart.yaml` in a process pinned to AVX2 kernels, as the golden runs
    are (the instruction set and the torch build change float results): 352 of the 360 test images,
    0.978, exactly, on the torch pyproject.toml pins. The README gives this."""
    import subprocess
    import sys

    from tests.golden.runs import PINNED_ISA

    env = {**cli_env(), **PINNED_ISA}
    subprocess.run([sys.executable, "-m", "hfl.cli", "run", str(QUICKSTART), "--out", str(tmp_path)], env=env, cwd=ROOT,
                   check=True, capture_output=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 20 and summary["final_accuracy"] == 352 / 360


def test_budget_prints_the_sparse_table_for_a_sparse_method(tmp_path, capsys):
    config = ROOT / "experiments" / "fedmef_table1" / "fedmef.yaml"
    assert main(["budget", str(config), "data.name=digits", "model.name=cnn", "fl.clients=10", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "FedMef's Table 1 / Table 5 form" in out
    rows = json.loads((tmp_path / "b.json").read_text())["sparse"]
    assert [(r["method"], r["sparsity"]) for r in rows][:4] == [("fedavg", 0.0), ("flpqsu", 0.8), ("flpqsu", 0.9), ("flpqsu", 0.95)]
    assert len(rows) == 19 and sum(line.split()[:2] == ["fedmef", "0.9"] for line in out.splitlines()) == 1  # 1 + 6 rows x 3 sparsities
    assert main(["budget", str(ROOT / "experiments" / "quickstart.yaml")]) == 0
    assert "Table 1 / Table 5" not in capsys.readouterr().out  # FedAvg's own config: no sparse table
