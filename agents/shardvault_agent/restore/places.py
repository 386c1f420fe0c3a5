"""Where a restore lives on a target node, and what it keeps between commands.

``Places`` names every directory and file of a restore (the terms are the package's) and
reads and writes the per-restore records: each shard's layout, the failure that ended the
restore here, the tombstone an abort leaves. Objects have a record of their own
(``objects.ObjectRecord``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shardvault import errors
from shardvault.contracts.commands import Prefetched, ShardLayout
from shardvault.errors import DownloadIncomplete, ShardVaultError, TargetNotReady
from shardvault_agent.config import AgentConfig
from shardvault_agent.restore.objects import ObjectRecord
from shardvault_agent.statefiles import write_json

INCOMING = ".incoming"


class LaidOut(ShardLayout):
    """A shard's layout as its node laid it out: what prepare was told (the chain aside, once
    placed), and what its downloads and finish check against the chain's placements."""

    # Every object that writes a byte, which finish requires: an object that failed for good
    # in the Download map (it tolerates failures) must not pass unnoticed.
    chain_objects: list[str] = []
    # A layered chain: the root's objects, and the newer objects whose blocks their frames
    # take in (``overlay``); a root object waits for those (``Downloads.refuse_early``).
    patched_objects: list[str] = []
    patch_objects: list[str] = []

    def stream(self, phase: str) -> str:
        """The packed files of the stream of ``phase``."""
        return next(s.files for s in self.streams if s.phase == phase)


def occupied(restore_dir: Path | None) -> list[str]:
    """Shard directories ``restore_dir`` already holds (reported with each heartbeat)."""
    if restore_dir is None or not restore_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in restore_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and any(p.iterdir())
    )


def room(config: AgentConfig) -> int | None:
    """Bytes this node offers restores: free space, capped by ``restore_capacity_bytes``."""
    if config.restore_dir is None:
        return None
    config.restore_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(config.restore_dir).free
    cap = config.restore_capacity_bytes
    return free if cap is None else min(free, cap)


class Places:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def restore_dir(self) -> Path:
        if self.config.restore_dir is None:
            raise TargetNotReady(
                f"node {self.node_id} accepts no restores: its agent has no restore_dir.",
                fix="set restore_dir in the agent's configuration and restart it.",
            )
        return self.config.restore_dir

    @property
    def restores_dir(self) -> Path:
        return self.config.state_dir / "restores"

    def state(self, restore_id: str) -> Path:
        return self.restores_dir / restore_id

    def incoming(self, restore_id: str) -> Path:
        return self.restore_dir / INCOMING / restore_id

    def staging(self, restore_id: str, shard_id: str) -> Path:
        return self.incoming(restore_id) / shard_id

    def final(self, shard_id: str) -> Path:
        return self.restore_dir / shard_id

    def object(self, restore_id: str, key: str) -> ObjectRecord:
        return ObjectRecord.of(self.state(restore_id) / "objects", key)

    def links_record(self, restore_id: str) -> Path:
        """Where a restore's linked directories are recorded (``linked``): beside its state
        directory, which an aborted download removes before the abort reads the record."""
        return self.restores_dir / f"{restore_id}.links.json"

    def patch_index(self, restore_id: str, shard_id: str) -> Path:
        return self.state(restore_id) / f"{shard_id}.patchindex"

    def held_restores(self) -> set[str]:
        """Restores this node holds state or staging of."""
        ids = {p.name for p in self.restores_dir.glob("*") if p.is_dir()}  # not the tombstones
        if self.config.restore_dir is not None:
            ids |= {p.name for p in (self.restore_dir / INCOMING).glob("*") if p.is_dir()}
        return ids

    def drop_spools(self, restore_id: str) -> bool:
        """Removes a restore's spools (a chain's newer objects, stored: ``overlay``), needed
        no more once its objects are all written; True if there were any."""
        spools = list((self.state(restore_id) / "objects").glob("*.spool"))
        for spool in spools:
            spool.unlink(missing_ok=True)
        return bool(spools)

    # --- layouts --------------------------------------------------------------------------
    def _layout_path(self, restore_id: str, shard_id: str) -> Path:
        return self.state(restore_id) / f"{shard_id}.layout.json"

    def is_laid_out(self, restore_id: str, shard_id: str) -> bool:
        return self._layout_path(restore_id, shard_id).exists()

    def save_layout(self, restore_id: str, layout: LaidOut) -> None:
        """Written last: it marks the shard laid out."""
        path = self._layout_path(restore_id, layout.shard_id)
        write_json(path, layout.model_dump(mode="json", exclude={"chain"}))

    def layout(self, restore_id: str, shard_id: str) -> LaidOut:
        path = self._layout_path(restore_id, shard_id)
        if not path.exists():
            raise DownloadIncomplete(
                f"node {self.node_id} has no layout of shard {shard_id} for restore "
                f"{restore_id} (was it prepared here?).",
                fix="start the restore again; an agent's state_dir must survive restarts.",
            )
        return LaidOut.model_validate_json(path.read_text())

    # --- what prepare fetched ------------------------------------------------------------
    def _prefetched_path(self, restore_id: str) -> Path:
        return self.state(restore_id) / "prefetched.json"

    def save_prefetched(self, restore_id: str, count: Prefetched) -> None:
        write_json(self._prefetched_path(restore_id), count.model_dump(mode="json"))

    def prefetched(self, restore_id: str) -> Prefetched | None:
        """What the chain work fetched as the node prepared, once it landed."""
        path = self._prefetched_path(restore_id)
        return Prefetched.model_validate_json(path.read_text()) if path.exists() else None

    # --- how a restore ended here ---------------------------------------------------------
    def aborted(self, restore_id: str) -> Path:
        """The tombstone an abort leaves: a command of the restore that comes later stops."""
        return self.restores_dir / f"{restore_id}.aborted"

    def refuse_aborted(self, restore_id: str) -> None:
        if self.aborted(restore_id).exists():
            raise DownloadIncomplete(
                f"restore {restore_id} was aborted on node {self.node_id}.",
                fix="nothing to do: that restore has ended; start a new one.",
            )

    def _failure_path(self, restore_id: str) -> Path:
        return self.state(restore_id) / "failed.json"

    def record_failure(self, restore_id: str, error: ShardVaultError) -> None:
        """Keeps the first error that failed the restore for good on this node: later
        downloads and finish report it, whatever order the tasks end in."""
        path = self._failure_path(restore_id)
        if not path.exists() and path.parent.exists():
            failure = {"name": error.name, "message": error.message, "fix": error.fix}
            path.write_text(json.dumps(failure))

    def raise_recorded_failure(self, restore_id: str) -> None:
        path = self._failure_path(restore_id)
        if path.exists():
            failure = json.loads(path.read_text())
            kind = getattr(errors, failure["name"], None)
            if not (isinstance(kind, type) and issubclass(kind, ShardVaultError)):
                kind = DownloadIncomplete
            raise kind(failure["message"], fix=failure["fix"])
