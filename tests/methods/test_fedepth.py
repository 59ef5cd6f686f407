"""FeDepth and m-FeDepth: the decomposition, depth-wise sequential training, partial training, the
mutual-distillation loss, and budgets kept in every scenario."""

import functools

import pytest
import torch
import torch.nn.functional as F

from hfl.accounting.cost import tensor_bytes
from hfl.experiment import ClientEnvironment
from hfl.losses import mutual_learning_loss
from hfl.models.shortcut import skip_to_head
from hfl.server import initial_state, run_experiment, train_settings
from hfl.submodel.scaling import decompose
from hfl.submodel.spec import full_spec
from hfl.types import RoundContext
from tests.conftest import small_config

pytestmark = pytest.mark.xdist_group("tests/methods/test_fedepth.py")  # one worker builds each measured environment once

GB = 10**9


FIGURE_3 = [3 * GB, 2 * GB, 1 * GB, GB // 2, GB // 2, GB // 2]


def additive(budget):
    """Figure 3's reading: a group costs the sum of its blocks' memories."""
    return lambda group: sum(FIGURE_3[group[0] : group[1] + 1]) <= budget


def test_figure_3_decomposition():
    assert decompose(6, additive(3 * GB)) == ([(0, 0), (1, 2), (3, 5)], [])
    assert decompose(6, additive(5 * GB)) == ([(0, 1), (2, 5)], [])


def test_blocks_too_large_alone_are_skipped():
    assert decompose(6, additive(int(2.5 * GB))) == ([(1, 1), (2, 5)], [0])
    assert decompose(6, additive(GB // 4)) == ([], [0, 1, 2, 3, 4, 5])


@pytest.mark.slow
def test_groups_are_costed_whole_not_as_sums_of_blocks():
    """A group's measured memory counts what its blocks share once: packing by it gives fewer,
    larger groups than summing single-block costs (the top tier trains the whole model in one
    group, as in the paper), and every group of every tier still fits."""
    config, env, tasks = env_and_tasks("fedepth", "fair")
    cost = lambda group: env.method.stage_cost(group, 1, config.fl.batch_size).peak_bytes
    for ctx, task in tasks.values():
        assert all(cost(g) <= ctx.budget.memory_bytes for g in task.options.groups), ctx.budget.tier
    assert tasks["w1"][1].options.groups == ((0, 8),)
    groups = tasks["w1_2"][1].options.groups
    first, last = next(g for g in groups if g[1] > g[0])
    single = env.method.stage_cost((first, first), 1, config.fl.batch_size)
    fixed = single.param_bytes + single.input_bytes
    assert cost((first, last)) < fixed + sum(cost((b, b)) - fixed for b in range(first, last + 1))


@pytest.mark.parametrize("scenario", ["fair", "lack"])
def test_paper_grouping_gives_each_tier_the_authors_groups(scenario):
    """`method.grouping=paper`: 6 / 3 / 2 / 1 groups for the 1/6, 1/3, 1/2, 1 tiers, every block
    trained (fair); under lack the 1/8 tier skips blocks 1-3, whatever the budgets would allow."""
    _config, _env, tasks = env_and_tasks("fedepth", scenario, grouping="paper")
    layouts = {tier: (task.options.groups, task.options.skipped) for tier, (_ctx, task) in tasks.items()}
    expected = {"w1_6": (((0, 0), (1, 1), (2, 2), (3, 3), (4, 5), (6, 8)), ()), "w1_2": (((0, 2), (3, 8)), ()),
                "w1": (((0, 8),), ())}
    expected |= {"w1_3": (((0, 1), (2, 3), (4, 8)), ())} if scenario == "fair" else {
        "w1_8": (((3, 3), (4, 4), (5, 5), (6, 7), (8, 8)), (0, 1, 2))}
    assert layouts == expected


def test_paper_grouping_refuses_models_and_budgets_it_has_no_groups_for():
    from hfl.errors import ConfigError

    with pytest.raises(ConfigError, match="method.grouping.*9 blocks"):
        ClientEnvironment.from_config(small_config(method={"name": "fedepth", "grouping": "paper"}, model={"name": "resnet18"},
                                                   budgets={"scenario": "fair"}))
    with pytest.raises(ConfigError, match="method.grouping.*budgets.scenario"):
        ClientEnvironment.from_config(small_config(method={"name": "fedepth", "grouping": "paper"}, model={"name": "preresnet20"}))


def test_skip_connection_subsamples_and_pads_to_the_head_shape():
    h = torch.randn(2, 16, 32, 32)
    out = skip_to_head(h, (64, 8, 8))
    assert out.shape == (2, 64, 8, 8)
    assert torch.equal(out[:, :16], h[:, :, ::4, ::4]) and not out[:, 16:].any()
    assert skip_to_head(h, (16, 32, 32)) is h


def test_mutual_learning_loss_of_a_hand_made_pair():
    a = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    b = torch.tensor([[1.0, 1.0, 0.0], [-0.5, 0.0, 2.0]])
    y = torch.tensor([0, 2])

    def kl(p_logits, q_logits):  # KL(p || q), batch mean
        p, q = p_logits.softmax(1), q_logits.softmax(1)
        return float((p * (p.log() - q.log())).sum(1).mean())

    ce = (float(F.cross_entropy(a, y)) + float(F.cross_entropy(b, y))) / 2
    terms = mutual_learning_loss([a, b], y)
    # M = 2: 1/(M-1) = 1, and each model learns from the other's prediction.
    assert float(terms["loss"]) == pytest.approx(ce + kl(b, a) + kl(a, b), rel=1e-5)
    assert float(mutual_learning_loss([a], y)["loss"]) == pytest.approx(float(F.cross_entropy(a, y)))


def env_and_tasks(method, scenario, **options):
    """PreResNet-20 on 32x32 inputs at batch 128 (FeDepth's Table 1), where activations, not weights,
    dominate training memory (on digits' 8x8 the whole model's weights exceed the narrow tiers'
    budgets: nothing fits them). Built once per argument list (a few seconds of measuring each): the
    tests read them, and patch only with monkeypatch."""
    return _measured_env(method, scenario, tuple(sorted(options.items())))


@functools.cache
def _measured_env(method, scenario, options):
    options = dict(options)
    config = small_config(method={"name": method, **options}, model={"name": "preresnet20"}, budgets={"scenario": scenario},
                          data={"name": "synthetic"}, fl={"batch_size": 128})
    env = ClientEnvironment.from_config(config)
    settings = train_settings(config.fl, 1)
    tasks = {}
    for client, budget in enumerate(env.budgets):
        ctx = RoundContext(1, client, config.seed, len(env.partitions[client]), settings, budget)
        tasks.setdefault(budget.tier, (ctx, env.method.plan(ctx, {})))
    return config, env, tasks


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedepth", "mfedepth"])
@pytest.mark.parametrize("scenario", ["fair", "lack", "surplus"])
def test_estimated_peak_fits_every_budget_where_the_full_model_does_not(method, scenario):
    config, env, tasks = env_and_tasks(method, scenario)
    full_model_too_big = sitting_out = 0
    for ctx, task in tasks.values():
        batch = min(config.fl.batch_size, ctx.num_samples)
        if task is None:  # only where not even one block, trained alone, fits
            assert all(env.method.stage_cost((b, b), 1, batch).peak_bytes > ctx.budget.memory_bytes for b in range(9))
            sitting_out += 1
            continue
        assert env.method.training_cost(task, batch).peak_bytes <= ctx.budget.memory_bytes
        full_model_too_big += env.accountant.plain_cost(1.0, batch).peak_bytes > ctx.budget.memory_bytes
    assert full_model_too_big >= 2 - sitting_out and sitting_out <= 1  # the narrow tiers could not train the whole model at once


@pytest.mark.slow
def test_lack_tier_skips_the_input_blocks_and_leaves_them_untouched():
    config, env, tasks = env_and_tasks("fedepth", "lack")
    _ctx, task = tasks["w1_6"]
    skipped = task.options.skipped
    assert skipped and skipped[0] == 0 and list(skipped) == list(range(len(skipped)))  # the input side
    start = initial_state(config, env).global_state
    update = env.train(start, task)
    skipped_keys = {k for k in start if k.startswith("stem.") or any(k.startswith(f"body.{b}.") for b in skipped)}
    assert skipped_keys and not skipped_keys & set(update.state)  # never sent back
    new, _ = env.method.aggregate(start, [update], env.method.init_state())
    for key in skipped_keys:
        assert torch.equal(new[key], start[key]), key
    trained = f"body.{task.options.groups[0][0]}.conv1.weight"
    assert not torch.equal(new[trained], start[trained])


@pytest.mark.slow
def test_each_group_starts_from_the_head_the_previous_group_trained(monkeypatch):
    config, env, tasks = env_and_tasks("fedepth", "fair")
    _ctx, task = tasks["w1_3"]
    assert len(task.options.groups) >= 2
    method = env.method
    seen: list[tuple[int, torch.Tensor]] = []
    original = method.objective

    def spy(client, x, y):
        seen.append((client.stage, client.model.head.fc.weight.detach().clone()))
        trainable = {n for n, p in client.model.named_parameters() if p.requires_grad}
        assert trainable == method.stage_parameters(client.model, task.options.groups[client.stage])
        return original(client, x, y)

    monkeypatch.setattr(method, "objective", spy)
    start = initial_state(config, env).global_state
    env.train(start, task)
    stages = [s for s, _ in seen]
    assert stages == sorted(stages) and set(stages) == set(range(len(task.options.groups)))
    first_of_stage_1 = next(i for i, (s, _) in enumerate(seen) if s == 1)
    assert torch.equal(seen[0][1], start["head.fc.weight"])
    assert not torch.equal(seen[first_of_stage_1][1], start["head.fc.weight"])  # carried over, not reset


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "distilling"), [("fair", set()), ("surplus", {"w2"})])
def test_m_fedepth_trains_peers_on_surplus_memory_only_with_fedepths_own_groups(scenario, distilling):
    """The paper's Surplus scenario: "1/4 of clients with sufficient memory can apply MKD", the
    tier at twice the whole model's memory; a tier whose memory holds two models only in finer
    groups trains one, in FeDepth's groups."""
    _, _, single = env_and_tasks("fedepth", scenario)
    _, _, multi = env_and_tasks("mfedepth", scenario)
    assert {tier: task.options.groups for tier, (_, task) in multi.items()} == {tier: task.options.groups for tier, (_, task) in single.items()}
    assert {tier for tier, (_, task) in multi.items() if task.options.models > 1} == distilling


@pytest.mark.slow
def test_surplus_clients_train_peers_and_upload_one_model(monkeypatch):
    """The w2 tier trains a peer beside its model: the peer exists, its weights move, its logits
    enter the loss (the distillation term), and only the model that started from the global
    weights goes up."""
    config, env, tasks = env_and_tasks("mfedepth", "surplus")
    _ctx, task = tasks["w2"]
    assert task.options.models >= 2 and task.peers == task.options.models - 1
    method = env.method
    seen = {}
    original = method.objective

    def spy(client, x, y):
        if not seen:
            seen["client"] = client
            seen["peers_start"] = [{n: p.detach().clone() for n, p in peer.named_parameters()} for peer in client.peers]
        terms = original(client, x, y)
        seen.setdefault("distillation", []).append(float(terms.get("distillation", 0.0)))
        return terms

    monkeypatch.setattr(method, "objective", spy)
    start = initial_state(config, env).global_state
    update = env.train(start, task)
    client = seen["client"]
    assert len(client.peers) == task.peers >= 1
    for peer, before in zip(client.peers, seen["peers_start"]):
        assert any(not torch.equal(p, before[n]) for n, p in peer.named_parameters())  # trained
        # a fresh initialisation, not a copy of the global model
        assert not torch.equal(peer.state_dict()["head.fc.weight"], start["head.fc.weight"])
    assert min(seen["distillation"]) > 0  # the peer's predictions are in the model's loss
    assert set(update.state) == set(start)  # one model's worth, the whole model
    assert update.metrics["bytes_up"] == update.metrics["bytes_down"]
    model = client.model.state_dict()
    for key, tensor in update.state.items():
        assert torch.equal(tensor, model[key]), key  # the model that started from the global weights
    assert not torch.equal(update.state["head.fc.weight"], client.peers[0].state_dict()["head.fc.weight"])


@pytest.mark.slow
def test_auxiliary_classifiers_variant_trains_the_exit_after_each_group(tmp_path):
    config = small_config(method={"name": "fedepth", "connector": "auxiliary"}, model={"name": "preresnet20"},
                          budgets={"scenario": "fair"}, data={"name": "synthetic", "partition": "iid"},
                          fl={"rounds": 1, "clients": 12, "fraction": 1 / 3, "batch_size": 128})  # 4 clients of a batch each
    env = ClientEnvironment.from_config(config)
    budget = next(b for b in env.budgets if b.tier == "w1_3")
    ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1), budget)
    task = env.method.plan(ctx, {})
    ends = {last for _, last in task.options.groups}
    exits = {int(k.split(".")[1]) for k in env.method.model.state_dict() if k.startswith("exits.")}
    held = {int(k.split(".")[1]) for k in env.method.model.state_dict() if k.startswith("exits.") and k not in task.spec.frozen}
    assert held == ends - {max(exits) + 1} and held < exits
    summary = run_experiment(config, tmp_path)
    assert summary["budget_violations"] == 0 and summary["client_rounds"] == 4


