"""Chains: which backup of a chain holds each byte a restore of its newest backup writes.

Terms:
- *member*: one backup of a chain, seen through one shard's data stream: its files (its own
  listing) and its extents (``None`` for the full at the root: its objects hold the whole
  stream). A member's objects hold its *delta stream*: the bytes of its extents, in order.
- *piece*: ``length`` bytes at ``delta_offset`` of one member's delta stream, written at
  ``target`` of the newest member's stream (the one restored).
- *placement*: a piece seen through the member's stored objects: ``(frame, offset in the
  frame, length, target)``, so a node fetches only the frames an object contributes and
  writes each frame's pieces (``object_placements``).

Resolution, newest member first: each member's extents, mapped per file onto the newest
listing (files the newest backup no longer has are dropped; bytes past a file's newest size
are cut), claim the bytes no newer member claimed. A block absent from a member's extents was
unchanged since its parent (its hash was equal), so the older member holds the same bytes;
the root holds every byte. Stream offsets differ between members (files grow and shrink), so
everything is matched by file path and offset in the file, never by stream offset.

*Layered* resolution (``layered``): the root's pieces are every byte it maps, not only the
bytes no newer member claimed, so its frames land whole, as a full's do, instead of as tens of
thousands of pieces between the changed blocks of a chain of scattered changes. The newer
members' claimed pieces split in two: those the root also writes are *patches*, laid into the
root's frame buffers before each frame is written (every byte written once; the node keeps a
newer member's stored frames until the root's arrive: the restore's first download wave holds
the newer members' objects, the second the root's); the rest (files or blocks the root does
not have) are written as they arrive. Without the waves' order a layered placement is wrong, so
a node uses it only when told.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple

from shardvault.errors import ParentUnavailable
from shardvault.extents import coarsen, unpack_extents
from shardvault.models import (
    BackupKind,
    FileEntry,
    Manifest,
    ManifestStream,
    Phase,
    pack_files,
    unpack_files,
)
from shardvault.streams import StreamIndex


@dataclass(frozen=True)
class Member:
    backup_id: str
    files: list[FileEntry]
    extents: list[tuple[int, int]] | None  # None: the whole stream (a full)


class Piece(NamedTuple):  # a tuple: a chain of scattered changes makes tens of thousands
    backup_id: str
    delta_offset: int
    length: int
    target: int


# Makes a Piece without the Python frame of its generated ``__new__``: a chain of scattered
# changes makes hundreds of thousands, and making them took a third of placing the chain.
_new_tuple = tuple.__new__


class Unclaimed:
    """Disjoint ranges ``[start, end)`` not yet claimed, sorted."""

    def __init__(self, length: int) -> None:
        self.starts, self.ends = ([0], [length]) if length else ([], [])

    def take(self, ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Removes the unclaimed parts of ``ranges`` (``(start, end, tag)``, sorted and
        disjoint) and returns them, each with its range's tag. One sweep over both lists,
        copying the untouched runs between them as slices: a chain of scattered changes
        claims tens of thousands of ranges per member."""
        starts, ends = self.starts, self.ends
        kept_starts: list[int] = []
        kept_ends: list[int] = []
        taken: list[tuple[int, int, int]] = []
        i = 0
        for lo, hi, tag in ranges:
            j = bisect.bisect_right(ends, lo, i)  # intervals ending at or before lo: kept
            kept_starts += starts[i:j]
            kept_ends += ends[i:j]
            i = j
            while i < len(starts) and starts[i] < hi:
                start, end = starts[i], ends[i]
                a, b = max(start, lo), min(end, hi)
                if start < a:
                    kept_starts.append(start)
                    kept_ends.append(a)
                taken.append((a, b, tag))
                if b < end:  # the interval goes on past this range: later ranges may take it
                    starts[i] = b
                    break
                i += 1
        kept_starts += starts[i:]
        kept_ends += ends[i:]
        self.starts, self.ends = kept_starts, kept_ends
        return taken

    @property
    def empty(self) -> bool:
        return not self.starts


def resolve(chain: list[Member], layered: bool = False) -> list[Piece]:
    """The pieces that make the newest member's stream, root first in ``chain``; sorted by
    member (oldest first) and delta offset, adjacent ones merged. ``layered`` (see the module
    docstring): the root's pieces are all it maps."""
    return resolve_layers(chain, layered)[0]


