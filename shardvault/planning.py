"""Object and part planning: how a backup's bytes become S3 objects and parts.

One knob governs sizes: the *part size*. An object is at most ``PARTS_PER_OBJECT`` parts, so
the object size follows from it. The part size is chosen from the backup's total bytes so
that a backup has few, large objects (xbcloud's 10 MiB objects made ~100,000 requests per
TiB), never fewer than ``MIN_OBJECT_SIZE`` bytes per object, and never more parts per object
than S3 allows. Every later stage (compression, encryption) works in units of this part.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from shardvault.errors import PlanTooLarge
from shardvault.models import ObjectPlan, ShardListing

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

S3_MIN_PART_SIZE = 5 * MiB
S3_MAX_PART_SIZE = 5 * GiB
S3_MAX_PARTS = 10_000

DEFAULT_MIN_PART_SIZE = 8 * MiB  # s3transfer's default: good throughput per request
PARTS_PER_OBJECT = 32
MIN_OBJECT_SIZE = DEFAULT_MIN_PART_SIZE * PARTS_PER_OBJECT  # 256 MiB
TARGET_MAX_OBJECTS = 1_000  # above this, parts grow instead of the object count


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_part_size(total_bytes: int) -> int:
    """The part size for a backup of ``total_bytes``: a power of two from 8 MiB to 5 GiB."""
    wanted = -(-total_bytes // (TARGET_MAX_OBJECTS * PARTS_PER_OBJECT))
    size = _next_power_of_two(max(wanted, 1))
    return min(max(size, DEFAULT_MIN_PART_SIZE), S3_MAX_PART_SIZE)


def check_part_size(part_size: int) -> int:
    """Validates a part size given by the user (the one knob)."""
    if not S3_MIN_PART_SIZE <= part_size <= S3_MAX_PART_SIZE:
        raise PlanTooLarge(
            f"part size {part_size} bytes is outside S3's limits (5 MiB to 5 GiB).",
            fix="choose a part size between 5 MiB and 5 GiB, or omit it to have it chosen "
            "from the data size.",
        )
    return part_size


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


def object_key(prefix: str, cluster: str, backup_id: str, listing: ShardListing, i: int) -> str:
    return f"{backup_prefix(prefix, cluster, backup_id)}{listing.shard_id}/{listing.phase}-{i:05d}"


def backup_prefix(prefix: str, cluster: str, backup_id: str) -> str:
    """Where a backup's objects and manifest live in the store."""
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    return f"{base}{cluster}/{backup_id}/"


def plan_objects(
    *, backup_id: str, cluster: str, prefix: str, listings: list[ShardListing], part_size: int
) -> list[ObjectPlan]:
    """Every object of a backup phase, in a deterministic order (shard, then offset)."""
    object_size = object_size_for(part_size)
    plans: list[ObjectPlan] = []
    for listing in sorted(listings, key=lambda item: item.shard_id):
        for i, (offset, length) in enumerate(cut_stream(listing.bytes, object_size)):
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
                )
            )
    for plan in plans:
        if plan.part_count > S3_MAX_PARTS:  # impossible by construction; kept as a guard
            raise PlanTooLarge(f"object {plan.key} would need {plan.part_count} parts.")
    return plans
