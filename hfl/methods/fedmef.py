"""FedMef — Huang, Zhuang, Chen and Lyu, "FedMef: Towards Memory-efficient Federated
Dynamic Pruning", CVPR 2024 (Algorithm 1): FedTiny's server-side prune/grow plus

- budget-aware extrusion (BaE, Eq. 2–4), in adjustment rounds only: the client minimises
  L + λ‖θ_low‖²₂, θ_low per prunable layer the ξ kept weights of smallest |θ| (the ones the server
  will drop next, recomputed from the current weights at every step), with the budgeted learning
  rate μ_t = max(η_t, β_t), β_t = p(t)(2σ(‖θ_low‖) − 1)η₀, p(t) = (2T − 2t)/(2T − t), t the client's
  step and T its local steps this round, η_t the round's rate and η₀ the schedule's first;
- scaled activation pruning (SAP, §3.4) in every round: each Conv2d and Linear of the client model
  keeps only the top ⌊(1 − s)·numel⌋ entries of its input for backward, stored compressed, so the
  accountant's measured peak (real saved tensors) shows the saving. It saves where nothing else keeps
  the layer's input: a plain ReLU before a layer keeps its own output whatever the layer saves, so
  ReLUs may keep a boolean mask instead (`MaskReLU`); that pays where a conv or linear layer is the
  only other holder (PreResNet-20 at batch 32 on 32x32: 49.5 MiB dense, 37.4 with SAP and masked
  ReLUs) and costs the mask where pooling keeps the output anyway (the CNN), so the client model takes
  whichever of the two the accountant measures lower on the whole model (`relu_masks`).

- normalized sparse convolution (NSConv, Eq. 6–7, `nsconv`, on by default): every convolution
  standardises each filter over its kept entries (γ `ns_gamma`, the paper gives none: the ReLU gain
  √(2/(1 − 1/π)) by default) in a model without normalisation layers, which `model.norm=auto` builds
  for FedMef; `method.nsconv=false` runs SAP on the configured norms (the paper's "w/o NSConv").
  The growth criterion's dense gradient is taken with respect to the effective weights the
  convolutions apply (the stored weights' gradient is masked by the standardisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from torch import Tensor, nn

from hfl.errors import ConfigError, check
from hfl.methods.base import Client, Resources
from hfl.methods.fedtiny import Adjustment, FedTiny, FedTinyConfig
from hfl.models.base import ScalableModel
from hfl.pruning.nsconv import RELU_GAMMA, normalize_convolutions
from hfl.pruning.sap import prune_activations
from hfl.pruning.schedules import extrusion_learning_rate
from hfl.pruning.selection import lowest_magnitude
from hfl.registry import METHODS
from hfl.submodel.spec import SubmodelSpec, full_spec
from hfl.types import RoundContext


@dataclass(frozen=True)
class FedMefConfig(FedTinyConfig):
    name: str = "fedmef"
    bae_lambda: float = 0.01
    """λ of budget-aware extrusion's surrogate term λ‖θ_low‖²₂ (Eq. 2)."""
    activation_sparsity: float = 0.9
    """s_ta of scaled activation pruning: the share of each Conv2d/Linear input dropped from the copy kept for backward."""

    nsconv: bool = True
    """Whether every convolution is an NSConv (needs `model.norm=none`, which auto gives FedMef)."""
    ns_gamma: float = RELU_GAMMA
    """γ of NSConv (Eq. 7): the paper gives none; by default the ReLU gain √(2/(1 − 1/π))."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.ns_gamma > 0, "ns_gamma", self.ns_gamma, "a number > 0")
        check(self.bae_lambda >= 0, "bae_lambda", self.bae_lambda, "a number >= 0")
        check(0 <= self.activation_sparsity < 1, "activation_sparsity", self.activation_sparsity, "a number in [0, 1)")


def local_steps(ctx: RoundContext) -> int:
    """T: the optimiser steps of a client-round (its batches times its local epochs)."""
    return math.ceil(ctx.num_samples / ctx.train.batch_size) * ctx.train.local_epochs


@METHODS.register("fedmef")
class FedMef(FedTiny):
    Config = FedMefConfig
    preferred_norm = "none"  # NSConv replaces the norms (Eq. 6–7)

    def __init__(self, config: FedMefConfig, resources: Resources) -> None:
        norm = resources.model.norm
        if config.nsconv and norm != "none":
            raise ConfigError("model.norm", norm, "none with method.nsconv=true (NSConv models have no normalisation layers; or set method.nsconv=false)")
        super().__init__(config, resources)
        self.model = self.adapt_model(self.model)

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        return normalize_convolutions(model, self.config.ns_gamma) if self.config.nsconv else model

    def client_model(self, spec: SubmodelSpec, norm: str | None = None) -> nn.Module:
        return prune_activations(super().client_model(spec, norm), self.config.activation_sparsity, self.relu_masks)

    @cached_property
    def relu_masks(self) -> bool:
        """Whether the client's ReLUs keep boolean masks instead of their outputs: whichever gives
        the lower measured training peak of the whole model with SAP (see the module docstring)."""
        def peak(masks: bool) -> int:
            model = prune_activations(super(FedMef, self).client_model(full_spec()), self.config.activation_sparsity, masks)
            return self.resources.accountant.measure(model, self.resources.batch_size, count_flops=False).peak_bytes

        return peak(True) < peak(False)

    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        terms = super().objective(client, x, y)
        adjustment = client.task.options
        if not isinstance(adjustment, Adjustment):
            return terms
        params = dict(client.model.named_parameters())
        masks = {k: m.to(params[k].device) for k, m in client.task.spec.masks.items()}
        low = lowest_magnitude({k: params[k].detach() for k in masks}, masks, adjustment.counts)
        squared = sum((params[k][low[k]] ** 2).sum() for k in masks)
        terms["extrusion"] = squared.detach()
        terms["loss"] = terms["loss"] + self.config.bae_lambda * squared
        ctx = client.task.ctx
        initial_lr = ctx.train.lr if ctx.train.initial_lr is None else ctx.train.initial_lr
        lr = extrusion_learning_rate(ctx.train.lr, initial_lr, client.steps, local_steps(ctx), math.sqrt(float(terms["extrusion"])))
        for group in client.optimizer.param_groups:  # the step right after this loss takes μ_t
            group["lr"] = lr
        return terms
