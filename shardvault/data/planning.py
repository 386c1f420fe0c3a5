"""Object and part planning: how a backup's bytes become S3 objects and parts.

One knob governs sizes: the *part size*. An object is at most ``PARTS_PER_OBJECT`` parts, so
the object size follows from it. The part size is chosen from the backup's total bytes so
that a backup has few, large objects (xbcloud's 10 MiB objects made ~100,000 requests per
TiB), never fewer than ``MIN_OBJECT_SIZE`` bytes per object, and never more parts per object
than S3 allows. Every later stage (compression, encryption) works in units of this part.

Inside an object, the part pipeline (``shardvault.data.pipeline``) compresses and seals *frames*
of ``frame_size_for(object size)`` bytes of plaintext: 1 MiB (enough for zstd to find repeats
across rows and pages), growing to 4 MiB for the largest objects so that an object's frame
table (12 bytes a frame) stays small enough for a task result. Frames never change where
objects and parts are cut.

Backups bound for an *archive class* (GLACIER, DEEP_ARCHIVE) get larger parts: there every
object costs on the way in (a state transition per step, a copy into the vault, 40 KB of
billed metadata, a restore request on the way out) against storage so cheap that, at the
default sizes, those costs were 8% of the storage bill. Their parts grow up to
``ARCHIVE_PART_SIZE`` (objects up to 16 GiB) while the backup still has at least
``ARCHIVE_MIN_OBJECTS`` objects to upload side by side; ``costs`` shows the effect.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from shardvault.contracts.commands import Listing
from shardvault.contracts.deployment import NODE_MAP_CONCURRENCY
from shardvault.contracts.layout import object_key
from shardvault.contracts.models import (
    Compression,
    FileEntry,
    ObjectPlan,
    Phase,
    ShardListing,
    unpack_files,
)
from shardvault.errors import InvalidRequest, PlanTooLarge
from shardvault.pricing.prices import ARCHIVE_CLASSES

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

S3_MIN_PART_SIZE = 5 * MiB
S3_MAX_PART_SIZE = 5 * GiB
S3_MAX_PARTS = 10_000
PART_SIZE_RANGE = "5 MiB to 5 GiB (5,242,880 to 5,368,709,120 bytes)"

DEFAULT_MIN_PART_SIZE = 8 * MiB  # s3transfer's default: good throughput per request
PARTS_PER_OBJECT = 32
MIN_OBJECT_SIZE = DEFAULT_MIN_PART_SIZE * PARTS_PER_OBJECT  # 256 MiB
TARGET_MAX_OBJECTS = 1_000  # above this, parts grow instead of the object count
ARCHIVE_PART_SIZE = 512 * MiB  # largest part chosen for an archive class: 16 GiB objects
ARCHIVE_MIN_OBJECTS = 4  # as many as an agent uploads at once (max_parallel_commands)
MIN_FRAME_SIZE = 1 * MiB
MAX_FRAME_SIZE = 4 * MiB  # bounds the memory of a frame in flight (encoded and decoded)
FRAMES_PER_OBJECT = 4096  # 48 KiB of frame table: fits a task result with room to spare


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _part_size_for_objects(total_bytes: int, objects: int) -> int:
    """The power-of-two part size that cuts ``total_bytes`` into at most ``objects`` objects."""
    wanted = -(-total_bytes // (objects * PARTS_PER_OBJECT))
    return _next_power_of_two(max(wanted, 1))


def choose_part_size(total_bytes: int, storage_class: str | None = None) -> int:
    """The part size for a backup of ``total_bytes`` that lands in ``storage_class`` (None: it
    stays in the store): a power of two from 8 MiB to 5 GiB."""
    size = _part_size_for_objects(total_bytes, TARGET_MAX_OBJECTS)
    if storage_class in ARCHIVE_CLASSES:
        # Rounded down: at least ARCHIVE_MIN_OBJECTS objects, once parts exceed the minimum.
        wanted = total_bytes // (ARCHIVE_MIN_OBJECTS * PARTS_PER_OBJECT)
        archive = 1 << max(0, wanted.bit_length() - 1)
        size = max(size, min(archive, ARCHIVE_PART_SIZE))
    return min(max(size, DEFAULT_MIN_PART_SIZE), S3_MAX_PART_SIZE)


def check_part_size(part_size: int) -> int:
    """Validates a part size given by the user (the one knob): one below S3's minimum is a
    wrong request (``InvalidRequest``), one above its maximum a plan too large to store."""
    fix = (
        f"choose a part size of {PART_SIZE_RANGE}, or omit it to have it chosen from the data size."
    )
    if part_size < S3_MIN_PART_SIZE:
        raise InvalidRequest(
            f"part size {part_size} bytes is below S3's minimum; parts may be {PART_SIZE_RANGE}.",
            fix=fix,
        )
    if part_size > S3_MAX_PART_SIZE:
        raise PlanTooLarge(
            f"part size {part_size} bytes is above S3's maximum; parts may be {PART_SIZE_RANGE}.",
            fix=fix,
        )
    return part_size


def frame_size_for(object_size: int) -> int:
    """The plaintext size of an object's frames: a power of two from 1 to 4 MiB, so that an
    object has at most ``FRAMES_PER_OBJECT`` frames (objects grow with the part size)."""
    wanted = -(-object_size // FRAMES_PER_OBJECT)
    size = _next_power_of_two(max(wanted, 1))
    return min(max(size, MIN_FRAME_SIZE), MAX_FRAME_SIZE)


def object_size_for(part_size: int) -> int:
    return part_size * PARTS_PER_OBJECT


def part_count(length: int, part_size: int) -> int:
    return max(1, -(-length // part_size))


@dataclass(frozen=True)
class PartRange:
    part_number: int  # 1-based, as S3 numbers parts
    offset: int  # within the object
    size: int


def part_ranges(length: int, part_size: int) -> list[PartRange]:
    """The parts of an object of ``length`` bytes: all ``part_size`` but the last."""
    return [
        PartRange(n + 1, off, min(part_size, length - off))
        for n, off in enumerate(range(0, max(length, 1), part_size))
    ]


def cut_stream(length: int, object_size: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of each object of a stream; an empty stream makes one empty object
    only when it has files (empty files must still be restored), handled by the caller."""
    for offset in range(0, length, object_size):
        yield offset, min(object_size, length - offset)


