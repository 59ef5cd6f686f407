"""Normalisation and augmentation of whole uint8 batches, on the device that trains on them.

Datasets live in memory as uint8 tensors (see `hfl.data.datasets`), so a batch is gathered by
index and transformed here with a handful of tensor ops instead of per-image PIL transforms in
DataLoader workers, which would dominate the cost of training the small models used in FL.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

AUGMENTS = ("none", "flip", "crop_flip")
CROP_PADDING = 4


class BatchTransform:
    """Normalisation and augmentation as batched tensor ops on the training device.

    `augment` is one of "none", "flip" (random horizontal flip) and "crop_flip" (random crop
    from the image zero-padded by 4 pixels, then random horizontal flip), the usual CIFAR recipe.
    Padding is zero in pixel space (black), as torchvision's `RandomCrop(padding=4)` on the
    image followed by `Normalize`, so padded pixels become -mean/std after normalisation.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], augment: str, device: torch.device | str = "cpu") -> None:
        if augment not in AUGMENTS:
            raise ValueError(f"augment={augment!r}: expected one of {', '.join(AUGMENTS)}")
        if len(mean) != len(std) or len(mean) == 0:
            raise ValueError(f"mean ({len(mean)} values) and std ({len(std)} values) need one value per channel")
        if any(s <= 0 for s in std):
            raise ValueError(f"std={tuple(std)}: every channel's std must be positive")
        self.augment = augment
        self.device = torch.device(device)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.padding = CROP_PADDING if augment == "crop_flip" else 0

    def __call__(self, x: torch.Tensor, train: bool, generator: torch.Generator | None = None) -> torch.Tensor:
        """Return float32 (x / 255 - mean) / std, augmented first when `train`.

        `x` is uint8 N x C x H x W on the device. Random draws come from `generator` (a CPU
        generator; its draws are moved to the device), or torch's global generator when None.
        """
        if x.dtype != torch.uint8 or x.dim() != 4:
            raise ValueError(f"BatchTransform expects a uint8 N x C x H x W batch, got {x.dtype} {tuple(x.shape)}")
        if x.shape[1] != self.mean.shape[1]:
            raise ValueError(f"batch has {x.shape[1]} channels but mean/std have {self.mean.shape[1]}")
        if train and self.augment != "none":
            n = x.shape[0]
            offsets = torch.randint(0, 2 * self.padding + 1, (n, 2), generator=generator)
            flips = torch.randint(0, 2, (n, 1), generator=generator)
            # One copy, without waiting: a blocking copy to a GPU waits for all the work queued on it,
            # every batch, so the host could never run ahead of the GPU (the draws are made by then).
            draws = torch.cat([offsets, flips], dim=1).to(x.device, non_blocking=True)
            x = self.crop_flip(x, draws[:, 0], draws[:, 1], draws[:, 2].bool())
        return self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """float32 (x / 255 - mean) / std."""
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return (x.to(torch.float32) / 255.0 - mean) / std

    def crop_flip(self, x: torch.Tensor, offset_y: torch.Tensor, offset_x: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """Crop each sample i of the zero-padded batch at (offset_y[i], offset_x[i]), mirrored where flip[i].

        Offsets range over [0, 2 * padding]; offset == padding is the uncropped image. One gather
        does every sample's crop and flip at once: the flip only reverses the column index.
        """
        n, _, h, w = x.shape
        p = self.padding
        padded = torch.nn.functional.pad(x, (p, p, p, p)) if p else x
        ar_h = torch.arange(h, device=x.device)
        ar_w = torch.arange(w, device=x.device)
        rows = offset_y.view(n, 1) + ar_h  # N x H
        cols = offset_x.view(n, 1) + torch.where(flip.view(n, 1), (w - 1) - ar_w, ar_w)  # N x W
        batch = torch.arange(n, device=x.device).view(n, 1, 1)
        # Advanced indices around a slice put the channel axis last: N x H x W x C.
        out = padded[batch, :, rows.view(n, h, 1), cols.view(n, 1, w)]
        return out.permute(0, 3, 1, 2).contiguous()
