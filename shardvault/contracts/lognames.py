"""The names of archived log files, and their order: PostgreSQL's WAL (``WAL_FILE``) and
MariaDB's binary logs (``BINLOG_FILE``); ``shardvault.contracts.wal_archive`` says what each
kind is. Nothing here imports another contract, so the request models may check a binary log
position with it."""

from __future__ import annotations

import re
from collections.abc import Iterable

# Segments (24 hex digits), timeline history files, backup history files, partial segments:
# the names shardvault_agent.wal.walspool accepts (it imports nothing of ShardVault's: a unit test
# holds the two patterns equal).
WAL_FILE = re.compile(r"^[0-9A-F]{24}(\.partial|\.[0-9A-F]{8}\.backup)?$|^[0-9A-F]{8}\.history$")
BINLOG_FILE = re.compile(r"^(?!.*--)[A-Za-z0-9_][A-Za-z0-9_.-]{0,59}\.[0-9]{6,}$")
LOG_KINDS = {"wal": WAL_FILE, "binlog": BINLOG_FILE}


def log_order(name: str) -> tuple[str, int]:
    """A log file's place in its log: a binlog's by its basename and ordinal (a seventh digit
    sorts after six), a WAL file's by its name (PostgreSQL's names sort in WAL order)."""
    if BINLOG_FILE.fullmatch(name):
        base, _, ordinal = name.rpartition(".")
        return base, int(ordinal)
    return name, 0


def binlog_run(first: str, names: Iterable[str]) -> list[str]:
    """The binary logs of ``names`` from ``first`` on, consecutive ordinals of its basename:
    the run stops at the first one missing. The archive's run (``wal.archive.binlog_archive``)
    and the node's replay (``engines.mariadb.replay``) count it alike."""
    held = {log_order(n): n for n in names if BINLOG_FILE.fullmatch(n)}
    run, (base, ordinal) = [], log_order(first)
    while (base, ordinal) in held:
        run.append(held[(base, ordinal)])
        ordinal += 1
    return run
