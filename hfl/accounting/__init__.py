"""Resource accounting: what a client-round costs (memory, FLOPs, bytes) and what clients may spend."""

from hfl.accounting.accountant import Accountant, optimizer_kind
from hfl.accounting.budgets import (
    SCENARIOS,
    BudgetResolver,
    ClientBudget,
    Tier,
    assign_tiers,
    client_budgets,
    tiers_of,
)
from hfl.accounting.cost import TrainingCost, measure_training_cost

__all__ = [
    "SCENARIOS",
    "Accountant",
    "BudgetResolver",
    "ClientBudget",
    "Tier",
    "TrainingCost",
    "assign_tiers",
    "client_budgets",
    "measure_training_cost",
    "optimizer_kind",
    "tiers_of",
]
