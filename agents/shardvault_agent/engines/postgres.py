"""PostgreSQL: one shard per instance, copied with the non-exclusive low-level backup API.

- check: ``data_dir`` is a directory holding ``PG_VERSION``. Every connection then confirms
  that ``conninfo`` reaches the instance of ``data_dir`` (``SHOW data_directory`` is the same
  directory, symlinks followed) before anything else is done on it: otherwise the agent would
  take one server's backup mode and copy another's files.
- flush: ``CHECKPOINT``.
- checkpoint: on a connection held until stop, a temporary physical replication slot that
  reserves WAL from now on (so no segment the copy needs is recycled, and nothing is left
  behind if the agent dies: the slot dies with the session), then ``pg_backup_start``. The
  listing is the data directory minus what PostgreSQL documents as safe to omit.
- stop: ``pg_backup_stop``, then at the cut's instant the cluster's restore point
  (``shardvault.cut``); the tail is the backup label (and tablespace map) plus every WAL
  segment from the start to the restore point (to the stop LSN without a cut), copied from
  ``pg_wal`` while the slot holds them, so the backup restores on its own without a WAL
  archive.
- release: end the backup if it is still running and close the session (dropping the slot).

Restore: ``engines.postgres_restore`` (recovery to the cut or a target, the checks), with the
server control of ``engines.pgserver``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from shardvault.cut import (
    LOCK_TIMEOUT_SECONDS,
    PAUSE_HOLD_SECONDS,
    PAUSE_LEAD_SECONDS,
    CutRequest,
)
from shardvault.errors import CheckpointNotFound, EngineError, ShardDataMissing
from shardvault.models import FileEntry
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines import postgres_restore
from shardvault_agent.engines.base import Capture, Finishing, list_tree, size_or_zero
from shardvault_agent.engines.pgserver import stop_server

log = logging.getLogger("shardvault.agent.postgres")

# Directories whose contents are omitted (the directory itself is kept): see "Backing Up the
# Data Directory" in PostgreSQL's "Making a Base Backup Using the Low Level API".
EMPTY_DIRS = frozenset(
    {
        "pg_wal",
        "pg_replslot",
        "pg_dynshmem",
        "pg_notify",
        "pg_serial",
        "pg_snapshots",
        "pg_stat_tmp",
        "pg_subtrans",
    }
)
DATA_DIR_FIX = (
    "correct 'data_dir' in the agent config: the instance's data directory, as "
    "'SHOW data_directory' answers over the shard's conninfo."
)
SKIP_FILES = frozenset({"postmaster.pid", "postmaster.opts", "backup_label", "tablespace_map"})
RELATION_FILE = re.compile(
    r"^(?P<db>base/\d+|global)/(?P<node>\d+)(?P<fork>_fsm|_vm|_init)?(\.\d+)?$"
)


def skip_dir(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return rel in EMPTY_DIRS or name.startswith("pgsql_tmp")


def unlogged_relations(root: Path) -> set[tuple[str, str]]:
    """Relations with an init fork are unlogged: only the init fork is copied."""
    return {
        (p.parent.relative_to(root).as_posix(), p.name[: -len("_init")])
        for p in root.glob("base/*/*_init")
    }


def listing(root: Path) -> list[FileEntry]:
    unlogged = unlogged_relations(root)

    def skip_file(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if rel in SKIP_FILES or name == "pg_internal.init" or name.startswith("pgsql_tmp"):
            return True
        match = RELATION_FILE.match(rel)
        return bool(match and match["fork"] != "_init" and (match["db"], match["node"]) in unlogged)

    return list_tree(root, skip_dir=skip_dir, skip_file=skip_file)


@dataclass
class HeldBackup:
    connection: psycopg.Connection
    start_lsn: str
    start_wal: str
    stopped: bool = False


# What a backup needs of the server (PostgresAdapter.check_ready), in one round trip.
READINESS = """
SELECT current_setting('wal_level'),
       current_setting('max_replication_slots')::int
           - (SELECT count(*) FROM pg_replication_slots),
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
       has_function_privilege('pg_backup_start(text, boolean)', 'EXECUTE'),
       has_function_privilege('pg_create_restore_point(text)', 'EXECUTE')
