"""Federated methods, one file each; importing this package registers them."""

from hfl.methods import fedavg, fedprox  # noqa: F401  (registers the methods)
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.models.base import ScalableModel
from hfl.registry import METHODS


def build_method(config: MethodConfig, model: ScalableModel) -> Method:
    return METHODS.get(config.name, field="method.name")(config, model)


__all__ = ["Method", "MethodConfig", "MethodState", "build_method"]
