"""Per-sub-model copies of a layer: one batch norm (or step size) per width or per nested sub-model.

FjORD keeps a batch norm per ladder width, NeFL a batch norm and a step size per sub-model ("inconsistent
parameters"). The global model holds every copy side by side (`<layer>.<copy>.*`); a sub-model's spec
leaves the other copies absent, so a client holds, trains and sends only its own, and the masked mean
averages each copy over the clients that held it. The copy in use is the module's `active` one.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence

import torch
from torch import Tensor, nn


class Copies(nn.Module):
    """A set of named copies of which one, `active`, is in use."""

    active: str

    def names(self) -> list[str]:
        return [name for name, _ in self.named_children()] + [name for name, _ in self.named_parameters(recurse=False)]

    def keep_only(self, name: str) -> None:
        """Drop every copy but `name` (a client's model holds its own only)."""
        for other in self.names():
            if other != name:
                delattr(self, other)
        self.active = name


class NormCopies(Copies):
    """One batch norm per copy name, each with the layer's full channel count (a narrower width
    uses a prefix of it); the model runs the `active` copy."""

    def __init__(self, norm: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, copy.deepcopy(norm))
        self.active = names[-1]

    def forward(self, x: Tensor) -> Tensor:
        return getattr(self, self.active)(x)


class StepCopies(Copies):
    """One learnable scalar step size per copy name; calling it returns the `active` one."""

    def __init__(self, values: dict[str, float], like: Tensor) -> None:
        super().__init__()
        for name, value in values.items():
            self.register_parameter(name, nn.Parameter(torch.tensor(value, dtype=like.dtype, device=like.device)))
        self.active = list(values)[-1]

    def forward(self) -> Tensor:
        return getattr(self, self.active)


def copy_keys(model: nn.Module, names: Collection[str]) -> frozenset[str]:
    """State keys of the copies named `names` in every copy set of `model`."""
    return frozenset(
        f"{path}.{key}"
        for path, module in model.named_modules() if isinstance(module, Copies)
        for key in module.state_dict() if key.partition(".")[0] in names
    )


def keep_copy(model: nn.Module, name: str) -> None:
    """Reduce every copy set of `model` to its copy `name`."""
    for module in model.modules():
        if isinstance(module, Copies):
            module.keep_only(name)


def select_copy(model: nn.Module, name: str) -> None:
    """Run every copy set of `model` with its copy `name`."""
    for module in model.modules():
        if isinstance(module, Copies):
            module.active = name
