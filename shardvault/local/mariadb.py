"""MariaDB servers for the tests and benchmarks: real servers on Unix sockets.

The server control is the agent's (``shardvault_agent.engines.mariadb.server``: its docstring
defines *server*, *mysql user* and *client*); this module adds what only the tests do: create
a server (``mariadb-install-db``) and put a write load on it.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

from shardvault_agent.engines.mariadb.server import (
    MARIADB_USER,
    MariadbServer,
    give_to_mysql,
    program,
    run,
    socket_for,
    stop_server,
)
from shardvault_agent.engines.serveruser import as_root, ensure_traversable, make_dirs

__all__ = ["MariadbServer", "Transfers", "init_server", "stop_server"]


# Binary logs as ``shardvault_agent.engines.mariadb.binlogs`` needs them: rows, no expiry (the
# agent purges what it archived), files of at most 16 MiB (a test's archive has several).
BINLOG_OPTIONS = (
    "--log-bin=mysql-bin",
    "--server-id=1",
    "--binlog-format=ROW",
    "--binlog-expire-logs-seconds=0",
    "--max-binlog-size=16M",
)


def init_server(data_dir: Path, *, binlog: bool = False) -> MariadbServer:
    """A new, started server on ``data_dir`` (absent or empty); ``binlog``: writing binary
    logs as an archived shard needs (``BINLOG_OPTIONS``)."""
    data_dir = data_dir.absolute()
    ensure_traversable(data_dir, MARIADB_USER, make_dirs(data_dir))
    give_to_mysql(data_dir)
    command = [program("mariadb-install-db"), "--no-defaults", f"--datadir={data_dir}"]
    command += ["--auth-root-authentication-method=socket", "--skip-test-db"]
    run([*command, "--user=mysql"] if as_root() else command)
    server = MariadbServer(data_dir, socket_for(data_dir), BINLOG_OPTIONS if binlog else ())
    server.start()
    return server


ACCOUNTS = 100
BALANCE = 1000


class Transfers:
    """A write load whose every commit keeps an invariant: ``ACCOUNTS`` accounts whose balances
    always sum to ``ACCOUNTS * BALANCE``; each transaction moves an amount between two and
    logs it. A copy consistent at any instant keeps the sum and matches its log."""

    def __init__(self, server: MariadbServer, database: str = "bank") -> None:
        self.server, self.database = server, database
        self.stopped = threading.Event()
        self.committed = 0
        self.thread: threading.Thread | None = None

    def create(self) -> None:
        rows = ",".join(f"({i}, {BALANCE})" for i in range(ACCOUNTS))
        self.server.sql(
            f"CREATE DATABASE {self.database}; USE {self.database}; "
            "CREATE TABLE accounts (id INT PRIMARY KEY, balance INT NOT NULL) ENGINE=InnoDB; "
            "CREATE TABLE moves (id INT AUTO_INCREMENT PRIMARY KEY, src INT, dst INT, "
            "amount INT, pad VARCHAR(200)) ENGINE=InnoDB; "
            f"INSERT INTO accounts VALUES {rows};"
        )

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        picks = random.Random(7)
        while not self.stopped.is_set():
            batch = []
            for _ in range(20):  # one client call, twenty transactions
                src, dst = picks.sample(range(ACCOUNTS), 2)
                amount = picks.randint(1, 50)
                batch.append(
                    "START TRANSACTION; "
                    f"UPDATE accounts SET balance = balance - {amount} WHERE id = {src}; "
                    f"UPDATE accounts SET balance = balance + {amount} WHERE id = {dst}; "
                    f"INSERT INTO moves (src, dst, amount, pad) VALUES ({src}, {dst}, {amount}, "
                    f"REPEAT('x', 200)); COMMIT;"
                )
            self.server.sql(" ".join(batch), database=self.database)
            self.committed += len(batch)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=60)


def consistent(server: MariadbServer, database: str = "bank") -> tuple[int, int]:
    """The copy's (sum of balances, moves) after checking that the log explains every balance:
    each account's balance is its start plus what it received minus what it sent."""
    total = int(server.sql("SELECT SUM(balance) FROM accounts", database=database))
    unexplained = server.sql(
        "SELECT COUNT(*) FROM accounts a WHERE a.balance <> "
        f"{BALANCE} + COALESCE((SELECT SUM(amount) FROM moves WHERE dst = a.id), 0) "
        "- COALESCE((SELECT SUM(amount) FROM moves WHERE src = a.id), 0)",
        database=database,
    )
    assert unexplained == "0", f"{unexplained} balances differ from the moves' log"
    moves = int(server.sql("SELECT COUNT(*) FROM moves", database=database))
    return total, moves
