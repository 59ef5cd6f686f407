"""The method plug-in API: plan (which sub-model a client trains), objective (its loss) and
aggregate (global state + updates -> new global state), over a `Resources` object given once.

A method is a subclass of `Method` with a `Config` dataclass; each member's docstring says when a
method overrides it, and docs/extending.md walks through writing one. Methods over several sub-models
set `self.ladder` (`hfl.submodel.ladder`): it plans, fits budgets, records trained levels, names what
is evaluated and gives `hfl budget` its table. Sparse methods set `self.initial_masks`: the method
state carries the masks (`MethodState.masks`) and the global model is scored with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.amounts import ClientBudget
from hfl.accounting.cost import TrainingCost, tensor_bytes
from hfl.errors import check, check_choice
from hfl.models.base import ScalableModel
from hfl.optim import ClientOptimizer
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.submodel.ladder import Ladder, Level
from hfl.methods.vectorisable import vectorisable
from hfl.submodel.spec import SubmodelSpec, extract, full_spec, shape_model
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

ModelBuilder = Callable[..., ScalableModel]
"""build(width, norm=None): a fresh plain model at an absolute width ratio, optionally with another norm."""
WEIGHTINGS = ("samples", "clients")


@dataclass(frozen=True)
class MethodConfig:
    name: str = "fedavg"
    """Method registry key (`hfl methods` lists them)."""
    weighting: str = "samples"
    """How the masked mean weighs a client's update: by its sample count ('samples', FedAvg) or each
    client once ('clients', HeteroFL's per-entry count of the clients that hold it). Each method
    defaults to what its paper does (the method table in docs/methods.md)."""

    def __post_init__(self) -> None:
        check_choice("weighting", self.weighting, WEIGHTINGS)


@dataclass(frozen=True)
class LadderConfig(MethodConfig):
    """The settings every method over a ladder of sub-models shares."""

    tier_window: int = -1
    """-1: each client trains the largest level fitting its budget. k >= 0: NeFL's dynamic tiers
    (appendix B.7, `hfl.submodel.ladder`): each round a client trains a level drawn uniformly within
    k levels of its tier (the paper's setting is 2 with five levels)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        window = self.tier_window
        check(isinstance(window, int) and not isinstance(window, bool) and window >= -1, "tier_window", window, "an integer >= -1")


@dataclass(frozen=True)
class MethodState:
    """What a method keeps between rounds, checkpointed with the model. A method that keeps more
    declares a frozen subclass as its `State`."""

    trained_levels: frozenset[str] = frozenset()
    """Levels of the method's ladder some client has trained (recorded by the server)."""
    masks: Mapping[str, Tensor] = field(default_factory=dict)
    """The global model's element masks ({prunable state key: bool tensor}, False entries pruned and
    zero), for the sparse methods; empty: dense. The global model is scored with them."""


@dataclass(frozen=True)
class Resources:
    """Everything a method is built with."""

    model: ScalableModel
    """The global model's structure as configured; the method adapts it (`Method.model`)."""
    build: ModelBuilder
    """Builds the plain model at a width ratio (the method's `build` adapts it)."""
    accountant: Accountant
    """What training a model costs on this experiment's data, for fitting budgets."""
    budgets: Sequence[ClientBudget | None] = ()
    """Every client's budget, fixed for the run (None: unlimited)."""
    batch_size: int = 32
    """The batch size budgets were costed at."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the server computes (FedDF's distillation)."""
    unlabelled_x: Tensor | None = None
    """The server's share of the training inputs, normalised, labels withheld (`data.server_fraction`)."""
    seed: int = 0
    """The experiment's seed, for the server's own random draws."""
    rounds: int = 1
    """The run's number of rounds (for schedules that switch on part-way, e.g. ScaleFL's distillation)."""
    local_epochs: int = 1
    """Local epochs of a client-round (a FLOPs budget covers all of them)."""
    client_samples: Sequence[int] = ()
    """Every client's number of training samples, fixed for the run (for fitting FLOPs budgets
    before round 1: CAFF's model selection)."""
    load_member: Callable[[nn.Module, int], None] | None = None
    """Loads the pretrained family's member with `l` blocks into a model of that depth
    (`model.pretrained=FAMILY:l` names the family; CAFF picks l); None when the run starts from no family."""


class Client(Protocol):
    """What an objective sees of the client training (`hfl.client.ClientModule`)."""

    model: nn.Module
    peers: Sequence[nn.Module]
    task: ClientTask
    stage: int
    """Index of the running training stage (see `ClientTask.stages`)."""
    steps: int
    """Batches trained so far this client-round."""
    classes: Tensor | None
    """The labels present in the client's data."""
    initial: Mapping[str, Tensor]
    """The trainable weights the client started the round with."""
    optimizer: ClientOptimizer
    """The running stage's optimiser; it steps right after the objective's loss is backpropagated."""
    masks: Mapping[str, Tensor]
    """The element masks enforced after every optimiser step, on the model's device."""

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]: ...

    def replace_masks(self, masks: Mapping[str, Tensor]) -> None:
        """Enforce `masks` from this step's end on; the update is sent with them (FedDST)."""
        ...


class Method:
    """FedAvg's behaviour: every client trains the whole global model with cross-entropy, and the
    server takes the masked mean of the updates (weighted as `config.weighting` says)."""

    Config: ClassVar[type[MethodConfig]] = MethodConfig
    State: ClassVar[type[MethodState]] = MethodState
    preferred_norm: ClassVar[str] = "bn"
    """The batch-norm kind `model.norm=auto` builds the model with."""
    ladder: Ladder | None = None

    def __init__(self, config: MethodConfig, resources: Resources) -> None:
        self.config, self.resources = config, resources
        self.model = resources.model
        """The global model's structure (adapted by methods that adapt models); read, never trained."""
        self.initial_masks: dict[str, Tensor] = {}
        """The global model's masks before round 1 (`MethodState.masks`); a sparse method sets them."""
        self._sent_shapes: dict[tuple, StateDict] = {}

    # -- models -----------------------------------------------------------------------------------
    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        """Change a freshly built model the way this method needs (exits, a norm per width); applied
        to every model it builds. Must give equal models equal changes."""
        return model

    def client_model(self, spec: SubmodelSpec, norm: str | None = None) -> nn.Module:
        """A model of `spec`'s shape (`norm`: another batch-norm kind, for evaluation)."""
        return shape_model(self.build(self.width_of(spec), norm), spec)

    def initial_global_state(self) -> StateDict:
        """The global state before round 1 (freshly initialised under the run's seed)."""
        return self.build(self.model.width).state_dict()

    def client_state(self, global_state: StateDict, spec: SubmodelSpec) -> StateDict:
        """What a client of `spec` receives (and starts from, and is evaluated with): by default the
        global entries it holds. A method that sends something else (FedHM's factors) turns its
        updates back into global form in `aggregate`."""
        return extract(global_state, spec)

    # -- the three roles ----------------------------------------------------------------------------
    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        """The client's task this round; None when nothing the method offers fits its budget (the
        client sits the round out, recorded as skipped)."""
        return self.ladder.task(ctx) if self.ladder else ClientTask(ctx, full_spec())

    @vectorisable
    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """The client loss for one batch: a dict with `loss` plus any terms worth logging. It may set
        the learning rate of this step through `client.optimizer` (FedMef's budgeted rate); one that
        reads no more than `vectorisable` names says so with that decorator."""
        return {"loss": F.cross_entropy(client.model(x), y)}

    def client_uploads(self, client: Client, batches: Iterable[tuple[Tensor, Tensor]]) -> StateDict:
        """Tensors the client sends beside its trained weights, computed after its training
        (`batches`: its data, in a fresh order); they arrive in `ClientUpdate.extras`."""
        return {}

    def aggregate(self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState) -> tuple[StateDict, MethodState]:
        if self.config.weighting == "clients":
            updates = [replace(u, weight=1.0) for u in updates]
        return masked_weighted_mean(global_state, updates), state

    # -- costs ------------------------------------------------------------------------------------
    def training_cost(self, task: ClientTask, batch_size: int) -> TrainingCost:
        """What one step of `task` costs a client (memory, FLOPs): a cross-entropy step at every exit
        of its spec's client model, measured once per shape. Budgets are checked against this."""
        spec = task.spec

        def build() -> nn.Module:
            model = self.client_model(spec)
            for name, param in model.named_parameters():
                param.requires_grad_(name not in spec.frozen)
            return model

        return self.resources.accountant.cost(("client", spec.shape, spec.frozen), build, batch_size)

    # -- derived, not meant to be overridden ---------------------------------------------------------
    def make_ladder(self, levels: Sequence[Level], **policies: Any) -> Ladder:
        """A ladder over `levels`, costed by this method's `training_cost` and fitted to the run's
        budgets; `policies` as `Ladder` takes them (tier_window, unbudgeted, evaluated, ...)."""
        return Ladder(levels, self.training_cost, budgets=self.resources.budgets, upload=self.upload_bytes, **policies)

    def upload_bytes(self, spec: SubmodelSpec) -> int:
        """Bytes a client of `spec` sends up: its client model's tensors (what `client_state` gives it:
        FedHM's factors, not the weights they stand for), less its frozen ones and pruned entries."""
        key = (spec.shape, spec.frozen)
        if key not in self._sent_shapes:
            with torch.device("meta"):  # shapes only: no weights
                self._sent_shapes[key] = {k: v for k, v in self.client_model(spec).state_dict().items() if k not in spec.frozen}
        return tensor_bytes(self._sent_shapes[key], spec.masks)

    def build(self, width: float, norm: str | None = None) -> ScalableModel:
        """The method's model (adapted) at an absolute width ratio, freshly initialised, on the CPU."""
        return self.adapt_model(self.resources.build(width, norm))

    def width_of(self, spec: SubmodelSpec) -> float:
        return self.model.width if spec.width is None else spec.width

    def init_state(self) -> MethodState:
        return self.State(masks={k: m.clone() for k, m in self.initial_masks.items()})

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        """What is scored as "the global model" (with the global masks: what an NSConv standardises over)."""
        spec = self.ladder.global_spec(state.trained_levels) if self.ladder else full_spec()
        return replace(spec, masks=state.masks) if state.masks else spec

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        """The sub-models scored every evaluation (worst and mean go to the summary), by name."""
        return self.ladder.evaluated(state.trained_levels) if self.ladder else {}


def record_trained(state: MethodState, updates: Sequence[ClientUpdate]) -> MethodState:
    """`state` with the levels of `updates` added to the trained ones."""
    levels = {u.level for u in updates if u.level is not None}
    return replace(state, trained_levels=state.trained_levels | levels) if levels - state.trained_levels else state

