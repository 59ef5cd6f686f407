"""Where round metrics go: OUT/metrics.jsonl always, wandb when asked (offline by default)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from hfl.config import ExperimentConfig

log = logging.getLogger(__name__)
METRICS = "metrics.jsonl"


class RoundCallback(Protocol):
    def on_round(self, record: dict[str, Any]) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


class WandbLogger:
    """Logs each round's scalars and the per-client table to wandb; offline unless configured."""

    def __init__(self, config: ExperimentConfig, out_dir: Path, resume: bool) -> None:
        import wandb  # imported only when asked for: it is slow to import

        settings = config.logging
        self.run = wandb.init(
            project=settings.wandb_project,
            group=settings.wandb_group or None,
            name=out_dir.name,
            id=out_dir.name.replace("/", "_"),
            dir=str(out_dir),
            mode=settings.wandb_mode,
            config=config.to_dict(),
            resume="allow" if resume else None,
        )
        log.info("wandb run in %s (mode %s)", out_dir, settings.wandb_mode)

    def on_round(self, record: dict[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and v is not None}
        clients = record.get("clients", [])
        for key in ("train_loss", "bytes_up", "bytes_down"):
            values = [c[key] for c in clients if c.get(key) is not None]
            if values:
                scalars[f"clients/mean_{key}"] = sum(values) / len(values)
        self.run.log(scalars, step=record["round"])

    def on_end(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            self.run.summary[key] = value
        self.run.finish()
