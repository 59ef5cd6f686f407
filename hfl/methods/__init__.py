"""Federated methods, one file each; importing this package registers them."""

from hfl.accounting.accountant import Accountant
from hfl.methods import (  # noqa: F401  (registers the methods)
    decoupled,
    fedavg,
    fedprox,
    fedrolex,
    heterofl,
)
from hfl.methods.base import Method, MethodConfig, MethodState, ServerResources
from hfl.models.base import ScalableModel
from hfl.registry import METHODS


def build_method(config: MethodConfig, model: ScalableModel, accountant: Accountant | None = None) -> Method:
    """The configured method over the global model `model`, which it adapts (exits, norms) in place."""
    method = METHODS.get(config.name, field="method.name")(config, model, accountant)
    method.adapt_model(method.model)
    return method


__all__ = ["Method", "MethodConfig", "MethodState", "ServerResources", "build_method"]