@pytest.mark.slow
def test_without_budgets_fedepth_is_fedavg(tmp_path):
    fedavg = run_experiment(small_config(model={"name": "preresnet20"}), tmp_path / "fedavg")
    fedepth = run_experiment(small_config(method={"name": "fedepth"}, model={"name": "preresnet20"}), tmp_path / "fedepth")
    assert fedepth["final_accuracy"] == fedavg["final_accuracy"]
    assert fedepth["final_loss"] == fedavg["final_loss"]


def train_budgeted_clients_on_cuda(scenario: str, precision: str) -> tuple[int, list[str], list[tuple[str, float]]]:
    """FeDepth's clients of round 1 under `scenario`'s budgets on CUDA with cuDNN (`backend.cudnn=auto`), each under
    the allocator's cap of its budget: how many trained, the tiers that failed, and (tier, measured / budget) over 1."""
    config = small_config(method={"name": "fedepth"}, model={"name": "preresnet20"}, budgets={"scenario": scenario},
                          data={"name": "synthetic"}, backend={"device": "cuda"}, fl={"batch_size": 64, "precision": precision})
    env = ClientEnvironment.from_config(config)
    start = {k: v.cuda() for k, v in initial_state(config, env).global_state.items()}
    settings = train_settings(config.fl, 1)
    trained, failed, over = 0, [], []
    for client, budget in enumerate(env.budgets):
        ctx = RoundContext(1, client, config.seed, len(env.partitions[client]), settings, budget)
        task = env.method.plan(ctx, {})
        if task is None:  # a tier none of whose blocks fits sits out
            continue
        try:
            update = env.train(start, task)
        except torch.OutOfMemoryError:
            failed.append(budget.tier)
            continue
        trained += 1
        if update.metrics["measured_peak_bytes"] > budget.memory_bytes:
            over.append((budget.tier, round(update.metrics["measured_peak_bytes"] / budget.memory_bytes, 3)))
    return trained, failed, over


