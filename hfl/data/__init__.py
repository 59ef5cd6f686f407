"""Datasets as in-memory uint8 tensors (images) or token streams (text), client partitions, batched
on-device transforms and text tokenizers.

Datasets and partitioners are declared here with the module that registers each, so that the config
checks their names without importing torch; a module is imported when a run asks for its entry. The
names below (`hfl.data.load_dataset`, ...) are imported on first use, for the same reason.
"""

from __future__ import annotations

import importlib
from typing import Any

from hfl.registry import DATASETS, PARTITIONERS

for _name in ("digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "svhn", "cifar10_jpeg"):
    DATASETS.declare(_name, "hfl.data.datasets")
DATASETS.declare("shakespeare", "hfl.data.tokens")
for _name in ("iid", "dirichlet", "dirichlet_unbalanced", "pathological"):
    PARTITIONERS.declare(_name, "hfl.data.partitioners")

NATURAL = "natural"
"""`data.partition` of a dataset whose clients come with the data: one hfl client per data client."""
NATURAL_CLIENTS = frozenset({"shakespeare"})
"""Datasets whose clients come with the data; they take `data.partition=natural` and no other."""

_LAZY = {
    "ImageDataset": "hfl.data.datasets",
    "SyntheticSpec": "hfl.data.synthetic",
    "load_dataset": "hfl.data.datasets",
    "select_classes": "hfl.data.datasets",
    "default_cache_dir": "hfl.data.cache",
    "default_data_root": "hfl.data.cache",
    "label_histogram": "hfl.data.partitioners",
    "partition": "hfl.data.partitioners",
    "save_label_heatmap": "hfl.data.partitioners",
    "ByteTokenizer": "hfl.data.text",
    "CharTokenizer": "hfl.data.text",
    "make_tokenizer": "hfl.data.text",
    "TokenDataset": "hfl.data.tokens",
    "TokenWindows": "hfl.data.tokens",
    "BatchTransform": "hfl.data.transforms",
}
"""Public names and the module each comes from."""
__all__ = ["NATURAL", "NATURAL_CLIENTS", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hfl.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
