"""Placing a chain: which backup of a chain holds each byte a restore of its newest backup
writes, and where in that backup's stored objects, worked out by the node that restores the
shard, over arrays.

Terms (the chain as a node receives it: ``shardvault.data.chains``):
- *member*: one backup of a chain, seen through one shard's data stream: its files (its own
  listing) and its extents (``None`` for the full at the root: its objects hold the whole
  stream). A member's objects hold its *delta stream*: the bytes of its extents, in order.
- *range*: a member's extent mapped, file by file, onto the newest member's stream (the one
  restored): ``[start, stop)`` there, and the *base* that turns a place there into the
  member's delta offset (``delta = base + place``).
- *piece*: ``length`` bytes at ``delta_offset`` of one member's delta stream, written at
  ``target`` of the newest member's stream.
- *placement*: a piece seen through the member's stored objects: ``(frame, offset in the
  frame, length, target)``, so a node fetches only the frames an object contributes and
  writes each frame's pieces (``object_placements``).

Resolution: each member's extents, mapped per file onto the newest listing (files the newest
backup no longer has are dropped; bytes past a file's newest size are cut), supply the bytes
no newer member's ranges cover. A block absent from a member's extents was unchanged since its
parent (its hash was equal), so the older member holds the same bytes; the root holds every
byte. Stream offsets differ between members (files grow and shrink), so everything is matched
by file path and offset in the file, never by stream offset. The ranges' ends cut the newest
stream into *intervals*, each covered wholly or not at all by each member's ranges; each
interval's *owner* is the newest member covering it.

*Layered* resolution (``layered``): the root's pieces are every byte it maps, not only the
bytes no newer member owns, so its frames land whole, as a full's do, instead of as tens of
thousands of pieces between the changed blocks of a chain of scattered changes. The newer
members' pieces split in two: those the root also writes are *patches*, laid into the root's
frame buffers before each frame is written (every byte written once; the node keeps a newer
member's stored frames until the root's arrive: the restore fetches the newer members' objects
first, the root's after); the rest (files or blocks the root does not have) are written as
they arrive. Without that order a layered placement is wrong, so a node uses it only when told.

Why arrays: a chain of scattered changes has tens of thousands of extents per member, and the
root's downloads wait for its placement. Placed a tuple at a time (about 20 us an extent), the
benchmark's chain of 45,000 extents took 0.4 to 1.1 s, and a chain with millions would take
minutes; here every step is a sort, a search or a cumulative sum over all of them at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from shardvault.contracts.extents import varint_bytes
from shardvault.contracts.models import FileEntry, unpack_file_pairs
from shardvault.errors import ParentUnavailable

I64 = np.int64
Array = np.ndarray  # of int64 unless said otherwise
_CHAIN_DISAGREES = "restore another backup; run a full backup of the cluster."


@dataclass(frozen=True)
class Member:
    """A member as the resolution reads it: its files' paths and sizes, and its extents as
    offsets and lengths in its stream (``None``: the root, the whole stream)."""

    backup_id: str
    paths: list[str]
    sizes: Array
    offsets: Array | None = None
    lengths: Array | None = None

    @classmethod
    def of(
        cls, backup_id: str, files: list[FileEntry], extents: list[tuple[int, int]] | None
    ) -> Member:
        """A member from a listing and extents as ``(offset, length)`` pairs."""
        sizes = np.array([f.size for f in files], dtype=I64)
        if extents is None:
            return cls(backup_id, [f.path for f in files], sizes)
        pairs = np.array(extents, dtype=I64).reshape(-1, 2)
        return cls(backup_id, [f.path for f in files], sizes, pairs[:, 0], pairs[:, 1])

    @cached_property
    def starts(self) -> Array:
        """Each file's start in the member's stream, and the stream's end."""
        return np.concatenate(([0], np.cumsum(self.sizes, dtype=I64)))


class Pieces(NamedTuple):
    """Pieces as columns: the member's place in the chain (root 0), its delta offset, the
    length and the target."""

    member: Array
    delta: Array
    length: Array
    target: Array

    def take(self, which: Array) -> Pieces:
        """The pieces ``which`` (a mask or an order) selects."""
        return Pieces(*(column[which] for column in self))


