"""Memory-efficient (block-by-block) inference, and a meter of the peak memory inference needs.

FeDepth (Zhang et al., AAAI 2024, "Memory-adaptive Depth-wise Heterogeneous Federated Learning"),
"Memory-efficient Inference": for each input the activation z_j is stored (on disk), z_{j-1} is
discarded, and z_j is reloaded to compute z_{j+1}, until the prediction is obtained.

`blockwise_inference` runs a `ScalableModel` one stage at a time: the stem, each body block, each
early exit and the head. A stage streams the whole input set through itself in batches and keeps
its outputs for every input, in host memory or, given a spill directory, in a memory-mapped file
that is deleted once the next stage has read it. Only the running stage's weights are on the
compute device. `standard_inference` is the ordinary batched `forward_exits`, measured the same way.

What `peak_bytes` counts (both functions, see `PeakMemoryMeter`): the largest total, at any moment
of the call, of tensor memory in use on the compute device, namely

- the weights (parameters and buffers) that are on the device: the whole model for the standard
  forward, the running stage's for the block-wise one;
- every tensor the call creates there and holds: a batch's copy of its input, the activations
  inside the running layers, a batch's output, the logits returned, and, on a CPU without a spill
  directory, the kept outputs of the stage that runs and of the one it reads (two full-set buffers).

The caller's input set is not counted (it exists before the call; on a device a batch's copy of it
is). On CUDA the kept activations live in host memory, so they are not counted there; on the CPU,
host memory is the device memory. Spilled activations are file pages, not tensor memory.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from hfl.accounting.memory import LiveStorageTracker
from hfl.models import ScalableModel

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)
HOST = torch.device("cpu")


@dataclass(frozen=True)
class Inference:
    """What an inference over an input set gives."""

    outputs: list[Tensor]
    """Every exit's logits for the whole set, shallowest first (the head's last), as `forward_exits`."""
    peak_bytes: int
    """The peak memory the call needed on its compute device (see the module docstring)."""


# -- measuring ----------------------------------------------------------------------------------
def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class PeakMemoryMeter:
    """A context manager measuring the peak bytes of tensor memory in use on `device` inside it.

    CUDA: the caching allocator's count (`torch.cuda.max_memory_allocated`) above what was allocated
    on entry; it includes kernels' workspaces and the allocator's rounding. CPU: the bytes of tensor
    storages that torch operations create inside the block and that are still alive (seen through a
    TorchDispatchMode); scratch memory a kernel allocates internally (e.g. for im2col), memory
    allocated outside torch (numpy, memory-mapped files) and Python objects are not seen.
    On both, `charge` adds memory in use that was not allocated inside the block: weights already on
    the device. Read `peak_bytes` after the block."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._charged = 0
        self._tracker: LiveStorageTracker | None = None
        self._base = 0

    def __enter__(self) -> Self:
        self.peak_bytes, self._charged = 0, 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            self._tracker = LiveStorageTracker("cpu", on_change=self._update)
            self._tracker.__enter__()
        else:
            raise ValueError(f"memory can be measured on cpu or cuda, not {self.device}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._update()
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self._tracker.stop()
            self._tracker = None

    def _update(self) -> None:
        if self._tracker is not None:
            used = self._tracker.live_bytes
        else:  # the peak since the last reset, which happened when the charge last changed
            used = torch.cuda.max_memory_allocated(self.device) - self._base
        self.peak_bytes = max(self.peak_bytes, used + self._charged)

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` more (fewer, if negative) as in use from now on."""
        self._update()
        if self._tracker is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._charged += nbytes
        self._update()


# -- the standard forward -----------------------------------------------------------------------
def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), HOST)


def _forward_exits(model: nn.Module, x: Tensor) -> list[Tensor]:
    return model.forward_exits(x) if hasattr(model, "forward_exits") else [model(x)]


@torch.no_grad()
def standard_inference(model: nn.Module, x: Tensor, batch_size: int) -> Inference:
    """`model.forward_exits` (or `model(x)` for a model without exits) on `x` in batches of
    `batch_size`, on the model's device; the whole model's weights are resident throughout."""
    device = _device_of(model)
    parts: list[list[Tensor]] = []
    with PeakMemoryMeter(device) as meter:
        meter.charge(module_bytes(model))  # resident before the call, so not seen allocated
        for start in range(0, len(x), batch_size):
            parts.append(_forward_exits(model, x[start : start + batch_size].to(device)))
        outputs = [torch.cat(list(exit_parts)) for exit_parts in zip(*parts)]
        del parts
    return Inference(outputs, meter.peak_bytes)


# -- the block-wise forward ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Stage:
    name: str
    module: nn.Module
    classifier: bool
    """True for an exit or the head: it reads the current activation and gives logits."""


def stages(model: ScalableModel) -> list[_Stage]:
    """The model's stages in forward order: stem, body blocks (each followed by its exit), head.
    Identity blocks (dropped by depth scaling) and an identity stem compute nothing and are left out."""
    depth = len(model.body) if model.depth is None else model.depth
    found = [_Stage("stem", model.stem, False)]
    for i in range(depth):
        found.append(_Stage(f"body.{i}", model.body[i], False))
        if str(i) in model.exits:
            found.append(_Stage(f"exits.{i}", model.exits[str(i)], True))
    if model.head is not None:
        found.append(_Stage("head", model.head, True))
    return [s for s in found if not isinstance(s.module, nn.Identity)]


class _Kept:
    """One stage's outputs for the whole input set, in host memory or in a memory-mapped file."""

    def __init__(self, size: int, spill_dir: Path | None, name: str) -> None:
        self.size, self.spill_dir, self.name = size, spill_dir, name
        self.tensor: Tensor | None = None
        self.array: np.memmap | None = None
        self.path: str | None = None

    @classmethod
    def of(cls, x: Tensor) -> _Kept:
        """The input set itself, read in place."""
        kept = cls(len(x), None, "input")
        kept.tensor = x
        return kept

    def write(self, start: int, out: Tensor) -> None:
        if self.tensor is None and self.array is None:
            shape = (self.size, *out.shape[1:])
            if self.spill_dir is None:
                self.tensor = torch.empty(shape, dtype=out.dtype, device=HOST)
            else:
                dtype = torch.empty(0, dtype=out.dtype).numpy().dtype
                fd, self.path = tempfile.mkstemp(prefix=f"hfl-{self.name}-", suffix=".bin", dir=self.spill_dir)
                os.close(fd)
                self.array = np.memmap(self.path, dtype=dtype, mode="w+", shape=shape)
        if self.tensor is not None:
            self.tensor[start : start + len(out)].copy_(out)
        else:
            self.array[start : start + len(out)] = out.cpu().numpy()

    def read(self, start: int, stop: int, device: torch.device) -> Tensor:
        """Inputs `start:stop` on `device`: a view where they already are, else a copy (from disk, a load)."""
        if self.tensor is not None:
            return self.tensor[start:stop].to(device)
        return torch.from_numpy(self.array[start:stop]).to(device, copy=True)

    def release(self) -> None:
        self.tensor, self.array = None, None
        if self.path is not None:
            os.remove(self.path)
            self.path = None


@contextmanager
def _placed(module: nn.Module, device: torch.device, meter: PeakMemoryMeter) -> Iterator[None]:
    """Keep `module` on `device` while it runs: moved there and back to the host, or, where it
    already is (the CPU), charged to the meter."""
    if device == HOST:
        size = module_bytes(module)
        meter.charge(size)
        try:
            yield
        finally:
            meter.charge(-size)
    else:
        module.to(device)
        try:
            yield
        finally:
            module.to(HOST)


@torch.no_grad()
def blockwise_inference(model: nn.Module, x: Tensor, batch_size: int, spill_dir: str | Path | None = None) -> Inference:
    """Every exit's logits of `model` on `x`, computed one stage at a time (see the module docstring).

    Each stage runs on the model's device over `x` in batches of `batch_size`; the other stages wait
    in host memory (a CUDA model is moved there for the call and back afterwards). A stage's outputs
    are kept in host memory, or with `spill_dir` in a file there that is deleted once read; the
    directory is created if missing and left as found. Logits equal `forward_exits`' for models in
    eval mode. A model that is not a ScalableModel has no stages: it gets `standard_inference`."""
    if not isinstance(model, ScalableModel):
        log.debug("%s has no blocks; running the whole-model forward", type(model).__name__)
        return standard_inference(model, x, batch_size)
    device = _device_of(model)
    spill = None if spill_dir is None else Path(spill_dir)
    if spill is not None:
        spill.mkdir(parents=True, exist_ok=True)
    if device != HOST:
        model.to(HOST)
    outputs: list[Tensor] = []
    current = kept = _Kept.of(x)
    try:
        with PeakMemoryMeter(device) as meter:
            for stage in stages(model):
                kept = _Kept(len(x), None if stage.classifier else spill, stage.name)
                with _placed(stage.module, device, meter):
                    for start in range(0, len(x), batch_size):
                        kept.write(start, stage.module(current.read(start, start + batch_size, device)))
                if stage.classifier:
                    outputs.append(kept.tensor.to(device))
                else:
                    current.release()  # z_{j-1} is discarded once z_j is complete
                    current = kept
            current.release()
    finally:  # also after an error: no file is left behind
        current.release()
        kept.release()
        if device != HOST:
            model.to(device)
    return Inference(outputs, meter.peak_bytes)
