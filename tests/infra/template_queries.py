"""Queries on a synthesized CloudFormation template and on ASL definitions, for the tests.

A *reference* is a ``Ref`` or ``Fn::GetAtt`` naming a resource by its logical id; the
*statements of a role* are those of every policy attached to it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# One reading of a template's references and role statements: the local stack's IAM uses it.
from shardvault.local.iam.template import as_list, referenced_ids, role_statements

__all__ = [
    "actions",
    "as_list",
    "iter_states",
    "only",
    "placeholders",
    "referenced_ids",
    "role_statements",
    "tasks_without_retry",
]
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


def only(resources: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    assert len(resources) == 1, f"expected one resource, found {sorted(resources)}"
    return next(iter(resources.items()))


def actions(statement: dict[str, Any]) -> list[str]:
    return as_list(statement.get("Action", []))


def iter_states(states: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every state, including those of Map processors (inline or distributed) and Parallel
    branches, at any depth."""
    for name, state in states.items():
        yield name, state
        processor = state.get("ItemProcessor") or state.get("Iterator")
        if processor:
            yield from iter_states(processor.get("States", {}))
        for branch in state.get("Branches", []):
            yield from iter_states(branch.get("States", {}))


def tasks_without_retry(definition: dict[str, Any]) -> list[str]:
    return [
        name
        for name, state in iter_states(definition.get("States", {}))
        if state.get("Type") == "Task" and not state.get("Retry")
    ]


def placeholders(text: str) -> set[str]:
    return set(PLACEHOLDER.findall(text))
