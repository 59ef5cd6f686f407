"""Local pretraining corpora for `hfl pretrain`, chosen to be disjoint from the federated tasks.

`sst2_agnews` (language models): the GLUE SST-2 training sentences (`sst2/SST-2/train.tsv`,
`sentence<TAB>label` with a header) and the AG News texts, title and description
(`ag_news/ag_news_csv/test.csv`, `"class","title","description"`; AG News' train split is not
available locally). Never the Shakespeare plays: they are the downstream task. Each sentence or
article is one document ending in a newline; the documents are shuffled with a fixed permutation
(seed `CORPUS_SEED`, not the experiment's: every family sees the same corpus) so that the held-out
tail holds both sources, then concatenated and tokenised. The last `eval_fraction` of the tokens is
the validation text.

`cifar10_jpeg_0_4` (ViTs): the CIFAR-10 (JPEG) training images of classes 0-4 (airplane,
automobile, bird, cat, deer; the federated task uses 5-9), labelled 0-4. The last `eval_fraction`
of each class's images (in file order) is the validation set; CIFAR-10's test split is not used.
"""

from __future__ import annotations

import csv
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hfl.data.text import make_tokenizer
from hfl.errors import DataNotFoundError

CORPUS_SEED = 0
"""Seed of the document order of the text corpus."""
SST2_TRAIN = Path("sst2") / "SST-2" / "train.tsv"
AG_NEWS_TEXTS = Path("ag_news") / "ag_news_csv" / "test.csv"
TEXT_CORPORA = ("sst2_agnews",)
IMAGE_CORPUS_DATASETS = {"cifar10_jpeg_0_4": "cifar10_jpeg"}
"""The dataset each image corpus takes its images and labels from."""
IMAGE_CORPORA = tuple(IMAGE_CORPUS_DATASETS)
PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
"""CIFAR-10's classes the ViTs are pretrained on; the federated CIFAR task keeps the others."""
_FIX_ROOT = "set data_root (or the environment variable HFL_DATA) to the folder that holds it"
# AG News lost its HTML entities' '&' (" #39;" for "'", " quot;" for '"') and marks line breaks with '\'.
_AG_ENTITY = re.compile(r" ?#(\d+);")
_AG_NAMED = {"quot": '"', "amp": "&", "lt": "<", "gt": ">"}
_AG_NAMED_ENTITY = re.compile(r" ?\b(quot|amp|lt|gt);")


@dataclass(frozen=True)
class SourceFile:
    """A file a corpus was read from, for the model card."""

    path: str
    sha256: str
    items: int
    """Sentences, articles or images read from it."""


@dataclass(frozen=True)
class TextCorpus:
    """A tokenised text, split into a training head and a validation tail."""

    train: torch.Tensor
    """int64 token ids."""
    val: torch.Tensor
    """int64 token ids: the held-out tail."""
    vocab_size: int
    sources: tuple[SourceFile, ...]


@dataclass(frozen=True)
class ImageCorpus:
    """Labelled uint8 images, split into training and validation images."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    sources: tuple[SourceFile, ...]


def _read(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise DataNotFoundError(f"{what} not found: looked for {path}. Fix: {_FIX_ROOT}")
    return path.read_bytes()


def _sst2_sentences(path: Path) -> list[str]:
    rows = _read(path, "SST-2's training sentences").decode("utf-8").splitlines()
    if not rows or rows[0].split("\t")[0] != "sentence":
        raise DataNotFoundError(f"{path} is not GLUE's SST-2 train.tsv: expected a header `sentence<TAB>label`")
    return [row.split("\t")[0].strip() for row in rows[1:] if row.strip()]


def clean_ag_news(text: str) -> str:
    """An AG News field with its mangled HTML entities restored and its '\\' line breaks as spaces."""
    text = _AG_ENTITY.sub(lambda m: chr(int(m.group(1))), text)
    text = _AG_NAMED_ENTITY.sub(lambda m: _AG_NAMED[m.group(1)], text)
    return " ".join(text.replace("\\", " ").split())


def _ag_news_articles(path: Path) -> list[str]:
    rows = list(csv.reader(_read(path, "AG News' texts").decode("utf-8").splitlines()))
    if not rows or any(len(row) != 3 for row in rows):
        raise DataNotFoundError(f"{path} is not AG News' CSV: expected rows \"class\",\"title\",\"description\"")
    return [f"{clean_ag_news(title)}\n{clean_ag_news(description)}" for _, title, description in rows]


def _source(path: Path, items: int) -> SourceFile:
    return SourceFile(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), items)


def corpus_text(root: str | Path) -> tuple[str, tuple[SourceFile, ...]]:
    """The `sst2_agnews` text (documents in their fixed shuffled order) and the files it came from."""
    root = Path(root)
    sst2, ag_news = root / SST2_TRAIN, root / AG_NEWS_TEXTS
    documents = _sst2_sentences(sst2)
    sources = [_source(sst2, len(documents))]
    articles = _ag_news_articles(ag_news)
    documents += articles
    sources.append(_source(ag_news, len(articles)))
    order = np.random.default_rng(CORPUS_SEED).permutation(len(documents))
    return "".join(documents[i] + "\n" for i in order), tuple(sources)


def load_text_corpus(name: str, root: str | Path, tokenizer: str, eval_fraction: float) -> TextCorpus:
    """Corpus `name` tokenised with `tokenizer` (chars or bytes); the last `eval_fraction` of the
    tokens is the validation text."""
    if name not in TEXT_CORPORA:
        raise ValueError(f"unknown text corpus {name!r}: expected one of {', '.join(TEXT_CORPORA)}")
    text, sources = corpus_text(root)
    tok = make_tokenizer(tokenizer)
    ids = tok.encode(text)
    cut = len(ids) - int(len(ids) * eval_fraction)
    return TextCorpus(ids[:cut].clone(), ids[cut:].clone(), tok.vocab_size, sources)


def load_image_corpus(name: str, root: str | Path, cache_dir: str | Path, eval_fraction: float) -> ImageCorpus:
    """Corpus `name`: CIFAR-10 (JPEG) training images of `PRETRAIN_CLASSES`; the last `eval_fraction`
    of each class's images is the validation set."""
    from hfl.data.datasets import _JPEG_ZIP, load_dataset

    if name not in IMAGE_CORPORA:
        raise ValueError(f"unknown image corpus {name!r}: expected one of {', '.join(IMAGE_CORPORA)}")
    data = load_dataset(IMAGE_CORPUS_DATASETS[name], str(root), str(cache_dir), classes=PRETRAIN_CLASSES)
    val = torch.zeros(len(data.train_y), dtype=torch.bool)
    for c in range(data.num_classes):
        index = torch.nonzero(data.train_y == c).flatten()
        val[index[len(index) - int(len(index) * eval_fraction):]] = True
    zip_path = Path(root) / "cifar10_jpeg" / _JPEG_ZIP
    # Hashing the 63 MB zip costs a fraction of a second; the card then names exactly what was read.
    source = _source(zip_path, len(data.train_y)) if zip_path.is_file() else SourceFile(str(zip_path), "", len(data.train_y))
    return ImageCorpus(
        data.train_x[~val], data.train_y[~val], data.train_x[val], data.train_y[val],
        data.num_classes, data.mean, data.std, (source,),
    )
