"""Every golden run reproduces its recorded metrics exactly (see tests/golden/runs.py), on the torch
build they were recorded with (tests/golden/recorded.py: skipped under another, failed in CI).

The runs go in `SHARDS` groups, each reproduced by one pinned subprocess the first time one of its
tests asks: `-k NAME` pays for NAME's shard only, and under pytest-xdist's `--dist loadgroup` each
shard runs on one worker (`xdist_group`), so the shards split across cores without running twice."""

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.golden.recorded import require_recorded_builds
from tests.golden.runs import FIXTURES, run_pinned, runs

pytestmark = pytest.mark.slow
NAMES = sorted(runs())
SHARDS = 8
"""About nine runs each, half a minute of runs per subprocess on a CI core beside its start-up."""


def shard_of(name: str) -> int:
    return NAMES.index(name) % SHARDS


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory) -> Callable[[str], list[dict[str, Any]]]:
    """The metrics of a run, reproduced with the rest of its shard on first request."""
    shards: dict[int, dict[str, list[dict[str, Any]]]] = {}

    def metrics(name: str) -> list[dict[str, Any]]:
        shard = shard_of(name)
        if shard not in shards:
            members = [n for n in NAMES if shard_of(n) == shard]
            found = run_pinned(tmp_path_factory.mktemp(f"golden{shard}") / "runs.json", members, exact=True)
            shards[shard] = found
        return shards[shard][name]

    return metrics


def first_difference(expected: Any, found: Any, path: str = "") -> str | None:
    """Where two JSON values first differ, as a path with both values."""
    if isinstance(expected, dict) and isinstance(found, dict):
        for key in sorted(set(expected) | set(found), key=str):
            if key not in expected or key not in found:
                return f"{path}.{key}: only in {'recorded' if key in expected else 'this run'}"
            if (where := first_difference(expected[key], found[key], f"{path}.{key}")) is not None:
                return where
        return None
    if isinstance(expected, list) and isinstance(found, list):
        if len(expected) != len(found):
            return f"{path}: {len(expected)} entries recorded, {len(found)} now"
        for i, (e, f) in enumerate(zip(expected, found)):
            if (where := first_difference(e, f, f"{path}[{i}]")) is not None:
                return where
        return None
    return None if expected == found else f"{path}: recorded {expected!r}, now {found!r}"


def test_every_run_has_a_fixture():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(runs())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"golden{shard_of(n)}")) for n in NAMES])
def test_run_reproduces_its_recorded_metrics(reproduced, name):
    require_recorded_builds()  # before the minutes of runs
    difference = first_difference(json.loads((FIXTURES / f"{name}.json").read_text()), reproduced(name))
    # A deliberate change of numbers: python -m tests.golden.runs --record, and name the runs it changed in the commit.
    assert difference is None, f"{name}{difference}"
