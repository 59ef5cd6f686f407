"""One wandb run per trial, logged by the sweep's driver from the trial's own metrics.jsonl.

The driver outlives every trial: Ray pausing, stopping or exploiting a trial ends its worker, which
would abandon a wandb run the worker held (rounds lost, an empty run at every restart); the driver
instead logs a trial's rounds as Tune receives them (the trial writes its round's line before it
reports it) and finishes the trial's run when the trial ends. Under PBT the rounds a trial inherits
from the trial it clones are not logged again where the trial had already logged its own (those stay
in `metrics.pbt-<k>.jsonl`, see `hfl.tune.trial`); the exploit is marked at its round (`pbt/exploit`,
`pbt/source_round`), in the run's config (`pbt`) and rounds inherited beyond what the trial had run
carry `pbt/inherited`. Sweep-file URIs: the runs go to `$WANDB_DIR/hfl-wandb/<sweep>/<trial>` on the
driver (a URI is no folder wandb can write).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ray import tune

from hfl.loggers import METRICS, WandbLogger, existing_wandb_id
from hfl.storage import is_uri, join, read_text
from hfl.scores import RoundScores
from hfl.tune.progress import read_exploits
from hfl.tune.trial import SUMMARY_FILE, TrialSetup, swept_config

log = logging.getLogger(__name__)


def trial_records(location: str) -> list[dict[str, Any]]:
    """The complete lines of a trial's metrics.jsonl, on a local folder or a URI."""
    text = (read_text(join(location, METRICS)) or "").rpartition("\n")[0]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class TrialRuns(tune.Callback):
    """Tune callback: a wandb run per trial (see the module docstring). `exploits`: the sweep's
    exploits.json, where PBT's exploits are recorded (`hfl.tune.progress.RecordingPBT`)."""

    def __init__(self, setup: TrialSetup, exploits: str) -> None:
        self.sweep_setup, self.exploits = setup, exploits
        self.logged: dict[str, int] = {}
        """Trial id -> the last round its wandb run holds."""
        self.marked: dict[str, int] = {}
        """Trial id -> how many of its exploits its run marks."""
        self._runs: dict[str, WandbLogger] = {}

    def __getstate__(self) -> dict[str, Any]:  # Tune saves its callbacks with the sweep; open runs are not state
        return {**self.__dict__, "_runs": {}}

    def _folder(self, trial_id: str) -> Path:
        location = join(self.sweep_setup.trials_dir, trial_id)
        if not is_uri(location):
            return Path(location)
        return Path(os.environ.get("WANDB_DIR", ".")).resolve() / "hfl-wandb" / self.sweep_setup.group / trial_id

    def _run(self, trial: Any, before: list[dict[str, Any]]) -> WandbLogger:
        """The trial's open run; `before`: the rounds it already holds (a resumed sweep's)."""
        trial_id = trial.trial_id
        if trial_id not in self._runs:
            config = swept_config(self.sweep_setup, self.sweep_setup.swept(trial.config), trial_id)
            folder = self._folder(trial_id)
            folder.mkdir(parents=True, exist_ok=True)
            # a resumed sweep: its runs go on under the ids they had
            resumed = trial_id in self.logged or existing_wandb_id(folder) is not None
            self._runs[trial_id] = WandbLogger(config, folder, resume=resumed, swept=self.sweep_setup.swept(trial.config), records=before)
        return self._runs[trial_id]

    def _log(self, trial: Any, upto: int | None) -> None:
        if not self.sweep_setup.base["logging"]["wandb"]:
            return
        trial_id, location = trial.trial_id, join(self.sweep_setup.trials_dir, trial.trial_id)
        records = trial_records(location)
        last = self.logged.get(trial_id, 0)
        fresh = [r for r in records if last < r["round"] <= (upto if upto is not None else records[-1]["round"] if records else 0)]
        if not fresh:
            return
        run = self._run(trial, [r for r in records if r["round"] <= last])
        # An exploit counts once the trial's folder holds the cloned history (the trial kept its own
        # as metrics.pbt-<n>.jsonl): the scheduler decides it rounds before the trial restarts.
        events, applied = read_exploits(self.exploits).get(trial_id, []), self.marked.get(trial_id, 0)
        while applied < len(events) and read_text(join(location, f"metrics.pbt-{applied + 1}.jsonl")) is not None:
            applied += 1
        new_events = events[self.marked.get(trial_id, 0):applied]
        if new_events:
            run.run.config.update({"pbt": events[:applied]}, allow_val_change=True)
            self.marked[trial_id] = applied
            # The violations so far continue from the lineage the trial now holds.
            run.scores = RoundScores([r for r in records if r["round"] <= last])
        inherited_upto = max((e["round"] for e in new_events), default=0)
        for record in fresh:
            extra: dict[str, Any] = {}
            if record["round"] <= inherited_upto:
                extra["pbt/inherited"] = 1
            if new_events and record is fresh[0]:
                extra.update({"pbt/exploit": 1, "pbt/source_round": new_events[-1]["round"]})
            run.on_round(record, extra)
            self.logged[trial_id] = record["round"]

    def _finish(self, trial: Any) -> None:
        run = self._runs.pop(trial.trial_id, None)
        if run is None:
            return
        summary_text = read_text(join(self.sweep_setup.trials_dir, trial.trial_id, SUMMARY_FILE))
        if summary_text:
            run.on_end(json.loads(summary_text))
        else:
            run.close()

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        self._log(trial, result.get("round"))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._log(trial, None)
        self._finish(trial)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._log(trial, None)
        self._finish(trial)

    def close(self) -> None:
        """Finish every open run (the sweep ended, or was interrupted: a resumed sweep goes on in them)."""
        for run in self._runs.values():
            run.close()
        self._runs.clear()

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.close()
