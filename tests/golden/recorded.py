"""The builds the golden fixtures were recorded with, and the guard of the tests whose numbers need them.

Float results change with the torch build, so a test that asserts recorded numbers skips under another
torch (a researcher's own install keeps working) with a message naming the pinned version; CI sets
`HFL_REQUIRE_RECORDED_TORCH=1` (.ci/run), under which another torch fails those tests instead, so that
CI never passes by skipping them. constraints.txt pins exactly these versions (tests/test_install.py).
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
from packaging.version import Version

RECORDED_WITH = {"torch": "2.14.1", "torchvision": "0.29.1"}
REQUIRE_ENV = "HFL_REQUIRE_RECORDED_TORCH"


def other_builds() -> list[str]:
    """The installed distributions whose release differs from the recorded one, as `name version`.
    A local label (2.14.1+cpu, +cu130) is the same release, as pip's `==2.14.1` counts it."""
    installed = {name: Version(importlib.metadata.version(name)) for name in RECORDED_WITH}
    return [f"{name} {version}" for name, version in installed.items() if version.public != RECORDED_WITH[name]]


def require_recorded_builds() -> None:
    """Skip the calling test under builds other than the recorded ones; fail it instead under CI's
    HFL_REQUIRE_RECORDED_TORCH=1."""
    found = other_builds()
    if not found:
        return
    pinned = ", ".join(f"{name}=={version}" for name, version in RECORDED_WITH.items())
    message = (f"the recorded numbers need {pinned} (found {', '.join(found)}); "
               f'install them with: pip install -e ".[dev]" -c constraints.txt')
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1: {message}", pytrace=False)
    pytest.skip(message)
