"""FedMef — Huang, Zhuang, Chen and Lyu, "FedMef: Towards Memory-efficient Federated
Dynamic Pruning", CVPR 2024 (Algorithm 1): FedTiny's server-side prune/grow plus

- budget-aware extrusion (BaE, Eq. 2–4), in adjustment rounds only: the client minimises
  L + λ‖θ_low‖²₂, θ_low per prunable layer the ξ kept weights of smallest |θ| (the ones the server
  will drop next: marked once, on the weights the client received, and none in a layer the server
  keeps dense), λ calibrated to shrink them tenfold within the round (`bae_lambda`), with the budgeted learning
  rate μ_t = max(η_t, β_t), β_t = p(t)(2σ(‖θ_low‖) − 1)η₀, p(t) = (2T − 2t)/(2T − t), t the client's
  step and T its local steps this round, η_t the round's rate and η₀ the schedule's first;
- scaled activation pruning (SAP, §3.4) in every round: each Conv2d and Linear of the client model
  keeps only the top ⌊(1 − s)·numel⌋ entries of its input for backward, stored compressed, so the
  accountant's measured peak (real saved tensors) shows the saving. It saves where nothing else keeps
  the layer's input: a plain ReLU before a layer keeps its own output whatever the layer saves, so
  ReLUs may keep a boolean mask instead (`MaskReLU`); that pays where a conv or linear layer is the
  only other holder (PreResNet-20 with batch norms at batch 32 on 32x32: 49.5 MiB dense, 37.4 with SAP
  and masked ReLUs; with NSConv 28.3 and 17.6) and costs the mask where pooling keeps the output
  anyway (the CNN), so the client model takes whichever of the two the accountant measures lower on
  the whole model (`relu_masks`).
- normalized sparse convolution (NSConv, Eq. 6–7, `nsconv`, on by default): every convolution
  standardises each filter over its kept entries (γ `ns_gamma`, the paper gives none: the ReLU gain
  √(2/(1 − 1/π)) by default) in a model without normalisation layers, which `model.norm=auto` builds
  for FedMef, whose residual branches are scaled by α = 0.2 (`residual_scale`, as in norm-free
  ResNets) and each filter has a learnable gain and bias (`ns_affine`, NF-Nets'); `method.nsconv=false` runs SAP on the configured norms (the paper's "w/o NSConv").
  The growth criterion's dense gradient is taken with respect to the effective weights the
  convolutions apply (the stored weights' gradient is masked by the standardisation), and a grown
  entry starts at 0 in those effective weights (`aggregate`).

hfl's options beyond the paper, off by default (issue 49): `nf_block=pre` (NF-ResNets' pre-activation
blocks, `hfl.models.normfree`), `bae_target=applied` (extrusion, marking and the server's drop on the
weights NSConv applies, as Algorithm 1 writes θ̂), `sap_layers=relu_conv` (SAP on ReLU -> conv inputs
only); the client option `fl.agc` (adaptive gradient clipping) serves any method.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from hfl.errors import ConfigError, check, check_choice
from hfl.methods.base import Client, Resources
from hfl.methods.fedtiny import Adjustment, FedTiny, FedTinyConfig, SparseTrainingState
from hfl.models.base import ResidualBlock, ScalableModel
from hfl.models.normfree import preactivate_norm_free
from hfl.models.resnet import ResNet
from hfl.pruning.nsconv import RELU_GAMMA, NSConv2d, applied_in_stored_units, effective_weight, grown_at_zero, normalize_convolutions
from hfl.pruning.sap import prune_activations
from hfl.pruning.schedules import extrusion_learning_rate
from hfl.pruning.selection import lowest_magnitude
from hfl.registry import METHODS
from hfl.submodel.spec import SubmodelSpec, full_spec
from hfl.types import ClientUpdate, RoundContext, StateDict


@dataclass(frozen=True)
class FedMefConfig(FedTinyConfig):
    name: str = "fedmef"
    bae_lambda: float | None = None
    """λ of budget-aware extrusion's surrogate term λ‖θ_low‖²₂ (Eq. 2). The paper gives no value (its
    Figure 9 sweeps it); its point is that the marked weights approach zero before the server drops
    them. None (default): calibrated per step to the client's T local steps and the step's rate μ_t,
    λ_t = (1 − 10^(−1/T)) / (2μ_t), so that the term alone shrinks the marked weights tenfold over
    the round, at any scale, under plain SGD (with momentum 0.9, by 38 % in 6 steps: heavy ball
    contracts by at most √0.9 a step). The data's gradient holds them up where the term balances
    it. The constant λ = 0.01 shrank them by 1.4 % in a round of 5 steps at η = 0.1, leaving FedMef
    FedTiny plus SAP."""
    bae: bool = True
    """Whether budget-aware extrusion runs (Eq. 2–4). false: neither its term nor its budgeted rate μ_t,
    the paper's "without BaE" (FedTiny's adjustment on FedMef's model, with SAP); `bae_lambda=0` keeps μ_t."""
    activation_sparsity: float = 0.9
    """s_ta of scaled activation pruning: the share of each Conv2d/Linear input dropped from the copy kept for backward."""

    nsconv: bool = True
    """Whether every convolution is an NSConv (needs `model.norm=none`, which auto gives FedMef)."""
    ns_gamma: float = RELU_GAMMA
    """γ of NSConv (Eq. 7): the paper gives none; by default the ReLU gain √(2/(1 − 1/π))."""
    ns_affine: bool = True
    """With NSConv, a learnable gain (initially 1) and bias (initially 0) per filter, as NF-Nets'
    weight-standardised convolutions: the standardisation fixes each filter's scale and the model has
    no norms to learn one. Folded into the effective weight, they keep no activation for backward."""
    residual_scale: float = 0.2
    """With NSConv, each residual branch of the norm-free model is scaled by this constant
    (NF-ResNets' α = 0.2): without batch norm nothing else keeps the residual stream's variance from
    growing block by block. A constant, not a learnable step size, because multiplying by a
    parameter keeps every branch's output for backward (ResNet-18 at batch 64: 60 MiB more
    activations). 0: unscaled (the plain network)."""

    nf_block: str = "model"
    """With NSConv, the residual blocks: model (the model's own, post-activation for ResNet-18, with
    ReLU on the residual stream) or pre (NF-ResNets' pre-activation blocks, Brock et al. 2021: the
    branch reads its input divided by β, the stream's expected standard deviation, and each block
    starts as the identity, its last convolution's per-filter gain at 0; needs `ns_affine`; ResNets
    only). Not the paper's: an hfl addition for the norm-free model's slow training (issue 49)."""
    bae_target: str = "stored"
    """What budget-aware extrusion acts on: stored (the weights θ as kept, the default) or applied
    (Algorithm 1's θ̂ = γ(θ − μ)/(σ√k), the standardised weight each NSConv applies: driving θ to 0
    leaves θ̂ at −γμ/(σ√k)). With applied, θ_low is marked and the server drops by |what each layer
    applies| (its gain included), and the term is λ‖θ̂_low / c‖², c = γ/(σ√k) per filter held constant
    in the step, so that λ and its calibration keep their meaning in the stored weights' units."""
    sap_layers: str = "all"
    """Which layers' inputs scaled activation pruning compresses: all (every Conv2d and Linear, the
    default) or relu_conv (the convolutions the paper frames it for, whose inputs are ReLU outputs:
    the first convolution, reading the image, and the linear layers keep theirs whole). In MobileNetV2
    relu_conv still compresses the expanding convolutions, which read the linear bottleneck."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, allowed in (("nf_block", ("model", "pre")), ("bae_target", ("stored", "applied")), ("sap_layers", ("all", "relu_conv"))):
            check_choice(name, getattr(self, name), allowed)
        check(self.nf_block == "model" or (self.nsconv and self.ns_affine), "nf_block", self.nf_block,
              "model unless nsconv and ns_affine are true (the skip gain is the last convolution's NSConv gain)")
        check(self.bae_target == "stored" or self.nsconv, "bae_target", self.bae_target, "stored unless nsconv is true")
        check(self.ns_gamma > 0, "ns_gamma", self.ns_gamma, "a number > 0")
        check(self.residual_scale >= 0, "residual_scale", self.residual_scale, "a number >= 0 (0: unscaled)")
        check(self.bae_lambda is None or self.bae_lambda >= 0, "bae_lambda", self.bae_lambda, "a number >= 0, or null (calibrated)")
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
        if config.nf_block == "pre" and not isinstance(resources.model, ResNet):
            raise ConfigError("method.nf_block", config.nf_block, f"model for {type(resources.model).__name__} (pre-activation norm-free blocks are ResNets')")
        super().__init__(config, resources)
        self.model = self.adapt_model(self.model)

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        config = self.config
        if not config.nsconv:
            return model
        if config.residual_scale:
            for block in getattr(model, "body", ()):
                if isinstance(block, ResidualBlock):  # MobileNetV2's blocks without a shortcut are not
                    block.fix_step_sizes(config.residual_scale)
        blocks = preactivate_norm_free(model, config.residual_scale or 1.0) if config.nf_block == "pre" else []
        normalize_convolutions(model, config.ns_gamma, config.ns_affine)
        with torch.no_grad():
            for block in blocks:  # each block starts as the identity (NF-ResNets' skip gain at 0)
                block.conv2.gain.zero_()
        return model

    def client_model(self, spec: SubmodelSpec, norm: str | None = None) -> nn.Module:
        return self.with_sap(super().client_model(spec, norm), self.relu_masks)

    def with_sap(self, model: nn.Module, relu_masks: bool) -> nn.Module:
        """`model` with scaled activation pruning on the layers `sap_layers` names."""
        return prune_activations(model, self.config.activation_sparsity, relu_masks, self.config.sap_layers == "relu_conv")

    @cached_property
    def relu_masks(self) -> bool:
        """Whether the client's ReLUs keep boolean masks instead of their outputs: whichever gives
        the lower measured training peak of the whole model with SAP (see the module docstring)."""
        def peak(masks: bool) -> int:
            build = lambda: self.with_sap(super(FedMef, self).client_model(full_spec()), masks)
            return self.resources.accountant.cost(("sap", masks), build, self.resources.batch_size, count_flops=False).peak_bytes

        # Measured on the CPU whoever asks first: `upload_bytes` builds client models on the meta device.
        with torch.device("cpu"):
            return peak(True) < peak(False)

    @cached_property
    def marked(self) -> weakref.WeakKeyDictionary:
        """θ_low of each client in training (by its client module): per layer, flat positions."""
        return weakref.WeakKeyDictionary()

    def extrusion_lambda(self, rate: float, steps: int) -> float:
        """λ of Eq. 2 for a step at `rate` in a client-round of `steps`: `bae_lambda`, or calibrated
        (see `FedMefConfig.bae_lambda`)."""
        return self.config.bae_lambda if self.config.bae_lambda is not None else (1 - 10 ** (-1 / steps)) / (2 * rate)

    def aggregate(self, global_state: StateDict, updates: list[ClientUpdate], state: SparseTrainingState) -> tuple[StateDict, SparseTrainingState]:
        """FedTiny's, except that under NSConv a grown entry is stored at its filter's mean over the
        entries kept through the adjustment: the standardised weight the convolution applies then starts
        at 0, as FedTiny's grown weights do (a stored 0 would apply −μ/σ of its filter)."""
        weights, adjusted = super().aggregate(global_state, updates, state)
        if not self.config.nsconv or adjusted.masks is state.masks:
            return weights, adjusted
        weights = dict(weights)
        for key, new in adjusted.masks.items():
            stored = weights[key]
            if stored.dim() != 4:  # only convolutions standardise their filters
                continue
            weights[key] = grown_at_zero(stored, state.masks[key].to(stored.device), new.to(stored.device))
        return weights, adjusted

    def drop_magnitudes(self, weights: StateDict, masks: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """With `bae_target=applied`, what each layer applies (an NSConv's standardised weight times
        its gain): what the server drops and extrusion marks; else the stored weights, as FedTiny."""
        if self.config.bae_target == "stored":
            return {k: weights[k] for k in masks}
        out = {}
        for key, mask in masks.items():
            weight = weights[key]
            if weight.dim() == 4:  # a convolution: an NSConv
                gain = weights.get(key.removesuffix("weight") + "gain")
                weight = effective_weight(weight, mask.to(weight.device), self.config.ns_gamma, gain)
            out[key] = weight
        return out

    def extruded_weights(self, model: nn.Module, keys: Iterable[str]) -> dict[str, Tensor]:
        """Per key, the weight whose marked entries the surrogate term shrinks: the stored one, or
        with `bae_target=applied` an NSConv's standardised one in stored units (`applied_in_stored_units`)."""
        params = dict(model.named_parameters())
        if self.config.bae_target == "stored":
            return {k: params[k] for k in keys}
        out = {}
        for key in keys:
            layer = model.get_submodule(key.removesuffix(".weight"))
            out[key] = applied_in_stored_units(layer.weight, layer.mask, layer.gamma) if isinstance(layer, NSConv2d) else params[key]
        return out

    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        terms = super().objective(client, x, y)
        if not self.config.bae or not isinstance(adjustment := client.task.options, Adjustment):
            return terms
        params = dict(client.model.named_parameters())
        if client.steps == 0 or client not in self.marked:
            # Marked once per round, on the weights the client received (Algorithm 1), kept as flat positions.
            masks = {k: m.to(params[k].device) for k, m in client.task.spec.masks.items()}
            with torch.no_grad():
                magnitudes = self.drop_magnitudes(client.model.state_dict(), masks)
            low = lowest_magnitude(magnitudes, masks, adjustment.counts)
            self.marked[client] = {k: low[k].view(-1).nonzero().squeeze(1) for k in masks}
        extruded = self.extruded_weights(client.model, self.marked[client])
        squared = sum(extruded[k].view(-1)[positions].square().sum() for k, positions in self.marked[client].items())
        terms["extrusion"] = squared.detach()
        ctx = client.task.ctx
        initial_lr = ctx.train.lr if ctx.train.initial_lr is None else ctx.train.initial_lr
        lr = extrusion_learning_rate(ctx.train.lr, initial_lr, client.steps, local_steps(ctx), math.sqrt(float(terms["extrusion"])))
        for group in client.optimizer.param_groups:  # the step right after this loss takes μ_t
            group["lr"] = lr
        terms["loss"] = terms["loss"] + self.extrusion_lambda(lr, local_steps(ctx)) * squared
        return terms
