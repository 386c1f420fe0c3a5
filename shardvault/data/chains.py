"""Chains: a restore of an incremental backup writes bytes from every backup of its chain, the
full at its root and each incremental after it; this module hands each node its shards' chains.

Terms:
- *member*: one backup of a chain, seen through one shard's data stream: its files (its own
  listing), its *extents* (the byte ranges it changed since its parent; none for the full at
  the root, whose objects hold the whole stream) and its objects, which hold its *delta
  stream*: the bytes of its extents, in order.
- *layer*: a member as a restore reads it. A synthesized full (``shardvault.backup.synthesis``)
  holds copies of the chain it was made from, so it is read as several layers: one per backup
  of that chain (``ManifestStream.layers``), then its own changes. Any other backup is one.
- *layered*: a backup a restore reads as a chain of layers: an incremental (with its
  ancestors) or a synthesized full (alone).

The node that restores a shard places its chain itself
(``shardvault_agent.restore.chain_placement``): which member holds each byte of the restored stream,
and where in that member's objects. A chain of scattered changes makes millions of
placements, too many for a task's input, and each node places only its own shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardvault.contracts.models import (
    BackupKind,
    FileEntry,
    Manifest,
    ManifestStream,
    ObjectResult,
    Phase,
    pack_files,
)


@dataclass(frozen=True)
class ShardLayer:
    """One layer of a shard's chain: whose it is, its files, its extents (None: the whole
    stream) and its objects, with the manifest that records them."""

    backup_id: str
    files: list[FileEntry]
    extents: str | None
    objects: list[ObjectResult]
    manifest: Manifest


def data_stream(manifest: Manifest, shard_id: str) -> ManifestStream:
    shard = next(s for s in manifest.shards if s.shard_id == shard_id)
    return next(s for s in shard.streams if s.phase == Phase.DATA)


def is_layered(manifest: Manifest) -> bool:
    """Whether a restore reads the backup's data as a chain of layers (module docstring)."""
    return manifest.kind == BackupKind.INCREMENTAL or manifest.synthesized_from is not None


def shard_layers(manifest: Manifest, shard_id: str) -> list[ShardLayer]:
    """The layers one backup contributes to a shard's chain, oldest first."""
    stream = data_stream(manifest, shard_id)
    below = [
        ShardLayer(
            layer.backup_id,
            layer.files,
            layer.extents,
            [o for o in stream.objects if o.layer == i],
            manifest,
        )
        for i, layer in enumerate(stream.layers)
    ]
    whole = manifest.kind == BackupKind.FULL and not stream.layers
    own = ShardLayer(
        manifest.backup_id,
        stream.files,
        None if whole else stream.extents,
        stream.own_objects,
        manifest,
    )
    return [*below, own]


def chain_layers(chain: list[Manifest], shard_id: str) -> list[ShardLayer]:
    """A shard's chain, root first: every layer of every backup of ``chain`` (root first)."""
    return [layer for manifest in chain for layer in shard_layers(manifest, shard_id)]


def chain_args(chain: list[Manifest], shard_id: str) -> list[dict[str, Any]]:
    """A shard's chain, root first, as the restore's prepare step hands it to the node that
    restores the shard: per layer its data stream's files (packed), its extents (None: the
    root, whose objects hold the whole stream; "": nothing changed in this shard) and its
    objects. The node places the chain itself
    (``shardvault_agent.restore.chain_placement.place_chain``)."""
    return [
        {
            "backup_id": layer.backup_id,
            "files": pack_files(layer.files),
            "extents": layer.extents,
            "objects": [
                {
                    "key": o.key,
                    "stream_offset": o.stream_offset,
                    "length": o.length,
                    "frame_size": o.frame_size,
                }
                for o in layer.objects
            ],
        }
        for layer in chain_layers(chain, shard_id)
    ]
