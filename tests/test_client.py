"""Client training: clients trained together (one vectorised model) against clients trained one by
one, and a client-round that does not depend on what its process ran before."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfl.backends.base import ClientEnvironment
from hfl.client import trains_together
from hfl.config import config_from_dict
from hfl.methods.scalefl import held_exits
from hfl.server import initial_state, run_experiment, train_settings
from hfl.types import RoundContext
from tests.conftest import small_config


def environment_and_tasks(clients: int = 4, samples: int | None = None, **sections):
    """The environment of a small digits experiment and its first round's tasks for `clients`
    clients; with `samples`, each client keeps about that many of its samples, spread over its
    partition (every class it holds keeps its share), so a test pays for fewer steps."""
    config = small_config(**{"data": {"name": "digits", "partition": "iid"}, "fl": {"clients": 8, "local_epochs": 2}, **sections})
    env = ClientEnvironment.from_config(config)
    if samples is not None:
        env.partitions = [p[:: max(1, len(p) // samples)][:samples] for p in env.partitions]
    state = initial_state(config, env).global_state
    settings = train_settings(config.fl, 1)
    tasks = [env.method.plan(RoundContext(1, c, config.seed, len(env.partitions[c]), settings, env.budgets[c]), {}) for c in range(clients)]
    return env, state, tasks


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# HeteroFL and FedRolex at half width (the scaler active) on two labels per client (the masking trick
# and the rows each client holds differ per client).
HALF_WIDTH_TWO_LABELS = {"budgets": {"scenario": "tiers", "memory": ["width:1/2"]},
                         "data": {"name": "digits", "partition": "pathological", "labels_per_client": 2}}


@pytest.mark.slow
@pytest.mark.parametrize(("method", "sections"), [({"name": "fedavg"}, {}), ({"name": "fedprox", "mu": 0.5}, {}), ({"name": "depthfl"}, {}),
                                                  ({"name": "heterofl", "masked_ce": True}, HALF_WIDTH_TWO_LABELS),
                                                  ({"name": "fedrolex", "masked_ce": True}, HALF_WIDTH_TWO_LABELS),
                                                  ({"name": "fedepth"}, {"budgets": {"scenario": "fair"}}),
                                                  ({"name": "scalefl", "distill_after": 0.0}, {"budgets": {"scenario": "fair"}}),
                                                  ({"name": "nefl"}, {"budgets": {"scenario": "fair"}}),
                                                  ({"name": "splitmix"}, {"budgets": {"scenario": "fair"}})],
                         ids=["fedavg", "fedprox", "depthfl", "heterofl", "fedrolex", "fedepth", "scalefl", "nefl", "splitmix"])
def test_training_together_is_training_one_by_one(float64, method, sections):
    # In float64 the only difference, the order in which batched kernels sum, vanishes below 1e-12:
    # the same batches, the same steps, the same optimiser arithmetic for every client; FedProx's
    # proximal term from each client's own starting weights, DepthFL's exits and their distillation,
    # HeteroFL's scaler and each client's own classes, FeDepth's block groups one stage after another
    # (each with a fresh optimiser over its own blocks and the head).
    # Three batches of 32 a client and two epochs: every step kind (the first, a momentum step, a
    # short last batch, a reshuffled epoch) at a third of a full partition's cost.
    env, state, tasks = environment_and_tasks(clients=8, samples=80, model={"name": "preresnet20"}, method=method, **sections)
    tasks = [t for t in tasks if t is not None]  # FeDepth's tiers that fit no block sit out
    assert all(trains_together(env.method, t) for t in tasks)
    keys = [env.together_key(t) for t in tasks]
    largest = max(zip(keys, tasks), key=lambda pair: (keys.count(pair[0]), len(pair[1].stages)))[0]
    tasks = [t for t, k in zip(tasks, keys) if k == largest]  # the largest group of one shape, stages and size; most stages first
    assert len(tasks) >= 2
    if method["name"] == "fedepth":
        assert len(tasks[0].stages) > 2 and tasks[0].ctx.budget.tier != "w1"
    if method["name"] == "scalefl":  # the scaler, and two exits or more: the self-distillation term is on
        split, blocks = env.method.splits[tasks[0].options.level - 1], env.method.blocks
        assert tasks[0].options.rate < 1 and len(held_exits(env.method.exit_blocks, split.depth, blocks)) + (split.depth == blocks) >= 2
    if method["name"] == "splitmix":  # two bases or more, each with batch norm's running statistics
        assert len(tasks[0].spec.places) >= 2 and any(k.endswith("running_mean") for k in state)
    if sections is HALF_WIDTH_TWO_LABELS:
        assert tasks[0].level == "x0.5" and tasks[0].present_classes_only
        assert len({tuple(env.labels_of(t.ctx.client_id).tolist()) for t in tasks}) > 1
    env.train_x = env.train_x.double()
    state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    alone = [env.train(state, task) for task in tasks]
    together = env.train_together(state, tasks)
    for a, b in zip(alone, together, strict=True):
        assert a.client_id == b.client_id and a.state.keys() == b.state.keys()
        assert a.spec.masks.keys() == b.spec.masks.keys() and all(torch.equal(a.spec.masks[k], b.spec.masks[k]) for k in a.spec.masks)
        assert a.metrics["train_loss"] == pytest.approx(b.metrics["train_loss"], rel=1e-12)
        for key in a.state:
            assert torch.allclose(a.state[key], b.state[key], rtol=0, atol=1e-12), key
        assert b.metrics["measured_peak_bytes"] is None and b.metrics["estimated_peak_bytes"] == a.metrics["estimated_peak_bytes"]
    classifiers = [k for k in together[0].state if k.endswith("fc.weight")]  # the head, an exit's, each base's
    assert classifiers and not any(torch.equal(together[0].state[k], together[1].state[k]) for k in classifiers)


def test_only_objectives_marked_vectorisable_train_together():
    for name, expected in [("fedavg", True), ("fedprox", True), ("depthfl", True), ("heterofl", True), ("fedepth", True), ("scalefl", True), ("nefl", True), ("fjord", False),
                           ("splitmix", True)]:
        env, _, tasks = environment_and_tasks(clients=1, method={"name": name}, model={"name": "preresnet20"})
        assert trains_together(env.method, tasks[0]) is expected, name


def test_batch_clients_runs_match_one_by_one(tmp_path):
    runs = {}
    for size in (1, 3):
        config = small_config(data={"partition": "iid"}, fl={"rounds": 2, "clients": 6, "fraction": 1.0}, backend={"batch_clients": size})
        runs[size] = run_experiment(config, tmp_path / str(size))
    assert runs[3]["final_accuracy"] == pytest.approx(runs[1]["final_accuracy"], abs=0.02)
    assert runs[3]["client_rounds"] == runs[1]["client_rounds"] == 12


@pytest.mark.slow
def test_methods_that_cannot_train_together_run_one_by_one_unchanged(tmp_path):
    runs = {}
    for size in (1, 4):
        config = small_config(method={"name": "fjord"}, model={"name": "preresnet20"}, budgets={"scenario": "fair"},
                              backend={"batch_clients": size})
        run_experiment(config, tmp_path / str(size))
        runs[size] = (tmp_path / str(size) / "summary.json").read_text()
    strip = lambda text: [line for line in text.splitlines() if "seconds" not in line]
    assert strip(runs[1]) == strip(runs[4])


@pytest.mark.slow
def test_training_a_client_with_the_fast_driver_does_not_import_lightning():
    # Lightning costs about a second of import and 250 MiB per Ray actor; only `trainer=lightning`
    # needs it. A fresh interpreter, since this test session may have imported it already.
    script = """
