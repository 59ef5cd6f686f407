"""FedDST: clients readjust their masks mid-round in readjustment rounds; the server averages each
entry over its holders, then keeps per layer the largest magnitudes of the union of client masks."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfl.client import ClientBatches, train_client
from hfl.methods.base import MethodState
from hfl.methods.feddst import Readjustment
from hfl.pruning.schedules import feddst_adjustment_rate
from hfl.submodel.spec import SubmodelSpec
from hfl.types import ClientUpdate, RoundContext, TrainSettings
from tests.conftest import method_for, small_config

SETTINGS = TrainSettings(lr=0.1, momentum=0.9, weight_decay=0.0, local_epochs=2, batch_size=10)


def feddst(**fields):
    return method_for({"name": "feddst", "sparsity": 0.8, "adjust_every": 2, "stop_round": 10, **fields}, "cnn", input_size=8)


def test_readjustment_rate_follows_the_cosine_schedule():
    assert feddst_adjustment_rate(0, 0.4, 300) == pytest.approx(0.4)
    assert feddst_adjustment_rate(100, 0.05, 300) == pytest.approx(0.0375)  # 0.025·(1 + cos(π/3))
    assert feddst_adjustment_rate(150, 0.4, 300) == pytest.approx(0.2)
    assert feddst_adjustment_rate(300, 0.4, 300) == pytest.approx(0.0)
    assert feddst_adjustment_rate(301, 0.4, 300) == 0.0


def test_only_rounds_divisible_by_adjust_every_before_the_stop_readjust_after_half_the_steps():
    method = feddst(alpha=0.3)
    plans = {r: method.plan(RoundContext(r, 0, 0, 45, SETTINGS), method.init_state()).options for r in range(1, 13)}
    assert {r for r, options in plans.items() if options is not None} == {2, 4, 6, 8}  # α_10 = 0: nothing to swap
    assert plans[4] == Readjustment(feddst_adjustment_rate(4, 0.3, 10), 5)  # 2 epochs of ⌈45/10⌉ = 5 batches: 10 steps


def test_the_objective_drops_the_smallest_kept_and_grows_the_largest_gradient_pruned_entries():
    layer = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, -3.0, 0.0, 0.1], [0.2, 0.0, 1.0, 0.0]]))
    mask = torch.tensor([[True, True, False, True], [True, False, True, False]])
    x, y = torch.tensor([[1.0, 2.0, 0.5, -4.0]]), torch.tensor([1])
    replaced = []
    client = SimpleNamespace(model=nn.Sequential(layer), masks={"0.weight": mask}, steps=3,
                             task=SimpleNamespace(options=Readjustment(0.4, 3)), replace_masks=replaced.append)
    method = feddst()
    loss = method.objective(client, x, y)["loss"]
    gradient = torch.autograd.grad(torch.nn.functional.cross_entropy(layer(x), y), layer.weight)[0].abs()
    assert gradient[1, 3] > gradient[1, 1] > gradient[0, 2]  # the pruned entries, not in position order
    # ξ = ⌊0.4·5⌋ = 2: drop 0.1 and 0.2, grow the pruned entries of the two largest |gradient|
    (new,) = replaced
    assert new["0.weight"].tolist() == [[True, True, False, False], [False, True, True, True]]
    loss.backward()  # the step's own backward still runs through the graph
    client.steps = 4
    method.objective(client, x, y)
    assert len(replaced) == 1  # once per round, at its step


def client_round(method, round_, state):
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 8, 8, generator=generator), torch.randint(0, 10, (40,), generator=generator)
    task = method.plan(RoundContext(round_, 0, 0, 40, SETTINGS), state)
    batches = ClientBatches(x, y, torch.arange(40), SETTINGS.batch_size, None, torch.Generator().manual_seed(1))
    return train_client(method.client_model(task.spec), method, task, method.initial_global_state(), batches)


def test_the_client_mask_changes_only_in_readjustment_rounds_and_keeps_each_layers_count():
    method = feddst()
    state = method.init_state()
    plain = client_round(method, 1, state)
    assert all(torch.equal(plain.spec.masks[k], m) for k, m in state.masks.items())
    readjusted = client_round(method, 2, state)
    changed = 0
    for key, old in state.masks.items():
        new = readjusted.spec.masks[key]
        assert int(new.sum()) == int(old.sum()), key  # regrown to the layer's density
        assert not readjusted.state[key][~new].any(), key  # dropped entries held at zero
        grown = new & ~old
        if grown.any():
            changed += 1
            assert readjusted.state[key][grown].abs().sum() > 0, key  # grown at 0, then trained
    assert changed > 0


def test_the_server_averages_each_entry_over_the_clients_holding_it():
    method = feddst()
    state = MethodState(masks={"w": torch.tensor([True, True, False, False])})
    global_state = {"w": torch.tensor([9.0, 9.0, 0.0, 0.0]), "b": torch.tensor([0.0])}

    def update(weight, mask, values, bias):
        spec = SubmodelSpec(masks={"w": torch.tensor(mask)})
        return ClientUpdate(0, {"w": torch.tensor(values), "b": torch.tensor([bias])}, weight, spec, {})

    updates = [update(1.0, [True, False, True, False], [1.0, 0.0, 4.0, 0.0], 1.0),
               update(3.0, [True, True, False, False], [5.0, -2.0, 0.0, 0.0], 2.0),
               update(2.0, [False, True, False, True], [0.0, 7.0, 0.0, 0.5], 4.0)]
    new, new_state = method.aggregate(global_state, updates, state)
    # holders' means: (1 + 3·5)/4 = 4, (3·(−2) + 2·7)/5 = 1.6, 4/1 = 4, 0.5/1; the two largest stay
    assert new_state.masks["w"].tolist() == [True, False, True, False]
    assert new["w"].tolist() == [4.0, 0.0, 4.0, 0.0]
    assert new["b"].item() == pytest.approx((1.0 + 6.0 + 8.0) / 6.0)  # unmasked: every client


def test_the_union_is_re_pruned_to_each_layers_count_by_magnitude():
    method = feddst()
    generator = torch.Generator().manual_seed(3)
    shapes = {"a": (6, 5), "b": (40,)}
    counts = {"a": 7, "b": 10}

    def mask_of(shape, count):
        kept = torch.zeros(math.prod(shape), dtype=torch.bool)
        kept[torch.randperm(kept.numel(), generator=generator)[:count]] = True
        return kept.view(shape)

    state = MethodState(masks={k: mask_of(s, counts[k]) for k, s in shapes.items()})
    global_state = {k: torch.randn(s, generator=generator) * state.masks[k] for k, s in shapes.items()}
    updates = []
    for weight in (1.0, 2.0, 5.0):
        masks = {k: mask_of(s, counts[k]) for k, s in shapes.items()}
        values = {k: torch.randn(s, generator=generator) * masks[k] for k, s in shapes.items()}
        updates.append(ClientUpdate(0, values, weight, SubmodelSpec(masks=masks), {}))
    new, new_state = method.aggregate(global_state, updates, state)
    for key in shapes:
        union = torch.stack([u.spec.masks[key] for u in updates]).any(0)
        held = torch.stack([u.spec.masks[key].float() * u.weight for u in updates]).sum(0)
        mean = torch.stack([u.state[key] * u.weight for u in updates]).sum(0) / held.clamp_min(1e-30)
        mask = new_state.masks[key]
        assert int(mask.sum()) == counts[key] and not (mask & ~union).any(), key
        assert mean.abs()[mask].min() >= mean.abs()[union & ~mask].max(), key  # the largest |θ̄| of the union
        assert torch.allclose(new[key][mask], mean[mask]) and not new[key][~mask].any(), key


def test_a_run_keeps_pruned_entries_at_zero_and_resumes_exactly(tmp_path, monkeypatch):
    from hfl.config import load_config
    from hfl.loggers import read_metrics
    from hfl.server import initial_state, run_experiment
    from tests.conftest import run_with_env
    from tests.golden.runs import without_timings

    def config(rounds):
        return small_config(method={"name": "feddst", "sparsity": 0.8, "adjust_every": 1, "stop_round": 10},
                            fl={"rounds": rounds, "clients": 4, "fraction": 1.0})

    _, env, final = run_with_env(config(2), tmp_path / "straight", monkeypatch)
    run_experiment(config(1), tmp_path / "resumed")
    run_experiment(load_config(tmp_path / "resumed" / "config.yaml", ["fl.rounds=2"]), tmp_path / "resumed", resume=True)
    resumed = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    assert without_timings(read_metrics(tmp_path / "resumed")) == without_timings(read_metrics(tmp_path / "straight"))
    assert all(torch.equal(resumed["global_state"][k], v) for k, v in final["global_state"].items())
    assert all(torch.equal(resumed["method_state"].masks[k], m) for k, m in final["method_state"].masks.items())
    start_masks = env.method.init_state().masks
    start = initial_state(config(2), env).global_state
    masks = final["method_state"].masks
    assert any(not torch.equal(masks[k], m) for k, m in start_masks.items())  # readjusted in both rounds
    for key, mask in masks.items():
        assert int(mask.sum()) == int(start_masks[key].sum()), key
        assert not final["global_state"][key][~mask].any() and not start[key][~start_masks[key]].any(), key
