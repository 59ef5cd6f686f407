"""Per-sub-model copies of a layer: one batch norm (or step size) per width or per nested sub-model.

FjORD keeps a batch norm per ladder width, NeFL a batch norm and a step size per sub-model ("inconsistent
parameters"). The global model holds every copy side by side (`<layer>.<copy>.*`); a sub-model's spec
leaves the other copies absent, so a client holds, trains and sends only its own, and the masked mean
averages each copy over the clients that held it. The copy in use is the module's `active` one.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Sequence

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


def nefl_do_step_sizes(num_blocks: int, omitted: Iterable[int]) -> list[float]:
    """NeFL-DO's initial step sizes for a body of `num_blocks` blocks of which `omitted` are skipped.

    Kang et al. (NeFL, appendix A.3): NeFL-DO "gives larger initial step sizes to compensate" the
    skipped blocks, "determined based on the number of blocks that are skipped. For a submodel
    without Block 2, initial output after Block 2 is initially computed as Y3 = Y0 + F0 + 2F1 given
    s0 = 1, s1 = 2, s2 = 0". Their ResNet-56 table (Table 12, appendix B.2) pins the rule: a kept
    block followed by k consecutive omitted blocks starts at k + 1 (e.g. `1, 8, 0, 0, 0, 0, 0, 0, 0`
    for a stage whose last seven blocks are omitted); every other kept block starts at 1 and an
    omitted block at 0, the tables' mark for a block the sub-model lacks (s = 0 also computes
    Y + 0 * F(Y) = Y). Omitted blocks at the very start of the body have no kept block before them:
    the paper never omits one, and here they are left uncompensated. The paper gives NeFL-DO values
    for ResNets only; `add_step_sizes` gives a ViT block's value to both its attention and MLP steps."""
    omitted = set(omitted)
    if not omitted <= set(range(num_blocks)):
        raise ValueError(f"omitted blocks must lie in 0..{num_blocks - 1}, got {sorted(omitted)}")
    steps = [0.0 if i in omitted else 1.0 for i in range(num_blocks)]
    kept = None
    for i in range(num_blocks):
        if i not in omitted:
            kept = i
        elif kept is not None:
            steps[kept] += 1.0
    return steps
