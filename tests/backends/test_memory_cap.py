"""The per-client CUDA memory cap of the Ray backend, its arithmetic checked without a GPU."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfl.accounting.amounts import ClientBudget
from hfl.backends.ray import cap_client_memory

MiB = 2**20


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as seen by the cap: 80 GiB, 300 MiB reserved by the process, current device 0;
    records the fractions set, and, as torch does on a GPU, refuses a device without an index."""
    calls = []

    def set_fraction(fraction, device):
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        calls.append(fraction)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300 * MiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 1024 * MiB))
    return calls


def env_with(model):
    return SimpleNamespace(device=torch.device("cuda"), model=lambda spec: model)


def task_with(budget_bytes):
    budget = None if budget_bytes is None else ClientBudget("t", budget_bytes, None, None)
    return SimpleNamespace(ctx=SimpleNamespace(budget=budget), spec=None)


def test_cap_is_what_the_process_holds_besides_the_model_plus_the_budget(fake_cuda):
    model = nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights, part of the client's budget
    model.weight.grad = torch.ones_like(model.weight)  # a failed client's leftover: not held
    cap_client_memory(env_with(model), task_with(50 * MiB))
    assert fake_cuda[:2] == [1.0, "emptied"]  # the last client's cap lifted before anything is built
    assert fake_cuda[2] == pytest.approx((300 - 4 + 50) / (80 * 1024))
    assert model.weight.grad is None


def test_no_budget_no_cap(fake_cuda):
    cap_client_memory(env_with(nn.Linear(2, 2)), task_with(None))
    assert fake_cuda == [1.0]


def test_nothing_happens_on_the_cpu(fake_cuda):
    cap_client_memory(SimpleNamespace(device=torch.device("cpu")), task_with(50 * MiB))
    assert fake_cuda == []
