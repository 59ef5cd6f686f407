"""What one client-round of training costs: memory by kind, FLOPs, and the bytes it moves.

Memory is measured, not modelled. Real training steps run (zero_grad, forward, backward, optimiser
step, as a client runs them). A first step creates the optimiser's state; each steady step after it
runs under a `LiveStorageTracker`, which starts from the gradients and state the step before left
and sees every tensor the step creates and frees: gradients, optimiser temporaries, activations
saved for backward, the gradients of activations. The peak is the largest total at any moment, plus
the tensors held throughout (weights, one input batch). Tracking only the steady steps gives the
same peaks as tracking every step (the golden runs' estimates are unchanged) in about 10 % less
time of a run. Saved activations alone are also counted (`torch.autograd.graph.saved_tensors_hooks`),
for the breakdown. FLOPs are `torch.utils.flop_counter`'s formulas, with the CPU attention kernels
counted too, summed in the tracker's own dispatch mode (`hfl.accounting.flops.FlopCountingTracker`).

The batch is what the experiment's clients read: standard-normal float inputs of `input_shape`
(C, H, W) and a class each for images, or token ids of `input_shape` (the sequence) with a target
token at every position for a language model (`input_dtype` int64).

Every tensor a step creates is either independent of the batch size or proportional to it, so the
live total at each moment of the step is affine in the batch: steady steps run at batch sizes 2
and 4 (after one first step) and the timeline is extrapolated moment by moment, which gives the
peak at any batch size exactly (checked against a direct run in the tests) and cheaply. The optimiser is the multi-tensor
(`foreach`) implementation clients use (`hfl.client.client_optimizer`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.cuda_autocast import cuda_autocast_on_cpu
from hfl.accounting.flops import FlopCountingTracker
from hfl.accounting.memory import CUDA_ALLOCATION_UNIT, allocation_bytes
from hfl.accounting.storage import sparse_bytes
from hfl.models.base import ScalableModel
from hfl.optim import ClientOptimizer

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
"""The autocast dtype of each mixed `fl.precision` (32-true runs without autocast)."""

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
    """One batch of inputs and labels."""
    peak_bytes: int
    """Estimated peak training memory: the largest total, at any moment of a steady training step,
    of the weights, the batch and every tensor the step holds (see the module docstring). Less than
    the sum of the parts above when gradients and activations are not all alive at once, more when
    transient tensors (the gradients of activations, an optimiser's temporaries) add to them."""
    forward_flops_per_sample: int
    backward_flops_per_sample: int

    @property
    def train_flops_per_sample(self) -> int:
        return self.forward_flops_per_sample + self.backward_flops_per_sample


def tensor_bytes(tensors: Mapping[str, Tensor], masks: Mapping[str, Tensor] | None = None) -> int:
    """Bytes to transmit `tensors`; masked tensors send their kept entries and their positions in
    the sparse storage their density calls for (`hfl.accounting.storage`)."""
    masks = masks or {}
    return sum(
        sparse_bytes(t.shape, int(masks[k].sum()), t.element_size()) if k in masks else t.numel() * t.element_size()
        for k, t in tensors.items()
    )


def sparse_weight_saving(state: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> int:
    """Bytes a client saves by holding the weights `masks` prunes sparse, their kept values and
    positions in the appendix's storage by density (what `tensor_bytes` counts for uploads), instead
    of masked-dense."""
    masked = {k: state[k] for k in masks}
    return sum(t.numel() * t.element_size() for t in masked.values()) - tensor_bytes(masked, masks)


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


def probe_optimizer(params: list[nn.Parameter], optimizer: str, weight_decay: float) -> ClientOptimizer:
    """The optimiser a client of this kind builds, the one clients use (`foreach`, whose temporaries
    span all parameters at once). Its learning rate is irrelevant to memory."""
    if optimizer == "adam":
        return ClientOptimizer(params, "adam", lr=1e-3, weight_decay=weight_decay)
    return ClientOptimizer(params, "sgd", lr=1e-3, momentum=0.9 if optimizer == "sgd_momentum" else 0.0, weight_decay=weight_decay)


@dataclass(frozen=True)
class _StepMeasurement:
    timeline: list[int]
    """Bytes alive after every allocation of the steady step (besides the weights and the batch)."""
    activation_bytes: int
    forward_flops: int
    backward_flops: int
    conv_workspace_bytes: int


def conv_workspace_bytes(conv: nn.Conv2d, output: Tensor) -> int:
    """The unfolded input (im2col) CUDA's convolution without cuDNN allocates for one image, inside
    the kernel and so outside torch's tensors, in the forward pass and again in the backward pass:
    (input channels per group x kernel area) x output positions. Depthwise convolutions and 1x1
    convolutions that neither stride nor pad use kernels without one."""
    groups, channels = conv.groups, conv.in_channels
    if groups > 1 and groups == channels:
        return 0
    if conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.padding in ((0, 0), "valid"):
        return 0
    kh, kw = conv.kernel_size
    positions = output.shape[-2] * output.shape[-1]
    return (channels // groups) * kh * kw * positions * output.element_size()


def autocast_for(precision: str, device_type: str, lists: str | None = None) -> contextlib.AbstractContextManager:
    """The forward pass's autocast under `precision` (`fl.precision`) on `device_type`, as Lightning's
    MixedPrecision plugin enters it around a training step; 32-true: none. `lists` "cuda" on the CPU:
    CUDA's per-op casts instead of the CPU's (`cuda_autocast_on_cpu`, for measuring a client that
    trains on CUDA); None: `device_type`'s own."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    if lists == "cuda" and device_type == "cpu":
        return cuda_autocast_on_cpu(dtype)
    return torch.autocast(device_type, dtype=dtype)


def _train_step(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    step: Step,
    opt: ClientOptimizer | None,
    saving: contextlib.AbstractContextManager | None = None,
    counter: FlopCountingTracker | None = None,
    precision: str = "32-true",
    autocast_lists: str | None = None,
) -> tuple[int, int]:
    """One training step as a client runs it (zero_grad, forward under `saving` and `precision`'s
    autocast with `autocast_lists`' casts, backward, optimiser step); with `counter` (entered), the
    forward and backward FLOPs it counts during those two."""
    def counted() -> int:
        return counter.flops if counter is not None else 0

    if opt is not None:
        opt.zero_grad(set_to_none=True)
    start = counted()
    if counter is not None:
        counter.counting = True
    with saving or contextlib.nullcontext(), autocast_for(precision, x.device.type, autocast_lists):
        loss = step(model, x, y)
    forward = counted() - start
    if loss.requires_grad:
        loss.backward()
    backward = counted() - start - forward
    if counter is not None:
        counter.counting = False
    del loss
    if opt is not None:
        opt.step()
    return forward, backward


def _measure_steps(
    model: nn.Module,
    batches: list[tuple[Tensor, Tensor]],
    step: Step,
    optimizer: str,
    weight_decay: float,
    record_only: nn.Module | None,
    count_flops: bool,
    conv_workspace: bool,
    precision: str,
    autocast_lists: str | None = None,
) -> list[_StepMeasurement]:
    """A first training step of `model` on the first of `batches`, then one steady step on each
    (the optimiser's state exists), each under the live-storage tracker, which starts from the
    gradients and state the step before left; each steady step's saved activations (only
    `record_only`'s, if given) and FLOPs; with `conv_workspace`, the largest convolution's unfolded
    input. A steady step starts from what any step before it left (the same tensors' shapes at
    every batch size), so one first step serves all the batches."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = probe_optimizer(trainable, optimizer, weight_decay) if trainable else None
    hooks = []
    workspace = [0]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)] if conv_workspace else []
    for conv in convs:
        hooks.append(conv.register_forward_hook(
            lambda module, _, out: workspace.__setitem__(0, max(workspace[0], conv_workspace_bytes(module, out)))))
    measured = []
    try:
        # The first step creates the optimiser's state. It runs untracked (the dispatch mode is most
        # of a measurement's time), and the steady step's count starts from what it left alive.
        _train_step(model, *batches[0], step, opt, precision=precision, autocast_lists=autocast_lists)
        for x, y in batches:
            held = [p.grad for p in trainable if p.grad is not None]
            if opt is not None:  # Adam's step counts: scalars it keeps on the CPU (not capturable), made outside any op
                held += [t for state in opt.state.values() for k, t in state.items() if isinstance(t, Tensor) and k != "step"]
            meter = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers(), x])
            recording_hooks = []
            if record_only is not None:  # count only what this module saves (e.g. one block of a depth-wise method)
                meter.recording = False
                recording_hooks = [record_only.register_forward_pre_hook(lambda *_, meter=meter: setattr(meter, "recording", True)),
                          record_only.register_forward_hook(lambda *_, meter=meter: setattr(meter, "recording", False))]
            tracker = FlopCountingTracker(x.device.type)
            workspace[0] = 0
            try:
                with tracker:
                    tracker.hold(held)
                    del held
                    saving = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)
                    forward, backward = _train_step(model, x, y, step, opt, saving, tracker if count_flops else None, precision,
                                                    autocast_lists)
            finally:
                tracker.stop()
                for hook in recording_hooks:
                    hook.remove()
            measured.append(_StepMeasurement(tracker.timeline, meter.bytes, forward, backward, workspace[0]))
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    return measured


