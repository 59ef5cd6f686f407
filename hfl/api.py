"""hfl from Python (notebooks, scripts): build a config, run it, open a finished run.

    import hfl

    run = hfl.run("experiments/quickstart.yaml", fl__rounds=2, out="runs/try", progress=True)
    run.summary["final_accuracy"]
    run.metrics          # one row per round (a pandas DataFrame where pandas is installed)
    model = run.model()  # the global model, as it was scored

Overrides are the command line's `section.field=value`: keyword arguments with `__` for the dots
(`fl__rounds=3`), or a dict of dotted keys (`{"fl.rounds": 3}`). Their values are Python values,
checked as the YAML file's are, with the same errors (field, value, what is allowed).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfl.config import ExperimentConfig, config_from_dict, experiment_values, flatten, read_yaml_mapping
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.yaml_loader import set_dotted

if TYPE_CHECKING:
    from torch import nn

ConfigSource = ExperimentConfig | Mapping[str, Any] | str | os.PathLike | None
"""An experiment: a built config, a dict of sections (dotted keys allowed), a YAML file, or None (all defaults)."""


def make_config(source: ConfigSource = None, overrides: Mapping[str, Any] | None = None, /, **fields: Any) -> ExperimentConfig:
    """The checked `ExperimentConfig` of `source` with `overrides` ({"fl.rounds": 3}) and `fields`
    (fl__rounds=3) applied, in that order. (Not `hfl.config`: that name is the module.)"""
    if isinstance(source, ExperimentConfig):
        values = source.to_dict()
    elif isinstance(source, Mapping):
        values = copy.deepcopy(dict(source))
    elif source is None:
        values = {}
    else:
        values = experiment_values(source)
    dotted = {**(overrides or {}), **{key.replace("__", "."): value for key, value in fields.items()}}
    for key, value in dotted.items():
        values = set_dotted(values, key, value)
    return config_from_dict(values)


def run(
    config: ConfigSource, overrides: Mapping[str, Any] | None = None, /, *, out: str | os.PathLike | None = None,
    progress: bool = False, **fields: Any,
) -> Run:
    """Run an experiment in this process, as `hfl run` does, and return the finished run.

    `config`, `overrides` and `fields` as `make_config` takes them; `out`: the run folder (or a URI),
    default `runs/NAME-TIME` as on the command line; `progress`: show a line (a bar on a terminal) per round."""
    from hfl.server import run_experiment

    experiment = make_config(config, overrides, **fields)
    folder = out if out is not None else f"runs/{experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    callbacks = []
    if progress:
        from hfl.cli import RoundProgress  # the command line's display, so both show a round alike

        callbacks.append(RoundProgress(experiment.fl.rounds, 0))
    summary = run_experiment(experiment, folder, callbacks=callbacks)
    return Run(Path(folder), experiment, summary)


def load_run(folder: str | os.PathLike) -> Run:
    """The run `hfl run` (or `hfl.run`) wrote to `folder`; its summary is None while it is unfinished."""
    from hfl.server import SUMMARY

    path = Path(folder)
    saved = read_yaml_mapping(path / "config.yaml", "folder", "a run folder, as hfl run --out writes it, holding config.yaml")
    summary = json.loads((path / SUMMARY).read_text()) if (path / SUMMARY).is_file() else None
    return Run(path, config_from_dict(saved), summary)


@dataclass(frozen=True)
class Run:
    """A run folder, read: its config, its metrics by round, its summary and its global model."""

    folder: Path
    config: ExperimentConfig
    summary: dict[str, Any] | None
    """summary.json: final and best accuracy, resource totals, violations, ...; None while unfinished."""

    @property
    def records(self) -> list[dict[str, Any]]:
        """metrics.jsonl: one dict per round, as written (with every client's metrics under `clients`)."""
        return read_metrics(self.folder)

    @property
    def metrics(self) -> Any:
        """One row per round: its scalars, nested scores as dotted columns (`submodel_accuracy.x0.5`);
        a pandas DataFrame where pandas is installed, else a list of dicts."""
        rows = [{k: v for k, v in flatten(record).items() if not isinstance(v, list)} for record in self.records]
        return table(rows)

    @property
    def clients(self) -> Any:
        """One row per client-round: `round` and that client's metrics (as `metrics` returns them)."""
        return table([{"round": record["round"], **client} for record in self.records for client in record["clients"]])

    def model(self, device: str = "cpu") -> nn.Module:
        """The global model of the last checkpoint as it was scored (the method's global sub-model, its
        weights, masks and batch-norm statistics), in eval mode on `device`. Builds the experiment's
        data and method to do so, as the run did."""
        import torch

        from hfl.checkpoint import CHECKPOINT
        from hfl.evaluation import Evaluator
        from hfl.experiment import ClientEnvironment

        checkpoint = self.folder / CHECKPOINT
        if not checkpoint.is_file():
            raise ConfigError("folder", str(self.folder), f"a run folder with a {CHECKPOINT} (none there: the run wrote no round yet)")
        saved = torch.load(checkpoint, map_location=device, weights_only=False)
        env = ClientEnvironment.from_config(self.config, torch.device(device))
        return Evaluator(env).scored_model(saved["global_state"], env.method.global_model_spec(saved["method_state"]))


def table(rows: list[dict[str, Any]]) -> Any:
    """`rows` as a pandas DataFrame where pandas is installed (it is no dependency of hfl), else as they are."""
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows)
