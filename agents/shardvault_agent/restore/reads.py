"""How one stored object is read into a staged shard: its ranged GETs (``planned_reads``),
each fetched, checked and written where its bytes go (``fetch_range``).

*Read*: one ranged GET of whole frames, about a part's worth (``RangeRead``). A format 1
object (no frames) is read a part at a time, each checked against the part's CRC64NVME.
"""

from __future__ import annotations

import os
from collections.abc import Container
from dataclasses import dataclass

from shardvault.contracts.models import DownloadItem
from shardvault.data.pipeline import (
    FrameCodec,
    FrameSink,
    FrameSpan,
    Sealer,
    fetch_ranges,
    frame_spans,
    unpack_frames,
)
from shardvault.data.planning import part_ranges
from shardvault.errors import ChecksumMismatch
from shardvault_agent.restore.files import Pieces, ShardFiles, Write, dense_runs
from shardvault_agent.restore.overlay import Overlay
from shardvault_agent.transfer import Downloader, SpoolReader


def _nth(values: list[str], index: int) -> str | None:
    return values[index] if index < len(values) else None


@dataclass(frozen=True)
class RangeRead:
    """One ranged GET of a stored object: ``size`` stored bytes from ``offset``, holding the
    stream's bytes ``[plain_offset, plain_offset + plain_size)`` of the object. ``spans``: its
    frames (format 2); None when the object stores the stream's bytes as they are (format 1),
    where ``expected`` is the part's recorded CRC64NVME."""

    number: int
    offset: int
    size: int
    plain_offset: int
    plain_size: int
    spans: list[FrameSpan] | None = None
    expected: str | None = None


def planned_reads(item: DownloadItem, frames: Container[int] | None = None) -> list[RangeRead]:
    """The ranged GETs of an object: whole frames, about a part's worth each; with
    ``frames`` (a chain member's object), only those."""
    if not item.frames:
        return [
            RangeRead(r.part_number, r.offset, r.size, r.offset, r.size, None,
                      _nth(item.part_crc64nvme, r.part_number - 1))
            for r in (part_ranges(item.length, item.part_size) if item.length else [])
        ]  # fmt: skip
    spans = frame_spans(unpack_frames(item.frames), item.frame_size, item.length)
    if frames is not None:  # a chain member's object: only the frames it contributes
        spans = [s for s in spans if s.index in frames]
    groups = [g for run in consecutive(spans) for g in fetch_ranges(run, item.part_size)]
    reads = []
    for number, group in enumerate(groups, start=1):
        first, last = group[0], group[-1]
        reads.append(
            RangeRead(
                number,
                first.stored_offset,
                last.stored_offset + last.stored_size - first.stored_offset,
                first.plain_offset,
                last.plain_offset + last.plain_size - first.plain_offset,
                group,
            )
        )
    return reads


def written_ranges(
    item: DownloadItem, read: RangeRead, files: ShardFiles, pieces: Pieces | None
) -> list[Write]:
    """The file ranges a read wrote whose writeback starts now: all of a contiguous read; of a
    chain member's pieces, runs merged where they lie within ``FLUSH_GAP`` of each other in
    a file, where they fill at least ``FLUSH_DENSITY`` of the merged run."""
    if pieces is None or read.spans is None:
        return files.writes(item.stream_offset + read.plain_offset, read.plain_size)
    return dense_runs(
        (fd, at, n) for span in read.spans for _, n, fd, at, _ in pieces.get(span.index, ())
    )


def consecutive(spans: list[FrameSpan]) -> list[list[FrameSpan]]:
    """Runs of frames that follow each other in the object (one ranged read can hold them)."""
    runs: list[list[FrameSpan]] = []
    for span in spans:
        if runs and runs[-1][-1].index + 1 == span.index:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def fetch_range(
    downloader: Downloader | SpoolReader,
    url: str,
    item: DownloadItem,
    read: RangeRead,
    files: ShardFiles,
    sealer: Sealer | None = None,
    pieces: Pieces | None = None,
    spool: int | None = None,
    overlay: Overlay | None = None,
) -> str:
    """Fetches one read into the staged files; returns the stored bytes' CRC64NVME. Frames are
    decoded and each checked against its plaintext checksum before it is written; a chain
    member's frames write only their ``pieces`` (``ShardFiles.resolve``), a layered root's
    with the newer members' patches laid in (``overlay``). ``spool``: the stored bytes are
    kept there too, at their offsets in the object (a newer member's frames that patch the
    root's, opened when those are written)."""
    if read.spans is None:
        base = item.stream_offset + read.plain_offset
        crc = downloader.fetch(
            url, item.key, read.offset, read.size, lambda at, data: files.write(base + at, data)
        )
        if read.expected and crc != read.expected:
            raise ChecksumMismatch(
                f"part {read.number} of {item.key} arrived with CRC64NVME {crc}; the backup "
                f"recorded {read.expected}.",
                fix="the object is damaged in the store: restore another backup.",
            )
        return crc

    def place(offset: int, plain: bytes) -> None:
        if pieces is None:
            files.write(item.stream_offset + offset, plain)
            return
        view, pwrite = memoryview(plain), os.pwrite
        for inside, length, fd, at, target in pieces[offset // item.frame_size]:
            if overlay is None:
                pwrite(fd, view[inside : inside + length], at)
            else:
                overlay.write(fd, view[inside : inside + length], at, target)

    wanted = None if pieces is None else pieces.keys()  # frames only spooled stay unopened
    sink = FrameSink(read.spans, FrameCodec(sealer=sealer), item.place, place, item.key, wanted)

    def receive(position: int, chunk: bytes) -> None:
        if spool is not None:
            os.pwrite(spool, chunk, read.offset + position)
        sink.receive(position, chunk)

    crc = downloader.fetch(url, item.key, read.offset, read.size, receive)
    if not sink.complete:  # the store sent the bytes asked for, but not whole frames
        raise ChecksumMismatch(
            f"bytes {read.offset}-{read.offset + read.size - 1} of {item.key} do not hold the "
            "frames the manifest records.",
            fix="the object is damaged or replaced in the store: restore another backup.",
        )
    return crc
