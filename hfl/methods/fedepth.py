"""FeDepth and m-FeDepth — Zhang, Dai, Wang, Xing, Chen and Sun, "Memory-adaptive Depth-wise
Heterogeneous Federated Learning", AAAI 2024 (arXiv:2303.04887).

Every client trains the whole model, one group of consecutive blocks at a time. The groups come from
the client's memory budget (`decompose`, the paper's Figure 3): blocks are packed in order while the
group's measured training memory fits (the paper sums per-block memories; measuring the group counts
the frozen prefix's forward, the head and the batch once). For group j the earlier blocks are frozen
and run without saving activations, the group is trained together with the head, and the group's
output reaches the head through a skip connection over the remaining blocks (problem (1)); the head
trained with group j is the starting point for group j+1 (Algorithm 1).
`connector=auxiliary` trains an auxiliary classifier after the group instead (the alternative the
paper names). A block that does not fit even alone is never trained by that client but still runs
forward (partial training); the server averages each tensor over the clients that trained it.
`grouping=paper` replaces the decomposition by the authors' fixed groups per budget tier (their
code's PreResNet-20 schedule), to compare with the paper's tables.

m-FeDepth (`mfedepth`, `hfl.methods.mfedepth`) trains several models with mutual distillation where
a budget has surplus memory for them in FeDepth's groups; its peers are built here (`max_models`).

Deliberate choices where the paper is silent:
- The skip connection is the parameter-free shortcut of He et al. (2016): the group's output is
  subsampled to (about) the head's resolution and its channels zero-padded to the head's; the head
  pools globally, so only its channel count must match.
- Each group is trained for the round's local epochs, so a client makes as many updates per block
  as FedAvg ("the same number of local updates"); each group starts a fresh optimiser.
- Frozen blocks run in training mode (batch statistics, as when they were trained this round).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor, nn

from hfl.accounting.amounts import ClientBudget
from hfl.accounting.cost import TrainingCost
from hfl.errors import ConfigError, check, check_choice
from hfl.losses import mutual_learning_loss
from hfl.methods.base import Client, Method, MethodConfig, MethodState, Resources
from hfl.methods.vectorisable import vectorisable
from hfl.models.base import ScalableModel
from hfl.models.exits import EXIT_KINDS, add_exits
from hfl.models.shortcut import block_output_shapes, skip_to_head
from hfl.registry import METHODS
from hfl.submodel.scaling import Group, Layout, decompose
from hfl.submodel.spec import freeze, full_spec
from hfl.types import ClientTask, RoundContext

log = logging.getLogger(__name__)

CONNECTORS = ("skip", "auxiliary")
GROUPINGS = ("measured", "paper")

PAPER_LAYOUTS: dict[str, tuple[tuple[Group, ...], tuple[int, ...]]] = {
    "w1_8": (((3, 3), (4, 4), (5, 5), (6, 7), (8, 8)), (0, 1, 2)),
    "w1_6": (((0, 0), (1, 1), (2, 2), (3, 3), (4, 5), (6, 8)), ()),
    "w1_3": (((0, 1), (2, 3), (4, 8)), ()),
    "w1_2": (((0, 2), (3, 8)), ()),
    "w1": (((0, 8),), ()),
    "w2": (((0, 8),), ()),
}
"""The authors' fixed block groups and skipped blocks of PreResNet-20 (blocks counted from 0) per
scenario tier (`budgets.scenario` fair, lack, surplus): 6 / 3 / 2 / 1 groups for the 1/6, 1/3, 1/2
and 1 tiers, and under `lack` the 1/8 tier skips blocks 1-3. `method.grouping=paper` uses them."""
PAPER_BLOCKS = 9


@dataclass(frozen=True)
class FeDepthConfig(MethodConfig):
    name: str = "fedepth"
    connector: str = "skip"
    """How a group reaches a classifier: 'skip' (a skip connection to the head) or 'auxiliary'
    (an auxiliary classifier after every block; the head after the last)."""
    exit_kind: str = "linear"
    """Auxiliary classifier: 'linear' (pooling and a linear layer) or 'bottleneck'."""
    max_models: int = 1
    """Most models a client trains with mutual distillation (m-FeDepth); 1: FeDepth."""
    temperature: float = 1.0
    """Softmax temperature of the mutual distillation (scaled back by T^2)."""
    grouping: str = "measured"
    """'measured': blocks packed in order while the whole group's measured training memory fits the
    client's budget (Figure 3); 'paper': the authors' fixed groups per scenario tier for PreResNet-20
    (`PAPER_LAYOUTS`), for comparison with the paper's tables; budgets are then not consulted and
    a client that breaks its budget is reported as a violation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("connector", self.connector, CONNECTORS)
        check_choice("grouping", self.grouping, GROUPINGS)
        check_choice("exit_kind", self.exit_kind, EXIT_KINDS)
        check(self.max_models >= 1, "max_models", self.max_models, "an integer >= 1")
        check(self.temperature > 0, "temperature", self.temperature, "a positive number")


