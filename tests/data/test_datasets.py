"""Dataset loaders: shapes, dtypes, fixed splits, caching, and the errors for missing data.

The tests of real datasets read them from `$HFL_DATA` (`tests.conftest.real_data`) and skip with the
reason where it is unset or lacks them; under `HFL_REQUIRE_DATA=1` a missing dataset FAILS its test.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hfl.data import (
    ImageDataset,
    SyntheticSpec,
    default_cache_dir,
    default_data_root,
    load_dataset,
)
from hfl.errors import ConfigError, DataNotFoundError
from hfl.registry import DATASETS
from tests.conftest import cli_env, real_data

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def check_well_formed(ds: ImageDataset) -> None:
    for x, y in ((ds.train_x, ds.train_y), (ds.test_x, ds.test_y)):
        assert x.dtype == torch.uint8 and x.dim() == 4
        assert y.dtype == torch.int64 and y.shape == (x.shape[0],)
        assert int(y.min()) >= 0 and int(y.max()) < ds.num_classes
    assert len(ds.mean) == len(ds.std) == ds.in_channels
    expected_mean = ds.train_x.double().div(255).mean(dim=(0, 2, 3))
    expected_std = ds.train_x.double().div(255).std(dim=(0, 2, 3), unbiased=False)
    np.testing.assert_allclose(ds.mean, expected_mean.numpy(), rtol=1e-9)
    np.testing.assert_allclose(ds.std, expected_std.numpy(), rtol=1e-9)


def test_registry_holds_every_dataset() -> None:
    assert set(DATASETS.names()) == {"digits", "mnist", "fashion_mnist", "cifar10", "cifar100", "svhn", "cifar10_jpeg", "synthetic", "shakespeare"}


def test_digits_shapes_and_fixed_split(tmp_path) -> None:
    ds = load_dataset("digits", str(tmp_path / "root"), str(tmp_path / "cache"))
    check_well_formed(ds)
    assert ds.name == "digits" and ds.num_classes == 10
    assert ds.train_x.shape == (1437, 1, 8, 8) and ds.test_x.shape == (360, 1, 8, 8)
    assert (ds.in_channels, ds.image_size, ds.default_augment) == (1, 8, "none")
    assert int(ds.train_x.max()) == 255  # 16 scaled to 255
    # Stratified: every class appears in the test set in proportion.
    assert ds.test_y.bincount().min() >= 30
    again = load_dataset("digits", str(tmp_path / "other"), str(tmp_path / "cache"))
    assert torch.equal(ds.test_x, again.test_x) and torch.equal(ds.test_y, again.test_y)
    smaller = load_dataset("digits", str(tmp_path), str(tmp_path), test_fraction=0.1)
    assert smaller.test_x.shape[0] == 180
    # Cached once split, so that a process loading digits again (each Ray actor) skips scikit-learn.
    assert (tmp_path / "cache" / "decoded" / "digits.pt").is_file()
    probe = ("import sys; from hfl.data import load_dataset; "
             f"d = load_dataset('digits', '', {str(tmp_path / 'cache')!r}); "
             "assert 'sklearn' not in sys.modules and d.test_x.shape[0] == 360")
    subprocess.run([sys.executable, "-c", probe], check=True, env=cli_env())


def test_synthetic_is_deterministic_and_follows_spec(tmp_path) -> None:
    spec = SyntheticSpec(num_samples=300, image_size=16, channels=2, num_classes=5, seed=3)
    a = load_dataset("synthetic", str(tmp_path), str(tmp_path), synthetic=spec, test_fraction=0.2)
    b = load_dataset("synthetic", str(tmp_path), str(tmp_path / "another cache"), synthetic=spec, test_fraction=0.2)  # made again
    c = load_dataset("synthetic", str(tmp_path), str(tmp_path), synthetic=SyntheticSpec(300, 16, 2, 5, seed=4))
    check_well_formed(a)
    assert a.train_x.shape == (240, 2, 16, 16) and a.test_x.shape == (60, 2, 16, 16)
    assert a.num_classes == 5 and a.default_augment == "none"
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.train_x, c.train_x)
    assert a.train_y.bincount().tolist() == [48] * 5


def test_synthetic_data_is_cached_per_spec_and_split_and_made_again_by_another_generator(tmp_path, monkeypatch) -> None:
    from hfl.data import datasets

    spec = SyntheticSpec(num_samples=300, image_size=16, channels=2, num_classes=5, seed=3)
    made = load_dataset("synthetic", str(tmp_path), str(tmp_path), synthetic=spec, test_fraction=0.2)
    assert (tmp_path / "decoded" / "synthetic_300x2x16_5c_seed3.pt").is_file()

    def make_fails(_spec):
        raise AssertionError("made again")

    monkeypatch.setattr(datasets, "make_synthetic", make_fails)
    cached = load_dataset("synthetic", str(tmp_path), str(tmp_path), synthetic=spec, test_fraction=0.2)
    assert torch.equal(cached.train_x, made.train_x) and torch.equal(cached.test_y, made.test_y)
    for changed in ({"test_fraction": 0.3}, {"synthetic": SyntheticSpec(300, 16, 2, 5, seed=4)}):
        with pytest.raises(AssertionError, match="made again"):
            load_dataset("synthetic", str(tmp_path), str(tmp_path), **{"synthetic": spec, "test_fraction": 0.2, **changed})
    monkeypatch.setattr(datasets, "generator_digest", lambda: "another generator")
    with pytest.raises(AssertionError, match="made again"):
        load_dataset("synthetic", str(tmp_path), str(tmp_path), synthetic=spec, test_fraction=0.2)


def test_synthetic_classes_differ_but_overlap(tmp_path) -> None:
    ds = load_dataset("synthetic", str(tmp_path), str(tmp_path), synthetic=SyntheticSpec(num_samples=1000, image_size=16))
    train, test = ds.train_x.double().div(255).flatten(1), ds.test_x.double().div(255).flatten(1)
    centroids = torch.stack([train[ds.train_y == c].mean(0) for c in range(10)])
    accuracy = (torch.cdist(test, centroids).argmin(1) == ds.test_y).double().mean().item()
    # Above the 10% of chance, yet far from solved by a nearest-class-mean rule (about 30% here).
    assert 0.15 < accuracy < 0.8


def test_class_subset_keeps_those_classes_relabelled_in_the_order_given(tmp_path) -> None:
    full = load_dataset("digits", str(tmp_path), str(tmp_path))
    upper = load_dataset("digits", str(tmp_path), str(tmp_path), classes=[5, 6, 7, 8, 9])
    check_well_formed(upper)  # with the channel statistics of the kept training images
    assert upper.num_classes == 5 and upper.train_y.unique().tolist() == [0, 1, 2, 3, 4]
    for x, y, full_x, full_y in ((upper.train_x, upper.train_y, full.train_x, full.train_y),
                                 (upper.test_x, upper.test_y, full.test_x, full.test_y)):
        kept = full_y >= 5
        assert torch.equal(x, full_x[kept]) and torch.equal(y, full_y[kept] - 5)
    nine_three = load_dataset("digits", str(tmp_path), str(tmp_path), classes=[9, 3])
    kept = (full.test_y == 9) | (full.test_y == 3)
    assert torch.equal(nine_three.test_x, full.test_x[kept])
    assert torch.equal(nine_three.test_y, (full.test_y[kept] == 3).long())  # 9 -> 0, 3 -> 1


@pytest.mark.parametrize("classes", [[3, 10], [4, 4], [7]])
def test_class_subset_refuses_ids_the_dataset_lacks(tmp_path, classes) -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset("digits", str(tmp_path), str(tmp_path), classes=classes)
    assert (info.value.field, info.value.value) == ("data.classes", classes)
    assert "digits" in info.value.allowed and "0..9" in info.value.allowed


def test_class_subset_in_the_config_sizes_the_data_and_the_model() -> None:
    from hfl.backends.base import ClientEnvironment
    from hfl.config import DataConfig
    from tests.conftest import small_config

    for bad in ((2,), (1, 1), (-1, 2)):
        with pytest.raises(ConfigError, match="^classes="):
            DataConfig(classes=bad)
    env = ClientEnvironment.from_config(small_config(data={"classes": [5, 6, 7, 8, 9]}))
    assert env.data.num_classes == 5 and sorted(env.train_y.unique().tolist()) == [0, 1, 2, 3, 4]
    assert env.method.model(env.test_x[:2]).shape == (2, 5)
    with pytest.raises(ConfigError, match="^data.classes="):
        ClientEnvironment.from_config(small_config(data={"classes": [5, 10]}))


def test_default_paths_follow_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HFL_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HFL_CACHE", str(tmp_path / "cache"))
    assert (default_data_root(), default_cache_dir()) == (str(tmp_path / "data"), str(tmp_path / "cache"))
    monkeypatch.delenv("HFL_DATA")
    monkeypatch.delenv("HFL_CACHE")
    assert default_data_root() == default_cache_dir() == os.path.expanduser("~/.cache/hfl")


def test_unknown_name_and_bad_fraction(tmp_path) -> None:
    with pytest.raises(ConfigError, match="data.name"):
        load_dataset("imagenet", str(tmp_path), str(tmp_path))
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("digits", str(tmp_path), str(tmp_path), test_fraction=1.0)


def test_missing_mnist_names_the_paths(tmp_path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    with pytest.raises(DataNotFoundError) as info:
        load_dataset("mnist", str(root), str(cache))
    msg = str(info.value)
    assert str(root / "mnist" / "MNIST" / "raw") in msg
    assert str(cache / "mnist" / "MNIST" / "raw") in msg
    assert "train-images-idx3-ubyte" in msg and "t10k-labels-idx1-ubyte" in msg
    assert "HFL_DATA" in msg and "data.download=true" in msg
    assert not root.exists(), "a failed load must not create the data root"


def test_missing_cifar10_jpeg_names_the_zip(tmp_path) -> None:
    root = tmp_path / "root"
    with pytest.raises(DataNotFoundError) as info:
        load_dataset("cifar10_jpeg", str(root), str(tmp_path / "cache"))
    msg = str(info.value)
    assert str(root / "cifar10_jpeg" / "cifar10-jpeg.zip") in msg
    assert "train/<class>/<NNNN>.jpg" in msg and "HFL_DATA" in msg


def test_missing_cifar10_names_the_folder(tmp_path) -> None:
    root = tmp_path / "root"
    with pytest.raises(DataNotFoundError) as info:
        load_dataset("cifar10", str(root), str(tmp_path / "cache"))
    msg = str(info.value)
    assert str(root / "cifar10") in msg and "data_batch_1" in msg and "data.download=true" in msg


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """An MNIST idx file: magic (0, 0, uint8 code 8, ndim), big-endian dims, then the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def fake_mnist(root: Path, n_train: int = 50, n_test: int = 20) -> None:
    rng = np.random.default_rng(0)
    raw = root / "mnist" / "MNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (n_train, 28, 28)), gz=True)
    write_idx(raw / "train-labels-idx1-ubyte", np.arange(n_train) % 10, gz=True)
    write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 28, 28)), gz=True)
    write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(n_test) % 10, gz=True)


