"""Sweep files: a base experiment, a search space over its dotted config paths, and how to search.

Everything is checked when the file is loaded, before Ray starts: an unknown key, a malformed domain,
or a space path whose values do not make a valid `ExperimentConfig` (each grid/choice value and each
bound of a range is built into the base config) raises a ConfigError naming the field.

Split ratios are searched as distributions: `{dirichlet: [a1, ..., ak]}` draws k shares that sum to 1
(tier shares, `budgets.shares`), `{cumulative_dirichlet: [a1, ..., ak]}` their running sums, ascending
ratios ending at 1 (ScaleFL's `method.ratios`, NeFL's `method.gammas`). Tune sees such a path as k
uniform draws u_i in (0, 1), one per share, so every searcher and PBT handle it: the shares are
G_i / sum G, G_i the Gamma(a_i) quantile of u_i, which is a Dirichlet(a) draw.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfl.config import (
    ExperimentConfig,
    check,
    check_choice,
    config_from_dict,
    load_config,
    read_yaml_mapping,
)
from hfl.errors import ConfigError

DOMAINS = ("grid", "choice", "uniform", "loguniform", "dirichlet", "cumulative_dirichlet")
SHARE_DOMAINS = ("dirichlet", "cumulative_dirichlet")
OBJECTIVES = {
    # the global model on the test set, as in every round's line of metrics.jsonl
    "accuracy": "max", "loss": "min",
    # summary.json's values as the run stands after the round (its final values at the last round)
    "final_accuracy": "max", "best_accuracy": "max", "final_loss": "min", "final_perplexity": "min",
    "worst_submodel_accuracy": "max", "mean_submodel_accuracy": "max",
    "worst_exit_accuracy": "max", "mean_exit_accuracy": "max", "final_ensemble_accuracy": "max",
    "budget_violations": "min", "total_flops": "min", "total_bytes_up": "min", "total_bytes_down": "min",
    "mean_estimated_peak_bytes": "min", "max_estimated_peak_bytes": "min", "final_inference_peak_bytes": "min",
}
"""Metrics a sweep can rank trials by, with the mode each defaults to."""
TIME_OBJECTIVES = {"time_to_accuracy": ("min", "time_targets"), "accuracy_at_time": ("max", "time_points")}
"""Metrics of simulated time (docs/time.md), written `name:value`: summary.json's `time_to_accuracy`
for a target in `fl.time_targets` (`time_to_accuracy:0.9`) and `accuracy_at_time` for a point in
`fl.time_points` (`accuracy_at_time:20`), with the mode each defaults to and the field recording it."""
SCHEDULERS = ("fifo", "asha", "pbt")
SEARCHES = ("random", "grid", "optuna")
SWEEP_KEYS = (
    "experiment", "overrides", "space", "metric", "mode", "within_budget", "num_samples", "search", "scheduler",
    "max_concurrent_trials", "resources_per_trial",
)
SHARE_BOUND = 1e-6
"""How close to 0 or 1 a share's uniform draw may come (PBT's perturbations scale draws past 1)."""


@dataclass(frozen=True)
class Domain:
    """Where one config path's values come from."""

    path: str
    """The dotted config path this domain sets, e.g. method.mu."""
    kind: str
    """grid (every value, crossed with the other grids), choice (one at random), uniform or loguniform (a
    float in [lo, hi]), dirichlet (shares summing to 1) or cumulative_dirichlet (their running sums)."""
    values: tuple[Any, ...]
    """The values of grid/choice; (lo, hi) of uniform/loguniform; the concentrations of a dirichlet."""

    def __post_init__(self) -> None:
        name = f"space.{self.path}"
        check_choice(name, self.kind, DOMAINS)
        if self.kind in ("grid", "choice"):
            check(len(self.values) >= 1, name, {self.kind: list(self.values)}, f"{{{self.kind}: [v1, v2, ...]}} with at least one value")
            return
        if self.kind in SHARE_DOMAINS:
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in self.values)
            check(len(self.values) >= 2 and numbers, name, {self.kind: list(self.values)},
                  f"{{{self.kind}: [a1, a2, ...]}} with two or more concentrations > 0")
            return
        numbers = len(self.values) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.values)
        shown = {self.kind: list(self.values)}
        check(numbers and self.values[0] < self.values[1], name, shown, f"{{{self.kind}: [lo, hi]}} with numbers lo < hi")
        if self.kind == "loguniform":
            check(self.values[0] > 0, name, shown, "{loguniform: [lo, hi]} with 0 < lo < hi")

    @property
    def tune_keys(self) -> list[str]:
        """The keys of this path in Tune's trial config: the path, or `path[i]` per share of a dirichlet
        (no `/`: Optuna's space flattening splits keys there)."""
        return [f"{self.path}[{i}]" for i in range(len(self.values))] if self.kind in SHARE_DOMAINS else [self.path]

    def examples(self) -> list[Any]:
        """Values to build into the base config at load time: every discrete value, both bounds of a
        range, a dirichlet's mean and a draw that gives almost everything to one share."""
        if self.kind in ("grid", "choice"):
            return list(self.values)
        if self.kind in SHARE_DOMAINS:
            skewed = {key: 1 - SHARE_BOUND if i == 0 else SHARE_BOUND for i, key in enumerate(self.tune_keys)}
            return [self.shares(None), self.value(skewed)]
        return [float(v) for v in self.values]  # sampled values are floats: an integer field must refuse them

    def value(self, params: Mapping[str, Any]) -> Any:
        """This path's value in a trial whose Tune config is `params`."""
        if self.kind not in SHARE_DOMAINS:
            return params[self.path]
        return self.shares([params[key] for key in self.tune_keys])

    def shares(self, draws: Sequence[float] | None) -> list[float]:
        """The shares (or running sums) for uniform draws `draws`; None gives the distribution's mean."""
        from scipy.stats import gamma

        alphas = [float(a) for a in self.values]
        if draws is None:
            weights = alphas
        else:
            weights = [float(gamma.ppf(min(max(u, SHARE_BOUND), 1 - SHARE_BOUND), a)) for u, a in zip(draws, alphas)]
        total = sum(weights)
        shares = [w / total for w in weights]
        if self.kind == "dirichlet":
            return shares
        ratios = list(itertools.accumulate(shares))
        ratios[-1] = 1.0  # exactly: the full model is the last level
        return ratios

    def to_tune(self) -> dict[str, Any]:
        """Tune's domains for this path, by key of the trial config."""
        from ray import tune

        if self.kind == "grid":
            return {self.path: tune.grid_search(list(self.values))}
        if self.kind == "choice":
            return {self.path: tune.choice(list(self.values))}
        if self.kind in SHARE_DOMAINS:
            return {key: tune.uniform(SHARE_BOUND, 1 - SHARE_BOUND) for key in self.tune_keys}
        lo, hi = (float(v) for v in self.values)
        return {self.path: tune.uniform(lo, hi) if self.kind == "uniform" else tune.loguniform(lo, hi)}

    @property
    def perturbable(self) -> bool:
        """Whether PBT may perturb this path: numeric grid/choice values (more than one), ranges, a
        dirichlet's draws. Other values (a method name, a partition) stay fixed: a trial cannot switch
        them midway. Asked without Ray Tune, which loading a sweep does not import."""
        if self.kind in ("grid", "choice"):
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.values)
            return numeric and len(self.values) > 1
        return True

    def mutations(self) -> dict[str, Any]:
        """What PBT may perturb this path to (`perturbable` paths only): the grid's or choice's values,
        Tune's domains otherwise."""
        if not self.perturbable:
            return {}
        if self.kind in ("grid", "choice"):
            return {self.path: list(self.values)}
        from ray import tune

        if self.kind in SHARE_DOMAINS:
            return {key: tune.uniform(SHARE_BOUND, 1 - SHARE_BOUND) for key in self.tune_keys}
        return self.to_tune()


