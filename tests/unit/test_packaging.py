"""Each package declares what it imports: ``pip install ./ ./agents`` (the README's install)
must give programs that start, not ones that fail on the first import of an undeclared
library (the CLI once crashed on ``--help``: ``croniter`` was imported, not declared)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Modules outside what the package's own dependencies cover, each with its reason:
NOT_COVERED = {
    # the local stack runs moto's server: a development install (requirements-dev.txt)
    "shardvault/local",
    # Powertools is the Lambda functions' runtime (requirements-lambda.txt); the CLI and the
    # agent never import it
    "shardvault/lambda_support.py",
}


def imported_top_levels(package: Path) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if any(relative.startswith(skip) for skip in NOT_COVERED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"}


def declared(pyproject: Path) -> set[str]:
    requirements = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {
        re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        for requirement in requirements
    }


@pytest.mark.parametrize(
    ("package", "pyproject", "own"),
    [
        ("shardvault", "pyproject.toml", {"shardvault"}),
        ("agents/shardvault_agent", "agents/pyproject.toml", {"shardvault_agent"}),
    ],
)
def test_every_import_is_declared(package: str, pyproject: str, own: set[str]) -> None:
    providers = packages_distributions()
    needs = {
        name: {d.lower().replace("_", "-") for d in providers.get(name, [name])}
        for name in imported_top_levels(ROOT / package) - own
    }
    have = declared(ROOT / pyproject)
    missing = sorted(name for name, dists in needs.items() if not dists & have)
    assert not missing, f"{pyproject} does not declare the distributions of {missing}"