def concat(first: Pieces, second: Pieces) -> Pieces:
    return Pieces(*(np.concatenate((a, b)) for a, b in zip(first, second, strict=True)))


class Ranges(NamedTuple):
    """A member's ranges in the newest stream, sorted by start and disjoint."""

    start: Array
    stop: Array
    base: Array


def member_ranges(member: Member, newest: Member) -> Ranges:
    """Where ``member``'s extents land in the newest member's stream (see the module
    docstring), split at the member's file boundaries and cut to the newest files' sizes."""
    starts = member.starts
    if member.offsets is None or member.lengths is None:  # the root: its whole stream
        offsets, lengths = np.zeros(1, I64), starts[-1:]
    else:
        offsets, lengths = member.offsets, member.lengths
    delta = np.cumsum(lengths, dtype=I64) - lengths  # each extent's offset in the delta stream
    # Bytes past the member's stream lie in none of its files: nothing of them is placed.
    keep = (lengths > 0) & (offsets < starts[-1])
    offsets, delta = offsets[keep], delta[keep]
    ends = offsets + np.minimum(lengths[keep], starts[-1] - offsets)  # no sum past int64
    # Each extent, once per file it touches: the first holding its first byte (empty files
    # skipped: ``right``), the last holding its last byte.
    first = np.searchsorted(starts, offsets, side="right") - 1
    last = np.searchsorted(starts, ends, side="left") - 1
    counts = last - first + 1
    extent = np.repeat(np.arange(len(offsets)), counts)
    file = first[extent] + _rank_in_group(counts)
    where = newest_places(member.paths, newest)
    place, size = where[0][file], where[1][file]
    file_start = starts[file]
    lo = np.maximum(offsets[extent], file_start)
    hi = np.minimum(ends[extent], starts[file + 1])
    inside = lo - file_start
    keep = (hi > lo) & (place >= 0) & (inside < size)
    lo, hi, inside, place, size, extent = (
        column[keep] for column in (lo, hi, inside, place, size, extent)
    )
    start = place + inside
    stop = start + np.minimum(hi - lo, size - inside)
    base = delta[extent] + (lo - offsets[extent]) - start
    order = np.argsort(start, kind="stable")
    return Ranges(start[order], stop[order], base[order])


def newest_places(paths: list[str], newest: Member) -> tuple[Array, Array]:
    """Per path, its file's start in the newest stream (-1: not there) and size there."""
    at = {path: i for i, path in enumerate(newest.paths)}
    index = np.array([at.get(path, -1) for path in paths], dtype=I64)
    starts = newest.starts
    found = index >= 0
    place = np.where(found, starts[index], -1)
    size = np.where(found, newest.sizes[index] if len(newest.sizes) else 0, 0)
    return place, size


def _rank_in_group(counts: Array) -> Array:
    """0, 1, ... within each of the groups of ``counts`` elements laid back to back."""
    total = int(counts.sum())
    firsts = np.cumsum(counts) - counts
    return np.arange(total, dtype=I64) - np.repeat(firsts, counts)


class Resolution(NamedTuple):
    """The chain's pieces (sorted by member and delta offset, adjacent ones merged), and the
    intervals, each as a piece of its owner, with whether the root covers it."""

    pieces: Pieces
    intervals: Pieces
    root_covers: Array


