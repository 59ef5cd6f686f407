"""The round loop: sample a cohort, plan, train, aggregate, evaluate, log and checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfl.checkpoint import RunState, has_checkpoint, load_checkpoint, save_checkpoint
from hfl.config import ExperimentConfig, dump_config
from hfl.errors import ConfigError
from hfl.evaluation import Evaluator
from hfl.experiment import ClientEnvironment, train_settings
from hfl.loggers import MetricsWriter, RoundCallback, WandbLogger, read_metrics
from hfl.methods.base import record_trained
from hfl.registry import BACKENDS
from hfl.scores import over_budget
from hfl.seeding import COHORT_STREAM, MODEL_STREAM, derive_seed
from hfl.simulation.devices import Device, assign_devices
from hfl.simulation.estimate import meets_deadline
from hfl.simulation.fedbuff import FedBuffRounds, refuse_stale_server_steps
from hfl.simulation.policy import SyncRounds
from hfl.storage import check_job_location, staged
from hfl.types import ClientTask, RoundContext, TrainSettings

log = logging.getLogger(__name__)
SUMMARY = "summary.json"


def sample_cohort(config: ExperimentConfig, round_: int) -> list[int]:
    """Clients of round `round_`: a fraction of all, drawn from a generator seeded by (seed, round)."""
    k = config.fl.clients
    m = max(1, round(config.fl.fraction * k))
    rng = np.random.default_rng(derive_seed(config.seed, round_, COHORT_STREAM))
    return sorted(int(c) for c in rng.choice(k, size=m, replace=False))


def plan_client(env: ClientEnvironment, ctx: RoundContext, state: RunState) -> ClientTask | None:
    """The method's task for a client-round; None where nothing fits its budgets, its time budget
    (`fl.deadline_plans`) included."""
    task = env.method.plan(ctx, state.method_state)
    return task if task is not None and meets_deadline(env.method, task, state.global_state) else None


def initial_state(config: ExperimentConfig, env: ClientEnvironment) -> RunState:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(config.seed, MODEL_STREAM))
        weights = env.method.initial_global_state()
    global_state = {k: v.detach().clone().to(env.device) for k, v in weights.items()}
    return RunState(0, global_state, env.method.init_state(), 0.0)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def warn_if_diverged(round_: int, updates: Sequence[Any], lr: float) -> bool:
    """Warn (once a run: the caller stops asking) when a client's training loss is NaN or infinite, a
    run that otherwise goes on silently at chance accuracy; whether it warned."""
    diverged = [u.metrics["id"] for u in updates if not math.isfinite(u.metrics.get("train_loss", 0.0))]
    if diverged:
        log.warning("round %d: clients %s ended with a non-finite training loss at lr %g: training diverged "
                    "(a lower fl.lr may help); the run goes on", round_, diverged, lr)
    return bool(diverged)


def resource_summary(clients: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals, violations and per-tier means over all client-rounds."""
    excess = [over_budget(c) for c in clients]
    summary: dict[str, Any] = {
        "client_rounds": len(clients),
        "budget_violations": sum(e["memory"] for e in excess),
        "flops_violations": sum(e["flops"] for e in excess),
        "upload_violations": sum(e["upload"] for e in excess),
        "total_flops": sum(c["flops"] for c in clients),
        "total_bytes_down": sum(c["bytes_down"] for c in clients),
        "total_bytes_up": sum(c["bytes_up"] for c in clients),
        "mean_estimated_peak_bytes": _mean([c["estimated_peak_bytes"] for c in clients]),
        "max_estimated_peak_bytes": max((c["estimated_peak_bytes"] for c in clients), default=None),
        "max_measured_peak_bytes": max((c["measured_peak_bytes"] for c in clients if c.get("measured_peak_bytes")), default=None),
    }
    if sparse := [c["estimated_sparse_peak_bytes"] for c in clients if "estimated_sparse_peak_bytes" in c]:  # a pruning method's
        summary |= {"mean_estimated_sparse_peak_bytes": _mean(sparse), "max_estimated_sparse_peak_bytes": max(sparse)}
    tiers: dict[str, dict[str, Any]] = {}
    for tier in sorted({c["tier"] for c in clients if c.get("tier") is not None}):
        members = [(c, e) for c, e in zip(clients, excess) if c["tier"] == tier]
        tiers[tier] = {
            "client_rounds": len(members),
            "budget_bytes": members[0][0]["budget_bytes"],
            "mean_estimated_peak_bytes": _mean([c["estimated_peak_bytes"] for c, _ in members]),
            "mean_measured_peak_bytes": _mean([c["measured_peak_bytes"] for c, _ in members if c.get("measured_peak_bytes")]),
            "mean_flops": _mean([c["flops"] for c, _ in members]),
            "mean_bytes_down": _mean([c["bytes_down"] for c, _ in members]),
            "mean_bytes_up": _mean([c["bytes_up"] for c, _ in members]),
            "budget_violations": sum(e["memory"] for _, e in members),
        }
    summary["tiers"] = tiers
    return summary


