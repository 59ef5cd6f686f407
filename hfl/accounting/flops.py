"""torch's FLOP counter, with the attention kernels it leaves uncounted on the CPU.

`torch.utils.flop_counter` counts `F.scaled_dot_product_attention` through the CUDA kernels it
dispatches to (flash, memory-efficient, cuDNN), but has no formula for the fused CPU kernel
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward), so on the CPU a transformer's
attention cost nothing. Importing this module registers torch's own formulas for the CUDA kernels
(`sdpa_flop_count`: 4 b h s_q s_k d for QK^T and the product with V; `sdpa_backward_flop_count`:
10 b h s_q s_k d) for the CPU kernels too, so a model costs the same FLOPs on every device. Like
torch's, they count the full score matrix also under a causal mask.

Import `FlopCounterMode` from here rather than from torch, so the registration has happened.
`TotalFlopCounterMode` counts the same FLOPs without attributing them to modules, for the callers
that only read the total.
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

__all__ = ["FlopCounterMode", "TotalFlopCounterMode", "attention_backward_flops", "attention_flops"]

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


class _EverythingGlobal:
    """Stands in for `FlopCounterMode`'s module tracker: every operation runs in "Global" alone."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _EverythingGlobal:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class TotalFlopCounterMode(FlopCounterMode):
    """torch's `FlopCounterMode` for the total alone (`get_total_flops`): the same operations and
    formulas, every count under "Global". torch's counter also attributes each count to the modules
    running it, through a tracker that hooks every module's forward and registers a gradient hook on
    every output; leaving it out makes measuring a PreResNet-20's training cost about 15 % faster, and
    hfl's costs never read it."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _EverythingGlobal()
