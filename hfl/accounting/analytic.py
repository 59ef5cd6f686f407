"""Parameters and FLOPs of sub-models counted from their shapes, without building or running them
(for searches over many candidate sub-models: NeFL's width and depth solving, ScaleFL's grid)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import Tensor, nn

from hfl.accounting.cost import zero_inputs
from hfl.models.base import ScalableModel, scaled_channels
from hfl.models.exits import add_exits
from hfl.submodel.spec import SubmodelSpec


def held_parameters(model: ScalableModel, spec: SubmodelSpec) -> int:
    """Parameters of `model` a client of `spec` holds (no buffers)."""
    total = 0
    for key, param in model.named_parameters():
        if key in spec.absent:
            continue
        dims = spec.indices.get(key, {})
        count = 1
        for d, size in enumerate(param.shape):
            count *= len(dims[d]) if d in dims else size
        total += count
    return total


class AnalyticCosts:
    """Parameters and forward FLOPs per sample of any split, without building it: a tensor of the
    split has every coupled dimension at ceil(width * base) channels (in whole runs of its group's
    unit); a conv or linear layer costs 2 * weight entries * output positions FLOPs (what torch's
    FLOP counter counts), output positions from one forward of the global model with an exit after
    every block."""

    def __init__(
        self, model: ScalableModel, exit_kind: str, input_shape: tuple[int, ...] | None, input_dtype: torch.dtype = torch.float32
    ) -> None:
        probe = copy.deepcopy(model)  # exits are added to the copy only
        self.blocks = len(probe.blocks())
        missing = [b for b in range(self.blocks - 1) if str(b) not in probe.exits]
        add_exits(probe, missing, exit_kind)
        coupled: dict[str, dict[int, tuple[int, int]]] = {}  # key -> dim -> (base, unit) of its group
        for group in probe.channel_groups():
            for key, dim in group.members:
                coupled.setdefault(key, {})[dim] = (group.base, group.unit)
        positions = _output_positions(probe, zero_inputs(input_shape, 2, input_dtype)) if input_shape else None
        parts = {"stem": probe.stem, "head": probe.head}
        parts.update({f"body.{i}": probe.body[i] for i in range(self.blocks)})
        parts.update({f"exits.{b}": module for b, module in probe.exits.items()})
        # Per part: (shape, coupled dims) of each parameter, and (weight shape, coupled dims, positions) of each layer.
        self._params = {
            name: [(tuple(p.shape), coupled.get(f"{name}.{k}", {})) for k, p in part.named_parameters()]
            for name, part in parts.items()
        }
        self._layers = None if positions is None else {
            name: [(tuple(m.weight.shape), coupled.get(".".join(filter(None, (name, k, "weight"))), {}), positions[id(m)])
                   for k, m in part.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
            for name, part in parts.items()
        }
        self._cache: dict[tuple[str, float], tuple[int, int | None]] = {}

    @staticmethod
    def _entries(shape: tuple[int, ...], dims: dict[int, tuple[int, int]], width: float) -> int:
        return int(np.prod([scaled_channels(dims[d][0], width, dims[d][1]) if d in dims else n for d, n in enumerate(shape)]))

    def _part(self, name: str, width: float) -> tuple[int, int | None]:
        if (name, width) not in self._cache:
            params = sum(self._entries(shape, dims, width) for shape, dims in self._params[name])
            flops = None if self._layers is None else sum(
                2 * self._entries(shape, dims, width) * n for shape, dims, n in self._layers[name])
            self._cache[name, width] = (params, flops)
        return self._cache[name, width]

    def _parts(self, depth: int, exits: frozenset[int]) -> list[str]:
        names = ["stem", *(f"body.{i}" for i in range(depth)), *(f"exits.{b}" for b in sorted(exits))]
        return names + (["head"] if depth == self.blocks else [])

    def params(self, width: float, depth: int, exits: frozenset[int]) -> int:
        return sum(self._part(name, width)[0] for name in self._parts(depth, exits))

    def flops(self, width: float, depth: int, exits: frozenset[int]) -> int | None:
        counts = [self._part(name, width)[1] for name in self._parts(depth, exits)]
        return None if None in counts else sum(counts)


@torch.no_grad()
def _output_positions(model: ScalableModel, x: Tensor) -> dict[int, int]:
    """Output positions (pixels; 1 for a linear layer) of every conv and linear layer, by module id."""
    positions: dict[int, int] = {}

    def record(module: nn.Module, _inputs: object, out: Tensor) -> None:
        channels = out.shape[1] if isinstance(module, nn.Conv2d) else out.shape[-1]
        positions[id(module)] = out[0].numel() // channels

    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    hooks = [m.register_forward_hook(record) for m in layers]
    try:
        model.train()  # batch statistics: static batch norm has no others
        model.forward_exits(x)
    finally:
        for hook in hooks:
            hook.remove()
    return positions
