"""CAFF: the selection (Eq. 1-3) and the averaging (Eq. 4-5, CoCoFL's form) by hand; member l of a
family loaded and finetuned with its embeddings and untrained blocks bit-identical; bytes up equal to
the trained tensors; every constraint kind kept, where FedAvg at full size breaks each."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hfl.backends.base import ClientEnvironment
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.methods.caff import cocofl_mean, select_depth
from hfl.models.family import weights_path
from hfl.models.gpt import GPT
from hfl.registry import MODELS
from hfl.server import run_experiment
from hfl.submodel.spec import SubmodelSpec
from hfl.types import ClientUpdate
from tests.data.test_tokens import text_config


def made_up_cost(budgets):
    """O(l, t) = l + 2t against each client's budget: the issue's hand example."""
    return lambda depth, client: max((t for t in range(1, depth + 1) if depth + 2 * t <= budgets[client]), default=0)


@pytest.mark.parametrize(("budgets", "depth", "trained"), [((9, 15), 3, (3, 3)), ((9, 21), 6, (1, 6))])
def test_selection_maximises_the_mean_trained_layers_over_feasible_depths(budgets, depth, trained):
    selection = select_depth((3, 6, 9), len(budgets), made_up_cost(budgets))
    assert (selection.depth, selection.trained) == (depth, trained)
    assert selection.mean_trained[9] is None  # 9 + 2 > 9: the first client fits no t


def test_equal_means_go_to_the_larger_depth():
    selection = select_depth((3, 6), 2, made_up_cost((13, 13)))  # l = 3: t = 3, 3; l = 6: t = 3, 3
    assert selection.mean_trained == {3: 3.0, 6: 3.0} and selection.depth == 6


def test_no_feasible_depth_is_a_config_error_naming_the_budgets():
    with pytest.raises(ConfigError, match="budgets"):
        select_depth((3, 6), 2, made_up_cost((4, 20)))


def update(state):
    return ClientUpdate(0, state, 1.0, SubmodelSpec(), {})


def test_averaging_keeps_the_old_weight_for_the_share_of_clients_that_did_not_train_a_block():
    old = {"block": torch.tensor([10.0]), "head": torch.tensor([0.0]), "untouched": torch.tensor([0.1, 0.2])}
    trained = [update({"block": torch.tensor([v]), "head": torch.tensor([1.0])}) for v in (1.0, 2.0, 3.0, 4.0)]
    others = [update({"head": torch.tensor([2.0])}) for _ in range(6)]
    new = cocofl_mean(old, trained + others)
    assert new["block"].item() == pytest.approx(7.0)  # rho = 4/10: 0.4 * 2.5 + 0.6 * 10
    assert new["head"].item() == pytest.approx(1.6)  # every client sent it: the plain mean
    assert torch.equal(new["untouched"], old["untouched"])


def tiny_family(cache, monkeypatch):
    """A family 'fake' of 1-, 2- and 3-block GPTs (embedding 16, 2 heads, context 32), random but
    distinct weights, and `gpt_tiny`, its deepest member's registered model."""
    def gpt_tiny(in_channels, num_classes, width=1.0, norm="bn"):
        return GPT(num_classes, width, norm, dim=16, depth=3, heads=2, context=32)

    monkeypatch.setitem(MODELS._entries, "gpt_tiny", gpt_tiny)
    members = {}
    for depth in (1, 2, 3):
        torch.manual_seed(100 + depth)
        members[depth] = GPT(81, 1.0, "bn", dim=16, depth=depth, heads=2, context=32).state_dict()
        path = weights_path(cache, "fake", depth)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(members[depth], path)
        path.with_suffix(".json").write_text("{}")  # a member is complete with its card
    return members


def caff_config(tmp_path, method="caff", **budgets):
    return text_config(tmp_path, method={"name": method, **({"depths": [1, 2, 3]} if method == "caff" else {})},
                       model={"name": "gpt_tiny", "depth": 0, "width": 1.0, "pretrained": "fake:3"},
                       budgets={"scenario": "tiers", **budgets}, fl={"rounds": 2, "fraction": 1.0})


