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

from shardvault.errors import ParentUnavailable
from shardvault.models import FileEntry
from shardvault.streams import StreamIndex


@dataclass(frozen=True)
class Member:
    backup_id: str
    files: list[FileEntry]
    extents: list[tuple[int, int]] | None  # None: the whole stream (a full)


@dataclass(frozen=True)
class Piece:
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
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
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
    pieces: list[Piece] = []
    for member in reversed(chain):
        member_index = StreamIndex(member.files)
        extents = member.extents if member.extents is not None else [(0, member_index.length)]
        delta = 0
        for offset, length in extents:
            for seg in member_index.segments(offset, length):
                at = where.get(seg.path)
                if at is not None and seg.file_offset < at[1]:
                    start = at[0] + seg.file_offset
                    end = start + min(seg.length, at[1] - seg.file_offset)
                    base = delta + (seg.stream_offset - offset) - start
                    pieces += [
                        Piece(member.backup_id, base + a, b - a, a)
                        for a, b in unclaimed.claim(start, end)
                    ]
            delta += length
        if unclaimed.empty:
            break
    if not unclaimed.empty:
        raise ParentUnavailable(
            f"bytes {unclaimed.starts[0]}-{unclaimed.ends[0]} of the restored stream are in no "
            "backup of its chain: the chain's manifests disagree.",
            fix="restore another backup; run a full backup of the cluster.",
        )
    order = {m.backup_id: i for i, m in enumerate(chain)}
    return merge(sorted(pieces, key=lambda p: (order[p.backup_id], p.delta_offset)))


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
