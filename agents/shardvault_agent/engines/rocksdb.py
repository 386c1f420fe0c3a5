"""RocksDB (an LSM store embedded in its application): each shard is one database directory,
written by the application's process while the agent copies it.

Terms:
- *checkpoint*: a crash-consistent copy in the agent's state directory
  (``state_dir/rocksdb/<backup>/<shard>``) made without the owner's help: the live WAL files
  copied, the SST files hard-linked (immutable once written, so a link is a copy in constant
  time, whatever the size: the YugabyteDB lesson), then ``OPTIONS``, ``CURRENT`` and the
  ``MANIFEST`` it names copied last. Opened, it replays its WAL copy and holds a prefix of the
  writes. A flush or compaction during the copy makes SST files the copied MANIFEST may name,
  so the SST files that appeared meanwhile are linked after it (*catching up*); one that
  vanished before its link was obsolete before that MANIFEST was written, so it is not
  needed. A copy that still does not open (a file made and removed within the copy) is
  caught up again, at most ``ATTEMPTS`` times, each attempt only linking what is new; the
  SST files its MANIFEST does not name are then removed, so the backup carries live files
  only.
- *digest*: over every key and value of the checkpoint in key order (xxh3-128), recorded in
  the backup's marker with the key count; a restore opens the copy and recomputes it, so every
  pair is checked against the backup, not only the files' checksums.

The database must use RocksDB's default (bytewise) comparator, as it is opened here in raw
mode; a store with its own comparator, or one whose owner offers a checkpoint command, is
backed up through command hooks (``engines.hooks``). The state directory should be on the
data's file system: across file systems the SST files are copied, not linked.

flush: nothing (the owner's WAL makes every write durable); stop: no tail, no cut (the copy
is its own point); release: the checkpoint deleted; checkpoints survive an agent restart
(``held_backups``), so a starting agent releases those whose backup ended.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import xxhash

from shardvault.errors import EngineError, ShardDataMissing
from shardvault_agent.config import ShardConfig
from shardvault_agent.engines.base import (
    Capture,
    CopySource,
    Finishing,
    NoServer,
    list_tree,
    size_or_zero,
)

ATTEMPTS = 5
SKIPPED = ("LOCK", "LOG")  # the owner's lock and its info logs: not the database
DATA_DIR_FIX = "correct 'data_dir' in the agent config: the RocksDB database directory."


class RocksdbAdapter(NoServer, CopySource):
    copies = "rocksdb"
    copy_proof = "CURRENT"
    what = "RocksDB checkpoint"
    fsyncs_restored_files = False
    shard_fields = ("data_dir",)

    # --- backup ----------------------------------------------------------------------------
    def check(self, shard: ShardConfig) -> None:
        data_dir = shard.data_dir
        if data_dir is None or not (data_dir / "CURRENT").is_file():
            raise ShardDataMissing(
                f"RocksDB shard {shard.shard_id}: data_dir {data_dir} holds no CURRENT file: "
                "it is not a RocksDB database.",
                fix=DATA_DIR_FIX,
            )

    def check_ready(self, shard: ShardConfig) -> None:
        self.check(shard)

    def shard_bytes(self, shard: ShardConfig) -> int:
        def measure() -> int:
            assert shard.data_dir is not None
            return sum(p.stat().st_size for p in shard.data_dir.iterdir() if p.is_file())

        return size_or_zero(self, shard, measure)

    def flush(self, shard: ShardConfig) -> None:
        self.check(shard)

    def checkpoint(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, *, log_archived: bool = False
    ) -> Capture:
        self.check(shard)
        assert shard.data_dir is not None
        target = self.copy_dir(backup_id, shard)
        shutil.rmtree(target, ignore_errors=True)  # a copy an earlier agent left half made
        problem = ""
        for _ in range(ATTEMPTS):
            try:
                copy_database(shard.data_dir, target)
                keys, digest, live = read_copy(target)
            except (OSError, RocksdbError) as error:  # raced with a flush or compaction
                problem = str(error)
                continue
            for unnamed in (p for p in target.glob("*.sst") if p.name not in live):
                unnamed.unlink()  # linked while catching up, but not in the copy's MANIFEST
            marker = {"keys": str(keys), "digest": digest}
            return Capture(root=target, files=list_tree(target), marker=marker, mutable=False)
        self.release(shard, backup_id)
        raise EngineError(
            f"RocksDB shard {shard.shard_id}: no consistent copy in {ATTEMPTS} attempts "
            f"(the last: {problem}).",
            fix="retry the backup; if it keeps failing, the store compacts faster than a copy "
            "takes: back it up through a checkpoint command of its own (command hooks).",
        )

    # --- restore ---------------------------------------------------------------------------
    def finish(self, job: Finishing) -> dict[str, Any]:
        """Opens the restored database and checks every pair against the backup's digest."""
        marker = job.layout.get("marker", {})
        try:
            keys, digest = database_digest(job.root)
            if marker.get("digest") is None:
                verdict = "ok"  # nothing recorded to compare with
            elif (str(keys), digest) == (marker.get("keys"), marker["digest"]):
                verdict = "ok"
            else:
                verdict = (
                    f"{keys} keys, digest {digest}; the backup recorded {marker.get('keys')} "
                    f"keys, digest {marker['digest']}"
                )
        except RocksdbError as error:
            verdict = f"does not open: {error}"
        return {
            "shard_id": job.shard_id,
            "node_id": self.config.node_id,
            "path": str(job.root),
            "checks": {"every key and value against the backup's digest": verdict},
            "checks_passed": verdict == "ok",
        }

    def adoptable(self, shard_id: str, result: dict[str, Any]) -> dict[str, Any]:
        return {"shard_id": shard_id, "data_dir": result["path"]}


