"""FedTiny — Huang et al., "Distributed Pruning Towards Tiny Neural Networks in Federated Learning",
ICDCS 2023 — as FedMef's comparison runs it (Huang, Zhuang, Chen and Lyu, CVPR 2024: Algorithm 1
without budget-aware extrusion and scaled activation pruning): dynamic sparse training with the
mask kept and adjusted by the server.

The server holds the mask in the method's state, starting from a random one with ERK layer
densities at `sparsity` (biases and norms never pruned); clients train the masked model. In an
adjustment round (every `adjust_every` rounds up to `stop_round`: r mod ΔR = 0 and r ≤ R_stop, with
rounds counted from 1) each client also uploads, per prunable layer, the ξ = ⌊ζ_r·n_l⌋ entries of
largest |gradient| among the pruned ones, from the dense gradient of one batch of its data taken
after training (`client_uploads`, sent as values and int32 positions, counted in bytes_up). The
server averages weights and those gradients weighted by the clients' sample counts, then per layer
drops the ξ kept entries of smallest |θ̄| and grows the ξ pruned entries of largest |ḡ|, at 0:
each layer keeps its density.

Deliberate choices: FedTiny's adaptive batch-norm selection of the initial mask (candidate masks
scored by clients' BN statistics) is omitted, as FedMef's comparison may omit it; the initial mask
is random (ERK), drawn from the run's seed. The one-batch gradient is plain cross-entropy and leaves
the client's batch-norm statistics as training left them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.methods.base import Client, MethodState
from hfl.methods.sparse import AdjustedSparseConfig, SparseStart
from hfl.pruning.nsconv import applied_weights
from hfl.pruning.schedules import adjustment_count, fedmef_adjustment_rate
from hfl.pruning.selection import SparseGradient, prune_and_grow, top_pruned_gradients
from hfl.registry import METHODS
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.submodel.spec import full_spec
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

VALUES, POSITIONS = "/gradient_values", "/gradient_positions"
"""Suffixes of a layer's key in `ClientUpdate.extras`: its uploaded gradient entries and their positions."""


@dataclass(frozen=True)
class FedTinyConfig(AdjustedSparseConfig):
    name: str = "fedtiny"


@dataclass(frozen=True)
class SparseTrainingState(MethodState):
    rounds: int = 0
    """Rounds aggregated so far: `aggregate` learns from it which round it closes."""


@dataclass(frozen=True)
class Adjustment:
    """A task's options in an adjustment round: the ξ of every prunable layer."""

    counts: Mapping[str, int]

    def __str__(self) -> str:
        return f"mask adjustment: {sum(self.counts.values())} entries to swap"


def encode_gradients(gradients: Mapping[str, SparseGradient]) -> StateDict:
    """`client_uploads`' tensors: per layer the values and their int32 flat positions."""
    out = {}
    for key, gradient in gradients.items():
        out[key + VALUES], out[key + POSITIONS] = gradient.values, gradient.indices.to(torch.int32)
    return out


def averaged_gradients(updates: Iterable[ClientUpdate], shapes: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """ḡ per key of `shapes`: the clients' uploaded entries (zero elsewhere), averaged by update weight."""
    sums = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in shapes.items()}
    total = 0.0
    for update in updates:
        total += update.weight
        for key, acc in sums.items():
            values = update.extras[key + VALUES].to(acc.device, acc.dtype)
            positions = update.extras[key + POSITIONS].to(acc.device).long()
            acc.add_(SparseGradient(values, positions, acc.shape).dense(), alpha=update.weight)
    return {k: v / total for k, v in sums.items()}


def one_batch_gradients(model: nn.Module, keys: Iterable[str], x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """The dense cross-entropy gradient of `keys` on one batch, with respect to the weights as the
    layers apply them (an NSConv's effective weight, whose gradient is dense where the stored one's is
    masked); the model's buffers (batch-norm statistics, which the update already carries) are left
    as they were."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    keys = list(keys)
    with applied_weights(model) as applied:
        params = {**dict(model.named_parameters()), **applied}
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), [params[k] for k in keys])
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    return dict(zip(keys, grads))


@METHODS.register("fedtiny")
class FedTiny(SparseStart):
    Config = FedTinyConfig
    State = SparseTrainingState

    def adjusts(self, round_: int) -> bool:
        """Whether the mask is adjusted at the end of round `round_` (1-based)."""
        return round_ % self.config.adjust_every == 0 and round_ <= self.config.stop_round

    def adjustment_counts(self, round_: int, masks: Mapping[str, Tensor]) -> dict[str, int]:
        """ξ per layer: ⌊ζ_r · n_l⌋, n_l the layer's kept entries."""
        rate = fedmef_adjustment_rate(round_, self.config.stop_round)
        return {k: adjustment_count(rate, int(m.sum())) for k, m in masks.items()}

    def plan(self, ctx: RoundContext, state: SparseTrainingState) -> ClientTask | None:
        options = Adjustment(self.adjustment_counts(ctx.round, state.masks)) if self.adjusts(ctx.round) else None
        return ClientTask(ctx, replace(full_spec(), masks=state.masks), options=options)

    def client_uploads(self, client: Client, batches: Iterable[tuple[Tensor, Tensor]]) -> StateDict:
        adjustment = client.task.options
        if not isinstance(adjustment, Adjustment):
            return {}
        masks = client.task.spec.masks
        x, y = next(iter(batches))
        gradients = one_batch_gradients(client.model, masks, x, y)
        device_masks = {k: m.to(gradients[k].device) for k, m in masks.items()}
        return encode_gradients(top_pruned_gradients(gradients, device_masks, adjustment.counts))

    def drop_magnitudes(self, weights: StateDict, masks: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """What the server's prune step ranks by magnitude, per key of `masks`: the averaged weights,
        which the layers apply as they are (FedMef's NSConv applies standardised ones)."""
        return weights

    def aggregate(
        self, global_state: StateDict, updates: list[ClientUpdate], state: SparseTrainingState
    ) -> tuple[StateDict, SparseTrainingState]:
        if self.config.weighting == "clients":
            updates = [replace(u, weight=1.0) for u in updates]
        weights = masked_weighted_mean(global_state, updates)
        round_ = state.rounds + 1
        state = replace(state, rounds=round_)
        if not self.adjusts(round_) or not updates:
            return weights, state
        masks = {k: m.to(weights[k].device) for k, m in state.masks.items()}
        gradients = averaged_gradients(updates, {k: weights[k] for k in masks})
        counts = self.adjustment_counts(round_, masks)
        new_masks, adjusted = prune_and_grow(weights, masks, gradients, counts, self.drop_magnitudes(weights, masks))
        return adjusted, replace(state, masks={k: m.cpu() for k, m in new_masks.items()})

