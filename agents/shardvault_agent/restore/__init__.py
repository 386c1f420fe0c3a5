"""Restore on a target node: lay out shards, download their objects, finish and check them.

Terms:
- *restore_dir*: where this node keeps restored shards, one directory per shard
  (``restore_dir/<shard_id>``), configured per agent.
- *staging*: ``restore_dir/.incoming/<restore_id>/<shard_id>``: the files are created there
  at their final sizes by ``prepare_restore`` and filled in place by ``download``; only
  ``finish_restore`` moves a complete, verified shard to its final directory and starts it,
  so nothing half-restored is ever started.
- *state*: ``state_dir/restores/<restore_id>/``: the layout of each shard, each object's
  record (``objects``: the reads it has received, so a retried or resumed download fetches
  only what is missing; whether it is written), and what ``finish_restore`` started (so
  ``abort_restore`` can undo it).
- *adopted shard*: a shard this node restored and checked (``adoption``); the agent holds it
  as if it were in its configuration.

A restore's commands, one module each, in the order they run: ``prepare`` (check room, lay
out, place chains, prefetch), ``download`` (one object), ``finish`` (move in, start, check;
or abort). ``places`` names where everything lives; ``objects``, ``files`` and ``reads`` are
what a download is made of; ``chain_placement`` and ``overlay`` restore incremental chains.

Every part is checked against its checksum as it is written, and every object against the
manifest's full-object checksum (combined from its parts' checksums): there is no
verification pass after the last byte.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shardvault.contracts.commands import (
    Aborted,
    DownloadArgs,
    Downloaded,
    Finished,
    FinishRestoreArgs,
    ParentMap,
    Prepared,
    PrepareRestoreArgs,
)
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import EngineAdapter
from shardvault_agent.keys import DataKeys
from shardvault_agent.restore.adoption import Adoption
from shardvault_agent.restore.download import Downloads
from shardvault_agent.restore.finish import Finisher
from shardvault_agent.restore.places import Places, occupied, room
from shardvault_agent.restore.prepare import ChainWork, Preparer
from shardvault_agent.transfer import Downloader

__all__ = ["Restorer", "occupied", "room"]


class Restorer:
    """A node's restores: its four commands, each run by its own part."""

    def __init__(
        self, config: AgentConfig, engine: EngineAdapter, downloader: Downloader, keys: DataKeys
    ) -> None:
        self.places = Places(config)
        self.chains = ChainWork()
        self.downloads = Downloads(config, self.places, downloader, keys)
        self.adoption = Adoption(config.state_dir, engine)
        self.preparer = Preparer(config, self.places, self.downloads, self.chains)
        self.finisher = Finisher(
            config, engine, self.places, self.chains, self.downloads, self.adoption
        )

    @property
    def downloader(self) -> Downloader:
        return self.downloads.downloader

    def prepare(self, args: PrepareRestoreArgs) -> Prepared:
        return self.preparer.prepare(args)

    def download(self, args: DownloadArgs) -> Downloaded:
        restore_id = args.object.restore_id
        self.places.refuse_aborted(restore_id)
        self.chains.wait(restore_id)  # the chains placed and spooled: the patches are in
        return self.downloads.download(args)

    def finish(self, args: FinishRestoreArgs) -> Finished:
        return self.finisher.finish(args)

    def abort(self, restore_id: str) -> Aborted:
        return self.finisher.abort(restore_id)

    # --- for the rest of the agent --------------------------------------------------------
    def held_restores(self) -> set[str]:
        return self.places.held_restores()

    def drop_staging(self, restore_id: str) -> bool:
        """Removes what a finished restore left in staging and its spools; True if there
        was any."""
        dropped = self.places.drop_spools(restore_id)
        staging = self.places.incoming(restore_id)
        if not staging.exists():
            return dropped
        shutil.rmtree(staging, ignore_errors=True)
        return True

    def adopted_shards(self) -> list[ShardConfig]:
        return self.adoption.shards()

    def fetch_object_plain(self, source: ParentMap, dest: Path) -> Path:
        """A parent's block map, fetched whole (``Downloads.fetch_object_plain``)."""
        return self.downloads.fetch_object_plain(source, dest)
