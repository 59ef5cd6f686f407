"""Every golden run reproduces its recorded facts exactly and its measured floats exactly on a
platform they were recorded on, within a tolerance elsewhere (tests/golden/runs.py), on the torch
build they were recorded with (tests/golden/recorded.py: skipped under another, failed in CI). The
portable runs also hold under a second numerical path of this machine, so that the suite shows on
any one machine that the tolerance carries across processors.

The runs go in `SHARDS` groups, each reproduced by one pinned subprocess the first time one of its
tests asks, with only the runs this session selected (`-k NAME` pays for NAME alone); under
pytest-xdist's `--dist loadgroup` each shard runs on one worker (`xdist_group`), so the shards split
across cores without running twice."""

import json
import platform as host
from collections.abc import Callable
from itertools import combinations
from typing import Any

import pytest

from tests.golden.compare import PLACEHOLDER, Tolerance, float_differences, split
from tests.golden.platforms import key
from tests.golden.recorded import require_recorded_builds
from tests.golden.runs import FIXTURES, OTHER_PATH, PLATFORMS, differences, fixture, platforms, run_pinned, runs, tolerance_for

NAMES = sorted(runs())
SHARDS = 3
"""One per worker of `-n auto` on 2 cores: each subprocess pays ~6 CPU-seconds to start (torch,
torch._dynamo, hfl), about an eighth of its runs' work; 8 shards spent ~30 CPU-seconds more of the
suite's 2-core budget."""
PORTABLE_NAMES = [n for n in NAMES if n.startswith("portable__")]


def shard_of(name: str) -> int:
    return NAMES.index(name) % SHARDS


@pytest.fixture(scope="module")
def reproduced(request, tmp_path_factory) -> Callable[[str], tuple[str, list[dict[str, Any]]]]:
    """(this platform's key, the metrics of a run), reproduced on first request with the rest of its
    shard's runs that this session selected."""
    shards: dict[int, tuple[str, dict[str, list[dict[str, Any]]]]] = {}
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.originalname == "test_run_reproduces_its_recorded_metrics"}

    def metrics(name: str) -> tuple[str, list[dict[str, Any]]]:
        shard = shard_of(name)
        if shard not in shards:
            members = [n for n in NAMES if shard_of(n) == shard and n in selected]
            described, found = run_pinned(tmp_path_factory.mktemp(f"golden{shard}") / "runs.json", members, exact=True)
            shards[shard] = (key(described), found)
        here, found = shards[shard]
        return here, found[name]

    return metrics


def test_every_run_has_a_fixture():
    assert sorted(p.stem for p in FIXTURES.glob("*.json") if p != PLATFORMS) == sorted(runs())


def test_every_fixture_names_recorded_platforms_and_agrees_with_itself_within_its_tolerance():
    """The floats recorded on two platforms are two machines' drift over two rounds: each pair must
    lie within the run's tolerance, or the tolerance would fail one of the machines it was recorded on."""
    known = platforms()
    for name in NAMES:
        recorded = fixture(name)
        assert recorded["floats"] and set(recorded["floats"]) <= set(known), name
        facts_floats = split(recorded["facts"])[1]
        assert not facts_floats, f"{name}: a measured float among the facts"
        for a, b in combinations(recorded["floats"], 2):
            beyond = float_differences(recorded["floats"][a], recorded["floats"][b], tolerance_for(name))
            assert not beyond, f"{name}: {a} and {b} differ beyond {tolerance_for(name)}: {beyond[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"golden{shard_of(n)}")) for n in NAMES])
def test_run_reproduces_its_recorded_metrics(reproduced, name):
    require_recorded_builds()  # before the minutes of runs
    here, found = reproduced(name)
    problems = differences(name, found, here)
    # A deliberate change of numbers: python -m tests.golden.runs --record, and name the runs it changed in the commit.
    assert not problems, f"{name}: {problems[0]} ({len(problems)} differences)"


@pytest.mark.slow
@pytest.mark.xdist_group("golden_other_path")
def test_the_portable_runs_hold_under_another_numerical_path(tmp_path):
    """The portable runs computed with torch's scalar kernels, oneDNN's SSE4.1 and MKL's compatibility
    path (`OTHER_PATH`) sum in other orders than the pinned AVX2 ones, as another processor would: their
    facts are equal and their floats lie within the portable tolerance of every recorded platform's."""
    require_recorded_builds()
    if host.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the other path switches x86-64 kernels; this is {host.machine()}")
    described, found = run_pinned(tmp_path / "runs.json", PORTABLE_NAMES, exact=True, path=OTHER_PATH)
    unrecorded = f"{key(described)} (another path)"  # never a recorded platform: compared within the tolerance
    moved = 0
    for name in PORTABLE_NAMES:
        problems = differences(name, found[name], unrecorded)
        assert not problems, f"{name}: {problems[0]} ({len(problems)} differences)"
        floats = split(found[name])[1]
        moved += sum(floats != recorded for recorded in fixture(name)["floats"].values())
    assert moved, "the other path computed every float bit for bit as recorded: it showed no portability"