def test_member_l_is_finetuned_in_its_last_t_blocks_and_sends_exactly_them(tmp_path, monkeypatch):
    members = tiny_family(tmp_path / "cache", monkeypatch)
    probe = ClientEnvironment.from_config(caff_config(tmp_path, memory=["1GB"]))
    costs = {(r["depth"], r["trained"]): r["peak_bytes"] for r in probe.method.ladder.rows(_ctx(probe))}
    # Half the clients fit F_3^1 only, half F_3^3: l = 3 (mean 2) beats l = 2 (mean 1.5) and l = 1 (1).
    weak, strong = costs[(3, 1)], costs[(3, 3)]
    assert costs[(2, 2)] > weak  # so that at l = 2 the weak clients train one block
    config = caff_config(tmp_path, memory=[str(weak), str(strong)])
    env = ClientEnvironment.from_config(config)
    assert env.method.selection.depth == 3 and sorted(set(env.method.selection.trained)) == [1, 3]
    initial = env.method.initial_global_state()
    assert initial.keys() == members[3].keys() and all(torch.equal(initial[k], v) for k, v in members[3].items())

    summary = run_experiment(config, tmp_path / "run")
    final = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["global_state"]
    frozen_for_all = [k for k in initial if k.startswith("stem.")]
    assert frozen_for_all and all(torch.equal(final[k], initial[k]) for k in frozen_for_all)
    assert all(not torch.equal(final[k], initial[k]) for k in initial if k.startswith(("body.0.", "head.fc")))
    assert summary["budget_violations"] == 0
    for record in read_metrics(tmp_path / "run"):
        for client in record["clients"]:
            t = 1 if client["budget_bytes"] == weak else 3
            trained = [k for k in initial if k.startswith("head.") or any(k.startswith(f"body.{b}.") for b in range(3 - t, 3))]
            assert client["bytes_up"] == sum(initial[k].numel() * initial[k].element_size() for k in trained)


def test_a_member_shallower_than_the_configured_model_is_loaded_and_its_frozen_blocks_kept(tmp_path, monkeypatch):
    """Every published CAFF number at l < 12 starts from member l, not from the deepest member's first l blocks."""
    members = tiny_family(tmp_path / "cache", monkeypatch)
    probe = ClientEnvironment.from_config(caff_config(tmp_path, memory=["1GB"]))
    costs = {(r["depth"], r["trained"]): r["peak_bytes"] for r in probe.method.ladder.rows(_ctx(probe))}
    # Room for F_2^1 but not F_3^1: l = 3 is infeasible, l = 2 and l = 1 tie at t = 1 and go to l = 2.
    assert costs[(2, 1)] < costs[(3, 1)]
    config = caff_config(tmp_path, memory=[str(costs[(2, 1)])])
    env = ClientEnvironment.from_config(config)
    assert env.method.selection.depth == 2 and set(env.method.selection.trained) == {1}
    initial = env.method.initial_global_state()
    assert initial.keys() == members[2].keys() and all(torch.equal(initial[k], v) for k, v in members[2].items())
    assert not torch.equal(initial["body.0.attn.q.weight"], members[3]["body.0.attn.q.weight"])

    run_experiment(config, tmp_path / "run")
    final = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["global_state"]
    frozen = [k for k in members[2] if k.startswith(("stem.", "body.0."))]
    assert any(k.startswith("body.0.") for k in frozen) and all(torch.equal(final[k], members[2][k]) for k in frozen)
    assert all(not torch.equal(final[k], members[2][k]) for k in members[2] if k.startswith("body.1."))


def _ctx(env):
    from hfl.budget import round_one

    return round_one(env.config, env, 0)


def test_every_constraint_kind_broken_by_fedavg_is_kept_by_caff(tmp_path, monkeypatch):
    tiny_family(tmp_path / "cache", monkeypatch)
    probe = ClientEnvironment.from_config(caff_config(tmp_path, memory=["1GB"]))
    rows = {(r["depth"], r["trained"]): r for r in probe.method.ladder.rows(_ctx(probe))}
    samples = max(len(p) for p in probe.partitions)
    middle = rows[(3, 2)]
    budgets = {"memory": [str(middle["peak_bytes"])], "upload": [str(middle["upload_bytes"])],
               "flops": [str(middle["train_flops_per_sample"] * samples)]}
    caff = run_experiment(caff_config(tmp_path, **budgets), tmp_path / "caff")
    fedavg = run_experiment(caff_config(tmp_path, method="fedavg", **budgets), tmp_path / "fedavg")
    for kind in ("budget_violations", "upload_violations", "flops_violations"):
        assert fedavg[kind] > 0 and caff[kind] == 0, kind


def test_hfl_budget_shows_every_member_and_trained_count_with_the_chosen_depth(tmp_path, monkeypatch):
    """`hfl budget` prints CAFF's Eq. 1-3 table as its sub-model table: every F_l^t of every configured
    depth, each costed at a full batch, the chosen l marked and named in the title."""
    from hfl.budget import budget_report

    tiny_family(tmp_path / "cache", monkeypatch)
    config = caff_config(tmp_path, memory=["1GB"])
    env = ClientEnvironment.from_config(config)
    report = budget_report(config, env)
    rows = report["levels"]
    assert sorted((r["depth"], r["trained"]) for r in rows) == [(d, t) for d in (1, 2, 3) for t in range(1, d + 1)]
    assert {r["depth"] for r in rows if r["chosen"]} == {env.method.depth} == {3}
    assert report["levels_title"].endswith("chosen l = 3")
    deepest = [r for r in rows if r["depth"] == 3]
    assert all(a["upload_bytes"] < b["upload_bytes"] and a["peak_bytes"] < b["peak_bytes"] for a, b in zip(deepest, deepest[1:]))
