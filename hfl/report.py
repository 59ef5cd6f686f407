"""Compare finished runs: a Markdown table and PNG plots, from run folders alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.server import SUMMARY

MIB = 2**20


@dataclass(frozen=True)
class RunRecord:
    """What the report needs of one run folder."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return f"{self.config['method']['name']} ({self.path.name})"


def load_run(path: str | Path) -> RunRecord:
    folder = Path(path)
    missing = [name for name in ("config.yaml", SUMMARY, "metrics.jsonl") if not (folder / name).is_file()]
    if missing:
        raise ConfigError("run folder", str(folder), f"a finished hfl run (missing {', '.join(missing)})")
    config = yaml.safe_load((folder / "config.yaml").read_text())
    return RunRecord(folder, config, json.loads((folder / SUMMARY).read_text()), read_metrics(folder))


def _fmt(value: Any, scale: float = 1.0, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) or scale != 1.0:
        return f"{value / scale:.{digits}f}"
    return str(value)


def comparison_rows(runs: list[RunRecord]) -> tuple[list[str], list[list[str]]]:
    headers = ["run", "method", "data", "partition", "budgets", "final acc", "best acc"]
    has_submodels = any("worst_submodel_accuracy" in r.summary for r in runs)
    if has_submodels:
        headers += ["worst sub-model", "mean sub-model"]
    headers += ["mean peak MiB", "max peak MiB", "GFLOPs/round", "MiB down/round", "MiB up/round", "violations", "failed", "skipped", "wall s"]
    rows = []
    for run in runs:
        s, c, n = run.summary, run.config, max(len(run.rounds), 1)
        data = c["data"]
        partition = data["partition"] + (f" α={data['alpha']:g}" if data["partition"].startswith("dirichlet") else "")
        partition += f" Λ={data['labels_per_client']}" if data["partition"] == "pathological" else ""
        row = [run.path.name, c["method"]["name"], data["name"], partition, c.get("budgets", {}).get("scenario", "none"),
               _fmt(s.get("final_accuracy")), _fmt(s.get("best_accuracy"))]
        if has_submodels:
            row += [_fmt(s.get("worst_submodel_accuracy")), _fmt(s.get("mean_submodel_accuracy"))]
        row += [
            _fmt(s.get("mean_estimated_peak_bytes"), MIB, 2), _fmt(s.get("max_estimated_peak_bytes"), MIB, 2),
            _fmt(s.get("total_flops", 0) / n, 1e9, 2), _fmt(s.get("total_bytes_down", 0) / n, MIB, 2),
            _fmt(s.get("total_bytes_up", 0) / n, MIB, 2), _fmt(s.get("budget_violations")),
            _fmt(s.get("failed_client_rounds")), _fmt(s.get("skipped_client_rounds")), _fmt(s.get("wall_seconds"), 1.0, 1),
        ]
        rows.append(row)
    return headers, rows


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_accuracy_by_round(runs: list[RunRecord], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for run in runs:
        points = [(r["round"], r["accuracy"]) for r in run.rounds if r.get("accuracy") is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=run.label)
    ax.set(xlabel="round", ylabel="test accuracy (global model)", title="accuracy by round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_accuracy_by_memory(runs: list[RunRecord], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for run in runs:
        peak = run.summary.get("max_estimated_peak_bytes")
        if peak is not None and run.summary.get("final_accuracy") is not None:
            ax.scatter(peak / MIB, run.summary["final_accuracy"], s=40)
            ax.annotate(run.label, (peak / MIB, run.summary["final_accuracy"]), fontsize="small",
                        xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="max client peak training memory (MiB, estimated)", ylabel="final test accuracy",
           title="accuracy vs client memory")
    ax.margins(0.2)  # room for the labels beside the points
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def write_report(run_dirs: list[str], out: str | Path) -> Path:
    """Write report.md, accuracy_by_round.png and accuracy_by_memory.png into `out`; returns report.md."""
    runs = [load_run(d) for d in run_dirs]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    headers, rows = comparison_rows(runs)
    plot_accuracy_by_round(runs, folder / "accuracy_by_round.png")
    plot_accuracy_by_memory(runs, folder / "accuracy_by_memory.png")
    text = "# hfl report\n\n" + markdown_table(headers, rows)
    text += "\nPeak memory is the estimated peak training memory of a client-round; GFLOPs and MiB are per round, summed over the round's clients.\n"
    text += "\n![accuracy by round](accuracy_by_round.png)\n\n![accuracy vs client memory](accuracy_by_memory.png)\n"
    report = folder / "report.md"
    report.write_text(text)
    return report
