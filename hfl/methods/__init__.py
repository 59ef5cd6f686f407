"""Federated methods, one file each; importing this package registers them."""

from hfl.methods import fedavg, fedprox, fedrolex, heterofl  # noqa: F401  (registers the methods)
from hfl.accounting.accountant import Accountant
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.models.base import ScalableModel
from hfl.registry import METHODS


def build_method(config: MethodConfig, model: ScalableModel, accountant: Accountant | None = None) -> Method:
    return METHODS.get(config.name, field="method.name")(config, model, accountant)


__all__ = ["Method", "MethodConfig", "MethodState", "build_method"]
