"""Image classification datasets as whole uint8 tensors, decoded once and cached.

Every loader returns an `ImageDataset` holding all images in memory as uint8 N x C x H x W tensors:
the datasets used here are small (CIFAR-10 is 150 MB as uint8), and keeping them whole lets a
client's batches be gathered by index and augmented on the training device (`BatchTransform`)
instead of going through a per-sample `DataLoader`.

Real datasets are decoded once and cached as one file, `<cache_dir>/decoded/<name>.pt`. The data
root is only read, never written, unless the caller passes `download=True` (torchvision then
downloads into `<root>/<name>`).
"""

from __future__ import annotations

import gzip
import logging
import re
import shutil
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol

import numpy as np
import torch

from hfl.data.cache import cached_blob, decoded_path
from hfl.data.synthetic import SyntheticSpec, generator_digest, make_synthetic
from hfl.errors import ConfigError, DataNotFoundError
from hfl.registry import DATASETS
from hfl.storage import atomic_write

if TYPE_CHECKING:
    from hfl.data.tokens import TokenDataset

logger = logging.getLogger(__name__)

# Bump when the layout of the decoded cache file changes, so stale caches are rebuilt.
# The experiment seed must not move the digits test set: results across seeds would then be
# measured on different test samples.
_DIGITS_SPLIT_SEED = 0
_CROP_FLIP = ("cifar10", "cifar100", "cifar10_jpeg", "svhn")
# What a decoder returns: train_x, train_y, test_x, test_y, num_classes.
Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]
_FIX_ROOT = "set data.root (or the environment variable HFL_DATA) to the folder that holds it"


@dataclass
class ImageDataset:
    """A labelled image dataset with its official (or fixed-seed) train/test split."""

    name: str
    train_x: torch.Tensor
    """uint8, N x C x H x W."""
    train_y: torch.Tensor
    """int64, N."""
    test_x: torch.Tensor
    """uint8, M x C x H x W."""
    test_y: torch.Tensor
    """int64, M."""
    num_classes: int
    mean: tuple[float, ...]
    """Per-channel mean of train_x / 255."""
    std: tuple[float, ...]
    """Per-channel standard deviation of train_x / 255."""
    default_augment: str
    """Augmentation that suits the dataset: "crop_flip" for natural 32x32 images, else "none"."""

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.dtype != torch.uint8 or x.dim() != 4:
                raise ValueError(f"{self.name}: {split}_x must be uint8 N x C x H x W, got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"{self.name}: {split}_y must be int64 of length {x.shape[0]}, got {y.dtype} {tuple(y.shape)}")

    input_kind: ClassVar[str] = "images"
    """What a model must read for this dataset (`ScalableModel.input_kind`)."""

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape as a model reads it: C x H x W."""
        return tuple(self.train_x.shape[1:])

    @property
    def input_dtype(self) -> torch.dtype:
        """What a model reads: float32, the images normalised (`BatchTransform`)."""
        return torch.float32

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])


class DatasetLoader(Protocol):
    """What `@DATASETS.register` expects: every loader takes the same keyword arguments (each uses
    those that apply to it) and returns an `ImageDataset` or, for text, a `TokenDataset`."""

    def __call__(
        self, *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
    ) -> ImageDataset | TokenDataset: ...


def load_dataset(
    name: str,
    root: str,
    cache_dir: str,
    download: bool = False,
    *,
    test_fraction: float = 0.2,
    synthetic: SyntheticSpec | None = None,
    classes: Sequence[int] = (),
    seq_len: int = 80,
    stride: int = 1,
) -> ImageDataset | TokenDataset:
    """Load dataset `name` from `root`, using and filling the decoded cache in `cache_dir`.

    `test_fraction` only matters for datasets without an official test split (digits, synthetic);
    `synthetic` only for the synthetic dataset (None means `SyntheticSpec()`); `classes`, when
    given, keeps only those classes of an image dataset (see `select_classes`); `seq_len` only for
    text (`hfl.data.tokens`): tokens per sample; `stride` only for text: tokens between windows' starts.
    Raises `DataNotFoundError` naming the paths looked in when the data is not there.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction}: must lie strictly between 0 and 1")
    loader: DatasetLoader = DATASETS.get(name, field="data.name")
    data = loader(root=root, cache_dir=cache_dir, download=download, test_fraction=test_fraction, synthetic=synthetic, seq_len=seq_len)
    if classes and not isinstance(data, ImageDataset):
        raise ConfigError("data.classes", list(classes), f"empty for {name}: its samples are token windows, with no class to select")
    if stride != 1 and not isinstance(data, ImageDataset):
        return replace(data, stride=stride)
    return select_classes(data, classes) if classes else data


