"""SplitMix — Hong, Wang, Wang and Zhou, "Efficient Split-Mix Federated Learning for On-Demand and
In-Situ Customization", ICLR 2022. The wide model is split into n = 1/r independent base models of
width r; each client trains as many bases as its budget allows, all on the same batches, each with
its own cross-entropy; the server averages each base over the clients that trained it; a model of
width k*r is the mix (mean of logits) of k bases, the global model the mix of all n.

The bases sit side by side in the global state under `bases.<i>.`; a client's model holds its k
bases under `bases.0.`..`bases.<k-1>.`, mapped to the global bases it drew by the spec's `places`.
k is the most bases whose joint training step (k bases' weights, gradients, optimiser state and
activations, all alive together) fits the client's memory budget; a client that fits none sits the
round out. r is `base_width`, or by default the widest of 1/2, 1/3, 1/4, 1/6, 1/8, 1/16 whose
single-base training fits the smallest budget (1/6 in the FeDepth paper's `fair` and `surplus`
scenarios, 1/8 in `lack`; 1/8, the authors' default, when no client has a budget).

Deliberate deviations and choices:
- Base selection (the authors' `SplitFederation.sample_bases`): the authors draw each client's first
  base from one shuffled cycle over the bases, shared by the clients in the order they train, and
  its other k-1 at random among the rest. Here the order is a permutation per round, seeded by
  (seed, round), and client c's first base is its entry c mod n, so that a round's clients spread
  their first bases evenly without an order between them; the other k-1 are drawn without
  replacement from the client-round's own generator.
- The authors backpropagate base after base (one base's activations alive at a time); here the
  summed loss is backpropagated once (the same gradients), and costed as such.
- The number of bases follows from memory, not from a client's width ratio divided by r.
- None of the paper's in-situ parts: no dual batch norm or adversarial training, no client-local
  batch norm, no rescaling of a base's initialisation or layer outputs, no loss temperature.
- Each base is averaged weighted by the clients' sample counts (as the authors' code weights them).
- The width-k*r models are the first k bases (the authors' order without `sort_bases`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.cost import TrainingCost
from hfl.errors import check
from hfl.methods.base import Client, Method, MethodConfig, Resources
from hfl.methods.vectorisable import vectorisable
from hfl.models.ensemble import BaseEnsemble
from hfl.registry import METHODS
from hfl.seeding import BASE_ORDER_STREAM, derive_seed
from hfl.submodel.ladder import Level
from hfl.submodel.spec import SubmodelSpec
from hfl.types import ClientTask, RoundContext, StateDict

log = logging.getLogger(__name__)

BASES_STREAM = 3  # seed tag of a client-round's other bases (the client's data order is tag 1)
BASE_WIDTHS = (1 / 2, 1 / 3, 1 / 4, 1 / 6, 1 / 8, 1 / 16)
"""The base widths `base_width: null` chooses from, widest first."""
MAX_BASES = 32
"""The most bases a global model may hold: each is a whole model (base_width 1/1000 on digits held
17 GB of host memory before its first round ended); the paper's narrowest is 1/16."""
UNBUDGETED_BASE_WIDTH = 1 / 8
"""The authors' default `atom_slim_ratio`, for runs in which no client has a memory budget."""


@dataclass(frozen=True)
class SplitMixConfig(MethodConfig):
    name: str = "splitmix"
    weighting: str = "samples"
    """The authors' code weighs every base by the client's share of the training samples."""
    base_width: float | None = None
    """Width ratio r of a base model, relative to the configured model; the global model is
    round(1/r) bases. null: the widest of 1/2, 1/3, 1/4, 1/6, 1/8, 1/16 whose training memory fits
    the smallest client budget (1/8 when no client has one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        r = self.base_width
        if r is not None:
            n = round(1 / r) if r > 0 else 0
            check(1 <= n <= MAX_BASES and abs(n * r - 1) <= 0.01, "base_width", r, f"1/n for an integer n from 1 to {MAX_BASES} (0.5, 0.25, 0.1667, ...)")


@dataclass(frozen=True)
class BasesOptions:
    bases: tuple[int, ...]
    """The global bases the client trains."""


def base_prefix(index: int) -> str:
    return f"bases.{index}."


def ensemble_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Each base's own cross-entropy, summed: the bases share nothing, so each gets its own gradient."""
    return sum(F.cross_entropy(base(x), y) for base in model.bases)


