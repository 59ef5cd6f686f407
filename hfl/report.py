"""Compare finished runs: a Markdown table and PNG plots, from run folders alone."""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.scores import RoundScores
from hfl.server import SUMMARY
from hfl.storage import is_uri, staged

MIB = 2**20


SWEEP_FILE = "sweep.yaml"
"""What `hfl tune` writes beside its trials' folders (OUT/trials/<id>): the swept config paths."""


@dataclass(frozen=True)
class RunRecord:
    """What the report needs of one run folder."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]
    swept: dict[str, Any] = field(default_factory=dict)
    """A sweep trial's swept config paths and its values of them (empty for other runs)."""

    @property
    def label(self) -> str:
        """The run folder's name, and the method's where the name does not already say it; a trial's
        swept values (a trial id alone says nothing)."""
        name, method = self.path.name, self.config["method"]["name"]
        if self.swept:
            return f"{name} " + " ".join(f"{path.rsplit('.', 1)[-1]}={short_value(v)}" for path, v in self.swept.items())
        return name if method in name else f"{name} ({method})"


def short_value(value: Any, digits: int = 3) -> str:
    """A config or metric value in a label: floats to `digits` significant digits, lists without spaces."""
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(short_value(v, digits) for v in value) + "]"
    return str(value)


def config_value(config: dict[str, Any], path: str) -> Any:
    """The value at dotted `path` of a config dict (None where absent)."""
    node: Any = config
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def sweep_metric(folder: Path) -> str | None:
    """The metric a sweep ranked its trials by, where `folder` is one of its trials."""
    sweep = folder.parent.parent / SWEEP_FILE
    if folder.parent.name != "trials" or not sweep.is_file():
        return None
    return (yaml.safe_load(sweep.read_text()) or {}).get("metric")


def swept_paths(folder: Path) -> list[str]:
    """The config paths a sweep varied, where `folder` is one of its trials (OUT/trials/<id>)."""
    sweep = folder.parent.parent / SWEEP_FILE
    if folder.parent.name != "trials" or not sweep.is_file():
        return []
    return list((yaml.safe_load(sweep.read_text()) or {}).get("space") or {})


def expand_sweeps(run_dirs: list[str]) -> list[str]:
    """Run folders, with a sweep folder (holding sweep.yaml) replaced by its trials' folders."""
    expanded = []
    for run_dir in run_dirs:
        folder = Path(run_dir)
        if not is_uri(run_dir) and (folder / SWEEP_FILE).is_file():
            expanded += [str(t) for t in sorted((folder / "trials").iterdir()) if t.is_dir()]
        else:
            expanded.append(run_dir)
    return expanded


def load_run(path: str | Path) -> RunRecord:
    """The run in folder `path`, or at a URI (s3://, gs://, file://; read from a local copy)."""
    if is_uri(path):
        with staged(path, "run folder") as (folder, _):
            return replace(load_run(folder), path=Path(str(path).rstrip("/").rsplit("/", 1)[-1]))
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError("run folder", str(folder), "an existing folder holding a finished hfl run (no such folder)")
    missing = [name for name in ("config.yaml", SUMMARY, "metrics.jsonl") if not (folder / name).is_file()]
    if missing:
        raise ConfigError("run folder", str(folder), f"a finished hfl run (missing {', '.join(missing)})")
    config = yaml.safe_load((folder / "config.yaml").read_text())
    swept = {path: config_value(config, path) for path in swept_paths(folder)}
    return RunRecord(folder, config, json.loads((folder / SUMMARY).read_text()), read_metrics(folder), swept)


def _fmt(value: Any, scale: float = 1.0, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) or scale != 1.0:
        return f"{value / scale:.{digits}f}"
    return str(value)


