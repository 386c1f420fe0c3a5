"""PostgreSQL's checks of a restored server (``checks`` defines the terms): ``pg_amcheck`` on
every database, then the validation queries, each in the database it names (else
``postgres``: ``shardvault.contracts.sqlcheck``), as a temporary login role
(``shardvault_check_<random>``), not a superuser, holding only ``pg_read_all_data``: no file,
program or replication privilege. The restored server's ``pg_hba.conf`` gets one line letting
that role in over the local socket while the queries run; then the file is put back and the
role dropped. Each query runs in a read-only transaction under ``statement_timeout``.

``pg_amcheck --install-missing`` installs the amcheck extension where a database lacks it; the
check drops it again from those databases, so the restored databases hold what the backup held.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql

from shardvault.contracts.sqlcheck import QUERY_TIMEOUT_SECONDS, split_database
from shardvault.errors import InvalidRequest
from shardvault_agent.checks import REFUSED, run_queries, verdict
from shardvault_agent.engines.postgres.server import PostgresInstance

EXISTS = "SELECT EXISTS (SELECT FROM pg_database WHERE datname = %s AND datallowconn)"
# PostgreSQL errors that mean "the query was not allowed", by SQLSTATE class or code.
PG_REFUSALS = {
    "25006": "it tried to write (read-only transaction)",
    "42501": "it needs a privilege validation queries do not have",
    "57014": "it ran longer than {timeout} s",
    "0A000": "it uses a feature not allowed here",
}


def postgres_checks(
    instance: PostgresInstance, queries: list[str], *, jobs: int, heapallindexed: bool = False
) -> dict[str, str]:
    """pg_amcheck on every database (leaving no extension behind), then the queries as a
    read-only role. ``instance``: a started ``PostgresInstance``."""
    checks = {"pg_amcheck --all": amcheck(instance, jobs=jobs, heapallindexed=heapallindexed)}
    if queries:
        with check_role(instance) as role:
            checks |= run_queries(lambda q: postgres_query(instance, role, q), queries)
    return checks


def amcheck(instance: PostgresInstance, *, jobs: int, heapallindexed: bool) -> str:
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


def what_amcheck_would_add(instance: PostgresInstance) -> dict[str, list[str]]:
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


def admin(instance: PostgresInstance, dbname: str = "postgres") -> psycopg.Connection:
    """The agent's own connection (the ``postgres`` role over the socket)."""
    return psycopg.connect(instance.conninfo_for(dbname), autocommit=True)


@contextmanager
def check_role(instance: PostgresInstance) -> Iterator[str]:
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


def postgres_query(instance: PostgresInstance, role: str, text: str) -> str:
    """One validation query (``[DATABASE:]QUERY``) as the check role, in its database (else
    ``postgres``): its first value's verdict, or why not."""
    database, query = split_database(text)
    dbname = database or "postgres"
    with admin(instance) as conn:
        if not conn.execute(EXISTS, (dbname,)).fetchone()[0]:
            return f"error: the restored server has no database {dbname!r} that takes connections"
    options = (
        f"-c default_transaction_read_only=on -c statement_timeout={QUERY_TIMEOUT_SECONDS}s "
        f"-c lock_timeout={QUERY_TIMEOUT_SECONDS}s"
    )
    try:
        conn = connect_as(instance, role, options, dbname)
    except psycopg.OperationalError as error:  # e.g. CONNECT revoked from PUBLIC there
        message = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
        return f"error: the check role cannot connect to {dbname!r}: {message}"
    with conn:
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


def connect_as(
    instance: PostgresInstance, role: str, options: str, dbname: str, wait: float = 5.0
) -> psycopg.Connection:
    """Connects as ``role``; the server reloads pg_hba.conf after the signal, so the first
    tries may still meet the old rules (only that refusal is tried again: a database that
    refuses the role's connection says so at once)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return psycopg.connect(
                host=str(instance.socket_dir),
                port=instance.port,
                user=role,
                dbname=dbname,
                options=options,
                application_name="shardvault-check",
            )
        except psycopg.OperationalError as error:
            if "pg_hba.conf" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