# A transfer map's width (the Upload and Download maps' MaxConcurrencyPath), from the plan:
# objects in flight per node (one packing while another uploads; an agent runs
# max_parallel_commands, 4 by default), at least the maps' old fixed width for a small
# cluster, at most the per-node Maps' width (the account's Lambda concurrency is shared:
# shardvault.workflow.fanout).
OBJECTS_IN_FLIGHT_PER_NODE = 2
TRANSFER_CONCURRENCY_FLOOR = 8
TRANSFER_CONCURRENCY_CEILING = NODE_MAP_CONCURRENCY


class OnANode(Protocol):
    node_id: str


Item = TypeVar("Item", bound=OnANode)


def transfer_concurrency(items: Sequence[OnANode]) -> int:
    """How many objects a transfer map moves at once: it grows with the nodes that move them."""
    nodes = len({item.node_id for item in items})
    wanted = max(TRANSFER_CONCURRENCY_FLOOR, OBJECTS_IN_FLIGHT_PER_NODE * nodes)
    return min(TRANSFER_CONCURRENCY_CEILING, wanted)


def interleave_by_node(items: Sequence[Item]) -> list[Item]:
    """The items taken from each node in turn, each node's in their order: a transfer map
    starts items in plan order, so a plan grouped by shard would keep its window on one node
    while the others wait."""
    queues: dict[str, list[Item]] = {}
    for item in items:
        queues.setdefault(item.node_id, []).append(item)
    out: list[Item] = []
    for turn in range(max((len(q) for q in queues.values()), default=0)):
        out += [queue[turn] for queue in queues.values() if turn < len(queue)]
    return out


def listings_from_results(answers: list[Listing], phase: Phase) -> list[ShardListing]:
    """Agents' scan/checkpoint/stop answers (one per node) to shard listings: the plan
    step's, and a node's own when it packs what it listed (``shardvault_agent.backup.commands``)."""
    return [
        ShardListing(
            shard_id=shard.shard_id,
            node_id=answer.node_id,
            phase=phase,
            files=unpack_files(shard.files),
            marker=shard.marker,
            checkpoint_at=shard.checkpoint_at,
            mutable=shard.mutable,
            extents=shard.extents,
            delta_bytes=shard.delta_bytes,
            scan_seconds=shard.scan_seconds,
            unchanged_bytes=shard.unchanged_bytes,
            screened_bytes=shard.screened_bytes,
        )
        for answer in answers
        for shard in answer.shards
    ]


def blockmap_listings(answers: list[Listing]) -> list[ShardListing]:
    """One listing per shard whose agent's answer announces a block map (``blockmap_bytes``):
    the map file, sent as one stream (phase ``blockmap``) through the same pipeline as the
    data."""
    return [
        ShardListing(
            shard_id=shard.shard_id,
            node_id=answer.node_id,
            phase=Phase.BLOCKMAP,
            files=[FileEntry(path=f"{shard.shard_id}.map", size=shard.blockmap_bytes)],
        )
        for answer in answers
        for shard in answer.shards
        if shard.blockmap_bytes
    ]


def plan_objects(
    *,
    backup_id: str,
    cluster: str,
    prefix: str,
    listings: list[ShardListing],
    part_size: int,
    compression: Compression | None = None,
) -> list[ObjectPlan]:
    """Every object of a backup phase, in a deterministic order (shard, then offset). A block
    map is one object however large (a manifest records one per shard; a TiB's map is 1 GiB,
    still 128 parts of 8 MiB)."""
    plans: list[ObjectPlan] = []
    for listing in sorted(listings, key=lambda item: item.shard_id):
        object_size = object_size_for(part_size)
        if listing.phase == Phase.BLOCKMAP:
            object_size = max(object_size, listing.sent_bytes)
        frame_size = frame_size_for(object_size)
        for i, (offset, length) in enumerate(cut_stream(listing.sent_bytes, object_size)):
            plans.append(
                ObjectPlan(
                    backup_id=backup_id,
                    cluster=cluster,
                    node_id=listing.node_id,
                    shard_id=listing.shard_id,
                    phase=listing.phase,
                    index=i,
                    key=object_key(prefix, cluster, backup_id, listing, i),
                    stream_offset=offset,
                    length=length,
                    part_size=part_size,
                    part_count=part_count(length, part_size),
                    mutable=listing.mutable,
                    frame_size=frame_size,
                    compression=compression or Compression(),
                )
            )
    for plan in plans:
        if plan.part_count > S3_MAX_PARTS:  # impossible by construction; kept as a guard
            raise PlanTooLarge(f"object {plan.key} would need {plan.part_count} parts.")
    return plans
