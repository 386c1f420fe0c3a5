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
  (``shardvault.contracts.cut``; with a commit pause, on a session in the policy's ``cut.database``,
  where the application takes the lock: ``take_cut``); the tail is the backup label (and
  tablespace map) plus every WAL segment from the start to the restore point (to the stop
  LSN without a cut), copied from ``pg_wal`` while the slot holds them, so the backup
  restores on its own without a WAL archive.
- *archived tail*: a shard with a ``wal_spool_dir`` whose agent archives it (``archived``),
  in a backup whose control plane copies archived tails (``log_archived``), has its WAL in
  the archive already. Once such a backup holds more than ``archive_handoff_mib`` of WAL
  (``held_log``, each second), it *hands off*: it drops its slot (``archive_mode`` keeps
  every segment until it is pushed, and the spool until it is stored), and at stop the
  segment holding the restore point is closed (``pg_switch_wal``) and pushed, and the tail is
  the backup label alone, its marker naming the first and last segment (``archived_from``,
  ``archived_through``). The agent then waits for the archive to record that segment, and
  Finalize copies the archive's batches into the backup (``shardvault.backup.archived``): a
  slow backup under writes holds no more WAL on the source than that, reads none twice, and
  still restores alone. A backup that held less copies its few segments at stop, as any
  other: quicker than waiting for the archive to store them.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from shardvault.contracts import links
from shardvault.contracts.cut import (
    LOCK_TIMEOUT_SECONDS,
    PAUSE_HOLD_SECONDS,
    CutRequest,
)
from shardvault.contracts.links import LinkedDir
from shardvault.contracts.models import FileEntry
from shardvault.errors import CheckpointNotFound, EngineError, ShardDataMissing, WalNotArchived
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import (
    BlockScreen,
    Capture,
    Finishing,
    HeldLog,
    list_tree,
    size_or_zero,
    tree_bytes,
)
from shardvault_agent.engines.postgres import pages as pgpages
from shardvault_agent.engines.postgres import restore as postgres_restore
from shardvault_agent.engines.postgres import tablespaces
from shardvault_agent.engines.postgres.server import beside, postgres_ids, stop_server
from shardvault_agent.engines.serveruser import as_root
from shardvault_agent.wal.archiver import LogSource, Spool

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