@dataclass(frozen=True)
class SchedulerSpec:
    name: str = "fifo"
    """fifo (every trial runs all its rounds), asha (stops weak trials early; its time unit is the round)
    or pbt (population-based training: every `perturbation_interval` rounds a trial in the bottom
    quantile continues from a top trial's hfl checkpoint with that trial's values, perturbed)."""
    grace_period: int = 1
    """asha: rounds every trial runs before it can be stopped."""
    reduction_factor: float = 2.0
    """asha: the share 1/reduction_factor of trials that go on at each rung."""
    perturbation_interval: int = 2
    """pbt: rounds between a trial's exploit/explore steps (a multiple of fl.checkpoint_every)."""
    quantile_fraction: float = 0.25
    """pbt: the share of trials that copy (bottom) and are copied (top)."""
    resample_probability: float = 0.25
    """pbt: the chance a perturbed value is drawn anew from its domain instead of scaled by 0.8 or 1.2."""
    synch: bool = True
    """pbt: exploit once every trial has reached the perturbation round, so which trial copies which
    depends on the scores alone, not on which trial happened to report first (false: Tune's
    asynchronous PBT, which keeps every slot busy)."""

    def __post_init__(self) -> None:
        check_choice("scheduler", self.name, SCHEDULERS)
        check(isinstance(self.grace_period, int) and self.grace_period >= 1, "scheduler.grace_period", self.grace_period, "an integer >= 1")
        check(self.reduction_factor > 1, "scheduler.reduction_factor", self.reduction_factor, "a number > 1")
        check(isinstance(self.perturbation_interval, int) and self.perturbation_interval >= 1, "scheduler.perturbation_interval",
              self.perturbation_interval, "an integer >= 1")
        check(0 < self.quantile_fraction <= 0.5, "scheduler.quantile_fraction", self.quantile_fraction, "a number in (0, 0.5]")
        check(0 <= self.resample_probability <= 1, "scheduler.resample_probability", self.resample_probability, "a number in [0, 1]")
        check(isinstance(self.synch, bool), "scheduler.synch", self.synch, "true or false")
        defaults = SchedulerSpec.__dataclass_fields__
        for key, owner in SCHEDULER_KEYS.items():
            if owner != self.name and getattr(self, key) != defaults[key].default:
                raise ConfigError(f"scheduler.{key}", getattr(self, key), f"a key of scheduler {owner}, not of {self.name}")


