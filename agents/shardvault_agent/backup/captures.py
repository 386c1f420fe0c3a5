"""What a node keeps of a backup between its commands, under ``state_dir/backups/<backup_id>/``.

- *capture*: one shard's checkpoint (phase ``data``) or stop (phase ``tail``) as its engine
  took it, and when: the files and sizes it lists under its root, the engine's marker. Saved
  the moment it is taken, so a later command (pack, upload, stop) and a retried one find it.
- *scan*: what one shard's scan found against its parent (``scan``): the changed extents,
  packed, and what it read. Saved before it answers, so a retried scan answers the same.

Both are plain JSON files written whole (``statefiles.write_json``); release deletes the
backup's directory, and with it both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shardvault.contracts.commands import Marker, ScanFields
from shardvault.contracts.models import FileEntry, Frozen
from shardvault.errors import CheckpointNotFound
from shardvault_agent.engines.base import Capture
from shardvault_agent.statefiles import write_json


@dataclass(frozen=True)
class SavedCapture:
    """A capture and the time its checkpoint (or stop) was taken."""

    root: Path
    files: list[FileEntry]
    checkpoint_at: float
    marker: Marker = field(default_factory=dict)
    mutable: bool = False
    trust_identity: bool = False

    @classmethod
    def taken(cls, capture: Capture, at: float) -> SavedCapture:
        return cls(
            root=capture.root,
            files=capture.files,
            checkpoint_at=at,
            marker=capture.marker,
            mutable=capture.mutable,
            trust_identity=capture.trust_identity,
        )

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def save(self, path: Path) -> None:
        # Files as [path, size] pairs: a capture of a large shard lists many thousands.
        write_json(
            path,
            {
                "root": str(self.root),
                "files": [[f.path, f.size] for f in self.files],
                "marker": self.marker,
                "mutable": self.mutable,
                "trust_identity": self.trust_identity,
                "checkpoint_at": self.checkpoint_at,
            },
        )

    @classmethod
    def load(cls, path: Path, what: str) -> SavedCapture:
        """The capture saved at ``path``; CheckpointNotFound naming ``what`` when none is."""
        if not path.exists():
            raise CheckpointNotFound(
                f"this agent holds no {what}.",
                fix="retry the backup (the agent may have been restarted or released it).",
            )
        saved = json.loads(path.read_text())
        return cls(
            root=Path(saved["root"]),
            files=[FileEntry(path=p, size=s) for p, s in saved["files"]],
            checkpoint_at=saved["checkpoint_at"],
            marker=saved["marker"],
            mutable=saved["mutable"],
            trust_identity=saved.get("trust_identity", False),
        )


class ShardScan(ScanFields, Frozen):
    """One shard's scan, saved before it answers (``ScanFields`` says what each field is)."""

    @property
    def is_full(self) -> bool:
        return self.delta_bytes is None

    def save(self, path: Path) -> None:
        write_json(path, self.model_dump(mode="json", exclude_unset=True))

    @classmethod
    def load(cls, path: Path) -> ShardScan | None:
        return cls.model_validate_json(path.read_text()) if path.exists() else None
