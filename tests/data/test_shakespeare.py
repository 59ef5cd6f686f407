"""LEAF's Shakespeare construction: parsing plays into roles, the clients, windows and split.

The fixtures imitate the 1998 Project Gutenberg texts (tags on their own line, bracketed stage
directions). The test over the real texts reads `$HFL_DATA` and skips with the reason where the play
folder is not there (it fails instead under HFL_REQUIRE_DATA=1).
"""

from __future__ import annotations

import os
import statistics

import pytest

from hfl.data.shakespeare import (
    TEXTS_FOLDER,
    Play,
    build_clients,
    is_play,
    load_shakespeare_clients,
    next_char_windows,
    parse_play,
    read_plays,
    role_text,
    split_text,
)
from hfl.data.text import CharTokenizer
from hfl.data.tokens import tokenise_clients
from hfl.errors import DataNotFoundError
from tests.conftest import real_data


# Capital tags, as in most of the plays; with a Gutenberg header and licence, the dramatis
# personae, stage directions (multi-line, inline, mid-speech), scene headings with a wrapped
# location line, a speech continuing after a stage direction and a tag with its speech on its line.
TEMPEST = """\
The Project Gutenberg EBook of The Tempest, by William Shakespeare

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK THE TEMPEST ***

THE TEMPEST

by William Shakespeare


DRAMATIS PERSONAE

ALONSO, King of Naples
PROSPERO, the right Duke of Milan
MIRANDA, daughter to Prospero


ACT I.

SCENE I. On a ship at sea.

[Enter a SHIPMASTER and a BOATSWAIN,
severally.]

MASTER.
Boatswain!

BOATSWAIN.
Here, master: what cheer?

MASTER.
Good, speak to the mariners: fall to't yarely,
or we run ourselves aground: bestir, bestir.

[Exit.]

[Enter MARINERS.]

BOATSWAIN.
Heigh, my hearts! cheerly, cheerly, my hearts!
Take in the topsail. [A whistle.] Tend to the
master's whistle.

[Exeunt MARINERS.]

Blow till thou burst thy wind, if room enough.


SCENE II. The island.
Before the cell of PROSPERO.

[Enter PROSPERO and MIRANDA.]

MIRANDA.
If by your art, my dearest father, you have
Put the wild waters in this roar, allay them.

PROSPERO.
Be collected:
No more amazement.

MIRANDA. You have often
Begun to tell me what I am;

[Exeunt.]

End of the Project Gutenberg EBook of The Tempest

*** END OF THIS PROJECT GUTENBERG EBOOK THE TEMPEST ***

PROSPERO.
Updated editions will replace the previous one.
"""

TEMPEST_ROLES = {
    "MASTER": [
        "Boatswain!",
        "Good, speak to the mariners: fall to't yarely,",
        "or we run ourselves aground: bestir, bestir.",
    ],
    "BOATSWAIN": [
        "Here, master: what cheer?",
        "Heigh, my hearts! cheerly, cheerly, my hearts!",
        "Take in the topsail. Tend to the",
        "master's whistle.",
        "Blow till thou burst thy wind, if room enough.",
    ],
    "MIRANDA": [
        "If by your art, my dearest father, you have",
        "Put the wild waters in this roar, allay them.",
        "You have often",
        "Begun to tell me what I am;",
    ],
    "PROSPERO": ["Be collected:", "No more amazement."],
}

# Abbreviated tags, as in Hamlet, Lear and Romeo and Juliet, a numbered one, and the closing line.
HAMLET = """\
HAMLET, PRINCE OF DENMARK

by William Shakespeare

PERSONS REPRESENTED.

Claudius, King of Denmark.
Horatio, Friend to Hamlet.

ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Hor.
But, soft, behold! lo, where it comes again!

[Re-enter Ghost.]

I'll cross it, though it blast me.--Stay, illusion!

1 Clown.
Is she to be buried in Christian burial?

THE END
"""

SONNETS = """\
THE SONNETS

by William Shakespeare

I

From fairest creatures we desire increase,
That thereby beauty's rose might never die,
"""


def test_parser_attributes_each_spoken_line_to_its_role():
    roles = parse_play(TEMPEST)
    assert roles == TEMPEST_ROLES
    assert list(roles) == ["MASTER", "BOATSWAIN", "MIRANDA", "PROSPERO"]  # order of first speech


def test_parser_reads_abbreviated_and_numbered_tags():
    assert parse_play(HAMLET) == {
        "BER": ["Who's there?"],
        "FRAN": ["Nay, answer me: stand, and unfold yourself."],
        "HOR": ["But, soft, behold! lo, where it comes again!", "I'll cross it, though it blast me.--Stay, illusion!"],
        "1 CLOWN": ["Is she to be buried in Christian burial?"],
    }