@METHODS.register("splitmix")
class SplitMix(Method):
    Config = SplitMixConfig
    preferred_norm = "bn"  # every base is trained whole by its clients: running statistics are valid

    def __init__(self, config: SplitMixConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        self.base_ratio = config.base_width or self.widest_fitting_base()
        """r, relative to the configured model."""
        # Level k: the mix of k bases (width k*r); the first k for evaluation, others for a client.
        levels = [Level(f"x{k * self.base_ratio:.3g}", self.spec_for(range(k)), BasesOptions(tuple(range(k))))
                  for k in range(1, self.num_bases + 1)]
        self.ladder = self.make_ladder(levels, global_model="largest", place=self.choose_bases)

    def widest_fitting_base(self) -> float:
        """The widest base width whose one-base training fits the smallest memory budget."""
        memory = [b.memory_bytes for b in self.resources.budgets if b is not None and b.memory_bytes is not None]
        if not memory:
            return UNBUDGETED_BASE_WIDTH
        accountant, batch = self.resources.accountant, self.resources.batch_size
        fits = [r for r in BASE_WIDTHS if accountant.plain_cost(self.model.width * r, batch).peak_bytes <= min(memory)]
        if not fits:
            log.warning("even a base of width 1/16 exceeds the smallest budget (%d bytes): its clients sit out", min(memory))
        ratio = fits[0] if fits else BASE_WIDTHS[-1]
        log.info("SplitMix: %d bases of width %.4g", max(1, round(1 / ratio)), ratio)
        return ratio

    @property
    def num_bases(self) -> int:
        return max(1, round(1 / self.base_ratio))

    @property
    def base_width(self) -> float:
        """A base's absolute width ratio (what the model factories take)."""
        return self.model.width * self.base_ratio

    # -- models ---------------------------------------------------------------------------------
    def spec_for(self, bases: Iterable[int]) -> SubmodelSpec:
        """A model of the given global bases: its i-th base is global base `bases[i]`."""
        places = tuple((base_prefix(i), base_prefix(b)) for i, b in enumerate(bases))
        return SubmodelSpec(width=self.base_width, places=places)

    def client_model(self, spec: SubmodelSpec, norm: str | None = None) -> nn.Module:
        return BaseEnsemble([self.build(spec.width, norm) for _ in spec.places])

    def initial_global_state(self) -> StateDict:
        return {base_prefix(i) + k: v for i in range(self.num_bases) for k, v in self.build(self.base_width).state_dict().items()}

    def training_cost(self, task: ClientTask, batch_size: int) -> TrainingCost:
        """k bases trained in one step: k bases' weights, gradients, optimiser state and activations,
        one input batch. The bases share only that input, so every term is affine in k: measured for
        one base (the plain model, a `width:` budget's own cost) and for two, and extrapolated."""
        one = self.resources.accountant.plain_cost(self.base_width, batch_size)
        k = len(task.spec.places)
        if k <= 1:
            return one
        pair = lambda: BaseEnsemble([self.build(self.base_width) for _ in range(2)])
        two = self.resources.accountant.cost(("base pair", self.base_width), pair, batch_size, ensemble_loss)
        return TrainingCost(**{f.name: getattr(one, f.name) + (k - 1) * (getattr(two, f.name) - getattr(one, f.name)) for f in fields(TrainingCost)})

    # -- plan and objective -----------------------------------------------------------------------
    def choose_bases(self, level: Level, ctx: RoundContext) -> tuple[SubmodelSpec, BasesOptions]:
        """The round's base order at the client's position, then k-1 others at random (ascending)."""
        n, k = self.num_bases, len(level.options.bases)
        order = np.random.default_rng(derive_seed(ctx.seed, ctx.round, BASE_ORDER_STREAM)).permutation(n)
        first = int(order[ctx.client_id % n])
        others = [b for b in range(n) if b != first]
        rest = ctx.rng(BASES_STREAM).choice(others, size=k - 1, replace=False) if k > 1 else []
        bases = tuple(sorted([first, *(int(b) for b in rest)]))
        return self.spec_for(bases), BasesOptions(bases)

    @vectorisable
    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {"loss": ensemble_loss(client.model, x, y)}