import sys
import hfl.backends.base, hfl.server
from tests.test_client import environment_and_tasks
env, state, tasks = environment_and_tasks(clients=1)
env.train(state, tasks[0])
loaded = [m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "torchmetrics")]
assert not loaded, loaded
"""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_batch_clients_must_be_positive():
    from hfl.errors import ConfigError

    with pytest.raises(ConfigError, match="batch_clients"):
        config_from_dict({"backend": {"batch_clients": 0}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_together_is_training_one_by_one_on_cuda(float64):
    env, state, tasks = environment_and_tasks(model={"name": "preresnet20"}, backend={"device": "cuda"})
    env.train_x = env.train_x.double()
    state = {k: (v.double() if v.is_floating_point() else v).cuda() for k, v in state.items()}
    for a, b in zip([env.train(state, t) for t in tasks], env.train_together(state, tasks), strict=True):
        for key in a.state:
            assert torch.allclose(a.state[key], b.state[key], rtol=0, atol=1e-10), key
        # Each client's share of the clients' peak together: its own weights, gradients, momentum and
        # activations, as alone (vmap's batched kernels may hold a little more at once).
        assert 0.9 <= b.metrics["measured_peak_bytes"] / a.metrics["measured_peak_bytes"] <= 1.5


def test_a_client_round_does_not_depend_on_what_the_process_drew_before():
    # m-FeDepth initialises its peer models from the global generator: seeded by the client-round,
    # they are the same whichever clients this process trained before.
    env, state, tasks = environment_and_tasks(clients=1, method={"name": "mfedepth"}, model={"name": "preresnet20"})
    first = env.train(state, tasks[0])
    torch.rand(1000)
    again = env.train(state, tasks[0])
    for key in first.state:
        assert torch.equal(first.state[key], again.state[key]), key