def resolve_layers(chain: list[Member], layered: bool) -> tuple[list[Piece], list[Piece]]:
    """``resolve``'s pieces, and of the root's, those no newer member overwrites: the bytes
    the root supplies to the restored stream (layered, fewer than it writes)."""
    newest = chain[-1]
    index = StreamIndex(newest.files)
    where = {f.path: (start, f.size) for f, start in zip(newest.files, index.starts, strict=False)}
    unclaimed = Unclaimed(index.length)
    # (member's place in the chain, delta offset, length, target): tuples sort fast, and a
    # chain of scattered changes makes tens of thousands of pieces.
    found: list[tuple[int, int, int, int]] = []
    kept: list[Piece] = []
    for order in range(len(chain) - 1, -1, -1):
        if unclaimed.empty and not (layered and order == 0):
            continue
        member = chain[order]
        targets = _Targets(member, where)
        extents = member.extents if member.extents is not None else [(0, targets.length)]
        ranges = targets.ranges(extents)
        ranges.sort()
        taken = unclaimed.take(ranges)
        if order == 0 and layered:
            kept = [
                _new_tuple(Piece, (member.backup_id, base + a, b - a, a)) for a, b, base in taken
            ]
            taken = ranges
        found += [(order, base + a, b - a, a) for a, b, base in taken]
    if not unclaimed.empty:
        raise ParentUnavailable(
            f"bytes {unclaimed.starts[0]}-{unclaimed.ends[0]} of the restored stream are in no "
            "backup of its chain: the chain's manifests disagree.",
            fix="restore another backup; run a full backup of the cluster.",
        )
    found.sort()
    ids = [member.backup_id for member in chain]
    return [_new_tuple(Piece, (ids[o], d, n, t)) for o, d, n, t in merged(found)], kept


