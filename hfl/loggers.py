"""Where round metrics go: OUT/metrics.jsonl always, wandb when asked (offline by default)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Protocol

from hfl.config import ExperimentConfig
from hfl.errors import ConfigError
from hfl.scores import RoundScores

log = logging.getLogger(__name__)
METRICS = "metrics.jsonl"


class RoundCallback(Protocol):
    def on_round(self, record: dict[str, Any]) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    """The rounds written so far. A last line without its newline is a round still being written (or
    cut by a kill mid-write): it is not a round yet, so it is left out rather than failing the read."""
    path = Path(out_dir) / METRICS
    if not path.is_file():
        return []
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


class MetricsWriter:
    """Appends one JSON line per round, flushed so a crash loses at most the round in flight."""

    def __init__(self, out_dir: Path, keep_rounds_upto: int | None = None) -> None:
        self.path = out_dir / METRICS
        if keep_rounds_upto is not None:  # resuming: drop rounds newer than the checkpoint
            kept = [r for r in read_metrics(out_dir) if r["round"] <= keep_rounds_upto]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()

    def on_round(self, record: dict[str, Any]) -> None:
        # One unbuffered write per line: a buffered file splits a long line into several writes,
        # which a reader polling the file (or a kill) can catch half-way.
        with open(self.path, "ab", buffering=0) as f:
            f.write((json.dumps(record) + "\n").encode())
            os.fsync(f.fileno())

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


WANDB_HASH_IGNORES = ("name", "logging/", "data/root", "data/cache_dir")
"""Config fields that do not change what a run computes: left out of the hash in its wandb id."""


def flatten_slash(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of `a/b/c` keys (wandb's panel separator; `.` would nest again)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_slash(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def config_digest(config: ExperimentConfig) -> str:
    """A short hash of what the run computes: the config without its name, logging and data paths."""
    values = flatten_slash(config.to_dict())
    kept = {k: v for k, v in values.items() if not any(k == i or k.startswith(i) and i.endswith("/") for i in WANDB_HASH_IGNORES)}
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:8]


def folder_digest(out_dir: str | Path) -> str:
    """A short hash of a run folder's absolute path (a URI as it is)."""
    where = str(out_dir) if "://" in str(out_dir) else str(Path(out_dir).resolve())
    return hashlib.sha1(where.encode()).hexdigest()[:6]


def wandb_run_id(config: ExperimentConfig, out_dir: str | Path) -> str:
    """`<name>-<config hash>-s<seed>-<folder hash>`: runs of one name with other settings or seeds
    never share an id (comparison scripts reuse names such as `fedavg`), nor does the same config run
    into two folders (offline runs of one id merge when synced); wandb allows letters, digits, `-`, `_`, `.`."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", config.name)
    return f"{name}-{config_digest(config)}-s{config.seed}-{folder_digest(out_dir)}"


WANDB_RUN_FOLDER = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-(?P<id>.+)$")


def existing_wandb_id(out_dir: Path) -> str | None:
    """The id of the latest wandb run in a run folder: a resumed run (whose `fl.rounds` may have
    been raised, changing the hash, or whose folder was moved) goes on in the same wandb run."""
    runs = sorted(p.name for p in (out_dir / "wandb").glob("*run-*") if p.is_dir() and WANDB_RUN_FOLDER.match(p.name))
    return WANDB_RUN_FOLDER.match(runs[-1])["id"] if runs else None


SIMULATED_TIME = "simulated_time"
"""The step metric of a run with devices: its rows' keys are plotted against simulated seconds."""

TIER_MEANS = ("train_loss", "estimated_peak_bytes", "estimated_sparse_peak_bytes", "measured_peak_bytes", "flops", "bytes_down", "bytes_up", "seconds")
"""Client fields averaged per budget tier in each round's wandb row."""


def round_row(record: dict[str, Any], scores: RoundScores | None = None) -> dict[str, Any]:
    """A round's metrics as flat wandb keys: `round`, scalars, sub-model / exit accuracies
    (`submodel_accuracy/x0.5`), counts of failed and skipped clients, per budget tier the means over its
    clients (`tiers/w1_2/mean_estimated_peak_bytes`), and the round's scores (`RoundScores`: worst and
    mean sub-model accuracy, per-tier accuracy, violations this round and so far); with devices,
    `simulated_time`: the simulated clock at the round's end (docs/time.md)."""
    row = {k: v for k, v in flatten_slash({k: v for k, v in record.items() if k != "clients"}).items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if record.get("sim_end_s") is not None:
        row[SIMULATED_TIME] = record["sim_end_s"]
    for key in ("failed_clients", "skipped_clients"):
        row[key] = len(record.get(key) or [])
    clients = record.get("clients", [])
    for tier in sorted({c["tier"] for c in clients if c.get("tier") is not None}):
        members = [c for c in clients if c.get("tier") == tier]
        row[f"tiers/{tier}/clients"] = len(members)
        for key in TIER_MEANS:
            values = [c[key] for c in members if c.get(key) is not None]
            if values:
                row[f"tiers/{tier}/mean_{key}"] = sum(values) / len(values)
    for key in ("train_loss", "bytes_up", "bytes_down"):
        values = [c[key] for c in clients if c.get(key) is not None]
        if values:
            row[f"clients/mean_{key}"] = sum(values) / len(values)
    row.update((scores or RoundScores())(record))
    return row


def client_table(clients: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a round's per-client resources (nested fields as `submodel/width`; lists as JSON)."""
    flat = [flatten_slash(c) for c in clients]
    columns = list(dict.fromkeys(k for c in flat for k in c))
    return columns, [[_table_cell(c.get(k)) for k in columns] for c in flat]


def _table_cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, tuple)) else value  # a wandb table column holds scalars