CUDA_BUDGET_CASES = [("fair", "32-true"), ("lack", "32-true"), ("fair", "bf16-mixed")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("scenario", "precision"), CUDA_BUDGET_CASES)
def test_clients_that_fit_by_the_estimate_train_under_the_cuda_cap(scenario, precision):
    trained, failed, _ = train_budgeted_clients_on_cuda(scenario, precision)
    assert failed == []
    assert trained >= 2


# The allocator caps reserved memory, so a client can fill free parts of pages the process already held: on an H200
# the 1/6 tier measured 1.174x its budget in float32 (benchmarks/RESULTS.md, fifth lease). Strict: passing means fixed.
OVER_ON_H200 = pytest.mark.xfail(strict=True, reason="cap on reserved memory; measured 1.174x the 1/6 tier's budget on an H200")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("scenario", "precision"), [pytest.param(*case, marks=OVER_ON_H200) if case[1] == "32-true" else case
                                                     for case in CUDA_BUDGET_CASES])
def test_measured_cuda_peak_stays_within_the_budget(scenario, precision):
    _, _, over = train_budgeted_clients_on_cuda(scenario, precision)
    assert over == [], "(tier, measured / budget)"


@pytest.mark.slow
def test_budget_command_shows_each_tiers_decomposition(tmp_path, capsys):
    import json

    from hfl.cli import main
    from tests.conftest import QUICKSTART

    out = tmp_path / "budget.json"
    assert main(["budget", str(QUICKSTART), "method.name=fedepth", "model.name=preresnet20", "data.name=synthetic",
                 "budgets.scenario=lack", "fl.batch_size=128", "--json", str(out)]) == 0
    assert "What a client of each tier trains (fedepth" in capsys.readouterr().out
    plans = {p["tier"]: p for p in json.loads(out.read_text())["plans"]}
    assert set(plans) == {"w1_8", "w1_6", "w1_2", "w1"}
    assert "skips 1" in plans["w1_8"]["plan"] and "skips" not in plans["w1"]["plan"]
    assert all(p["peak_bytes"] <= p["budget_bytes"] for p in plans.values())


