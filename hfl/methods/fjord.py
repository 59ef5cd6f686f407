"""FjORD — Horváth et al., "FjORD: Fair and Accurate Federated Learning under heterogeneous targets
with Ordered Dropout", NeurIPS 2021. Each client holds the upper-left width-p_max slice of the model,
p_max the widest ladder width whose training memory fits its budget; every mini-batch trains the
width-p prefix network, p drawn uniformly from the ladder widths <= p_max (ordered dropout); each
width has its own batch norm; optionally the width-p network distils from the width-p_max one. With
`tier_window` >= 0 a client's p_max is instead drawn every round from its tier's window of ladder
widths (NeFL's dynamic environment, `hfl.submodel.ladder`).

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

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from fractions import Fraction
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.cost import TrainingCost
from hfl.errors import check
from hfl.losses import kl_distillation
from hfl.methods.base import Client, LadderConfig, Method, Resources
from hfl.models.base import ChannelGroup, ScalableModel
from hfl.registry import METHODS
from hfl.submodel.copies import NormCopies, copy_keys
from hfl.submodel.ladder import Level
from hfl.submodel.ordered_dropout import ordered_dropout, output_layers
from hfl.submodel.spec import SubmodelSpec, width_spec
from hfl.types import ClientTask, RoundContext

WIDTH_STREAM = 3  # seed tag of the per-batch width draws (the client's data order is tag 1)
UNIFORM_6 = tuple(float(Fraction(k, 6)) for k in range(1, 7))


def same_width(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@dataclass(frozen=True)
class FjORDConfig(LadderConfig):
    name: str = "fjord"
    weighting: str = "samples"
    """The authors' code weighs each width's entries by the sample counts of the clients that hold them."""
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

    def __post_init__(self) -> None:
        super().__post_init__()
        check(bool(self.widths) and all(0 < w <= 1 for w in self.widths), "widths", list(self.widths), "ratios in (0, 1]")
        check(any(same_width(w, 1.0) for w in self.widths), "widths", list(self.widths), "a ladder that holds 1 (the global model)")
        check(0 <= self.kd_alpha <= 1, "kd_alpha", self.kd_alpha, "a number in [0, 1]")
        check(self.kd_temperature > 0, "kd_temperature", self.kd_temperature, "a number > 0")


@dataclass(frozen=True)
class FjORDOptions:
    p_max: float
    """The widest ladder width the client holds (relative to the global model)."""


@METHODS.register("fjord")
class FjORD(Method):
    Config = FjORDConfig
    preferred_norm = "bn"

    def __init__(self, config: FjORDConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        self.ladder_widths = tuple(sorted({float(w) for w in config.widths}))
        self.norm_per_width = self.model.norm == "bn"
        """A batch norm per width; with static batch norm the evaluation recomputes statistics per width instead."""
        self.model = self.adapt_model(self.model)
        self._layers: WeakKeyDictionary[ScalableModel, list[tuple[nn.Module, ChannelGroup]]] = WeakKeyDictionary()
        levels = [Level(f"x{p:.3g}", self.spec_for(p), FjORDOptions(p)) for p in self.ladder_widths]
        self.ladder = self.make_ladder(levels, tier_window=config.tier_window, evaluated="nested", global_model="largest_trained")

    # -- models: a batch norm per width -------------------------------------------------------
    def norm_name(self, p: float) -> str:
        return f"w{next(k for k, w in enumerate(self.ladder_widths) if same_width(w, p))}"

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        # Decided by the global model's norm: the evaluation builds static-BN models with running statistics.
        if not self.norm_per_width:
            return model
        ratio = model.width / self.model.width
        held = [self.norm_name(w) for w in self.ladder_widths if w <= ratio or same_width(w, ratio)]
        if not held:
            raise ValueError(f"FjORD builds models at its ladder widths {list(self.ladder_widths)}; got width ratio {ratio:g}")
        model.replace_norms(lambda norm: NormCopies(norm, held))
        return model

    def at_width(self, model: ScalableModel, p: float) -> AbstractContextManager[None]:
        """Context: `model` (a client's or the global one) runs as the ladder width-`p` network."""
        if model not in self._layers:  # once per model: finding the layers costs more than a small batch
            self._layers[model] = output_layers(model)
        return ordered_dropout(model, self.model.width * p, self.norm_name(p) if self.norm_per_width else None, self._layers[model])

    def spec_for(self, p: float) -> SubmodelSpec:
        """The width-p prefix of every group; batch norms of wider ladder widths are absent."""
        spec = width_spec(self.model, self.model.width * p)
        wider = [self.norm_name(w) for w in self.ladder_widths if w > p and not same_width(w, p)]
        return replace(spec, absent=spec.absent | copy_keys(self.model, wider))

    def training_cost(self, task: ClientTask, batch_size: int) -> TrainingCost:
        """The width-p_max model's cost (no batch trains a wider network, and a masked forward saves
        what the plain one does); with self-distillation, a step that runs the teacher and the
        narrowest student, whose graphs are alive together."""
        cost = super().training_cost(task, batch_size)
        p = task.options.p_max
        if not self.config.self_distillation or same_width(p, self.ladder_widths[0]):
            return cost
        step = lambda m, x, y: self.losses(m, x, y, self.ladder_widths[0], p)["loss"]
        return self.resources.accountant.cost(("distilled", p), lambda: self.build(self.width_of(task.spec)), batch_size, step)

    # -- objective ------------------------------------------------------------------------------
    def draw_width(self, ctx: RoundContext, p_max: float, step: int) -> float:
        """Mini-batch `step`'s width: uniform over the ladder widths <= p_max, seeded by the client-round and step."""
        allowed = [w for w in self.ladder_widths if w <= p_max or same_width(w, p_max)]
        return allowed[int(torch.randint(len(allowed), (), generator=ctx.generator(WIDTH_STREAM, step)))]

    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        p_max = client.task.options.p_max
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
        kd = kl_distillation(student, teacher, self.config.kd_temperature)
        loss = ce + (1 - alpha) * F.cross_entropy(student, y) + alpha * kd
        return {"loss": loss, "ce": ce.detach(), "kd": kd.detach()}
