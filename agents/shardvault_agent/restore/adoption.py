"""Adopted shards: the shards this node restored and checked, held as if configured.

``state_dir/adopted.json`` maps each adopted shard's id to its entry: the restore that placed
it (``restore_id``), the shard as the agent holds it (``shard``: ``ShardConfig`` fields), and
the entry it replaced (``previous``), put back if that restore is aborted. The agent registers
these shards and backs them up, so a restored cluster is protected without editing agent
configs.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from shardvault_agent.config import ShardConfig
from shardvault_agent.engines.base import EngineAdapter
from shardvault_agent.statefiles import write_json

log = logging.getLogger("shardvault.agent.restore")

Entry = dict[str, Any]  # {"restore_id", "shard", "previous"?}, as adopted.json holds it


class Adoption:
    def __init__(self, state_dir: Path, engine: EngineAdapter) -> None:
        self.path = state_dir / "adopted.json"
        self.engine = engine
        self._guard = threading.Lock()  # adopted.json: one writer at a time

    def adopted(self) -> dict[str, Entry]:
        """Adopted shards by id."""
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def shards(self) -> list[ShardConfig]:
        return [ShardConfig.model_validate(e["shard"]) for e in self.adopted().values()]

    def adopt(self, restore_id: str, shard_id: str, result: dict[str, Any]) -> None:
        shard = self.engine.adoptable(shard_id, result)
        if shard is None:
            log.warning("shard %s not adopted: its directory holds no single database", shard_id)
            return
        with self._guard:
            adopted = self.adopted()
            entry: Entry = {"restore_id": restore_id, "shard": shard}
            if (previous := adopted.get(shard_id)) and previous["restore_id"] != restore_id:
                entry["previous"] = {k: previous[k] for k in ("restore_id", "shard")}
            adopted[shard_id] = entry
            write_json(self.path, adopted)

    def unadopt(self, restore_id: str, shard_id: str) -> None:
        """Gives up ``restore_id``'s adoption of the shard, putting back the one it replaced."""
        with self._guard:
            adopted = self.adopted()
            entry = adopted.get(shard_id)
            if entry is None or entry["restore_id"] != restore_id:
                return
            if "previous" in entry:
                adopted[shard_id] = entry["previous"]
            else:
                del adopted[shard_id]
            write_json(self.path, adopted)


def adopted_since(entry: Entry, restore_id: str, started: dict[str, Any]) -> bool:
    """Whether the shard's adopted ``entry`` is a *later* restore's, placed over what
    ``restore_id`` placed, rather than the copy ``restore_id`` itself set aside."""
    owner = entry.get("restore_id")
    if owner is None or owner == restore_id or owner == started.get("replaced_restore"):
        return False
    later = entry.get("previous")
    while later is not None:  # the later restore adopted over this one's adoption
        if later.get("restore_id") == restore_id:
            return True
        later = later.get("previous")
    # This restore never adopted, and noted no copy it set aside (an agent before that note):
    # restore ids begin with their start time, so the later one sorts after.
    return owner > restore_id
