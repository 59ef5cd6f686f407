"""How the width methods average: each client once or by samples, and classifier rows by label."""

import pytest
import torch

from hfl.client import ClientBatches, train_client
from hfl.server import train_settings
from hfl.submodel.spec import extract
from hfl.types import ClientUpdate, RoundContext
from tests.conftest import method_for, small_config

RATES = (1.0, 0.5, 0.25, 0.125)
SAMPLES = (10, 20, 30, 40)


def four_client_rows(weighting):
    """HeteroFL's average of four clients at rates 1, 1/2, 1/4, 1/8 with 10, 20, 30, 40 samples,
    client i sending the value i + 1 everywhere: the output channels of the first conv (Q = 32)."""
    method = method_for(
        {"name": "heterofl", "widths": list(RATES), "weighting": weighting}
    )
    group = next(g for g in method.model.channel_groups() if g.name == "block0")
    key = next(k for k, dim in group.members if dim == 0 and k.endswith("weight"))
    global_state = {
        k: torch.zeros_like(v) for k, v in method.initial_global_state().items()
    }
    updates = []
    for i, (rate, n) in enumerate(zip(RATES, SAMPLES)):
        spec = method.level_spec(rate)
        sent = {
            k: torch.full_like(v, i + 1.0)
            for k, v in extract(global_state, spec).items()
            if v.is_floating_point()
        }
        updates.append(ClientUpdate(i, sent, float(n), spec, {}))
    new, _ = method.aggregate(global_state, updates, method.init_state())
    return new[key].flatten(1).mean(1)  # every entry of an output channel is equal


@pytest.mark.parametrize(
    "weighting, expected",
    [
        # channels 0-3 are held by all four, 4-7 by the rates 1, 1/2, 1/4, 8-15 by 1 and 1/2, 16-31 by 1 alone
        ("clients", [(1 + 2 + 3 + 4) / 4, (1 + 2 + 3) / 3, (1 + 2) / 2, 1.0]),
        (
            "samples",
            [
                (10 * 1 + 20 * 2 + 30 * 3 + 40 * 4) / 100,
                (10 * 1 + 20 * 2 + 30 * 3) / 60,
                (10 * 1 + 20 * 2) / 30,
                1.0,
            ],
        ),
    ],
)
def test_four_clients_by_hand(weighting, expected):
    rows = four_client_rows(weighting)
    by_hand = torch.tensor(
        [expected[0]] * 4 + [expected[1]] * 4 + [expected[2]] * 8 + [expected[3]] * 16
    )
    torch.testing.assert_close(rows, by_hand)


def test_heterofl_and_fedrolex_default_to_clients_fedavg_to_samples():
    for name, weighting in [
        ("heterofl", "clients"),
        ("fedrolex", "clients"),
        ("fedavg", "samples"),
        ("fedprox", "samples"),
    ]:
        assert method_for({"name": name}).config.weighting == weighting, name


def client_round(method, client_id, labels, global_state, config):
    """Train `method`'s client `client_id` one epoch on 8 random inputs whose labels are `labels` (cycled)."""
    ctx = RoundContext(1, client_id, 0, 8, train_settings(config.fl, 1))
    task = method.plan(ctx, method.init_state())
    generator = torch.Generator().manual_seed(client_id)
    x, y = (
        torch.randn(8, 1, 8, 8, generator=generator),
        torch.tensor(labels * (8 // len(labels))),
    )
    batches = ClientBatches(x, y, torch.arange(8), 4, None, generator)
    return train_client(
        method.client_model(task.spec),
        method,
        task,
        global_state,
        batches,
        classes=torch.unique(y),
    )


@pytest.mark.parametrize("name", ["heterofl", "fedrolex"])
def test_a_label_absent_from_a_client_leaves_its_classifier_row_out(name):
    config = small_config(
        method={"name": name, "widths": [1.0], "masked_ce": True},
        fl={"weight_decay": 5e-4},
    )
    method = method_for(config.method)
    global_state = method.initial_global_state()
    narrow = client_round(
        method, 0, [0, 3], global_state, config
    )  # labels 0 and 3 only
    wide = client_round(
        method, 1, list(range(8)), global_state, config
    )  # labels 0-7: 8 and 9 absent here too

    held = narrow.spec.masks["head.fc.weight"]
    assert held[[0, 3]].all() and not held[[1, 2, 4, 5, 6, 7, 8, 9]].any()
    assert narrow.spec.masks["head.fc.bias"].tolist() == [
        c in (0, 3) for c in range(10)
    ]
    assert narrow.metrics["bytes_up"] < wide.metrics["bytes_up"]

    new, _ = method.aggregate(global_state, [narrow, wide], method.init_state())
    weight, old = new["head.fc.weight"], global_state["head.fc.weight"]
    mean = (narrow.state["head.fc.weight"] + wide.state["head.fc.weight"]) / 2
    torch.testing.assert_close(weight[[0, 3]], mean[[0, 3]])  # both hold labels 0 and 3
    torch.testing.assert_close(
        weight[5], wide.state["head.fc.weight"][5]
    )  # only the wide client holds 5
    assert not torch.equal(
        narrow.state["head.fc.weight"][5], old[5]
    )  # weight decay moved the narrow client's row
    assert torch.equal(weight[9], old[9])  # no client holds 9: unchanged


def test_without_masking_every_row_is_sent():
    config = small_config(method={"name": "heterofl", "widths": [1.0]})
    method = method_for(config.method)
    update = client_round(method, 0, [0, 3], method.initial_global_state(), config)
    assert not update.spec.masks
