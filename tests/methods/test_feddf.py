"""FedDF: server distillation pulls the global model towards the clients' ensemble, adds nothing
when it takes no steps, runs on a server split disjoint from the clients', and needs that split."""

import numpy as np
import pytest
import torch

from hfl.backends.base import SERVER_SPLIT_STREAM, ClientEnvironment, server_split
from hfl.cli import main
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.losses import kl_distillation as distillation_loss
from hfl.methods.base import MethodState
from hfl.methods.feddf import batch_order
from hfl.models import build_model
from hfl.seeding import derive_seed
from hfl.server import run_experiment
from hfl.submodel.spec import width_spec
from hfl.types import ClientUpdate
from tests.conftest import QUICKSTART, method_for, small_config

WIDTH = 0.5  # of the global model; small, so that distillation takes a fraction of a second


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread per process, as `backend.threads` sets for runs: two threads on a loaded
    two-core machine made these tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seeded_model(seed, width, norm):
    torch.manual_seed(seed)
    return build_model("preresnet20", 1, 10, width, norm)


def two_client_round(norm, **method):
    """A FedDF method over a width-0.5 PreResNet-20 with 256 unlabelled inputs, its global state,
    and the updates of a client at rate 1 and one at rate 0.5 (independently initialised models
    standing in for trained ones)."""
    config = small_config(method={"name": "feddf", "widths": [1.0, 0.5], **method}, model={"norm": norm})
    x = torch.randn(256, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    method = method_for(config.method, "preresnet20", width=WIDTH, norm=norm, unlabelled_x=x)
    global_state = seeded_model(0, WIDTH, norm).state_dict()
    updates = []
    for c, (w, weight) in enumerate([(WIDTH, 30.0), (WIDTH / 2, 10.0)], start=1):
        state = seeded_model(c, w, norm).state_dict()
        state["head.fc.weight"] *= 10  # confident teachers that disagree, unlike fresh models
        updates.append(ClientUpdate(c, state, weight, width_spec(method.model, w), {}))
    return method, global_state, updates, x


def heterofl_like(norm):
    """HeteroFL's width slices averaged as FedDF averages them: by sample counts (FedDF's Algorithm 1)."""
    return method_for({"name": "heterofl", "widths": [1.0, 0.5], "weighting": "samples"}, "preresnet20", width=WIDTH, norm=norm)


@torch.no_grad()
def logits_on(state, width, x, norm):
    """Logits with batch statistics of all of x (what the teachers' recomputed statistics hold)."""
    model = build_model("preresnet20", 1, 10, width, norm).train()
    model.load_state_dict(state)
    return model(x)


@pytest.mark.parametrize("norm", ["static_bn", "bn"])
def test_distillation_moves_the_global_model_towards_the_ensemble(norm):
    method, global_state, updates, x = two_client_round(norm, distill_steps=30, distill_batch_size=64)
    ensemble = torch.stack([logits_on(u.state, u.spec.width, x, norm) for u in updates]).mean(0)
    state = method.init_state()
    averaged, _ = heterofl_like(norm).aggregate(global_state, updates, MethodState())
    distilled, new_state = method.aggregate(global_state, updates, state)

    before = float(distillation_loss(logits_on(averaged, WIDTH, x, norm), ensemble, 1.0))
    after = float(distillation_loss(logits_on(distilled, WIDTH, x, norm), ensemble, 1.0))
    assert (round(before, 2), round(after, 2)) == (0.90, 0.10)  # the docs' figure: distillation cuts the KL ninefold
    assert new_state.aggregations == 1 and state.aggregations == 0
    torch.testing.assert_close(method.ensemble_logits(global_state, updates, x), ensemble, rtol=0.05, atol=0.05)
    for key, tensor in averaged.items():
        assert distilled[key].dtype == tensor.dtype and distilled[key].shape == tensor.shape
        if not tensor.is_floating_point():  # BN's batch counters keep the clients' value
            assert torch.equal(distilled[key], tensor)


@pytest.mark.parametrize("norm", ["static_bn", "bn"])
def test_zero_steps_is_heterofl_exactly(norm):
    method, global_state, updates, _ = two_client_round(norm, distill_steps=0)
    expected, _ = heterofl_like(norm).aggregate(global_state, updates, MethodState())
    distilled, _ = method.aggregate(global_state, updates, method.init_state())
    assert distilled.keys() == expected.keys()
    for key in expected:
        assert distilled[key].dtype == expected[key].dtype and torch.equal(distilled[key], expected[key]), key


def test_batch_order_covers_the_set_before_repeating():
    batches = list(batch_order(10, 4, 5, torch.Generator().manual_seed(0)))
    assert [len(b) for b in batches] == [4] * 5
    assert len(set(torch.cat(batches[:2]).tolist())) == 8  # one pass: no repeats; its tail of 2 is skipped
    assert [len(b) for b in batch_order(3, 128, 2, torch.Generator())] == [3, 3]


def test_server_split_is_disjoint_from_every_client_and_sized():
    config = small_config(method={"name": "feddf"}, data={"server_fraction": 0.1})
    env = ClientEnvironment.from_config(config)
    n = len(env.data.train_y)
    server, rest = server_split(n, 0.1, derive_seed(config.seed, SERVER_SPLIT_STREAM))
    clients = torch.cat(env.partitions).numpy()
    assert len(server) == round(0.1 * n) == len(env.method.resources.unlabelled_x)
    assert not np.intersect1d(server, clients).size
    assert set(clients.tolist()) <= set(rest.tolist())
    expected = env.train_x[torch.as_tensor(server)]
    if env.transform is not None:
        expected = env.transform(expected, train=False)
    assert torch.equal(env.method.resources.unlabelled_x, expected)


def test_two_rounds_with_budgets_distil_after_heterofl_clients(tmp_path):
    def config(name):
        return small_config(method={"name": name, **({"distill_steps": 10} if name == "feddf" else {})},
                            model={"name": "cnn"}, budgets={"scenario": "fair"},
                            data={"server_fraction": 0.1}, fl={"rounds": 2, "clients": 4, "fraction": 1.0})

    summary = run_experiment(config("feddf"), tmp_path / "feddf")
    run_experiment(config("heterofl"), tmp_path / "heterofl")
    assert summary["budget_violations"] == 0 and summary["client_rounds"] == 8
    feddf, heterofl = read_metrics(tmp_path / "feddf"), read_metrics(tmp_path / "heterofl")
    assert len({c["submodel"]["width"] for r in feddf for c in r["clients"]}) > 1  # width-heterogeneous
    # Round 1 trains the same clients from the same model; distillation then changes the global one.
    assert [c["train_loss"] for c in feddf[0]["clients"]] == [c["train_loss"] for c in heterofl[0]["clients"]]
    assert feddf[0]["accuracy"] != heterofl[0]["accuracy"]
    assert [c["train_loss"] for c in feddf[1]["clients"]] != [c["train_loss"] for c in heterofl[1]["clients"]]


def test_resumed_run_repeats_the_uninterrupted_one(tmp_path):
    def config(rounds):
        return small_config(method={"name": "feddf", "distill_steps": 5}, data={"server_fraction": 0.1},
                            fl={"rounds": rounds, "clients": 4, "fraction": 1.0})

    run_experiment(config(2), tmp_path / "whole")
    run_experiment(config(1), tmp_path / "split")
    run_experiment(config(2), tmp_path / "split", resume=True)
    scores = [[(r["accuracy"], r["loss"]) for r in read_metrics(tmp_path / run)] for run in ("whole", "split")]
    assert scores[0] == scores[1]


def test_missing_server_split_is_a_config_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="data.server_fraction"):
        method_for({"name": "feddf"})
    assert main(["run", str(QUICKSTART), "method.name=feddf", "--out", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hfl: error:")]
    assert len(errors) == 1 and "data.server_fraction" in errors[0] and "feddf" in errors[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_distill_samples_bounds_what_the_teachers_run_on(monkeypatch):
    method, global_state, updates, x = two_client_round("bn", distill_steps=2, distill_samples=5)
    seen = []
    original = method.ensemble_logits
    monkeypatch.setattr(method, "ensemble_logits", lambda g, u, inputs: seen.append(inputs) or original(g, u, inputs))
    method.aggregate(global_state, updates, method.init_state())
    assert len(seen) == 1 and len(seen[0]) == 5 < len(x)
    rows = {tuple(r.flatten().tolist()) for r in x}
    assert all(tuple(r.flatten().tolist()) in rows for r in seen[0])  # a sample of the server split