class _Targets:
    """Where a member's stream ranges land in the newest member's stream, file by file."""

    def __init__(self, member: Member, where: dict[str, tuple[int, int]]) -> None:
        self.index = StreamIndex(member.files)
        self.length = self.index.length
        # Per file of the member: its start in the newest stream and its size there (None:
        # the newest backup no longer has it).
        self.places = [where.get(f.path) for f in member.files]

    def ranges(self, extents: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """``(start, end, base)`` in the newest stream for the member's ``extents`` (sorted,
        disjoint), which are back to back in its delta stream: a target ``t`` holds the delta
        stream's byte ``base + t``. One sweep over the extents and the files together (a chain
        of scattered changes has tens of thousands of extents)."""
        starts, places, out = self.index.starts, self.places, []
        append, files, i, delta = out.append, len(places), 0, 0
        for offset, length in extents:
            end = offset + length
            while i < files and starts[i + 1] <= offset:  # the file holding ``offset``
                i += 1
            j = i
            while j < files and starts[j] < end:
                place, first, after = places[j], starts[j], starts[j + 1]
                lo = offset if offset > first else first
                hi = end if end < after else after
                if hi > lo and place is not None and lo - first < place[1]:
                    start = place[0] + lo - first
                    stop = start + min(hi - lo, place[1] - (lo - first))
                    append((start, stop, delta + (lo - offset) - start))
                j += 1
            delta += length
        return out


@dataclass(frozen=True)
class MemberObject:
    """A stored object of one member's data stream: ``length`` bytes of its delta stream
    from ``stream_offset``, in frames of ``frame_size`` plaintext bytes."""

    backup_id: str
    key: str
    stream_offset: int
    length: int
    frame_size: int


def object_placements(pieces: list[Piece], objects: list[MemberObject]) -> dict[str, list[int]]:
    """Per object key, the placements of its bytes (see the module docstring) as flat
    numbers, four per placement, in the order of ``pieces``; an object no piece reads is
    absent."""
    held: dict[str, tuple[list[MemberObject], list[int]]] = {}
    for obj in sorted(objects, key=lambda o: o.stream_offset):
        own, starts = held.setdefault(obj.backup_id, ([], []))
        own.append(obj)
        starts.append(obj.stream_offset)
    out: dict[str, list[int]] = {}
    for piece in pieces:
        own, starts = held.get(piece.backup_id, ([], []))
        at, left, target = piece.delta_offset, piece.length, piece.target
        while left:
            obj = own[bisect.bisect_right(starts, at) - 1] if own else None
            inside = at - obj.stream_offset if obj else -1
            if obj is None or not 0 <= inside < obj.length:
                raise ParentUnavailable(
                    f"byte {at} of backup {piece.backup_id}'s changes is in none of its objects: "
                    "the chain's manifests disagree.",
                    fix="restore another backup; run a full backup of the cluster.",
                )
            frame, offset = divmod(inside, obj.frame_size)
            take = min(left, obj.frame_size - offset, obj.length - inside)
            out.setdefault(obj.key, []).extend((frame, offset, take, target))
            at, left, target = at + take, left - take, target + take
    return out


def merged(pieces: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """``(member, delta_offset, length, target)`` tuples, sorted, with each piece that goes on
    where the one before it ends (in the same member's delta stream and in the target) joined
    to it."""
    out: list[tuple[int, int, int, int]] = []
    last_member, last_end, last_target_end = -1, -1, -1
    for member, delta, length, target in pieces:
        if member == last_member and delta == last_end and target == last_target_end:
            first = out[-1]
            out[-1] = (member, first[1], first[2] + length, first[3])
        else:
            out.append((member, delta, length, target))
        last_member, last_end, last_target_end = member, delta + length, target + length
    return out


# --- the chain as a node receives it ----------------------------------------------------------
def data_stream(manifest: Manifest, shard_id: str) -> ManifestStream:
    shard = next(s for s in manifest.shards if s.shard_id == shard_id)
    return next(s for s in shard.streams if s.phase == Phase.DATA)


def chain_args(chain: list[Manifest], shard_id: str) -> list[dict[str, Any]]:
    """A shard's chain, root first, as the restore's prepare step hands it to the node that
    restores the shard: per member its data stream's files (packed), its extents (None: the
    root, whose objects hold the whole stream; "": nothing changed in this shard) and its
    objects. The node places the chain itself (``place_chain``): a chain of scattered changes
    makes millions of placements, too many for a task's input."""
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


class Placed(NamedTuple):
    """A chain placed by the node that restores it: per object key, its placements (flat
    numbers, ``object_placements``) written as its frames arrive, its patches (the same,
    layered only: laid into the root's frames), and how many bytes of the restored stream it
    supplies (its progress; layered, the root writes more than it supplies)."""

    placements: dict[str, list[int]]
    supplied: dict[str, int]
    patches: dict[str, list[int]] = {}


def place_chain(members: list[dict[str, Any]], layered: bool = False) -> Placed:
    """A chain (``chain_args``) placed in the newest member's stream; ``layered``: see the
    module docstring."""
    chain = [
        Member(
            m["backup_id"],
            unpack_files(m["files"]),
            None if m["extents"] is None else unpack_extents(m["extents"]) if m["extents"] else [],
        )
        for m in members
    ]
    objects = [
        MemberObject(m["backup_id"], o["key"], o["stream_offset"], o["length"], o["frame_size"])
        for m in members
        for o in m["objects"]
    ]
    pieces, root_kept = resolve_layers(chain, layered)
    if not layered:
        placements = object_placements(pieces, objects)
        return Placed(placements, {key: sum(n[2::4]) for key, n in placements.items()})
    root_id = chain[0].backup_id
    root = [p for p in pieces if p.backup_id == root_id]
    covered, uncovered = split_by_cover([p for p in pieces if p.backup_id != root_id], root)
    placements = object_placements(root + uncovered, objects)
    patches = object_placements(covered, objects)
    supplied = {
        key: sum(placements.get(key, [])[2::4]) + sum(patches.get(key, [])[2::4])
        for key in placements.keys() | patches.keys()
    }
    # The root supplies only what no newer member overwrites.
    root_objects = [o for o in objects if o.backup_id == root_id]
    supplied |= bytes_in_objects(root_kept, root_objects)
    return Placed(placements, supplied, patches)


def bytes_in_objects(pieces: list[Piece], objects: list[MemberObject]) -> dict[str, int]:
    """Per object of one member, how many bytes of ``pieces`` (that member's) it holds."""
    objects = sorted(objects, key=lambda o: o.stream_offset)
    starts = [o.stream_offset for o in objects]
    held = {o.key: 0 for o in objects}
    for piece in pieces:
        at, end = piece.delta_offset, piece.delta_offset + piece.length
        i = max(0, bisect.bisect_right(starts, at) - 1)
        while at < end and i < len(objects):
            obj = objects[i]
            stop = min(end, obj.stream_offset + obj.length)
            if stop > at:
                held[obj.key] += stop - at
                at = stop
            i += 1
    return held


def split_by_cover(pieces: list[Piece], cover: list[Piece]) -> tuple[list[Piece], list[Piece]]:
    """``pieces`` cut where ``cover``'s targets begin and end: the parts that fall on bytes
    ``cover`` writes, and the rest."""
    spans = coarsen(sorted((p.target, p.length) for p in cover), 1)  # touching ones joined
    starts, ends = [a for a, _ in spans], [a + n for a, n in spans]
    covered: list[Piece] = []
    uncovered: list[Piece] = []
    for piece in sorted(pieces, key=lambda p: p.target):
        at, end = piece.target, piece.target + piece.length
        i = bisect.bisect_right(ends, at)  # the first span ending past ``at``
        while at < end:
            inside = i < len(starts) and starts[i] <= at
            stop = min(end, ends[i] if inside else starts[i] if i < len(starts) else end)
            part = _new_tuple(
                Piece, (piece.backup_id, piece.delta_offset + at - piece.target, stop - at, at)
            )
            (covered if inside else uncovered).append(part)
            at = stop
            i += inside
    return covered, uncovered
