"""Next-token datasets that bring their own clients: LEAF's Shakespeare as one token stream.

A `TokenDataset` holds every client's training text and test text, tokenised, as spans of one flat
token stream (uint8: 4 MB for all of Shakespeare). A sample is a window of `seq_len` tokens, and its
target is the window shifted by one token: the next token at every position, which a decoder-only
language model (`gpt`) predicts all at once, so `F.cross_entropy(model(x), y)` is the mean
next-token loss over the window. Windows start at every token that leaves a full window and its
next token (stride 1), so a client has LEAF's number of samples, `len(text) - seq_len`; with
`stride` k they start every k tokens (k = seq_len: each token predicted once per epoch, in train
and test alike), which turns LEAF's 80 passes over a role's text per local epoch into one.

The windows are gathered from the stream when a batch is read (`TokenWindows`), never stored one by
one: LEAF's 3.6 million overlapping training windows of 80 characters would take 2.3 GB as int64
inputs and as much again as targets.

The partition is the data's own (`data.partition=natural`): one client per (play, role), in the
order the plays' files and their roles come. The test set is the clients' test windows, LEAF's
per-client time-ordered split (`hfl.data.shakespeare.split_text`), evaluated as one set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from hfl.data.cache import cached_blob, decoded_path
from hfl.data.synthetic import SyntheticSpec
from hfl.data.shakespeare import TEXTS_FOLDER, load_shakespeare_clients
from hfl.data.text import CharTokenizer
from hfl.registry import DATASETS

class TokenWindows:
    """Row i is `tokens[starts[i] : starts[i] + length]` as int64 ids, gathered when indexed.

    Indexing takes what a tensor of samples takes in hfl (an index tensor, a slice or an int) and
    returns an int64 tensor; `len`, `shape`, `device` and `to` behave as a tensor's."""

    def __init__(self, tokens: Tensor, starts: Tensor, length: int) -> None:
        if tokens.dim() != 1 or starts.dim() != 1:
            raise ValueError(f"tokens and starts must be 1-D, got {tuple(tokens.shape)} and {tuple(starts.shape)}")
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + length > len(tokens)):
            raise ValueError(f"windows of {length} tokens from starts {int(starts.min())}..{int(starts.max())} "
                             f"overrun the {len(tokens)} tokens")
        self.tokens, self.starts, self.length = tokens, starts.to(torch.int64), length
        self._offsets = torch.arange(length, device=tokens.device)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.starts), self.length))

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def __getitem__(self, index: Tensor | slice | int) -> Tensor:
        starts = self.starts[index]
        return self.tokens[starts.unsqueeze(-1) + self._offsets].to(torch.int64)

    def to(self, device: torch.device | str) -> TokenWindows:
        return TokenWindows(self.tokens.to(device), self.starts.to(device), self.length)

    def shifted(self, by: int) -> TokenWindows:
        """The windows `by` tokens later: the targets of next-token prediction for `by` = 1."""
        return TokenWindows(self.tokens, self.starts + by, self.length)


def window_counts(spans: Tensor, seq_len: int, stride: int = 1) -> Tensor:
    """Windows per span: starts s, s + stride, ... up to e - seq_len - 1 for span [s, e)."""
    room = (spans[:, 1] - spans[:, 0] - seq_len).clamp(min=0)
    return (room + stride - 1) // stride


def window_starts(spans: Tensor, seq_len: int, stride: int = 1) -> Tensor:
    """The start of every window of `seq_len` tokens that has a next token inside its span, span by
    span in order: span [s, e) gives s, s + stride, ..., up to e - seq_len - 1."""
    begin, counts = spans[:, 0], window_counts(spans, seq_len, stride)
    first = torch.cumsum(counts, 0) - counts  # position of each span's first window among all
    return torch.repeat_interleave(begin, counts) + stride * (torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts))


