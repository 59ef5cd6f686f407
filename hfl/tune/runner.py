"""Run a sweep with Ray Tune; every trial is an ordinary hfl run folder.

Layout of a sweep folder OUT, a local folder or a URI (s3://, gs://, file://; see hfl.storage):

    OUT/sweep.yaml          the validated sweep (a resumed sweep must match it)
    OUT/trials/<trial_id>/  one hfl run per trial: metrics.jsonl, summary.json, config.yaml, checkpoint.pt
    OUT/tune/               Ray Tune's storage: experiment state, per-trial results and checkpoints
    OUT/results.csv         one row per trial: swept values, final and best metric, violations, rounds, status,
                            reason (completed, stopped by asha after round k/N, error: ...), PBT exploits
    OUT/exploits.json       under PBT: each exploit (trial, source trial and round, values before and after)
    OUT/best_config.yaml    the full config of the best trial, runnable with `hfl run`

A trial reports every round to Tune: the global model's accuracy and loss and summary.json's values
as the run stands after the round (worst/mean sub-model accuracy, perplexity, budget violations, ...),
and `objective`, the sweep's metric, or the worst value where `within_budget` holds and the trial broke
a budget. It attaches a Tune checkpoint (hfl's checkpoint.pt,
metrics.jsonl and config.yaml) whenever hfl has written one; a restored trial copies those files
back into its run folder and continues with `run_experiment(..., resume=True)`, which ends with the
same numbers as an uninterrupted run. PBT's exploit takes the same path: Tune hands the trial another
trial's checkpoint and the perturbed values, and the run continues from that round with them (its
metrics.jsonl is the copied trial's up to there).

On a URI (a multi-node cluster under `ray job submit`, whose driver may not outlive the job), no
state that a resume needs stays on the driver's disk: Tune's `storage_path` is the URI itself, where
the trials upload their checkpoints and the driver its experiment state (at Tune's snapshots, so a
crash of the driver costs at most the rounds since, which the restored trials rerun); each trial
stages its run folder on the node it runs on (the driver's disk is not theirs) and copies it to
OUT/trials/<trial_id> after every round, before the round goes to Tune, so that folder is never
behind Tune's records; the driver writes sweep.yaml, results.csv and best_config.yaml to OUT
directly. A local OUT takes the same path (pyarrow opens local paths; `staged` hands a local folder
back as is), and on a multi-node cluster it must be a folder every node shares, as Tune requires.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hfl.config import flatten
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.storage import check_job_location, is_dir, is_uri, join, read_text, staged, write_text
from hfl.tune.space import Sweep, load_sweep, trial_values
from hfl.tune.trial import CONFIG_FILE, FINAL, OBJECTIVE, TrialSetup, make_trainable, swept_config

log = logging.getLogger(__name__)
TUNE_DIR, TRIALS_DIR = "tune", "trials"
PROGRESS_FILE = "progress.csv"  # Tune's records of a trial's results, as a table
SWEEP_FILE, RESULTS_FILE, BEST_CONFIG_FILE, EXPLOITS_FILE = "sweep.yaml", "results.csv", "best_config.yaml", "exploits.json"


@dataclass(frozen=True)
class TuneOutcome:
    """What a sweep produced."""

    out: Path | str
    """The sweep folder; a URI stays a string (a Path would fold its `//`)."""
    best_config: dict[str, Any] | None
    """The full hfl config of the best trial (None when no trial reported a metric)."""
    best_metric: float | None
    """The best trial's final value of `metric`."""
    results: list[dict[str, Any]]
    """One row per trial, as in results.csv."""
    metric: str = "accuracy"
    mode: str = "max"
    best_trial: str | None = None
    """Trial id of the best trial."""
    within_budget: bool = False
    """Whether trials that broke a budget were ranked last (and never best)."""
    interrupted: bool = False
    """Whether a Ctrl-C (SIGINT) ended the sweep early: `--resume` continues it."""

    @property
    def incomplete(self) -> list[str]:
        """Trials that failed or were interrupted: a resumed sweep continues them."""
        return [row["trial_id"] for row in self.results if row["status"] in ("error", "unfinished")]


