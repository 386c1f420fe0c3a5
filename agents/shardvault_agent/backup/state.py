"""What a node keeps of each backup between its commands (``BackupFiles``).

Under ``state_dir``:

- ``backups/<backup_id>/``: the backup's *captures* and *scans* (``captures``), the upload
  limits and wrapped data key its checkpoint brought, its block maps, a full's hash fragments,
  the *packed copies* (an object's stored bytes, until every part is uploaded) and the record
  of parts sent. Release deletes the directory.
- ``released/<backup_id>``: the *tombstone* release leaves, so a command still in flight, or
  replayed after a restart, gives up instead of making state nobody will release.
- ``cuts/<cut_id>/<shard_id>.json``: a scheduled cut's restore point on the shard, as its
  engine recorded it: a redelivered ``cut`` answers it again instead of making a second point
  of the same name (recovery stops at the first). Kept ``KEPT_CUT_SECONDS``.
- ``blockmaps/<shard_id>/``: the block maps of the newest backups this node made, kept for the
  next incremental's scan (checked against the manifest before use).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

from shardvault.contracts.models import Encryption, ObjectPlan, Phase, UploadLimits
from shardvault.errors import BackupReleased
from shardvault_agent.backup.captures import SavedCapture, ShardScan
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.base import Capture, EngineAdapter
from shardvault_agent.statefiles import write_json

KEPT_MAPS = 2  # block maps kept per shard: the newest backup's, and the one before
# A cut's command lives at most its task's 300 s (cut.asl.json); a day covers any redelivery.
KEPT_CUT_SECONDS = 24 * 3600


class BackupFiles:
    """Where each piece of a backup's state lives on this node, and how it is read back."""

    def __init__(self, config: AgentConfig, engine: EngineAdapter) -> None:
        self.config, self.engine = config, engine

    @property
    def backups_dir(self) -> Path:
        return self.config.state_dir / "backups"

    def backup_dir(self, backup_id: str) -> Path:
        return self.backups_dir / backup_id

    def held_backups(self) -> set[str]:
        """Backups this node holds state of: its captures, and the engine's own (snapshots)."""
        captured = {p.name for p in self.backups_dir.glob("*") if p.is_dir()}
        return captured | self.engine.held_backups()

    # --- release --------------------------------------------------------------------------
    def tombstone(self, backup_id: str) -> Path:
        return self.config.state_dir / "released" / backup_id

    def released(self, backup_id: str) -> bool:
        return self.tombstone(backup_id).exists()

    def refuse_released(self, backup_id: str) -> None:
        if self.released(backup_id):
            raise BackupReleased(
                f"backup {backup_id} was already released on this node.",
                fix="nothing to do: that backup has ended; start a new one.",
            )

    def remove(self, backup_id: str) -> None:
        shutil.rmtree(self.backup_dir(backup_id), ignore_errors=True)

    # --- scheduled cuts ---------------------------------------------------------------------
    def cut_path(self, cut_id: str, shard_id: str) -> Path:
        return self.config.state_dir / "cuts" / cut_id / f"{shard_id}.json"

    def saved_cut(self, cut_id: str, shard_id: str) -> dict[str, str] | None:
        """The shard's restore point of the cut, if this node made it already."""
        path = self.cut_path(cut_id, shard_id)
        return json.loads(path.read_text()) if path.exists() else None

    def save_cut(self, cut_id: str, shard_id: str, marker: dict[str, str]) -> None:
        write_json(self.cut_path(cut_id, shard_id), marker)

    def forget_cuts(self, before: float) -> None:
        """Removes the records of cuts made before ``before`` (epoch seconds)."""
        for cut_dir in (self.config.state_dir / "cuts").glob("*"):
            with contextlib.suppress(FileNotFoundError):
                if cut_dir.stat().st_mtime < before:
                    shutil.rmtree(cut_dir, ignore_errors=True)

    # --- captures -------------------------------------------------------------------------
    def capture_path(self, backup_id: str, shard_id: str, phase: Phase) -> Path:
        return self.backup_dir(backup_id) / f"{shard_id}.{phase}.json"

    def save_capture(
        self, backup_id: str, shard_id: str, phase: Phase, capture: Capture, at: float
    ) -> None:
        path = self.capture_path(backup_id, shard_id, phase)
        SavedCapture.taken(capture, at).save(path)

    def load_capture(self, backup_id: str, shard_id: str, phase: Phase) -> SavedCapture:
        path = self.capture_path(backup_id, shard_id, phase)
        what = f"{phase} capture of shard {shard_id} for backup {backup_id}"
        return SavedCapture.load(path, what)

    def stopped_before(self, backup_id: str, shard_id: str) -> bool:
        return self.capture_path(backup_id, shard_id, Phase.TAIL).exists()

    # --- what the checkpoint brought --------------------------------------------------------
    def _limits_path(self, backup_id: str) -> Path:
        return self.backup_dir(backup_id) / "upload-limits.json"

    def save_limits(self, backup_id: str, limits: UploadLimits | None) -> None:
        """Keeps the policy's upload limits the checkpoint command brought, for the backup's
        pack and upload commands (they survive an agent restart like the captures)."""
        kept = limits or UploadLimits()
        write_json(self._limits_path(backup_id), kept.model_dump(mode="json"))

    def upload_limits(self, backup_id: str) -> UploadLimits:
        path = self._limits_path(backup_id)
        return (
            UploadLimits.model_validate_json(path.read_text()) if path.exists() else UploadLimits()
        )

    def _encryption_path(self, backup_id: str) -> Path:
        return self.backup_dir(backup_id) / "encryption.json"

    def save_encryption(self, backup_id: str, encryption: Encryption | None) -> None:
        """Keeps the backup's wrapped data key (never the key itself) for its pack commands."""
        path = self._encryption_path(backup_id)
        if encryption:
            write_json(path, encryption.model_dump(mode="json"))
        else:
            path.unlink(missing_ok=True)

    def encryption(self, backup_id: str) -> Encryption | None:
        path = self._encryption_path(backup_id)
        return Encryption.model_validate_json(path.read_text()) if path.exists() else None

    # --- scans and block maps (incrementals; see scan.py) -----------------------------------
    def map_path(self, backup_id: str, shard_id: str) -> Path:
        return self.backup_dir(backup_id) / f"{shard_id}.map"

    def scan_path(self, backup_id: str, shard_id: str) -> Path:
        return self.backup_dir(backup_id) / f"{shard_id}.extents.json"

    def hashes_dir(self, backup_id: str, shard_id: str) -> Path:
        """A full's hash fragments, one per data object (``scan.PackHasher``)."""
        return self.backup_dir(backup_id) / "hashes" / shard_id

    def saved_scan(self, backup_id: str, shard_id: str) -> ShardScan | None:
        return ShardScan.load(self.scan_path(backup_id, shard_id))

    def discard_scan(self, backup_id: str, shard_id: str) -> None:
        """Removes a shard's scan answer, block map, hash fragments (with the identities
        beside them) and packed copies: they belong to one capture, and a checkpoint taken
        again replaces it. A packed copy is reused for an identical object plan, and a lost
        capture's plan can be identical (the same blocks changed) while its bytes are older
        than the new checkpoint's start."""
        self.scan_path(backup_id, shard_id).unlink(missing_ok=True)
        self.map_path(backup_id, shard_id).unlink(missing_ok=True)
        shutil.rmtree(self.hashes_dir(backup_id, shard_id), ignore_errors=True)
        for summary in self.packed_dir(backup_id).glob("*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                if json.loads(summary.read_text())["object"]["shard_id"] == shard_id:
                    summary.with_suffix(".bin").unlink(missing_ok=True)
                    summary.unlink(missing_ok=True)

    def hashed_in_pack(self, backup_id: str, shard_id: str) -> bool:
        """A full (its scan found no parent: every byte is sent) has its block map made of
        its packs' hashes, not by a scan."""
        scan = self.saved_scan(backup_id, shard_id)
        return scan is not None and scan.is_full

    def map_goes_with_tail(self, backup_id: str, shard_id: str) -> bool:
        """A full's map (joined at Stop), or an incremental's scanned by a Scan command (its
        map is planned with the tail)."""
        scan = self.saved_scan(backup_id, shard_id)
        return scan is not None and (scan.is_full or scan.map_with_tail)

    def cached_map(self, shard_id: str, backup_id: str) -> Path:
        """Where this node keeps the block map of a backup it made, for the next incremental."""
        return self.config.state_dir / "blockmaps" / shard_id / f"{backup_id}.map"

    def keep_map(self, item: ObjectPlan) -> None:
        """Keeps a packed block map for the next incremental (checked against the manifest
        before it is used); older ones go."""
        cache = self.cached_map(item.shard_id, item.backup_id)
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.map_path(item.backup_id, item.shard_id), cache.with_suffix(".tmp"))
        cache.with_suffix(".tmp").replace(cache)
        kept = sorted(cache.parent.glob("*.map"), key=lambda p: p.stat().st_mtime)
        for old in kept[:-KEPT_MAPS]:
            old.unlink(missing_ok=True)

    # --- packed copies and sent parts -------------------------------------------------------
    def packed_dir(self, backup_id: str) -> Path:
        """The backup's packed copies (``.bin``) and their summaries (``.json``)."""
        return self.backup_dir(backup_id) / "packed"

    def packed_path(self, item: ObjectPlan) -> Path:
        """The packed copy of an object (its stored bytes), until every part is uploaded."""
        digest = hashlib.sha256(item.key.encode()).hexdigest()[:24]
        return self.packed_dir(item.backup_id) / f"{digest}.bin"

    def sent_parts_path(self, backup_id: str, upload: str) -> Path:
        """The record of one upload's parts sent: ``upload`` is a multipart upload's id, or
        (a single PUT) the object's key."""
        digest = hashlib.sha256(upload.encode()).hexdigest()[:24]
        return self.backup_dir(backup_id) / "uploads" / f"{digest}.jsonl"
