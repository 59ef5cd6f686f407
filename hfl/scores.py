"""What a round is scored by, below the server and the loggers that both count it: which budgets a
client-round broke, and a round's scores as a sweep ranks a run (worst and mean sub-model accuracy,
exit accuracies, per-tier accuracy, budget violations so far)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

VIOLATIONS = {"memory": "budget_violations", "flops": "flops_violations", "upload": "upload_violations"}
"""Kind of budget -> the summary.json key counting the client-rounds that broke it."""


def over_budget(client: dict[str, Any]) -> dict[str, bool]:
    """Which of a client-round's budgets it exceeded (estimated or, where measured, measured)."""
    peak = max(client["estimated_peak_bytes"], client.get("measured_peak_bytes") or 0)
    limits = (("memory", peak, "budget_bytes"), ("flops", client["flops"], "budget_flops"), ("upload", client["bytes_up"], "budget_upload_bytes"))
    return {kind: client.get(key) is not None and used > client[key] for kind, used, key in limits}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class RoundScores:
    """A round's scores beside its own metrics, with the violations counted since round 1 (as
    summary.json counts them after that round). Built from the rounds already run when a run resumes."""

    def __init__(self, records: Iterable[dict[str, Any]] = ()) -> None:
        self.totals: Counter[str] = Counter()
        for record in records:
            self(record)

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        """Flat `a/b` keys: `worst_submodel_accuracy`, `mean_submodel_accuracy` (a method without
        sub-models: its one model's accuracy, as a sweep ranks it), `worst_exit_accuracy`,
        `mean_exit_accuracy`, per tier `tiers/<t>/accuracy` (the mean over the tier's clients of the
        accuracy of the sub-model each trained), this round's violations (`violations/memory`, and per
        tier `tiers/<t>/violations/memory`) and the run's so far (`budget_violations`,
        `tiers/<t>/budget_violations`, ...)."""
        scores: dict[str, Any] = {}
        accuracy, submodels, exits = record.get("accuracy"), record.get("submodel_accuracy") or {}, record.get("exit_accuracy") or {}
        if submodels:
            scores["worst_submodel_accuracy"], scores["mean_submodel_accuracy"] = min(submodels.values()), _mean(list(submodels.values()))
        elif accuracy is not None:
            scores["worst_submodel_accuracy"] = scores["mean_submodel_accuracy"] = accuracy
        if exits:
            scores["worst_exit_accuracy"], scores["mean_exit_accuracy"] = min(exits.values()), _mean(list(exits.values()))
        clients = record.get("clients") or []
        excess = [over_budget(c) for c in clients]
        for kind, total in VIOLATIONS.items():
            scores[f"violations/{kind}"] = sum(e[kind] for e in excess)
            self.totals[total] += scores[f"violations/{kind}"]
            scores[total] = self.totals[total]
        for tier in sorted({c["tier"] for c in clients if c.get("tier") is not None}):
            members = [(c, e) for c, e in zip(clients, excess) if c["tier"] == tier]
            if accuracy is not None:
                held = [submodels.get(c.get("level"), accuracy) if c.get("level") is not None else accuracy for c, _ in members]
                scores[f"tiers/{tier}/accuracy"] = _mean(held)
            for kind, total in VIOLATIONS.items():
                scores[f"tiers/{tier}/violations/{kind}"] = sum(e[kind] for _, e in members)
                self.totals[f"tiers/{tier}/{total}"] += scores[f"tiers/{tier}/violations/{kind}"]
                scores[f"tiers/{tier}/{total}"] = self.totals[f"tiers/{tier}/{total}"]
        return scores
