import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def small_config(**sections):
    """A seconds-long digits experiment; keyword arguments override whole sections' fields."""
    from hfl.config import config_from_dict

    values = {
        "name": "test",
        "data": {"name": "digits", "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "cnn"},
        "method": {"name": "fedavg"},
        "fl": {"rounds": 3, "clients": 6, "fraction": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "backend": {"device": "cpu"},
    }
    for section, fields in sections.items():
        if isinstance(fields, dict):
            values.setdefault(section, {}).update(fields)
        else:
            values[section] = fields
    return config_from_dict(values)


def cli_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
