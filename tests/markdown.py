"""Reading the docs' Markdown in tests: the code blocks of a section (the worked examples tests run as
written) and the links and heading anchors (checked to resolve)."""

from __future__ import annotations

import re
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def section(path: Path, heading: str) -> str:
    """The text of the section whose heading line starts with `heading` (e.g. "## A model"), up to the
    next heading of the same or a higher level, code blocks skipped when looking for it."""
    level = heading.split(" ", 1)[0]
    text = path.read_text()
    prose = FENCE.sub(lambda m: " " * len(m.group(0)), text)  # same offsets, no headings from code comments
    start = re.search(rf"^{re.escape(heading)}", prose, re.MULTILINE)
    if start is None:
        raise LookupError(f"{path.name} has no heading {heading!r}")
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.MULTILINE).search(prose, start.end())
    return text[start.start() : end.start() if end else len(text)]


def code_blocks(path: Path, heading: str, language: str) -> list[str]:
    """The fenced `language` code blocks of that section, in order."""
    return [code for lang, code in FENCE.findall(section(path, heading)) if lang == language]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose = FENCE.sub("", path.read_text())
    return {anchor(line.lstrip("#")) for line in prose.splitlines() if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    """The targets of the Markdown links outside code blocks (inline code spans are not links)."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))
    return LINK.findall(prose)