def summarise(out_dir: Path, config: ExperimentConfig, elapsed: float) -> dict[str, Any]:
    records = read_metrics(out_dir)
    evaluated = [r for r in records if r.get("accuracy") is not None]
    submodels = evaluated[-1].get("submodel_accuracy") if evaluated else None
    exits = evaluated[-1].get("exit_accuracy") if evaluated else None
    return {
        "name": config.name,
        "method": config.method.name,
        "final_accuracy": evaluated[-1]["accuracy"] if evaluated else None,
        "best_accuracy": max((r["accuracy"] for r in evaluated), default=None),
        "final_loss": evaluated[-1]["loss"] if evaluated else None,
        **({"final_perplexity": evaluated[-1]["perplexity"]} if evaluated and "perplexity" in evaluated[-1] else {}),
        "final_inference_peak_bytes": evaluated[-1].get("inference_peak_bytes") if evaluated else None,
        **({"worst_submodel_accuracy": min(submodels.values()), "mean_submodel_accuracy": _mean(list(submodels.values())),
            "submodel_accuracy": submodels} if submodels else {}),
        **({"worst_exit_accuracy": min(exits.values()), "mean_exit_accuracy": _mean(list(exits.values())),
            "final_ensemble_accuracy": evaluated[-1].get("ensemble_accuracy")} if exits else {}),
        "rounds": records[-1]["round"] if records else 0,  # fewer than fl.rounds where fl.time_limit_s ended the run
        "wall_seconds": elapsed,
        "failed_client_rounds": sum(len(r.get("failed_clients", [])) for r in records),
        "skipped_client_rounds": sum(len(r.get("skipped_clients", [])) for r in records),
        **resource_summary([c for r in records for c in r["clients"]]),
        **time_summary(records, config.fl.time_targets, config.fl.time_points),
    }


def time_summary(records: list[dict[str, Any]], targets: Sequence[float], points: Sequence[float] = ()) -> dict[str, Any]:
    """Simulated time of a run with devices: its total, when the test accuracy first reached each
    target, and the accuracy reached by each time point (None: never, or no round scored by then);
    with devices' energy figures, the joules every client-round spent."""
    if not records or "sim_end_s" not in records[-1]:
        return {}
    scored = [(r["sim_end_s"], r["accuracy"]) for r in records if r.get("accuracy") is not None]
    energy = [c["energy_j"] for r in records for c in r["clients"] if "energy_j" in c]  # dropped client-rounds' too: spent
    return {"simulated_seconds": records[-1]["sim_end_s"], **({"total_energy_j": sum(energy)} if energy else {}),
            "time_to_accuracy": {str(t): next((when for when, acc in scored if acc >= t), None) for t in targets},
            **({"accuracy_at_time": {str(p): next((acc for when, acc in reversed(scored) if when <= p), None) for p in points}} if points else {})}


