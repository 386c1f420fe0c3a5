"""Chains: a restore of an incremental backup writes bytes from every backup of its chain, the
full at its root and each incremental after it; this module hands each node its shards' chains.

Terms:
- *member*: one backup of a chain, seen through one shard's data stream: its files (its own
  listing), its *extents* (the byte ranges it changed since its parent; none for the full at
  the root, whose objects hold the whole stream) and its objects, which hold its *delta
  stream*: the bytes of its extents, in order.

The node that restores a shard places its chain itself
(``shardvault_agent.restore.chain_placement``): which member holds each byte of the restored stream,
and where in that member's objects. A chain of scattered changes makes millions of
placements, too many for a task's input, and each node places only its own shards.
"""

from __future__ import annotations

from typing import Any

from shardvault.contracts.models import BackupKind, Manifest, ManifestStream, Phase, pack_files


def data_stream(manifest: Manifest, shard_id: str) -> ManifestStream:
    shard = next(s for s in manifest.shards if s.shard_id == shard_id)
    return next(s for s in shard.streams if s.phase == Phase.DATA)


def chain_args(chain: list[Manifest], shard_id: str) -> list[dict[str, Any]]:
    """A shard's chain, root first, as the restore's prepare step hands it to the node that
    restores the shard: per member its data stream's files (packed), its extents (None: the
    root, whose objects hold the whole stream; "": nothing changed in this shard) and its
    objects. The node places the chain itself
    (``shardvault_agent.restore.chain_placement.place_chain``)."""
    members = []
    for manifest in chain:
        stream = data_stream(manifest, shard_id)
        members.append(
            {
                "backup_id": manifest.backup_id,
                "files": pack_files(stream.files),
                "extents": None if manifest.kind == BackupKind.FULL else stream.extents,
                "objects": [
                    {
                        "key": o.key,
                        "stream_offset": o.stream_offset,
                        "length": o.length,
                        "frame_size": o.frame_size,
                    }
                    for o in stream.objects
                ],
            }
        )
    return members
