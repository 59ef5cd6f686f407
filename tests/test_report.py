"""`hfl report` compares finished runs in a Markdown table and two PNG plots."""

import pytest

from hfl.cli import main
from hfl.errors import ConfigError
from hfl.report import write_report
from hfl.server import run_experiment
from tests.conftest import small_config

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_compares_runs(tmp_path, capsys):
    run_experiment(small_config(budgets={"scenario": "fair"}, fl={"rounds": 2}), tmp_path / "avg")
    run_experiment(small_config(method={"name": "fedprox", "mu": 0.1}, model={"width": 0.5}, fl={"rounds": 2}), tmp_path / "prox")
    assert main(["report", str(tmp_path / "avg"), str(tmp_path / "prox"), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| avg", "| prox"))]
    assert len(rows) == 2
    assert "| fedavg | digits | dirichlet α=0.5 | fair | 2 | completed |" in rows[0] and "| fedprox |" in rows[1]
    for name in ("accuracy_by_round.png", "accuracy_by_memory.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:8] == PNG
    assert "fedprox" in capsys.readouterr().out


def test_report_refuses_a_folder_that_is_not_a_finished_run(tmp_path):
    with pytest.raises(ConfigError, match="finished hfl run"):
        write_report([str(tmp_path)], tmp_path / "rep")


def test_runs_whose_labels_would_overlap_share_one_stacked_label():
    from hfl.report import shared_labels

    # HeteroFL and FedRolex under fair on digits: the same memory, accuracies 0.012 apart
    points = [(4.2119, 0.513, "heterofl"), (4.2119, 0.525, "fedrolex"), (4.2119, 0.525, "decoupled"), (4.2173, 0.802, "fedavg")]
    assert shared_labels(points) == [(4.2119, 0.525, ["decoupled", "fedrolex", "heterofl"]), (4.2173, 0.802, ["fedavg"])]
    assert shared_labels([(1.0, 0.5, "a"), (9.0, 0.5, "b")]) == [(1.0, 0.5, ["a"]), (9.0, 0.5, ["b"])]  # far apart: one each


def test_a_label_names_the_method_only_where_the_folder_does_not(tmp_path):
    from pathlib import Path

    from hfl.report import RunRecord

    def label(folder):
        return RunRecord(Path(folder), {"method": {"name": "heterofl"}}, {}, []).label

    assert label("runs/heterofl") == "heterofl"
    assert label("runs/heterofl-20261123") == "heterofl-20261123"
    assert label("runs/baseline") == "baseline (heterofl)"


def fake_run(folder, seed, final, method="heterofl", alpha=1.0, worst=None):
    """A finished run's three files, as `hfl run` writes them, with the numbers given."""
    import json

    import yaml

    from hfl.server import SUMMARY

    folder.mkdir(parents=True)
    config = {"name": "x", "seed": seed, "method": {"name": method}, "data": {"name": "digits", "partition": "dirichlet", "alpha": alpha}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    summary = {"final_accuracy": final, "best_accuracy": final} | ({"worst_submodel_accuracy": worst} if worst is not None else {})
    (folder / SUMMARY).write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy": final}) + "\n")
    return folder


def test_runs_that_differ_only_in_seed_are_reported_as_mean_and_std(tmp_path):
    runs = [fake_run(tmp_path / f"heterofl-seed{s}", s, acc, worst=acc - 0.1) for s, acc in ((0, 0.5), (1, 0.6), (2, 0.7))]
    runs += [fake_run(tmp_path / "heterofl-a100-seed0", 0, 0.9, alpha=100.0), fake_run(tmp_path / "fedavg-seed0", 0, 0.4, method="fedavg")]
    text = write_report([str(r) for r in runs], tmp_path / "rep").read_text()
    seeds_table = text[text.index("Mean ± standard deviation"):text.index("## Every run")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in seeds_table.splitlines() if line.startswith("| ")][1:]
    # the sample standard deviation of 0.5, 0.6, 0.7 is 0.1; other configs stay rows of their own
    assert [r[:4] for r in rows] == [["heterofl", "heterofl", "0, 1, 2", "0.6000 ± 0.1000"],
                                    ["heterofl-a100", "heterofl", "0", "0.9000"], ["fedavg", "fedavg", "0", "0.4000"]]
    assert rows[0][5] == "0.5000 ± 0.1000" and rows[2][5] == "-"  # worst sub-model
    assert text.count("| heterofl-seed") == 3  # every run is still listed


def test_report_of_single_seed_runs_has_no_seed_table(tmp_path):
    runs = [fake_run(tmp_path / "a", 0, 0.5), fake_run(tmp_path / "b", 0, 0.6, method="fedavg")]
    assert "Mean ±" not in write_report([str(r) for r in runs], tmp_path / "rep").read_text()


def test_a_sweeps_trials_are_reported_with_their_swept_values(tmp_path):
    import yaml

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.yaml").write_text(yaml.safe_dump({"space": {"fl.lr": {"loguniform": [0.01, 0.3]}, "method.name": {"grid": ["heterofl", "fedavg"]}}}))
    for trial, lr, method, acc in (("ab_00000", 0.0123456, "heterofl", 0.5), ("ab_00001", 0.2, "fedavg", 0.6)):
        folder = fake_run(sweep / "trials" / trial, 0, acc, method=method)
        config = yaml.safe_load((folder / "config.yaml").read_text())
        (folder / "config.yaml").write_text(yaml.safe_dump({**config, "fl": {"lr": lr}}))
    text = write_report([str(sweep)], tmp_path / "rep").read_text()  # the sweep folder stands for its trials
    table = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    assert table[0][:4] == ["run", "fl.lr", "method.name", "method"]
    assert [r[:4] for r in table[1:]] == [["ab_00000", "0.0123", "heterofl", "heterofl"], ["ab_00001", "0.2", "fedavg", "fedavg"]]
    # a single run folder of a sweep too, and its plot label says what the trial id does not
    from hfl.report import load_run

    assert load_run(sweep / "trials" / "ab_00000").label == "ab_00000 lr=0.0123 name=heterofl"
    assert "fl.lr" not in write_report([str(fake_run(tmp_path / "plain", 0, 0.5))], tmp_path / "rep2").read_text()


def test_memory_is_reported_per_budget_tier(tmp_path):
    from hfl.report import load_run, memory_points

    run_experiment(small_config(method={"name": "heterofl", "widths": [1.0, 0.5]}, fl={"rounds": 2},
                                budgets={"scenario": "tiers", "memory": ["width:1/2", "width:1"], "shares": [0.5, 0.5]}), tmp_path / "het")
    run = load_run(tmp_path / "het")
    tiers = run.summary["tiers"]
    (small, small_accuracy, small_tier), (large, large_accuracy, large_tier) = memory_points(run)
    assert (small_tier, large_tier) == ("w1_2", "w1")
    assert [small, large] == sorted(t["mean_estimated_peak_bytes"] / 2**20 for t in tiers.values())
    assert small < large == run.summary["max_estimated_peak_bytes"] / 2**20  # the small tier shows
    # each tier at the accuracy of the width its clients trained, not the global model's
    assert {c["level"] for r in run.rounds for c in r["clients"] if c["tier"] == "w1_2"} == {"x0.5"}
    assert small_accuracy == run.summary["submodel_accuracy"]["x0.5"] != large_accuracy == run.summary["submodel_accuracy"]["x1"]
    text = write_report([str(tmp_path / "het")], tmp_path / "rep").read_text()
    section = text[text.index("## Per budget tier"):]
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| w"))}
    assert set(rows) == {"w1", "w1_2"}
    assert rows["w1_2"][3] == f"{tiers['w1_2']['mean_estimated_peak_bytes'] / 2**20:.2f}" and rows["w1_2"][5] == "0"


@pytest.fixture(scope="module")
def widths_and_fedavg(tmp_path_factory):
    """HeteroFL with two tiers and FedAvg under the same tiers, 3 rounds each."""
    from hfl.report import load_run

    out = tmp_path_factory.mktemp("pictures")
    tiers = {"scenario": "tiers", "memory": ["width:1/2", "width:1"], "shares": [0.5, 0.5]}
    run_experiment(small_config(method={"name": "heterofl", "widths": [1.0, 0.5]}, budgets=tiers), out / "heterofl")
    run_experiment(small_config(budgets={"scenario": "fair"}), out / "fedavg")
    return out, [load_run(out / "heterofl"), load_run(out / "fedavg")]


def test_the_round_plot_shows_the_worst_and_mean_sub_model_beside_the_global_with_whole_rounds(widths_and_fedavg, tmp_path):
    """What a sub-model method is ranked by gets its panel, from each round's sub-model accuracies (a
    method without sub-models: its one model's); a sweep's own metric one more; ticks are whole rounds."""
    from hfl.report import plot_accuracy_by_round

    _, runs = widths_and_fedavg
    fig = plot_accuracy_by_round(runs, tmp_path / "a.png")
    assert [ax.get_title() for ax in fig.axes] == ["global model", "worst sub-model", "mean sub-model"]
    heterofl, fedavg = runs
    curves = {title: {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()} for title, ax in zip(("g", "w", "m"), fig.axes)}
    assert curves["w"][heterofl.label] == [min(r["submodel_accuracy"].values()) for r in heterofl.rounds]
    assert curves["m"][heterofl.label] == pytest.approx([sum(r["submodel_accuracy"].values()) / 2 for r in heterofl.rounds])
    assert any(len(set(r["submodel_accuracy"].values())) > 1 for r in heterofl.rounds)
    assert curves["m"][heterofl.label] != curves["g"][heterofl.label]  # the global model's curve would not do
    assert curves["w"][fedavg.label] == curves["g"][fedavg.label] == [r["accuracy"] for r in fedavg.rounds]
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    ranked = plot_accuracy_by_round(runs, tmp_path / "b.png", ranked_by="final_loss")
    assert ranked.axes[-1].get_title() == "final_loss (ranked by)"
    assert list(ranked.axes[-1].get_lines()[0].get_ydata()) == [r["loss"] for r in heterofl.rounds]


def test_the_memory_plot_names_each_tier_point_and_stacks_labels_that_would_overlap(widths_and_fedavg, tmp_path):
    from hfl.report import plot_accuracy_by_memory

    _, runs = widths_and_fedavg
    fig = plot_accuracy_by_memory([*runs, runs[0]], tmp_path / "m.png")  # HeteroFL twice: the same places
    texts = [(t.xy, t.get_text().split("\n")) for t in fig.axes[0].texts]
    named = {name for _, lines in texts for name in lines}
    assert {"tier w1_2", runs[0].label, runs[1].label} <= named and any(n.startswith("tier") and "w1," in n for n in named)
    assert len({xy for xy, _ in texts}) == len(texts)  # one label per place
    assert all(len(lines) == len(set(lines)) for _, lines in texts)  # the twin run's label and tier names once


def test_data_png_titles_say_the_partitions_own_parameter(tmp_path, monkeypatch, capsys):
    import hfl.data
    from tests.conftest import QUICKSTART

    titles = []
    monkeypatch.setattr(hfl.data, "save_label_heatmap", lambda hist, path, title="": titles.append(title))
    for partition in (["data.partition=pathological", "data.labels_per_client=3"], ["data.alpha=0.3"], ["data.partition=iid"]):
        assert main(["data", str(QUICKSTART), *partition, "--png", str(tmp_path / "x.png")]) == 0
    assert titles == ["digits pathological (labels_per_client=3), 20 clients", "digits dirichlet (alpha=0.3), 20 clients", "digits iid, 20 clients"]