def resolve_chain(chain: list[Member], layered: bool) -> Resolution:
    """The pieces that make the newest member's stream, root first in ``chain``."""
    newest = chain[-1]
    length = int(newest.starts[-1])
    ranges = [member_ranges(member, newest) for member in chain]
    ends = [r.start for r in ranges] + [r.stop for r in ranges]
    cuts = np.sort(np.concatenate([np.array([0, length], dtype=I64), *ends]))
    cuts = cuts[np.concatenate(([True], cuts[1:] != cuts[:-1]))]  # np.unique hashes: slower
    lefts = cuts[:-1]
    owner = np.full(len(lefts), -1, dtype=I64)
    delta = np.zeros(len(lefts), dtype=I64)
    root_covers = np.zeros(len(lefts), dtype=bool)
    for order, found in enumerate(ranges):  # oldest first: a newer member's cover wins
        covered, base = covers(found, lefts)
        owner[covered] = order
        delta[covered] = base[covered] + lefts[covered]
        if order == 0:
            root_covers = covered
    if (owner < 0).any():
        first = int(np.argmax(owner < 0))
        rest = owner[first:] >= 0
        after = first + int(np.argmax(rest)) if rest.any() else len(owner)
        raise ParentUnavailable(
            f"bytes {int(cuts[first])}-{int(cuts[after])} of the restored stream are in no "
            "backup of its chain: the chain's manifests disagree.",
            fix=_CHAIN_DISAGREES,
        )
    lengths = np.diff(cuts)
    owned = Pieces(owner, delta, lengths, lefts)
    if layered:
        root = ranges[0]
        whole = Pieces(
            np.zeros(len(root.start), I64),
            root.base + root.start,
            root.stop - root.start,
            root.start,
        )
        pieces = concat(whole, owned.take(owner > 0))
    else:
        pieces = owned
    return Resolution(merged(pieces), owned, root_covers)


def covers(ranges: Ranges, places: Array) -> tuple[Array, Array]:
    """Per place, whether ``ranges`` cover it, and the base of the range that does."""
    if not len(ranges.start):
        return np.zeros(len(places), dtype=bool), np.zeros(len(places), dtype=I64)
    k = np.searchsorted(ranges.start, places, side="right") - 1
    inside = np.maximum(k, 0)
    return (k >= 0) & (ranges.stop[inside] > places), ranges.base[inside]


def merged(pieces: Pieces) -> Pieces:
    """``pieces`` sorted by member and delta offset, each that goes on where the one before it
    ends (in the same member's delta stream and in the target) joined to it."""
    member, delta, length, target = pieces.take(np.lexsort((pieces.delta, pieces.member)))
    if not len(member):
        return Pieces(member, delta, length, target)
    joins = (
        (member[1:] == member[:-1])
        & (delta[1:] == delta[:-1] + length[:-1])
        & (target[1:] == target[:-1] + length[:-1])
    )
    firsts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return Pieces(member[firsts], delta[firsts], np.add.reduceat(length, firsts), target[firsts])


# --- through the members' objects ----------------------------------------------------------
class Objects(NamedTuple):
    """The chain's stored objects that hold a byte, sorted by member and stream offset: each
    one's key, member (its place in the chain), offset in its member's delta stream, length
    and frame size; and the members' backup ids."""

    keys: list[str]
    member: Array
    offset: Array
    length: Array
    frame_size: Array
    ids: list[str]

    @classmethod
    def of(cls, members: list[dict[str, Any]]) -> Objects:
        rows = sorted(
            (order, o["stream_offset"], o["length"], o["frame_size"], o["key"])
            for order, m in enumerate(members)
            for o in m["objects"]
            if o["length"] > 0
        )
        numbers = np.array([row[:4] for row in rows], dtype=I64).reshape(-1, 4)
        ids = [m["backup_id"] for m in members]
        return cls([row[4] for row in rows], *numbers.T, ids)