def trial_dirname(trial: Any) -> str:
    """Tune's folder of a trial is its id, as is its hfl run folder."""
    return str(trial.trial_id)


# -- the driver -----------------------------------------------------------------------------------
def _location(out: str) -> str:
    return out.rstrip("/") if is_uri(out) else str(Path(out).resolve())


def _sweep_folder(sweep: Sweep, out: str | None, resume: bool) -> str:
    """The sweep's location (an absolute folder or a URI), with sweep.yaml written, or checked on resume."""
    if resume:
        if out is None:
            raise ConfigError("out", None, "the folder of the sweep to resume (--out DIR)")
        folder = _location(out)
        text = read_text(join(folder, SWEEP_FILE))
        if text is None or not is_dir(join(folder, TUNE_DIR)):
            raise ConfigError("out", out, f"a sweep folder holding {SWEEP_FILE} and {TUNE_DIR}/ (none found there)")
        saved = flatten(yaml.safe_load(text))
        now = flatten(yaml.safe_load(yaml.safe_dump(sweep.to_dict())))
        changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if changed:
            shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
            raise ConfigError("--resume", out, f"the same sweep and overrides as the sweep being resumed (differs in {shown})")
        return folder
    folder = _location(out or f"runs/tune-{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if is_dir(join(folder, TUNE_DIR)):
        raise ConfigError("out", out, "a folder without a sweep in it (continue that one with --resume)")
    write_text(join(folder, SWEEP_FILE), yaml.safe_dump(sweep.to_dict(), sort_keys=False))
    return folder


def trials_at_once(resources_per_trial: Mapping[str, float], cluster: Mapping[str, float]) -> int:
    """How many trials the cluster's advertised CPUs and GPUs hold at once (at least one)."""
    fits = [cluster.get(kind.upper(), 0.0) / amount for kind, amount in resources_per_trial.items() if amount > 0]
    return max(1, int(min(fits) + 1e-9)) if fits else 1


def _scheduler(sweep: Sweep, folder: str) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = sweep.scheduler
    if s.name == "asha":
        return ASHAScheduler(time_attr="round", max_t=sweep.max_rounds, grace_period=s.grace_period, reduction_factor=s.reduction_factor)
    if s.name == "pbt":
        from hfl.tune.progress import RecordingPBT

        mutations = {key: value for domain in sweep.space.values() for key, value in domain.mutations().items()}
        return RecordingPBT(
            sweep, join(folder, EXPLOITS_FILE), time_attr="round", perturbation_interval=s.perturbation_interval, hyperparam_mutations=mutations,
            quantile_fraction=s.quantile_fraction, resample_probability=s.resample_probability, synch=s.synch,
        )
    return FIFOScheduler()


def _search(sweep: Sweep, concurrency: int) -> Any:
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.basic_variant import BasicVariantGenerator

    seed = int(sweep.base["seed"])  # seeded from the experiment so a sweep samples the same points every time
    if sweep.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(seed=seed), max_concurrent=concurrency)
    return BasicVariantGenerator(max_concurrent=concurrency, random_state=seed)