def writable_folder(path: str | Path, field: str) -> Path:
    """`path`, created if missing; a ConfigError naming `field` where it cannot be written."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(field, str(folder), f"a folder hfl can create ({error.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(field, str(folder), "a folder hfl can write to")
    return folder


def run_experiment(
    config: ExperimentConfig, out_dir: str | Path, *, resume: bool = False, callbacks: Sequence[RoundCallback] = ()
) -> dict[str, Any]:
    """Run (or resume) an experiment, writing metrics.jsonl, checkpoints and summary.json to `out_dir`:
    a folder, or a URI (s3://, gs://, file://) that the run is copied to after every round."""
    check_job_location(out_dir, "--out")
    with staged(out_dir, "--out") as (folder, push):
        created = not Path(folder).exists()
        try:
            return _run(config, writable_folder(folder, "--out"), resume, callbacks, push)
        except BaseException:
            if created and Path(folder).is_dir() and not any(Path(folder).iterdir()):
                Path(folder).rmdir()  # a run refused before it wrote anything leaves no folder behind
            raise


def refuse_budgets_nobody_fits(config: ExperimentConfig, env: ClientEnvironment, state: RunState) -> None:
    """A ConfigError naming the budgets when not one client's budget fits any sub-model of the
    method in round 1 (budgets are fixed for the run, so no round would train anything)."""
    if all(b is None for b in env.budgets):
        return
    settings = train_settings(config.fl, 1)
    if any(plan_client(env, RoundContext(1, c, config.seed, len(env.partitions[c]), settings, env.budgets[c]), state) is not None
           for c in range(config.fl.clients)):
        return
    if config.fl.deadline_plans:
        raise ConfigError("fl.deadline_s", config.fl.deadline_s, f"a deadline within which some client ends a sub-model of "
                          f"{config.method.name} on its device (fl.deadline_plans): none of the {config.fl.clients} clients' does "
                          "within its budgets (`hfl budget` shows each tier's round seconds per sub-model)")
    budgets = config.budgets
    field = next((f for f in ("memory", "flops", "upload") if getattr(budgets, f)), "scenario")
    raise ConfigError(f"budgets.{field}", getattr(budgets, field), f"budgets under which some client fits a sub-model of "
                      f"{config.method.name}: none of the {config.fl.clients} clients' does (`hfl budget` shows what each costs)")


def refuse_deadline_nobody_meets(config: ExperimentConfig, env: ClientEnvironment, state: RunState, devices: Sequence[Device]) -> None:
    """A ConfigError naming `fl.deadline_s` when no client's round-1 task would finish within it on its device."""
    from hfl.simulation.estimate import expected_time

    settings = train_settings(config.fl, 1)
    fastest = math.inf
    for c in range(config.fl.clients):
        task = plan_client(env, RoundContext(1, c, config.seed, len(env.partitions[c]), settings, env.budgets[c]), state)
        if task is not None:
            fastest = min(fastest, expected_time(env.method, task, state.global_state, devices[c]).finish)
    if fastest > config.fl.deadline_s:
        raise ConfigError("fl.deadline_s", config.fl.deadline_s, f"a deadline some client can meet: the fastest client's "
                          f"round 1 takes {fastest:.4g} simulated seconds on its device")


def _run(config: ExperimentConfig, out: Path, resume: bool, callbacks: Sequence[RoundCallback], push: Callable[[], None]) -> dict[str, Any]:
    if config.fl.eval_spill_dir:
        writable_folder(config.fl.eval_spill_dir, "fl.eval_spill_dir")
    env = ClientEnvironment.from_config(config)
    method, fl = env.method, config.fl
    if resume and has_checkpoint(out):
        state, _ = load_checkpoint(out, env.device)
        log.info("resuming %s after round %d", out, state.round)
        if state.round > fl.rounds:
            raise ConfigError("fl.rounds", fl.rounds, f"at least {state.round}, the rounds {out} has already run "
                              "(resuming extends a run; it cannot shorten it)")
    else:
        state = initial_state(config, env)  # may refuse the config: before any backend starts
        refuse_budgets_nobody_fits(config, env, state)
    devices = assign_devices(config)
    if devices and fl.round_policy == "async":
        refuse_stale_server_steps(config, method)
    fedbuff = FedBuffRounds(config, devices, state.simulation) if devices and fl.round_policy == "async" else None
    clock = SyncRounds(config, devices, state.simulation) if devices and not fedbuff else None
    if devices and fl.round_policy == "deadline" and state.round == 0:
        refuse_deadline_nobody_meets(config, env, state, devices)
    backend = BACKENDS.get(config.backend.name, field="backend.name")(env)
    dump_config(config, out / "config.yaml")  # also on resume: a run may be extended (fl.rounds)
    metrics = MetricsWriter(out, keep_rounds_upto=state.round if resume else None)
    sinks: list[RoundCallback] = []
    if config.logging.wandb and not any(isinstance(c, WandbLogger) for c in callbacks):  # a Tune trial brings its own
        sinks.append(WandbLogger(config, out, resume))
    sinks.extend(callbacks)
    evaluate = Evaluator(env)
    budgets = env.budgets

    def start(r: int) -> tuple[Any, TrainSettings, list[dict[str, Any]], float | None]:
        """Steps 1 and 2 of round `r`, and its training started: (what `backend.collect` takes, the
        round's settings, the clients no sub-model fits, its simulated start; None without devices)."""
        # 1. cohort (with devices: of the clients online when the round starts in simulated time)
        cohort, sim_start = clock.cohort(r) if clock else (sample_cohort(config, r), None)
        # 2. plan: which sub-model and objective settings each client gets
        settings = train_settings(fl, r)
        planned = {c: plan_client(env, RoundContext(r, c, config.seed, len(env.partitions[c]), settings, budgets[c]), state) for c in cohort}
        tasks = [task for task in planned.values() if task is not None]
        skipped = [{"id": c, "reason": "no sub-model of the method fits the budget"} for c, t in planned.items() if t is None]
        if not tasks:
            log.warning("round %d: no sampled client's budget fits any sub-model of %s; the round trains nothing", r, config.method.name)
        return backend.submit(state.global_state, tasks), settings, skipped, sim_start

    def plan_async(client: int) -> ClientTask | None:
        """The task of a client starting now under the async policy, toward the next server step."""
        r = fedbuff.version + 1
        ctx = RoundContext(r, client, config.seed, len(env.partitions[client]), train_settings(fl, r), budgets[client])
        return plan_client(env, ctx, state)

    def train_now(global_state: Any, tasks: Sequence[ClientTask]) -> tuple[list[Any], list[dict[str, Any]]]:
        return backend.collect(backend.submit(global_state, tasks))

    simulation = fedbuff or clock

    def ends_run(r: int) -> bool:
        """Whether round `r`, just run, is the run's last (`fl.rounds`, or `fl.time_limit_s` reached)."""
        return fl.ends_run(r, simulation.now if simulation else None)

    pending, diverged_before = None, False
    first = fl.rounds + 1 if state.round and ends_run(state.round) else state.round + 1  # resumed after its last round: none more
    try:
        for r in range(first, fl.rounds + 1):
            started = time.perf_counter()
            # 1-2. cohort and plan (done in the last round, where that round started this one's training)
            if fedbuff:  # 1-3. async: clients start as others arrive, until a buffer's worth has arrived
                settings = train_settings(fl, r)
                kept, updates, timing, skipped, failed = fedbuff.step(state.global_state, plan_async, train_now)
            else:
                submitted, settings, skipped, sim_start = pending or start(r)
                # 3. local training; with devices, the round's policy keeps the updates that arrive in time
                updates, failed = backend.collect(submitted)
                kept, timing = clock.settle(sim_start, updates) if clock else (updates, {})
            diverged_before = diverged_before or warn_if_diverged(r, kept, settings.lr)
            # 4. aggregation
            state.global_state, state.method_state = method.aggregate(state.global_state, kept, state.method_state)
            state.method_state = record_trained(state.method_state, kept)
            # The next round's clients start training now, while this round is evaluated, logged and
            # checkpointed: on Ray they train elsewhere; the local backend trains them when collected.
            last = ends_run(r)
            pending = None if last or fedbuff else start(r + 1)
            # 5. evaluation of the global model
            scores: dict[str, Any] = {"accuracy": None, "loss": None}
            if r % fl.eval_every == 0 or last:
                scores = evaluate(state.global_state, method.global_model_spec(state.method_state))
                submodels = method.submodels(state.method_state)
                if submodels:
                    scores["submodel_accuracy"] = {
                        name: evaluate(state.global_state, spec)["accuracy"] for name, spec in submodels.items()
                    }
            # 6. log and checkpoint
            seconds = time.perf_counter() - started
            state.round, state.elapsed_seconds = r, state.elapsed_seconds + seconds
            state.simulation = simulation.saved() if simulation else None
            # With devices, `clients` holds dropped client-rounds too (marked `dropped`): their work was spent.
            record = {"round": r, **scores, "lr": settings.lr, "wall_seconds": seconds, "clients": [u.metrics for u in updates], "failed_clients": failed,
                      **({"skipped_clients": skipped} if skipped else {}), **timing}
            # The round's line, then the checkpoint (a resumed run keeps lines up to its round),
            # then callbacks, which may hand that checkpoint on (Ray Tune does).
            metrics.on_round(record)
            if r % fl.checkpoint_every == 0 or last:
                save_checkpoint(out, state, config.to_dict())
            push()
            for sink in sinks:
                sink.on_round(record)
            if last:  # fl.time_limit_s may end a run before fl.rounds
                break
    finally:
        backend.close()
    summary = summarise(out, config, state.elapsed_seconds)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    for sink in sinks:
        sink.on_end(summary)
    return summary
