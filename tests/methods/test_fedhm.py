"""FedHM: factors from the SVD of the global weights (exact at full rank, the truncated SVD below
it), factorised updates rebuilt dense and averaged by samples, uploads counted as the factors, ranks
fitted to budgets, and two rounds on the tiny GPT fixture."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from torch import nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.amounts import ClientBudget
from hfl.backends.base import ClientEnvironment
from hfl.config import build_dataclass
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.methods.base import Resources
from hfl.methods.fedhm import FactorisedLinear, FedHM, FedHMConfig
from hfl.methods.transformer import block_linears
from hfl.models.gpt import GPT
from hfl.models.vit import ViT
from hfl.server import initial_state, train_settings
from hfl.submodel.spec import extract, full_spec
from hfl.types import ClientUpdate, RoundContext
from tests.conftest import run_with_env
from tests.data.test_tokens import SEQ, text_config

VOCAB = 11
MODELS = {  # name: (build at a width, one input batch, min(out, in) of every block linear)
    "gpt": (lambda width: GPT(VOCAB, width, dim=16, depth=2, heads=2, context=SEQ), lambda: torch.randint(0, VOCAB, (3, SEQ)), 16),
    "vit": (lambda width: ViT(3, VOCAB, width, patch_size=4, dim=12, depth=2, heads=3, image_size=8), lambda: torch.randn(3, 3, 8, 8), 12),
}
UPLOAD_TIERS = {"scenario": "tiers", "memory": ["width:1/2", "width:1"], "upload": ["width:1/4", "width:1"]}
"""Half the clients may upload what a quarter-width model trains: they fit only factorised levels."""


def fedhm_over(make, **fields) -> FedHM:
    config = build_dataclass(FedHMConfig, {"name": "fedhm", **fields}, "method.")
    accountant = Accountant(build=lambda width, norm=None: make(width), input_shape=(SEQ,), num_classes=VOCAB, input_dtype=torch.int64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return FedHM(config, Resources(model=make(1.0), build=lambda width, norm=None: make(width), accountant=accountant))


def tiny_gpt(width: float = 1.0) -> GPT:
    """Every block linear 2 x 2 but fc1 (3 x 2) and fc2 (2 x 3): matrices to work out by hand."""
    return GPT(VOCAB, width, dim=2, depth=1, heads=1, context=SEQ, mlp_ratio=1.5)


FC1 = "body.0.mlp.fc1"
HAND_W = torch.tensor([[2.0, 2.0], [1.0, -1.0], [0.0, 0.0]])
"""W^T W = [[5, 3], [3, 5]]: sigma_1 = sqrt(8) along v_1 = (1, 1) / sqrt(2), u_1 = W v_1 / sigma_1 = (1, 0, 0);
rank 1 keeps sigma_1 u_1 v_1^T = [[2, 2], [0, 0], [0, 0]]."""


@pytest.mark.parametrize("model", list(MODELS))
def test_full_rank_factors_rebuild_w_and_the_factorised_model_computes_the_dense_one(model):
    make, batch, full_rank = MODELS[model]
    method = fedhm_over(make, ranks=[full_rank])
    state = method.initial_global_state()
    spec = method.ladder[f"r{full_rank}"].spec
    received = method.client_state(state, spec)
    assert len(method.factorised) == 2 * 6  # q, k, v, proj, fc1, fc2 in each of 2 blocks
    for name in method.factorised:
        assert f"{name}.weight" not in received
        torch.testing.assert_close(received[f"{name}.us.weight"] @ received[f"{name}.vt.weight"], state[f"{name}.weight"], rtol=0, atol=1e-6)
        assert torch.equal(received[f"{name}.us.bias"], state[f"{name}.bias"])
    factorised = method.client_model(spec)
    factorised.load_state_dict(received, strict=True)
    assert all(isinstance(factorised.get_submodule(name), FactorisedLinear) for name in method.factorised)
    dense = method.client_model(full_spec())
    dense.load_state_dict(state, strict=True)
    x = batch()
    torch.testing.assert_close(factorised(x), dense(x), rtol=0, atol=1e-5)


def test_rank_one_factors_are_the_truncated_svd_worked_by_hand():
    method = fedhm_over(tiny_gpt, ranks=[1, 2])
    state = method.initial_global_state()
    state[f"{FC1}.weight"] = HAND_W
    received = method.client_state(state, method.ladder["r1"].spec)
    us, vt = received[f"{FC1}.us.weight"], received[f"{FC1}.vt.weight"]
    # The sign of a singular pair is the SVD's choice: the magnitudes and the product are not.
    torch.testing.assert_close(us.abs(), torch.tensor([[math.sqrt(8)], [0.0], [0.0]]))
    torch.testing.assert_close(vt.abs(), torch.tensor([[1.0, 1.0]]) / math.sqrt(2))
    torch.testing.assert_close(us @ vt, torch.tensor([[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]))
    u, s, v_t = torch.linalg.svd(HAND_W.double())  # the same decomposition, signs included
    assert torch.equal(us, (u[:, :1] * s[:1]).float()) and torch.equal(vt, v_t[:1].float())


def test_an_untrained_factorised_update_rebuilds_the_rank_z_approximation_of_w():
    method = fedhm_over(tiny_gpt, ranks=[1, 2])
    state = method.initial_global_state()
    state[f"{FC1}.weight"] = HAND_W
    spec = method.ladder["r1"].spec
    received = method.client_state(state, spec)
    sent = {k: v for k, v in received.items() if k not in spec.frozen}
    new, _ = method.aggregate(state, [ClientUpdate(0, sent, 5.0, spec, {}, "r1")], method.init_state())
    torch.testing.assert_close(new[f"{FC1}.weight"], torch.tensor([[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]))
    for name in method.factorised:
        u, s, v_t = torch.linalg.svd(state[f"{name}.weight"].double())
        torch.testing.assert_close(new[f"{name}.weight"], (s[0] * torch.outer(u[:, 0], v_t[0])).float())
        assert torch.equal(new[f"{name}.bias"], state[f"{name}.bias"])
    assert all(torch.equal(new[k], state[k]) for k in spec.frozen)  # the embeddings: frozen, not sent


def test_a_dense_and_a_factorised_update_average_by_samples():
    """Dense client (10 samples) sends W_d = ones; the rank-1 client (30 samples) sends us = (1, 2, 0),
    vt = (3, 1): W_f = [[3, 1], [6, 2], [0, 0]]; the mean is W_d / 4 + 3 W_f / 4. Biases likewise."""
    method = fedhm_over(tiny_gpt, ranks=[1, 2], train_dense=True)
    state = method.initial_global_state()
    dense_spec, rank_spec = method.ladder["dense"].spec, method.ladder["r1"].spec
    dense = {k: v for k, v in extract(state, dense_spec).items() if k not in dense_spec.frozen}
    dense[f"{FC1}.weight"], dense[f"{FC1}.bias"] = torch.ones(3, 2), torch.tensor([4.0, 4.0, 4.0])
    factorised = {k: v for k, v in method.client_state(state, rank_spec).items() if k not in rank_spec.frozen}
    factorised[f"{FC1}.us.weight"], factorised[f"{FC1}.vt.weight"] = torch.tensor([[1.0], [2.0], [0.0]]), torch.tensor([[3.0, 1.0]])
    factorised[f"{FC1}.us.bias"] = torch.tensor([0.0, 8.0, 4.0])
    updates = [ClientUpdate(0, dense, 10.0, dense_spec, {}, "dense"), ClientUpdate(1, factorised, 30.0, rank_spec, {}, "r1")]
    new, _ = method.aggregate(state, updates, method.init_state())
    assert torch.equal(new[f"{FC1}.weight"], torch.tensor([[2.5, 1.0], [4.75, 1.75], [0.25, 0.25]]))
    assert torch.equal(new[f"{FC1}.bias"], torch.tensor([1.0, 7.0, 4.0]))


def test_tighter_memory_flops_or_upload_budgets_give_smaller_ranks(tmp_path):
    """A level's own memory, FLOPs or upload as the budget gives that level; one byte (or FLOP) less
    the next smaller one, and below r3 nothing."""
    env = ClientEnvironment.from_config(text_config(tmp_path, method={"name": "fedhm", "train_dense": True}, fl={"clients": 4, "fraction": 1.0}))
    method, ladder = env.method, env.method.ladder
    settings = train_settings(env.config.fl, 1)
    samples = len(env.partitions[0])

    def level_for(**limits):
        ctx = RoundContext(1, 0, 0, samples, settings, ClientBudget("t", limits.get("memory"), limits.get("flops"), limits.get("upload")))
        task = method.plan(ctx, method.init_state())
        return None if task is None else task.level

    rows = ladder.rows(RoundContext(1, 0, 0, samples, settings))  # `hfl budget`'s table
    assert [r["rank"] for r in rows] == [3, 6, 12, 24, 48, None]
    assert all(a["upload_bytes"] < b["upload_bytes"] and a["flops"] < b["flops"] for a, b in pairwise(rows[:-1]))
    for level, smaller in (("r3", None), ("r12", "r6")):
        task = ladder.task_for(RoundContext(1, 0, 0, samples, settings), ladder[level])
        cost = method.training_cost(task, min(settings.batch_size, samples))
        limits = {"memory": cost.peak_bytes, "flops": cost.train_flops_per_sample * samples, "upload": method.upload_bytes(task.spec)}
        for kind, limit in limits.items():
            assert level_for(**{kind: limit}) == level, (kind, level)
            assert level_for(**{kind: limit - 1}) == smaller, (kind, level)
    assert level_for() == "dense"  # no budget: the dense model


def test_two_rounds_train_factorised_and_dense_clients_within_budgets_uploading_what_they_trained(tmp_path, monkeypatch):
    """On the tiny GPT fixture with half the clients short of upload: they train rank-12 factors, the
    others the dense model; nothing exceeds a budget, the dense global model is scored, the frozen
    embeddings come back untouched, and each client's bytes_up is exactly the tensors it trained."""
    config = text_config(tmp_path, method={"name": "fedhm", "train_dense": True}, budgets=UPLOAD_TIERS, fl={"rounds": 2, "clients": 4, "fraction": 1.0})
    summary, env, final = run_with_env(config, tmp_path / "run", monkeypatch)
    method, start = env.method, initial_state(config, env).global_state
    assert summary["client_rounds"] == 8 and summary["budget_violations"] == summary["flops_violations"] == summary["upload_violations"] == 0
    assert 0 < summary["final_accuracy"] < 1 and summary["final_perplexity"] > 1 and set(summary["submodel_accuracy"]) == {"r12", "dense"}
    assert method.global_model_spec(final["method_state"]).variant == ()  # scored dense
    assert {"stem.tokens.weight", "stem.positions.weight"} == method.frozen
    assert all(torch.equal(final["global_state"][k], start[k]) for k in method.frozen)
    assert all(not torch.equal(final["global_state"][f"{n}.weight"], start[f"{n}.weight"]) for n in method.factorised)
    model = method.model
    linears = block_linears(model).values()
    dense_linears = sum(m.weight.numel() + m.bias.numel() for m in linears)
    others = sum(v.numel() for k, v in start.items() if k not in method.frozen) - dense_linears  # LayerNorms and the head
    ranks = []
    for record in read_metrics(tmp_path / "run"):
        for client in record["clients"]:
            rank = client["submodel"].get("rank")
            ranks.append(rank)
            trained = dense_linears if rank is None else sum(rank * (m.in_features + m.out_features) + m.out_features for m in linears)
            assert client["bytes_up"] == 4 * (trained + others), rank
    assert Counter(ranks) == {12: 4, None: 4}


