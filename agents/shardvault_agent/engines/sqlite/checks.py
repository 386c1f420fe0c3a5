"""SQLite's checks of a restored database: ``PRAGMA integrity_check``, then the validation
queries on the file opened read-only, under an authorizer that allows reads and function calls
only, and a progress handler that ends a query after the time limit (``checks`` defines the
terms)."""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from pathlib import Path

from shardvault.contracts.sqlcheck import QUERY_TIMEOUT_SECONDS
from shardvault_agent.checks import REFUSED, run_queries, verdict

SQLITE_ALLOWED = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)


def sqlite_checks(db: Path, queries: list[str]) -> dict[str, str]:
    """``PRAGMA integrity_check``, then the validation queries under the authorizer."""
    # as_uri() escapes '#' and '?' in the file name, which would otherwise cut off mode=ro.
    with closing(sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True)) as conn:
        try:
            integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        except sqlite3.DatabaseError as error:  # too damaged to check: a failed check
            return {f"integrity_check {db.name}": f"error: {error}"}
        checks = {f"integrity_check {db.name}": integrity}
        conn.set_authorizer(sqlite_authorizer)

        def execute(query: str) -> str:
            deadline = time.monotonic() + QUERY_TIMEOUT_SECONDS
            conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
            try:
                row = conn.execute(query).fetchone()
            except (sqlite3.Error, sqlite3.Warning) as error:
                return sqlite_failure(error)
            return verdict(row[0]) if row else "returned no row"

        checks |= {f"{db.name}: {q}": v for q, v in run_queries(execute, queries).items()}
    return checks


def sqlite_authorizer(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in SQLITE_ALLOWED else sqlite3.SQLITE_DENY


def sqlite_failure(error: Exception) -> str:
    text = str(error)
    if "not authorized" in text:
        return f"{REFUSED}it is not a plain read ({text})"
    if "interrupted" in text:
        return f"{REFUSED}it ran longer than {QUERY_TIMEOUT_SECONDS} s"
    if "one statement" in text:
        return f"{REFUSED}{text}"
    return f"error: {text}"
