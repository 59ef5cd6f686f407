"""FjORD — Horváth et al., "FjORD: Fair and Accurate Federated Learning under heterogeneous targets
with Ordered Dropout", NeurIPS 2021. Each client holds the upper-left width-p_max slice of the model,
p_max the widest ladder width whose training memory fits its budget; every mini-batch trains the
width-p prefix network, p drawn uniformly from the ladder widths <= p_max (ordered dropout); each
width has its own batch norm; optionally the width-p network distils from the width-p_max one. With
`tier_window` >= 0 a client's p_max is instead drawn every round from its tier's window of ladder
widths (NeFL's dynamic environment, `hfl.methods.tiers`).

Ordered dropout runs on the client's width-p_max model: every layer's outputs beyond the first
ceil(p * base) channels of its group are zeroed (after convs and after norms, so norm + ReLU of a
dropped channel stays zero), which computes exactly the width-p network. The server takes the
masked weighted mean; every ladder width is evaluated as a sub-model with its own batch norm.

Batch norm per width. `model.norm=bn` (the default): every batch norm becomes one full batch norm
per ladder width (a switchable norm). A client holds the copies of the widths up to its p_max, and
they are resident memory the accountant counts, so where a budget is exactly the plain model's
training memory at a ladder width (the `fair` tiers) the client fits one width less.
`model.norm=static_bn`: one batch norm per layer, its affine weights shared by every width (as in
the authors' Flower baseline, whose per-width norms separate only the running statistics), no
running statistics while training, and statistics recomputed per width for evaluation; it costs no
memory beyond the plain width-p_max model.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.accounting.cost import TrainingCost
from hfl.config import check
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.methods.tiers import DynamicTiers
from hfl.models.base import ChannelGroup, ScalableModel, scaled_channels
from hfl.registry import METHODS
from hfl.submodel.spec import SubmodelSpec, width_spec
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

if TYPE_CHECKING:
    from hfl.client import ClientModule

log = logging.getLogger(__name__)

WIDTH_STREAM = 3  # seed tag of the per-batch width draws (the client's data order is tag 1)
UNIFORM_6 = tuple(float(Fraction(k, 6)) for k in range(1, 7))


def same_width(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@dataclass(frozen=True)
class FjORDConfig(MethodConfig):
    name: str = "fjord"
    widths: tuple[float, ...] = UNIFORM_6
    """Width ladder relative to the global model; must hold 1. Default uniform-6 (1/6, 2/6, ..., 1),
    so the smallest width fits the `fair` scenario's smallest budget (width 1/6); the paper's
    uniform-5 is `method.widths=[0.2,0.4,0.6,0.8,1.0]`."""
    self_distillation: bool = False
    """Add the paper's self-distillation: cross-entropy at p_max, and the width-p network also
    learns from the width-p_max network's (detached) softened outputs."""
    kd_alpha: float = 1.0
    """Share of the distillation term in the width-p network's loss, (1 - a) * CE + a * T^2 * KL;
    1 matches the authors' code (the p_max outputs as the width-p network's only target)."""
    kd_temperature: float = 1.0
    """Softmax temperature T of the distillation term."""
    tier_window: int = -1
    """-1: off (each client trains the largest level fitting its budget, as before). k >= 0: NeFL's
    dynamic tiers (appendix B.7, `hfl.methods.tiers`): each round a client trains a level drawn
    uniformly within k levels of its tier (the paper's setting is 2 with five levels)."""

    def __post_init__(self) -> None:
        check(bool(self.widths) and all(0 < w <= 1 for w in self.widths), "widths", list(self.widths), "ratios in (0, 1]")
        check(any(same_width(w, 1.0) for w in self.widths), "widths", list(self.widths), "a ladder that holds 1 (the global model)")
        check(0 <= self.kd_alpha <= 1, "kd_alpha", self.kd_alpha, "a number in [0, 1]")
        check(self.kd_temperature > 0, "kd_temperature", self.kd_temperature, "a number > 0")
        window = self.tier_window
        check(isinstance(window, int) and not isinstance(window, bool) and window >= -1, "tier_window", window, "an integer >= -1")


class SwitchableNorm(nn.Module):
    """One batch norm per ladder width, each with this layer's full channel count (a narrower width
    uses a prefix of its copy); `active` picks the copy in use, by default the widest held."""

    def __init__(self, norm: nn.modules.batchnorm._BatchNorm, widths: Sequence[float]) -> None:
        super().__init__()
        self.widths = tuple(widths)
        """The ladder widths held, ascending: copy i serves widths[i]."""
        self.norms = nn.ModuleList(copy.deepcopy(norm) for _ in self.widths)
        self.active = len(self.widths) - 1

    def select(self, width: float) -> None:
        """Use the copy of ladder width `width`."""
        for i, w in enumerate(self.widths):
            if same_width(w, width):
                self.active = i
                return
        raise ValueError(f"no batch norm for width {width:g}; this layer holds widths {list(self.widths)}")

    def forward(self, x: Tensor) -> Tensor:
        return self.norms[self.active](x)


