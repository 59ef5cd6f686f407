"""The shakespeare dataset: token windows and next-token targets, the natural partition (a client
per role), the test set of the clients' test windows, caching, and the errors of wrong configs.

The fixture corpus (tests/conftest.py, `write_shakespeare_corpus`) has the format of the real play
texts; the test over the real texts reads `$HFL_DATA` and skips with the reason where the play folder
is not there (it fails instead under HFL_REQUIRE_DATA=1).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hfl.backends.base import ClientEnvironment
from hfl.cli import main
from hfl.data import CharTokenizer, TokenDataset, load_dataset
from hfl.data.shakespeare import TEXTS_FOLDER, load_shakespeare_clients
from hfl.data.tokens import TokenWindows
from hfl.errors import ConfigError, DataNotFoundError
from tests.conftest import (
    QUICKSTART,
    SHAKESPEARE_ROLES,
    real_data,
    small_config,
    write_shakespeare_corpus,
)

SEQ = 8
ROLES = [f"{play}/{role}" for play in sorted(SHAKESPEARE_ROLES) for role in SHAKESPEARE_ROLES[play]]
"""The fixture's clients in the dataset's order: plays by file name, roles as they first speak."""


def text_config(tmp_path: Path, **sections: dict) -> object:
    """A shakespeare experiment on the fixture corpus with a one-block GPT."""
    root = tmp_path / "corpus"
    if not root.exists():
        write_shakespeare_corpus(root)
    data = {"name": "shakespeare", "partition": "natural", "root": str(root), "cache_dir": str(tmp_path / "cache"), "seq_len": SEQ}
    values = {"data": data, "model": {"name": "gpt", "depth": 1, "width": 0.5}, "fl": {"clients": len(ROLES), "batch_size": 16}}
    for section, fields in sections.items():
        if isinstance(fields, dict):
            values.setdefault(section, {}).update(fields)
        else:
            values[section] = fields
    return small_config(**values)


def test_windows_are_seq_len_tokens_and_targets_the_next_token_at_every_position():
    tokens = torch.tensor([5, 6, 7, 8, 9, 1, 2, 3, 4], dtype=torch.uint8)
    # Client a: train 5 6 7 8 9, test 9 1 2 3 (spans overlap by the last training target, as LEAF's split).
    data = TokenDataset("hand", tokens, ("a",), torch.tensor([[0, 5]]), torch.tensor([[4, 8]]), seq_len=3, num_classes=10)
    assert data.train_x[torch.arange(2)].tolist() == [[5, 6, 7], [6, 7, 8]]
    assert data.train_y[torch.arange(2)].tolist() == [[6, 7, 8], [7, 8, 9]]
    assert data.test_x[:].tolist() == [[9, 1, 2]] and data.test_y[:].tolist() == [[1, 2, 3]]
    assert data.train_x[0].dtype == torch.int64 and data.train_x.shape == (2, 3)
    assert [p.tolist() for p in data.client_indices()] == [[0, 1]]


def test_fixture_windows_are_the_roles_texts_tokenised(tmp_path):
    root = write_shakespeare_corpus(tmp_path / "corpus")
    clients = load_shakespeare_clients(root, seq_len=SEQ)
    data = load_dataset("shakespeare", str(root), str(tmp_path / "cache"), seq_len=SEQ)
    assert isinstance(data, TokenDataset) and data.clients == tuple(ROLES) and data.num_classes == 81
    encode = CharTokenizer().encode
    train_start = test_start = 0
    for client, parts in zip(clients, data.client_indices()):
        n_train, n_test = len(client.train_text) - SEQ, len(client.test_text) - SEQ
        assert len(parts) == n_train  # LEAF's sample count: every window with a next character
        for i in (0, n_train - 1):
            assert torch.equal(data.train_x[parts[i]], encode(client.train_text[i : i + SEQ]))
            assert torch.equal(data.train_y[parts[i]], encode(client.train_text[i + 1 : i + SEQ + 1]))
        for j in (0, n_test - 1):
            assert torch.equal(data.test_x[test_start + j], encode(client.test_text[j : j + SEQ]))
            assert torch.equal(data.test_y[test_start + j], encode(client.test_text[j + 1 : j + SEQ + 1]))
        train_start, test_start = train_start + n_train, test_start + n_test
    assert (train_start, test_start) == (len(data.train_x), len(data.test_x))


def test_natural_partition_is_one_client_per_role_and_token_ids_are_not_transformed(tmp_path):
    env = ClientEnvironment.from_config(text_config(tmp_path))
    assert env.data.clients == tuple(ROLES)
    sizes = [len(c.train_text) - SEQ for c in load_shakespeare_clients(tmp_path / "corpus", seq_len=SEQ)]
    assert [len(p) for p in env.partitions] == sizes
    assert torch.equal(torch.cat(env.partitions), torch.arange(sum(sizes)))  # every window once, client by client
    assert env.transform is None and isinstance(env.train_x, TokenWindows)
    batch = env.batches(env.method.plan(*_round_one(env, 2)))
    x, y = next(iter(batch))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16, SEQ)
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are the inputs shifted by one
    assert env.accountant.input_shape == (SEQ,) and env.accountant.input_dtype == torch.int64


def _round_one(env: ClientEnvironment, client: int) -> tuple:
    from hfl.methods.base import MethodState
    from hfl.server import train_settings
    from hfl.types import RoundContext

    return RoundContext(1, client, env.config.seed, len(env.partitions[client]), train_settings(env.config.fl, 1)), MethodState()


def test_fl_clients_takes_a_seeded_subset_of_roles_and_their_test_windows(tmp_path):
    picks = [ClientEnvironment.from_config(text_config(tmp_path, fl={"clients": 3}, seed=seed)).data for seed in (0, 0, 1, 2)]
    assert picks[0].clients == picks[1].clients and len(set(picks[0].clients)) == 3
    assert len({p.clients for p in picks}) > 1  # the seed draws the subset
    chosen = picks[0]
    assert list(chosen.clients) == [r for r in ROLES if r in chosen.clients]  # kept in the dataset's order
    assert len(chosen.test_x) == chosen.sizes("test").sum() < load_dataset(
        "shakespeare", str(tmp_path / "corpus"), str(tmp_path / "cache"), seq_len=SEQ).sizes("test").sum()


def test_wrong_combinations_name_the_field_and_what_is_allowed(tmp_path):
    with pytest.raises(ConfigError, match=r"fl.clients=7 .*at most the 6 clients of shakespeare"):
        ClientEnvironment.from_config(text_config(tmp_path, fl={"clients": 7}))
    with pytest.raises(ConfigError, match=r"data.partition='dirichlet' .*natural for shakespeare"):
        text_config(tmp_path, data={"partition": "dirichlet"})
    with pytest.raises(ConfigError, match=r"partition='natural' .*one of .*dirichlet.* for digits"):
        small_config(data={"partition": "natural"})
    with pytest.raises(ConfigError, match=r"model.name='cnn' .*reads tokens"):
        ClientEnvironment.from_config(text_config(tmp_path, model={"name": "cnn", "depth": 0}))
    with pytest.raises(ConfigError, match=r"model.name='gpt' .*reads images"):
        ClientEnvironment.from_config(small_config(model={"name": "gpt", "depth": 1}))
    with pytest.raises(ConfigError, match=r"data.seq_len=300 .*at most the 256 positions"):
        ClientEnvironment.from_config(text_config(tmp_path, data={"seq_len": 300}))
    with pytest.raises(ConfigError, match=r"data.augment='flip'"):
        ClientEnvironment.from_config(text_config(tmp_path, data={"augment": "flip"}))
    with pytest.raises(ConfigError, match=r"data.classes"):
        ClientEnvironment.from_config(text_config(tmp_path, data={"classes": [1, 2]}))


def test_tokens_are_cached_per_seq_len_and_source_folder(tmp_path):
    root, cache = write_shakespeare_corpus(tmp_path / "corpus"), tmp_path / "cache"
    built = load_dataset("shakespeare", str(root), str(cache), seq_len=SEQ)
    assert (cache / "decoded" / f"shakespeare_seq{SEQ}.pt").is_file()
    shutil.rmtree(root / TEXTS_FOLDER)  # from now on only the cache holds the texts
    cached = load_dataset("shakespeare", str(root), str(cache), seq_len=SEQ)
    assert cached.clients == built.clients and torch.equal(cached.tokens, built.tokens)
    assert torch.equal(cached.train_spans, built.train_spans) and torch.equal(cached.test_spans, built.test_spans)
    with pytest.raises(DataNotFoundError):  # another length is another split: not in the cache
        load_dataset("shakespeare", str(root), str(cache), seq_len=SEQ + 1)
    with pytest.raises(DataNotFoundError):  # another folder's texts are not the cached ones
        load_dataset("shakespeare", str(tmp_path / "elsewhere"), str(cache), seq_len=SEQ)


def test_missing_folder_stops_with_exit_2_naming_the_path(tmp_path, capsys):
    code = main(["run", str(QUICKSTART), "data.name=shakespeare", "data.partition=natural", "model.name=gpt", f"data.root={tmp_path}",
                 f"data.cache_dir={tmp_path}/c", "--out", str(tmp_path / "o")])
    assert code == 2
    assert str(tmp_path / TEXTS_FOLDER) in capsys.readouterr().err


def test_data_command_prints_each_role_and_its_windows(tmp_path, capsys):
    config = text_config(tmp_path)
    overrides = [f"data.{k}={v}" for k, v in [("name", "shakespeare"), ("partition", "natural"), ("root", config.data.root),
                                              ("cache_dir", config.data.cache_dir), ("seq_len", SEQ)]]
    assert main(["data", str(QUICKSTART), *overrides, "model.name=gpt", "fl.clients=6"]) == 0
    out = capsys.readouterr().out
    data = load_dataset("shakespeare", config.data.root, config.data.cache_dir, seq_len=SEQ)
    for name, train, test in zip(ROLES, data.sizes("train"), data.sizes("test")):
        assert any(line.split()[1:] == [name, str(train), str(test)] for line in out.splitlines()), name
    assert f"{data.sizes('train').sum()} train / {data.sizes('test').sum()} test windows" in out


def test_real_play_texts_give_leaf_sized_token_clients(tmp_path):
    real_data(*TEXTS_FOLDER.parts)
    data = load_dataset("shakespeare", os.environ["HFL_DATA"], str(tmp_path), seq_len=80)
    assert 600 < len(data.clients) < 800 and data.tokens.dtype == torch.uint8 and int(data.tokens.max()) < 81
    assert 3.4e6 < len(data.train_x) < 3.9e6 and 3e5 < len(data.test_x) < 4e5  # LEAF's 90/10 split of about 4.2M samples
    hamlet = data.clients.index("hamlet/HAM")
    window = data.client_indices()[hamlet][100]
    assert torch.equal(data.train_x[window][1:], data.train_y[window][:-1])
    assert np.all(data.sizes("train") > 0) and np.all(data.sizes("test") > 0)


def test_a_stride_starts_windows_every_k_tokens_in_train_and_test():
    tokens = torch.arange(1, 13, dtype=torch.uint8)  # train 1..8, test 9..12
    data = TokenDataset("hand", tokens, ("a",), torch.tensor([[0, 8]]), torch.tensor([[8, 12]]), seq_len=2, num_classes=13, stride=3)
    assert data.train_x[torch.arange(2)].tolist() == [[1, 2], [4, 5]]  # a third window at 7 would have no next token
    assert data.train_y[torch.arange(2)].tolist() == [[2, 3], [5, 6]]
    assert len(data.train_x) == 2 and data.sizes("train").tolist() == [2] and data.sizes("test").tolist() == [1]
    assert data.test_x[:].tolist() == [[9, 10]] and data.select([0]).stride == 3


def test_a_stride_reaches_the_clients_through_data_stride_and_is_refused_for_images(tmp_path):
    from hfl.backends.base import ClientEnvironment
    from hfl.errors import ConfigError

    plain, strided = (ClientEnvironment.from_config(text_config(tmp_path, data={"stride": k})) for k in (1, SEQ))
    assert sum(len(p) for p in strided.partitions) < sum(len(p) for p in plain.partitions) / (SEQ - 1)
    with pytest.raises(ConfigError, match="stride"):
        small_config(data={"stride": 2})
