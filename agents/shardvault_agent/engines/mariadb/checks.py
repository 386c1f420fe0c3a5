"""MariaDB's checks of a restored server (``checks`` defines the terms): ``mariadb-check
--all-databases`` (``CHECK TABLE`` on every table), then the validation queries (each with the
database it names as the session's default) as a temporary account
(``shardvault_check_<random>``@``localhost``) holding ``SELECT`` only: no ``FILE``, ``PROCESS``,
``SUPER`` or write privilege, one connection, a random password that lives only in a private
option file for the queries' duration; the account is dropped afterwards. Each query runs as
one prepared statement (a second statement is a syntax error) in a read-only transaction under
``max_statement_time``.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardvault.contracts.sqlcheck import QUERY_TIMEOUT_SECONDS, split_database
from shardvault_agent.checks import REFUSED, run_queries, verdict
from shardvault_agent.engines.mariadb.server import MariadbServer, program

TABLES_CHECK = "mariadb-check --all-databases"
# MariaDB errors that mean "the query was not allowed", by error number.
REFUSALS = {
    "1142": "it needs a privilege validation queries do not have",
    "1143": "it needs a privilege validation queries do not have",
    "1227": "it needs a privilege validation queries do not have",
    "1044": "it needs a privilege validation queries do not have",
    "1045": "it needs a privilege validation queries do not have",
    "1792": "it tried to write (read-only transaction)",
    "1969": "it ran longer than {timeout} s",
}
ERROR = re.compile(r"ERROR (\d+) \(\w+\)(?: at line \d+)?: (.*)")


def mariadb_checks(server: MariadbServer, queries: list[str]) -> dict[str, str]:
    checks = {TABLES_CHECK: check_tables(server)}
    if queries:
        with check_account(server) as options:
            checks |= run_queries(lambda q: account_query(options, q), queries)
    return checks


def check_tables(server: MariadbServer) -> str:
    """``ok`` when every table checks OK; else the tool's last words."""
    command = [program("mariadb-check"), *server.client_args(), "--all-databases", "--check"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd="/")
    lines = (done.stdout + done.stderr).splitlines()
    failed = [line for line in lines if line.startswith(("error", "Error", "warning"))]
    if done.returncode == 0 and not failed and lines:
        return "ok"
    return "\n".join(lines)[-500:] or f"mariadb-check exited with {done.returncode}"


@contextmanager
def check_account(server: MariadbServer) -> Iterator[Path]:
    """A temporary account allowed ``SELECT`` only; yields the private option file that
    reaches the server as it. The password never appears on a command line (statements go
    to the client on its standard input) or in a log."""
    name = f"shardvault_check_{secrets.token_hex(6)}"
    password = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="shardvault-check-") as private:  # 0700
        options = Path(private) / "client.cnf"
        options.touch(mode=0o600)
        options.write_text(f"[client]\nuser={name}\npassword={password}\nsocket={server.socket}\n")
        account = f"'{name}'@'localhost'"
        try:
            server.sql(
                f"CREATE USER {account} IDENTIFIED BY '{password}' WITH MAX_USER_CONNECTIONS 1;"
                f" GRANT SELECT ON *.* TO {account};"
            )
        except RuntimeError:  # its message may echo the statement, password and all
            raise RuntimeError("the validation queries' account could not be created") from None
        try:
            yield options
        finally:
            server.sql(f"DROP USER IF EXISTS {account};")


def account_query(options: Path, text: str) -> str:
    """One validation query (``[DATABASE:]QUERY``) as the check account, with its database as
    the session's default: its first value's verdict, or why not."""
    database, query = split_database(text)
    command = [program("mariadb"), f"--defaults-file={options}", "--batch", "--skip-column-names"]
    if database is not None:  # a checked name, one argument: no shell, no SQL
        command.append(f"--database={database}")
    # The query travels hex-encoded into one prepared statement: the client cannot split it
    # at a ';' and the server prepares one statement only, so a second one is refused.
    script = (
        f"SET SESSION max_statement_time = {QUERY_TIMEOUT_SECONDS};\n"
        f"SET @query = CONVERT(X'{query.encode().hex()}' USING utf8mb4);\n"
        "PREPARE query FROM @query;\n"
        "START TRANSACTION READ ONLY;\n"
        "EXECUTE query;\n"
        "ROLLBACK;\n"
    )
    done = subprocess.run(
        command, input=script, capture_output=True, text=True, check=False, cwd="/"
    )
    if done.returncode != 0:
        found = ERROR.search(done.stderr)
        if found is None:
            return f"error: {done.stderr.strip()[-300:]}"
        number, message = found.groups()
        refusal = REFUSALS.get(number, "").format(timeout=QUERY_TIMEOUT_SECONDS)
        return f"{REFUSED}{refusal} ({message})" if refusal else f"error: {message}"
    first = done.stdout.splitlines()[0].split("\t")[0] if done.stdout.strip() else None
    return verdict(first) if first is not None else "returned no row"