def _zero_beyond(keep: int) -> Callable[[nn.Module, Any, Tensor], Tensor]:
    """A forward hook that zeroes a layer's output channels `keep`.. (dim 1). Padding a slice saves
    nothing for backward (a multiplied mask would), so the masked forward costs what the plain one does."""

    def hook(_module: nn.Module, _inputs: Any, out: Tensor) -> Tensor:
        return F.pad(out[:, :keep], [0, 0] * (out.dim() - 2) + [0, out.shape[1] - keep])

    return hook


def output_layers(model: ScalableModel) -> list[tuple[nn.Module, ChannelGroup]]:
    """Every layer whose outputs (dim 0 of its state) index a channel group, with that group; a
    switchable norm stands for its copies."""
    modules = dict(model.named_modules())
    owner = {f"{name}.norms.{i}": name for name, m in modules.items() if isinstance(m, SwitchableNorm) for i in range(len(m.norms))}
    layers: dict[str, tuple[nn.Module, ChannelGroup]] = {}
    for group in model.channel_groups():
        for key, dim in group.members:
            name = key.rpartition(".")[0]
            name = owner.get(name, name)
            if dim == 0 and name not in layers:
                layers[name] = (modules[name], group)
    return list(layers.values())


@contextmanager
def ordered_dropout(
    model: ScalableModel, width: float, ratio: float, layers: list[tuple[nn.Module, ChannelGroup]] | None = None
) -> Iterator[None]:
    """While active, `model` computes the width-`width` prefix network (absolute width ratio) with
    the batch norms of ladder width `ratio`; the model's own width needs no masks. `layers`: the
    model's `output_layers`, when the caller keeps them."""
    layers = output_layers(model) if layers is None else layers
    norms = [layer for layer, _ in layers if isinstance(layer, SwitchableNorm)]
    previous = [n.active for n in norms]
    hooks = []
    try:
        for norm in norms:
            norm.select(ratio)
        for layer, group in layers:
            keep = scaled_channels(group.base, width)
            if keep > group.size:
                raise ValueError(f"width {width:g} needs {keep} channels of group {group.name}, the model has {group.size}")
            if keep < group.size:
                hooks.append(layer.register_forward_hook(_zero_beyond(keep)))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for norm, active in zip(norms, previous):
            norm.active = active


