"""Independent models side by side whose prediction is the mean of their logits (SplitMix's mix of
base models). Each base keeps its own state keys under `bases.<i>.`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from hfl.models.base import ScalableModel


class BaseEnsemble(nn.Module):
    """The mean of its bases' logits; offers what evaluation reads from a model (`forward_exits`,
    `exit_blocks`, `head`) as a model with one classifier."""

    def __init__(self, bases: Sequence[ScalableModel]) -> None:
        super().__init__()
        if not bases:
            raise ValueError("an ensemble needs at least one base model")
        self.bases = nn.ModuleList(bases)

    @property
    def exit_blocks(self) -> tuple[int, ...]:
        return ()

    @property
    def head(self) -> nn.Module:
        """The first base's classifier: the ensemble predicts at the bases' heads, never earlier."""
        return self.bases[0].head

    def forward(self, x: Tensor) -> Tensor:
        logits = [base(x) for base in self.bases]
        # One base is its own mean: returned as is, so a one-base ensemble computes exactly what the base does.
        return logits[0] if len(logits) == 1 else torch.stack(logits).mean(0)

    def forward_exits(self, x: Tensor) -> list[Tensor]:
        return [self(x)]