def example_batch(
    input_shape: tuple[int, ...], num_classes: int, size: int, gen: torch.Generator, input_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """`size` random inputs and their targets: for a float dtype standard-normal inputs and a class
    each; for an integer dtype token ids in 0..num_classes - 1 and a target id at every position.
    Float inputs take the default float dtype, the one models are built in (float64 under
    `torch.set_default_dtype(torch.float64)`), so that they match the weights."""
    if input_dtype.is_floating_point:
        x = torch.randn(size, *input_shape, generator=gen, dtype=torch.get_default_dtype())
        return x, torch.randint(0, num_classes, (size,), generator=gen)
    ids = torch.randint(0, num_classes, (size, *input_shape), generator=gen, dtype=input_dtype)
    return ids, torch.randint(0, num_classes, (size, *input_shape), generator=gen)


def zero_inputs(input_shape: tuple[int, ...], size: int, input_dtype: torch.dtype = torch.float32, device: str = "cpu") -> Tensor:
    """`size` all-zero inputs a model reads (zero pixels, or token id 0), for probing shapes and FLOPs."""
    dtype = torch.get_default_dtype() if input_dtype.is_floating_point else input_dtype  # as `example_batch`
    return torch.zeros(size, *input_shape, dtype=dtype, device=device)


def measure_training_cost(
    model: nn.Module,
    input_shape: tuple[int, ...],
    num_classes: int,
    batch_size: int,
    optimizer: str = "sgd_momentum",
    step: Step = cross_entropy_step,
    record_only: str | None = None,
    count_flops: bool = True,
    weight_decay: float = 0.0,
    input_dtype: torch.dtype = torch.float32,
    conv_workspace: bool = False,
    in_place: bool = False,
    precision: str = "32-true",
    headroom: int = 0,
    autocast_lists: str | None = None,
) -> TrainingCost:
    """Measure training `model` (its `requires_grad` flags say what is trainable) on batches of
    `batch_size` inputs of `input_shape` (C, H, W; or the sequence, for token ids of `input_dtype`
    int64) with `optimizer` ("sgd", "sgd_momentum", "adam") and `weight_decay`. `record_only` names a submodule whose saved activations alone are counted;
    the peak is then that share's sum of parts (weights, gradients, optimiser state, its saved
    activations, the batch), not a timeline. Without `count_flops` the FLOPs are reported as 0 (for
    searches over many shapes). With `conv_workspace` the peak also counts the largest convolution's
    unfolded input (`conv_workspace_bytes`), which CUDA allocates outside torch's tensors when cuDNN
    is off; `headroom` bytes come on top of the peak (what a client on CUDA keeps for its allocator's
    pages and cuDNN's workspace under the cap of its budget). The model is copied, so its weights and statistics stay
    unchanged; `in_place` trains `model` itself instead (one built for this measurement alone; not
    copying a PreResNet-20 makes measuring it about 10 % faster). `precision` (`fl.precision`) runs
    the forward pass under its autocast, as clients do: the activations saved in bfloat16 are what
    mixed precision saves. 16-mixed is measured as bf16-mixed (the same element sizes and autocast
    lists; its gradient scaler adds one scalar). `autocast_lists` "cuda": with CUDA's per-op casts
    (for clients that train on CUDA; CUDA runs norms, softmax and reductions in float32 where the
    CPU uses the lower precision); None: the measuring device's."""
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}")
    probe = (model if in_place else copy.deepcopy(model)).train()
    region = probe.get_submodule(record_only) if record_only else None
    gen = torch.Generator().manual_seed(0)
    # Autocast to float16 on the CPU (where the accountant measures) is slow; its tensors are bf16's sizes.
    measured_as = "bf16-mixed" if precision == "16-mixed" else precision

    def measured(*sizes: int) -> list[_StepMeasurement]:
        batches = [example_batch(input_shape, num_classes, size, gen, input_dtype) for size in sizes]
        with torch.random.fork_rng(devices=[]):
            return _measure_steps(probe, batches, step, optimizer, weight_decay, region, count_flops, conv_workspace, measured_as,
                                  autocast_lists)

    # Batches of 2 and 4 (batch norm refuses a single sample on 1x1 feature maps) fix every moment's
    # affine function of the batch size.
    small, large = measured(2, 4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    element = next(iter(model.parameters())).element_size()
    param_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    x, y = example_batch(input_shape, num_classes, 1, torch.Generator(), input_dtype)  # one sample's shapes and dtypes
    # Float inputs are held in the model's precision; token ids and labels as int64.
    input_bytes = batch_size * ((element if input_dtype.is_floating_point else x.element_size()) * x.numel() + y.element_size() * y.numel())
    activation_bytes = small.activation_bytes + (large.activation_bytes - small.activation_bytes) * (batch_size - 2) // 2
    optimizer_bytes = grad_bytes * OPTIMIZER_STATE_COPIES[optimizer]
    if region is not None:
        peak = param_bytes + grad_bytes + optimizer_bytes + activation_bytes + input_bytes
    else:
        if len(small.timeline) == len(large.timeline):
            created = max((a + (b - a) * (batch_size - 2) // 2 for a, b in zip(small.timeline, large.timeline)), default=0)
        else:  # the two batch sizes did not allocate alike (a size-dependent kernel path): measure directly
            log.debug("timelines of %d and %d allocations: measuring at batch %d", len(small.timeline), len(large.timeline), batch_size)
            created = max(measured(batch_size)[0].timeline, default=0)
        peak = param_bytes + input_bytes + created
    if conv_workspace:  # at most one convolution runs at a time: its unfolded input comes on top once
        peak += allocation_bytes(max(small.conv_workspace_bytes, large.conv_workspace_bytes), CUDA_ALLOCATION_UNIT)
    peak += headroom
    return TrainingCost(
        batch_size=batch_size,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes=activation_bytes,
        input_bytes=input_bytes,
        peak_bytes=peak,
        forward_flops_per_sample=(large.forward_flops - small.forward_flops) // 2,
        backward_flops_per_sample=(large.backward_flops - small.backward_flops) // 2,
    )
