"""Bytes of a masked tensor on the wire, in the sparse storage of FedMef's appendix (§7.1).

A tensor of n entries keeping m of b bits each (density d = m / n), reshaped to n_r × n_c (its first
dimension by the rest; a vector is one row):
- d ≥ 0.9: dense, n·b bits;
- 0.3 ≤ d < 0.9: bitmap, n bits of map + m·b;
- 0.1 ≤ d < 0.3: coordinates, m·⌈log₂ n⌉ bits of offsets + m·b;
- d < 0.1: CSR, m·⌈log₂ n_c⌉ bits of column indices + n_r·⌈log₂ m⌉ bits of row pointers + m·b.
The positions carry the mask, so nothing else is sent for it. A count of 0 or 1 possible positions
needs no bits (⌈log₂ 1⌉ = 0); a tensor keeping nothing costs nothing. Bits are rounded up to whole
bytes per tensor.
"""

from __future__ import annotations

import math

import torch

DENSE_FROM, BITMAP_FROM, COORDINATES_FROM = 0.9, 0.3, 0.1
"""Lowest density of each scheme; CSR below the last."""


def position_bits(choices: int) -> int:
    """⌈log₂ choices⌉: bits that tell one of `choices` positions apart."""
    return math.ceil(math.log2(choices)) if choices > 1 else 0


def storage_scheme(density: float) -> str:
    """"dense", "bitmap", "coo" or "csr" for a tensor of this density."""
    if density >= DENSE_FROM:
        return "dense"
    if density >= BITMAP_FROM:
        return "bitmap"
    return "coo" if density >= COORDINATES_FROM else "csr"


def sparse_bits(shape: torch.Size, kept: int, element_bits: int) -> int:
    """Bits to send a tensor of `shape` keeping `kept` entries of `element_bits` each."""
    n = shape.numel()
    if kept == 0:
        return 0
    rows = shape[0] if len(shape) > 1 else 1
    values = kept * element_bits
    scheme = storage_scheme(kept / n)
    if scheme == "dense":
        return n * element_bits
    if scheme == "bitmap":
        return n + values
    if scheme == "coo":
        return kept * position_bits(n) + values
    return kept * position_bits(n // rows) + rows * position_bits(kept) + values


def sparse_bytes(shape: torch.Size, kept: int, element_size: int) -> int:
    """`sparse_bits` in whole bytes, for elements of `element_size` bytes."""
    return -(-sparse_bits(shape, kept, 8 * element_size) // 8)
