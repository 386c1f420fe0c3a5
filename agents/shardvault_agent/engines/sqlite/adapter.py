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

import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from shardvault.contracts.models import FileEntry
from shardvault.errors import EngineError, ShardDataMissing
from shardvault_agent.config import ShardConfig
from shardvault_agent.engines.base import Capture, CopySource, Finishing, NoServer, size_or_zero
from shardvault_agent.engines.sqlite.checks import sqlite_checks

HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
PATH_FIX = "correct 'path' in the agent config: the shard's database file, which must exist."


class SqliteAdapter(NoServer, CopySource):
    copies = "snapshots"
    what = "SQLite snapshot"
    shard_fields = ("path",)
    fsyncs_restored_files = False  # a database file is only read by whoever opens it
    checkpoint_flushes = False  # flush truncates the WAL; the snapshot does not

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

    def checkpoint(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, *, log_archived: bool = False
    ) -> Capture:
        started = time.time()
        source = self._open(shard, "ro")  # first: a missing source leaves no snapshot behind
        target_dir = self.copy_dir(backup_id, shard)
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


SIDE_FILES = ("-wal", "-shm", "-journal")  # opening a database may create them


def sqlite_databases(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and not p.name.endswith(SIDE_FILES))
