"""Checks of a restored shard: the engine's integrity check and the request's validation queries.

A *check* is a name and a verdict: ``ok``, or what went wrong. A *validation query* comes from
whoever started the restore, so it runs with no power to change anything or reach the host
(``shardvault.contracts.sqlcheck`` has already refused anything but one read-only statement; the
engine enforces the rest, in its module: ``engines.postgres_checks``, ``engines.sqlite_checks``):

- PostgreSQL: a temporary login role (``shardvault_check_<random>``), not a superuser, holding
  only ``pg_read_all_data``: no file, program or replication privilege. The restored server's
  ``pg_hba.conf`` gets one line letting that role in over the local socket while the queries
  run; then the file is put back and the role dropped. Each query runs in a read-only
  transaction under ``statement_timeout``.
- SQLite: the file opened read-only, with an authorizer that allows reads and function calls
  only, and a progress handler that ends a query after the time limit.

A query the engine *refuses* (a write, a privilege, the time limit) is the request's fault, not
the backup's: it is reported as ``refused: ...`` and the restore fails with ``InvalidRequest``.
This module holds what every engine shares: verdicts, running the queries, refusals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardvault.contracts.sqlcheck import FIX, check_validation_queries
from shardvault.errors import InvalidRequest

REFUSED = "refused: "
TRUE_VALUES = frozenset({"t", "true", "1"})


def verdict(value: Any) -> str:
    """A query passes when its first value is true (``t``/``true``/``1``/``True``)."""
    text = str(value).strip().lower()
    return "ok" if text in TRUE_VALUES else f"returned {text!r}"


def run_queries(execute: Callable[[str], str], queries: list[str]) -> dict[str, str]:
    """Runs each query through ``execute`` (which returns a verdict or raises)."""
    return {query: execute(query) for query in check_validation_queries(queries)}


def raise_if_refused(shard_id: str, checks: dict[str, str]) -> None:
    """A refused validation query fails the restore as a bad request, naming the query."""
    refused = {q: v for q, v in checks.items() if v.startswith(REFUSED)}
    if refused:
        query, why = next(iter(refused.items()))
        raise InvalidRequest(
            f"validation query {query!r} was refused on shard {shard_id}: "
            f"{why.removeprefix(REFUSED)}.",
            fix=FIX,
        )
