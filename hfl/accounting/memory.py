"""Live tensor memory, seen through a TorchDispatchMode: the device-independent twin of the CUDA
caching allocator's `memory_allocated`.

Every torch operation's outputs pass through `__torch_dispatch__`; a storage an operation creates
(not a view of, or an in-place write into, one of its inputs) is counted from then until it is
freed (a weak reference: torch keeps one Python object per storage while the storage lives). The
count sees what the program holds: weights' gradients, optimiser state, activations saved for
backward and every transient tensor (the gradients of activations during backward, an optimiser's
temporaries). It does not see scratch memory a kernel allocates outside torch's tensors (a CPU
convolution's im2col buffer, cuDNN's and cuBLAS's workspaces on CUDA), nor tensors that existed
before the tracker started (the caller counts those).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

CUDA_ALLOCATION_UNIT = 512
"""The CUDA caching allocator hands out blocks in multiples of 512 bytes (its `kMinBlockSize`)."""


def allocation_bytes(nbytes: int, unit: int = 1) -> int:
    """`nbytes` rounded up to the allocator's unit, as the allocator would charge it."""
    return -(-nbytes // unit) * unit if nbytes else 0


def _tensors(tree: Any) -> Iterator[Tensor]:
    """The tensors in an operation's arguments or outputs (nested tuples, lists and dicts), in
    `torch.utils._pytree.tree_leaves`'s order; a walk of its own, as the tracker runs it for every
    operation and pytree's general one was a fifth of a measurement's time."""
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of the storages on `device_type` that torch operations create while the
    mode is active and that are still alive (`live_bytes`), and the largest such count (`peak_bytes`).

    Each storage is counted once, however many views share it, rounded up to `unit` bytes. With
    `record`, the count after every allocation is appended to `timeline` (peaks happen right after
    an allocation), so two runs of one program at different sizes can be compared event by event.
    `on_change` is called after every allocation."""

    def __init__(
        self,
        device_type: str = "cpu",
        *,
        unit: int = 1,
        record: bool = False,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.device_type, self.unit, self.record = device_type, unit, record
        self.live_bytes = 0
        self.peak_bytes = 0
        self.timeline: list[int] = []
        self._sizes: dict[int, int] = {}
        self._on_change = on_change

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: leave `__torch_dispatch__` unwrapped (TorchDispatchMode wraps it in
        `torch._disable_dynamo` otherwise, whose first call imports torch._dynamo: 1.5 CPU-seconds a
        process, as much as `import torch`). Nothing is compiled inside these modes."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: set[int] | None = None
        for t in _tensors(out):
            if t.device.type != self.device_type or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            if id(storage) in self._sizes:
                continue
            if inputs is None:
                inputs = {id(a.untyped_storage()) for a in _tensors((args, kwargs)) if a.layout == torch.strided}
            if id(storage) not in inputs:
                self._add(storage)
        return out

    def hold(self, tensors: Iterable[Tensor]) -> None:
        """Count the storages of `tensors` (on this device) as alive from now until they are freed:
        what ran before the tracker left them (a first training step's gradients and optimiser state)."""
        for t in tensors:
            if t.device.type == self.device_type and t.layout == torch.strided and id(t.untyped_storage()) not in self._sizes:
                self._add(t.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, size = id(storage), allocation_bytes(storage.nbytes(), self.unit)
        self._sizes[key] = size
        weakref.finalize(storage, self._free, key)
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.record:
            self.timeline.append(self.live_bytes)
        if self._on_change is not None:
            self._on_change()

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)

    def stop(self) -> None:
        """Forget the storages still alive: freeing them later no longer changes a finished count."""
        self._sizes.clear()
