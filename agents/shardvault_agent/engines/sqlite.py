"""SQLite (the embedded default): each shard is one database file.

check = the file exists and starts with SQLite's header; flush = WAL checkpoint (TRUNCATE);
checkpoint = an online-backup snapshot of the database into the agent's work directory, which
then never changes; stop has no tail and no cut (SQLite's log has no named points: each
shard is cut at its snapshot); release deletes the snapshot.

The source is always opened by URI with ``mode=rw`` or ``mode=ro``, never created: a plain
``sqlite3.connect`` of a misspelled path creates an empty database there, which would then be
backed up as if it were the shard.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from shardvault.contracts.cut import CutRequest
from shardvault.contracts.models import FileEntry
from shardvault.errors import CheckpointNotFound, EngineError, ShardDataMissing
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import Capture, Finishing, size_or_zero
from shardvault_agent.engines.sqlite_checks import sqlite_checks

HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
PATH_FIX = "correct 'path' in the agent config: the shard's database file, which must exist."


class SqliteAdapter:
    shard_fields = ("path",)
    config_fields = ()
    fsyncs_restored_files = False  # a database file is only read by whoever opens it
    checkpoint_flushes = False  # flush truncates the WAL; the snapshot does not
    screen_module = None

    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    def check_ready(self, shard: ShardConfig) -> None:
        self.check(shard)  # a readable database file is all a SQLite backup needs

    def check(self, shard: ShardConfig) -> None:
        path = shard.path
        where = f"SQLite shard {shard.shard_id}: path {path}"
        try:
            if path is None or not path.exists():
                raise ShardDataMissing(f"{where} does not exist.", fix=PATH_FIX)
            if not path.is_file():
                raise ShardDataMissing(f"{where} is not a regular file.", fix=PATH_FIX)
            with path.open("rb") as file:
                header = file.read(len(HEADER))
        except OSError as error:
            raise ShardDataMissing(
                f"{where} cannot be read: {error.strerror}.",
                fix="let the agent's user read the database file and its directory.",
            ) from None
        if not header:
            raise ShardDataMissing(
                f"{where} is an empty file, not a database (opening a misspelled path with "
                "sqlite3 creates one).",
                fix=f"{PATH_FIX.rstrip('.')}; delete the empty file if nothing else uses it.",
            )
        if header != HEADER:
            raise ShardDataMissing(f"{where} is not a SQLite database.", fix=PATH_FIX)

    def _open(self, shard: ShardConfig, mode: str) -> sqlite3.Connection:
        """The shard's database, opened read-write (``rw``) or read-only (``ro``), never
        created."""
        self.check(shard)
        uri = f"{shard.path.absolute().as_uri()}?mode={mode}"
        try:
            return sqlite3.connect(uri, uri=True, timeout=30)
        except sqlite3.Error as error:
            self.check(shard)  # removed since: named as missing
            raise EngineError(
                f"cannot open SQLite shard {shard.shard_id} ({shard.path}): {error}.",
                fix="check the file's permissions and those of its directory.",
            ) from None

    def shard_bytes(self, shard: ShardConfig) -> int:
        return size_or_zero(self, shard, lambda: shard.path.stat().st_size)

    def flush(self, shard: ShardConfig) -> None:
        with closing(self._open(shard, "rw")) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _snapshot_dir(self, backup_id: str, shard: ShardConfig) -> Path:
        return self.config.state_dir / "snapshots" / backup_id / shard.shard_id

    def checkpoint(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, *, log_archived: bool = False
    ) -> Capture:
        started = time.time()
        source = self._open(shard, "ro")  # first: a missing source leaves no snapshot behind
        target_dir = self._snapshot_dir(backup_id, shard)
        target = target_dir / shard.path.name
        try:
            target_dir.mkdir(parents=True, exist_ok=True)
            with closing(sqlite3.connect(target)) as snapshot:
                source.backup(snapshot)  # one step: a consistent copy under a read transaction
                version = snapshot.execute("PRAGMA schema_version").fetchone()[0]
        except (sqlite3.Error, OSError) as error:
            self.release(shard, backup_id)  # a partial snapshot must not count as held
            raise EngineError(
                f"SQLite snapshot of shard {shard.shard_id} failed: {error}",
                fix="check the database file and free space in state_dir.",
            ) from error
        finally:
            source.close()
        marker = {"snapshot_at": f"{started:.6f}", "schema_version": str(version)}
        files = [FileEntry(path=target.name, size=target.stat().st_size)]
        return Capture(root=target_dir, files=files, marker=marker, mutable=False)

    def holds(self, shard: ShardConfig, backup_id: str) -> bool:
        return self._snapshot_dir(backup_id, shard).exists()

    def stop(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, cut: CutRequest | None = None
    ) -> Capture:
        if not self.holds(shard, backup_id):
            raise CheckpointNotFound(
                f"no snapshot of shard {shard.shard_id} for backup {backup_id}.",
                fix="retry the backup.",
            )
        return Capture(root=self._snapshot_dir(backup_id, shard), files=[])

    def release(self, shard: ShardConfig, backup_id: str) -> None:
        snapshot = self._snapshot_dir(backup_id, shard)
        shutil.rmtree(snapshot, ignore_errors=True)
        with contextlib.suppress(OSError):  # the backup's directory, once its last shard left
            snapshot.parent.rmdir()

    def use_log_archive(self, shard_ids: set[str]) -> None:
        pass  # no log to archive

    def held_backups(self) -> set[str]:
        return {p.name for p in (self.config.state_dir / "snapshots").glob("*") if p.is_dir()}

    # --- restore ---------------------------------------------------------------------------
    def finish(self, job: Finishing) -> dict[str, Any]:
        """Checks each restored database (``PRAGMA integrity_check``) and runs the validation
        queries on it: a restored SQLite shard is just its file, nothing to start."""
        checks: dict[str, str] = {}
        databases = sqlite_databases(job.root)
        for db in databases:
            checks |= sqlite_checks(db, job.validation_queries)
        return {
            "shard_id": job.shard_id,
            "node_id": self.config.node_id,
            "path": str(job.root),
            "checks": checks,
            "checks_passed": bool(databases) and all(v == "ok" for v in checks.values()),
        }

    def adoptable(self, shard_id: str, result: dict[str, Any]) -> dict[str, Any] | None:
        """The shard's one database file; None when the directory holds more or none."""
        databases = sqlite_databases(Path(result["path"]))
        if len(databases) != 1:
            return None
        return {"shard_id": shard_id, "path": str(databases[0])}

    def held_log(self, shard: ShardConfig, backup_id: str) -> None:
        return None  # a snapshot: nothing held on the source

    def block_screen(self, marker: dict[str, str], parent_marker: dict[str, str]) -> None:
        return None  # a snapshot is a new file every time: every block is read

    def server_pid(self, shard: ShardConfig) -> int | None:
        return None  # no server

    def health_probe(self, shard: ShardConfig) -> None:
        return None

    def serving(self, root: Path) -> dict[str, Any] | None:
        return None  # no server: nothing runs from a restored file

    def stop_server(self, root: Path, *, immediate: bool = False) -> None:
        return None

    def server_files(self, root: Path) -> list[Path]:
        return []

    def start_server(self, root: Path, server: dict[str, Any]) -> None:
        return None


SIDE_FILES = ("-wal", "-shm", "-journal")  # opening a database may create them


def sqlite_databases(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and not p.name.endswith(SIDE_FILES))