def _tuner(sweep: Sweep, folder: str, setup: TrialSetup, trainable: Any, resume: bool, concurrency: int) -> Any:
    from ray import tune

    from hfl.tune.dashboard import TrialRuns
    from hfl.tune.progress import TrialProgress

    if resume:  # the scheduler and the callbacks come back as the sweep saved them
        return tune.Tuner.restore(join(folder, TUNE_DIR), trainable, resume_errored=True)
    scheduler = _scheduler(sweep, folder)
    return tune.Tuner(
        trainable,
        param_space={key: value for domain in sweep.space.values() for key, value in domain.to_tune().items()},
        tune_config=tune.TuneConfig(
            metric=OBJECTIVE,
            mode=sweep.mode,
            num_samples=sweep.num_samples,
            scheduler=scheduler,
            search_alg=_search(sweep, concurrency),
            trial_dirname_creator=trial_dirname,
            reuse_actors=True,  # a fresh worker per trial re-imports torch: ~10 s each on 2 cores
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR,
            storage_path=folder,  # a URI too: Tune reads and writes it with pyarrow.fs
            verbose=0,
            # PBT keeps every checkpoint: a trial may clone another's at any time, and Ray, deleting a
            # population's old ones, loses track of a cloned trial's (FileNotFoundError on 2 rounds' sweeps).
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None if sweep.scheduler.name == "pbt" else 2),
            callbacks=[TrialProgress(sweep), TrialRuns(setup, join(folder, EXPLOITS_FILE))],
            stop=FINAL,
        ),
    )


def _status(tune_status: str, rounds_done: int, rounds: int) -> str:
    if tune_status == "ERROR":
        return "error"
    if tune_status == "TERMINATED":
        return "completed" if rounds_done >= rounds else "stopped"  # stopped early by the scheduler
    return "unfinished"  # interrupted sweep: continue it with resume


def _results(sweep: Sweep, setup: TrialSetup) -> list[dict[str, Any]]:
    import pandas
    from ray.tune import ExperimentAnalysis

    from hfl.tune.progress import exploit_text, read_exploits, stop_reason

    analysis = ExperimentAnalysis(setup.tune_dir, default_metric=OBJECTIVE, default_mode=sweep.mode)
    exploits = read_exploits(join(setup.tune_dir.rsplit("/", 1)[0], EXPLOITS_FILE))
    rows = []
    for trial in sorted(analysis.trials, key=lambda t: t.trial_id):
        # The values its run ended with (under PBT the last perturbed ones), as its config.yaml holds them.
        swept = _run_values(join(setup.trials_dir, trial.trial_id, CONFIG_FILE), sweep) or sweep.swept(trial.config)
        frame = _trial_frame(join(setup.tune_dir, trial.trial_id, PROGRESS_FILE))
        final = best = None
        rounds_done = broken = 0
        if frame is not None and not frame.empty and sweep.metric in frame:
            # After a hard kill a restored trial re-reports the rounds after its last checkpoint.
            frame = frame.drop_duplicates("round", keep="last").sort_values("round")
            # a time to accuracy is empty (NaN) until its target is reached: the trial ranks last, unranked
            values = frame[sweep.metric]
            final = None if pandas.isna(values.iloc[-1]) else float(values.iloc[-1])
            reached = values.dropna()
            best = None if reached.empty else float(reached.max() if sweep.mode == "max" else reached.min())
            rounds_done = int(frame["round"].iloc[-1])
            broken = int(frame["violations"].iloc[-1])
        rounds = int(trial_values(setup.base, swept)["fl"]["rounds"])
        error = None
        if trial.status == "ERROR":
            error_file = join(setup.tune_dir, trial.trial_id, "error.txt")
            lines = (read_text(error_file) or "(no error.txt)").strip().splitlines()
            error = lines[-1]
            log.warning("trial %s failed: %s (traceback in %s)", trial.trial_id, error, error_file)
        rows.append({
            "trial_id": trial.trial_id,
            **swept,
            sweep.metric: final,
            f"best_{sweep.metric}": best,
            "violations": broken,
            "rounds": rounds_done,
            "status": _status(trial.status, rounds_done, rounds),
            "reason": stop_reason(sweep, trial.status, rounds_done, rounds, error),
            "exploits": "; ".join(exploit_text(e) for e in exploits.get(trial.trial_id, [])),
            "run_dir": join(setup.trials_dir, trial.trial_id),
        })
    return rows