def comparison_rows(runs: list[RunRecord]) -> tuple[list[str], list[list[str]]]:
    swept = list(dict.fromkeys(path for run in runs for path in run.swept))  # a sweep's values, beside the trial id
    headers = ["run", *swept, "method", "data", "partition", "budgets", "rounds", "status", "final acc", "best acc"]
    has_submodels = any("worst_submodel_accuracy" in r.summary for r in runs)
    if has_submodels:
        headers += ["worst sub-model", "mean sub-model"]
    has_sparse = any("mean_estimated_sparse_peak_bytes" in r.summary for r in runs)
    headers += ["mean peak MiB", *(["mean peak MiB, sparse weights"] if has_sparse else []), "max peak MiB", "GFLOPs/round", "MiB down/round", "MiB up/round", "violations", "failed", "skipped", "wall s"]
    rows = []
    for run in runs:
        s, c, n = run.summary, run.config, max(len(run.rounds), 1)
        data = c["data"]
        partition = data["partition"] + (f" α={data['alpha']:g}" if data["partition"].startswith("dirichlet") else "")
        partition += f" Λ={data['labels_per_client']}" if data["partition"] == "pathological" else ""
        row = [run.path.name, *(short_value(run.swept[p]) if p in run.swept else "-" for p in swept),
               c["method"]["name"], data["name"], partition, c.get("budgets", {}).get("scenario", "none"),
               str(len(run.rounds)), run_status(run), _fmt(s.get("final_accuracy")), _fmt(s.get("best_accuracy"))]
        if has_submodels:
            row += [_fmt(s.get("worst_submodel_accuracy")), _fmt(s.get("mean_submodel_accuracy"))]
        row += [
            _fmt(s.get("mean_estimated_peak_bytes"), MIB, 2),
            *([_fmt(s.get("mean_estimated_sparse_peak_bytes"), MIB, 2)] if has_sparse else []),
            _fmt(s.get("max_estimated_peak_bytes"), MIB, 2),
            _fmt(s.get("total_flops", 0) / n, 1e9, 2), _fmt(s.get("total_bytes_down", 0) / n, MIB, 2),
            _fmt(s.get("total_bytes_up", 0) / n, MIB, 2), _fmt(s.get("budget_violations")),
            _fmt(s.get("failed_client_rounds")), _fmt(s.get("skipped_client_rounds")), _fmt(s.get("wall_seconds"), 1.0, 1),
        ]
        rows.append(row)
    return headers, rows


def run_status(run: RunRecord) -> str:
    """How a run ended: a sweep trial's reason from its results.csv (`stopped by asha after round
    1/3`), else `completed` (`completed (T simulated s)` where `fl.time_limit_s` ended it), or
    `stopped after round k/N` where it ran fewer rounds than configured."""
    results = run.path.parent.parent / "results.csv"
    if run.swept and results.is_file():
        with open(results, newline="") as f:
            reason = next((row.get("reason") for row in csv.DictReader(f) if row.get("trial_id") == run.path.name), None)
        if reason:
            return reason
    planned = config_value(run.config, "fl.rounds")
    done = len(run.rounds)
    limit = config_value(run.config, "fl.time_limit_s")
    if limit and run.rounds and run.rounds[-1].get("sim_end_s", 0) >= limit:
        return f"completed ({limit:g} simulated s)"
    return f"stopped after round {done}/{planned}" if planned is not None and done < planned else "completed"


SEED_SUFFIX = re.compile(r"[-_]?seed\d+$")
"""A run folder's seed suffix (`compare.sh --seeds` writes OUT/<method>-seed<k>)."""
SEED_METRICS = (("final acc", "final_accuracy"), ("best acc", "best_accuracy"),
                ("worst sub-model", "worst_submodel_accuracy"), ("mean sub-model", "mean_submodel_accuracy"))


def seed_groups(runs: list[RunRecord]) -> list[list[RunRecord]]:
    """Runs grouped by their config without the seed (and the run name), in first-seen order."""
    groups: dict[str, list[RunRecord]] = {}
    for run in runs:
        key = json.dumps({k: v for k, v in run.config.items() if k not in ("seed", "name")}, sort_keys=True, default=str)
        groups.setdefault(key, []).append(run)
    return list(groups.values())


