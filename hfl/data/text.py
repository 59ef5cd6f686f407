"""Offline, deterministic tokenizers for next-token prediction: characters or bytes to token ids.

`CharTokenizer` maps each character of a fixed alphabet to its position in it and every other
character to one unknown id after them. Its default alphabet is LEAF's Shakespeare alphabet
(Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings"; `ALL_LETTERS` in LEAF's
`models/utils/language_utils.py`): the 80 characters below, so ids 0..79 are LEAF's ids and 80 is
the unknown id (LEAF itself gives unknown characters the id -1). `ByteTokenizer` reads UTF-8
bytes, 256 ids, and needs no unknown id. Neither downloads or learns anything: the same text gives
the same ids on every machine. A model's vocabulary is the tokenizer's `vocab_size`
(`build_model("gpt", ..., num_classes=tokenizer.vocab_size)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

LEAF_SHAKESPEARE_ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's 80 Shakespeare characters, in LEAF's id order: newline, space, 23 punctuation marks and
digits, the capitals, '[' and ']', the small letters and '}'."""

UNKNOWN_CHARACTER = "\ufffd"
"""What the unknown id decodes to: Unicode's replacement character."""

class Tokenizer(Protocol):
    """Text to token ids and back."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> Tensor: ...

    def decode(self, ids: Tensor | Sequence[int]) -> str: ...


def _checked_ids(ids: Tensor | Sequence[int], vocab_size: int) -> np.ndarray:
    """One sequence of ids as an int64 array, each checked to lie in the vocabulary."""
    values = np.asarray(ids.cpu() if isinstance(ids, Tensor) else ids, dtype=np.int64)
    if values.ndim != 1:
        raise ValueError(f"decode takes one sequence of ids, got an array of shape {tuple(values.shape)}")
    if values.size and (values.min() < 0 or values.max() >= vocab_size):
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}, got {values.min()}..{values.max()}")
    return values


class CharTokenizer:
    """One id per character of `alphabet` (its position), then one id for every other character."""

    def __init__(self, alphabet: str = LEAF_SHAKESPEARE_ALPHABET) -> None:
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError("the alphabet must be non-empty and hold each character once")
        if UNKNOWN_CHARACTER in alphabet:
            raise ValueError(f"the alphabet must not hold {UNKNOWN_CHARACTER!r}: it stands for unknown characters")
        self.alphabet = alphabet
        self.unknown_id = len(alphabet)
        # A table indexed by code point encodes a whole text in one numpy gather.
        codes = np.array([ord(c) for c in alphabet])
        self._table = np.full(int(codes.max()) + 1, self.unknown_id, dtype=np.int64)
        self._table[codes] = np.arange(len(alphabet))
        self._characters = np.array([*alphabet, UNKNOWN_CHARACTER])

    @property
    def vocab_size(self) -> int:
        """The alphabet's characters and the unknown id."""
        return len(self.alphabet) + 1

    def encode(self, text: str) -> Tensor:
        """int64 ids of `text`, one per character; characters outside the alphabet get `unknown_id`."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        known = codes < len(self._table)
        ids = np.where(known, self._table[np.where(known, codes, 0)], self.unknown_id)
        return torch.from_numpy(ids)

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """The characters of `ids`; the unknown id decodes to `UNKNOWN_CHARACTER`."""
        return "".join(self._characters[_checked_ids(ids, self.vocab_size)].tolist())


class ByteTokenizer:
    """The UTF-8 bytes of a text, ids 0..255: every text encodes, nothing is unknown."""

    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        """int64 ids of `text`'s UTF-8 bytes (a character outside ASCII takes two to four)."""
        return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64))

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """The text of byte ids; bytes that are not valid UTF-8 (a character cut in two) decode to
        `UNKNOWN_CHARACTER`."""
        return _checked_ids(ids, self.vocab_size).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


TOKENIZERS: dict[str, type[CharTokenizer | ByteTokenizer]] = {"chars": CharTokenizer, "bytes": ByteTokenizer}
"""Tokenizer kinds by name: LEAF's Shakespeare characters and an unknown id (81 ids), or UTF-8 bytes (256 ids)."""


def make_tokenizer(kind: str = "chars") -> Tokenizer:
    """A tokenizer of `kind`, a key of `TOKENIZERS`."""
    if kind not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {kind!r}")
    return TOKENIZERS[kind]()
