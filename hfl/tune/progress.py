"""A sweep's progress while it runs: one line per round a trial reports, one when PBT's exploit
hands a trial another trial's checkpoint and new values, and one when a trial ends, saying why
(completed, stopped by ASHA, failed) and how many of the sweep's trials are done.

Lines go to the `hfl.tune.progress` logger from a Tune callback in the driver, so they appear from the
first reported round, whichever node the trial runs on; the CLI shows them (`show_progress`), a
library caller may route them anywhere. The callback keeps no handle to a stream: Tune pickles it
with the sweep's state and a resumed sweep restores it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from typing import IO, Any

from ray import tune
from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining

from hfl.report import short_value
from hfl.storage import read_text, write_text
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


def total_trials(sweep: Sweep) -> int:
    """The sweep's trials: its samples, each crossing every grid."""
    total = sweep.num_samples
    for domain in sweep.space.values():
        total *= len(domain.values) if domain.kind == "grid" else 1
    return total


def stop_reason(sweep: Sweep, status: str, rounds_done: int, rounds: int, error: str | None = None) -> str:
    """Why a trial ended, in words: `completed`, `stopped by asha after round 2/4`, `error: ...`, `unfinished`."""
    if status == "ERROR":
        return f"error: {error or 'see the trial error.txt'}"
    if status == "TERMINATED":
        return "completed" if rounds_done >= rounds else f"stopped by {sweep.scheduler.name} after round {rounds_done}/{rounds}"
    return "unfinished"


def read_exploits(location: str) -> dict[str, list[dict[str, Any]]]:
    """Trial id -> its PBT exploits, as a sweep's exploits.json holds them (none: {})."""
    text = read_text(location)
    return json.loads(text) if text else {}


def exploit_text(event: Mapping[str, Any]) -> str:
    """`from <trial>'s round k: path a -> b`: one PBT exploit."""
    changed = [f"{p} {short_value(event['from'].get(p), 4)} -> {short_value(v, 4)}" for p, v in event["to"].items()]
    return f"from {event['source']}'s round {event['round']}: {', '.join(changed) or 'no value perturbed'}"


class RecordingPBT(PopulationBasedTraining):
    """Tune's PBT that also records each exploit (the trial, the trial it cloned and at which round,
    the swept values before and after) in `exploits`, written to `record_to` (the sweep's
    exploits.json: results.csv and the trials' wandb runs read it), and logs it as a progress line.
    A trial exploited while Tune was still saving it runs all its rounds, as every other does (see `_exploit`)."""

    def __init__(self, sweep: Sweep, record_to: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sweep, self.record_to = sweep, record_to
        self.exploits: dict[str, list[dict[str, Any]]] = {}

    def _exploit(self, tune_controller: Any, trial: Trial, trial_to_clone: Trial) -> None:
        before = self.sweep.swept(trial.config)
        source_round = int((self._trial_state[trial_to_clone].last_result or {}).get("round", 0))
        # Synchronous PBT pauses a trial that reaches the perturbation round before the others with a
        # save; a trial exploited before that save is back is paused again, and Tune (2.60) drops the
        # save but keeps the STOP it cached for it (ray-project/ray#57906; fix proposed in #61448),
        # which ended the restarted trial at its next save: round 3 of 4, TERMINATED, no error.
        saving = trial.status == Trial.RUNNING and trial.is_saving
        super()._exploit(tune_controller, trial, trial_to_clone)
        if saving and trial.status == Trial.PAUSED:
            # pause_trial forgets the trial's cached decision; a paused trial without an actor stays as it is.
            tune_controller.pause_trial(trial, should_checkpoint=False)
        event = {"trial": trial.trial_id, "source": trial_to_clone.trial_id, "round": source_round,
                 "from": before, "to": self.sweep.swept(trial.config)}
        self.exploits.setdefault(trial.trial_id, []).append(event)
        write_text(self.record_to, json.dumps(self.exploits, indent=1) + "\n")
        PROGRESS.info("%s: PBT exploit: continues %s", trial.trial_id, exploit_text(event))


class TrialProgress(tune.Callback):
    """Logs every result a trial reports, and how each trial ended."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        rounds = int(self.sweep.trial_values(trial.config)["fl"]["rounds"])
        PROGRESS.info("%s", round_line(self.sweep, trial.trial_id, trial.config, result, rounds))

    def _done(self, trials: list, ending: Any) -> str:
        # The ending trial may not be marked yet; a resumed sweep's trials that ended before count too.
        done = {t.trial_id for t in trials if t.status in (Trial.TERMINATED, Trial.ERROR)} | {ending.trial_id}
        return f"({len(done)} / {total_trials(self.sweep)} trials done)"

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        rounds = int(self.sweep.trial_values(trial.config)["fl"]["rounds"])
        reason = stop_reason(self.sweep, "TERMINATED", int(trial.last_result.get("round", 0)), rounds)
        PROGRESS.info("%s: %s %s", trial_label(self.sweep, trial.trial_id, trial.config), reason, self._done(trials, trial))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        try:  # the error's last line, as results.csv's reason holds it
            error = str(trial.get_error()).strip().splitlines()[-1]
        except Exception:  # noqa: BLE001 (Ray's record of the error may be unreadable; the line still says the trial failed)
            error = None
        rounds = int(self.sweep.trial_values(trial.config)["fl"]["rounds"])
        reason = stop_reason(self.sweep, "ERROR", int((trial.last_result or {}).get("round", 0)), rounds, error)
        PROGRESS.info("%s: %s (after round %s) %s", trial_label(self.sweep, trial.trial_id, trial.config), reason,
                      (trial.last_result or {}).get("round", 0), self._done(trials, trial))
