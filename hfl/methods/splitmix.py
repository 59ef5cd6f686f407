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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.accounting.cost import TrainingCost
from hfl.config import check
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.models.base import ScalableModel
from hfl.models.ensemble import BaseEnsemble
from hfl.registry import METHODS
from hfl.seeding import BASE_ORDER_STREAM, derive_seed
from hfl.submodel.spec import SubmodelSpec
from hfl.types import ClientTask, RoundContext, StateDict

if TYPE_CHECKING:
    from hfl.client import ClientModule

log = logging.getLogger(__name__)

BASES_STREAM = 3  # seed tag of a client-round's other bases (the client's data order is tag 1)
BASE_WIDTHS = (1 / 2, 1 / 3, 1 / 4, 1 / 6, 1 / 8, 1 / 16)
"""The base widths `base_width: null` chooses from, widest first."""
UNBUDGETED_BASE_WIDTH = 1 / 8
"""The authors' default `atom_slim_ratio`, for runs in which no client has a memory budget."""


@dataclass(frozen=True)
class SplitMixConfig(MethodConfig):
    name: str = "splitmix"
    base_width: float | None = None
    """Width ratio r of a base model, relative to the configured model; the global model is
    round(1/r) bases. null: the widest of 1/2, 1/3, 1/4, 1/6, 1/8, 1/16 whose training memory fits
    the smallest client budget (1/8 when no client has one)."""

    def __post_init__(self) -> None:
        r = self.base_width
        if r is not None:
            check(0 < r <= 1 and abs(round(1 / r) * r - 1) <= 0.01, "base_width", r, "1/n for an integer n >= 1 (0.5, 0.25, 0.1667, ...)")


def base_prefix(index: int) -> str:
    return f"bases.{index}."


def ensemble_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Each base's own cross-entropy, summed: the bases share nothing, so each gets its own gradient."""
    return sum(F.cross_entropy(base(x), y) for base in model.bases)


@METHODS.register("splitmix")
class SplitMix(Method):
    Config = SplitMixConfig
    paper = "Hong, Wang, Wang and Zhou, ICLR 2022 (arXiv:2203.09747)"
    preferred_norm = "bn"  # every base is trained whole by its clients: running statistics are valid

    def __init__(self, config: SplitMixConfig, model: ScalableModel, accountant: Accountant | None = None) -> None:
        super().__init__(config, model, accountant)
        self.base_ratio = UNBUDGETED_BASE_WIDTH if config.base_width is None else config.base_width
        """r, relative to the configured model; fixed by `use_budgets` when `base_width` is null."""
        self._pair_costs: dict[int, TrainingCost] = {}
        """Two bases' training cost, by batch size."""

    @property
    def num_bases(self) -> int:
        return max(1, round(1 / self.base_ratio))

    @property
    def base_width(self) -> float:
        """A base's absolute width ratio (what the model factories take)."""
        return self.model.width * self.base_ratio

    def use_budgets(self, budgets: Sequence[ClientBudget | None], batch_size: int) -> None:
        """With `base_width: null`: the widest ladder width whose one-base training fits the smallest budget."""
        memory = [b.memory_bytes for b in budgets if b is not None and b.memory_bytes is not None]
        if self.config.base_width is not None or not memory or self.accountant is None:
            return
        fits = [r for r in BASE_WIDTHS if self.accountant.cost(self.model.width * r, batch_size).peak_bytes <= min(memory)]
        if not fits:
            log.warning("even a base of width 1/16 exceeds the smallest budget (%d bytes): its clients sit out", min(memory))
        self.base_ratio = fits[0] if fits else BASE_WIDTHS[-1]
        log.info("SplitMix: %d bases of width %.4g", self.num_bases, self.base_ratio)

    # -- models ---------------------------------------------------------------------------------
    def spec_for(self, bases: Iterable[int]) -> SubmodelSpec:
        """A model of the given global bases: its i-th base is global base `bases[i]`."""
        places = tuple((base_prefix(i), base_prefix(b)) for i, b in enumerate(bases))
        return SubmodelSpec(width=self.base_width, places=places)

    def model_key(self, spec: SubmodelSpec) -> tuple:
        return ("ensemble", spec.width, len(spec.places))

    def client_model(self, spec: SubmodelSpec, build: Callable[[float], ScalableModel]) -> nn.Module:
        return BaseEnsemble([build(spec.width) for _ in spec.places])

    def initial_global_state(self, build: Callable[[float], ScalableModel]) -> StateDict:
        return {base_prefix(i) + k: v for i in range(self.num_bases) for k, v in build(self.base_width).state_dict().items()}

    def training_cost(self, spec: SubmodelSpec, batch_size: int) -> TrainingCost:
        """k bases trained in one step: k bases' weights, gradients, optimiser state and activations,
        one input batch. The bases share only that input, so every term is affine in k: measured for
        one base (the plain model, a `width:` budget's own cost) and for two, and extrapolated."""
        one = super().training_cost(spec, batch_size)
        k = len(spec.places)
        if k <= 1:
            return one
        if batch_size not in self._pair_costs:
            acc = self.accountant
            pair = BaseEnsemble([self.adapt_model(acc.build(self.base_width)) for _ in range(2)])
            self._pair_costs[batch_size] = acc.measure(pair, batch_size, ensemble_loss)
        two = self._pair_costs[batch_size]
        return TrainingCost(**{f.name: getattr(one, f.name) + (k - 1) * (getattr(two, f.name) - getattr(one, f.name)) for f in fields(TrainingCost)})

    # -- plan -----------------------------------------------------------------------------------
    def bases_for(self, ctx: RoundContext) -> int:
        """The most bases whose joint training fits the client's memory budget (0: not even one)."""
        budget = ctx.budget.memory_bytes if ctx.budget else None
        if budget is None or self.accountant is None:
            return self.num_bases
        batch = min(ctx.train.batch_size, ctx.num_samples)
        k = 0
        while k < self.num_bases and self.training_cost(self.spec_for(range(k + 1)), batch).peak_bytes <= budget:
            k += 1
        return k

    def choose_bases(self, ctx: RoundContext, k: int) -> list[int]:
        """The round's base order at the client's position, then k-1 others at random (ascending)."""
        n = self.num_bases
        order = np.random.default_rng(derive_seed(ctx.seed, ctx.round, BASE_ORDER_STREAM)).permutation(n)
        first = int(order[ctx.client_id % n])
        others = [b for b in range(n) if b != first]
        rest = ctx.rng(BASES_STREAM).choice(others, size=k - 1, replace=False) if k > 1 else []
        return sorted([first, *(int(b) for b in rest)])

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        k = self.bases_for(ctx)
        if k == 0:
            log.info("client %d: even one base exceeds its budget of %d bytes", ctx.client_id, ctx.budget.memory_bytes)
            return None
        bases = self.choose_bases(ctx, k)
        return ClientTask(ctx, self.spec_for(bases), {"bases": bases})

    # -- objective and evaluation ---------------------------------------------------------------
    def objective(self, client: ClientModule, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {"loss": ensemble_loss(client.model, x, y)}

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        return self.spec_for(range(self.num_bases))

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        """SplitMix's on-demand widths: the mix of the first k bases, width k*r, for k = 1..n."""
        return {f"x{k * self.base_ratio:.3g}": self.spec_for(range(k)) for k in range(1, self.num_bases + 1)}
