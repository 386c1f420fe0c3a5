"""MariaDB's binary logs, archived for point-in-time restores.

Terms:
- *binary log* (binlog): the server's log of committed changes, a numbered series of files
  (``<basename>.<ordinal>``, ``mysql-bin.000012``; ``shardvault.contracts.wal_archive``'s
  ``binlog`` kind), the last one *open* (being written). A transaction is never split across
  two files. Each event is stamped with the second (UTC) its statement started.
- *source*: the archiver reads the *closed* files straight from the server's binlog
  directory (no spool copy: the server keeps them durable until they are purged), each
  file's modification time being when it was closed (the archive's ``pushed_at``).
- *closing*: a file open with changes in it for the policy's ``archive.max_delay_seconds`` is
  closed (``FLUSH BINARY LOGS``), which bounds what a lost host loses, as PostgreSQL's
  ``archive_timeout`` does; a closed file goes at once.
- *purge*: MariaDB keeps no record of what was archived, so the agent purges the server's
  files up to the oldest one not yet archived (``PURGE BINARY LOGS TO``), and the server's own
  expiry must be off (``readiness_problems``): it would purge what the archive lacks.
- *position*: ``file:offset`` of an event group's boundary. A backup records where its copy
  is consistent (``mariabackup``'s binlog info file) as the marker's ``binlog_file`` and
  ``binlog_pos``: replay starts there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardvault.contracts.wal_archive import BATCH_MAX_BYTES, BINLOG_FILE
from shardvault.errors import EngineError
from shardvault_agent.engines.mariadb.server import MariadbServer

log = logging.getLogger("shardvault.agent.mariadb")

# mariabackup's record of the binlog position its copy is consistent at: file, position and
# GTID, tab-separated (the older name first: MariaDB 10.11 writes it; 11.x the newer).
BINLOG_INFO = ("xtrabackup_binlog_info", "mariadb_backup_binlog_info")
# What an archived shard's server must be set to (``readiness_problems``).
FLUSHED = "(flushed)"  # the open file as last seen: the one this source's flush just opened
CONFIRM_SECONDS = 60.0  # how long a source trusts that its socket reaches the shard's server
# How long the listing a look read answers ``waiting`` (the batches the look packs, the
# heartbeat's spool state) before the server is asked again: one client process a look.
LISTING_SECONDS = 1.0
SETTINGS = (
    "SELECT @@log_bin, @@binlog_format, @@binlog_expire_logs_seconds, @@max_binlog_size, "
    "@@encrypt_binlog"
)


def backup_position(copy: Path) -> dict[str, str]:
    """The marker's binlog position of a copy (none: the server writes no binary log)."""
    for name in BINLOG_INFO:
        path = copy / name
        if path.is_file() and (fields := path.read_text().split()):
            file, pos, *gtid = fields
            if BINLOG_FILE.fullmatch(file) and pos.isdigit():
                return {"binlog_file": file, "binlog_pos": pos, "binlog_gtid": ",".join(gtid)}
    return {}


def readiness_problems(server: MariadbServer) -> list[str]:
    """What keeps the shard's binary logs from being archived, each with its fix."""
    log_bin, binlog_format, expire, max_size, encrypted = server.sql(SETTINGS).split("\t")
    problems = []
    if log_bin != "1":
        problems.append("binary logging is off (start the server with log_bin, and server_id)")
    if binlog_format.upper() not in ("ROW", "MIXED"):
        problems.append(
            f"binlog_format is {binlog_format}: a replay of statements is not deterministic "
            "(set binlog_format = ROW)"
        )
    if expire != "0":
        problems.append(
            "the server purges its binary logs itself (binlog_expire_logs_seconds = "
            f"{expire}): it would purge what the archive lacks; the agent purges once "
            "archived (set binlog_expire_logs_seconds = 0 and expire_logs_days = 0)"
        )
    if int(max_size) > BATCH_MAX_BYTES:
        problems.append(
            f"max_binlog_size is {int(max_size):,} bytes, over the archive's batch of "
            f"{BATCH_MAX_BYTES:,} (set max_binlog_size = 256M or less)"
        )
    if encrypted == "1":
        problems.append(
            "encrypt_binlog is on: the agent reads the files, which only the server can "
            "decrypt (the archive seals them itself with the policy's encryption: set "
            "encrypt_binlog = OFF)"
        )
    return problems