def test_mnist_gz_only_root_is_decompressed_into_the_cache(tmp_path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    fake_mnist(root)
    os.chmod(root / "mnist" / "MNIST" / "raw", 0o555)  # the shared data folder is read-only
    try:
        ds = load_dataset("mnist", str(root), str(cache))
    finally:
        os.chmod(root / "mnist" / "MNIST" / "raw", 0o755)
    check_well_formed(ds)
    assert ds.train_x.shape == (50, 1, 28, 28) and ds.test_x.shape == (20, 1, 28, 28)
    assert sorted(p.name for p in (root / "mnist" / "MNIST" / "raw").iterdir()) == sorted(f"{f}.gz" for f in MNIST_FILES)
    assert all((cache / "mnist" / "MNIST" / "raw" / f).is_file() for f in MNIST_FILES)
    assert (cache / "decoded" / "mnist.pt").is_file()
    assert not list((cache / "decoded").glob("*.tmp")), "the temp file is renamed into place"

    # The decoded cache alone serves a second load, even once the source is gone.
    shutil.rmtree(root)
    shutil.rmtree(cache / "mnist")
    again = load_dataset("mnist", str(root), str(cache))
    assert torch.equal(ds.train_x, again.train_x) and torch.equal(ds.test_y, again.test_y)


def test_unreadable_cache_is_rebuilt(tmp_path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    fake_mnist(root)
    (cache / "decoded").mkdir(parents=True)
    (cache / "decoded" / "mnist.pt").write_bytes(b"not a torch file")
    ds = load_dataset("mnist", str(root), str(cache))
    assert ds.train_x.shape[0] == 50
    assert load_dataset("mnist", str(root), str(cache)).train_x.shape[0] == 50


def test_real_mnist_from_shared_folder(tmp_path) -> None:
    real_data("mnist", "MNIST", "raw")
    root = os.environ["HFL_DATA"]
    cache = tmp_path / "cache"
    ds = load_dataset("mnist", str(root), str(cache))
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_y.bincount().tolist()[:2] == [5923, 6742]
    assert ds.mean[0] == pytest.approx(0.1307, abs=1e-4) and ds.std[0] == pytest.approx(0.3081, abs=1e-4)
    cached = cache / "decoded" / "mnist.pt"
    stamp = cached.stat().st_mtime_ns
    again = load_dataset("mnist", str(root), str(cache))
    assert cached.stat().st_mtime_ns == stamp, "the second load reads the cache, it does not rewrite it"
    assert torch.equal(again.train_x, ds.train_x)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")  # torchvision warns once per image
def test_real_cifar10_jpeg_from_shared_folder(tmp_path) -> None:
    """The dataset behind every RESULTS table: sizes, classes, images in the zip's order decoded as
    PIL decodes them, the label counts, and the normalisation statistics."""
    import io
    import zipfile

    from PIL import Image

    from hfl.data import BatchTransform

    archive = real_data("cifar10_jpeg", "cifar10-jpeg.zip")
    ds = load_dataset("cifar10_jpeg", os.environ["HFL_DATA"], str(tmp_path / "cache"))
    check_well_formed(ds)
    assert ds.train_x.shape == (50000, 3, 32, 32) and ds.test_x.shape == (10000, 3, 32, 32)
    assert (ds.num_classes, ds.in_channels, ds.image_size, ds.default_augment) == (10, 3, 32, "crop_flip")
    assert ds.train_y.bincount().tolist() == [5000] * 10 and ds.test_y.bincount().tolist() == [1000] * 10
    # Sorted by class (airplane ... truck), then by file number: the i-th image of a split is known.
    with zipfile.ZipFile(archive) as zf:
        for x, y, index, member in [(ds.train_x, ds.train_y, 0, "train/airplane/0000.jpg"),
                                    (ds.train_x, ds.train_y, 5000 * 3 + 17, "train/cat/0017.jpg"),
                                    (ds.train_x, ds.train_y, 49999, "train/truck/4999.jpg"),
                                    (ds.test_x, ds.test_y, 9999, "test/truck/0999.jpg")]:
            pil = np.asarray(Image.open(io.BytesIO(zf.read(member))).convert("RGB"))
            assert torch.equal(x[index], torch.from_numpy(pil.copy()).permute(2, 0, 1)), member
            assert int(y[index]) == index // (5000 if x is ds.train_x else 1000), member
    # CIFAR-10's usual statistics, shifted a little by the JPEG encoding.
    np.testing.assert_allclose(ds.mean, (0.49125, 0.48209, 0.44652), atol=1e-5)
    np.testing.assert_allclose(ds.std, (0.24523, 0.24278, 0.26063), atol=1e-5)
    np.testing.assert_allclose(ds.mean, (0.4914, 0.4822, 0.4465), atol=2e-3)
    normalised = BatchTransform(ds.mean, ds.std, "none")(ds.test_x[:4], train=False)
    expected = (ds.test_x[:4].double() / 255 - torch.tensor(ds.mean).view(1, 3, 1, 1)) / torch.tensor(ds.std).view(1, 3, 1, 1)
    torch.testing.assert_close(normalised, expected.float())
