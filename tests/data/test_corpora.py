"""The pretraining corpora: what they hold, in a fixed order, and what they say when missing."""

from __future__ import annotations

import pytest
import torch

from hfl.data.corpora import (
    clean_ag_news,
    corpus_text,
    load_image_corpus,
    load_text_corpus,
)
from hfl.data.text import CharTokenizer
from hfl.errors import DataNotFoundError
from tests.pretrain_fixtures import (
    AG_NEWS_ROWS,
    SST2_ROWS,
    write_cifar_zip,
    write_text_corpus,
)


def test_the_text_holds_every_sst2_sentence_and_ag_news_article_once_in_a_fixed_order(tmp_path) -> None:
    text, sources = corpus_text(write_text_corpus(tmp_path))

    documents = text.split("\n")
    assert text == corpus_text(tmp_path)[0]
    assert sorted(d for d in documents if d) == sorted([s.strip() for s in SST2_ROWS] + [clean_ag_news(x) for _, t, d in AG_NEWS_ROWS
                                                                                       for x in (t, d)])
    assert [s.items for s in sources] == [len(SST2_ROWS), len(AG_NEWS_ROWS)]
    assert documents[0] != SST2_ROWS[0].strip()  # shuffled, so the held-out tail draws from both sources


def test_ag_news_entities_and_line_breaks_are_restored() -> None:
    assert clean_ag_news("for the  #36;10 million, a second\\team") == "for the $10 million, a second team"
    assert clean_ag_news("won a  quot;grant quot; in Peru, it #39;s said") == 'won a "grant" in Peru, it\'s said'


def test_the_validation_text_is_the_tail(tmp_path) -> None:
    text, _ = corpus_text(write_text_corpus(tmp_path))

    corpus = load_text_corpus("sst2_agnews", tmp_path, "chars", 0.25)

    ids = CharTokenizer().encode(text)
    assert torch.equal(torch.cat([corpus.train, corpus.val]), ids)
    assert len(corpus.val) == int(len(ids) * 0.25) and corpus.vocab_size == 81


@pytest.mark.parametrize("missing", ["sst2/SST-2/train.tsv", "ag_news/ag_news_csv/test.csv"])
def test_a_missing_source_names_the_path_looked_in(tmp_path, missing) -> None:
    write_text_corpus(tmp_path)
    (tmp_path / missing).unlink()

    with pytest.raises(DataNotFoundError, match=str(tmp_path / missing)):
        load_text_corpus("sst2_agnews", tmp_path, "bytes", 0.1)


def test_the_images_are_cifar_classes_0_to_4_with_each_class_last_images_held_out(tmp_path) -> None:
    write_cifar_zip(tmp_path, per_class=4)

    corpus = load_image_corpus("cifar10_jpeg_0_4", tmp_path, tmp_path / "cache", 0.25)

    assert corpus.num_classes == 5
    assert corpus.train_y.tolist() == [c for c in range(5) for _ in range(3)]
    assert corpus.val_y.tolist() == [0, 1, 2, 3, 4]
    # The images of class 0 (airplane) are the darkest; class 4 (deer) the brightest of the five.
    assert corpus.val_x[0].float().mean() < corpus.val_x[4].float().mean()
