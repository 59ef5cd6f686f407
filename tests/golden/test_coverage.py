"""Every registered method has a golden run (tests/golden/runs.py), so that no method's numbers can
change unnoticed."""

import yaml

from hfl.registry import METHODS
from tests.golden.runs import runs


def method_of(path, overrides):
    for override in overrides:
        if override.startswith("method.name="):
            return override.split("=", 1)[1]
    return yaml.safe_load(path.read_text())["method"]["name"]


def test_every_registered_method_has_a_golden_run():
    import hfl.config  # noqa: F401  (fills the registries)

    covered = {method_of(path, overrides) for path, overrides in runs().values()}
    shipped = {name for name in METHODS.names() if METHODS.info(name)}  # not docs/extending.md's example, once a test registered it
    assert sorted(shipped - covered) == []
