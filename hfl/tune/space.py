"""Sweep files: a base experiment, a search space over its dotted config paths, and how to search.

Everything is checked when the file is loaded, before Ray starts: an unknown key, a malformed domain,
or a space path whose values do not make a valid `ExperimentConfig` (each grid/choice value and each
bound of a range is built into the base config) raises a ConfigError naming the field.
"""

from __future__ import annotations

import copy
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

DOMAINS = ("grid", "choice", "uniform", "loguniform")
METRICS = ("accuracy", "loss")
SCHEDULERS = ("fifo", "asha")
SWEEP_KEYS = (
    "experiment", "overrides", "space", "metric", "mode", "num_samples", "scheduler", "max_concurrent_trials", "resources_per_trial",
)


@dataclass(frozen=True)
class Domain:
    """Where one config path's values come from."""

    path: str
    """The dotted config path this domain sets, e.g. method.mu."""
    kind: str
    """grid (every value, crossed with the other grids), choice (one at random), uniform or loguniform (a float in [lo, hi])."""
    values: tuple[Any, ...]
    """The values of grid/choice; (lo, hi) of uniform/loguniform."""

    def __post_init__(self) -> None:
        name = f"space.{self.path}"
        check_choice(name, self.kind, DOMAINS)
        if self.kind in ("grid", "choice"):
            check(len(self.values) >= 1, name, {self.kind: list(self.values)}, f"{{{self.kind}: [v1, v2, ...]}} with at least one value")
            return
        numbers = len(self.values) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.values)
        shown = {self.kind: list(self.values)}
        check(numbers and self.values[0] < self.values[1], name, shown, f"{{{self.kind}: [lo, hi]}} with numbers lo < hi")
        if self.kind == "loguniform":
            check(self.values[0] > 0, name, shown, "{loguniform: [lo, hi]} with 0 < lo < hi")

    def examples(self) -> list[Any]:
        """Values to build into the base config at load time: every discrete value, both bounds of a range."""
        if self.kind in ("grid", "choice"):
            return list(self.values)
        return [float(v) for v in self.values]  # sampled values are floats: an integer field must refuse them

    def to_tune(self) -> Any:
        from ray import tune

        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        lo, hi = (float(v) for v in self.values)
        return tune.uniform(lo, hi) if self.kind == "uniform" else tune.loguniform(lo, hi)


@dataclass(frozen=True)
class SchedulerSpec:
    name: str = "fifo"
    """fifo (every trial runs all its rounds) or asha (stops weak trials early; its time unit is the round)."""
    grace_period: int = 1
    """asha: rounds every trial runs before it can be stopped."""
    reduction_factor: float = 2.0
    """asha: the share 1/reduction_factor of trials that go on at each rung."""

    def __post_init__(self) -> None:
        check_choice("scheduler", self.name, SCHEDULERS)
        check(isinstance(self.grace_period, int) and self.grace_period >= 1, "scheduler.grace_period", self.grace_period, "an integer >= 1")
        check(self.reduction_factor > 1, "scheduler.reduction_factor", self.reduction_factor, "a number > 1")
        if self.name == "fifo":
            check((self.grace_period, self.reduction_factor) == (1, 2.0), "scheduler", self.name, "asha when grace_period or reduction_factor is given")


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
    """Reported metric that ranks trials: accuracy or loss (of the global model on the test set)."""
    mode: str = "max"
    """max or min; default max for accuracy, min for loss."""
    num_samples: int = 1
    """Samples of the space; with grids, each sample repeats the whole grid (as in Ray Tune)."""
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    max_concurrent_trials: int = 1
    """Trials running at once."""
    resources_per_trial: dict[str, float] = field(default_factory=lambda: {"cpu": 1.0, "gpu": 0.0})
    """Ray resources each trial reserves."""

    @property
    def name(self) -> str:
        return self.file.stem

    @property
    def max_rounds(self) -> int:
        rounds = self.space.get("fl.rounds")
        return max(rounds.values) if rounds else int(self.base["fl"]["rounds"])

    def trial_values(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The base config dict with one trial's sampled values set."""
        return trial_values(self.base, params)

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
            "num_samples": self.num_samples,
            "scheduler": {"name": self.scheduler.name, "grace_period": self.scheduler.grace_period, "reduction_factor": self.scheduler.reduction_factor},
            "max_concurrent_trials": self.max_concurrent_trials,
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
    allowed = "a mapping with one key: {grid: [..]}, {choice: [..]}, {uniform: [lo, hi]} or {loguniform: [lo, hi]}"
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
    known = ("name", "grace_period", "reduction_factor")
    check(isinstance(value, dict), "scheduler", value, "fifo, asha, or a mapping {name: asha, grace_period: N, reduction_factor: F}")
    for key in value:
        check(key in known, f"scheduler.{key}", value[key], f"a key of scheduler: {', '.join(known)}")
    return SchedulerSpec(**value)


def _resources(value: Any) -> dict[str, float]:
    check(isinstance(value, dict), "resources_per_trial", value, "a mapping such as {cpu: 1, gpu: 0}")
    resources = {"cpu": 1.0, "gpu": 0.0}
    for key, amount in value.items():
        check(key in resources, f"resources_per_trial.{key}", amount, "a key of resources_per_trial: cpu, gpu")
        check(isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount >= 0, f"resources_per_trial.{key}", amount, "a number >= 0")
        resources[key] = float(amount)
    check(resources["cpu"] > 0 or resources["gpu"] > 0, "resources_per_trial", value, "some cpu or gpu for each trial")
    return resources


def _positive_int(name: str, value: Any) -> int:
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value, "an integer >= 1")
    return value


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

    metric = raw.get("metric", "accuracy")
    check_choice("metric", metric, METRICS)
    mode = raw.get("mode", "max" if metric == "accuracy" else "min")
    check_choice("mode", mode, ("max", "min"))
    return Sweep(
        file=file.resolve(),
        experiment=experiment,
        overrides=tuple(all_overrides),
        base=base,
        space=space,
        metric=metric,
        mode=mode,
        num_samples=_positive_int("num_samples", raw.get("num_samples", 1)),
        scheduler=_scheduler(raw.get("scheduler", "fifo")),
        max_concurrent_trials=_positive_int("max_concurrent_trials", raw.get("max_concurrent_trials", 1)),
        resources_per_trial=_resources(raw.get("resources_per_trial", {})),
    )
