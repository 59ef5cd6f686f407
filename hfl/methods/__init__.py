"""Federated methods, one file each; importing this package registers them."""

from collections.abc import Sequence

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.methods import (  # noqa: F401  (registers the methods)
    decoupled,
    depthfl,
    fedavg,
    feddf,
    fedepth,
    fedprox,
    fedrolex,
    fjord,
    heterofl,
    nefl,
    scalefl,
    splitmix,
)
from hfl.methods.base import Method, MethodConfig, MethodState, ServerResources
from hfl.models.base import ScalableModel
from hfl.registry import METHODS


def build_method(
    config: MethodConfig,
    model: ScalableModel,
    accountant: Accountant | None = None,
    budgets: Sequence[ClientBudget | None] | None = None,
    batch_size: int | None = None,
) -> Method:
    """The configured method over the global model `model`, which it adapts (exits, norms) in place;
    `budgets` (every client's, costed at `batch_size`) reach the method before it adapts the model."""
    method = METHODS.get(config.name, field="method.name")(config, model, accountant)
    if budgets is not None and batch_size is not None:
        method.use_budgets(budgets, batch_size)
    method.adapt_model(method.model)
    return method


__all__ = ["Method", "MethodConfig", "MethodState", "ServerResources", "build_method"]