"""


class PostgresAdapter:
    shard_fields = ("data_dir", "conninfo")
    config_fields = ()
    # Recovery from a backup label fsyncs the whole data directory before it replays.
    fsyncs_restored_files = True

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.held: dict[tuple[str, str], HeldBackup] = {}
        self.lock = threading.Lock()

    def check(self, shard: ShardConfig) -> None:
        data_dir = shard.data_dir
        where = f"PostgreSQL shard {shard.shard_id}: data_dir {data_dir}"
        try:
            if data_dir is None or not data_dir.exists():
                raise ShardDataMissing(f"{where} does not exist.", fix=DATA_DIR_FIX)
            if not data_dir.is_dir():
                raise ShardDataMissing(f"{where} is not a directory.", fix=DATA_DIR_FIX)
            if not (data_dir / "PG_VERSION").is_file():
                raise ShardDataMissing(
                    f"{where} holds no PG_VERSION: it is not a PostgreSQL data directory.",
                    fix=DATA_DIR_FIX,
                )
        except PermissionError:
            raise ShardDataMissing(
                f"{where} cannot be read by the agent's user.",
                fix="run the agent as a user that can read the data directory (e.g. postgres).",
            ) from None

    def check_ready(self, shard: ShardConfig) -> None:
        """``check``, then what the backup will ask of the server: that it answers (as the
        instance of ``data_dir``), ``wal_level`` above minimal (``pg_backup_start``), a free
        replication slot (the backup holds one), and a role that may take a slot, run
        ``pg_backup_start`` and create the cut's restore point."""
        conn = self._connect(shard)
        try:
            wal_level, free_slots, replicates, may_backup, may_cut = conn.execute(
                READINESS
            ).fetchone()
        except psycopg.Error as error:
            raise EngineError(
                f"PostgreSQL shard {shard.shard_id}: its settings cannot be read: {error}".strip(),
                fix="check that the agent's role may connect and read settings.",
            ) from None
        finally:
            conn.close()
        problems = []
        if wal_level == "minimal":
            problems.append("wal_level is minimal (set replica, and restart the server)")
        if free_slots < 1:
            problems.append(
                "no replication slot is free (raise max_replication_slots, or drop unused slots)"
            )
        if not replicates:
            problems.append("the agent's role lacks REPLICATION (ALTER ROLE ... REPLICATION)")
        if not may_backup:
            problems.append(
                "the agent's role may not run pg_backup_start (GRANT EXECUTE ON FUNCTION "
                "pg_backup_start, pg_backup_stop to it)"
            )
        if not may_cut:
            problems.append(
                "the agent's role may not create the backup's restore point (GRANT EXECUTE ON "
                "FUNCTION pg_create_restore_point(text) to it)"
            )
        if problems:
            raise EngineError(
                f"PostgreSQL shard {shard.shard_id} cannot be backed up: " + "; ".join(problems),
                fix="change what is named on the server; the agent's next heartbeat reports it.",
            )

    def _connect(self, shard: ShardConfig) -> psycopg.Connection:
        """A session on the shard's instance, once it is confirmed to be the instance of
        ``data_dir``."""
        self.check(shard)
        try:
            conn = psycopg.connect(
                shard.conninfo, autocommit=True, application_name="shardvault-agent"
            )
        except psycopg.Error as error:
            raise EngineError(
                f"cannot connect to PostgreSQL of shard {shard.shard_id}: {error}".strip(),
                fix="check 'conninfo' in the agent config and that the server is running.",
            ) from None
        try:
            refuse_other_instance(conn, shard)
        except BaseException:
            conn.close()
            raise
        return conn

    def shard_bytes(self, shard: ShardConfig) -> int:
        base = shard.data_dir / "base"
        return size_or_zero(
            self, shard, lambda: sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
        )

    def flush(self, shard: ShardConfig) -> None:
        with self._connect(shard) as conn:
            conn.execute("CHECKPOINT")

    def checkpoint(self, shard: ShardConfig, backup_id: str, work_dir: Path) -> Capture:
        self.check(shard)
        refuse_tablespaces(shard)
        self.release(shard, backup_id)  # a retried checkpoint starts over
        conn = self._connect(shard)  # refuses another instance before the slot is taken
        slot_name = f"shardvault_{backup_id}_{shard.shard_id}".lower()
        slot = re.sub(r"[^a-z0-9_]", "_", slot_name)[:63]
        try:
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (slot,))
        except psycopg.Error as error:
            conn.close()
            raise EngineError(
                f"cannot create a replication slot on shard {shard.shard_id}: {error}".strip(),
                fix="raise max_replication_slots (one free slot per running backup) and let the "
                "agent's user have the REPLICATION attribute.",
            ) from None
        try:
            started = time.time()
            lsn = conn.execute(
                "SELECT pg_backup_start(%s, true)", (f"shardvault {backup_id}",)
            ).fetchone()[0]
            wal = conn.execute("SELECT pg_walfile_name(%s)", (lsn,)).fetchone()[0]
        except psycopg.Error as error:
            conn.close()
            raise EngineError(
                f"pg_backup_start failed on shard {shard.shard_id}: {error}",
                fix="check the server log; wal_level must be replica or logical.",
            ) from None
        with self.lock:
            self.held[(backup_id, shard.shard_id)] = HeldBackup(conn, str(lsn), wal)
        marker = {"start_lsn": str(lsn), "start_wal": wal, "checkpoint_at": f"{started:.6f}"}
        # PostgreSQL writes relation files with pwrite (never through a mapping), and any
        # page written after pg_backup_start is in the WAL the backup keeps: a file unchanged
        # since the parent's scan needs no reading.
        return Capture(
            root=shard.data_dir,
            files=listing(shard.data_dir),
            marker=marker,
            mutable=True,
            trust_identity=True,
        )

    def holds(self, shard: ShardConfig, backup_id: str) -> bool:
        held = self.held.get((backup_id, shard.shard_id))
        return held is not None and not held.connection.closed

    def stop(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, cut: CutRequest | None = None
    ) -> Capture:
        held = self.held.get((backup_id, shard.shard_id))
        if held is None or held.connection.closed:
            raise CheckpointNotFound(
                f"shard {shard.shard_id} is not in backup mode for {backup_id} "
                "(was the agent restarted?).",
                fix="retry the backup; PostgreSQL ended the backup when the session closed.",
            )
        conn = held.connection
        try:
            lsn, label, spcmap = conn.execute(
                "SELECT lsn, labelfile, spcmapfile FROM pg_backup_stop(false)"
            ).fetchone()
            held.stopped = True
            stop_wal = conn.execute("SELECT pg_walfile_name(%s)", (lsn,)).fetchone()[0]
        except psycopg.Error as error:
            raise EngineError(
                f"pg_backup_stop failed on shard {shard.shard_id}: {error}",
                fix="check the server log.",
            ) from None
        marker = {"stop_lsn": str(lsn), "stop_wal": stop_wal}
        end = str(lsn)
        if cut is not None:
            marker |= restore_point(conn, shard, cut)
            end = marker["cut_lsn"]
        last_wal, last_bytes = self._wait_flushed(conn, end)
        tail = work_dir / "tail" / shard.shard_id
        shutil.rmtree(tail, ignore_errors=True)
        (tail / "pg_wal").mkdir(parents=True)
        (tail / "backup_label").write_text(label)
        if spcmap:
            (tail / "tablespace_map").write_text(spcmap)
        for name in wal_segments(shard.data_dir / "pg_wal", held.start_wal, last_wal):
            source, copy = shard.data_dir / "pg_wal" / name, tail / "pg_wal" / name
            if name == last_wal and cut is not None:
                copy_wal_up_to(source, copy, last_bytes)
            else:
                shutil.copyfile(source, copy)
        files = [f for f in list_tree(tail) if not f.path.endswith("/")]
        # The WAL is copied: end the session now, which drops the slot holding the WAL.
        self.release(shard, backup_id)
        return Capture(root=tail, files=files, marker=marker, mutable=False)

    @staticmethod
    def _wait_flushed(conn: psycopg.Connection, lsn: str, timeout: float = 30.0) -> tuple[str, int]:
        """Waits until the WAL up to ``lsn`` is on disk; returns the segment that holds the
        byte before ``lsn`` and how many of its bytes reach ``lsn``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if conn.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (lsn,)).fetchone()[
                0
            ]:
                break
            time.sleep(0.02)
        name, offset = conn.execute(
            "SELECT file_name, file_offset FROM pg_walfile_name_offset(%s::pg_lsn)", (lsn,)
        ).fetchone()
        # At a segment's boundary the function names the segment before, at offset 0: all of it.
        return name, int(offset) or WHOLE_SEGMENT

    def held_backups(self) -> set[str]:
        return set()  # backup mode and its slot end with the session: nothing outlives the agent

    def release(self, shard: ShardConfig, backup_id: str) -> None:
        with self.lock:
            held = self.held.pop((backup_id, shard.shard_id), None)
        if held is None or held.connection.closed:
            return
        try:
            if not held.stopped:
                held.connection.execute("SELECT pg_backup_stop(false)")
        except psycopg.Error:
            pass  # closing the session below aborts the backup anyway
        finally:
            held.connection.close()

    # --- restore (engines.postgres_restore) -----------------------------------------------
    def finish(self, job: Finishing) -> dict[str, Any]:
        return postgres_restore.finish(self.config, job)

    def adoptable(self, shard_id: str, result: dict[str, Any]) -> dict[str, Any]:
        return postgres_restore.adoptable(shard_id, result)

    def serving(self, root: Path) -> dict[str, Any] | None:
        port = postgres_restore.running_port(root)
        return None if port is None else {"port": port}

    def stop_server(self, root: Path, *, immediate: bool = False) -> None:
        stop_server(root, mode="immediate" if immediate else "fast")

    def start_server(self, root: Path, server: dict[str, Any]) -> None:
        postgres_restore.restart_replaced(root, server["port"])


WHOLE_SEGMENT = -1  # copy_wal_up_to: the segment's every byte


def restore_point(conn: psycopg.Connection, shard: ShardConfig, cut: CutRequest) -> dict[str, str]:
    """At the cut's instant, the cluster's restore point in this shard's WAL (see
    ``shardvault.cut``), its WAL made durable at once, inside the commit pause when the
    policy asks for one; the marker fields that record it."""
    pause = CommitPause(conn, cut.commit_lock) if cut.commit_lock is not None else None
    if pause is not None:
        wait_until(cut.at - PAUSE_LEAD_SECONDS)
        pause.hold()
    late = time.time() - cut.at
    wait_until(cut.at)
    try:
        lsn, created = conn.execute(
            "SELECT pg_create_restore_point(%s), extract(epoch FROM clock_timestamp())",
            (cut.name,),
        ).fetchone()
    except psycopg.Error as error:
        raise EngineError(
            f"cannot create restore point {cut.name} on shard {shard.shard_id}: {error}".strip(),
            fix="GRANT EXECUTE ON FUNCTION pg_create_restore_point(text) to the agent's role.",
        ) from None
    finally:
        if pause is not None:
            wait_until(cut.at + PAUSE_HOLD_SECONDS)
            pause.let_go()
    # A restore point is not flushed by itself: a transaction's commit flushes it now. Where
    # that cannot be (synchronous_commit off, a read-only default), _wait_flushed waits for
    # the WAL writer instead.
    with contextlib.suppress(psycopg.Error):
        conn.execute("SELECT txid_current()")
    return {
        "cut_name": cut.name,
        "cut_lsn": str(lsn),
        "cut_at": f"{float(created):.6f}",
        "cut_late_seconds": f"{max(0.0, late):.6f}",
        **({"cut_pause": pause.recorded()} if pause is not None else {}),
    }


def wait_until(instant: float) -> None:
    if (ahead := instant - time.time()) > 0:
        time.sleep(ahead)


class CommitPause:
    """The cut's commit pause on one node (``shardvault.cut``): the commit lock held
    exclusively from just before the instant to ``PAUSE_HOLD_SECONDS`` after it. Asking for it
    queues the distributed commits that come after (PostgreSQL grants no shared lock past a
    waiting exclusive one) while those under way finish; not granted within
    ``LOCK_TIMEOUT_SECONDS``, the node cuts without it."""

    def __init__(self, conn: psycopg.Connection, key: int) -> None:
        self.conn, self.key = conn, key
        self.asked = self.locked = self.released = 0.0

    def hold(self) -> None:
        self.asked = time.time()
        try:
            self.conn.execute(f"SET lock_timeout = {int(LOCK_TIMEOUT_SECONDS * 1000)}")
            self.conn.execute("SELECT pg_advisory_lock(%s)", (self.key,))
            self.locked = time.time()
        except psycopg.Error as error:  # lock_timeout: a commit under way did not end
            log.warning("commit pause not taken (lock %d): %s", self.key, error)

    def let_go(self) -> None:
        with contextlib.suppress(psycopg.Error):
            if self.locked:
                self.conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
            self.conn.execute("RESET lock_timeout")
        self.released = time.time()

    def recorded(self) -> str:
        """``asked locked released`` (epoch seconds; locked 0: not granted)."""
        return f"{self.asked:.6f} {self.locked:.6f} {self.released:.6f}"


def copy_wal_up_to(source: Path, copy: Path, length: int) -> None:
    """Copies a WAL segment's first ``length`` bytes (all of them: ``WHOLE_SEGMENT``) and
    pads it with zeros to its size. The segment the cut ends in is still being written: past
    the cut its file holds a recycled segment's old records, which would cost a backup 16 MB
    of incompressible bytes; recovery reads zeros as the end of the WAL."""
    size = source.stat().st_size
    if length == WHOLE_SEGMENT or length >= size:
        shutil.copyfile(source, copy)
        return
    with open(source, "rb") as src, open(copy, "wb") as dst:
        dst.write(src.read(length))
        dst.truncate(size)


START_TIME_SLACK = 2.0  # seconds from postmaster.pid's (truncated) start time to the server's


def refuse_other_instance(conn: psycopg.Connection, shard: ShardConfig) -> None:
    """Refuses a session on another instance than the one whose files ``data_dir`` holds."""
    try:
        served = conn.execute("SHOW data_directory").fetchone()[0]
        same, reached = same_directory(Path(served), shard.data_dir), f"the instance of {served}"
    except psycopg.errors.InsufficientPrivilege:
        # A role without pg_read_all_settings: the port and the postmaster's start time, which
        # any role may read, against what data_dir's postmaster.pid records for its server.
        started, port = conn.execute(
            "SELECT extract(epoch FROM pg_postmaster_start_time()), current_setting('port')"
        ).fetchone()
        same = same_postmaster(shard.data_dir, float(started), int(port))
        reached = f"another instance (port {port})"
    if not same:
        raise ShardDataMissing(
            f"PostgreSQL shard {shard.shard_id}: its conninfo reaches {reached}, not that of "
            f"data_dir {shard.data_dir}.",
            fix="point data_dir and conninfo at the same instance: data_dir is what 'SHOW "
            "data_directory' answers over conninfo.",
        )


def same_postmaster(data_dir: Path, started: float, port: int) -> bool:
    """Whether the server running on ``data_dir`` (its postmaster.pid: line 3 the start time in
    whole seconds, written just before the server notes its own; line 4 the port) listens on
    ``port`` and started at ``started``."""
    try:
        lines = (data_dir / "postmaster.pid").read_text(errors="replace").splitlines()
        recorded, recorded_port = int(lines[2]), int(lines[3])
    except (OSError, IndexError, ValueError):
        return False
    return recorded_port == port and 0 <= started - recorded < START_TIME_SLACK


def same_directory(a: Path, b: Path) -> bool:
    """Both paths name one directory on this host (symlinks followed)."""
    try:
        return a.samefile(b)
    except OSError:  # one of them is not on this host
        return False


def refuse_tablespaces(shard: ShardConfig) -> None:
    """Tablespaces live outside the data directory (symlinks in ``pg_tblspc``) and are not
    copied yet: refuse rather than record a backup that restores without their data."""
    links = sorted(p.name for p in (shard.data_dir / "pg_tblspc").glob("*"))
    if links:
        raise EngineError(
            f"shard {shard.shard_id} has tablespaces ({', '.join(links)}), which this version "
            "does not back up.",
            fix="move those tables into the default tablespace, or back up this instance "
            "with another tool until tablespace support lands.",
        )


def wal_segments(pg_wal: Path, first: str, last: str) -> list[str]:
    """WAL segment names from ``first`` to ``last`` inclusive, on the same timeline."""
    timeline = first[:8]
    names = sorted(p.name for p in pg_wal.iterdir() if re.fullmatch(r"[0-9A-F]{24}", p.name))
    segments = [n for n in names if n[:8] == timeline and first <= n <= last]
    if not segments or segments[0] != first or segments[-1] != last:
        raise EngineError(
            f"WAL segments {first}..{last} are not all in {pg_wal}.", fix="retry the backup."
        )
    return segments
