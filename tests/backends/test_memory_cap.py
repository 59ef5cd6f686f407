"""The per-client CUDA memory cap (both backends), its arithmetic checked without a GPU."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfl.accounting.amounts import ClientBudget
from hfl.experiment import cap_client_memory

MiB = 2**20


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as seen by the cap: 80 GiB, 300 MiB allocated (310 MiB reserved) by the process, current device 0;
    records the fractions set, and, as torch does on a GPU, refuses a device without an index."""
    calls = []

    def set_fraction(fraction, device):
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        calls.append(fraction)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 300 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 310 * MiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 1024 * MiB))
    return calls


def env_with(model):
    return SimpleNamespace(device=torch.device("cuda"), model=lambda spec: model)


def task_with(budget_bytes):
    budget = None if budget_bytes is None else ClientBudget("t", budget_bytes, None, None)
    return SimpleNamespace(ctx=SimpleNamespace(budget=budget), spec=None)


def test_cap_is_what_the_process_has_reserved_besides_the_model_plus_the_budget_and_is_lifted_after(fake_cuda):
    # From the reserved memory, not the allocated: the allocator holds the cap against what it reserves, and
    # its fragmentation (here 10 MiB) would otherwise come out of the budget (on an H200 it failed every FeDepth client).
    model = nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights, part of the client's budget
    model.weight.grad = torch.ones_like(model.weight)  # a failed client's leftover: not held
    with cap_client_memory(env_with(model), task_with(50 * MiB)):
        assert fake_cuda[0] == "emptied"
        assert fake_cuda[1] == pytest.approx((310 - 4 + 50) / (80 * 1024))
        assert model.weight.grad is None
    assert fake_cuda[2:] == [1.0]  # the server's evaluation and the next client's set-up run uncapped
    with pytest.raises(RuntimeError), cap_client_memory(env_with(model), task_with(50 * MiB)):
        raise RuntimeError("a client that fails")
    assert fake_cuda[-1] == 1.0


def test_no_budget_no_cap(fake_cuda):
    with cap_client_memory(env_with(nn.Linear(2, 2)), task_with(None)):
        pass
    assert fake_cuda == []


def test_nothing_happens_on_the_cpu(fake_cuda):
    with cap_client_memory(SimpleNamespace(device=torch.device("cpu")), task_with(50 * MiB)):
        pass
    assert fake_cuda == []
