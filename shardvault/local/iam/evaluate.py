"""Evaluation: whether a principal's statements allow a request, by IAM's rules.

An explicit ``Deny`` (in the principal's policies or the resource's policy) refuses; else an
``Allow`` of the principal's allows; else the request is refused (implicit deny). A principal
of another account than the resource's (*cross-account*) needs both: its own policies' Allow
and an Allow of the resource's policy that names it. A statement
applies when its action, resource (and, in a resource policy, principal) match and every
condition holds. Actions match without regard to case, resources with it; ``*`` and ``?`` are
the only wildcards.

Conditions: the String, Arn, Numeric, Bool and Null operators, their ``IfExists`` forms and
the ``ForAllValues:``/``ForAnyValue:`` set operators (an absent or empty key satisfies
``ForAllValues``, as on AWS). An operator outside that list raises ``UnsupportedCondition``
rather than being skipped: a statement is never allowed because its condition went unread.
(moto's ``access_control`` reads ``StringEquals`` only, and turns an ``Allow`` whose
condition fails into a ``Deny``, which would refuse calls AWS allows.)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shardvault.local.iam.requests import Context, Request


class UnsupportedCondition(Exception):
    """A condition operator the local stack does not evaluate."""


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    allowed_by: tuple[int, ...] = ()  # the indexes of the identity statements that allow it
    denied_by: str | None = None  # "identity" or "resource" for an explicit deny
    # Cross-account: the principal's own policies allow it, the resource's policy does not.
    no_resource_allow: bool = False


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


@functools.lru_cache(maxsize=4096)
def wildcard(pattern: str, case: bool) -> re.Pattern[str]:
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile(f"^{body}$", 0 if case else re.IGNORECASE | re.DOTALL)


def matches(patterns: Any, value: str, *, case: bool = True) -> bool:
    return any(wildcard(str(p), case).match(value) for p in as_list(patterns))


def applies(statement: dict[str, Any], request: Request, principal_arn: str | None) -> bool:
    if "Action" in statement and not matches(statement["Action"], request.action, case=False):
        return False
    if "NotAction" in statement and matches(statement["NotAction"], request.action, case=False):
        return False
    if "Resource" in statement and not matches(statement["Resource"], request.resource):
        return False
    if "NotResource" in statement and matches(statement["NotResource"], request.resource):
        return False
    if principal_arn is not None and not principal_matches(statement, principal_arn):
        return False
    return conditions_hold(statement.get("Condition", {}), request.context)


def principal_matches(statement: dict[str, Any], principal_arn: str) -> bool:
    """A resource policy statement's ``Principal``: ``*``, ``{"AWS": "*"}`` or ARNs."""
    principal = statement.get("Principal", "*")
    if principal == "*":
        return True
    aws = as_list(principal.get("AWS", []))
    account = principal_arn.split(":")[4] if principal_arn.count(":") >= 5 else ""
    # An account (its id, or its root's ARN) names every principal of that account.
    names_account = account in aws or f"arn:aws:iam::{account}:root" in aws
    return "*" in aws or principal_arn in aws or bool(account and names_account)


def conditions_hold(condition: dict[str, dict[str, Any]], context: Context) -> bool:
    return all(
        holds(operator, key, as_list(expected), context.get(key))
        for operator, keys in condition.items()
        for key, expected in keys.items()
    )


def holds(operator: str, key: str, expected: list[Any], actual: list[str] | None) -> bool:
    quantifier, _, base = operator.rpartition(":")
    if_exists = base.endswith("IfExists")
    base = base.removesuffix("IfExists")
    if base == "Null":
        absent = not actual
        return any(str(e).lower() == str(absent).lower() for e in expected)
    compare = comparison(base)
    negated = "Not" in base
    if quantifier == "ForAllValues":
        return not actual or all(compare_any(compare, expected, v) for v in actual) != negated
    if quantifier == "ForAnyValue":
        return bool(actual) and any(compare_any(compare, expected, v) for v in actual) != negated
    if quantifier:
        raise UnsupportedCondition(operator)
    if not actual:
        return if_exists or negated
    return any(compare_any(compare, expected, v) for v in actual) != negated


def compare_any(compare: Callable[[str, str], bool], expected: Iterable[Any], value: str) -> bool:
    return any(compare(str(e), value) for e in expected)


def comparison(base: str) -> Callable[[str, str], bool]:
    positive = base.replace("Not", "")
    if positive in ("StringEquals", "ArnEquals"):
        return lambda e, v: e == v
    if positive == "StringEqualsIgnoreCase":
        return lambda e, v: e.lower() == v.lower()
    if positive in ("StringLike", "ArnLike"):
        return lambda e, v: bool(wildcard(e, True).match(v))
    if positive == "Bool":
        return lambda e, v: e.lower() == v.lower()
    numeric = {
        "NumericEquals": lambda e, v: float(v) == float(e),
        "NumericLessThan": lambda e, v: float(v) < float(e),
        "NumericLessThanEquals": lambda e, v: float(v) <= float(e),
        "NumericGreaterThan": lambda e, v: float(v) > float(e),
        "NumericGreaterThanEquals": lambda e, v: float(v) >= float(e),
    }
    if positive in numeric:
        return numeric[positive]
    raise UnsupportedCondition(base)


def evaluate(
    identity: list[dict[str, Any]],
    resource_policy: list[dict[str, Any]],
    request: Request,
    principal_arn: str,
    *,
    cross_account: bool = False,
) -> Verdict:
    """The verdict on ``request`` for a principal with ``identity`` statements;
    ``cross_account``: the principal is of another account than the resource."""
    for statement in resource_policy:
        if statement["Effect"] == "Deny" and applies(statement, request, principal_arn):
            return Verdict(False, denied_by="resource")
    allowed_by = []
    for index, statement in enumerate(identity):
        if not applies(statement, request, None):
            continue
        if statement["Effect"] == "Deny":
            return Verdict(False, denied_by="identity")
        allowed_by.append(index)
    if (
        allowed_by
        and cross_account
        and not resource_allows(resource_policy, request, principal_arn)
    ):
        return Verdict(False, tuple(allowed_by), no_resource_allow=True)
    return Verdict(bool(allowed_by), tuple(allowed_by))


def resource_allows(statements: list[dict[str, Any]], request: Request, principal_arn: str) -> bool:
    """Whether the resource's policy has an Allow that names the principal (or everyone)."""
    return any(s["Effect"] == "Allow" and applies(s, request, principal_arn) for s in statements)