def mean_std(values: list[float]) -> str:
    """'mean ± sample standard deviation' over seeds; the value alone for one seed; '-' for none."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def seed_rows(groups: list[list[RunRecord]]) -> tuple[list[str], list[list[str]]]:
    """One row per group of runs that differ only in seed: mean ± std of the accuracies."""
    metrics = [(header, key) for header, key in SEED_METRICS if any(key in r.summary for g in groups for r in g)]
    headers = ["run", "method", "seeds", *(header for header, _ in metrics)]
    rows = []
    for group in groups:
        name = SEED_SUFFIX.sub("", group[0].path.name) or group[0].path.name
        seeds = ", ".join(str(r.config.get("seed")) for r in group)
        values = [mean_std([r.summary[key] for r in group if r.summary.get(key) is not None]) for _, key in metrics]
        rows.append([name, group[0].config["method"]["name"], seeds, *values])
    return headers, rows


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


SUBMODEL_PANELS = ("worst_submodel_accuracy", "mean_submodel_accuracy")
PANEL_TITLES = {"accuracy": "global model", "worst_submodel_accuracy": "worst sub-model", "mean_submodel_accuracy": "mean sub-model"}


def round_values(record: dict[str, Any], scores: RoundScores) -> dict[str, Any]:
    """A round's numbers by the names a sweep ranks by: its own scalars, and `RoundScores`' (worst and
    mean sub-model accuracy, violations so far, ...); `final_X` and `X` alike."""
    values = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    values.update(scores(record))
    return {**values, **{f"final_{k}": v for k, v in values.items()}}


def round_panels(runs: list[RunRecord], ranked_by: str | None = None) -> list[str]:
    """What accuracy_by_round.png plots, a panel each: the global model's accuracy, the worst and
    mean sub-model accuracy where a run has sub-models (what sub-model methods are ranked by), and
    the metric a sweep ranked by where it is none of these."""
    panels = ["accuracy"]
    if any(r.get("submodel_accuracy") for run in runs for r in run.rounds):
        panels += SUBMODEL_PANELS
    metric = {"final_accuracy": "accuracy"}.get(ranked_by or "", ranked_by)
    if metric and metric not in panels:
        panels.append(metric)
    return panels


def round_curve(run: RunRecord, metric: str) -> list[tuple[int, float]]:
    """(round, value of `metric`) for every round of `run` that has it."""
    scores, points = RoundScores(), []
    for record in run.rounds:
        value = round_values(record, scores).get(metric)
        if value is not None:
            points.append((record["round"], value))
    return points


def plot_accuracy_by_round(runs: list[RunRecord], path: Path, ranked_by: str | None = None) -> Any:
    """One panel per `round_panels` metric, a line per run, integer round ticks; returns the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = round_panels(runs, ranked_by)
    fig = Figure(figsize=(4.2 * len(panels) + 1.5, 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=all(p.endswith("accuracy") for p in panels))[0]
    for ax, metric in zip(axes, panels):
        for run in runs:
            points = round_curve(run, metric)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=run.label)
        title = PANEL_TITLES.get(metric, metric) + (" (ranked by)" if metric == {"final_accuracy": "accuracy"}.get(ranked_by or "", ranked_by) else "")
        ax.set(xlabel="round", title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy" if all(p.endswith("accuracy") for p in panels) else "value")
    axes[-1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.02, 0.5))  # beside the panels, over no curve
    fig.suptitle("accuracy by round")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def plot_accuracy_by_time(runs: list[RunRecord], path: Path) -> bool:
    """Accuracy against simulated time (the end of each round) for the runs with devices; whether any had them."""
    timed = [run for run in runs if any("sim_end_s" in r for r in run.rounds)]
    if not timed:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for run in timed:
        points = [(r["sim_end_s"], r["accuracy"]) for r in run.rounds if r.get("accuracy") is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=run.label)
    ax.set(xlabel="simulated seconds", ylabel="test accuracy (global model)", title="accuracy by simulated time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return True


def time_rows(groups: list[list[RunRecord]]) -> tuple[list[str], list[list[str]]]:
    """Per group of seeds: total simulated seconds and the time to each `fl.time_targets` accuracy,
    mean ± std over the seeds that reached it, with how many did."""
    targets = sorted({t for g in groups for r in g for t in (r.summary.get("time_to_accuracy") or {})}, key=float)
    headers = ["run", "method", "seeds", "simulated s", *(f"time to {t}" for t in targets)]
    rows = []
    for group in groups:
        if "simulated_seconds" not in group[0].summary:
            continue
        name = SEED_SUFFIX.sub("", group[0].path.name) or group[0].path.name
        cells = []
        for t in targets:
            reached = [r.summary["time_to_accuracy"][t] for r in group if (r.summary.get("time_to_accuracy") or {}).get(t) is not None]
            cells.append(f"{mean_std(reached)} ({len(reached)}/{len(group)})")
        rows.append([name, group[0].config["method"]["name"], str(len(group)), mean_std([r.summary["simulated_seconds"] for r in group]), *cells])
    return headers, rows


LABEL_REACH = (0.2, 0.08)
"""How far (shares of the data's x and y spans) a point's label reaches: about one label's width
and two lines' height on the plot."""


def shared_labels(points: list[tuple[float, float, str]]) -> list[tuple[float, float, list[str]]]:
    """One label per group of points whose labels would overlap: (x, y of the group's highest point,
    its labels from the highest point down). Runs at (nearly) the same place, as HeteroFL and
    FedRolex under `fair`, get one stacked label instead of labels printed over each other."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    reach_x = LABEL_REACH[0] * (max(xs) - min(xs) if points else 0) or 1e-9
    reach_y = LABEL_REACH[1] * (max(ys) - min(ys) if points else 0) or 1e-9
    groups: list[list[tuple[float, float, str]]] = []
    for point in sorted(points):
        group = next((g for g in groups if any(abs(q[0] - point[0]) <= reach_x and abs(q[1] - point[1]) <= reach_y for q in g)), None)
        if group is None:
            groups.append([point])
        else:
            group.append(point)
    stacked = []
    for group in groups:
        group.sort(key=lambda q: (-q[1], q[2]))
        stacked.append((group[0][0], group[0][1], [q[2] for q in group]))
    return stacked


def tier_rows(runs: list[RunRecord]) -> tuple[list[str], list[list[str]]]:
    """One row per run and budget tier: what a width or depth method gives its smaller clients, which
    the maximum over all clients hides."""
    headers = ["tier", "run", "budget MiB", "mean peak MiB", "client-rounds", "violations"]
    rows = []
    for run in runs:
        for tier, t in (run.summary.get("tiers") or {}).items():
            rows.append([tier, run.label, _fmt(t.get("budget_bytes"), MIB, 2), _fmt(t.get("mean_estimated_peak_bytes"), MIB, 2),
                         _fmt(t.get("client_rounds")), _fmt(t.get("budget_violations"))])
    return headers, rows


def memory_points(run: RunRecord) -> list[tuple[float, float, str | None]]:
    """(client memory in MiB, final accuracy, tier) per budget tier: the tier's mean peak, and the
    accuracy of the sub-model its clients trained most (HeteroFL's small tier scores its small width,
    not the global model), or the global model's where no sub-model of theirs is scored. Without
    tiers, the mean and max peak at the global model's accuracy (tier None)."""
    final = run.summary.get("final_accuracy")
    if final is None:
        return []
    scored = run.summary.get("submodel_accuracy") or {}
    trained: dict[str, Counter[str]] = {}
    for record in run.rounds:
        for client in record.get("clients", []):
            if client.get("tier") is not None and client.get("level") is not None:
                trained.setdefault(client["tier"], Counter())[client["level"]] += 1
    points = []
    for name, tier in (run.summary.get("tiers") or {}).items():
        if tier.get("mean_estimated_peak_bytes"):
            submodel = trained[name].most_common(1)[0][0] if name in trained else None
            points.append((tier["mean_estimated_peak_bytes"] / MIB, scored.get(submodel, final), name))
    if points:
        return sorted(points)
    overall = [run.summary.get(k) for k in ("mean_estimated_peak_bytes", "max_estimated_peak_bytes")]
    return [(b / MIB, final, None) for b in sorted({b for b in overall if b is not None})]


def stacked_label(labels: list[str]) -> list[str]:
    """The lines of one place's label: its runs, then its tiers on one line (`tiers w1, w1_2`), each once."""
    runs = [label for label in dict.fromkeys(labels) if not label.startswith("tier ")]
    tiers = sorted({label.removeprefix("tier ") for label in labels if label.startswith("tier ")})
    return runs + ([("tiers " if len(tiers) > 1 else "tier ") + ", ".join(tiers)] if tiers else [])


def plot_accuracy_by_memory(runs: list[RunRecord], path: Path) -> Any:
    """Final accuracy against client memory, one marker per budget tier joined by a line, at the
    accuracy of the sub-model that tier trained: HeteroFL's small clients sit left of FedAvg's and
    below them, where the maximum peak alone put both at the same place. Each marker is named by its
    tier, each line's last by its run; labels that would overlap are stacked into one. Returns the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    points = []
    for run in runs:
        tiers = memory_points(run)
        if not tiers:
            continue
        ax.plot([t[0] for t in tiers], [t[1] for t in tiers], marker="o", markersize=5)
        for k, (x, y, tier) in enumerate(tiers):
            names = ([run.label] if k == len(tiers) - 1 else []) + ([f"tier {tier}"] if tier is not None else [])
            points += [(x, y, name) for name in names]
    for x, y, labels in shared_labels(points):
        ax.annotate("\n".join(stacked_label(labels)), (x, y), fontsize="small", xytext=(4, 4), textcoords="offset points", va="bottom")
    ax.set(xlabel="client peak training memory per budget tier (MiB, estimated mean)",
           ylabel="final test accuracy of the tier's sub-model", title="accuracy vs client memory (a marker per tier)")
    ax.margins(0.2)  # room for the labels beside the points
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def write_report(run_dirs: list[str], out: str | Path) -> Path:
    """Write report.md, accuracy_by_round.png and accuracy_by_memory.png (and accuracy_by_time.png for
    runs with devices) into `out`; returns report.md.
    A sweep folder (`hfl tune --out`) stands for its trials, which get the swept values as columns."""
    runs = [load_run(d) for d in expand_sweeps(run_dirs)]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    headers, rows = comparison_rows(runs)
    ranked_by = next((metric for run in runs if (metric := sweep_metric(run.path))), None)
    plot_accuracy_by_round(runs, folder / "accuracy_by_round.png", ranked_by)
    plot_accuracy_by_memory(runs, folder / "accuracy_by_memory.png")
    text = "# hfl report\n\n"
    groups = seed_groups(runs)
    if any(len(g) > 1 for g in groups):
        text += "## Mean ± standard deviation over seeds\n\nRuns whose configs differ only in `seed` are one row; ± is the sample standard deviation.\n\n"
        text += markdown_table(*seed_rows(groups)) + "\n## Every run\n\n"
    text += markdown_table(headers, rows)
    text += "\nPeak memory is the estimated peak training memory of a client-round; GFLOPs and MiB are per round, summed over the round's clients.\n"
    tiers = tier_rows(runs)
    if tiers[1]:
        text += "\n## Per budget tier\n\nThe mean estimated peak of each tier's client-rounds against its budget.\n\n" + markdown_table(*tiers)
    text += "\n![accuracy by round](accuracy_by_round.png)\n\n![accuracy vs client memory](accuracy_by_memory.png)\n"
    if plot_accuracy_by_time(runs, folder / "accuracy_by_time.png"):
        text += ("\n## Simulated time\n\nSimulated seconds of the whole run and to each target accuracy (`fl.time_targets`), mean ± std "
                 "over the seeds that reached it (how many did); docs/time.md.\n\n" + markdown_table(*time_rows(groups)))
        text += "\n![accuracy by simulated time](accuracy_by_time.png)\n"
    report = folder / "report.md"
    report.write_text(text)
    return report
