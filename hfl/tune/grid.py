"""Sweeps from Python: `hfl.tune(...)` runs one and gives Ray Tune's `ResultGrid`; `hfl.load_sweep(OUT)`
reads a finished (or interrupted) sweep folder back as one. Ray is imported when they are called."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hfl.errors import ConfigError
from hfl.storage import is_dir, is_uri, join, read_text
from hfl.tune.runner import SWEEP_FILE, TUNE_DIR, run_tune
from hfl.tune.trial import OBJECTIVE

if TYPE_CHECKING:
    from ray.tune import ResultGrid


def tune(sweep: str | os.PathLike, overrides: Sequence[str] | Mapping[str, Any] = (), /, *, out: str | os.PathLike | None = None,
         resume: bool = False, progress: bool = False, **fields: Any) -> ResultGrid:
    """Run a sweep (a file in tune_spaces/), as `hfl tune` does, and return Ray Tune's `ResultGrid`:
    one `Result` per trial, its `metrics` the last round it reported (`objective`, `accuracy`,
    `worst_submodel_accuracy`, ...), `metrics_dataframe` every round, `config` its Tune values and
    `path` its Tune folder; the trial's hfl run folder is OUT/trials/<trial id>. `overrides` and
    `fields` change the base experiment as `hfl.run` takes them; `progress`: a line per trial and round."""
    from hfl.tune.progress import show_progress  # imports Ray

    dotted = dict(overrides) if isinstance(overrides, Mapping) else dict(o.split("=", 1) for o in overrides)
    dotted.update({key.replace("__", "."): value for key, value in fields.items()})
    if progress:
        show_progress()
    outcome = run_tune(str(sweep), [f"{k}={v}" for k, v in dotted.items()], out=None if out is None else str(out), resume=resume)
    return load_results(outcome.out)


def load_results(folder: str | os.PathLike) -> ResultGrid:
    """The sweep `hfl tune` (or `hfl.tune`) wrote to `folder` (or a URI), as Ray Tune's `ResultGrid`."""
    from ray.tune import ExperimentAnalysis, ResultGrid

    location = str(folder).rstrip("/") if is_uri(str(folder)) else str(Path(folder).resolve())
    if not is_dir(join(location, TUNE_DIR)):
        raise ConfigError("folder", str(folder), f"a sweep folder, as hfl tune --out writes it, holding {TUNE_DIR}/")
    mode = yaml.safe_load(read_text(join(location, SWEEP_FILE)) or "{}").get("mode", "max")
    return ResultGrid(ExperimentAnalysis(join(location, TUNE_DIR), default_metric=OBJECTIVE, default_mode=mode))
