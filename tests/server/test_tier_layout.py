"""The tier's layout holds: one rule per file, a facade with no protocol branch, and a
package that ships every subpackage of the server."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIER = REPO / "server" / "tier"


def _branch_names(tree: ast.AST) -> set[str]:
    """Names and attributes read in the tests of if statements and conditional expressions."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Attribute):
                    out.add(sub.attr)
                elif isinstance(sub, ast.Name):
                    out.add(sub.id)
    return out


def test_the_facade_is_small_and_branches_on_no_protocol() -> None:
    src = (TIER / "coordinator.py").read_text()
    assert len(src.splitlines()) < 400
    forbidden = {"is_async", "kind", "mode", "tree", "over_tree", "enabled", "inline", "continuation"}
    assert not forbidden & _branch_names(ast.parse(src))


def test_no_tier_file_is_long() -> None:
    for f in [*TIER.glob("*.py"), REPO / "server" / "cohort.py", REPO / "server" / "coordinator.py"]:
        assert len(f.read_text().splitlines()) <= 600, f


def test_the_wheel_ships_every_server_subpackage() -> None:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for init in (REPO / "server").rglob("__init__.py"):
        rel = init.parent.relative_to(REPO / "server")
        name = ".".join(("orchard", "server", *rel.parts))
        assert name in cfg["packages"], f"{name} is not in pyproject's packages: a wheel would leave it out"
