"""hfl from Python (notebooks, scripts): build a config, run it, open a finished run.

    import hfl

    run = hfl.run("experiments/quickstart.yaml", fl__rounds=2, out="runs/try", progress=True)
    run.summary["final_accuracy"]
    run.metrics          # one row per round (a pandas DataFrame where pandas is installed)
    model = run.model()  # the global model, as it was scored; run.model(submodel="x0.5") a sub-model's
    run.evaluate()       # its scores on the run's own test split: accuracy == final_accuracy
    x, y = run.test_data()

    grid = hfl.tune("tune_spaces/quickstart.yaml", out="runs/sweep")   # Ray Tune's ResultGrid
    grid = hfl.load_sweep("runs/sweep")                                 # the same, read back

Overrides are the command line's `section.field=value`: keyword arguments with `__` for the dots
(`fl__rounds=3`), or a dict of dotted keys (`{"fl.rounds": 3}`). Their values are Python values,
checked as the YAML file's are, with the same errors (field, value, what is allowed).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any


from hfl.config import ExperimentConfig, config_from_dict, experiment_values, flatten, read_yaml_mapping
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.yaml_loader import set_dotted

if TYPE_CHECKING:  # Ray stays in hfl.tune and hfl.backends: its ResultGrid is named through hfl.tune.grid
    from torch import Tensor, nn

    from hfl.evaluation import Evaluator
    from hfl.submodel.spec import SubmodelSpec
    from hfl.tune.grid import ResultGrid

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
    """A run folder, read: its config, its metrics by round, its summary, and its models, which it
    builds and evaluates on its own test split with its own transforms."""

    folder: Path
    config: ExperimentConfig
    summary: dict[str, Any] | None
    """summary.json: final and best accuracy, resource totals, violations, ...; None while unfinished."""
    _built: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Device -> (the run's environment and evaluator, its checkpoint): built once, on first use."""

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

    def _build(self, device: str) -> tuple[Evaluator, dict[str, Any]]:
        """The run's data, method and evaluator, and its last checkpoint, as the run built them."""
        if device not in self._built:
            import torch

            from hfl.checkpoint import CHECKPOINT
            from hfl.evaluation import Evaluator
            from hfl.experiment import ClientEnvironment

            checkpoint = self.folder / CHECKPOINT
            if not checkpoint.is_file():
                raise ConfigError("folder", str(self.folder), f"a run folder with a {CHECKPOINT} (none there: the run wrote no round yet)")
            saved = torch.load(checkpoint, map_location=device, weights_only=False)
            self._built[device] = (Evaluator(ClientEnvironment.from_config(self.config, torch.device(device))), saved)
        return self._built[device]

    @property
    def submodels(self) -> list[str]:
        """The names of the sub-models the run scores (`summary["submodel_accuracy"]`'s keys; a method
        without sub-models has none): widths such as `x0.5`, depths, ensemble members."""
        evaluator, saved = self._build("cpu")
        return list(evaluator.env.method.submodels(saved["method_state"]))

    def _spec(self, evaluator: Evaluator, saved: dict[str, Any], submodel: str | None) -> SubmodelSpec:
        method = evaluator.env.method
        if submodel is None:
            return method.global_model_spec(saved["method_state"])
        specs = method.submodels(saved["method_state"])
        if submodel not in specs:
            raise ConfigError("submodel", submodel, f"one of the run's sub-models: {', '.join(specs) or f'none ({method.name} scores only its global model)'}")
        return specs[submodel]

    def _exit_index(self, model: nn.Module, exit: str | None) -> int | None:
        if exit is None:
            return None
        names = [f"exit{b}" for b in getattr(model, "exit_blocks", ())] + (["head"] if getattr(model, "head", None) is not None else [])
        if exit not in names or len(names) < 2:
            raise ConfigError("exit", exit, f"one of the model's exits: {', '.join(names) if len(names) > 1 else 'none (it has one output)'}")
        return names.index(exit)

    def model(self, submodel: str | None = None, exit: str | None = None, device: str = "cpu") -> nn.Module:
        """A model of the last checkpoint as it was scored, in eval mode on `device`: the method's global
        model, or the sub-model `submodel` names (see `submodels`), with its weights, masks and
        batch-norm statistics; `exit` (`exit3`, ..., `head`, as `exit_accuracy` names them): a module
        whose output is that exit's logits. Builds the run's data and method to do so, once."""
        evaluator, saved = self._build(device)
        model = evaluator.scored_model(saved["global_state"], self._spec(evaluator, saved, submodel))
        index = self._exit_index(model, exit)
        return model if index is None else _exit_class()(model, index).eval()

    def evaluate(self, submodel: str | None = None, exit: str | None = None, data: str = "test", device: str = "cpu") -> dict[str, Any]:
        """Scores on the run's test split, with its transforms, as the run scored them: `accuracy` and
        `loss` (and `exit_accuracy`, `ensemble_accuracy`, `perplexity` where the run has them) of the
        global model or of `submodel`; with `exit`, that exit's accuracy as `accuracy`. `evaluate()`
        gives the run's `final_accuracy`; `evaluate(submodel=name)` its `submodel_accuracy[name]`."""
        if data != "test":
            raise ConfigError("data", data, "'test' (the run's own test split)")
        evaluator, saved = self._build(device)
        spec = self._spec(evaluator, saved, submodel)
        scores = evaluator(saved["global_state"], spec)
        index = self._exit_index(evaluator.scored_model(saved["global_state"], spec), exit)
        if index is not None:
            scores = {**scores, "accuracy": list(scores["exit_accuracy"].values())[index]}
            scores.pop("loss")  # the deepest exit's: not this exit's
        return scores

    def test_data(self, device: str = "cpu") -> tuple[Tensor, Tensor]:
        """The run's test split as its models read it: (inputs, targets), the inputs normalised with
        the run's transforms (for text: token windows and their next tokens)."""
        evaluator, _ = self._build(device)
        return evaluator.env.test_x, evaluator.env.test_y


@functools.cache
def _exit_class() -> type:
    """`ExitOf`, defined on first use: `import hfl.api` imports no torch."""
    from torch import nn

    class ExitOf(nn.Module):
        """One exit of a model with several: its output is that exit's logits."""

        def __init__(self, model: nn.Module, index: int) -> None:
            super().__init__()
            self.model, self.index = model, index

        def forward(self, x: Tensor) -> Tensor:
            return self.model.forward_exits(x)[self.index]

    return ExitOf


def tune(sweep: str | os.PathLike, overrides: Sequence[str] | Mapping[str, Any] = (), /, *, out: str | os.PathLike | None = None,
         resume: bool = False, progress: bool = False, **fields: Any) -> ResultGrid:
    """Run a sweep as `hfl tune` does and return Ray Tune's `ResultGrid` (see `hfl.tune.grid.tune`)."""
    from hfl.tune.grid import tune as run_sweep

    return run_sweep(sweep, overrides, out=out, resume=resume, progress=progress, **fields)


def load_sweep(folder: str | os.PathLike) -> ResultGrid:
    """The sweep `hfl tune` (or `hfl.tune`) wrote to `folder` (or a URI), as Ray Tune's `ResultGrid`."""
    from hfl.tune.grid import load_results

    return load_results(folder)


def table(rows: list[dict[str, Any]]) -> Any:
    """`rows` as a pandas DataFrame where pandas is installed (it is no dependency of hfl), else as they are."""
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows)
