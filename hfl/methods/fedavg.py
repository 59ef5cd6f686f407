"""FedAvg — McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", AISTATS 2017. Every client trains the whole model; the server averages weighted by data size.

With `model.width=0.1667` this is the FeDepth paper's "FedAvg x min r" baseline."""

from __future__ import annotations

from hfl.methods.base import Method
from hfl.registry import METHODS


@METHODS.register("fedavg")
class FedAvg(Method):
    """The base method's roles as they are."""
