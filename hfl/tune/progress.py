"""A sweep's progress while it runs: one line per round a trial reports, and one when a trial ends.

Lines go to the `hfl.tune.progress` logger from a Tune callback in the driver, so they appear from the
first reported round, whichever node the trial runs on; the CLI shows them (`show_progress`), a
library caller may route them anywhere. The callback keeps no handle to a stream: Tune pickles it
with the sweep's state and a resumed sweep restores it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import IO, Any

from ray import tune

from hfl.report import short_value
from hfl.tune.space import Sweep

PROGRESS = logging.getLogger("hfl.tune.progress")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (a test's captured stream is closed later)."""

    @property
    def stream(self) -> IO[str]:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _: IO[str]) -> None:
        pass


def show_progress() -> None:
    """Print the progress lines on stderr (once, whatever the root logger's level; not twice with -v)."""
    if not any(isinstance(h, _StderrHandler) for h in PROGRESS.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        PROGRESS.addHandler(handler)
    PROGRESS.setLevel(logging.INFO)
    PROGRESS.propagate = False


def trial_label(sweep: Sweep, trial_id: str, params: Mapping[str, Any]) -> str:
    """`<trial id> path=value ...`: the trial's swept values, a dirichlet's shares resolved."""
    swept = sweep.swept(params)
    return " ".join([trial_id, *(f"{path}={short_value(value, 4)}" for path, value in swept.items())])


def round_line(sweep: Sweep, trial_id: str, params: Mapping[str, Any], result: Mapping[str, Any], rounds: int) -> str:
    """One reported round: the sweep's metric, the global model's accuracy and the budget violations so far."""
    parts = [f"round {result['round']}/{rounds}", f"{sweep.metric} {short_value(result.get(sweep.metric), 4)}"]
    if sweep.metric != "accuracy" and result.get("accuracy") is not None:
        parts.append(f"accuracy {short_value(result['accuracy'], 4)}")
    parts.append(f"violations {result.get('violations', 0)}")
    return f"{trial_label(sweep, trial_id, params)}: " + "  ".join(parts)


class TrialProgress(tune.Callback):
    """Logs every result a trial reports, and how each trial ended."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        rounds = int(self.sweep.trial_values(trial.config)["fl"]["rounds"])
        PROGRESS.info("%s", round_line(self.sweep, trial.trial_id, trial.config, result, rounds))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        PROGRESS.info("%s: ended after round %s", trial_label(self.sweep, trial.trial_id, trial.config), trial.last_result.get("round", 0))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        PROGRESS.info("%s: failed (see the sweep's results)", trial_label(self.sweep, trial.trial_id, trial.config))
