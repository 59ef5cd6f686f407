"""Results on a URI (here file://, as s3:// or gs:// on a cluster): copied every round, kept through a
crash, resumed from; a relative folder under a Ray job is refused."""

import pytest

from hfl.cli import main
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from hfl.storage import RAY_JOB_VARIABLE, check_job_location, is_uri
from tests.conftest import QUICKSTART, small_config


class CrashAfter:
    """Stops the run after `round_`, noting what the URI held at that moment (a SIGKILL then would
    leave it so)."""

    def __init__(self, round_, remote):
        self.round, self.remote, self.seen = round_, remote, None

    def on_round(self, record):
        if record["round"] == self.round:
            self.seen = [r["round"] for r in read_metrics(self.remote)], (self.remote / "checkpoint.pt").is_file()
            raise KeyboardInterrupt

    def on_end(self, summary):
        pass


def test_a_run_on_a_uri_is_there_after_every_round_and_after_a_crash_and_resumes_from_it(tmp_path):
    uri, remote = f"file://{tmp_path}/bucket/run", tmp_path / "bucket" / "run"
    crash = CrashAfter(2, remote)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(small_config(fl={"rounds": 4}), uri, callbacks=[crash])
    assert crash.seen == ([1, 2], True)  # copied as each round ended
    assert [r["round"] for r in read_metrics(remote)] == [1, 2]
    assert (remote / "checkpoint.pt").is_file() and not (remote / "summary.json").exists()

    assert main(["run", "--resume", uri]) == 0
    resumed = read_metrics(remote)
    assert [r["round"] for r in resumed] == [1, 2, 3, 4] and (remote / "summary.json").is_file()
    straight = run_experiment(small_config(fl={"rounds": 4}), tmp_path / "straight")
    assert resumed[-1]["accuracy"] == straight["final_accuracy"]  # as if it had never stopped


def test_only_files_that_changed_are_copied_again(tmp_path):
    from hfl.storage import Mirror

    local, remote = tmp_path / "local", tmp_path / "remote"
    local.mkdir()
    (local / "a.txt").write_text("1")
    mirror = Mirror(local, f"file://{remote}", "--out")
    mirror.push()
    first = (remote / "a.txt").stat().st_mtime_ns
    (local / "b.txt").write_text("2")
    mirror.push()
    assert (remote / "a.txt").stat().st_mtime_ns == first and (remote / "b.txt").read_text() == "2"
    (local / "a.txt").write_text("10")
    mirror.push()
    assert (remote / "a.txt").read_text() == "10"


def test_under_a_ray_job_a_results_folder_must_be_absolute_or_a_uri(monkeypatch, capsys, tmp_path):
    assert is_uri("s3://bucket/x") and is_uri(f"file://{tmp_path}") and not is_uri("runs/x") and not is_uri(str(tmp_path))
    check_job_location("runs/x", "--out")  # outside a job: fine
    monkeypatch.setenv(RAY_JOB_VARIABLE, "{}")
    check_job_location(str(tmp_path / "shared"), "--out")  # absolute: a path every node may mount
    check_job_location("gs://bucket/x", "--out")
    with pytest.raises(ConfigError) as info:
        check_job_location("runs/x", "--out")
    assert "deletes with the job" in info.value.allowed
    assert main(["run", str(QUICKSTART)]) == 2  # the default folder, runs/NAME-TIME, is relative
    assert "--out=None is not allowed" in capsys.readouterr().err


def test_a_uri_pyarrow_cannot_open_is_a_config_error(tmp_path, capsys):
    assert main(["run", str(QUICKSTART), "--out", "nosuchscheme://x/y"]) == 2
    assert "--out='nosuchscheme://x/y' is not allowed" in capsys.readouterr().err


def test_a_report_reads_runs_on_a_uri(tmp_path):
    from hfl.report import load_run

    run_experiment(small_config(fl={"rounds": 1}), f"file://{tmp_path}/bucket/run-a")
    record = load_run(f"file://{tmp_path}/bucket/run-a")
    assert record.label == "run-a (fedavg)" and len(record.rounds) == 1 and record.summary["rounds"] == 1
