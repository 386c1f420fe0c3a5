"""No import cycle among the control plane's modules (issue 45): a cycle makes the import
order decide which module sees a half-initialised other, and hides which room depends on
which. Imports under ``if TYPE_CHECKING:`` (types only) do not count."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shardvault"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules a module imports when it is imported (not under TYPE_CHECKING,
    not inside a function: those run later)."""
    found: set[str] = set()
    for statement in tree.body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardvault"):
                found.add(node.module or "")
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
    return found & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    path: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                found.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_the_control_planes_modules_import_each_other_without_a_cycle():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    graph = {
        name: imported(ast.parse(path.read_text()), known) - {name} for name, path in files.items()
    }
    assert graph["shardvault.data.planning"], "the graph is empty: the test reads nothing"
    assert cycles(graph) == []


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
