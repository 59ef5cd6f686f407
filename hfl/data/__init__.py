"""Datasets as in-memory uint8 tensors (images) or token streams (text), client partitions, batched
on-device transforms and text tokenizers."""

# Imported explicitly (not scanned) so that DATASETS and PARTITIONERS are filled on import.
from hfl.data import datasets, partitioners, tokens  # noqa: F401
from hfl.data.datasets import (
    ImageDataset,
    SyntheticSpec,
    default_cache_dir,
    default_data_root,
    load_dataset,
    select_classes,
)
from hfl.data.partitioners import label_histogram, partition, save_label_heatmap
from hfl.data.text import ByteTokenizer, CharTokenizer, make_tokenizer
from hfl.data.tokens import NATURAL_CLIENTS, TokenDataset, TokenWindows
from hfl.data.transforms import BatchTransform

__all__ = [
    "NATURAL_CLIENTS",
    "BatchTransform",
    "ByteTokenizer",
    "CharTokenizer",
    "ImageDataset",
    "SyntheticSpec",
    "TokenDataset",
    "TokenWindows",
    "default_cache_dir",
    "default_data_root",
    "label_histogram",
    "load_dataset",
    "make_tokenizer",
    "partition",
    "save_label_heatmap",
    "select_classes",
]
