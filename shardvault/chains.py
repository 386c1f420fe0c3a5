"""Chains: which backup of a chain holds each byte a restore of its newest backup writes.

Terms:
- *member*: one backup of a chain, seen through one shard's data stream: its files (its own
  listing) and its extents (``None`` for the full at the root: its objects hold the whole
  stream). A member's objects hold its *delta stream*: the bytes of its extents, in order.
- *piece*: ``length`` bytes at ``delta_offset`` of one member's delta stream, written at
  ``target`` of the newest member's stream (the one restored).

Resolution, newest member first: each member's extents, mapped per file onto the newest
listing (files the newest backup no longer has are dropped; bytes past a file's newest size
are cut), claim the bytes no newer member claimed. A block absent from a member's extents was
unchanged since its parent (its hash was equal), so the older member holds the same bytes;
the root holds every byte. Stream offsets differ between members (files grow and shrink), so
everything is matched by file path and offset in the file, never by stream offset.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

from shardvault.errors import ParentUnavailable
from shardvault.models import FileEntry
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


class Unclaimed:
    """Disjoint ranges ``[start, end)`` not yet claimed, sorted."""

    def __init__(self, length: int) -> None:
        self.starts, self.ends = ([0], [length]) if length else ([], [])

    def claim(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Removes and returns the unclaimed parts of ``[lo, hi)``."""
        starts, ends = self.starts, self.ends
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        # Fast paths for the common cases of a chain's scattered blocks: the range lies in one
        # unclaimed interval, or wholly in a claimed gap.
        if i < len(starts) and starts[i] <= lo and hi <= ends[i]:
            if starts[i] == lo and ends[i] == hi:
                del starts[i], ends[i]
            elif starts[i] == lo:
                starts[i] = hi
            elif ends[i] == hi:
                ends[i] = lo
            else:
                starts.insert(i + 1, hi)
                ends.insert(i + 1, ends[i])
                ends[i] = lo
            return [(lo, hi)]
        if (i >= len(starts) or ends[i] <= lo) and (i + 1 >= len(starts) or hi <= starts[i + 1]):
            return []
        taken, keep_starts, keep_ends = [], [], []
        j = i
        while j < len(self.starts) and self.starts[j] < hi:
            start, end = self.starts[j], self.ends[j]
            a, b = max(start, lo), min(end, hi)
            if a < b:
                taken.append((a, b))
                if start < a:
                    keep_starts.append(start)
                    keep_ends.append(a)
                if b < end:
                    keep_starts.append(b)
                    keep_ends.append(end)
            else:
                keep_starts.append(start)
                keep_ends.append(end)
            j += 1
        self.starts[i:j], self.ends[i:j] = keep_starts, keep_ends
        return taken

    @property
    def empty(self) -> bool:
        return not self.starts


def resolve(chain: list[Member]) -> list[Piece]:
    """The pieces that make the newest member's stream, root first in ``chain``; sorted by
    member (oldest first) and delta offset, adjacent ones merged."""
    newest = chain[-1]
    index = StreamIndex(newest.files)
    where = {f.path: (start, f.size) for f, start in zip(newest.files, index.starts, strict=False)}
    unclaimed = Unclaimed(index.length)
    # (member's place in the chain, delta offset, length, target): tuples sort fast, and a
    # chain of scattered changes makes tens of thousands of pieces.
    found: list[tuple[int, int, int, int]] = []
    for order in range(len(chain) - 1, -1, -1):
        member = chain[order]
        targets = _Targets(member, where)
        extents = member.extents if member.extents is not None else [(0, targets.length)]
        delta = 0
        for offset, length in extents:
            for start, end, base in targets.ranges(offset, length, delta):
                found += [(order, base + a, b - a, a) for a, b in unclaimed.claim(start, end)]
            delta += length
        if unclaimed.empty:
            break
    if not unclaimed.empty:
        raise ParentUnavailable(
            f"bytes {unclaimed.starts[0]}-{unclaimed.ends[0]} of the restored stream are in no "
            "backup of its chain: the chain's manifests disagree.",
            fix="restore another backup; run a full backup of the cluster.",
        )
    found.sort()
    ids = [member.backup_id for member in chain]
    return merge([Piece(ids[order], d, n, t) for order, d, n, t in found])


class _Targets:
    """Where a member's stream ranges land in the newest member's stream, file by file."""

    def __init__(self, member: Member, where: dict[str, tuple[int, int]]) -> None:
        self.index = StreamIndex(member.files)
        self.length = self.index.length
        # Per file of the member: its start in the newest stream and its size there (None:
        # the newest backup no longer has it).
        self.places = [where.get(f.path) for f in member.files]

    def ranges(self, offset: int, length: int, delta: int) -> list[tuple[int, int, int]]:
        """``(start, end, base)`` in the newest stream for ``length`` bytes at ``offset`` of
        the member's stream, which are at ``delta`` of its delta stream: a target ``t`` holds
        the delta stream's byte ``base + t``."""
        starts, out = self.index.starts, []
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        end = offset + length
        while i < len(self.places) and starts[i] < end:
            lo, hi = max(offset, starts[i]), min(end, starts[i + 1])
            place = self.places[i]
            file_offset = lo - starts[i]
            if hi > lo and place is not None and file_offset < place[1]:
                start = place[0] + file_offset
                stop = start + min(hi - lo, place[1] - file_offset)
                out.append((start, stop, delta + (lo - offset) - start))
            i += 1
        return out


def merge(pieces: list[Piece]) -> list[Piece]:
    merged: list[Piece] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (
            last
            and last.backup_id == piece.backup_id
            and last.delta_offset + last.length == piece.delta_offset
            and last.target + last.length == piece.target
        ):
            merged[-1] = Piece(
                last.backup_id, last.delta_offset, last.length + piece.length, last.target
            )
        else:
            merged.append(piece)
    return merged