def skip_dir(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return rel in EMPTY_DIRS or name.startswith("pgsql_tmp")


def unlogged_relations(root: Path) -> set[tuple[str, str]]:
    """Relations with an init fork are unlogged: only the init fork is copied."""
    return {
        (p.parent.relative_to(root).as_posix(), p.name[: -len("_init")])
        for pattern in ("base/*/*_init", "pg_tblspc/*/PG_*/*/*_init")
        for p in root.glob(pattern)
    }


def listing(root: Path) -> list[FileEntry]:
    """The data directory's files to copy, its tablespaces' among them (``tablespaces``:
    each link followed, only this server's version directory)."""
    unlogged = unlogged_relations(root)
    version = tablespaces.version_dir(root)

    def skip_file(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if rel in SKIP_FILES or name == "pg_internal.init" or name.startswith("pgsql_tmp"):
            return True
        match = pgpages.RELATION_FILE.match(rel)
        return bool(match and match["fork"] != "_init" and (match["db"], match["node"]) in unlogged)

    return list_tree(
        root,
        skip_dir=lambda rel: skip_dir(rel) or tablespaces.other_version(rel, version),
        skip_file=skip_file,
        follow=tablespaces.LINK.match,
    )


@dataclass
class HeldBackup:
    connection: psycopg.Connection
    start_lsn: str
    start_wal: str
    # Its WAL may be taken from the archive (an archived shard, a control plane that copies
    # archived tails); handed_off: it was, its slot dropped (module docstring).
    archivable: bool = False
    handed_off: bool = False
    tail_decided: bool = False  # at stop, where the tail's WAL comes from: no hand-off after
    stopped: bool = False
    linked: list[LinkedDir] = field(default_factory=list)  # its tablespaces at the checkpoint


# What a backup needs of the server (PostgresAdapter.check_ready), in one round trip.
READINESS = """
SELECT current_setting('wal_level'),
       current_setting('max_replication_slots')::int
           - (SELECT count(*) FROM pg_replication_slots),
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
       has_function_privilege('pg_backup_start(text, boolean)', 'EXECUTE'),
       has_function_privilege('pg_create_restore_point(text)', 'EXECUTE'),
       current_setting('archive_mode'),
       has_function_privilege('pg_switch_wal()', 'EXECUTE'),
       has_function_privilege('pg_backup_stop(boolean)', 'EXECUTE'),
       (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
           OR pg_has_role(current_user, 'pg_checkpoint', 'USAGE')
"""

ARCHIVE_WAIT_SECONDS = 600.0  # for the server to push a backup's last segment into the spool


class PostgresAdapter:
    shard_fields = ("data_dir", "conninfo")
    config_fields = ()
    # Recovery from a backup label fsyncs the whole data directory before it replays.
    fsyncs_restored_files = True
    checkpoint_flushes = True  # pg_backup_start(..., fast) checkpoints at once
    screen_module = "shardvault_agent.engines.postgres.pages"

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        # The shards whose WAL this agent's archiver stores (``use_log_archive``): their
        # backups may hand their WAL to the archive (module docstring, *archived tail*).
        self.archived: set[str] = set()
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
        ``pg_backup_start`` and create the cut's restore point; and tablespaces the backup
        can follow (``tablespaces.check``)."""
        self.check(shard)
        tablespaces.check(shard.data_dir, shard.shard_id)
        conn = self._connect(shard)
        try:
            row = conn.execute(READINESS).fetchone()
            (
                wal_level,
                free_slots,
                replicates,
                may_backup,
                may_cut,
                archive_mode,
                may_switch,
                may_stop,
                may_checkpoint,
            ) = row
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
        if shard.shard_id in self.archived:  # a backup may hand its WAL to the archive
            if archive_mode not in ("on", "always"):
                problems.append(
                    "the shard has a wal_spool_dir but archive_mode is off (set archive_mode = "
                    "on and archive_command to shardvault-wal-push, and restart the server)"
                )
            if not may_switch:
                problems.append(
                    "the agent's role may not close a WAL segment for the archive (GRANT "
                    "EXECUTE ON FUNCTION pg_switch_wal() to it)"
                )
        if free_slots < 1:
            problems.append(
                "no replication slot is free (raise max_replication_slots, or drop unused slots)"
            )
        if not replicates:
            problems.append("the agent's role lacks REPLICATION (ALTER ROLE ... REPLICATION)")
        if not (may_backup and may_stop):
            problems.append(
                "the agent's role may not run pg_backup_start and pg_backup_stop (GRANT EXECUTE "
                "ON FUNCTION pg_backup_start, pg_backup_stop to it)"
            )
        if not may_checkpoint:
            problems.append(
                "the agent's role may not run CHECKPOINT, the backup's flush (GRANT "
                "pg_checkpoint TO it)"
            )
        if not may_cut:
            problems.append(
                "the agent's role may not create the backup's restore point (GRANT EXECUTE ON "
                "FUNCTION pg_create_restore_point(text) to it)"
            )
        if problems:
            raise EngineError(
                f"PostgreSQL shard {shard.shard_id} cannot be backed up: " + "; ".join(problems),
                fix="change what is named on the server; the agent checks again within 30 s (its "
                "heartbeat, while a shard reports a problem).",
            )

    def check_cut_database(self, shard: ShardConfig, database: str) -> None:
        """What a paused cut needs of ``database``, the policy's ``cut.database``, checked
        before a backup meets it (``shardvault check``): the agent's role reaches it on the
        instance of ``data_dir`` and may create the restore point there. The heartbeat's
        ``check_ready`` cannot: the database is the control plane's policy, not the agent's
        config. Raises ``EngineError`` naming the database and the fix."""
        self.check(shard)
        open_cut_session(shard, database).close()

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
        def measure() -> int:
            return tree_bytes(shard.data_dir / "base") + tablespaces.placed_bytes(shard.data_dir)

        return size_or_zero(self, shard, measure)

    def flush(self, shard: ShardConfig) -> None:
        with self._connect(shard) as conn:
            conn.execute("CHECKPOINT")

    def checkpoint(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, *, log_archived: bool = False
    ) -> Capture:
        self.check(shard)
        tablespaces.check(shard.data_dir, shard.shard_id)
        self.release(shard, backup_id)  # a retried checkpoint starts over
        conn = self._connect(shard)  # refuses another instance before the slot is taken
        archivable = log_archived and shard.shard_id in self.archived
        slot = slot_name(backup_id, shard.shard_id)
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
            # Before the backup starts: a tablespace created from now on, even inside its
            # checkpoint, lies in the WAL it replays, and the stop refuses it.
            linked = tablespaces.catalog(conn)
            started = time.time()
            lsn = conn.execute(
                "SELECT pg_backup_start(%s, true)", (f"shardvault {backup_id}",)
            ).fetchone()[0]
            wal, block_size = conn.execute(
                "SELECT pg_walfile_name(%s), current_setting('block_size')", (lsn,)
            ).fetchone()
        except psycopg.Error as error:
            conn.close()
            raise EngineError(
                f"pg_backup_start failed on shard {shard.shard_id}: {error}",
                fix="check the server log; wal_level must be replica or logical.",
            ) from None
        with self.lock:
            self.held[(backup_id, shard.shard_id)] = HeldBackup(
                conn, str(lsn), wal, archivable, linked=linked
            )
        marker = {
            "start_lsn": str(lsn),
            "start_wal": wal,
            "checkpoint_at": f"{started:.6f}",
            "block_size": block_size,  # of its pages: the block screen reads their headers
            "system_identifier": pgpages.system_identifier(shard.data_dir),
        }
        if linked:  # the tablespaces, which a restore places (shardvault.contracts.links)
            marker[links.LINKS_MARKER] = links.encode(linked)
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
            marker |= take_cut(conn, shard, cut)
            end = marker["cut_lsn"]
        last_wal, last_bytes = self._wait_flushed(conn, end)
        tail = work_dir / "tail" / shard.shard_id
        shutil.rmtree(tail, ignore_errors=True)
        (tail / "pg_wal").mkdir(parents=True)
        (tail / "backup_label").write_text(label)
        if spcmap:
            (tail / "tablespace_map").write_text(spcmap)
        if self._tail_from_archive(held, shard, backup_id):
            pushed(conn, shard, last_wal, last_bytes)
            marker |= {"archived_from": held.start_wal, "archived_through": last_wal}
            files = [f for f in list_tree(tail) if not f.path.endswith("/")]
            tablespaces.refuse_changed(conn, shard.shard_id, held.linked)  # its WAL's end too
            self.release(shard, backup_id)
            return Capture(root=tail, files=files, marker=marker, mutable=False)
        for name in wal_segments(shard.data_dir / "pg_wal", held.start_wal, last_wal):
            source, copy = shard.data_dir / "pg_wal" / name, tail / "pg_wal" / name
            if name == last_wal and cut is not None:
                copy_wal_up_to(source, copy, last_bytes)
            else:
                shutil.copyfile(source, copy)
        files = [f for f in list_tree(tail) if not f.path.endswith("/")]
        # After the copy: its last segment may hold WAL past the stop, which crash recovery
        # replays too.
        tablespaces.refuse_changed(conn, shard.shard_id, held.linked)
        # The WAL is copied: end the session now, which drops the slot holding the WAL.
        self.release(shard, backup_id)
        return Capture(root=tail, files=files, marker=marker, mutable=False)

    def cut(self, shard: ShardConfig, cut: CutRequest) -> dict[str, str]:
        """The scheduled cut (``take_cut``) on a session of its own, answered once the point
        is on disk (a paused cut's commit does not flush it), with the segment it lies in."""
        conn = self._connect(shard)
        try:
            if conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                raise EngineError(
                    f"shard {shard.shard_id}'s server is a standby: a restore point is made "
                    "on the leader only.",
                    fix="set the shard's role to replica in this agent's configuration (the "
                    "leader's agent cuts it), or promote this server.",
                )
            marker = take_cut(conn, shard, cut)
            segment, _ = self._wait_flushed(conn, marker["cut_lsn"])
            flushed = conn.execute(
                "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (marker["cut_lsn"],)
            ).fetchone()[0]
        finally:
            conn.close()
        if not flushed:
            raise EngineError(
                f"shard {shard.shard_id}: restore point {cut.name} was not flushed to disk "
                "within 30 s; the cut is not answered as made.",
                fix="check the server's WAL writer and disk (pg_stat_wal, the server log).",
            )
        return marker | {"cut_wal": segment}

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

    def use_log_archive(self, shard_ids: set[str]) -> None:
        self.archived = set(shard_ids)

    def linked_dirs(self, shard: ShardConfig) -> dict[str, str]:
        return tablespaces.locations(shard.data_dir)

    def log_source(self, shard: ShardConfig) -> LogSource | None:
        """The spool its ``archive_command`` fills (``wal_spool_dir``), if it has one."""
        if shard.wal_spool_dir is None:
            return None
        return Spool(shard.shard_id, shard.wal_spool_dir, partial(self.linked_dirs, shard))

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

    def held_log(self, shard: ShardConfig, backup_id: str) -> HeldLog | None:
        """The WAL the backup's slot retains (from its restart point to the server's current
        position), and pg_wal (a symlink to another disk is followed). An archivable backup
        past ``archive_handoff_mib`` hands off here (the source guard asks each second): its
        slot dropped, it holds nothing from the next answer on."""
        held = self.held.get((backup_id, shard.shard_id))
        if held is None or held.connection.closed:
            return None
        pg_wal = (shard.data_dir / "pg_wal").resolve()
        if held.handed_off:  # no slot: the archive keeps the WAL, not the backup
            return HeldLog(0, pg_wal)
        holding = self._slot_holds(shard, backup_id)
        if holding is None:
            return None
        if held.archivable:
            with self.lock:  # never while stop copies the tail under the slot
                if not held.tail_decided and self._hands_off(held, shard, backup_id, holding):
                    return HeldLog(0, pg_wal, let_go=holding)  # the report's peak says so
        return HeldLog(holding, pg_wal)

    def _slot_holds(self, shard: ShardConfig, backup_id: str) -> int | None:
        with self._connect(shard) as conn:
            row = conn.execute(HELD_WAL, (slot_name(backup_id, shard.shard_id),)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def _tail_from_archive(self, held: HeldBackup, shard: ShardConfig, backup_id: str) -> bool:
        """Decides, once, where the tail's WAL comes from: the archive when the backup handed
        off, or does now (it holds more than the threshold); else a copy under its slot, and
        no hand-off after this."""
        with self.lock:
            held.tail_decided = True
            if held.archivable and not held.handed_off:
                self._hands_off(held, shard, backup_id, self._slot_holds(shard, backup_id) or 0)
            return held.handed_off

    def _hands_off(
        self, held: HeldBackup, shard: ShardConfig, backup_id: str, holding: int
    ) -> bool:
        """Past the threshold, lets the archive keep the backup's WAL: drops its slot (on the
        session that made it: a temporary slot is that session's). The caller holds the lock."""
        if holding <= self.config.archive_handoff_mib * 2**20:
            return False
        slot = slot_name(backup_id, shard.shard_id)
        held.connection.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        held.handed_off = True
        log.info(
            "shard %s: the backup held %d MiB of WAL: the archive keeps it now (slot dropped)",
            shard.shard_id,
            holding // 2**20,
        )
        return True

    def block_screen(
        self, marker: dict[str, str], parent_marker: dict[str, str]
    ) -> BlockScreen | None:
        return pgpages.screen_since(marker, parent_marker)

    def server_pid(self, shard: ShardConfig) -> int | None:
        """The postmaster's process id, from the first line of ``postmaster.pid``."""
        try:
            return int((shard.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError, TypeError):
            return None

    def health_probe(self, shard: ShardConfig) -> PostgresProbe | None:
        try:
            return PostgresProbe(self._connect(shard))
        except (EngineError, ShardDataMissing) as error:
            log.warning("no throttle probe for shard %s: %s", shard.shard_id, error)
            return None

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

    def server_files(self, root: Path) -> list[Path]:
        return list(beside(root))

    def start_server(self, root: Path, server: dict[str, Any]) -> None:
        postgres_restore.restart_replaced(root, server["port"])

    def server_account(self) -> tuple[int, int] | None:
        if not as_root():
            return None
        uid, gid, _ = postgres_ids()
        return uid, gid


WHOLE_SEGMENT = -1  # copy_wal_up_to: the segment's every byte


# The cut in one statement, timed by the server (``restore_point``); PostgreSQL evaluates a
# select list in order. ``pg_sleep_until`` wakes within about a millisecond of its instant.
# The transaction id makes the statement's commit flush the point: a transaction without one
# leaves its WAL to the WAL writer, which stop then waited for (up to wal_writer_delay, 200 ms
# by default, on a quiet server; 3 ms with it).
CUT = """
SELECT pg_sleep_until(to_timestamp(%(at)s)),
       txid_current(),
       pg_create_restore_point(%(name)s),
       extract(epoch FROM clock_timestamp())
"""
# The paused cut asks for the lock at the instant and makes the point as soon as it is
# granted: the one wake-up inside the pause is the hold's end (a lead before the instant, as
# when the agent timed the cut, would add a second one for nothing). It lets go at the
# instant plus the hold, or a hold after its own lock when that came late: nodes that a
# stall of the whole machine made late together still share a moment.
PAUSED_CUT = """
SELECT pg_sleep_until(to_timestamp(%(at)s)),
       extract(epoch FROM clock_timestamp()),
       pg_advisory_xact_lock(%(key)s),
       extract(epoch FROM clock_timestamp()),
       pg_create_restore_point(%(name)s),
       extract(epoch FROM clock_timestamp()),
       pg_sleep_until(greatest(to_timestamp(%(until)s),
                               clock_timestamp() + %(hold)s * interval '1 second')),
       extract(epoch FROM clock_timestamp())
"""


def slot_name(backup_id: str, shard_id: str) -> str:
    """The backup's temporary replication slot on the shard's server."""
    return re.sub(r"[^a-z0-9_]", "_", f"shardvault_{backup_id}_{shard_id}".lower())[:63]


# The WAL a backup's slot retains (every role may read pg_replication_slots).
HELD_WAL = """
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
FROM pg_replication_slots WHERE slot_name = %s
"""


# Whether clients other than ShardVault's are connected (an unused server is not slowed for
# its own sake); the time of the answer is the throttle's latency signal. Every role may read
# these columns of every session.
OTHER_CLIENTS = """
SELECT count(*) > 0 FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
  AND coalesce(application_name, '') NOT LIKE 'shardvault%'
"""


class PostgresProbe:
    """The throttle's question to a server, on a session of its own."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def ask(self) -> bool:
        return bool(self.conn.execute(OTHER_CLIENTS).fetchone()[0])

    def close(self) -> None:
        self.conn.close()


def restore_point(conn: psycopg.Connection, shard: ShardConfig, cut: CutRequest) -> dict[str, str]:
    """At the cut's instant, the cluster's restore point in this shard's WAL (see
    ``shardvault.contracts.cut``), inside the commit pause when the policy asks for one; the marker
    fields that record it (stop then waits for the point to be on disk).

    The whole cut is one statement sent ahead of the instant: the server sleeps until it,
    takes the commit lock (a transaction's: the statement's end lets it go, on error too),
    creates the restore point and holds the lock to the pause's end. Timed by the agent
    instead (a round trip to ask for the lock, one for the restore point, one to let go,
    and the agent's own wake-ups between them), a loaded machine stretched the pause to 43 ms
    in one backup of 20 (docs/BENCHMARKS.md) against its designed 12."""
    pause = None
    try:
        with cut_settings(conn):
            if cut.commit_lock is None:
                lsn, created = unpaused_cut(conn, cut)
            else:
                pause, lsn, created = paused_cut(conn, cut)
    except psycopg.Error as error:
        raise EngineError(
            f"cannot create restore point {cut.name} on shard {shard.shard_id} (in database "
            f"{conn.info.dbname!r}): {error}".strip(),
            fix="GRANT EXECUTE ON FUNCTION pg_create_restore_point(text) to the agent's role, "
            f"in database {conn.info.dbname!r} (function grants are per database).",
        ) from None
    # Without a commit lock the cut's commit flushed the point (``CUT``). The paused cut's
    # does not, so that no fsync lies inside the pause: the server's next synchronous commit or
    # its WAL writer (within wal_writer_delay) does, which stop waits for (_wait_flushed).
    return {
        "cut_name": cut.name,
        "cut_lsn": str(lsn),
        "cut_at": f"{float(created):.6f}",
        "cut_late_seconds": f"{max(0.0, float(created) - cut.at):.6f}",
        **({"cut_pause": pause} if pause is not None else {}),
    }


def take_cut(conn: psycopg.Connection, shard: ShardConfig, cut: CutRequest) -> dict[str, str]:
    """The cut on the shard's server (``restore_point``), on the session where its commit
    pause holds the application's commits (``cut_session``). A pause asked without its
    database (a control plane older than ``cut.database``) cannot know where the application
    takes the lock: the cut goes without it and its marker says the lock was not held, so
    the backup reports it best-effort, never paused in name only."""
    if cut.commit_lock is not None and cut.database is None:
        log.warning(
            "shard %s: commit pause not taken (lock %d): the cut names no database to take it "
            "in (upgrade the control plane and set the policy's cut.database); best-effort cut",
            shard.shard_id,
            cut.commit_lock,
        )
        marker = restore_point(conn, shard, cut.model_copy(update={"commit_lock": None}))
        return marker | {"cut_pause": f"{cut.at:.6f} 0 {float(marker['cut_at']):.6f}"}
    with cut_session(conn, shard, cut) as session:
        return restore_point(session, shard, cut)


@contextlib.contextmanager
def cut_session(
    conn: psycopg.Connection, shard: ShardConfig, cut: CutRequest
) -> Iterator[psycopg.Connection]:
    """The session the cut runs on: the stop's own when it is on ``cut.database`` or no
    pause is asked, else a session of its own on that database of the same server
    (``open_cut_session``): advisory locks are per database, and a lock taken in the agent's
    own database would hold no commit of the application's. The restore point is the
    server's, whichever database creates it."""
    if cut.commit_lock is None or cut.database is None or conn.info.dbname == cut.database:
        yield conn
        return
    other = open_cut_session(shard, cut.database)
    try:
        yield other
    finally:
        other.close()


def cut_conninfo(conninfo: str, database: str) -> str:
    """``conninfo`` with its database replaced by ``database`` (its host, port, user, TLS and
    the rest kept). The name goes as a quoted connection parameter, never into SQL; a
    conninfo that names no database (libpq's default: the user's name) gets it too."""
    return make_conninfo(conninfo, dbname=database)


def open_cut_session(shard: ShardConfig, database: str) -> psycopg.Connection:
    """A session on ``database`` of the shard's server where the cut can run: the instance
    of ``data_dir`` (the restore point must be in its WAL), a role that may create the
    restore point there (function grants are per database). Refused by name, with the fix."""
    where = f"shard {shard.shard_id}: database {database!r}, where the commit pause takes its lock"
    try:
        conn = psycopg.connect(
            cut_conninfo(shard.conninfo, database),
            autocommit=True,
            application_name="shardvault-agent",
        )
    except psycopg.Error as error:
        raise EngineError(
            f"{where}, cannot be reached: {error}".strip(),
            fix=f"GRANT CONNECT ON DATABASE {quote_ident(database)} TO the agent's role (and let "
            "pg_hba.conf admit it there), or correct the policy's cut.database: the database "
            "your application takes cut.commit_lock in.",
        ) from None
    try:
        refuse_other_instance(conn, shard)
        if not conn.execute(MAY_CUT).fetchone()[0]:
            raise EngineError(
                f"{where}: the agent's role may not create the backup's restore point there "
                "(function grants are per database).",
                fix=f"in database {database!r}: GRANT EXECUTE ON FUNCTION "
                "pg_create_restore_point(text) TO the agent's role.",
            )
    except BaseException:
        conn.close()
        raise
    return conn


MAY_CUT = "SELECT has_function_privilege('pg_create_restore_point(text)', 'EXECUTE')"


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier, for a fix the operator pastes (never executed)."""
    return '"' + name.replace('"', '""') + '"'


def unpaused_cut(conn: psycopg.Connection, cut: CutRequest) -> tuple[str, float]:
    """The cut without the commit pause (``CUT``): the restore point's LSN and creation time."""
    _, _, lsn, created = conn.execute(CUT, {"at": cut.at, "name": cut.name}).fetchone()
    return lsn, created


def paused_cut(conn: psycopg.Connection, cut: CutRequest) -> tuple[str, str, float]:
    """The cut inside the commit pause (``PAUSED_CUT``): the pause as ``asked locked
    released`` (epoch seconds, the server's clock; locked 0: not granted), the restore
    point's LSN and its creation time. A lock not granted within ``LOCK_TIMEOUT_SECONDS`` (a
    distributed commit under way did not end) leaves the cut best-effort: the restore point is
    created at once, without it."""
    try:
        row = conn.execute(
            PAUSED_CUT,
            {
                "at": cut.at,
                "key": cut.commit_lock,
                "name": cut.name,
                "until": cut.at + PAUSE_HOLD_SECONDS,
                "hold": PAUSE_HOLD_SECONDS,
            },
        ).fetchone()
        _, asked, _, locked, lsn, created, _, released = row
        return f"{float(asked):.6f} {float(locked):.6f} {float(released):.6f}", lsn, created
    except psycopg.errors.LockNotAvailable as error:
        log.warning("commit pause not taken (lock %d): %s", cut.commit_lock, error)
        gave_up = time.time()
        lsn, created = unpaused_cut(conn, cut)
        asked = max(cut.at, gave_up - LOCK_TIMEOUT_SECONDS)
        return f"{asked:.6f} 0 {gave_up:.6f}", lsn, created


@contextlib.contextmanager
def cut_settings(conn: psycopg.Connection) -> Iterator[None]:
    """The session's settings for the cut's statement: no statement timeout (it sleeps until
    the instant, up to the cut's margin: a role's own timeout must not fail the backup), and
    the commit lock's timeout. Reset after."""
    lock_ms = int(LOCK_TIMEOUT_SECONDS * 1000)
    conn.execute(
        "SELECT set_config('statement_timeout', '0', false), set_config('lock_timeout', %s, false)",
        (str(lock_ms),),
    )
    try:
        yield
    finally:
        with contextlib.suppress(psycopg.Error):
            conn.execute("RESET statement_timeout; RESET lock_timeout")


def pushed(conn: psycopg.Connection, shard: ShardConfig, last_wal: str, last_bytes: int) -> None:
    """Closes the segment ``last_wal`` if the WAL still goes on in it (``last_bytes``: how much
    of it the backup needs), then waits until the server has pushed it and every segment
    before it into the spool (``archive_status`` holds no ``.ready`` file up to it: the
    server's archiver goes oldest first and never skips one). Raises ``WalNotArchived``."""
    if last_bytes != WHOLE_SEGMENT:
        current = conn.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone()[0]
        if current == last_wal:
            conn.execute("SELECT pg_switch_wal()")
    status = shard.data_dir / "pg_wal" / "archive_status"
    deadline = time.monotonic() + ARCHIVE_WAIT_SECONDS
    while waiting := sorted(
        p.name
        for p in status.glob("*.ready")
        if p.name[:24] <= last_wal and ".history" not in p.name
    ):
        if time.monotonic() >= deadline:
            raise WalNotArchived(
                f"PostgreSQL shard {shard.shard_id} did not push WAL segment {waiting[0]} into "
                f"its spool within {ARCHIVE_WAIT_SECONDS:g} s (the backup needs it up to "
                f"{last_wal}).",
                fix="check archive_command in the server's log (shardvault-wal-push refuses "
                "when the spool is full: see the agent's log for why it does not drain).",
            )
        time.sleep(0.05)


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
