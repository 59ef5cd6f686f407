"""The house's import rules (ARCHITECTURE.md, "Dependencies point down"): no import circles among hfl's
modules, and a config is data that imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests.conftest import ROOT


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imported_modules(tree: ast.AST, known: set[str]) -> set[str]:
    """The hfl modules `tree` imports, at module level or inside functions alike (either runs, so
    either closes a circle); imports under `if TYPE_CHECKING:` only name types and never run."""
    found: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if is_type_checking_block(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from hfl.data import cache` imports the module hfl.data.cache; `from hfl.config import X`, hfl.config.
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                         for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return found & known


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the hfl modules it imports, read from the sources under `root`/hfl (none is imported)."""
    paths = {module_name(path, root): path for path in (root / "hfl").rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(ast.parse(path.read_text()), known) - {name} for name, path in paths.items()}


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        return list(error.args[1])
    return None


def test_no_hfl_modules_import_each_other_in_a_circle() -> None:
    cycle = first_cycle(import_graph(ROOT))

    assert cycle is None, f"import circle: {' -> '.join(reversed(cycle))}; put the piece both need in a module below both"


def test_the_cycle_check_finds_a_circle_through_an_import_inside_a_function(tmp_path: Path) -> None:
    package = tmp_path / "hfl"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / "__init__.py").write_text("")
    (package / "config.py").write_text("from hfl.data import loader\n")
    (package / "data" / "loader.py").write_text("def f():\n    from hfl.config import load\n")
    (package / "data" / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hfl.config import X\n")
    graph = import_graph(tmp_path)

    assert graph["hfl.config"] == {"hfl.data.loader"}
    assert graph["hfl.data.typed"] == set()
    assert sorted(first_cycle(graph)[1:]) == ["hfl.config", "hfl.data.loader"]


@pytest.mark.parametrize("module", ["hfl.config", "hfl.yaml_loader", "hfl.data.cache", "hfl.models.sources"])
def test_a_config_module_imports_no_torch(module: str) -> None:
    """A config is data: reading and checking one must not pay for torch (seconds per process)."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('hfl'))"

    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
