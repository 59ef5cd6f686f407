"""The seeded synthetic image dataset (`data.name=synthetic`) for benchmarks and smoke runs: its
shape (`SyntheticSpec`, which every dataset loader takes) and its images (`make_synthetic`).
Loaded through `hfl.data.datasets`, which registers it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

_CHUNK = 2048
"""Samples drawn at a time: bounds memory for large specs; a constant, so that the random stream,
and hence the data, does not depend on the machine."""


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of the seeded synthetic dataset used by benchmarks and smoke runs."""

    num_samples: int = 2000
    """Train plus test samples."""
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    seed: int = 0
    """Seed of the data itself, independent of the experiment seed."""

    def __post_init__(self) -> None:
        if self.num_classes < 2:
            raise ValueError(f"synthetic num_classes={self.num_classes}: need at least 2")
        if self.num_samples < 2 * self.num_classes:
            raise ValueError(f"synthetic num_samples={self.num_samples}: need at least 2 per class ({2 * self.num_classes})")
        if self.image_size < 4 or self.channels < 1:
            raise ValueError(
                f"synthetic image_size={self.image_size}, channels={self.channels}: need image_size >= 4, channels >= 1"
            )


@cache
def generator_digest() -> str:
    """A digest of this module's source: a cached synthetic dataset made by other code is made again."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def make_synthetic(spec: SyntheticSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class shows as a texture and a faint colour cast, under strong pixel noise.

    Each class has a random 5x5 convolution kernel (mixing channels) and a random colour offset.
    A sample is Gaussian noise filtered by its class kernel (a stationary texture, circular at
    the borders, scaled to unit variance per sample), plus the class colour, plus independent
    pixel noise, quantised to uint8. The texture is translation invariant, so CNNs with global
    pooling can learn it; the colour cast alone is weak. On the default spec a nearest-class-mean
    rule gets about 50% on held-out samples and a two-layer CNN about 75% after six epochs:
    learnable, but not trivially.
    """
    rng = np.random.default_rng(spec.seed)
    n, s, ch, k = spec.num_samples, spec.image_size, spec.channels, spec.num_classes
    ks = min(5, s)
    kernels = np.zeros((k, ch, ch, s, s))
    kernels[..., :ks, :ks] = rng.standard_normal((k, ch, ch, ks, ks))
    colours = rng.standard_normal((k, ch, 1, 1))
    labels = rng.permutation(np.arange(n) % k)
    responses = np.fft.rfft2(kernels)
    x = np.empty((n, ch, s, s), dtype=np.uint8)
    for lo in range(0, n, _CHUNK):
        y = labels[lo : lo + _CHUNK]
        # Circular convolution by FFT in float64: float32 arithmetic would flip the odd
        # quantised pixel between machines.
        spectrum = np.fft.rfft2(rng.standard_normal((y.size, ch, s, s), dtype=np.float32).astype(np.float64))
        filtered = np.empty_like(spectrum)
        for c in np.unique(y):
            members = y == c
            filtered[members] = np.einsum("oiuv,niuv->nouv", responses[c], spectrum[members])
        texture = np.fft.irfft2(filtered, s=(s, s))
        texture /= texture.std(axis=(1, 2, 3), keepdims=True)
        noise = rng.standard_normal((y.size, ch, s, s), dtype=np.float32)
        images = 0.5 + 0.02 * colours[y] + 0.08 * texture + 0.25 * noise.astype(np.float64)
        x[lo : lo + y.size] = np.clip(np.rint(images * 255.0), 0, 255)
    return torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))
