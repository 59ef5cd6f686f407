"""torch's FLOP counter, with the attention kernels it leaves uncounted on the CPU.

`torch.utils.flop_counter` counts `F.scaled_dot_product_attention` through the CUDA kernels it
dispatches to (flash, memory-efficient, cuDNN), but has no formula for the fused CPU kernel
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward), so on the CPU a transformer's
attention cost nothing. Importing this module registers torch's own formulas for the CUDA kernels
(`sdpa_flop_count`: 4 b h s_q s_k d for QK^T and the product with V; `sdpa_backward_flop_count`:
10 b h s_q s_k d) for the CPU kernels too, so a model costs the same FLOPs on every device. Like
torch's, they count the full score matrix also under a causal mask.

Import `FlopCounterMode` from here rather than from torch, so the registration has happened.
`FlopCountingTracker` counts the same FLOPs, the total alone, in the live-storage tracker's
dispatch mode (`hfl.accounting.memory`), as a training cost's measurement needs both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from hfl.accounting.memory import LiveStorageTracker

__all__ = ["FlopCounterMode", "FlopCountingTracker", "attention_backward_flops", "attention_flops"]

aten = torch.ops.aten
CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu
CPU_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward
Shape = tuple[int, ...]


def attention_flops(query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """Forward FLOPs of attention on (batch, heads, sequence, dim) shapes, as torch counts its CUDA kernels."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def attention_backward_flops(
    grad_out_shape: Shape, query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """Backward FLOPs of attention, as torch counts its CUDA kernels' backward."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Both kernels take (query, key, value, ...) and (grad_out, query, key, value, ...) first, as the
# CUDA ones do. A later torch that counts them itself keeps its own formulas.
if CPU_ATTENTION not in flop_registry:
    register_flop_formula(CPU_ATTENTION)(attention_flops)
if CPU_ATTENTION_BACKWARD not in flop_registry:
    register_flop_formula(CPU_ATTENTION_BACKWARD)(attention_backward_flops)


class FlopCountingTracker(LiveStorageTracker):
    """A `LiveStorageTracker` that also counts FLOPs by torch's formulas while `counting` is set
    (`flops`, the total alone: hfl never reads torch's attribution to modules). One dispatch mode
    instead of torch's `FlopCounterMode` entered inside the tracker: measuring a PreResNet-20's
    training cost takes about a third less time. Unlike torch's counter it does not first try each
    operation's decomposition: the operations hfl's models run that decompose (batch norm's) count
    no FLOPs either way and allocate alike (tests/accounting/test_flops.py compares the two)."""

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__(device_type, record=True)
        self.counting = False
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.counting:
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
        return out