def test_differences_hold_facts_exactly_and_floats_exactly_only_where_recorded():
    """The comparison itself, on a run's own fixture: a fact off by one fails anywhere; a float off
    by one part in 10^9 fails on its recorded platform and passes elsewhere; one off by ten times
    the tolerance fails everywhere."""
    name = "portable__fedavg"
    recorded = fixture(name)
    here = next(iter(recorded["floats"]))
    floats = recorded["floats"][here]

    def records(scale: float = 1.0, fact: int = 0) -> list[dict[str, Any]]:
        out = json.loads(json.dumps(recorded["facts"]))
        for path, value in floats.items():
            target, leaf = locate(out, path)
            target[leaf] = value * scale
        out[0]["clients"][0]["flops"] += fact
        return out

    assert differences(name, records(), here) == []
    assert differences(name, records(), "elsewhere") == []
    assert "a fact differs" in differences(name, records(fact=1), "elsewhere")[0]
    assert differences(name, records(1 + 1e-9), here) and differences(name, records(1 + 1e-9), "elsewhere") == []
    assert differences(name, records(1 + 10 * tolerance_for(name).loss_rel[0]), "elsewhere")


def locate(records: Any, path: str) -> tuple[Any, Any]:
    """The container and key of a flattened path (`[0].clients[2].train_loss`, `[1].submodel_accuracy.x0.5`)
    in records whose measured floats are placeholders."""
    node: Any = records
    rest = path
    while True:
        if rest.startswith("["):
            index, rest = rest[1:].split("]", 1)
            if not rest:
                return node, int(index)
            node = node[int(index)]
            continue
        rest = rest[1:]  # the dot
        for key_ in sorted(node, key=len, reverse=True):  # keys may hold dots (x0.5): the longest that fits
            if rest == key_ and node[key_] == PLACEHOLDER:
                return node, key_
            if rest.startswith(key_ + ".") or rest.startswith(key_ + "["):
                node, rest = node[key_], rest[len(key_):]
                break
        else:
            raise KeyError(path)


def test_tolerance_is_per_round_and_by_kind():
    tolerance = Tolerance(loss_rel=(1e-4, 1e-3), accuracy_abs=(0.01, 0.02))
    assert tolerance.allows("[0].loss", 1.0, 1.00009) and not tolerance.allows("[0].loss", 1.0, 1.0002)
    assert tolerance.allows("[1].clients[0].train_loss", 1.0, 1.0009) and not tolerance.allows("[3].loss", 1.0, 1.002)
    assert tolerance.allows("[0].accuracy", 0.5, 0.509) and not tolerance.allows("[0].submodel_accuracy.x0.5", 0.5, 0.52)
    assert tolerance.allows("[1].exit_accuracy.exit0", 0.5, 0.519) and not tolerance.allows("[1].loss", float("nan"), 1.0)


def test_recording_a_run_that_only_gained_a_fact_keeps_every_platforms_floats(tmp_path, monkeypatch):
    """A new field in a run's records is not a change of numbers: another platform's floats stay. A
    changed fact, or a float changed here, drops them (they are stale)."""
    import tests.golden.runs as golden_runs

    monkeypatch.setattr(golden_runs, "FIXTURES", tmp_path)
    monkeypatch.setattr(golden_runs, "PLATFORMS", tmp_path / "platforms.json")
    platform = {"processor": "Example family 1 model 2", "isa": "AVX2", "torch": "2.0", "blas": "MKL 2024.2"}
    here = key(platform)

    def recorded(**extra: Any) -> list[dict[str, Any]]:
        return [{"round": 1, "loss": 0.5, "clients": [{"id": 0, "train_loss": 1.25, "flops": 10, **extra}]}]

    def write(facts_of: list[dict[str, Any]]) -> None:
        facts, floats = split(facts_of)
        (tmp_path / "run.json").write_text(json.dumps({"facts": facts, "floats": {here: floats, "elsewhere": floats}}))

    def kept_platforms() -> list[str]:
        return sorted(json.loads((tmp_path / "run.json").read_text())["floats"])

    write(recorded())
    changes = golden_runs.record(platform, {"run": recorded(estimated_sparse_peak_bytes=7)})
    assert "facts gained fields" in changes[0] and kept_platforms() == sorted(["elsewhere", here])
    assert json.loads((tmp_path / "run.json").read_text())["facts"][0]["clients"][0]["estimated_sparse_peak_bytes"] == 7

    for changed in ({"flops": 11}, {"train_loss": 1.5}):  # a fact changed; a float changed on this platform
        write(recorded())
        gained = recorded(estimated_sparse_peak_bytes=7)
        gained[0]["clients"][0].update(changed)
        golden_runs.record(platform, {"run": gained})
        assert kept_platforms() == [here], changed