SCHEDULER_KEYS = {"grace_period": "asha", "reduction_factor": "asha", "perturbation_interval": "pbt",
                  "quantile_fraction": "pbt", "resample_probability": "pbt", "synch": "pbt"}
"""Each scheduler setting, and the scheduler it belongs to."""


@dataclass(frozen=True)
class Sweep:
    """A parsed, validated sweep file."""

    file: Path
    """The sweep file itself."""
    experiment: Path
    """The base experiment YAML."""
    overrides: tuple[str, ...]
    """`key=value` overrides applied to the base experiment (the file's, then the caller's)."""
    base: dict[str, Any]
    """The full resolved base config as a plain dict (paths made absolute: trials run in other folders)."""
    space: dict[str, Domain]
    """Dotted config path -> domain, in file order."""
    metric: str = "accuracy"
    """What ranks trials: a key of OBJECTIVES, e.g. worst_submodel_accuracy (summary.json's value as the
    run stands after each round; a method without sub-models has one, its global model), or, in runs
    with devices, `time_to_accuracy:<target>` or `accuracy_at_time:<seconds>` (TIME_OBJECTIVES)."""
    mode: str = "max"
    """max or min; default max for accuracies, min for the rest (time to accuracy included)."""
    within_budget: bool = False
    """Trials that broke a budget (memory, FLOPs or upload: summary.json's violations) rank last: Tune
    sees the worst value (ASHA stops them, PBT replaces them) and the best trial is one that kept them."""
    num_samples: int = 1
    """Samples of the space; with grids, each sample repeats the whole grid (as in Ray Tune)."""
    search: str = "random"
    """random (Tune's variant generator: grids crossed, other domains drawn with the experiment's seed),
    grid (the same, every domain a grid) or optuna (Optuna's TPE, seeded; no grid domains)."""
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    max_concurrent_trials: int | None = None
    """Trials running at once; None (`auto` in the file): as many as the cluster's CPUs and GPUs hold."""
    resources_per_trial: dict[str, float] = field(default_factory=lambda: {"cpu": 1.0, "gpu": 0.0})
    """Ray resources each trial reserves."""

    @property
    def name(self) -> str:
        return self.file.stem

    @property
    def max_rounds(self) -> int:
        rounds = self.space.get("fl.rounds")
        return max(rounds.values) if rounds else int(self.base["fl"]["rounds"])

    def swept(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Config path -> value for a trial whose Tune config is `params` (a dirichlet's shares resolved);
        paths `params` does not set keep the base config's value."""
        return {path: domain.value(params) for path, domain in self.space.items() if all(k in params for k in domain.tune_keys)}

    def trial_values(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The base config dict with one trial's sampled values set."""
        return trial_values(self.base, self.swept(params))

    def trial_config(self, params: Mapping[str, Any]) -> ExperimentConfig:
        return config_from_dict(self.trial_values(params))

    def to_dict(self) -> dict[str, Any]:
        """What identifies the sweep (saved in its folder; a resumed sweep must match it)."""
        return {
            "experiment": str(self.experiment),
            "overrides": list(self.overrides),
            "space": {p: {d.kind: list(d.values)} for p, d in self.space.items()},
            "metric": self.metric,
            "mode": self.mode,
            "within_budget": self.within_budget,
            "num_samples": self.num_samples,
            "search": self.search,
            "scheduler": dataclasses.asdict(self.scheduler),
            "max_concurrent_trials": "auto" if self.max_concurrent_trials is None else self.max_concurrent_trials,
            "resources_per_trial": dict(self.resources_per_trial),
            "base": self.base,
        }


def trial_values(base: dict[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of config dict `base` with `params` (dotted path -> value) set."""
    values = copy.deepcopy(base)
    if "method.name" in params and params["method.name"] != values["method"]["name"]:
        values["method"] = {"name": params["method.name"]}  # another method starts from its own defaults
    for path, value in params.items():
        set_path(values, path, value)
    return values


def set_path(values: dict[str, Any], path: str, value: Any) -> None:
    """Set `a.b.c` in a nested dict, creating sections on the way."""
    node = values
    *parents, leaf = path.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"space.{path}", value, f"a path into a section, but {part} is a value")
        node = child
    node[leaf] = value


def _domain(path: str, spec: Any) -> Domain:
    allowed = ("a mapping with one key: {grid: [..]}, {choice: [..]}, {uniform: [lo, hi]}, {loguniform: [lo, hi]}, "
               "{dirichlet: [a1, a2, ..]} or {cumulative_dirichlet: [a1, a2, ..]}")
    parts = path.split(".") if isinstance(path, str) else []
    check(bool(parts) and all(p.isidentifier() for p in parts), "space", path, "dotted config paths such as method.mu or data.alpha")
    check(isinstance(spec, dict) and len(spec) == 1, f"space.{path}", spec, allowed)
    ((kind, values),) = spec.items()
    check(kind in DOMAINS, f"space.{path}", spec, allowed)
    check(isinstance(values, list), f"space.{path}", spec, f"{{{kind}: [...]}} with a list")
    return Domain(path, kind, tuple(values))


def _check_path(base: dict[str, Any], path: str, domain: Domain) -> None:
    """Build the base config with each example value of `path`, naming the path on failure."""
    for value in domain.examples():
        try:
            config_from_dict(trial_values(base, {path: value}))
        except ConfigError as error:
            own = error.field == path or path.startswith(f"{error.field}.")
            raise ConfigError(f"space.{path}", value, error.allowed if own else f"a value giving a valid config ({error})") from None


def _resolve_experiment(file: Path, experiment: Any) -> Path:
    check(isinstance(experiment, str) and bool(experiment), "experiment", experiment, "the path of an experiment YAML")
    for candidate in (file.parent / experiment, Path(experiment)):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError("experiment", experiment, f"an experiment YAML relative to {file.parent} or to the current folder")


def _absolute_paths(base: dict[str, Any]) -> dict[str, Any]:
    for key in ("root", "cache_dir"):
        base["data"][key] = str(Path(base["data"][key]).expanduser().resolve())
    return base


def _scheduler(value: Any) -> SchedulerSpec:
    if isinstance(value, str):
        return SchedulerSpec(value)
    known = ("name", *SCHEDULER_KEYS)
    check(isinstance(value, dict), "scheduler", value, "fifo, asha, pbt, or a mapping such as {name: asha, grace_period: N, reduction_factor: F}")
    for key in value:
        check(key in known, f"scheduler.{key}", value[key], f"a key of scheduler: {', '.join(known)}")
    return SchedulerSpec(**value)


def _concurrency(value: Any) -> int | None:
    if value == "auto":
        return None
    return _positive_int("max_concurrent_trials", value, "auto (as many as the cluster holds) or an integer >= 1")


def _check_search(search: str, scheduler: SchedulerSpec, space: dict[str, Domain], base: dict[str, Any]) -> None:
    """Combinations Tune would refuse or run wrongly, named before Ray starts."""
    check_choice("search", search, SEARCHES)
    for path, domain in space.items():
        if search == "grid":
            check(domain.kind == "grid", f"space.{path}", {domain.kind: list(domain.values)}, "a {grid: [..]} (search: grid crosses grids only)")
        if search == "optuna":
            check(domain.kind != "grid", f"space.{path}", {domain.kind: list(domain.values)},
                  "{choice: [..]} or a range (search: optuna samples; it does not cross grids)")
    if search == "optuna":
        check(scheduler.name != "pbt", "search", search, "random or grid with scheduler pbt (PBT makes its own population)")
        check(importlib.util.find_spec("optuna") is not None, "search", search,
              'random or grid here: optuna is not installed (pip install -e ".[optuna]")')
    if scheduler.name == "pbt":
        check(any(domain.perturbable for domain in space.values()), "scheduler", scheduler.name,
              "pbt with a numeric space path to perturb (a range, a dirichlet, or a grid/choice of numbers)")
        every = int(base["fl"]["checkpoint_every"])
        # PBT copies a trial's latest hfl checkpoint: one must be written at every perturbation.
        check(scheduler.perturbation_interval % every == 0, "scheduler.perturbation_interval", scheduler.perturbation_interval,
              f"a multiple of fl.checkpoint_every ({every})")


def _resources(value: Any) -> dict[str, float]:
    check(isinstance(value, dict), "resources_per_trial", value, "a mapping such as {cpu: 1, gpu: 0}")
    resources = {"cpu": 1.0, "gpu": 0.0}
    for key, amount in value.items():
        check(key in resources, f"resources_per_trial.{key}", amount, "a key of resources_per_trial: cpu, gpu")
        check(isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount >= 0, f"resources_per_trial.{key}", amount, "a number >= 0")
        resources[key] = float(amount)
    check(resources["cpu"] > 0 or resources["gpu"] > 0, "resources_per_trial", value, "some cpu or gpu for each trial")
    return resources


def _positive_int(name: str, value: Any, allowed: str = "an integer >= 1") -> int:
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value, allowed)
    return value


def _metric(metric: Any, base: dict[str, Any]) -> str:
    """The sweep's metric: a key of OBJECTIVES, or a TIME_OBJECTIVES name with a target or point the
    base experiment's runs record, written as summary.json's key (`time_to_accuracy:0.9`)."""
    name, colon, number = str(metric).partition(":")
    if not colon or name not in TIME_OBJECTIVES:
        check_choice("metric", metric, [*OBJECTIVES, *(f"{n}:<value>" for n in TIME_OBJECTIVES)])
        return metric
    field_name = TIME_OBJECTIVES[name][1]
    check(base["devices"]["source"] != "none", "metric", metric,
          "a metric of simulated time only where the runs have devices (devices.source is none; docs/time.md)")
    recorded = base["fl"][field_name]
    try:
        value = float(number)
    except ValueError:
        value = None
    # summary.json's keys are the configured values as written (str), so the metric takes the same spelling
    match = next((str(v) for v in recorded if value is not None and float(v) == value), None)
    check(match is not None, "metric", metric,
          f"{name}:<v> for a v the runs record: fl.{field_name} is {list(recorded)} (add {number} there to rank by it)")
    return f"{name}:{match}"


def load_sweep(path: str | Path, overrides: Sequence[str] = ()) -> Sweep:
    """Read and validate a sweep file; `overrides` apply to the base experiment after the file's own."""
    file = Path(path)
    raw = read_yaml_mapping(file, "sweep", "a sweep: experiment, space, metric, ...")
    for key in raw:
        check(key in SWEEP_KEYS, str(key), raw[key], f"a key of a sweep file: {', '.join(SWEEP_KEYS)}")
    check("experiment" in raw, "experiment", None, "the path of the base experiment YAML")
    check(isinstance(raw.get("space"), dict) and bool(raw["space"]), "space", raw.get("space"), "a mapping of dotted config paths to domains")

    experiment = _resolve_experiment(file, raw["experiment"])
    own = raw.get("overrides") or []
    check(isinstance(own, list) and all(isinstance(o, str) for o in own), "overrides", own, 'a list of "key=value" strings')
    all_overrides = (*own, *overrides)
    base = _absolute_paths(load_config(experiment, all_overrides).to_dict())

    space = {p: _domain(p, spec) for p, spec in raw["space"].items()}
    for p, domain in space.items():
        _check_path(base, p, domain)

    metric = _metric(raw.get("metric", "accuracy"), base)
    mode = raw.get("mode", TIME_OBJECTIVES[metric.split(":")[0]][0] if ":" in metric else OBJECTIVES[metric])
    check_choice("mode", mode, ("max", "min"))
    within_budget = raw.get("within_budget", False)
    check(isinstance(within_budget, bool), "within_budget", within_budget, "true (trials that break a budget rank last) or false")
    scheduler = _scheduler(raw.get("scheduler", "fifo"))
    search = raw.get("search", "random")
    _check_search(search, scheduler, space, base)
    return Sweep(
        file=file.resolve(),
        experiment=experiment,
        overrides=tuple(all_overrides),
        base=base,
        space=space,
        metric=metric,
        mode=mode,
        within_budget=within_budget,
        num_samples=_positive_int("num_samples", raw.get("num_samples", 1)),
        search=search,
        scheduler=scheduler,
        max_concurrent_trials=_concurrency(raw.get("max_concurrent_trials", "auto")),
        resources_per_trial=_resources(raw.get("resources_per_trial", {})),
    )
