"""Client budgets: memory (and optionally FLOPs and upload) per client, from the config.

Amounts (`hfl.accounting.amounts`) are absolute or relative to the model (`width:1/6`: what training
the configured model at width 1/6 costs, measured by the accountant). The FeDepth paper's scenarios
give each quarter of the clients the memory of training the full model at one width ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hfl.accounting.accountant import Accountant
from hfl.accounting.amounts import SCENARIOS, ClientBudget, absolute_amount, parse_width
from hfl.config import BudgetsConfig, ExperimentConfig
from hfl.seeding import BUDGET_STREAM, derive_seed


@dataclass(frozen=True)
class Tier:
    name: str
    share: float
    memory: str
    flops: str | None
    upload: str | None


def tier_name(width_text: str) -> str:
    """'1/6' -> 'w1_6': usable as a Ray resource name and a column header."""
    return "w" + width_text.replace("/", "_").replace(".", "p")


def tiers_of(scenario: str, memory: Sequence[str], flops: Sequence[str], upload: Sequence[str],
             shares: Sequence[float], names: Sequence[str]) -> list[Tier]:
    """The tiers a budgets config describes (per-client budgets are one tier per distinct entry)."""
    if scenario in SCENARIOS:
        widths = SCENARIOS[scenario]
        return [Tier(tier_name(w), 1 / len(widths), f"width:{w}", None, None) for w in widths]
    count = len(memory)
    shares = list(shares) or [1 / count] * count
    default_names = [tier_name(m[len("width:"):]) if m.startswith("width:") else f"tier{i}" for i, m in enumerate(memory)]
    names = list(names) or default_names
    return [
        Tier(names[i], shares[i], memory[i], flops[i] if flops else None, upload[i] if upload else None)
        for i in range(count)
    ]


class BudgetResolver:
    """Turns amounts into numbers with the experiment's accountant (for `width:` amounts)."""

    def __init__(self, accountant: Accountant, batch_size: int, local_epochs: int, flops_per: str = "round") -> None:
        self.accountant, self.batch_size, self.local_epochs = accountant, batch_size, local_epochs
        self.flops_per = flops_per

    def memory(self, text: str) -> int:
        if text.startswith("width:"):
            return self.accountant.plain_cost(parse_width(text[6:]), self.batch_size).peak_bytes
        return absolute_amount(text)

    def flops(self, text: str, num_samples: int) -> int:
        """The client-round's FLOPs budget. A per-batch amount bounds the round at amount × samples ×
        epochs / batch (the client's batch: at most its samples), so that a task fits it exactly when
        one batch of it costs at most the amount."""
        if text.startswith("width:"):
            per_sample = self.accountant.plain_cost(parse_width(text[6:]), self.batch_size).train_flops_per_sample
            return per_sample * num_samples * self.local_epochs
        amount = absolute_amount(text)
        if self.flops_per == "batch":
            return amount * num_samples * self.local_epochs // min(self.batch_size, num_samples)
        return amount

    def upload(self, text: str) -> int:
        if text.startswith("width:"):
            return self.accountant.plain_cost(parse_width(text[6:]), self.batch_size).param_bytes
        return absolute_amount(text)


def assign_tiers(tiers: Sequence[Tier], num_clients: int, rng: np.random.Generator) -> list[int]:
    """Tier index of every client: shares rounded by largest remainder, clients shuffled."""
    exact = np.array([t.share for t in tiers]) * num_clients
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: num_clients - counts.sum()]:
        counts[i] += 1
    order = rng.permutation(num_clients)
    tier_of = np.empty(num_clients, dtype=int)
    tier_of[order] = np.repeat(np.arange(len(tiers)), counts)
    return tier_of.tolist()


def client_budgets(
    tiers: Sequence[Tier], tier_of: Sequence[int], resolver: BudgetResolver, num_samples: Sequence[int]
) -> list[ClientBudget]:
    memory = {t.name: resolver.memory(t.memory) for t in tiers}
    upload = {t.name: resolver.upload(t.upload) for t in tiers if t.upload}
    budgets = []
    for client, index in enumerate(tier_of):
        tier = tiers[index]
        flops = resolver.flops(tier.flops, num_samples[client]) if tier.flops else None
        budgets.append(ClientBudget(tier.name, memory[tier.name], flops, upload.get(tier.name)))
    return budgets


def plan_tiers(config: BudgetsConfig, num_clients: int, rng: np.random.Generator) -> tuple[list[Tier], list[int]]:
    """The tiers of a budgets config and the tier index of every client."""
    if config.scenario == "per_client":  # one tier per distinct (memory, flops, upload) triple
        triples = list(zip(config.memory, config.flops or [None] * num_clients, config.upload or [None] * num_clients))
        distinct = list(dict.fromkeys(triples))
        tiers = [Tier(tier_name(m[6:]) if m.startswith("width:") else f"tier{i}", 0.0, m, f, u) for i, (m, f, u) in enumerate(distinct)]
        return tiers, [distinct.index(t) for t in triples]
    tiers = tiers_of(config.scenario, config.memory, config.flops, config.upload, config.shares, config.names)
    return tiers, assign_tiers(tiers, num_clients, rng)


def assign_budgets(
    config: ExperimentConfig, accountant: Accountant, num_samples: Sequence[int]
) -> tuple[list[Tier], list[ClientBudget | None]]:
    """The run's tiers and every client's budget, fixed for the run and seeded by the seed."""
    if not config.budgets.enabled:
        return [], [None] * config.fl.clients
    rng = np.random.default_rng(derive_seed(config.seed, BUDGET_STREAM))
    tiers, tier_of = plan_tiers(config.budgets, config.fl.clients, rng)
    resolver = BudgetResolver(accountant, config.fl.batch_size, config.fl.local_epochs, config.budgets.flops_per)
    return tiers, client_budgets(tiers, tier_of, resolver, num_samples)