def in_objects(pieces: Pieces, objects: Objects) -> tuple[Array, Array, Array, Array]:
    """``pieces`` cut where their members' objects end: per part, its object, its offset in
    the object, its length and its target, in the order of ``pieces``."""
    if not len(pieces.member):
        return (np.zeros(0, I64),) * 4
    if not objects.keys:  # not one byte of the chain is stored
        raise _not_in_objects(int(pieces.delta[0]), objects.ids[int(pieces.member[0])])
    begin, end = pieces.delta, pieces.delta + pieces.length
    # Per piece, the objects holding its first and its last byte (-1: none), each member's
    # searched in its own delta stream.
    first, last = np.full(len(begin), -1, I64), np.full(len(begin), -1, I64)
    for member in np.unique(pieces.member).tolist():
        mine = pieces.member == member
        low, high = np.searchsorted(objects.member, [member, member + 1])
        own = objects.offset[low:high]
        for found, at in ((first, begin[mine]), (last, end[mine] - 1)):
            k = np.searchsorted(own, at, side="right") - 1
            found[mine] = np.where(k >= 0, k + low, -1)
    counts = np.maximum(last - first + 1, 1)
    piece = np.repeat(np.arange(len(begin)), counts)
    obj = np.maximum(first[piece] + _rank_in_group(counts), 0)
    lo = np.maximum(begin[piece], objects.offset[obj])
    hi = np.minimum(end[piece], objects.offset[obj] + objects.length[obj])
    # Each piece's parts must follow on from each other and from its start to its end: a byte
    # in none of the member's objects is a chain whose manifests disagree.
    expected = np.concatenate(([0], hi[:-1]))
    opens = np.concatenate(([True], piece[1:] != piece[:-1]))
    expected[opens] = begin[piece[opens]]
    closes = np.concatenate((piece[1:] != piece[:-1], [True]))
    broken = (first[piece] < 0) | (lo != expected) | (hi <= lo) | (closes & (hi != end[piece]))
    if broken.any():
        i = int(np.argmax(broken))
        # The first byte missing: where this part should have begun, or (a piece that runs
        # past its member's last object) where the part ends.
        joined = first[piece[i]] >= 0 and lo[i] == expected[i] and hi[i] > lo[i]
        member = objects.ids[int(pieces.member[piece[i]])]
        raise _not_in_objects(int(hi[i] if joined else expected[i]), member)
    return obj, lo - objects.offset[obj], hi - lo, pieces.target[piece] + (lo - begin[piece])


def _not_in_objects(at: int, backup_id: str) -> ParentUnavailable:
    return ParentUnavailable(
        f"byte {at} of backup {backup_id}'s changes is in none of its objects: the chain's "
        "manifests disagree.",
        fix=_CHAIN_DISAGREES,
    )


def object_placements(pieces: Pieces, objects: Objects) -> dict[str, Array]:
    """Per object key, the placements of its bytes (see the module docstring) as flat
    int64 numbers, four per placement, in the order of ``pieces``; an object no piece reads
    is absent."""
    obj, inside, length, target = in_objects(pieces, objects)
    # Each part once per frame it touches.
    size = objects.frame_size[obj]
    first, last = inside // size, (inside + length - 1) // size
    counts = last - first + 1
    part = np.repeat(np.arange(len(obj)), counts)
    frame = first[part] + _rank_in_group(counts)
    lo = np.maximum(inside[part], frame * size[part])
    hi = np.minimum(inside[part] + length[part], (frame + 1) * size[part])
    rows = np.stack((frame, lo - frame * size[part], hi - lo, target[part] + lo - inside[part]), 1)
    return _by_object(obj[part], rows, objects.keys)


def _by_object(obj: Array, rows: Array, keys: list[str]) -> dict[str, Array]:
    """``rows`` grouped by ``obj`` (the order kept within each), flattened, per key."""
    if not len(obj):
        return {}
    order = np.argsort(obj, kind="stable")
    obj, rows = obj[order], rows[order]
    bounds = np.flatnonzero(np.concatenate(([True], obj[1:] != obj[:-1], [True])))
    return {
        keys[int(obj[a])]: np.ascontiguousarray(rows[a:b]).reshape(-1)
        for a, b in itertools.pairwise(bounds.tolist())
    }


def bytes_in_objects(pieces: Pieces, objects: Objects) -> dict[str, int]:
    """Per object of the members of ``pieces``, how many of their bytes it holds."""
    obj, _, length, _ = in_objects(pieces, objects)
    held = np.zeros(len(objects.keys), dtype=I64)
    np.add.at(held, obj, length)
    members = set(pieces.member.tolist())
    return {
        key: int(held[i])
        for i, (key, member) in enumerate(zip(objects.keys, objects.member.tolist(), strict=True))
        if member in members
    }