@METHODS.register("fedepth")
class FeDepth(Method):
    Config = FeDepthConfig
    preferred_norm = "bn"  # every client trains the whole model: running statistics stay valid

    def __init__(self, config: FeDepthConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        self.num_blocks = len(self.model.blocks())
        if config.grouping == "paper":
            self.check_paper_grouping(resources)
        self.model = self.adapt_model(self.model)
        self._layouts: dict[tuple, Layout | None] = {}
        self._block_output_shapes: dict[tuple, list[tuple[int, ...]]] = {}

    def check_paper_grouping(self, resources: Resources) -> None:
        """The paper's groups exist for PreResNet-20's nine blocks and the scenario tiers only."""
        if self.num_blocks != PAPER_BLOCKS:
            raise ConfigError("method.grouping", "paper", f"a model with {PAPER_BLOCKS} blocks (preresnet20); "
                              f"{type(self.model).__name__} has {self.num_blocks}: use method.grouping=measured")
        tiers = sorted({b.tier for b in resources.budgets if b is not None} - set(PAPER_LAYOUTS))
        if tiers or not any(resources.budgets):
            raise ConfigError("method.grouping", "paper", "budgets.scenario fair, lack or surplus (the paper's tiers "
                              f"{', '.join(PAPER_LAYOUTS)}){'; found tiers ' + ', '.join(tiers) if tiers else ''}")

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        if self.config.connector == "auxiliary":
            add_exits(model, range(len(model.blocks()) - 1), self.config.exit_kind)
        return model

    # -- the stage a client trains ------------------------------------------------------------
    def classifier(self, model: ScalableModel, last: int) -> nn.Module:
        """The classifier a group ending at block `last` trains with."""
        if self.config.connector == "auxiliary" and last < self.num_blocks - 1:
            return model.exits[str(last)]
        return model.head

    def stage_logits(self, model: ScalableModel, x: Tensor, group: Group) -> Tensor:
        """Problem (1)'s forward: frozen blocks without saved activations, the group, then its classifier."""
        first, last = group
        with torch.no_grad():
            h = x
            if first > 0:
                h = model.stem(x)
                for i in range(first):
                    h = model.body[i](h)
        if first == 0:
            h = model.stem(h)
        for i in range(first, last + 1):
            h = model.body[i](h)
        classifier = self.classifier(model, last)
        if classifier is model.head:
            h = skip_to_head(h, self.head_input_shape(x.shape[1:], x.dtype))
        return classifier(h)

    def head_input_shape(self, input_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
        """Probed on the method's own model: a client's may run on weights `functional_call` swapped in."""
        key = (tuple(input_shape), dtype)
        if key not in self._block_output_shapes:
            self._block_output_shapes[key] = block_output_shapes(self.model, input_shape, dtype)
        return self._block_output_shapes[key][-1]

    def stage_loss(self, models: Sequence[ScalableModel], x: Tensor, y: Tensor, group: Group) -> dict[str, Tensor]:
        return mutual_learning_loss([self.stage_logits(m, x, group) for m in models], y, self.config.temperature)

    def stage_modules(self, model: ScalableModel, group: Group) -> list[nn.Module]:
        first, last = group
        return [*([model.stem] if first == 0 else []), *(model.body[i] for i in range(first, last + 1)), self.classifier(model, last)]

    def stage_parameters(self, model: ScalableModel, group: Group) -> frozenset[str]:
        names = {id(p): n for n, p in model.named_parameters()}
        return frozenset(names[id(p)] for module in self.stage_modules(model, group) for p in module.parameters())

    # -- costs and the decomposition ----------------------------------------------------------
    def stage_cost(self, group: Group, models: int, batch_size: int) -> TrainingCost:
        """Measured memory and FLOPs of one step of `group` with `models` models resident and trained."""
        accountant = self.resources.accountant

        def build() -> nn.Module:
            model = self.build(self.model.width)
            self.head_input_shape(accountant.input_shape, accountant.input_dtype)  # shapes first: not part of the measurement
            trainable = self.stage_parameters(model, group)
            for name, param in model.named_parameters():
                param.requires_grad_(name in trainable)
            return nn.ModuleList([model, *(copy.deepcopy(model) for _ in range(models - 1))])

        def step(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            return self.stage_loss(list(m), x, y, group)["loss"]

        return accountant.cost(("stage", group, models), build, batch_size, step)

    def group_fits(self, group: Group, *, models: int, batch_size: int, budget: int) -> bool:
        return self.stage_cost(group, models, batch_size).peak_bytes <= budget

    def layout_for(self, budget: ClientBudget | None, batch_size: int) -> Layout | None:
        """The models and block groups a budget trains; None when not even one block fits."""
        key = (budget, batch_size)
        if key not in self._layouts:
            self._layouts[key] = self._layout(budget, batch_size)
        return self._layouts[key]

    def _layout(self, budget: ClientBudget | None, batch_size: int) -> Layout | None:
        if budget is None or budget.memory_bytes is None:
            return Layout(self.config.max_models, ((0, self.num_blocks - 1),), ())
        if self.config.grouping == "paper":
            return self._paper_layout(budget, batch_size)
        groups, skipped = decompose(self.num_blocks, partial(self.group_fits, models=1, batch_size=batch_size, budget=budget.memory_bytes))
        return Layout(self._models_for(groups, skipped, budget, batch_size), tuple(groups), tuple(skipped)) if groups else None

    def _paper_layout(self, budget: ClientBudget, batch_size: int) -> Layout:
        """The tier's fixed groups, with as many models (m-FeDepth) as its surplus memory holds."""
        groups, skipped = PAPER_LAYOUTS[budget.tier]
        return Layout(self._models_for(groups, skipped, budget, batch_size), groups, skipped)

    def _models_for(self, groups: Sequence[Group], skipped: Sequence[int], budget: ClientBudget, batch_size: int) -> int:
        """m-FeDepth's models on surplus memory: the most, up to `max_models`, that fit with the very
        groups one model trains, and only where every block is trained (the paper's Surplus scenario:
        the quarter of the clients at twice the whole model's memory)."""
        fitting = [m for m in range(2, self.config.max_models + 1) if not skipped
                   and all(self.group_fits(g, models=m, batch_size=batch_size, budget=budget.memory_bytes) for g in groups)]
        return max(fitting, default=1)

    def training_cost(self, task: ClientTask, batch_size: int) -> TrainingCost:
        """The peak over the client's groups; the FLOPs of all of them (each runs the local epochs)."""
        layout = task.options
        costs = [self.stage_cost(g, layout.models, batch_size) for g in layout.groups]
        peak = max(costs, key=lambda c: c.peak_bytes)
        return replace(
            peak,
            forward_flops_per_sample=sum(c.forward_flops_per_sample for c in costs),
            backward_flops_per_sample=sum(c.backward_flops_per_sample for c in costs),
        )

    # -- the method's roles -------------------------------------------------------------------
    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        layout = self.layout_for(ctx.budget, min(ctx.train.batch_size, ctx.num_samples))
        if layout is None:
            log.info("client %d: no block fits its budget of %d bytes", ctx.client_id, ctx.budget.memory_bytes)
            return None
        if layout.skipped:
            log.debug("client %d skips blocks %s (partial training)", ctx.client_id, list(layout.skipped))
        trained = [m for g in layout.groups for m in self.stage_modules(self.model, g)]
        held = {id(t) for module in trained for t in (*module.parameters(), *module.buffers())}
        untrained = [k for k, t in self.model.state_dict(keep_vars=True).items() if id(t) not in held]
        stages = tuple(self.stage_parameters(self.model, g) for g in layout.groups)
        return ClientTask(ctx, freeze(full_spec(), untrained), layout, stages=stages, peers=layout.models - 1)

    @vectorisable
    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        group = client.task.options.groups[client.stage]
        return self.stage_loss([client.model, *client.peers], x, y, group)