BEST_IS_LOWEST = re.compile(r"(^|/)(loss|perplexity|.*seconds|.*violations|.*bytes.*|.*flops|.*train_loss|failed_clients|skipped_clients)$")
"""History keys whose summary keeps the lowest value beside the last (others keep the highest)."""


def summary_kind(key: str) -> str:
    """What a history key's wandb summary keeps: accuracies their best (`max`), losses, violations and
    costs their lowest (`min`), and every key its `last`."""
    return ("min" if BEST_IS_LOWEST.search(key) or key.startswith("violations/") or "/violations/" in key else "max") + ",last"


class WandbLogger:
    """wandb as the dashboard: every round's metrics (global, sub-model, exit, ensemble, per tier, the
    scores a sweep ranks by, violations), a table of the round's clients and their resources, the
    resolved config (plus a sweep's values, `swept`) and the run's summary, and on request the final
    checkpoint as an artifact. `round` is the step of every key, or `simulated_time` in a run with
    devices (`round` stays a key to plot against); each key's summary holds its best and its last value
    (`summary_kind`). Offline unless configured; the files go to OUT/wandb.

    The run id and name are `<name>-<config hash>-s<seed>-<folder hash>` (a resumed run keeps the id
    found in its folder), the group `logging.wandb_group` (a comparison or a sweep), the job type the
    method. `records`: the rounds a resumed run has already run (their violations count on)."""

    def __init__(self, config: ExperimentConfig, out_dir: Path, resume: bool, swept: dict[str, Any] | None = None,
                 records: list[dict[str, Any]] | None = None, run_id: str | None = None) -> None:
        import wandb  # imported only when asked for: it is slow to import

        settings = config.logging
        self.out_dir, self.checkpoint = out_dir, settings.wandb_checkpoint
        run_id = run_id or (existing_wandb_id(out_dir) if resume else None) or wandb_run_id(config, out_dir)
        try:
            self.run = wandb.init(
                project=settings.wandb_project,
                group=settings.wandb_group or None,
                job_type=config.method.name,
                name=run_id,
                id=run_id,
                dir=str(out_dir),
                mode=settings.wandb_mode,
                config={**config.to_dict(), **({"swept": swept} if swept else {})},
                resume="allow" if resume else None,
                # Runs of several Tune trials are open at once in the sweep's driver.
                reinit="create_new",
            )
        except wandb.errors.UsageError as error:  # online without an API key
            raise ConfigError("logging.wandb_mode", settings.wandb_mode,
                              f"'offline' (the default; `wandb sync` uploads later), or 'online' after `wandb login` ({error})") from None
        self.run.define_metric("round")
        self.defined: set[str] = {"round"}
        self.scores = RoundScores(records if records is not None else (read_metrics(out_dir) if resume else ()))
        self.finished = False
        log.info("wandb run %s in %s (mode %s)", run_id, out_dir, settings.wandb_mode)

    def log(self, row: dict[str, Any], round_: int) -> None:
        """Log `row` at step `round_`, each new key defined with its summaries and, as its step metric,
        `simulated_time` where the row has one (a run with devices), else `round`."""
        step_metric = SIMULATED_TIME if SIMULATED_TIME in row else "round"
        for key in row.keys() - self.defined:
            if key == SIMULATED_TIME:
                self.run.define_metric(key, summary="last")
            elif key != "client_resources":
                # a `.` nests in define_metric's names (sub-model names such as x0.5 hold one)
                self.run.define_metric(key.replace(".", "\\."), step_metric=step_metric, summary=summary_kind(key))
            self.defined.add(key)
        self.run.log({**row, "round": round_}, step=round_)

    def on_round(self, record: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Log a round (`extra`: more keys for its row, such as a Tune trial's PBT marks)."""
        import wandb

        row: dict[str, Any] = {**round_row(record, self.scores), **(extra or {})}
        if record.get("clients"):
            columns, rows = client_table(record["clients"])
            row["client_resources"] = wandb.Table(columns=columns, data=rows)
        self.log(row, record["round"])

    def on_end(self, summary: dict[str, Any]) -> None:
        # summary.json's keys, except those the history summarises itself (best and last)
        self.run.summary.update({k: v for k, v in flatten_slash(summary).items() if k not in self.defined})
        if self.checkpoint:
            self.log_checkpoint()
        self.close()

    def log_checkpoint(self) -> None:
        """The run's checkpoint.pt as a `model` artifact (offline: kept in the run's wandb folder until synced)."""
        import wandb

        from hfl.checkpoint import CHECKPOINT

        path = self.out_dir / CHECKPOINT
        if path.is_file():
            rounds = [r["round"] for r in read_metrics(self.out_dir)]
            artifact = wandb.Artifact(f"{self.run.id}-checkpoint", type="model", metadata={"round": rounds[-1] if rounds else None})
            artifact.add_file(str(path), name=CHECKPOINT)
            self.run.log_artifact(artifact, aliases=["final"])

    def close(self) -> None:
        """Finish the wandb run (once): at the run's end, or where a Tune trial ends early."""
        if not self.finished:
            self.finished = True
            self.run.finish()
