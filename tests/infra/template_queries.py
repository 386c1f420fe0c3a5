"""Queries on a synthesized CloudFormation template and on ASL definitions, for the tests.

A *reference* is a ``Ref`` or ``Fn::GetAtt`` naming a resource by its logical id; the
*statements of a role* are those of every policy attached to it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def referenced_ids(value: Any) -> set[str]:
    """The logical ids that ``value`` references, at any depth."""
    if isinstance(value, list):
        return set().union(*(referenced_ids(v) for v in value)) if value else set()
    if not isinstance(value, dict):
        return set()
    if "Ref" in value:
        return {value["Ref"]}
    if "Fn::GetAtt" in value:
        return {as_list(value["Fn::GetAtt"])[0]}
    return set().union(*(referenced_ids(v) for v in value.values())) if value else set()


def only(resources: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    assert len(resources) == 1, f"expected one resource, found {sorted(resources)}"
    return next(iter(resources.items()))


def role_statements(template: dict[str, Any], role_id: str) -> list[dict[str, Any]]:
    """Every statement granted to the role: inline, attached or in a managed policy."""
    resources = template["Resources"]
    role = resources[role_id]["Properties"]
    statements = [s for p in role.get("Policies", []) for s in p["PolicyDocument"]["Statement"]]
    for resource_id in referenced_ids(role.get("ManagedPolicyArns", [])):
        document = resources[resource_id]["Properties"]["PolicyDocument"]
        statements += document["Statement"]
    for resource in resources.values():
        attached_to = resource.get("Properties", {}).get("Roles", [])
        if resource["Type"] == "AWS::IAM::Policy" and role_id in referenced_ids(attached_to):
            statements += resource["Properties"]["PolicyDocument"]["Statement"]
    return statements


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