class RocksdbError(Exception):
    """RocksDB refused to open a copy (a file its MANIFEST names is missing, ...)."""


def copy_database(source: Path, target: Path) -> None:
    """Brings the copy at ``target`` up to ``source``: WAL files copied, SST files it lacks
    linked, then OPTIONS, CURRENT and its MANIFEST copied, and last the SST files a flush or
    compaction made meanwhile (that MANIFEST may name them). Run again on a copy that did not
    open, it only links what is new."""
    target.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in source.iterdir() if p.is_file())
    kept = [n for n in names if not n.startswith(SKIPPED)]
    for name in (n for n in kept if n.endswith(".log")):
        shutil.copy2(source / name, target / name)
    link_new_ssts(source, target, [n for n in kept if n.endswith(".sst")])
    others = [n for n in kept if not n.endswith((".log", ".sst")) and not n.startswith("MANIFEST")]
    for name in others:  # OPTIONS-*, CURRENT, IDENTITY, an application's own files
        shutil.copy2(source / name, target / name)
    manifest = (target / "CURRENT").read_text().strip()
    shutil.copy2(source / manifest, target / manifest)
    link_new_ssts(source, target, sorted(p.name for p in source.glob("*.sst")))


def link_new_ssts(source: Path, target: Path, names: list[str]) -> None:
    """Links each SST file of ``names`` the copy lacks (never writing to one it has: that
    would be a link to the owner's file); one gone already was obsolete, so it is skipped."""
    for name in names:
        if (target / name).exists():
            continue
        try:
            link_or_copy(source / name, target / name)
        except FileNotFoundError:
            continue  # removed by a compaction: the MANIFEST copied after it does not name it


def link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise
        shutil.copy2(source, target)  # another file system: a copy


def database_digest(root: Path) -> tuple[int, str]:
    """The key count and xxh3-128 of every key and value, in key order, of the database at
    ``root``, opened read-only (its WAL replayed in memory)."""
    keys, digest, _ = read_copy(root)
    return keys, digest


def read_copy(root: Path) -> tuple[int, str, set[str]]:
    """``database_digest`` and the names of the SST files the database's MANIFEST names."""
    from rocksdict import AccessType, Options, Rdict  # only RocksDB agents load the library

    try:
        db = Rdict(str(root), Options(raw_mode=True), access_type=AccessType.read_only(False))
    except Exception as error:  # rocksdict raises plain exceptions
        raise RocksdbError(str(error)) from None
    digest, keys = xxhash.xxh3_128(), 0
    try:
        live = {Path(f["name"]).name for f in db.live_files()}
        for key, value in db.items():
            digest.update(len(key).to_bytes(4, "little") + key)
            digest.update(len(value).to_bytes(4, "little") + value)
            keys += 1
    finally:
        db.close()
    return keys, digest.hexdigest(), live
