"""CUDA clients train with torch's allocator set to count what tensors hold (`use_expandable_segments`)."""

import os

import pytest
import torch

from hfl.experiment import ALLOCATOR_SETTINGS, use_expandable_segments

MiB = 2**20


@pytest.mark.parametrize("configured_by", [None, *ALLOCATOR_SETTINGS])
def test_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch, configured_by):
    for name in ALLOCATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    if configured_by:
        monkeypatch.setenv(configured_by, "max_split_size_mb:128")
    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    use_expandable_segments()
    assert settings == ([] if configured_by else ["expandable_segments:True"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(any(name in os.environ for name in ALLOCATOR_SETTINGS), reason="the allocator is configured by the user; hfl leaves it")
def test_a_tensor_in_a_larger_cached_block_counts_its_own_size():
    """The allocator's default hands a freed 2 MiB block to a 1.5 MiB request whole (it splits large
    blocks only when more than 1 MiB would remain) and counts 2 MiB: the gap between PreResNet-20's
    measured peak and its estimate on the GPU. With hfl's setting it counts 1.5 MiB."""
    use_expandable_segments()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    first = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    second = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")  # keeps the first block from merging with free memory
    del first
    reuse = torch.empty(3 * MiB // 2, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() - base == second.numel() + reuse.numel()
