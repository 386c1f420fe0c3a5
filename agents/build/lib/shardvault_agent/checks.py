"""Checks of a restored shard: the engine's integrity check and the request's validation queries.

A *check* is a name and a verdict: ``ok``, or what went wrong. A *validation query* comes from
whoever started the restore, so it runs with no power to change anything or reach the host
(``shardvault.sqlcheck`` has already refused anything but one read-only statement; the
engine enforces the rest):

- PostgreSQL: a temporary login role (``shardvault_check_<random>``), not a superuser, holding
  only ``pg_read_all_data``: no file, program or replication privilege. The restored server's
  ``pg_hba.conf`` gets one line letting that role in over the local socket while the queries
  run; then the file is put back and the role dropped. Each query runs in a read-only
  transaction under ``statement_timeout``.
- SQLite: the file opened read-only, with an authorizer that allows reads and function calls
  only, and a progress handler that ends a query after the time limit.

A query the engine *refuses* (a write, a privilege, the time limit) is the request's fault, not
the backup's: it is reported as ``refused: ...`` and the restore fails with ``InvalidRequest``.

``pg_amcheck --install-missing`` installs the amcheck extension where a database lacks it; the
check drops it again from those databases, so the restored databases hold what the backup held.
"""

from __future__ import annotations

import secrets
import sqlite3
import subprocess
import time
from collections.abc import Callable
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from shardvault.errors import InvalidRequest
from shardvault.sqlcheck import FIX, QUERY_TIMEOUT_SECONDS, check_validation_queries

REFUSED = "refused: "
TRUE_VALUES = frozenset({"t", "true", "1"})
# PostgreSQL errors that mean "the query was not allowed", by SQLSTATE class or code.
PG_REFUSALS = {
    "25006": "it tried to write (read-only transaction)",
    "42501": "it needs a privilege validation queries do not have",
    "57014": "it ran longer than {timeout} s",
    "0A000": "it uses a feature not allowed here",
}


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


# --- SQLite --------------------------------------------------------------------------------------
SQLITE_ALLOWED = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)


def sqlite_checks(db: Path, queries: list[str]) -> dict[str, str]:
    """``PRAGMA integrity_check``, then the validation queries under the authorizer."""
    # as_uri() escapes '#' and '?' in the file name, which would otherwise cut off mode=ro.
    with closing(sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True)) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
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


# --- PostgreSQL ----------------------------------------------------------------------------------
def postgres_checks(
    instance: Any, queries: list[str], *, jobs: int, heapallindexed: bool = False
) -> dict[str, str]:
    """pg_amcheck on every database (leaving no extension behind), then the queries as a
    read-only role. ``instance``: a started ``PostgresInstance``."""
    checks = {"pg_amcheck --all": amcheck(instance, jobs=jobs, heapallindexed=heapallindexed)}
    if queries:
        with check_role(instance) as role:
            checks |= run_queries(lambda q: postgres_query(instance, role, q), queries)
    return checks


def amcheck(instance: Any, *, jobs: int, heapallindexed: bool) -> str:
    added = what_amcheck_would_add(instance)
    command = [
        str(instance.bin_dir / "pg_amcheck"),
        "-h", str(instance.socket_dir), "-p", str(instance.port), "-U", "postgres",
        "--all", "--install-missing", f"--jobs={jobs}",
    ]  # fmt: skip
    if heapallindexed:
        command.append("--heapallindexed")
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, cwd="/")
    finally:
        for dbname, statements in added.items():
            with admin(instance, dbname) as conn:
                for statement in statements:
                    conn.execute(statement)
    return "ok" if done.returncode == 0 else (done.stdout + done.stderr)[-500:]


def what_amcheck_would_add(instance: Any) -> dict[str, list[str]]:
    """Per database, the statements that remove what ``--install-missing`` adds there: the
    amcheck extension and its schema ``pg_amcheck``, where they are absent now."""
    with admin(instance) as conn:
        names = [r[0] for r in conn.execute("SELECT datname FROM pg_database WHERE datallowconn")]
    added: dict[str, list[str]] = {}
    for name in names:
        with admin(instance, name) as conn:
            has_extension, has_schema = conn.execute(
                "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'amcheck'), "
                "EXISTS (SELECT FROM pg_namespace WHERE nspname = 'pg_amcheck')"
            ).fetchone()
        undo = [] if has_extension else ["DROP EXTENSION IF EXISTS amcheck"]
        undo += [] if has_schema else ["DROP SCHEMA IF EXISTS pg_amcheck"]
        if undo:
            added[name] = undo
    return added


def admin(instance: Any, dbname: str = "postgres") -> psycopg.Connection:
    """The agent's own connection (the ``postgres`` role over the socket)."""
    return psycopg.connect(instance.conninfo_for(dbname), autocommit=True)


@contextmanager
def check_role(instance: Any):
    """A temporary, unprivileged login role for validation queries; gone afterwards, and the
    restored server's pg_hba.conf as it was."""
    role = f"shardvault_check_{secrets.token_hex(6)}"
    with admin(instance) as conn:
        hba = Path(conn.execute("SHOW hba_file").fetchone()[0])
        if not hba.is_relative_to(instance.data_dir):
            raise InvalidRequest(
                f"the restored server reads its pg_hba.conf from {hba}, outside its data "
                "directory: validation queries cannot be given a read-only login there.",
                fix="restore without validation queries (pg_amcheck still checks every "
                "database), or keep pg_hba.conf in the data directory.",
            )
        original = hba.read_bytes()
        name = sql.Identifier(role)
        conn.execute(
            sql.SQL(
                "CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
                "NOBYPASSRLS CONNECTION LIMIT 1"
            ).format(name)
        )
        try:
            conn.execute(sql.SQL("GRANT pg_read_all_data TO {}").format(name))
            hba.write_bytes(f"local all {role} trust\n".encode() + original)
            conn.execute("SELECT pg_reload_conf()")
            yield role
        finally:
            hba.write_bytes(original)
            conn.execute("SELECT pg_reload_conf()")
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(name))


def postgres_query(instance: Any, role: str, query: str) -> str:
    options = (
        f"-c default_transaction_read_only=on -c statement_timeout={QUERY_TIMEOUT_SECONDS}s "
        f"-c lock_timeout={QUERY_TIMEOUT_SECONDS}s"
    )
    with connect_as(instance, role, options) as conn:
        conn.read_only = True  # BEGIN READ ONLY, whatever the session settings say
        try:
            # prepare=True: the extended protocol, where the server refuses a second statement
            # (the simple protocol would run "...; COMMIT; START TRANSACTION READ WRITE; ...").
            row = conn.execute(query, prepare=True).fetchone()
        except psycopg.Error as error:
            refusal = PG_REFUSALS.get(error.sqlstate or "", "").format(
                timeout=QUERY_TIMEOUT_SECONDS
            )
            message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            return f"{REFUSED}{refusal} ({message})" if refusal else f"error: {message}"
        finally:
            conn.rollback()
    return verdict(row[0]) if row else "returned no row"


def connect_as(instance: Any, role: str, options: str, wait: float = 5.0) -> psycopg.Connection:
    """Connects as ``role``; the server reloads pg_hba.conf after the signal, so the first
    tries may still meet the old rules."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return psycopg.connect(
                host=str(instance.socket_dir),
                port=instance.port,
                user=role,
                dbname="postgres",
                options=options,
                application_name="shardvault-check",
            )
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