# --- the chain as a node receives it ---------------------------------------------------------
class Placed(NamedTuple):
    """A chain placed by the node that restores it: per object key, its placements (flat
    int64 numbers, ``object_placements``) written as its frames arrive, its patches (the same,
    layered only: laid into the root's frames), and how many bytes of the restored stream it
    supplies (its progress; layered, the root writes more than it supplies). An object with
    nothing to write has no placements and no patches."""

    placements: dict[str, Array]
    supplied: dict[str, int]
    patches: dict[str, Array] = {}


def place_chain(members: list[dict[str, Any]], layered: bool = False) -> Placed:
    """A chain (``shardvault.data.chains.chain_args``) placed in the newest member's stream;
    ``layered``: see the module docstring."""
    chain = [received_member(m) for m in members]
    objects = Objects.of(members)
    resolution = resolve_chain(chain, layered)
    pieces = resolution.pieces
    if not layered:
        placements = object_placements(pieces, objects)
        return Placed(placements, placed_bytes(placements))
    # The newer members' intervals the root writes too (patches) and the rest, each merged.
    intervals, root_covers = resolution.intervals, resolution.root_covers
    owner = intervals.member
    covered = merged(intervals.take((owner > 0) & root_covers))
    uncovered = merged(intervals.take((owner > 0) & ~root_covers))
    covered, uncovered = (by_target(p) for p in (covered, uncovered))
    placements = object_placements(concat(pieces.take(pieces.member == 0), uncovered), objects)
    patches = object_placements(covered, objects)
    supplied = placed_bytes(placements)
    for key, n in placed_bytes(patches).items():
        supplied[key] = supplied.get(key, 0) + n
    # The root supplies only what no newer member overwrites (each of its objects named).
    kept = bytes_in_objects(intervals.take(owner == 0), objects)
    supplied |= {o["key"]: kept.get(o["key"], 0) for o in members[0]["objects"]}
    return Placed(placements, supplied, patches)


def placed_bytes(placements: dict[str, Array]) -> dict[str, int]:
    """Per object key, the bytes its placements write (every fourth number, the third)."""
    return {key: int(numbers[2::4].sum()) for key, numbers in placements.items()}


def by_target(pieces: Pieces) -> Pieces:
    return pieces.take(np.argsort(pieces.target, kind="stable"))


def received_member(member: dict[str, Any]) -> Member:
    """A member as ``chain_args`` sends it: files packed, extents packed (None: the root's
    whole stream; "": nothing changed in this shard)."""
    pairs = unpack_file_pairs(member["files"])
    paths = [path for path, _ in pairs]
    sizes = np.array([size for _, size in pairs], dtype=I64)
    packed = member["extents"]
    if packed is None:
        return Member(member["backup_id"], paths, sizes)
    offsets, lengths = extent_columns(packed) if packed else (np.zeros(0, I64),) * 2
    return Member(member["backup_id"], paths, sizes, offsets, lengths)


def extent_columns(packed: str) -> tuple[Array, Array]:
    """Packed extents (``shardvault.contracts.extents.pack_extents``: per extent the gap since the
    last one's end and its length, as LEB128 varints) as offsets and lengths, decoded at once."""
    raw = np.frombuffer(varint_bytes(packed), dtype=np.uint8)
    if not raw.size:
        return np.zeros(0, I64), np.zeros(0, I64)
    if raw[-1] & 0x80:
        raise ValueError("extents end inside a number")
    ends = np.flatnonzero(raw < 0x80)  # each number's last byte
    counts = np.diff(ends, prepend=-1)
    if counts.max() > 9:  # more than 63 bits
        raise ValueError("extents hold a number too large for a stream offset")
    shifts = (7 * _rank_in_group(counts)).astype(np.uint64)
    digits = (raw & 0x7F).astype(np.uint64) << shifts
    numbers = np.add.reduceat(digits, ends - counts + 1).astype(I64)
    if len(numbers) % 2:
        raise ValueError("extents hold an odd count of numbers")
    gaps, lengths = numbers[0::2], numbers[1::2]
    offsets = np.cumsum(gaps, dtype=I64) + np.cumsum(lengths, dtype=I64) - lengths
    return offsets, lengths