def _run_values(config_file: str, sweep: Sweep) -> dict[str, Any] | None:
    """Config path -> value of the swept paths in a trial's config.yaml (None before it wrote one)."""
    text = read_text(config_file)
    if not text:
        return None
    values = yaml.safe_load(text)
    swept = {}
    for path in sweep.space:
        node = values
        for part in path.split("."):
            node = node[part]
        swept[path] = list(node) if isinstance(node, tuple) else node
    return swept


def _trial_frame(progress_file: str) -> Any:
    """A trial's reported rounds from Tune's progress.csv (None before any). Not its result.json:
    a trial PBT pauses and restarts gets that file copied onto itself, which empties it where the
    sweep folder is local (Ray 2.60), while progress.csv keeps every round."""
    import pandas

    text = read_text(progress_file)
    return pandas.read_csv(io.StringIO(text)) if text and text.strip() else None


def ranked(rows: list[dict[str, Any]], metric: str, mode: str, within_budget: bool) -> list[dict[str, Any]]:
    """Trials that reported `metric`, best first; with `within_budget`, those that broke a budget last."""
    scored = [r for r in rows if r[metric] is not None]
    sign = -1.0 if mode == "max" else 1.0
    return sorted(scored, key=lambda r: (within_budget and r["violations"] > 0, sign * r[metric]))


