"""What a run on a cluster needs around its backend (issue 46): a resume may change the settings of
the Ray backend that change no number, and the local staging folder of a run on a URI never leaks."""

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from hfl.cli import main
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from hfl.storage import STAGING_PREFIX, join, staged
from tests.conftest import QUICKSTART, ROOT, cli_env, small_config


@pytest.fixture
def temp(tmp_path, monkeypatch):
    """The temporary directory staging folders go to, empty and this test's own."""
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_resume_may_change_how_ray_places_and_waits_for_clients(tmp_path):
    # A cluster that lost a tier's node may need a longer start timeout, other pool sizes or GPU
    # shares to go on; none of them changes a number of the run.
    run_experiment(small_config(fl={"rounds": 1}), tmp_path)
    changes = ["fl.rounds=2", "backend.actor_start_timeout_s=600", "backend.actors_per_pool=2", "backend.num_cpus_per_client=0.5",
               "backend.num_gpus_per_client=0.25", "backend.num_gpus_per_tier=[large:0.5]", "backend.gpu_memory=16GB", "backend.tier_strict=true"]
    assert main(["run", "--resume", str(tmp_path), *changes]) == 0
    assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2]


@pytest.mark.parametrize("fails", ["to open", pytest.param("to read", marks=pytest.mark.slow)])  # ~6 s of pyarrow retrying
def test_an_s3_uri_that_cannot_be_opened_or_read_leaves_no_staging_folder(temp, capsys, fails):
    # Without a network: an option pyarrow refuses, or an endpoint that refuses connections (pyarrow
    # opens that URI, and reading it fails after its retries, ~6 s).
    uri = ("s3://bucket/runs/x?region=us-east-1&no_such_option=1" if fails == "to open"
           else f"s3://bucket/runs/x?region=us-east-1&endpoint_override=127.0.0.1:{closed_port()}&scheme=http")
    assert main(["run", str(QUICKSTART), "--out", uri]) == 2
    assert list(temp.iterdir()) == []
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"hfl: error: --out='{uri}' is not allowed") and "bucket" in line


def test_a_file_uri_with_a_query_is_refused_in_one_line_and_other_schemes_keep_theirs(temp, tmp_path, capsys):
    assert main(["run", str(QUICKSTART), "--out", f"file://{tmp_path}/q1?foo=bar"]) == 2
    assert "a file:// URI without a query string" in capsys.readouterr().err
    assert list(temp.iterdir()) == [] and not (tmp_path / "q1").exists()
    # Elsewhere the query is the filesystem's options: kept whole, after the path.
    assert join("s3://b/sweep?region=eu-west-1", "trials", "t1") == "s3://b/sweep/trials/t1?region=eu-west-1"


def test_the_staging_folder_of_a_run_that_died_goes_with_the_next_run_and_logs_name_the_uri(temp, tmp_path, caplog):
    uri = f"file://{tmp_path}/bucket/run"
    # A run on the URI that is SIGKILLed while it holds its staging folder.
    code = ("import sys, time; from hfl.storage import staged\n"
            "with staged(sys.argv[1]) as (folder, push):\n"
            "    (folder / 'config.yaml').write_text('x'); push(); print(folder, flush=True); time.sleep(600)")
    env = {**cli_env(), "TMPDIR": str(temp)}
    process = subprocess.Popen([sys.executable, "-c", code, uri], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    dead = process.stdout.readline().strip()  # the event: its folder is made and copied once
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert os.path.isdir(dead) and dead.startswith(str(temp / STAGING_PREFIX))
    with caplog.at_level(logging.INFO, logger="hfl.storage"):
        with staged(uri) as (live, _):
            assert not os.path.exists(dead)  # the dead run's staging is gone
            with staged(f"file://{tmp_path}/other") as (other, _):
                assert live.is_dir()  # a live run's is kept
            assert (live / "config.yaml").read_text() == "x"  # what the dead run had copied
    assert list(temp.iterdir()) == []
    assert any(uri in r.getMessage() and str(live) in r.getMessage() for r in caplog.records)