def test_poems_are_not_plays_and_are_skipped(tmp_path):
    assert is_play(TEMPEST) and is_play(HAMLET) and not is_play(SONNETS)
    (tmp_path / "tempest_gut.txt").write_text(TEMPEST)
    (tmp_path / "sonnets_gut.txt").write_text(SONNETS)
    (tmp_path / "metadata.txt").write_text("[tempest_gut]\ntitle = The Tempest\n")
    assert read_plays(tmp_path) == [Play("tempest", TEMPEST_ROLES)]


def test_windows_are_every_seq_len_characters_and_the_next():
    assert next_char_windows("abcdef", 3) == [("abc", "d"), ("bcd", "e"), ("cde", "f")]
    assert next_char_windows("abc", 3) == []


def test_split_is_temporal_and_skips_the_windows_overlapping_training():
    text = "abcdefghijklmnopqrst"  # 20 characters: 17 windows of 3
    train, test = split_text(text, seq_len=3, train_fraction=0.5)
    every = next_char_windows(text, 3)
    # int(0.5 * 17) = 8 training windows; testing starts 3 - 1 windows after them.
    assert (train, test) == ("abcdefghijk", "klmnopqrst")
    assert next_char_windows(train, 3) == every[:8]
    assert next_char_windows(test, 3) == every[10:]
    # LEAF: two windows give one of each; with too few characters a side would be empty.
    assert split_text("abc", seq_len=1, train_fraction=0.9) == ("ab", "bc")
    assert split_text("abcde", seq_len=3, train_fraction=0.5) is None
    assert split_text("abcdefgh", seq_len=3, train_fraction=0.9) is None  # 5 windows: 4 train, none left


def test_clients_keep_roles_with_enough_lines_and_samples():
    play = Play("p", {"A": ["one two", "three", "four  five"], "B": ["six", "seven"], "C": ["x", "y", "z"]})
    assert role_text(play.roles["A"]) == "one two three four five"
    clients = build_clients([play], seq_len=2, train_fraction=0.5)
    # B has two lines (LEAF drops it). A's 23 characters hold 21 windows of 2: 10 train, and the
    # test starts 1 later; C's "x y z" holds 3: 1 trains, 1 tests.
    assert [(c.role, c.train_text, c.test_text) for c in clients] == [
        ("A", "one two thre", "ee four five"),
        ("C", "x y", "y z"),
    ]
    assert [c.role for c in build_clients([play], seq_len=2, train_fraction=0.5, min_lines=2)] == ["A", "B", "C"]
    assert [c.role for c in build_clients([play], seq_len=2, train_fraction=0.5, min_samples=4)] == ["A"]
    assert all(c.play == "p" for c in clients)


def test_missing_folder_names_where_it_looked(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        load_shakespeare_clients(tmp_path)
    assert str(tmp_path / TEXTS_FOLDER) in str(info.value) and "HFL_DATA" in str(info.value)


def test_real_play_texts_give_leaf_sized_clients():
    folder = real_data(*TEXTS_FOLDER.parts)
    root = os.environ["HFL_DATA"]
    plays = read_plays(folder)
    assert len(plays) == 37  # the 5 poems are skipped
    hamlet = next(p for p in plays if p.name == "hamlet")
    assert 1400 < len(hamlet.roles["HAM"]) < 1600  # Hamlet speaks about 1,500 lines
    # LEAF's all_data: 1,129 roles with 3+ lines, 4,226,158 samples.
    leaf_users = [role_text(lines) for p in plays for lines in p.roles.values() if len(lines) >= 3]
    assert 1000 < sum(len(t) > 80 for t in leaf_users) < 1300
    assert 3.8e6 < sum(max(0, len(t) - 80) for t in leaf_users) < 4.6e6
    clients = load_shakespeare_clients(root)
    assert len(clients) == 674  # fewer: a 0.9 split needs about 900 characters to leave a test window
    assert {c.play for c in clients} == {p.name for p in plays}
    assert all(len(c.train_text) > 80 and len(c.test_text) > 80 for c in clients)
    # The docs' 3.6 M training windows (median 2,900 per client) and 349 K test windows, at seq_len 80.
    data = tokenise_clients("shakespeare", [(c.role, c.train_text, c.test_text) for c in clients], 80, CharTokenizer())
    assert (len(data.train_x), len(data.test_x)) == (3_617_636, 349_040)
    assert statistics.median(data.sizes("train")) == 2927
