"""Inside a Tune trial: one hfl run in its trial folder, reporting every round to Tune (with hfl's
checkpoint on checkpoint rounds) and restoring from Tune's checkpoint when Tune restarts it or PBT
hands it another trial's. The driver that starts the trials is `hfl.tune.runner`, whose docstring
describes the sweep folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfl.checkpoint import CHECKPOINT
from hfl.config import ExperimentConfig, config_from_dict
from hfl.loggers import METRICS, read_metrics
from hfl.storage import join, read_text, staged
from hfl.tune.space import TIME_OBJECTIVES, Domain, trial_values

log = logging.getLogger(__name__)
RESULT_FILE = "result.json"  # Tune's record of a trial's results, a JSON line each
CONFIG_FILE, SUMMARY_FILE = "config.yaml", "summary.json"
OBJECTIVE = "objective"
"""The key Tune ranks by: the sweep's metric, or the worst value for a trial out of budget (`within_budget`)."""
FINAL = {"final_round": 1}
"""Tune's stop criterion: a trial's last round, reported once its run has ended (see TuneReporter)."""
WORST = {"max": -sys.float_info.max, "min": sys.float_info.max}
"""What a trial out of budget reports as `objective`: finite, so ASHA's quantiles and PBT's ranking stay numbers."""