def test_a_factorised_client_trained_vectorised_receives_and_sends_what_it_does_alone(tmp_path):
    """`train_clients_together` loads `client_state` too: in float64, the same factors come back as
    from `train_client` (to the order batched kernels sum in)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        config = text_config(tmp_path, method={"name": "fedhm", "ranks": [12]}, fl={"clients": 4, "local_epochs": 1})
        env = ClientEnvironment.from_config(config)
        state = {k: v.double() for k, v in initial_state(config, env).global_state.items()}
        ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1))
        task = env.method.ladder.task_for(ctx, env.method.ladder["r12"])
        alone, (together,) = env.train(state, task), env.train_together(state, [task])
    finally:
        torch.set_default_dtype(previous)
    assert f"{FC1}.us.weight" in together.state and alone.state.keys() == together.state.keys()
    for key in alone.state:
        torch.testing.assert_close(together.state[key], alone.state[key], rtol=0, atol=1e-12)


def test_config_refuses_bad_ranks_and_a_model_too_narrow_for_them():
    for ranks in ([], [0, 2], [2, 2], [1.5]):
        with pytest.raises(ConfigError, match="ranks"):
            FedHMConfig(ranks=tuple(ranks))
    with pytest.raises(ConfigError, match="freeze_embeddings"):
        FedHMConfig(freeze_embeddings="yes")
    with pytest.raises(ConfigError, match=r"method\.ranks=\[1, 3\].*at most 2"):
        fedhm_over(tiny_gpt, ranks=[1, 3])


def test_without_freezing_the_embeddings_every_client_trains_them():
    method = fedhm_over(tiny_gpt, ranks=[1], freeze_embeddings=False)
    assert all(level.spec.frozen == frozenset() for level in method.ladder.levels)
    assert fedhm_over(tiny_gpt, ranks=[1]).ladder["r1"].spec.frozen == {"stem.tokens.weight", "stem.positions.weight"}


def test_levels_of_different_ranks_are_different_shapes():
    method = fedhm_over(tiny_gpt, ranks=[1, 2], train_dense=True)
    shapes = {level.spec.shape for level in method.ladder.levels}
    assert len(shapes) == 3 and replace(method.ladder["dense"].spec, frozen=frozenset()).shape == full_spec().shape
    assert isinstance(method.client_model(method.ladder["dense"].spec).get_submodule(FC1), nn.Linear)


def test_by_default_every_client_trains_factors_even_one_that_could_train_the_dense_model(tmp_path):
    """The paper's FedHM (CAFF, Table 2: never marked as degrading to FedAvg): without budgets, or
    with budgets the dense model fits, a client trains the largest rank's factors; the dense model is
    only a level with `train_dense`."""
    env = ClientEnvironment.from_config(text_config(tmp_path, method={"name": "fedhm"}, fl={"clients": 4, "fraction": 1.0}))
    method = env.method
    assert [level.name for level in method.ladder.levels] == ["r3", "r6", "r12", "r24", "r48"]
    ctx = RoundContext(1, 0, 0, len(env.partitions[0]), train_settings(env.config.fl, 1))
    assert method.plan(ctx, method.init_state()).level == "r48"
