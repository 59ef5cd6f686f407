"""Installing hfl keeps the torch a researcher has; the exact builds the golden runs need come from
constraints.txt, and the tests that need them skip (or, in CI, fail) under another build."""

import importlib.metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import ROOT
from tests.golden import recorded
from tests.golden.recorded import RECORDED_WITH, REQUIRE_ENV, require_recorded_builds


def installed_requirements() -> dict[str, Requirement]:
    """hfl's runtime requirements, as the installed distribution declares them (not the extras)."""
    requirements = [Requirement(text) for text in importlib.metadata.requires("hfl")]
    return {r.name: r for r in requirements if r.marker is None}


@pytest.mark.parametrize(("name", "version"), [("torch", "2.5.1"), ("torch", "2.11.0"), ("torch", "2.14.1+cpu"),
                                               ("torchvision", "0.20.1"), ("torchvision", "0.26.0")])
def test_another_torch_2_satisfies_the_requirements(name, version):
    """pip keeps an installed torch that satisfies hfl's requirement (`pip install -e .` would not replace it)."""
    assert installed_requirements()[name].specifier.contains(Version(version), prereleases=True)


@pytest.mark.parametrize(("name", "version"), [("torch", "1.13.1"), ("torch", "3.0.0"), ("torchvision", "0.15.2")])
def test_torch_outside_the_tested_range_does_not(name, version):
    assert not installed_requirements()[name].specifier.contains(Version(version))


def test_constraints_pin_exactly_the_builds_the_golden_fixtures_were_recorded_with():
    lines = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    pins = {r.name: str(r.specifier) for r in map(Requirement, filter(None, lines))}
    assert pins == {name: f"=={version}" for name, version in RECORDED_WITH.items()}


def outcome_of_requiring_recorded_builds() -> tuple[str, str]:
    """What `require_recorded_builds` does to its test: passed, Skipped or Failed, and its message."""
    try:
        require_recorded_builds()
    except (pytest.skip.Exception, pytest.fail.Exception) as outcome:
        return type(outcome).__name__, outcome.msg
    return "passed", ""


def test_golden_tests_skip_under_another_torch_naming_the_pinned_version(monkeypatch):
    monkeypatch.setattr(recorded.importlib.metadata, "version", {"torch": "2.5.1", "torchvision": "0.29.1"}.get)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    kind, message = outcome_of_requiring_recorded_builds()
    assert kind == "Skipped" and message.startswith("the recorded numbers need torch==2.14.1, torchvision==0.29.1 (found torch 2.5.1)")
    monkeypatch.setenv(REQUIRE_ENV, "1")  # CI: a mismatch fails
    kind, message = outcome_of_requiring_recorded_builds()
    assert kind == "Failed" and "torch==2.14.1" in message


def test_a_local_build_label_is_the_recorded_release(monkeypatch):
    monkeypatch.setattr(recorded.importlib.metadata, "version", {"torch": "2.14.1+cu130", "torchvision": "0.29.1+cpu"}.get)
    monkeypatch.setenv(REQUIRE_ENV, "1")
    assert outcome_of_requiring_recorded_builds() == ("passed", "")
