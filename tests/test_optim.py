"""hfl.optim.ClientOptimizer: torch.optim's SGD and Adam steps, bit for bit, without torch.optim.Optimizer."""

import pytest
import torch
from torch import nn

from hfl.optim import ClientOptimizer


def model_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    twin = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    twin.load_state_dict(model.state_dict())
    return model, twin


def train(model: nn.Module, optimizer, steps: int = 4, frozen_bias_after: int = 2) -> None:
    """Steps with a learning rate changed through param_groups midway, and, from step
    `frozen_bias_after` on, a parameter without a gradient (which must neither move nor get state)."""
    torch.manual_seed(1)
    for step in range(steps):
        if step == 2:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        optimizer.zero_grad(set_to_none=True)
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        nn.functional.cross_entropy(model(x), y).backward()
        if step >= frozen_bias_after:
            model[2].bias.grad = None
        optimizer.step()


@pytest.mark.parametrize(("kind", "reference"), [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4, foreach=True)),
    ("sgd_plain", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.0, weight_decay=0.0, foreach=True)),
    ("adam", lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=5e-4, foreach=True)),
])
def test_steps_equal_torch_optim_bit_for_bit(kind, reference):
    ours, theirs = model_pair()
    if kind == "adam":
        optimizer = ClientOptimizer(ours.parameters(), "adam", lr=0.01, weight_decay=5e-4)
    else:
        momentum, decay = (0.9, 5e-4) if kind == "sgd" else (0.0, 0.0)
        optimizer = ClientOptimizer(ours.parameters(), "sgd", lr=0.1, momentum=momentum, weight_decay=decay)
    torch_optimizer = reference(theirs.parameters())
    train(ours, optimizer)
    train(theirs, torch_optimizer)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), name
    mine = {n: optimizer.state.get(p, {}) for n, p in ours.named_parameters()}
    torchs = {n: torch_optimizer.state.get(p, {}) for n, p in theirs.named_parameters()}
    assert {n: sorted(s) for n, s in mine.items()} == {n: sorted(s) for n, s in torchs.items()}
    assert all(torch.equal(mine[n][k], torchs[n][k]) for n in mine for k in mine[n])


def test_a_closure_runs_first_with_gradients_and_its_loss_is_returned():
    model, _ = model_pair()
    optimizer = ClientOptimizer(model.parameters(), "sgd", lr=0.1)
    before = model[0].weight.detach().clone()

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 6)).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = optimizer.step(closure)
    assert loss.requires_grad and not torch.equal(model[0].weight, before)


def test_zero_grad_sets_to_none_or_zeroes():
    model, _ = model_pair()
    optimizer = ClientOptimizer(model.parameters(), "sgd", lr=0.1)
    model(torch.ones(2, 6)).sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_round_trip_restores_state_and_rates():
    model, _ = model_pair()
    optimizer = ClientOptimizer(model.parameters(), "adam", lr=0.01)
    train(model, optimizer, steps=2)
    saved = optimizer.state_dict()
    restored = ClientOptimizer(model.parameters(), "adam", lr=0.5)
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert all(torch.equal(restored.state[p][k], optimizer.state[p][k]) for p in optimizer.state for k in optimizer.state[p])


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'sgd' or 'adam'"):
        ClientOptimizer([], "rmsprop", lr=0.1)


def test_lightning_takes_it_as_an_optimizer():
    from lightning.fabric.utilities.types import Optimizable

    assert isinstance(ClientOptimizer([], "sgd", lr=0.1), Optimizable)
