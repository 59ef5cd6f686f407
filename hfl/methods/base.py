"""The method plug-in API: plan (which sub-model a client trains), objective (its loss) and
aggregate (global state + updates -> new global state)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.accounting.cost import TrainingCost
from hfl.models.base import ScalableModel
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.submodel.spec import SubmodelSpec, full_spec, shape_model
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

if TYPE_CHECKING:
    from hfl.client import ClientModule

MethodState = dict[str, Any]


@dataclass(frozen=True)
class ServerResources:
    """What a method may use on the server besides the updates (FedDF's distillation)."""

    build_model: Callable[[float], ScalableModel]
    """Builds the method's model (exits and all) at an absolute width ratio."""
    device: torch.device
    unlabelled_x: Tensor | None
    """The server's share of the training inputs, normalised, labels withheld (`data.server_fraction`)."""
    seed: int
    """The experiment's seed, for the server's own random draws."""


@dataclass(frozen=True)
class MethodConfig:
    name: str = "fedavg"
    """Method registry key (`hfl methods` lists them)."""


class Method:
    """Default behaviour: every client trains the whole global model with cross-entropy, and the
    server takes the masked weighted mean of the updates. Methods override one or more roles."""

    Config: ClassVar[type[MethodConfig]] = MethodConfig
    paper: ClassVar[str] = ""
    keeps_initial_weights: ClassVar[bool] = False
    """True when the objective needs the weights the client started the round with."""
    preferred_norm: ClassVar[str] = "bn"
    """The batch-norm kind `model.norm=auto` builds the model with."""
    level_table_title: ClassVar[str] = ""
    """What `hfl budget` calls the table of `level_table` (the paper table it reproduces)."""

    def __init__(self, config: MethodConfig, model: ScalableModel, accountant: Accountant | None = None) -> None:
        self.config = config
        self.model = model  # the global model's structure; methods read it, never train it
        self.accountant = accountant  # what a sub-model costs to train, for fitting budgets
        self.server: ServerResources | None = None
        """Set by the environment that runs the method."""

    def use_budgets(self, budgets: Sequence[ClientBudget | None], batch_size: int) -> None:
        """Called once, before `adapt_model`, with every client's budget (fixed for the run) and the
        batch size they were costed at, for methods whose sub-models follow from the clients'
        resources (ScaleFL's levels); ignored by default."""

    def training_cost(self, spec: SubmodelSpec, batch_size: int) -> TrainingCost:
        """What training `spec` for one step costs a client (memory, FLOPs): the accountant's
        measurement of a cross-entropy step at every exit, unless the objective does more (FjORD's
        self-distillation runs two widths). Budgets are checked and reported against this."""
        if self.accountant is None:
            raise RuntimeError("training costs need an accountant (ClientEnvironment gives the method one)")
        width = self.model.width if spec.width is None else spec.width
        return self.accountant.cost(width, batch_size, spec)

    def task_cost(self, task: ClientTask, batch_size: int) -> TrainingCost:
        """What the client-round `task` costs per step: `training_cost` of its spec, unless the task
        trains in stages (FeDepth: the peak of its block groups, the FLOPs of all of them)."""
        return self.training_cost(task.spec, batch_size)

    def training_stages(self, task: ClientTask) -> Sequence[frozenset[str] | None]:
        """Parameter names trained one stage after the other, each stage for the round's local
        epochs with a fresh optimiser (FeDepth's block groups); None: every parameter the spec does
        not freeze. The objective reads the current stage's index as `client.stage`."""
        return (None,)

    def peer_models(self, task: ClientTask, model: nn.Module) -> list[nn.Module]:
        """Models a client trains beside the one it uploads, alive for this client-round only
        (m-FeDepth's mutual-distillation peers); built on `model`'s device. None by default."""
        return []

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        """Change a freshly built model (the global one, each client's, each evaluated one) the way
        this method needs: add early exits, a norm per width. Must give equal models equal changes."""
        return model

    def model_key(self, spec: SubmodelSpec) -> tuple:
        """What makes client models differ in structure: specs with equal keys share one built
        model (`client_model`), loaded with each client's weights."""
        return (self.model.width if spec.width is None else spec.width, spec.dropped_blocks, spec.depth)

    def client_model(self, spec: SubmodelSpec, build: Callable[[float], ScalableModel]) -> nn.Module:
        """A model of `spec`'s structure from `build(width)` (the method's model, adapted): by default
        the model at the spec's width with its depth structure; SplitMix assembles several."""
        return shape_model(build(self.model.width if spec.width is None else spec.width), spec)

    def initial_global_state(self, build: Callable[[float], ScalableModel]) -> StateDict:
        """The global state before round 1, from `build(width)` (the method's model, freshly
        initialised); methods that keep several models in it (Decoupled) override this."""
        return build(self.model.width).state_dict()

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        """What is scored as "the global model": the whole state by default."""
        return full_spec()

    def init_state(self) -> MethodState:
        """Server-side method state (masks, step sizes, ...), checkpointed with the model."""
        return {}

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        """The client's task this round; None when nothing the method offers fits its budget (the
        client sits the round out and the round records it as skipped)."""
        return ClientTask(ctx=ctx, spec=full_spec())

    def objective(self, client: ClientModule, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """The client loss for one batch: a dict with `loss` plus any terms worth logging."""
        return {"loss": F.cross_entropy(client.model(x), y)}

    def aggregate(
        self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState
    ) -> tuple[StateDict, MethodState]:
        return masked_weighted_mean(global_state, updates), state

    def describe_task(self, task: ClientTask) -> str:
        """One line on what a client trains, for `hfl budget`'s per-tier plans."""
        if not task.options:
            return "the whole model" if not task.spec.indices and not task.spec.absent else str(task.spec.describe())
        return ", ".join(f"{k}={v}" for k, v in task.options.items())

    def level_table(self) -> list[dict[str, Any]]:
        """Rows `hfl budget` prints about the sub-models or levels this method defines (ScaleFL's
        split ratios and costs per level), one column per key (`name` links a row to `submodels`
        for its training memory); none by default."""
        return []

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        """The sub-models this method defines, by name, each evaluated every evaluation round
        (worst and mean go to the summary); none for methods that train one model."""
        return {}