def _summarise_stopped(setup: TrialSetup, rows: list[dict[str, Any]]) -> None:
    """summary.json for trials a scheduler stopped early (they never reach the run's end, which writes
    it), so `hfl report OUT/trials/*` reads them as finished runs of fewer rounds."""
    from hfl.config import load_config
    from hfl.server import SUMMARY, summarise

    for row in rows:
        if row["status"] != "stopped":
            continue
        with staged(row["run_dir"], "--out") as (run_dir, push):
            if (run_dir / SUMMARY).is_file() or not (run_dir / CONFIG_FILE).is_file():
                continue
            elapsed = sum(line["wall_seconds"] for line in read_metrics(run_dir))
            summary = summarise(run_dir, load_config(run_dir / CONFIG_FILE), elapsed)
            (run_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
            push()


def _write_results(folder: str, rows: list[dict[str, Any]]) -> None:
    table = io.StringIO(newline="")
    if rows:
        writer = csv.DictWriter(table, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_text(join(folder, RESULTS_FILE), table.getvalue())


class _Interruption(logging.Filter):
    """Notes Tune's Ctrl-C and drops its lines about it, whose resume hint (`Tuner.restore(...)`) is
    not hfl's (`hfl tune ... --resume`, which the caller prints)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Stop signal received"):
            self.seen = True
            return False
        return "has been interrupted" not in message and "Tuner.restore" not in message


def _start_ray() -> bool:
    import ray

    if ray.is_initialized():
        return False
    # Joins the cluster in RAY_ADDRESS (set by `ray job submit`) or one started here by `ray start`;
    # with neither, starts a local one. Trial output stays in the trials' folders.
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


def run_tune(space_file: str, overrides: Sequence[str] = (), out: str | None = None, resume: bool = False) -> TuneOutcome:
    """Run the sweep in `space_file` (or continue the interrupted one in `out`); see the module docstring.

    `overrides` (`key=value`) apply to the base experiment after the sweep file's own overrides.
    Progress goes to the `hfl.tune.progress` logger (`hfl.tune.show_progress` prints it).
    """
    check_job_location(out, "--out")  # before the default folder, which is relative
    sweep = load_sweep(space_file, overrides)
    folder = _sweep_folder(sweep, out, resume)
    setup = TrialSetup(sweep.base, join(folder, TRIALS_DIR), join(folder, TUNE_DIR), group=folder.rsplit("/", 1)[-1],
                       space=sweep.space, metric=sweep.metric, mode=sweep.mode, within_budget=sweep.within_budget)
    # Keep Ray Tune off the console (the CLI prints progress and the results table): its new output
    # engine prints an experiment banner even at verbose=0, and every forced state snapshot (Tune forces
    # one when a trial has checkpointed num_to_keep times, i.e. every other round here) warns once it is frequent.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    started = _start_ray()
    interruption = _Interruption()
    tune_log = logging.getLogger("ray.tune.tune")
    tune_log.addFilter(interruption)
    try:
        import ray
        from ray import tune

        from hfl.tune.progress import PROGRESS

        # From what the cluster advertises, not the driver's machine (a CPU head may drive GPU nodes).
        concurrency = sweep.max_concurrent_trials or trials_at_once(sweep.resources_per_trial, ray.cluster_resources())
        PROGRESS.info("sweep %s -> %s: %s by %s (%s), up to %d trial(s) at once, %s", sweep.name, folder, sweep.search,
                      sweep.metric, sweep.mode, concurrency, "resumed" if resume else f"scheduler {sweep.scheduler.name}")
        trainable = tune.with_resources(make_trainable(setup), dict(sweep.resources_per_trial))
        _tuner(sweep, folder, setup, trainable, resume, concurrency).fit()
        rows = _results(sweep, setup)
    finally:
        tune_log.removeFilter(interruption)
        if started:
            import ray

            ray.shutdown()

    _summarise_stopped(setup, rows)
    _write_results(folder, rows)
    order = ranked(rows, sweep.metric, sweep.mode, sweep.within_budget)
    best = order[0] if order and not (sweep.within_budget and order[0]["violations"]) else None
    best_config = None
    if best is not None:
        config = swept_config(setup, {p: best[p] for p in sweep.space}, best["trial_id"])
        best_config = config.to_dict()
        write_text(join(folder, BEST_CONFIG_FILE), yaml.safe_dump(best_config, sort_keys=False))
    return TuneOutcome(
        folder if is_uri(folder) else Path(folder),
        best_config, best[sweep.metric] if best else None, rows, sweep.metric, sweep.mode, best["trial_id"] if best else None,
        sweep.within_budget, interruption.seen,
    )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_cell(v) for v in value) + "]"
    return "-" if value is None else str(value)


def format_results(outcome: TuneOutcome) -> str:
    """A plain-text table of the trials, then the best trial and where the files are."""
    if not outcome.results:
        return f"no trials ran; sweep folder {outcome.out}"
    headers = list(outcome.results[0])
    cells = [headers]
    for row in outcome.results:
        shown = dict(row, run_dir=join(TRIALS_DIR, row["trial_id"]))
        cells.append([_cell(shown[h]) for h in headers])
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = str(outcome.out)
    if outcome.best_trial is not None:
        lines.append(f"\nbest: {outcome.best_trial}  {outcome.metric}={_cell(outcome.best_metric)} ({outcome.mode})")
        config = join(out, BEST_CONFIG_FILE)
        # `hfl run` reads a local file: a URI's copy is fetched first.
        lines.append(f"config: {config}   ({'copy it here, then hfl run ' + BEST_CONFIG_FILE if is_uri(out) else 'hfl run ' + config})")
    elif outcome.within_budget and any(r["violations"] for r in outcome.results):
        lines.append(f"\nno trial kept its budgets (within_budget: true); the violations column counts the client-rounds over budget")
    else:
        lines.append(f"\nno trial reported {outcome.metric}")
    broken = [r["trial_id"] for r in outcome.results if r["violations"]]
    if outcome.within_budget and broken:
        lines.append(f"{len(broken)} trial(s) broke a budget and rank last: {', '.join(broken)}")
    lines.append(f"results: {join(out, RESULTS_FILE)}")
    if outcome.incomplete:
        lines.append(f"{len(outcome.incomplete)} trial(s) did not finish ({', '.join(outcome.incomplete)}); "
                     f"continue the sweep with --resume --out {outcome.out}")
    return "\n".join(lines)