@dataclass
class BinlogSource:
    """The archiver's source of one shard's binary logs (the module docstring). ``server``
    answers the shard's server, confirmed to be the one of its data directory."""

    shard_id: str
    server: Callable[[], MariadbServer]
    kind: str = "binlog"
    due_at_once: bool = True
    # The open file as last seen, since when it holds changes, and the GTID position read
    # before this source's last flush (what an empty new file's server says).
    open_name: str = ""
    changed_at: float | None = None
    flushed_gtid: str | None = None
    archived: set[str] = field(default_factory=set)  # recorded, not purged yet
    confirmed: tuple[float, MariadbServer] | None = None  # (monotonic time, the server)
    # The last listing (monotonic time, binlog directory, logs, GTID position); None once a
    # flush or purge changed the server's files.
    listing: tuple[float, Path, list[tuple[str, int]], str] | None = None
    guard: threading.Lock = field(default_factory=threading.Lock)

    def linked(self) -> dict[str, str]:
        return {}

    def _server(self) -> MariadbServer:
        """The shard's server, confirmed again every ``CONFIRM_SECONDS`` (a look asks it
        once more: a client process, on the database's host)."""
        now = time.monotonic()
        if self.confirmed is None or now - self.confirmed[0] >= CONFIRM_SECONDS:
            self.confirmed = (now, self.server())
        return self.confirmed[1]

    def sql(self, statements: str) -> str:
        try:
            return self._server().sql(statements)
        except RuntimeError as error:
            self.confirmed = None  # the server is asked who it is again
            raise EngineError(
                f"MariaDB shard {self.shard_id}'s binary logs: {error}",
                fix="the agent's account needs RELOAD, BINLOG MONITOR and BINLOG ADMIN; see the "
                "server's log.",
            ) from None

    def _logs(self, reuse: bool = False) -> tuple[Path, list[tuple[str, int]], str]:
        """The binlog directory, the server's binary logs in its own order (the last one
        open), and its GTID position (what it last logged: ``look`` compares it). ``reuse``:
        the last listing will do if it is younger than ``LISTING_SECONDS``."""
        now, last = time.monotonic(), self.listing
        if reuse and last is not None and now - last[0] < LISTING_SECONDS:
            return last[1], last[2], last[3]
        answer = self.sql("SELECT @@log_bin_basename, @@gtid_binlog_pos; SHOW BINARY LOGS")
        first, *lines = answer.splitlines()
        basename, _, gtid = first.partition("\t")
        logs = []
        for line in lines:
            name, size, *_ = line.split("\t")
            if not BINLOG_FILE.fullmatch(name):
                raise EngineError(
                    f"MariaDB shard {self.shard_id}: binary log {name!r} has a name the archive "
                    "does not take.",
                    fix="set log_bin to a basename of letters, digits, '.', '_' and single '-'.",
                )
            logs.append((name, int(size)))
        self.listing = (now, Path(basename).parent, logs, gtid)
        return Path(basename).parent, logs, gtid

    def waiting(self) -> list[Path]:
        """The closed files not archived yet, from the look's listing when it is fresh: a
        file closed since is taken at the next look, a second later. (No backup waits for
        binary logs to be archived: ``Archiver.wait_archived`` is PostgreSQL's, whose spool
        is a directory read each time.)"""
        directory, logs, _ = self._logs(reuse=True)
        with self.guard:
            return [directory / name for name, _ in logs[:-1] if name not in self.archived]

    def look(self, now: float, max_delay: float) -> None:
        """Closes the open file once it has held changes for ``max_delay`` seconds: a file
        first seen may hold some; one this source's flush opened holds them once the server's
        GTID position moved past the one read before that flush."""
        _, logs, gtid = self._logs()
        if not logs:
            return
        with self.guard:
            left = bool(self.archived) and logs[0][0] in self.archived
        if left:  # a file the server kept through the last purge
            self.purge()
        name = logs[-1][0]
        if name != self.open_name:
            fresh = self.open_name == FLUSHED
            self.open_name = name
            self.changed_at = None if fresh else now
        if self.changed_at is None and gtid != self.flushed_gtid:
            self.changed_at = now
        if self.changed_at is not None and now - self.changed_at >= max_delay:
            self.flushed_gtid = gtid  # read before the flush: a commit between goes in either
            self.sql("FLUSH BINARY LOGS")
            self.open_name, self.changed_at, self.listing = FLUSHED, None, None

    def let_go(self, names: list[str]) -> None:
        """The archive recorded ``names``: the server's files are purged up to the oldest one
        not recorded yet (``purge``)."""
        with self.guard:
            self.archived.update(names)
        self.purge()

    def purge(self) -> None:
        """Purges the server's files before the oldest one not recorded yet (a batch recorded
        before an older one's purges nothing early). The server may keep a file it still needs
        (its binlog checkpoint not past it) without a word: what it still lists stays known as
        archived, never stored twice, and the next look purges again. A purge that fails is
        logged, not raised: the files are stored, and a failed send would store them again."""
        try:
            _, logs, _ = self._logs()
            with self.guard:
                kept = next((n for n, _ in logs if n not in self.archived), None)
            if kept is None or kept == logs[0][0]:
                return
            self.listing = None
            self.sql(f"PURGE BINARY LOGS TO '{kept}'")  # a name the pattern checked
            _, logs, _ = self._logs()
        except Exception as error:  # any: raised, the send would store them again and again
            log.warning("shard %s's archived binary logs not purged: %s", self.shard_id, error)
            return
        listed = {name for name, _ in logs}
        with self.guard:
            self.archived = {n for n in self.archived if n in listed}
        log.info("purged shard %s's binary logs before %s: archived", self.shard_id, kept)
