"""The engine seam holds: engine knowledge lives in the engine adapters only.

An engine's name is tested only in ``shardvault_agent/engines/`` (and the control plane's
``shardvault/contracts/engines.py`` traits), the production agent imports nothing from the local
stack (``shardvault/local/``), and every engine has an adapter with every hook of the interface and
the control plane's traits."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
from shardvault_agent.engines import ADAPTERS, adapter_class
from shardvault_agent.engines.base import EngineAdapter

from shardvault.contracts.engines import TRAITS
from shardvault.contracts.models import Engine

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agents" / "shardvault_agent"
ENGINE_NAMES = {member.name for member in Engine} | {member.value for member in Engine}


def modules(root: Path, *outside: Path) -> list[Path]:
    return [
        path
        for path in sorted(root.rglob("*.py"))
        if not any(path == o or o in path.parents for o in outside)
    ]


def engine_tests(tree: ast.AST) -> list[str]:
    """``Engine.POSTGRES`` and comparisons with an engine's name (``== "sqlite"``)."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Engine"
            and node.attr in ENGINE_NAMES
        ):
            found.append(f"line {node.lineno}: Engine.{node.attr}")
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant) and side.value in ENGINE_NAMES:
                    found.append(f"line {node.lineno}: compares with {side.value!r}")
    return found


def imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_no_engine_name_is_tested_outside_the_engine_adapters():
    outside = [
        *modules(AGENT, AGENT / "engines"),
        *modules(
            ROOT / "shardvault",
            ROOT / "shardvault" / "local",
            ROOT / "shardvault" / "contracts" / "engines.py",
        ),
    ]
    assert len(outside) > 40
    found = {
        path.relative_to(ROOT).as_posix(): hits
        for path in outside
        if (hits := engine_tests(ast.parse(path.read_text())))
    }
    assert found == {}


def test_the_agent_imports_nothing_from_the_local_stack():
    found = {
        path.relative_to(ROOT).as_posix(): sorted(local)
        for path in modules(AGENT)
        if (local := {m for m in imported(ast.parse(path.read_text())) if "shardvault.local" in m})
    }
    assert found == {}


@pytest.mark.parametrize("engine", list(Engine))
def test_every_engine_has_an_adapter_with_every_hook_and_its_traits(engine):
    sides = [base for base in EngineAdapter.__mro__[1:] if getattr(base, "_is_protocol", False)]
    assert {side.__name__ for side in sides} >= {
        "BackupSource",
        "LoadSignals",
        "RestoreTarget",
        "ServerControl",
    }
    hooks = {
        name
        for side in sides
        for name, member in vars(side).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    assert {"checkpoint", "stop", "release", "finish", "adoptable", "stop_server"} <= hooks
    adapter = adapter_class(engine)
    assert {h for h in hooks if not callable(getattr(adapter, h, None))} == set()
    assert isinstance(adapter.shard_fields, tuple)
    assert isinstance(adapter.fsyncs_restored_files, bool)
    assert isinstance(adapter.checkpoint_flushes, bool)
    if adapter.screen_module is not None:  # the helper's preload: a module of the agent's
        assert importlib.util.find_spec(adapter.screen_module) is not None
    assert engine in ADAPTERS
    assert engine in TRAITS
