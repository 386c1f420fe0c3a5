"""MariaDB (and the same tool family as MySQL's XtraBackup): one shard per server, copied hot
with ``mariabackup``.

- check: ``data_dir`` is a directory holding the ``mysql`` system database. Every statement
  then confirms that ``socket`` reaches the server of ``data_dir`` (``@@datadir`` is the same
  directory) before anything else is done on it.
- flush: ``FLUSH NO_WRITE_TO_BINLOG ENGINE LOGS`` (InnoDB's redo log on disk).
- checkpoint: ``mariabackup --backup`` into the agent's state directory
  (``state_dir/mariabackup/<backup>/<shard>``): InnoDB's files copied while the server runs,
  its redo log followed until the copy ends, then a short ``BACKUP STAGE`` lock for the
  non-transactional tables; the copy is consistent at its end (the marker's ``to_lsn``) once
  prepared, and never changes after, so it is uploaded as it is. A copy on local disk first
  (not ``--stream``): a stream cannot be split into the plan's objects and parts before it
  ends, and a retried part must read the same bytes again.
- stop: no tail (the redo log the copy needs is inside it) and no cut: MariaDB's log has no
  named points, so each shard is cut where its copy ends.
- release: the copy is deleted. Copies survive an agent restart (``held_backups``), so a
  starting agent releases those whose backup has ended.

Restore: the placed files are fsynced, ``mariabackup --prepare`` applies the copied redo log
(the copy is then a clean data directory), a server is started on it (``engines.mariaserver``)
and ``mariadb-check --all-databases`` (``CHECK TABLE``) and the validation queries run
(``engines.mariadb_checks``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Any

from shardvault.errors import EngineError, RestoreValidationFailed, ShardDataMissing
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import (
    Capture,
    CopySource,
    Finishing,
    list_tree,
    size_or_zero,
    tree_bytes,
)
from shardvault_agent.engines.mariadb import binlogs
from shardvault_agent.engines.mariadb.checks import mariadb_checks
from shardvault_agent.engines.mariadb.replay import replay
from shardvault_agent.engines.mariadb.server import (
    MARIADB_USER,
    MariadbServer,
    client_user,
    program,
    run,
    running_pid,
    socket_for,
    stop_server,
)
from shardvault_agent.engines.serveruser import as_root, user_ids
from shardvault_agent.wal.archiver import LogSource

log = logging.getLogger("shardvault.agent.mariadb")
DATA_DIR_FIX = (
    "correct 'data_dir' in the agent config: the server's data directory, as "
    "'SELECT @@datadir' answers over the shard's socket."
)
BACKUP_SECONDS = 6 * 3600  # a copy that takes longer is stuck: the backup fails by name
PREPARE_SECONDS = 3600


class MariadbAdapter(CopySource):
    copies = "mariabackup"
    copy_proof = "xtrabackup_checkpoints"
    what = "mariabackup copy"
    shard_fields = ("data_dir", "socket")
    fsyncs_restored_files = False  # prepare and the server read the placed files as they are

    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    # --- backup ----------------------------------------------------------------------------
    def check(self, shard: ShardConfig) -> None:
        data_dir = shard.data_dir
        where = f"MariaDB shard {shard.shard_id}: data_dir {data_dir}"
        try:
            if data_dir is None or not data_dir.is_dir():
                raise ShardDataMissing(f"{where} is not a directory.", fix=DATA_DIR_FIX)
            if not (data_dir / "mysql").is_dir():
                raise ShardDataMissing(
                    f"{where} holds no mysql system database: it is not a MariaDB data directory.",
                    fix=DATA_DIR_FIX,
                )
        except PermissionError:
            raise ShardDataMissing(
                f"{where} cannot be read by the agent's user.",
                fix="run the agent as a user that can read the data directory (e.g. mysql).",
            ) from None

    def _server(self, shard: ShardConfig) -> MariadbServer:
        """The shard's server, once it is confirmed to be the server of ``data_dir``."""
        self.check(shard)
        assert shard.data_dir is not None
        assert shard.socket is not None
        server = MariadbServer(shard.data_dir, shard.socket)
        try:
            datadir = Path(server.sql("SELECT @@datadir"))
        except RuntimeError as error:
            raise EngineError(
                f"cannot reach MariaDB of shard {shard.shard_id}: {error}",
                fix="check 'socket' in the agent config, that the server is running, and "
                f"that MariaDB has an account for the agent's OS user ({client_user()}) "
                "IDENTIFIED VIA unix_socket.",
            ) from None
        if not same_directory(datadir, shard.data_dir):
            raise ShardDataMissing(
                f"MariaDB shard {shard.shard_id}: the server on socket {shard.socket} runs "
                f"from {datadir}, not from data_dir {shard.data_dir}.",
                fix=DATA_DIR_FIX,
            )
        return server

    def check_ready(self, shard: ShardConfig) -> None:
        """``check``, a server that answers as the server of ``data_dir``, and
        ``mariabackup`` on this host; a shard whose binary logs are archived, the server's
        settings that archiving needs (``binlogs.readiness_problems``)."""
        server = self._server(shard)
        try:
            program("mariabackup")
        except RuntimeError as error:
            raise EngineError(str(error), fix="install mariadb-backup on this host.") from None
        if shard.archive_binlogs and (problems := self._binlog_problems(shard, server)):
            raise EngineError(
                f"MariaDB shard {shard.shard_id}'s binary logs cannot be archived: "
                + "; ".join(problems),
                fix="change what is named in the server's configuration and restart it; the "
                "agent checks again within 30 s.",
            )

    def _binlog_problems(self, shard: ShardConfig, server: MariadbServer) -> list[str]:
        try:
            return binlogs.readiness_problems(server)
        except (RuntimeError, ValueError) as error:  # the heartbeat catches named errors only
            raise EngineError(
                f"MariaDB shard {shard.shard_id}: its binary log settings cannot be read: {error}",
                fix="check the agent's account (BINLOG MONITOR) and the server's log.",
            ) from None

    def log_source(self, shard: ShardConfig) -> LogSource | None:
        """The shard's binary logs, read from the server (``archive_binlogs``)."""
        if not shard.archive_binlogs:
            return None
        return binlogs.BinlogSource(shard.shard_id, partial(self._server, shard))

    def shard_bytes(self, shard: ShardConfig) -> int:
        return size_or_zero(self, shard, lambda: tree_bytes(shard.data_dir))

    def flush(self, shard: ShardConfig) -> None:
        self._sql(shard, "FLUSH NO_WRITE_TO_BINLOG ENGINE LOGS")

    def _sql(self, shard: ShardConfig, statement: str) -> str:
        try:
            return self._server(shard).sql(statement)
        except RuntimeError as error:
            raise EngineError(
                f"MariaDB shard {shard.shard_id}: {error}",
                fix="check the server's log; the agent's account needs RELOAD, PROCESS, "
                "LOCK TABLES and BINLOG MONITOR (what mariabackup needs).",
            ) from None

    def checkpoint(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, *, log_archived: bool = False
    ) -> Capture:
        server = self._server(shard)
        copy = self.copy_dir(backup_id, shard)
        shutil.rmtree(copy, ignore_errors=True)  # a retried checkpoint starts over
        copy.parent.mkdir(parents=True, exist_ok=True)
        started = time.time()
        try:
            run(
                server.backup_command(f"--target-dir={copy}", "--parallel=2"),
                timeout=BACKUP_SECONDS,
            )
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:  # a timeout too
            self.release(shard, backup_id)  # a partial copy must not count as held
            raise EngineError(
                f"mariabackup of shard {shard.shard_id} failed: {error}",
                fix="see the server's log and mariabackup's message; check free space in "
                "state_dir.",
            ) from None
        marker = {"copied_at": f"{started:.6f}", **checkpoints(copy)}
        marker |= binlogs.backup_position(copy)  # where a replay of its binary logs starts
        if shard.archive_binlogs and "binlog_file" not in marker:
            self.release(shard, backup_id)
            raise EngineError(
                f"mariabackup recorded no binary log position for shard {shard.shard_id}, "
                "whose binary logs are archived: a point-in-time restore could not start "
                "from this backup.",
                fix="check that the server runs with log_bin, and retry the backup.",
            )
        return Capture(root=copy, files=list_tree(copy), marker=marker, mutable=False)

    # --- restore ---------------------------------------------------------------------------
    def finish(self, job: Finishing) -> dict[str, Any]:
        root = job.root
        try:
            command = [program("mariabackup"), "--no-defaults", "--prepare"]
            run([*command, f"--target-dir={root}"], timeout=PREPARE_SECONDS)
        except (RuntimeError, subprocess.SubprocessError) as error:
            raise EngineError(
                f"mariabackup --prepare of shard {job.shard_id} failed: {error}",
                fix="the backup may be damaged: restore another backup, and report this one.",
            ) from None
        server = MariadbServer(root, socket_for(root))
        job.note_server({"socket": str(server.socket)})
        try:
            server.start()
        except RuntimeError as error:  # its log is in the message
            raise RestoreValidationFailed(
                f"shard {job.shard_id}: the restored MariaDB server did not start: {error}",
                fix="the backup is incomplete or damaged: run shardvault verify on it, restore "
                "another backup, and report this one.",
            ) from None
        target = job.layout.get("recovery")  # a point-in-time restore (shardvault.wal.pitr)
        reached = None
        if target is not None:
            reached = replay(server, root, job.shard_id, job.layout, job.wal_progress)
            job.wal_done()  # the feed stopped, its directory removed before the checks
        checks = mariadb_checks(server, job.validation_queries)
        return {
            "shard_id": job.shard_id,
            "node_id": self.config.node_id,
            "path": str(root),
            "socket": str(server.socket),
            **({} if target is None else recovered(target, reached)),
            "checks": checks,
            "checks_passed": all(v == "ok" for v in checks.values()),
        }

    def adoptable(self, shard_id: str, result: dict[str, Any]) -> dict[str, Any]:
        return {"shard_id": shard_id, "data_dir": result["path"], "socket": result["socket"]}

    def serving(self, root: Path) -> dict[str, Any] | None:
        return {"socket": str(socket_for(root))} if running_pid(root) is not None else None

    def stop_server(self, root: Path, *, immediate: bool = False) -> None:
        stop_server(root, immediate=immediate)

    def server_files(self, root: Path) -> list[Path]:
        server = MariadbServer(root, socket_for(root))  # the socket's directory is this root's
        return [server.socket.parent, server.log_path]

    def start_server(self, root: Path, server: dict[str, Any]) -> None:
        try:
            MariadbServer(root, Path(server["socket"])).start()
        except RuntimeError as error:  # put back whole; report, do not fail the undo
            log.warning("could not start the replaced copy %s again: %s", root, error)

    def server_account(self) -> tuple[int, int] | None:
        if not as_root():
            return None
        uid, gid, _ = user_ids(MARIADB_USER)
        return uid, gid


def recovered(target: dict[str, Any], reached: str | None) -> dict[str, Any]:
    """Where a point-in-time restore's replay stopped, as the restore's table shows it: the
    target (a time, a position, the archive's end) and the position reached."""
    if target.get("target_time"):
        kind, value = "time", target["target_time"]
    elif target.get("target_position"):
        kind, value = "position", target["target_position"]
    else:
        kind, value = "latest", f"the end of the binary log archive ({reached})"
    return {"recovered_to": value, "recovery_target": kind, "replayed_to": reached}


def checkpoints(copy: Path) -> dict[str, str]:
    """The copy's LSNs from ``xtrabackup_checkpoints`` (``to_lsn``: where it is consistent
    once prepared)."""
    found = {}
    for line in (copy / "xtrabackup_checkpoints").read_text().splitlines():
        key, _, value = (part.strip() for part in line.partition("="))
        if key in {"backup_type", "from_lsn", "to_lsn", "last_lsn"}:
            found[key] = value
    return found


def same_directory(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False