def test_upload_bytes_count_the_whole_model_after_the_head_shapes_are_cached():
    """FeDepth caches its blocks' output shapes under a name of its own: sharing the name of
    Method's cache of the global state's shapes, `upload_bytes` read the block shapes as the model."""
    env = ClientEnvironment.from_config(small_config(method={"name": "fedepth"}))
    method = env.method
    method.head_input_shape(env.accountant.input_shape, env.accountant.input_dtype)

    assert method.upload_bytes(full_spec()) == tensor_bytes(method.initial_global_state()) > 0


@pytest.mark.slow
def test_under_lack_the_eighth_tier_sits_out_and_paper_grouping_breaks_its_budget():
    """docs/methods.md's deviation, asserted: under `lack` the 1/8 tier (25.0 MiB) fits no block, so its
    clients (one of four tiers) sit out, where the paper trains blocks 4-9; `grouping=paper` gives it the
    authors' groups 4 | 5 | 6 | 7-8 | 9 at an estimated 42.7 MiB, a budget it breaks."""
    config, env, tasks = env_and_tasks("fedepth", "lack")
    ctx, task = tasks["w1_8"]
    mib = 2**20
    assert round(ctx.budget.memory_bytes / mib, 1) == 25.0 and task is None
    assert all(env.method.stage_cost((b, b), 1, config.fl.batch_size).peak_bytes > ctx.budget.memory_bytes for b in range(9))
    assert sorted({b.tier for b in env.budgets}) == ["w1", "w1_2", "w1_6", "w1_8"]  # one of lack's four tiers
    _config, paper_env, paper_tasks = env_and_tasks("fedepth", "lack", grouping="paper")
    paper_ctx, paper_task = paper_tasks["w1_8"]
    assert paper_task.options.groups == ((3, 3), (4, 4), (5, 5), (6, 7), (8, 8)) and paper_task.options.skipped == (0, 1, 2)
    peak = paper_env.method.training_cost(paper_task, config.fl.batch_size).peak_bytes
    assert round(peak / mib, 1) == 42.7 and peak > paper_ctx.budget.memory_bytes
