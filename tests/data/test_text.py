"""Tokenizers: LEAF's character ids, the unknown id, byte ids, round trips and determinism."""

from __future__ import annotations

import pytest
import torch

from hfl.data.text import (
    LEAF_SHAKESPEARE_ALPHABET,
    UNKNOWN_CHARACTER,
    ByteTokenizer,
    CharTokenizer,
    make_tokenizer,
)

VERSE = "ROMEO:\nBut, soft! what light through yonder window breaks?\n[Enter JULIET above.] 1595;}"


def test_the_default_alphabet_is_leafs_80_shakespeare_characters() -> None:
    tokenizer = CharTokenizer()

    assert len(LEAF_SHAKESPEARE_ALPHABET) == 80 and tokenizer.vocab_size == 81 and tokenizer.unknown_id == 80
    # LEAF's ids (ALL_LETTERS.find): newline first, '}' last, letters after the punctuation and digits.
    assert tokenizer.encode("\n !A[az}").tolist() == [0, 1, 2, 25, 51, 53, 78, 79]


def test_characters_round_trip_as_int64_ids() -> None:
    tokenizer = CharTokenizer()

    ids = tokenizer.encode(VERSE)

    assert ids.dtype == torch.int64 and ids.shape == (len(VERSE),)
    assert tokenizer.decode(ids) == VERSE
    assert tokenizer.decode(ids.tolist()) == VERSE


def test_characters_outside_the_alphabet_get_the_unknown_id() -> None:
    tokenizer = CharTokenizer()

    ids = tokenizer.encode("a\té{@\U0001f600b")

    assert ids.tolist() == [53, 80, 80, 80, 80, 80, 54]
    assert tokenizer.decode(ids) == "a" + UNKNOWN_CHARACTER * 5 + "b"


def test_a_custom_alphabet() -> None:
    tokenizer = CharTokenizer("ba")

    assert tokenizer.vocab_size == 3 and tokenizer.encode("abc").tolist() == [1, 0, 2]
    with pytest.raises(ValueError, match="each character once"):
        CharTokenizer("abca")


def test_bytes_round_trip_any_text_in_256_ids() -> None:
    tokenizer = ByteTokenizer()
    text = VERSE + " café \U0001f600\t"

    ids = tokenizer.encode(text)

    assert tokenizer.vocab_size == 256 and ids.dtype == torch.int64
    assert tokenizer.encode("Aé").tolist() == [65, 0xC3, 0xA9]
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("kind", ["chars", "bytes"])
def test_encoding_is_deterministic_and_decoding_checks_the_range(kind: str) -> None:
    first, second = make_tokenizer(kind), make_tokenizer(kind)

    assert torch.equal(first.encode(VERSE), second.encode(VERSE))
    assert first.encode("").tolist() == [] and first.decode([]) == ""
    with pytest.raises(ValueError, match="token ids must lie in"):
        first.decode([first.vocab_size])
    with pytest.raises(ValueError, match="one sequence"):
        first.decode(torch.zeros(2, 3, dtype=torch.int64))


def test_an_unknown_kind_names_the_choices() -> None:
    with pytest.raises(ValueError, match="one of chars, bytes"):
        make_tokenizer("sentencepiece")
