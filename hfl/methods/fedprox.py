"""FedProx — Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.

Client objective: CE + mu/2 * ||w - w_t||^2, w_t the global weights the client received."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from hfl.errors import check
from hfl.methods.base import Client, Method, MethodConfig
from hfl.methods.vectorisable import vectorisable
from hfl.registry import METHODS


@dataclass(frozen=True)
class FedProxConfig(MethodConfig):
    name: str = "fedprox"
    mu: float = 0.01
    """Weight of the proximal term; 0 gives FedAvg."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.mu >= 0, "mu", self.mu, "a number >= 0")


@METHODS.register("fedprox")
class FedProx(Method):
    Config = FedProxConfig

    @vectorisable
    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        terms = super().objective(client, x, y)
        proximal = sum(((p - client.initial[n]) ** 2).sum() for n, p in client.trainable_parameters())
        terms["proximal"] = proximal.detach()
        terms["loss"] = terms["loss"] + 0.5 * self.config.mu * proximal
        return terms
