"""BatchTransform: exact normalisation, eval path without randomness, vectorised crop and flip."""

from __future__ import annotations

import pytest
import torch

from hfl.data import BatchTransform

MEAN, STD = (0.5, 0.25, 0.125), (0.5, 0.25, 0.2)


def batch(n: int = 8, c: int = 3, size: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, c, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_normalisation_is_exact_on_known_values() -> None:
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2).contiguous()
    out = BatchTransform(MEAN, STD, "none")(x, train=False)
    assert out.dtype == torch.float32 and out.shape == x.shape
    expected = torch.tensor([(0.0 - 0.5) / 0.5, (0.2 - 0.25) / 0.25, (1.0 - 0.125) / 0.2]).view(1, 3, 1, 1).expand_as(out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_none_augment_trains_as_it_evaluates() -> None:
    t = BatchTransform(MEAN, STD, "none")
    x = batch()
    assert torch.equal(t(x, train=True, generator=torch.Generator().manual_seed(1)), t(x, train=False))


@pytest.mark.parametrize("augment", ["flip", "crop_flip"])
def test_eval_never_augments(augment: str) -> None:
    x = batch()
    assert torch.equal(BatchTransform(MEAN, STD, augment)(x, train=False), BatchTransform(MEAN, STD, "none")(x, train=False))


def test_crop_flip_keeps_shape_and_is_deterministic_given_a_generator() -> None:
    t = BatchTransform(MEAN, STD, "crop_flip")
    x = batch(n=64, size=8)
    a = t(x, train=True, generator=torch.Generator().manual_seed(5))
    b = t(x, train=True, generator=torch.Generator().manual_seed(5))
    c = t(x, train=True, generator=torch.Generator().manual_seed(6))
    assert a.shape == x.shape and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, t(x, train=False)), "64 samples are not all left in place"


def test_each_sample_takes_the_generators_next_offsets_then_flips() -> None:
    # The draws' order is part of every recorded run: two offsets a sample, then a flip a sample.
    t = BatchTransform(MEAN, STD, "crop_flip")
    x = batch(n=16, size=8)
    gen = torch.Generator().manual_seed(3)
    offsets, flips = torch.randint(0, 2 * t.padding + 1, (16, 2), generator=gen), torch.randint(0, 2, (16,), generator=gen).bool()
    expected = t.normalize(t.crop_flip(x, offsets[:, 0], offsets[:, 1], flips))
    assert torch.equal(t(x, train=True, generator=torch.Generator().manual_seed(3)), expected)


def test_flip_only_case_equals_mirroring() -> None:
    t = BatchTransform(MEAN, STD, "crop_flip")
    x = batch()
    centre = torch.full((x.shape[0],), t.padding)  # offset == padding: no shift
    flipped = t.crop_flip(x, centre, centre, torch.ones(x.shape[0], dtype=torch.bool))
    assert torch.equal(flipped, x.flip(3))
    kept = t.crop_flip(x, centre, centre, torch.zeros(x.shape[0], dtype=torch.bool))
    assert torch.equal(kept, x)


def test_crop_offsets_shift_in_zero_padding() -> None:
    t = BatchTransform(MEAN, STD, "crop_flip")
    x = batch(n=2, size=6)
    no_flip = torch.zeros(2, dtype=torch.bool)
    # Offset 0 takes the top-left corner of the padded image: content moves down/right by 4.
    out = t.crop_flip(x, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), no_flip)
    assert torch.equal(out[:, :, 4:, 4:], x[:, :, :2, :2])
    assert int(out[:, :, :4].abs().sum()) == 0 and int(out[:, :, :, :4].abs().sum()) == 0
    # Per-sample offsets: sample 0 moves up by 1, sample 1 left by 2.
    out = t.crop_flip(x, torch.tensor([5, 4]), torch.tensor([4, 6]), no_flip)
    assert torch.equal(out[0, :, :5], x[0, :, 1:]) and int(out[0, :, 5:].sum()) == 0
    assert torch.equal(out[1, :, :, :4], x[1, :, :, 2:]) and int(out[1, :, :, 4:].sum()) == 0


def test_flip_augment_mirrors_some_samples_and_keeps_the_rest() -> None:
    t = BatchTransform(MEAN, STD, "flip")
    x = batch(n=64)
    out = t(x, train=True, generator=torch.Generator().manual_seed(0))
    plain, mirrored = t(x, train=False), t(x.flip(3), train=False)
    same = (out == plain).flatten(1).all(1)
    flipped = (out == mirrored).flatten(1).all(1)
    assert torch.all(same | flipped)
    assert same.any() and flipped.any()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="augment"):
        BatchTransform(MEAN, STD, "rotate")
    with pytest.raises(ValueError, match="std"):
        BatchTransform((0.5,), (0.0,), "none")
    with pytest.raises(ValueError, match="uint8"):
        BatchTransform(MEAN, STD, "none")(batch().float(), train=False)
    with pytest.raises(ValueError, match="channels"):
        BatchTransform((0.5,), (0.5,), "none")(batch(), train=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    x = batch(n=32, size=8)
    cpu = BatchTransform(MEAN, STD, "crop_flip")(x, train=True, generator=torch.Generator().manual_seed(2))
    gpu = BatchTransform(MEAN, STD, "crop_flip", device="cuda")(x.cuda(), train=True, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(gpu.cpu(), cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_augmenting_on_cuda_does_not_wait_for_the_gpu() -> None:
    # A blocking copy of the draws would synchronise with every kernel queued before it, each batch.
    t = BatchTransform(MEAN, STD, "crop_flip", device="cuda")
    x = batch(n=32, size=8).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t(x, train=True, generator=torch.Generator().manual_seed(2))
    finally:
        torch.cuda.set_sync_debug_mode("default")
