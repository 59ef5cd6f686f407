"""NeFL's hand-picked depth-scaled sub-models: which blocks each sub-model keeps in the paper's
appendix tables (Kang et al., arXiv:2308.07761, Tables 10-14), transcribed row by row.

The authors chose these by hand, per model, to meet the target parameter ratios; no single rule
reproduces them (ResNet-110's NeFL-D keeps 16, 4 and 3 blocks of its three stages at gamma 0.2, its
NeFL-WD keeps each stage's last block, ResNet-18's NeFL-WD scales only the smallest sub-model in
depth, and NeFL-D's sub-models need not nest). A row gives, per stage, '1' for a kept block and '0'
for an omitted one; NeFL-DO uses NeFL-D's blocks (its step sizes follow from them,
`nefl_do_step_sizes`). A table applies to a model with the same body: the same kind of model with
the same blocks per stage, and to the paper's gammas."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hfl.errors import ConfigError
from hfl.models.base import ScalableModel
from hfl.submodel.scaling import omittable_blocks, stages_of

log = logging.getLogger(__name__)

GAMMAS = (0.2, 0.4, 0.6, 0.8, 1.0)
"""The sub-model sizes of every table but ViT's (the paper's Tables 1, 2, 4-6)."""


@dataclass(frozen=True)
class KeptBlocks:
    """One table: the blocks every sub-model but the whole model keeps."""

    source: str
    """Where in the paper, e.g. "Table 12, NeFL-D (ResNet-56)"."""
    model: str
    """hfl's model of that body."""
    gammas: tuple[float, ...]
    rows: tuple[str, ...]
    """Per sub-model, smallest first: each stage's kept ('1') and omitted ('0') blocks, stages
    separated by spaces."""

    def omitted(self, submodel: int, stages: Sequence[Sequence[int]]) -> frozenset[int]:
        """The body blocks sub-model `submodel` (1-based) omits; the whole model omits none."""
        if submodel > len(self.rows):
            return frozenset()
        marks = self.rows[submodel - 1].split()
        return frozenset(b for stage, mark in zip(stages, marks) for b, kept in zip(stage, mark) if kept == "0")


TABLES: dict[tuple[str, tuple[int, ...], str], KeptBlocks] = {
    # (model class, blocks per stage, scaling) -> the paper's table
    ("ResNet", (2, 2, 2, 2), "d"): KeptBlocks("Table 10, NeFL-D (ResNet-18)", "resnet18", GAMMAS, (
        "11 00 11 00", "10 00 10 10", "11 11 11 10", "10 11 00 11")),
    ("ResNet", (2, 2, 2, 2), "wd"): KeptBlocks("Table 10, NeFL-WD (ResNet-18)", "resnet18", GAMMAS, (
        "11 11 11 10", "11 11 11 11", "11 11 11 11", "11 11 11 11")),
    ("ResNet", (3, 4, 6, 3), "d"): KeptBlocks("Table 11, NeFL-D (ResNet-34)", "resnet34", GAMMAS, (
        "100 1000 100000 100", "111 1111 110001 100", "111 1111 110001 101", "111 1001 110001 111")),
    ("ResNet", (3, 4, 6, 3), "wd"): KeptBlocks("Table 11, NeFL-WD (ResNet-34)", "resnet34", GAMMAS, (
        "111 1001 100001 101", "111 1001 111001 101", "111 1111 111101 101", "111 1111 111001 111")),
    ("ResNet", (9, 9, 9), "d"): KeptBlocks("Table 12, NeFL-D (ResNet-56)", "resnet56", GAMMAS, (
        "110000000 110000000 110000000",
        "111000000 111000000 111100000",
        "111100000 111100000 111111000",
        "111111111 111111110 111111100")),
    ("ResNet", (9, 9, 9), "wd"): KeptBlocks("Table 12, NeFL-WD (ResNet-56)", "resnet56", GAMMAS, (
        "111100000 111100000 111100000",
        "111111000 111111000 111111000",
        "111111100 111111100 111111100",
        "111111110 111111110 111111110")),
    ("ResNet", (18, 18, 18), "d"): KeptBlocks("Table 14, NeFL-D (ResNet-110)", "resnet110", GAMMAS, (
        "111111111111111100 111100000000000000 111000000000000000",
        "111111111111110000 111111100000000000 111111100000000000",
        "111111111111111110 111111111111100000 111111111100000000",
        "111111111111111100 111111111111111100 111111111111110000")),
    ("ResNet", (18, 18, 18), "wd"): KeptBlocks("Table 14, NeFL-WD (ResNet-110)", "resnet110", GAMMAS, (
        "111111100000000001 111111100000000001 111111100000000001",
        "111111111110000001 111111111110000001 111111111110000001",
        "111111111111100001 111111111111100001 111111111111100001",
        "111111111111111001 111111111111111001 111111111111111001")),
    ("ViT", (12,), "d"): KeptBlocks("Table 13, NeFL-D (ViT-B/16)", "vit_tiny", (0.5, 0.75, 1.0), (
        "111111000000", "111111111000")),
}


def paper_table(model_kind: str, stages: Sequence[Sequence[int]], scaling: str, gammas: Sequence[float]) -> KeptBlocks | None:
    """The paper's table for a model of this kind and stages, this scaling and these gammas; None
    when the paper has none."""
    table = TABLES.get((model_kind, tuple(len(stage) for stage in stages), scaling))
    return table if table is not None and tuple(gammas) == table.gammas else None


def table_for(model: ScalableModel, scaling: str, gammas: Sequence[float], omit: str) -> KeptBlocks | None:
    """The table depth scaling follows under `method.omit`: the paper's for this model, scaling and
    gammas with 'auto' or 'paper' ('paper' refuses where there is none); None otherwise."""
    if "d" not in scaling or omit not in ("auto", "paper"):
        return None
    stages = stages_of(model)
    table = paper_table(type(model).__name__, stages, scaling, gammas)
    if table is None:
        if omit == "paper":
            raise ConfigError("method.omit", "paper", f"a model, scaling and gammas the paper tabulates ({covered()}); "
                              "'params' or 'per_stage' for others")
        return None
    strays = {b for row in range(1, len(table.rows) + 1) for b in table.omitted(row, stages)} - omittable_blocks(model)
    if strays:
        raise ConfigError("method.omit", omit, f"'params' or 'per_stage': {table.source} omits blocks {sorted(b + 1 for b in strays)}, "
                          "which this model cannot omit")
    log.info("nefl: sub-models' blocks as the paper's %s", table.source)
    return table


def covered() -> str:
    """What the tables cover, for error messages."""
    scalings: dict[str, list[str]] = {}
    for (_, _, scaling), table in TABLES.items():
        scalings.setdefault(table.model, []).append(scaling)
    groups: dict[tuple[tuple[str, ...], tuple[float, ...]], list[str]] = {}
    for table in TABLES.values():
        models = groups.setdefault((tuple(scalings[table.model]), table.gammas), [])
        if table.model not in models:
            models.append(table.model)
    return "; ".join(f"{', '.join(models)} with scaling {' or '.join(kinds)} and gammas {', '.join(f'{g:g}' for g in gammas)}"
                     for (kinds, gammas), models in groups.items())