def select_classes(data: ImageDataset, classes: Sequence[int]) -> ImageDataset:
    """`data` with only the samples of `classes`, in train and test, relabelled so that class
    `classes[i]` becomes label i; `num_classes` is then `len(classes)` and the channel statistics
    are those of the kept training images."""
    ids = [int(c) for c in classes]
    if len(ids) < 2 or len(set(ids)) != len(ids) or not all(0 <= c < data.num_classes for c in ids):
        raise ConfigError("data.classes", ids,
                          f"at least two distinct class ids of {data.name}, each in 0..{data.num_classes - 1} (empty: every class)")
    new_label = torch.full((data.num_classes,), -1, dtype=torch.int64)
    new_label[torch.tensor(ids)] = torch.arange(len(ids))

    def keep(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = new_label[y]
        kept = y >= 0
        return x[kept], y[kept]

    return _make(data.name, *keep(data.train_x, data.train_y), *keep(data.test_x, data.test_y), len(ids))


# --------------------------------------------------------------------------------------------
# Shared helpers


def _channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std of x / 255, from a 256-bin histogram per channel.

    A histogram avoids materialising a float copy of the whole dataset (600 MB for CIFAR-10).
    """
    values = torch.arange(256, dtype=torch.float64) / 255.0
    means, stds = [], []
    for c in range(x.shape[1]):
        counts = torch.bincount(x[:, c].reshape(-1), minlength=256).to(torch.float64)
        total = counts.sum()
        mean = (counts * values).sum() / total
        var = (counts * (values - mean) ** 2).sum() / total
        means.append(float(mean))
        stds.append(float(var.sqrt()))
    return tuple(means), tuple(stds)


def _make(
    name: str, train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor, num_classes: int
) -> ImageDataset:
    mean, std = _channel_stats(train_x)
    return ImageDataset(
        name=name,
        train_x=train_x.contiguous(),
        train_y=train_y.to(torch.int64).contiguous(),
        test_x=test_x.contiguous(),
        test_y=test_y.to(torch.int64).contiguous(),
        num_classes=num_classes,
        mean=mean,
        std=std,
        default_augment="crop_flip" if name in _CROP_FLIP else "none",
    )


def _cached(name: str, cache_dir: str, decode: Callable[[], Decoded]) -> ImageDataset:
    """Return dataset `name` from its decoded cache file, decoding and caching it first if needed."""

    def build() -> dict[str, Any]:
        train_x, train_y, test_x, test_y, num_classes = decode()
        return {"train_x": train_x.contiguous(), "train_y": train_y.to(torch.int64), "test_x": test_x.contiguous(),
                "test_y": test_y.to(torch.int64), "num_classes": num_classes}

    blob = cached_blob(decoded_path(cache_dir, name), name, build)
    return _make(name, blob["train_x"], blob["train_y"], blob["test_x"], blob["test_y"], int(blob["num_classes"]))


def _stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    try:
        train_idx, test_idx = train_test_split(idx, test_size=test_fraction, stratify=y, random_state=seed)
    except ValueError:  # a side would miss a class
        classes = len(np.unique(y))
        raise ConfigError("data.test_fraction", test_fraction,
                          f"a share leaving each of the training and test sets at least one sample of each of the {classes} classes ({len(y)} samples)") from None
    # Sorted so that the split, not sklearn's shuffling, is what the caller depends on.
    return np.sort(train_idx), np.sort(test_idx)


# --------------------------------------------------------------------------------------------
# Small datasets generated or shipped in a wheel: cheap to build, so not cached on disk (but for
# digits, whose split needs scikit-learn; see its loader).


@DATASETS.register("digits")
def _load_digits(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    """scikit-learn's 1,797 8x8 digits, split with a fixed seed (not the experiment seed). Cached
    once split, although cheap to build: building imports scikit-learn, which costs each process
    that loads digits (every Ray actor) about 140 MiB and a second."""

    def build() -> dict[str, Any]:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        # Pixel values are 0..16; scale to the 0..255 range every other dataset uses.
        images = torch.from_numpy(np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None])
        labels = torch.from_numpy(bunch.target.astype(np.int64))
        train_idx, test_idx = _stratified_split(labels.numpy(), test_fraction, _DIGITS_SPLIT_SEED)
        return {"train_x": images[train_idx], "train_y": labels[train_idx], "test_x": images[test_idx], "test_y": labels[test_idx],
                "test_fraction": test_fraction}

    blob = cached_blob(decoded_path(cache_dir, "digits"), "digits", build, lambda blob: blob.get("test_fraction") == test_fraction)
    return _make("digits", blob["train_x"], blob["train_y"], blob["test_x"], blob["test_y"], 10)


@DATASETS.register("synthetic")
def _load_synthetic(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    """Seeded class-conditional images; see `make_synthetic`. Cached once split, as digits are:
    making the default 2,000 images costs half a CPU-second, each process that loads them."""
    spec = synthetic or SyntheticSpec()
    made_by = generator_digest()

    def build() -> dict[str, Any]:
        x, y = make_synthetic(spec)
        train_idx, test_idx = _stratified_split(y.numpy(), test_fraction, spec.seed)
        return {"train_x": x[train_idx], "train_y": y[train_idx], "test_x": x[test_idx], "test_y": y[test_idx],
                "test_fraction": test_fraction, "made_by": made_by}

    name = f"synthetic_{spec.num_samples}x{spec.channels}x{spec.image_size}_{spec.num_classes}c_seed{spec.seed}"
    blob = cached_blob(decoded_path(cache_dir, name), name, build,
                       lambda blob: blob.get("test_fraction") == test_fraction and blob.get("made_by") == made_by)
    return _make("synthetic", blob["train_x"], blob["train_y"], blob["test_x"], blob["test_y"], spec.num_classes)


# --------------------------------------------------------------------------------------------
# MNIST-style datasets (torchvision layout; the .gz files are decompressed into the cache)

_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _mnist_like(name: str, cls_name: str, root: str, cache_dir: str, download: bool) -> ImageDataset:
    from torchvision import datasets as tvd

    tv_cls = getattr(tvd, cls_name)

    def decode() -> Decoded:
        tv_root = _mnist_root(name, cls_name, root, cache_dir, download)
        try:
            train = tv_cls(tv_root, train=True, download=download)
            test = tv_cls(tv_root, train=False, download=download)
        except (RuntimeError, OSError) as err:  # torchvision's "not found" and failed downloads
            raise _mnist_missing(name, cls_name, root, cache_dir, download, cause=err) from err
        return train.data.unsqueeze(1), train.targets, test.data.unsqueeze(1), test.targets, 10

    return _cached(name, cache_dir, decode)


def _mnist_root(name: str, cls_name: str, root: str, cache_dir: str, download: bool) -> str:
    """The torchvision root to load from, decompressing the .gz files into the cache when needed.

    torchvision (download=False) only accepts the decompressed files, and the data root may be
    read-only, so .gz-only folders are decompressed into `<cache_dir>/<name>/<Cls>/raw/`.
    """
    src_root = Path(root) / name
    src_raw = src_root / cls_name / "raw"
    dst_root = Path(cache_dir) / name
    dst_raw = dst_root / cls_name / "raw"
    for candidate_root, raw in ((src_root, src_raw), (dst_root, dst_raw)):
        if all((raw / f).is_file() for f in _MNIST_FILES):
            return str(candidate_root)
    if all((src_raw / f"{f}.gz").is_file() for f in _MNIST_FILES):
        dst_raw.mkdir(parents=True, exist_ok=True)
        for f in _MNIST_FILES:
            def gunzip(fout: BinaryIO, f: str = f) -> None:
                with gzip.open(src_raw / f"{f}.gz", "rb") as fin:
                    shutil.copyfileobj(fin, fout, length=1 << 20)

            atomic_write(dst_raw / f, gunzip)
        logger.info("decompressed %s/*.gz into %s", src_raw, dst_raw)
        return str(dst_root)
    if download:
        return str(src_root)
    raise _mnist_missing(name, cls_name, root, cache_dir, download)


def _mnist_missing(
    name: str, cls_name: str, root: str, cache_dir: str, download: bool, cause: Exception | None = None
) -> DataNotFoundError:
    src_raw = Path(root) / name / cls_name / "raw"
    dst_raw = Path(cache_dir) / name / cls_name / "raw"
    files = ", ".join(_MNIST_FILES)
    msg = (
        f"{name} not found. Looked in {src_raw} (for {files}, or the same names with .gz) "
        f"and in {dst_raw} (decompressed copies). Expected layout: <data.root>/{name}/{cls_name}/raw/<file>[.gz]. "
        f"Fix: {_FIX_ROOT}, or set data.download=true to let torchvision download it into {Path(root) / name}."
    )
    if cause is not None:
        msg += f" ({'download' if download else 'torchvision'} said: {cause})"
    return DataNotFoundError(msg)


@DATASETS.register("mnist")
def _load_mnist(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    return _mnist_like("mnist", "MNIST", root, cache_dir, download)


@DATASETS.register("fashion_mnist")
def _load_fashion_mnist(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    return _mnist_like("fashion_mnist", "FashionMNIST", root, cache_dir, download)


# --------------------------------------------------------------------------------------------
# CIFAR and SVHN through torchvision


def _torchvision_missing(name: str, folder: Path, layout: str, err: Exception, download: bool) -> DataNotFoundError:
    return DataNotFoundError(
        f"{name} not found or incomplete in {folder}. Expected layout: {layout}. "
        f"Fix: {_FIX_ROOT}, or set data.download=true to let torchvision download it into {folder}. "
        f"({'download' if download else 'torchvision'} said: {err})"
    )


def _cifar(name: str, cls_name: str, root: str, cache_dir: str, download: bool) -> ImageDataset:
    from torchvision import datasets as tvd

    tv_cls = getattr(tvd, cls_name)
    folder = Path(root) / name

    def decode() -> Decoded:
        try:
            train = tv_cls(str(folder), train=True, download=download)
            test = tv_cls(str(folder), train=False, download=download)
        except (RuntimeError, OSError) as err:
            files = ", ".join(f for f, _ in tv_cls.train_list + tv_cls.test_list)
            layout = f"{folder}/{tv_cls.base_folder}/{{{files}, {tv_cls.meta['filename']}}}"
            raise _torchvision_missing(name, folder, layout, err, download) from err

        def as_tensors(ds: object) -> tuple[torch.Tensor, torch.Tensor]:
            # torchvision keeps CIFAR as N x H x W x C numpy; hfl wants N x C x H x W.
            x = torch.from_numpy(np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)))
            return x, torch.as_tensor(ds.targets, dtype=torch.int64)

        return (*as_tensors(train), *as_tensors(test), len(train.classes))

    return _cached(name, cache_dir, decode)


@DATASETS.register("cifar10")
def _load_cifar10(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    return _cifar("cifar10", "CIFAR10", root, cache_dir, download)


@DATASETS.register("cifar100")
def _load_cifar100(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    return _cifar("cifar100", "CIFAR100", root, cache_dir, download)


@DATASETS.register("svhn")
def _load_svhn(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    from torchvision.datasets import SVHN

    folder = Path(root) / "svhn"

    def decode() -> Decoded:
        try:
            train = SVHN(str(folder), split="train", download=download)
            test = SVHN(str(folder), split="test", download=download)
        except (RuntimeError, OSError) as err:
            layout = f"{folder}/{{{SVHN.split_list['train'][1]}, {SVHN.split_list['test'][1]}}}"
            raise _torchvision_missing("svhn", folder, layout, err, download) from err
        # torchvision already maps SVHN's label 10 to digit 0 and stores N x C x H x W.
        return (
            torch.from_numpy(np.ascontiguousarray(train.data)),
            torch.from_numpy(train.labels.astype(np.int64)),
            torch.from_numpy(np.ascontiguousarray(test.data)),
            torch.from_numpy(test.labels.astype(np.int64)),
            10,
        )

    return _cached("svhn", cache_dir, decode)


# --------------------------------------------------------------------------------------------
# CIFAR-10 re-encoded as JPEG (ImageFolder layout inside a zip)

_JPEG_ZIP = "cifar10-jpeg.zip"
# Any leading folder inside the zip is tolerated; then split/class/file.
_JPEG_MEMBER = re.compile(r"(?:^|/)(train|test)/([^/]+)/([^/]+)\.jpe?g$", re.IGNORECASE)
_CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@DATASETS.register("cifar10_jpeg")
def _load_cifar10_jpeg(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> ImageDataset:
    """CIFAR-10 from a zip of JPEGs; pixels differ from the official files by about 5-7/255 (JPEG)."""
    path = Path(root) / "cifar10_jpeg" / _JPEG_ZIP

    def decode() -> Decoded:
        if not path.is_file():
            raise DataNotFoundError(
                f"cifar10_jpeg not found: looked for {path}. Expected layout: <data.root>/cifar10_jpeg/{_JPEG_ZIP}, "
                "a zip holding train/<class>/<NNNN>.jpg and test/<class>/<NNNN>.jpg (32x32 RGB, classes "
                f"{', '.join(_CIFAR10_CLASSES)}). Fix: {_FIX_ROOT}. This dataset cannot be downloaded by hfl "
                "(data.download does not apply)."
            )
        try:
            return _decode_jpeg_zip(path)
        except zipfile.BadZipFile as err:
            raise DataNotFoundError(f"{path} is not a readable zip ({err}); replace it with a complete copy") from err

    return _cached("cifar10_jpeg", cache_dir, decode)


def _decode_jpeg_zip(path: Path) -> Decoded:
    # torchvision's libjpeg decoder gives PIL's pixels exactly (checked on all 60,000 images) in a
    # fifth of the time.
    from torchvision.io import ImageReadMode, decode_jpeg

    with zipfile.ZipFile(path) as zf:
        members: dict[str, list[tuple[str, str, str]]] = {"train": [], "test": []}
        for member in zf.namelist():
            m = _JPEG_MEMBER.search(member)
            if m:
                members[m.group(1).lower()].append((m.group(2), m.group(3), member))
        classes = sorted({cls for split in members.values() for cls, _, _ in split})
        if not members["train"] or not members["test"]:
            raise DataNotFoundError(f"{path} holds no train/<class>/*.jpg or no test/<class>/*.jpg images")
        if len(classes) != len(_CIFAR10_CLASSES):
            logger.warning("%s has %d classes (%s); expected the 10 CIFAR-10 classes", path, len(classes), classes)
        class_index = {cls: i for i, cls in enumerate(classes)}

        def stem_key(stem: str) -> tuple[int, int | str]:
            # Numeric file names sort numerically (batch order); anything else sorts as text after.
            return (0, int(stem)) if stem.isdigit() else (1, stem)

        out = []
        for split in ("train", "test"):
            entries = sorted(members[split], key=lambda e: (class_index[e[0]], stem_key(e[1])))
            images = np.empty((len(entries), 32, 32, 3), dtype=np.uint8)
            for i, (_, _, member) in enumerate(entries):
                encoded = torch.frombuffer(bytearray(zf.read(member)), dtype=torch.uint8)
                arr = decode_jpeg(encoded, mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()
                if arr.shape != (32, 32, 3):
                    raise ValueError(f"{path}:{member} is {arr.shape[1]}x{arr.shape[0]}, expected 32x32 RGB")
                images[i] = arr
            labels = np.fromiter((class_index[cls] for cls, _, _ in entries), dtype=np.int64, count=len(entries))
            out += [torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))), torch.from_numpy(labels)]
    return out[0], out[1], out[2], out[3], len(classes)
