"""NeFL — Kang, Cha, Kim and Kim, "NeFL: Nested Model Scaling for Federated Learning with System
Heterogeneous Clients" (arXiv:2308.07761). Nested sub-models scaled in width and depth, every
residual block computing Y + s F(Y) with learnable step sizes; step sizes and batch norms are kept
per sub-model ("inconsistent") and averaged among that sub-model's clients (FedAvg), every other
parameter by NeFedAvg.

Sub-models. `method.gammas` are target parameter ratios (default 0.2, 0.4, 0.6, 0.8, 1).
- NeFL-W (`scaling=w`): the width ratio whose sub-model holds the target share of the parameters
  (every layer scaled alike, channels kept from the front as in HeteroFL/FjORD).
- NeFL-D (`scaling=d`): blocks omitted until the parameter ratio is met. On the models the paper
  tabulates (ResNet-18/34/56/110 at gammas 0.2-1, Tables 10-12 and 14; vit_tiny, the 12-block
  ViT, at 0.5/0.75/1, Table 13) each sub-model omits exactly the blocks the authors picked by hand
  (`omit=auto`, the default, or `paper`; `hfl.methods.nefl_tables`); they keep different numbers
  of blocks per stage and need not nest. Elsewhere (`omit=params`): of all sets of blocks whose
  omission meets the ratio, the one leaving the most parameters. Among blocks of equal size the
  last block of each stage goes first, deepest stage first (later blocks refine what earlier ones
  computed), stage-opening blocks last (a block that changes the feature shape keeps its
  projection shortcut, as the paper's ResNet-18 sub-models do). These sets need not nest either.
  `omit=per_stage`: every stage keeps the same number of leading blocks, the number whose
  parameter share is closest to gamma_D (NeFL-WD: among those holding at least gamma), so the
  sub-models nest, as the paper's ResNet-56 NeFL-WD table does.
- NeFL-WD (`scaling=wd`): gamma = gamma_W * gamma_D; the blocks are the paper's where it has a
  table (ResNet-18's scales only its smallest sub-model in depth, ResNet-110's keeps each stage's
  last block), elsewhere gamma_D = gamma^depth_exponent (balanced by default); the width is then
  solved for the whole sub-model to hold gamma of the parameters.
Step sizes start at 1 (NeFL-D) or, with `initial_steps=do`, a kept block followed by k omitted ones
starts at k + 1 (NeFL-DO); `learnable_steps=false` keeps them at their initial values (N/L). They
train in the client's optimiser at its learning rate, as the paper's "trained along with the network
parameters" and the authors' code (one SGD for all); a tenth of that rate did not steady NeFL-D,
whose unsteadiness came from too few clients per round (benchmarks/RESULTS.md, "NeFL-D stability").

Aggregation (Algorithm 2). NeFedAvg averages each entry of the consistent parameters over the
clients whose sub-model holds it, which is the shared masked mean: in appendix B.3's example a
slice held by sub-models 1, 3 and 5 is averaged over all their clients, the part only 3 and 5 hold
over theirs, and so on. Inconsistent parameters live once per sub-model in the global state
(`<norm>.m<k>.*`, `body.<i>.step.m<k>`), so the same mean is FedAvg over that sub-model's clients.
Both divide by client counts, as Algorithm 2 does (not by sample counts).

Clients (appendix B.7): five tiers, each drawing its sub-model every round among those within
`tier_window` of its own (`hfl.submodel.ladder`); with memory budgets a client's tier is the largest
sub-model whose training fits, and only fitting sub-models are drawn.

Models without residual blocks (the CNN) have no step sizes and no blocks to omit: NeFL-WD then
scales width alone, and NeFL-D is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from hfl.accounting.analytic import held_parameters
from hfl.errors import ConfigError, check, check_choice
from hfl.methods.base import LadderConfig, Method, Resources
from hfl.methods.nefl_tables import table_for
from hfl.models.base import ResidualBlock, ScalableModel
from hfl.registry import METHODS
from hfl.submodel.copies import NormCopies, StepCopies, copy_keys, keep_copy, nefl_do_step_sizes
from hfl.submodel.ladder import Level
from hfl.submodel.scaling import (
    blocks_to_omit,
    largest_width,
    omission_order,
    omittable_blocks,
    per_stage_omission,
    stages_of,
)
from hfl.submodel.spec import SubmodelSpec, drop_blocks, width_spec
from hfl.types import RoundContext

log = logging.getLogger(__name__)

SCALINGS = ("w", "d", "wd")
INITIAL_STEPS = ("ones", "do")
OMISSIONS = ("auto", "paper", "params", "per_stage")


@dataclass(frozen=True)
class NeFLConfig(LadderConfig):
    name: str = "nefl"
    weighting: str = "clients"
    """NeFedAvg (Algorithm 2) divides every slice by the number of clients that trained it."""
    scaling: str = "wd"
    """'w' width only (NeFL-W), 'd' depth only (NeFL-D), 'wd' both (NeFL-WD)."""
    gammas: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)
    """Each sub-model's target share of the global model's parameters, ascending; the last is 1."""
    learnable_steps: bool = True
    """Train the step sizes (False: the paper's N/L ablation, constant at their initial values)."""
    initial_steps: str = "ones"
    """'ones' (NeFL-D) or 'do' (NeFL-DO: a kept block followed by k omitted ones starts at k + 1)."""
    inconsistent: bool = True
    """Keep batch norms and step sizes per sub-model (False: everything averaged by NeFedAvg)."""
    omit: str = "auto"
    """Which blocks depth scaling omits: 'paper' (the paper's hand-picked sub-models, Tables 10-14:
    ResNet-18/34/56/110 NeFL-D and NeFL-WD at gammas 0.2-1, vit_tiny NeFL-D at 0.5, 0.75, 1),
    'params' (of all sets meeting the parameter ratio, the one leaving the most parameters),
    'per_stage' (the same leading blocks of every stage, as many as bring the share closest to the
    target; nested), or 'auto' ('paper' where the paper has a table, else 'params')."""
    depth_exponent: float = 0.5
    """NeFL-WD's split of gamma: gamma_D = gamma ** depth_exponent, the width taking the rest."""
    tier_window: int = 2
    """Appendix B.7: each round a client draws among the sub-models within this many of its tier's;
    -1: no draw, each client trains the largest sub-model fitting its budget (the whole model without one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("scaling", self.scaling, SCALINGS)
        check_choice("initial_steps", self.initial_steps, INITIAL_STEPS)
        check_choice("omit", self.omit, OMISSIONS)
        gammas = list(self.gammas)
        check(bool(gammas) and all(0 < g <= 1 for g in gammas) and gammas == sorted(set(gammas)) and gammas[-1] == 1,
              "gammas", gammas, "ascending ratios in (0, 1] ending with 1")
        check(0 <= self.depth_exponent <= 1, "depth_exponent", self.depth_exponent, "a number in [0, 1]")
        check(self.inconsistent or self.initial_steps == "ones", "initial_steps", self.initial_steps,
              "'ones' when inconsistent=false (NeFL-DO's values differ per sub-model)")


@dataclass(frozen=True)
class Submodel:
    """One nested sub-model: width ratio (relative to the global model) and omitted blocks."""

    index: int
    """1-based, smallest first (the paper's model index)."""
    gamma: float
    width: float
    omitted: frozenset[int]
    params: int

    @property
    def copy_name(self) -> str:
        return f"m{self.index}"

    @property
    def name(self) -> str:
        return f"x{self.gamma:g}"


@dataclass(frozen=True)
class NeFLOptions:
    submodel: int
    gamma: float

    def __str__(self) -> str:
        return f"sub-model {self.submodel} (gamma {self.gamma:g})"


@METHODS.register("nefl")
class NeFL(Method):
    Config = NeFLConfig
    preferred_norm = "bn"

    def __init__(self, config: NeFLConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        self.residual = any(isinstance(b, ResidualBlock) for b in self.model.body)
        if self.residual and not all(isinstance(b, ResidualBlock) for b in self.model.body):
            raise ConfigError("model.name", type(self.model).__name__.lower(), "a model whose body blocks are all residual for nefl "
                              "(resnet18, preresnet20, resnet56, resnet110, vit) or none of them (cnn): step sizes scale residual branches")
        if config.scaling == "d" and not self.residual:
            raise ConfigError("method.scaling", "d", f"'w' or 'wd': {type(self.model).__name__} has no residual blocks to omit")
        self.total_params = held_parameters(self.model, SubmodelSpec())
        self.order = omission_order(self.model) if self.residual else []
        """Blocks depth scaling may omit, in the order equal-sized ones go."""
        self.saved = {b: self.total_params - held_parameters(self.model, drop_blocks(SubmodelSpec(), self.model, {b})) for b in self.order}
        """Parameters omitting each block saves."""
        self.table = table_for(self.model, config.scaling, config.gammas, config.omit) if self.residual else None
        """The paper's sub-models for this model, scaling and gammas, when depth scaling uses them."""
        self.submodels_ = [self._scale(k, g) for k, g in enumerate(config.gammas, start=1)]
        self.model = self.adapt_model(self.model)
        levels = [Level(sub.name, self.spec_for(sub), NeFLOptions(sub.index, sub.gamma)) for sub in self.submodels_]
        self.ladder = self.make_ladder(levels, tier_window=config.tier_window, evaluated="trained", global_model="largest_trained",
                                       table=self.level_table, title="NeFL's Table 8; params ratio: achieved share of the parameters beside the target gamma")

    # -- sub-models -----------------------------------------------------------------------------
    def _params(self, width: float, omitted: frozenset[int]) -> int:
        return held_parameters(self.model, drop_blocks(width_spec(self.model, self.model.width * width), self.model, omitted))

    def _scale(self, index: int, gamma: float) -> Submodel:
        """The sub-model holding `gamma` of the parameters under the configured scaling."""
        scaling, total = self.config.scaling, self.total_params
        omitted: frozenset[int] = frozenset()
        if "d" in scaling and self.residual and gamma < 1:
            depth_gamma = gamma if scaling == "d" else gamma**self.config.depth_exponent
            if self.table is not None:
                omitted = self.table.omitted(index, stages_of(self.model))
            elif self.config.omit == "per_stage":
                at_least = gamma if "w" in scaling else 0.0
                omitted = per_stage_omission(stages_of(self.model), omittable_blocks(self.model), self.saved, total, depth_gamma, at_least)
            else:
                omitted = blocks_to_omit(self.order, self.saved, total, depth_gamma)
        width = 1.0
        if "w" in scaling and gamma < 1:
            width = largest_width(lambda w: self._params(w, omitted), gamma * total)
        return Submodel(index, gamma, width, omitted, self._params(width, omitted))

    def spec_for(self, sub: Submodel) -> SubmodelSpec:
        """Sub-model `sub`: its width slice, omitted blocks, and its own copies only."""
        spec = drop_blocks(width_spec(self.model, self.model.width * sub.width), self.model, sub.omitted)
        if self.config.inconsistent:
            spec = replace(spec, absent=spec.absent | copy_keys(self.model, [s.copy_name for s in self.submodels_ if s is not sub]))
        if not self.config.learnable_steps:
            spec = replace(spec, frozen=spec.frozen | (frozenset(self.model.step_size_keys()) - spec.absent))
        return spec

    # -- models ---------------------------------------------------------------------------------
    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        """Batch norms and step sizes per sub-model (one of each when `inconsistent=false`)."""
        names = [s.copy_name for s in self.submodels_]
        if self.config.inconsistent:
            model.replace_norms(lambda norm: NormCopies(norm, names))
        if not self.residual:
            return model
        model.add_step_sizes(1.0)
        if self.config.inconsistent:
            initial = nefl_do_step_sizes if self.config.initial_steps == "do" else lambda n, _omitted: [1.0] * n
            starts = {s.copy_name: initial(len(model.body), s.omitted) for s in self.submodels_}
            for i, block in enumerate(model.body):
                if isinstance(block, ResidualBlock) and not block.branch_skipped:
                    for step in block.step_names:
                        like = getattr(block, step)
                        delattr(block, step)  # a parameter slot takes no module
                        setattr(block, step, StepCopies({n: starts[n][i] for n in names}, like))
        return model

    def client_model(self, spec: SubmodelSpec, norm: str | None = None) -> nn.Module:
        """The sub-model's model, holding its own copies only (the whole state's model holds all)."""
        model = super().client_model(spec, norm)
        held = [s.copy_name for s in self.submodels_ if not copy_keys(self.model, [s.copy_name]) <= spec.absent]
        if self.config.inconsistent and len(held) == 1:
            keep_copy(model, held[0])
        return model

    def level_table(self, ctx: RoundContext) -> list[dict[str, Any]]:
        """The paper's Table 8 per sub-model: target and achieved parameter ratio, width, omitted
        blocks, parameters and forward FLOPs per sample; a last row with their means."""
        rows = []
        for sub in self.submodels_:
            task = self.ladder.task_for(ctx, self.ladder[sub.name])
            rows.append({"name": sub.name, "submodel": sub.index, "gamma": sub.gamma, "params_ratio": sub.params / self.total_params,
                         "width": sub.width, "omitted_blocks": ",".join(str(b + 1) for b in sorted(sub.omitted)) or "-",
                         "params": sub.params, "flops": self.training_cost(task, self.resources.batch_size).forward_flops_per_sample})
        mean = {"name": "mean", "submodel": "mean", "gamma": sum(r["gamma"] for r in rows) / len(rows),
                "params_ratio": sum(r["params_ratio"] for r in rows) / len(rows), "width": None, "omitted_blocks": "",
                "params": sum(r["params"] for r in rows) / len(rows), "flops": sum(r["flops"] for r in rows) / len(rows)}
        return [*rows, mean]
