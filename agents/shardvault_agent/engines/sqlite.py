"""SQLite (the embedded default): each shard is one database file.

flush = WAL checkpoint (TRUNCATE); checkpoint = an online-backup snapshot of the database into
the agent's work directory, which then never changes; stop has no tail; release deletes the
snapshot.
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path

from shardvault.errors import CheckpointNotFound, EngineError
from shardvault.models import FileEntry
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import Capture


class SqliteAdapter:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    def _connect(self, shard: ShardConfig) -> sqlite3.Connection:
        path = shard.path
        if path is None or not path.exists():
            raise EngineError(
                f"SQLite shard {shard.shard_id}: {path} does not exist.",
                fix="correct 'path' in the agent config.",
            )
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)

    def shard_bytes(self, shard: ShardConfig) -> int:
        return shard.path.stat().st_size if shard.path and shard.path.exists() else 0

    def flush(self, shard: ShardConfig) -> None:
        with sqlite3.connect(shard.path, timeout=30) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _snapshot_dir(self, backup_id: str, shard: ShardConfig) -> Path:
        return self.config.state_dir / "snapshots" / backup_id / shard.shard_id

    def checkpoint(self, shard: ShardConfig, backup_id: str, work_dir: Path) -> Capture:
        target_dir = self._snapshot_dir(backup_id, shard)
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / shard.path.name
        started = time.time()
        source = self._connect(shard)
        try:
            with sqlite3.connect(target) as snapshot:
                source.backup(snapshot)  # one step: a consistent copy under a read transaction
                version = snapshot.execute("PRAGMA schema_version").fetchone()[0]
        except sqlite3.Error as error:
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

    def stop(self, shard: ShardConfig, backup_id: str, work_dir: Path) -> Capture:
        if not self.holds(shard, backup_id):
            raise CheckpointNotFound(
                f"no snapshot of shard {shard.shard_id} for backup {backup_id}.",
                fix="retry the backup.",
            )
        return Capture(root=self._snapshot_dir(backup_id, shard), files=[])

    def release(self, shard: ShardConfig, backup_id: str) -> None:
        shutil.rmtree(self._snapshot_dir(backup_id, shard), ignore_errors=True)