@dataclass(frozen=True)
class TrialSetup:
    """What every trial needs, shipped to the Ray workers with the trainable."""

    base: dict[str, Any]
    """The sweep's resolved base config dict."""
    trials_dir: str
    """Absolute folder or URI holding the trials' run folders."""
    tune_dir: str
    """Absolute folder or URI of Ray Tune's storage: a trial's records are in <tune_dir>/<trial_id>/."""
    group: str
    """The sweep's name: the wandb group of every trial."""
    space: dict[str, Domain] = field(default_factory=dict)
    """The sweep's space: turns a trial's Tune config into config path -> value."""
    metric: str = "accuracy"
    mode: str = "max"
    within_budget: bool = False

    def swept(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Config path -> value of a trial whose Tune config is `params`."""
        if not self.space:
            return dict(params)
        return {path: domain.value(params) for path, domain in self.space.items() if all(k in params for k in domain.tune_keys)}


def trial_config(setup: TrialSetup, params: Mapping[str, Any], trial_id: str) -> ExperimentConfig:
    """Base config + the trial's sampled values (its Tune config), named after the trial and grouped under the sweep."""
    return swept_config(setup, setup.swept(params), trial_id)


def swept_config(setup: TrialSetup, swept: Mapping[str, Any], trial_id: str) -> ExperimentConfig:
    """Base config + config path -> value, named after the trial and grouped under the sweep."""
    values = trial_values(setup.base, swept)
    values["name"] = f"{values['name']}-{trial_id}"
    if values["logging"]["wandb"]:
        values["logging"]["wandb_group"] = setup.group
    return config_from_dict(values)


def round_scores(summary: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a summary (as summary.json holds them after a round) that a sweep can rank by.

    A method without sub-models trains one model that every client holds: its worst and mean
    sub-model accuracy are that model's, so a sweep over methods ranks FedAvg beside HeteroFL.
    A run with devices adds its simulated-time scores as `time_to_accuracy:0.9` and
    `accuracy_at_time:20` (TIME_OBJECTIVES), None while the target is not reached (no round scored
    by the point): present from the first round, so every round reports them."""
    scores = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rounds"}
    for name in TIME_OBJECTIVES:
        scores.update((f"{name}:{key}", value) for key, value in (summary.get(name) or {}).items())
    if summary.get("final_accuracy") is not None and "worst_submodel_accuracy" not in summary:
        scores["worst_submodel_accuracy"] = scores["mean_submodel_accuracy"] = summary["final_accuracy"]
    if "final_accuracy" in scores:
        scores["accuracy"], scores["loss"] = scores["final_accuracy"], scores["final_loss"]
    return scores


def violations(scores: Mapping[str, Any]) -> int:
    """Client-rounds that broke a memory, FLOPs or upload budget."""
    return int(sum(scores.get(k, 0) for k in ("budget_violations", "flops_violations", "upload_violations")))


def objective(scores: Mapping[str, Any], metric: str, mode: str, within_budget: bool) -> float:
    """What Tune ranks a trial by: `metric`, or the worst value where a budget constraint is broken or
    the metric is None (a time to accuracy whose target is not reached)."""
    broken = within_budget and violations(scores)
    return WORST[mode] if broken or scores[metric] is None else float(scores[metric])


def _link_or_copy(source: Path, target: Path) -> None:
    # checkpoint.pt is replaced by rename, never rewritten in place, so a hard link is a stable snapshot.
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


class TuneReporter:
    """Round callback that reports every round to Ray Tune, with hfl's checkpoint on checkpoint rounds.

    hfl writes a round's line and checkpoint before it calls the callbacks, so the scores are
    summary.json's as the run stands after this round, and the checkpoint handed to Tune is that
    round's. Rounds without evaluation carry the last evaluation's scores; rounds before the first
    evaluation are not reported (Tune requires the metric in every result). Rounds up to
    `recorded_upto` are not reported again: a restored trial replays them (see `recorded_rounds`).

    The last round is reported when the run has ended (summary.json written),
    marked `final_round`, which stops the trial (`FINAL`): no scheduler acts on it, so PBT never
    replaces a finished run by another trial's.
    """

    def __init__(self, setup: TrialSetup, config: ExperimentConfig, run_dir: Path, recorded_upto: int = 0) -> None:
        self.setup, self.config, self.run_dir, self.recorded_upto = setup, config, run_dir, recorded_upto
        self.final: dict[str, Any] | None = None

    def on_round(self, record: dict[str, Any]) -> None:
        from hfl.server import summarise

        r, fl, setup = record["round"], self.config.fl, self.setup
        if r <= self.recorded_upto:
            return
        elapsed = sum(line["wall_seconds"] for line in read_metrics(self.run_dir))
        scores = round_scores(summarise(self.run_dir, self.config, elapsed))
        if setup.metric not in scores:
            return
        metrics = {"round": r, OBJECTIVE: objective(scores, setup.metric, setup.mode, setup.within_budget), **scores,
                   "violations": violations(scores), "evaluated": record["accuracy"] is not None, "final_round": int(fl.ends_run(r, record.get("sim_end_s")))}
        if metrics["final_round"]:
            self.final = metrics
        else:
            self._report(metrics, checkpoint=r % fl.checkpoint_every == 0)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.final is not None:
            self._report(self.final, checkpoint=True)

    def _report(self, metrics: dict[str, Any], checkpoint: bool) -> None:
        from ray import tune

        if not checkpoint:
            tune.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="hfl-tune-") as folder:
            snapshot = Path(folder)
            _link_or_copy(self.run_dir / CHECKPOINT, snapshot / CHECKPOINT)
            shutil.copy2(self.run_dir / CONFIG_FILE, snapshot / CONFIG_FILE)
            shutil.copy2(self.run_dir / METRICS, snapshot / METRICS)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))


class Upload:
    """Round callback that copies a staged run folder to its URI after every round (a no-op for a
    local folder); `staged` copies it once more when the run ends."""

    def __init__(self, push: Callable[[], None]) -> None:
        self.push = push

    def on_round(self, record: dict[str, Any]) -> None:
        self.push()

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


def _restore_into(run_dir: Path) -> bool:
    """Copy the trial's latest Tune checkpoint into its run folder; whether there is a run to resume."""
    from ray import tune

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return False
    # Tune's copy wins over whatever the run folder holds: it is the state Tune's records end at
    # (the folder may be a round ahead, or on another node).
    with checkpoint.as_directory() as folder:
        _keep_replaced_rounds(Path(folder), run_dir)
        for name in (CHECKPOINT, METRICS, CONFIG_FILE):
            shutil.copy2(Path(folder) / name, run_dir / name)
    return True


def _keep_replaced_rounds(checkpoint: Path, run_dir: Path) -> None:
    """Before PBT's exploit replaces a trial's history with the cloned trial's, keep the trial's own
    rounds as metrics.pbt-<n>.jsonl (n: its n-th exploit): its wandb run holds them (`hfl.tune.dashboard`)."""
    import yaml

    own, theirs = run_dir / CONFIG_FILE, checkpoint / CONFIG_FILE
    if not own.is_file() or not (run_dir / METRICS).is_file():
        return
    if yaml.safe_load(own.read_text())["name"] != yaml.safe_load(theirs.read_text())["name"]:  # a trial's name holds its id
        shutil.copy2(run_dir / METRICS, run_dir / f"metrics.pbt-{len(list(run_dir.glob('metrics.pbt-*.jsonl'))) + 1}.jsonl")


def recorded_rounds(result_file: str) -> int:
    """The last round Tune recorded for a trial (0: none, or its records are not on this node).

    Tune takes a reported round in two steps: the result (the trial's `last_result`, a line of
    result.json) and then, from a separate call to the trial, the checkpoint reported with it. A
    sweep stopped between the two (a Ctrl-C) saves a state whose last checkpoint is a round older
    than its last result (or none at all), and the restored trial replays that round: hfl's runs are deterministic,
    so the replay reproduces it, and the reporter leaves it out instead of Tune recording it twice."""
    text = read_text(result_file) or ""
    rounds = [json.loads(line).get("round", 0) for line in text.splitlines() if line.strip()]
    return max(rounds, default=0)


def run_trial(setup: TrialSetup, params: dict[str, Any]) -> None:
    """One Tune trial: an hfl run in TRIALS_DIR/<trial_id>, reporting each round."""
    from ray import tune

    from hfl.server import run_experiment

    trial_id = tune.get_context().get_trial_id()
    config = trial_config(setup, params, trial_id)
    location = join(setup.trials_dir, trial_id)
    # On a URI the run folder is staged on this trial's node (the driver's is another node's disk).
    with staged(location, "--out") as (run_dir, push):
        run_dir.mkdir(parents=True, exist_ok=True)
        resume = _restore_into(run_dir)
        # Also without a checkpoint: a Ctrl-C between round 1's result and its checkpoint restarts the
        # trial from scratch, and its replayed round 1 is already Tune's.
        recorded = recorded_rounds(join(setup.tune_dir, trial_id, RESULT_FILE))
        log.info("trial %s: %s in %s%s", trial_id, params, location, f" (resumed; Tune holds rounds up to {recorded})" if resume else "")
        # The sweep's driver logs the trial's wandb run (hfl.tune.dashboard): a worker's run is lost when
        # Ray pauses or stops the trial (so the trial's config.yaml says wandb: false; best_config.yaml keeps the sweep's).
        quiet = dataclasses.replace(config, logging=dataclasses.replace(config.logging, wandb=False))
        # Upload first: Tune may end the trial inside the report (a scheduler's stop, a Ctrl-C).
        run_experiment(quiet, run_dir, resume=resume, callbacks=[Upload(push), TuneReporter(setup, config, run_dir, recorded)])


def make_trainable(setup: TrialSetup) -> Callable[[dict[str, Any]], None]:
    def hfl_trial(params: dict[str, Any]) -> None:
        run_trial(setup, params)

    return hfl_trial
