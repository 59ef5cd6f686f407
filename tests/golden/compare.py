"""What a golden run records, split into what no processor changes and the floats that it does, and
how each is compared.

*Facts* are every value of a run's metrics except the measured floats: bytes, FLOPs, estimated
peaks, budgets, tiers, the sub-model and level each client trained, widths, learning rates, which
clients were skipped or failed and why, masks' counts, and which scores exist (`None` where a round
was not scored). They follow from the config and integer arithmetic, so they must be equal on every
machine.

*Measured floats* are the losses and accuracies (`MEASURED`): sums of float32 products whose
rounding depends on the kernels the processor runs. They are equal bit for bit on the platform they
were recorded on (tests/golden/platform.py), and elsewhere within `TOLERANCE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LOSSES = ("loss", "train_loss", "perplexity")
"""Keys whose values are losses (perplexity is exp(loss))."""
ACCURACIES = ("accuracy", "ensemble_accuracy")
"""Keys whose values are accuracies."""
ACCURACY_TABLES = ("submodel_accuracy", "exit_accuracy")
"""Keys whose values are tables of accuracies, one per sub-model or exit."""
MEASURED = LOSSES + ACCURACIES + ACCURACY_TABLES
PLACEHOLDER = "<float>"
"""Where a measured float stands among the facts (its value is in the fixture's `floats`), so that
the facts keep every key a run records and which scores exist."""


@dataclass(frozen=True)
class Tolerance:
    """How far a measured float may lie from a recorded one on a platform it was not recorded on,
    per round (the last entry for later rounds): drift compounds over a run's steps. The values and
    the drift they rest on are in docs/development.md ("Golden runs")."""

    loss_rel: tuple[float, ...]
    """Relative difference of a loss: |a - b| <= loss_rel * max(|a|, |b|)."""
    accuracy_abs: tuple[float, ...]
    """Absolute difference of an accuracy (a fraction of the test images)."""

    def allows(self, path: str, recorded: float, found: float) -> bool:
        if math.isnan(recorded) or math.isnan(found):
            return math.isnan(recorded) and math.isnan(found)
        index = int(path[1:path.index("]")]) if path.startswith("[") else 0
        if kind_of(path) in LOSSES:
            bound = self.loss_rel[min(index, len(self.loss_rel) - 1)]
            return abs(recorded - found) <= bound * max(abs(recorded), abs(found))
        return abs(recorded - found) <= self.accuracy_abs[min(index, len(self.accuracy_abs) - 1)]


def kind_of(path: str) -> str:
    """The key a flattened path's tolerance is chosen by: a loss key, or an accuracy."""
    leaf = path.rsplit(".", 1)[-1]
    return leaf if leaf in LOSSES else "accuracy"


def split(records: Any) -> tuple[Any, dict[str, float]]:
    """(facts, measured floats): the records with each measured float replaced by `PLACEHOLDER`,
    and those floats by path (`[0].clients[2].train_loss`, `[1].submodel_accuracy.x0.5`). A
    measured key whose value is not a number (`None`: a round not scored) stays among the facts."""
    floats: dict[str, float] = {}

    def walk(value: Any, path: str, measured: bool) -> Any:
        if isinstance(value, dict):
            kept = {}
            for key, item in value.items():
                inner = measured or key in MEASURED
                if inner and isinstance(item, (int, float)) and not isinstance(item, bool):
                    floats[f"{path}.{key}"] = float(item)
                    kept[key] = PLACEHOLDER
                    continue
                kept[key] = walk(item, f"{path}.{key}", inner)
            return kept
        if isinstance(value, list):
            return [walk(item, f"{path}[{i}]", measured) for i, item in enumerate(value)]
        return value

    return walk(records, "", False), floats


def first_difference(expected: Any, found: Any, path: str = "") -> str | None:
    """Where two JSON values first differ, as a path with both values."""
    if isinstance(expected, dict) and isinstance(found, dict):
        for key in sorted(set(expected) | set(found), key=str):
            if key not in expected or key not in found:
                return f"{path}.{key}: only in {'recorded' if key in expected else 'this run'}"
            if (where := first_difference(expected[key], found[key], f"{path}.{key}")) is not None:
                return where
        return None
    if isinstance(expected, list) and isinstance(found, list):
        if len(expected) != len(found):
            return f"{path}: {len(expected)} entries recorded, {len(found)} now"
        for i, (e, f) in enumerate(zip(expected, found)):
            if (where := first_difference(e, f, f"{path}[{i}]")) is not None:
                return where
        return None
    return None if expected == found else f"{path}: recorded {expected!r}, now {found!r}"


def only_gained(expected: Any, found: Any) -> bool:
    """Whether `found` is `expected` with dict keys added and nothing else changed."""
    if isinstance(expected, dict) and isinstance(found, dict):
        return all(key in found and only_gained(value, found[key]) for key, value in expected.items())
    if isinstance(expected, list) and isinstance(found, list):
        return len(expected) == len(found) and all(only_gained(e, f) for e, f in zip(expected, found))
    return expected == found


def float_differences(recorded: dict[str, float], found: dict[str, float], tolerance: Tolerance | None) -> list[str]:
    """The measured floats that differ (exactly, with `tolerance` None; else beyond it), as
    `path: recorded X, now Y`, in recorded order; a path only on one side is a difference too."""
    out = [f"{path}: only in {'recorded' if path in recorded else 'this run'}" for path in sorted(set(recorded) ^ set(found))]
    for path, value in recorded.items():
        if path not in found:
            continue
        same = value == found[path] or (math.isnan(value) and math.isnan(found[path]))
        if not same and (tolerance is None or not tolerance.allows(path, value, found[path])):
            out.append(f"{path}: recorded {value!r}, now {found[path]!r}")
    return out


def drift(recorded: dict[str, float], found: dict[str, float]) -> dict[str, float]:
    """The largest difference per kind between two sets of measured floats over their common paths:
    relative for each loss key, absolute for accuracies."""
    worst: dict[str, float] = {}
    for path, a in recorded.items():
        if path not in found or math.isnan(a) or math.isnan(found[path]):
            continue
        b, kind = found[path], kind_of(path)
        if kind in LOSSES:
            d = abs(a - b) / max(abs(a), abs(b)) if a != b else 0.0
        else:
            d = abs(a - b)
        worst[kind] = max(worst.get(kind, 0.0), d)
    return worst