@dataclass
class TokenDataset:
    """Clients' training and test texts as spans of one token stream; samples are token windows."""

    input_kind: ClassVar[str] = "tokens"
    """What a model must read for this dataset (`ScalableModel.input_kind`)."""

    name: str
    tokens: Tensor
    """Every client's training text, then its test text, client after client: uint8 ids."""
    clients: tuple[str, ...]
    """A name per client (`play/ROLE` for Shakespeare)."""
    train_spans: Tensor
    """int64 (clients, 2): [start, end) of each client's training text in `tokens`."""
    test_spans: Tensor
    """int64 (clients, 2): [start, end) of each client's test text in `tokens`."""
    seq_len: int
    """Tokens per sample."""
    num_classes: int
    """The vocabulary: token ids lie in 0..num_classes - 1."""
    stride: int = 1
    """Tokens between consecutive windows' starts (LEAF: 1)."""
    train_x: TokenWindows = field(init=False, repr=False)
    """Every client's training windows, client after client."""
    train_y: TokenWindows = field(init=False, repr=False)
    """The next token at every position of `train_x`."""
    test_x: TokenWindows = field(init=False, repr=False)
    test_y: TokenWindows = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.clients)
        for split, spans in (("train", self.train_spans), ("test", self.test_spans)):
            if spans.shape != (n, 2) or spans.dtype != torch.int64:
                raise ValueError(f"{self.name}: {split}_spans must be int64 of shape ({n}, 2), got {spans.dtype} {tuple(spans.shape)}")
            if n and int((spans[:, 1] - spans[:, 0]).min()) <= self.seq_len:
                raise ValueError(f"{self.name}: every client's {split} text must hold more than seq_len={self.seq_len} tokens")
        if self.tokens.dim() != 1 or (len(self.tokens) and int(self.tokens.max()) >= self.num_classes):
            raise ValueError(f"{self.name}: tokens must be 1-D ids below num_classes={self.num_classes}")
        if self.stride < 1:
            raise ValueError(f"{self.name}: stride must be >= 1, got {self.stride}")
        self.train_x = TokenWindows(self.tokens, window_starts(self.train_spans, self.seq_len, self.stride), self.seq_len)
        self.train_y = self.train_x.shifted(1)
        self.test_x = TokenWindows(self.tokens, window_starts(self.test_spans, self.seq_len, self.stride), self.seq_len)
        self.test_y = self.test_x.shifted(1)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape as a model reads it: `seq_len` token ids."""
        return (self.seq_len,)

    @property
    def input_dtype(self) -> torch.dtype:
        return torch.int64

    @property
    def in_channels(self) -> int:
        """Token ids have no channels; a model reading tokens ignores this (it is 1)."""
        return 1

    def sizes(self, split: str = "train") -> np.ndarray:
        """Windows per client in `split` (train or test)."""
        spans = self.train_spans if split == "train" else self.test_spans
        return window_counts(spans, self.seq_len, self.stride).numpy()

    def client_indices(self) -> list[np.ndarray]:
        """Each client's training windows: indices into `train_x`, one contiguous range per client."""
        ends = np.cumsum(self.sizes("train"))
        return [np.arange(end - size, end, dtype=np.int64) for end, size in zip(ends, self.sizes("train"))]

    def select(self, clients: Sequence[int]) -> TokenDataset:
        """The dataset of `clients` alone (indices, in the order given): their texts, and only theirs in the test set."""
        ids = torch.as_tensor(list(clients), dtype=torch.int64)
        return TokenDataset(self.name, self.tokens, tuple(self.clients[i] for i in ids.tolist()), self.train_spans[ids],
                            self.test_spans[ids], self.seq_len, self.num_classes, self.stride)


def tokenise_clients(name: str, texts: Sequence[tuple[str, str, str]], seq_len: int, tokenizer: CharTokenizer) -> TokenDataset:
    """A `TokenDataset` of (client name, training text, test text) triples."""
    pieces, train_spans, test_spans, position = [], [], [], 0
    for _, train, test in texts:
        for text, spans in ((train, train_spans), (test, test_spans)):
            ids = tokenizer.encode(text)
            pieces.append(ids)
            spans.append((position, position + len(ids)))
            position += len(ids)
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    tokens = torch.cat(pieces).to(dtype) if pieces else torch.zeros(0, dtype=dtype)
    return TokenDataset(name, tokens, tuple(client for client, _, _ in texts), torch.tensor(train_spans, dtype=torch.int64).view(-1, 2),
                        torch.tensor(test_spans, dtype=torch.int64).view(-1, 2), seq_len, tokenizer.vocab_size)


def _cached_tokens(name: str, cache_dir: str, seq_len: int, source: Path, build: Callable[[], TokenDataset]) -> TokenDataset:
    """Dataset `name` at `seq_len` from its cache file, built by `build()` from the texts in `source`
    and cached first if needed. The split depends on `seq_len`, so each length has its own file; a
    file built from another folder is built again (a test corpus must not stand in for the real one)."""
    source_name = str(source.resolve())

    def build_blob() -> dict:
        data = build()
        return {"source": source_name, "tokens": data.tokens, "clients": list(data.clients), "train_spans": data.train_spans,
                "test_spans": data.test_spans, "seq_len": data.seq_len, "num_classes": data.num_classes}

    blob = cached_blob(decoded_path(cache_dir, f"{name}_seq{seq_len}"), name, build_blob, lambda blob: blob.get("source") == source_name)
    return TokenDataset(name, blob["tokens"], tuple(blob["clients"]), blob["train_spans"], blob["test_spans"],
                        int(blob["seq_len"]), int(blob["num_classes"]))


@DATASETS.register("shakespeare")
def _load_shakespeare(
    *, root: str, cache_dir: str, download: bool, test_fraction: float, synthetic: SyntheticSpec | None, seq_len: int
) -> TokenDataset:
    """LEAF's Shakespeare: a client per (play, role), LEAF's characters, its 0.9 time-ordered split
    at `seq_len` (data.download and data.test_fraction do not apply)."""

    def build() -> TokenDataset:
        clients = load_shakespeare_clients(root, seq_len=seq_len)  # DataNotFoundError names the folder
        texts = [(f"{c.play}/{c.role}", c.train_text, c.test_text) for c in clients]
        return tokenise_clients("shakespeare", texts, seq_len, CharTokenizer())

    return _cached_tokens("shakespeare", cache_dir, seq_len, Path(root) / TEXTS_FOLDER, build)
