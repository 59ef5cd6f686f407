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


def requirement_closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions `pip install NAME[extras]` installs: NAME's requirements under those extras,
    theirs, and so on, as the installed distributions declare them (normalised names)."""
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    pending = [(name, extras)]
    while pending:
        dist, wanted = pending.pop()
        if canonicalize_name(dist) in found:
            continue
        found.add(canonicalize_name(dist))
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement whose marker held but which is absent: pip would have failed
        for requirement in map(Requirement, requires):
            environments = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                pending.append((requirement.name, tuple(requirement.extras)))
    return found


def imported_modules(paths) -> set[str]:
    """The top-level modules the files import or `pytest.importorskip`, anywhere in them."""
    import ast

    modules: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                modules.add(node.args[0].value.split(".")[0])
    return modules


def test_every_module_the_tests_import_comes_from_the_readme_test_command():
    """A test needs only what `pip install -e ".[dev]"` installs: a module installed by hand (optuna
    once was, on the machine CI ran on) would let the suite pass there and fail on a fresh clone."""
    import sys

    from packaging.utils import canonicalize_name

    files = sorted((ROOT / "tests").rglob("*.py"))
    local = {p.stem for p in files} | {p.parent.name for p in files}  # the tests' own modules (conftest, ...)
    modules = imported_modules(files) - set(sys.stdlib_module_names) - local - {"hfl", "tests", "__future__"}
    providers = importlib.metadata.packages_distributions()
    closure = requirement_closure("hfl", ("dev",))
    missing = {m: providers.get(m, ["not installed"]) for m in modules
               if not {canonicalize_name(d) for d in providers.get(m, [])} & closure}
    assert missing == {}, 'add them to the dev extra in pyproject.toml (or make their tests skip, naming the extra)'
