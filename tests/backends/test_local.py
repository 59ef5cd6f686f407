"""The local backend: a client that runs out of CUDA memory under its budget's cap fails alone."""

import pytest
import torch

from hfl.backends.local import LocalBackend
from hfl.experiment import ClientEnvironment
from hfl.server import initial_state, train_settings
from hfl.types import RoundContext
from tests.conftest import small_config


def round_tasks(budgets: dict):
    config = small_config(budgets=budgets, fl={"clients": 4})
    env = ClientEnvironment.from_config(config)
    settings = train_settings(config.fl, 1)
    tasks = [env.method.plan(RoundContext(1, c, config.seed, len(env.partitions[c]), settings, env.budgets[c]), {}) for c in range(3)]
    return env, initial_state(config, env).global_state, tasks


def out_of_memory_for(env, client: int):
    train_unit = env.train_unit

    def failing(global_state, tasks):
        if tasks[0].ctx.client_id == client:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return train_unit(global_state, tasks)

    return failing


def test_a_budgeted_client_out_of_cuda_memory_is_a_failed_client_and_the_others_train(monkeypatch):
    env, state, tasks = round_tasks({"scenario": "tiers", "memory": ["1GB"]})
    monkeypatch.setattr(env, "train_unit", out_of_memory_for(env, 1))
    backend = LocalBackend(env)
    updates, failed = backend.collect(backend.submit(state, tasks))
    assert [u.client_id for u in updates] == [0, 2]
    assert [f["id"] for f in failed] == [1]
    assert "CUDA out of memory under its memory budget of 953.7 MiB" in failed[0]["reason"]


def test_without_a_budget_running_out_of_memory_stops_the_run(monkeypatch):
    env, state, tasks = round_tasks({"scenario": "none"})
    monkeypatch.setattr(env, "train_unit", out_of_memory_for(env, 1))
    backend = LocalBackend(env)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        backend.collect(backend.submit(state, tasks))
