"""Sparse storage of masked tensors (FedMef's appendix §7.1), by hand."""

import pytest
import torch

from hfl.accounting.cost import tensor_bytes
from hfl.accounting.storage import sparse_bytes, storage_scheme


@pytest.mark.parametrize(
    "density, scheme", [(1.0, "dense"), (0.9, "dense"), (0.89, "bitmap"), (0.3, "bitmap"), (0.29, "coo"), (0.1, "coo"), (0.09, "csr"), (0.0, "csr")]
)
def test_scheme_boundaries(density, scheme):
    assert storage_scheme(density) == scheme


def mask(shape, kept):
    out = torch.zeros(shape, dtype=torch.bool).flatten()
    out[:kept] = True
    return out.view(shape)


@pytest.mark.parametrize(
    "shape, kept, expected",
    [
        ((10, 10), 95, 400),  # dense: 100 · 4 bytes
        ((10, 10), 50, 213),  # bitmap: 100 bits + 50 · 32 bits = 1700 bits → 212.5 → 213 bytes
        ((10, 10), 20, 98),  # coo: 20 · ⌈log₂ 100⌉ = 140 bits + 640 bits = 780 bits → 97.5 → 98
        ((10, 10), 5, 27),  # csr: 5 · ⌈log₂ 10⌉ + 10 · ⌈log₂ 5⌉ + 5 · 32 = 20 + 30 + 160 = 210 bits → 27
        ((4, 2, 3, 3), 1, 5),  # csr on 4 × 18: 1 · ⌈log₂ 18⌉ + 4 · ⌈log₂ 1⌉ + 32 = 37 bits → 5
        ((100,), 5, 25),  # a vector is one row: csr, 5 · 7 + 1 · 3 + 160 = 198 bits → 25
        ((10, 10), 0, 0),
    ],
)
def test_bytes_by_hand(shape, kept, expected):
    assert tensor_bytes({"w": torch.zeros(shape)}, {"w": mask(shape, kept)}) == expected
    assert sparse_bytes(torch.Size(shape), kept, 4) == expected


def test_unmasked_tensors_are_dense():
    assert tensor_bytes({"w": torch.zeros(3, 5, dtype=torch.float16)}) == 30
