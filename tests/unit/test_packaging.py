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
    "shardvault/aws/lambda_support.py",
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


def pins(*files: str) -> dict[str, str]:
    """name -> exact version of each ``name==version`` line of the files."""
    found: dict[str, str] = {}
    for file in files:
        for raw in (ROOT / file).read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                name = re.split(r"\[", name, maxsplit=1)[0].lower()
                assert found.get(name, version) == version, f"{name} pinned twice, differently"
                found[name] = version
    return found


RUNTIME = ("requirements.txt", "agents/requirements.txt")


def test_the_constraints_file_is_the_runtime_pins() -> None:
    """``pip install -c constraints.txt ./ ./agents`` installs what the tests ran with. pip
    refuses extras in a constraints file: ``psycopg[binary]`` is listed as the two packages."""
    text = (ROOT / "constraints.txt").read_text()
    assert "[" not in "".join(line.split("#")[0] for line in text.splitlines())
    expected = pins(*RUNTIME)
    expected["psycopg-binary"] = expected["psycopg"]
    assert pins("constraints.txt") == expected


@pytest.mark.parametrize("pyproject", ["pyproject.toml", "agents/pyproject.toml"])
def test_every_declared_range_admits_the_pinned_version(pyproject: str) -> None:
    """A floor above the pin would make the tested versions uninstallable; every declared
    dependency is pinned (the pins are what the tests ran with)."""
    from packaging.requirements import Requirement

    pinned = pins(*RUNTIME)
    for text in tomllib.loads((ROOT / pyproject).read_text())["project"]["dependencies"]:
        requirement = Requirement(text)
        name = requirement.name.lower()
        if name == "shardvault":
            continue  # the shared core: this repository
        assert name in pinned, f"{pyproject}: {name} is declared but not pinned"
        assert requirement.specifier.contains(pinned[name]), (text, pinned[name])
