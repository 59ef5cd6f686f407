"""What one client-round of training costs: memory by kind, FLOPs, and the bytes it moves.

Activation memory is measured, not modelled: a real forward pass runs under
`torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for backward.
A frozen prefix whose inputs need no gradient saves nothing, a skipped block saves nothing, and an
op that saves a view of an existing tensor costs nothing extra (storages are counted once). FLOPs
come from `torch.utils.flop_counter.FlopCounterMode`. Both scale linearly with the batch, so they
are measured at two small batch sizes and extrapolated: exact for the models here, and cheap.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from hfl.models.base import ScalableModel

OPTIMIZER_STATE_COPIES = {"sgd": 0, "sgd_momentum": 1, "adam": 2}
"""Optimiser state per trainable parameter, in parameter-sized copies."""

Step = Callable[[nn.Module, Tensor, Tensor], Tensor]
"""Runs a forward pass and returns the loss to backpropagate."""


def cross_entropy_step(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy at every exit the model holds (one for a model without early exits)."""
    outputs = model.forward_exits(x) if isinstance(model, ScalableModel) else [model(x)]
    return sum(F.cross_entropy(logits, y) for logits in outputs)


@dataclass(frozen=True)
class TrainingCost:
    """Memory (bytes) and compute (FLOPs) of training one model shape at one batch size."""

    batch_size: int
    param_bytes: int
    """Every tensor the client holds: parameters and buffers."""
    grad_bytes: int
    """Gradients of trainable parameters."""
    optimizer_bytes: int
    """Optimiser state (momentum buffers, Adam moments)."""
    activation_bytes: int
    """Tensors autograd saves for backward, for one batch."""
    input_bytes: int
    """One input batch."""
    forward_flops_per_sample: int
    backward_flops_per_sample: int

    @property
    def peak_bytes(self) -> int:
        """Estimated peak training memory: everything above alive at once during backward."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes + self.input_bytes

    @property
    def train_flops_per_sample(self) -> int:
        return self.forward_flops_per_sample + self.backward_flops_per_sample


def _storage_key(t: Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedTensorMeter:
    """Counts the bytes of distinct storages autograd saves while `recording` is true."""

    def __init__(self, exclude: Iterable[Tensor]) -> None:
        self.seen: set[tuple[int, int]] = {_storage_key(t) for t in exclude}
        self.bytes = 0
        self.recording = True

    def pack(self, t: Tensor) -> Tensor:
        if self.recording and t.device.type != "meta":
            key = _storage_key(t)
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += key[1]
        return t

    @staticmethod
    def unpack(t: Tensor) -> Tensor:
        return t


def _measure_once(
    model: nn.Module, x: Tensor, y: Tensor, step: Step, record_only: nn.Module | None, count_flops: bool = True
) -> tuple[int, int, int]:
    """(activation bytes, forward FLOPs, backward FLOPs) of one training step on batch (x, y); without
    `count_flops` only the forward pass runs (autograd saves while going forward) and FLOPs are 0."""
    held = [*model.parameters(), *model.buffers()]
    meter = SavedTensorMeter(exclude=[*held, x])
    hooks = []
    if record_only is not None:  # count only what this module saves (e.g. one block of a depth-wise method)
        meter.recording = False
        hooks.append(record_only.register_forward_pre_hook(lambda *_: setattr(meter, "recording", True)))
        hooks.append(record_only.register_forward_hook(lambda *_: setattr(meter, "recording", False)))
    counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
    forward = backward = 0
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            loss = step(model, x, y)
            if count_flops:
                forward = counter.get_total_flops()
                if loss.requires_grad:
                    loss.backward()
        if count_flops:
            backward = counter.get_total_flops() - forward
    finally:
        for hook in hooks:
            hook.remove()
    return meter.bytes, forward, backward


def measure_training_cost(
    model: nn.Module,
    input_shape: tuple[int, ...],
    num_classes: int,
    batch_size: int,
    optimizer: str = "sgd_momentum",
    step: Step = cross_entropy_step,
    record_only: str | None = None,
    count_flops: bool = True,
) -> TrainingCost:
    """Measure training `model` (its `requires_grad` flags say what is trainable) on batches of
    `batch_size` inputs of `input_shape` (C, H, W). `record_only` names a submodule whose saved
    activations alone are counted. Without `count_flops` the FLOPs are reported as 0, and measuring
    is several times faster on deep models (for searches over many shapes). The model is copied:
    its weights and statistics stay unchanged."""
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}")
    probe = copy.deepcopy(model).train()
    region = probe.get_submodule(record_only) if record_only else None
    gen = torch.Generator().manual_seed(0)
    samples = []
    # Activations and FLOPs are affine in the batch size: two points fix the line. Batches of 2 and
    # 4, because batch norm refuses a single sample on 1x1 feature maps.
    for b in (2, 4):
        x = torch.randn(b, *input_shape, generator=gen)
        y = torch.randint(0, num_classes, (b,), generator=gen)
        with torch.random.fork_rng(devices=[]):
            samples.append(_measure_once(probe, x, y, step, region, count_flops))
    (a2, f2, b2), (a4, f4, b4) = samples
    activation_bytes = a2 + (a4 - a2) * (batch_size - 2) // 2
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    element = next(iter(model.parameters())).element_size()
    return TrainingCost(
        batch_size=batch_size,
        param_bytes=sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]),
        grad_bytes=grad_bytes,
        optimizer_bytes=grad_bytes * OPTIMIZER_STATE_COPIES[optimizer],
        activation_bytes=activation_bytes,
        input_bytes=batch_size * element * int(torch.Size(input_shape).numel()),
        forward_flops_per_sample=(f4 - f2) // 2,
        backward_flops_per_sample=(b4 - b2) // 2,
    )