def distillation_loss(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), the teacher detached (Hinton et al.)."""
    t = temperature
    return t * t * F.kl_div(F.log_softmax(student / t, 1), F.log_softmax(teacher.detach() / t, 1), reduction="batchmean", log_target=True)


@METHODS.register("fjord")
class FjORD(Method):
    Config = FjORDConfig
    paper = "Horváth et al., NeurIPS 2021 (arXiv:2102.13451)"
    preferred_norm = "bn"

    def __init__(self, config: FjORDConfig, model: ScalableModel, accountant: Accountant | None = None) -> None:
        super().__init__(config, model, accountant)
        self.ladder = tuple(sorted({float(w) for w in config.widths}))
        window = config.tier_window
        self.tiers = DynamicTiers.for_window(len(self.ladder), window)
        """NeFL's dynamic tiers over the ladder; None: each client's p_max is its widest fitting width."""
        self.norm_per_width = model.norm == "bn"
        """A batch norm per width; with static batch norm the evaluation recomputes statistics per width instead."""
        self._specs: dict[float, SubmodelSpec] = {}
        self._distillation_costs: dict[tuple[float, int], TrainingCost] = {}
        self._layers: WeakKeyDictionary[ScalableModel, list[tuple[nn.Module, ChannelGroup]]] = WeakKeyDictionary()

    def use_budgets(self, budgets: Sequence[ClientBudget | None], batch_size: int) -> None:
        super().use_budgets(budgets, batch_size)
        if self.tiers is not None:  # clients without a budget split into tiers by their share of the run
            self.tiers.use_budgets(budgets)

    # -- models: a batch norm per width -------------------------------------------------------
    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        # Decided by the global model's norm: the evaluation builds static-BN models with running statistics.
        if not self.norm_per_width:
            return model
        ratio = model.width / self.model.width
        held = [w for w in self.ladder if w <= ratio or same_width(w, ratio)]
        if not held:
            raise ValueError(f"FjORD builds models at its ladder widths {list(self.ladder)}; got width ratio {ratio:g}")
        model.replace_norms(lambda norm: SwitchableNorm(norm, held))
        return model

    def at_width(self, model: ScalableModel, p: float) -> AbstractContextManager[None]:
        """Context: `model` (a client's or the global one) runs as the ladder width-`p` network."""
        if model not in self._layers:  # once per model: finding the layers costs more than a small batch
            self._layers[model] = output_layers(model)
        return ordered_dropout(model, self.model.width * p, p, self._layers[model])

    # -- plan -----------------------------------------------------------------------------------
    def spec_for(self, p: float) -> SubmodelSpec:
        """The width-p prefix of every group; batch norms of wider ladder widths are absent."""
        if p not in self._specs:
            spec = width_spec(self.model, self.model.width * p)
            wider = frozenset(
                f"{name}.norms.{i}.{key}"
                for name, module in self.model.named_modules() if isinstance(module, SwitchableNorm)
                for i, w in enumerate(module.widths) if w > p and not same_width(w, p)
                for key in module.norms[i].state_dict()
            )
            self._specs[p] = replace(spec, absent=spec.absent | wider)
        return self._specs[p]

    def training_cost(self, spec: SubmodelSpec, batch_size: int) -> TrainingCost:
        """The width-p_max model's cost (no batch trains a wider network, and a masked forward saves
        what the plain one does); with self-distillation, a step that runs the teacher and the
        narrowest student, whose graphs are alive together."""
        cost = super().training_cost(spec, batch_size)
        p = spec.width / self.model.width
        if not self.config.self_distillation or same_width(p, self.ladder[0]):
            return cost
        key = (p, batch_size)
        if key not in self._distillation_costs:
            acc = self.accountant
            model = self.adapt_model(acc.build(spec.width))
            step = lambda m, x, y: self.losses(m, x, y, self.ladder[0], p)["loss"]
            self._distillation_costs[key] = acc.measure(model, batch_size, step)
        return self._distillation_costs[key]

    def width_fits(self, p: float, ctx: RoundContext) -> bool:
        """Whether training with p_max = p fits the client's memory budget (always, without a budget or an accountant)."""
        budget = ctx.budget.memory_bytes if ctx.budget else None
        if budget is None or self.accountant is None:
            return True
        batch = min(ctx.train.batch_size, ctx.num_samples)
        return self.training_cost(self.spec_for(p), batch).peak_bytes <= budget

    def p_max_for(self, ctx: RoundContext) -> float | None:
        """The widest ladder width whose training fits the client's memory budget; None if none does."""
        p_max = next((p for p in reversed(self.ladder) if self.width_fits(p, ctx)), None)
        if p_max is None:
            log.info("client %d: even width %g exceeds its budget of %d bytes", ctx.client_id, self.ladder[0], ctx.budget.memory_bytes)
        return p_max

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        if self.tiers is None:
            p_max = self.p_max_for(ctx)
        else:
            level = self.tiers.draw(ctx, lambda k: self.width_fits(self.ladder[k], ctx))
            p_max = None if level is None else self.ladder[level]
        if p_max is None:
            return None
        return ClientTask(ctx, self.spec_for(p_max), {"p_max": p_max})

    # -- objective ------------------------------------------------------------------------------
    def draw_width(self, ctx: RoundContext, p_max: float, step: int) -> float:
        """Mini-batch `step`'s width: uniform over the ladder widths <= p_max, seeded by the client-round and step."""
        allowed = [w for w in self.ladder if w <= p_max or same_width(w, p_max)]
        return allowed[int(torch.randint(len(allowed), (), generator=ctx.generator(WIDTH_STREAM, step)))]

    def objective(self, client: ClientModule, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        p_max = client.task.options["p_max"]
        return self.losses(client.model, x, y, self.draw_width(client.task.ctx, p_max, client.steps), p_max)

    def losses(self, model: ScalableModel, x: Tensor, y: Tensor, p: float, p_max: float) -> dict[str, Tensor]:
        """The loss terms of one batch trained at width p by a width-p_max model."""
        if not self.config.self_distillation:
            with self.at_width(model, p):
                return {"loss": F.cross_entropy(model(x), y)}
        teacher = model(x)  # the model's own width, p_max
        ce = F.cross_entropy(teacher, y)
        alpha = self.config.kd_alpha
        if same_width(p, p_max):  # the student is the teacher: the distillation term and its gradient are zero
            return {"loss": (2 - alpha) * ce, "ce": ce.detach(), "kd": torch.zeros((), device=ce.device)}
        with self.at_width(model, p):
            student = model(x)
        kd = distillation_loss(student, teacher, self.config.kd_temperature)
        loss = ce + (1 - alpha) * F.cross_entropy(student, y) + alpha * kd
        return {"loss": loss, "ce": ce.detach(), "kd": kd.detach()}

    # -- aggregation and evaluation -------------------------------------------------------------
    def init_state(self) -> MethodState:
        return {"widest_trained": 0.0}

    def aggregate(
        self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState
    ) -> tuple[StateDict, MethodState]:
        new, state = super().aggregate(global_state, updates, state)
        widest = max((u.spec.width / self.model.width for u in updates), default=0.0)
        return new, {**state, "widest_trained": max(state.get("widest_trained", 0.0), widest)}

    def trained_widths(self, state: MethodState) -> list[float]:
        """Ladder widths up to the widest p_max any client has had (all of them before round 1): a
        width beyond it, and its norm copy, were never trained."""
        widest = state.get("widest_trained", 0.0)
        return [p for p in self.ladder if p <= widest or same_width(p, widest)] or list(self.ladder)

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        """The widest trained width: under budgets that leave room for one norm copy less than the
        whole model needs (the `fair` tiers), the full width's norm copy is never trained."""
        return self.spec_for(self.trained_widths(state)[-1])

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        return {f"x{p:.3g}": self.spec_for(p) for p in self.trained_widths(state)}
