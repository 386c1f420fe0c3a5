"""The overlay of a layered chain restore: newer blocks laid into the root's frames before
each frame is written, so that every byte of a restored shard is written once.

Terms (see ``chain_placement`` for chains, members, pieces and placements):
- *patch*: a newer member's piece that falls where the chain's root (its full) also writes.
  It is not written on its own: when the root's frame that holds its place is written, the
  patch's bytes go in its stead (one ``pwritev`` of the root's bytes and the patches between
  them). Writing the changed blocks over the root's instead (tens of thousands of 8 KiB
  ``pwrite`` calls, each page dirtied twice and flushed twice) made a chain of six
  incrementals restore in 1.65 times a full's time.
- *spool*: a newer member's object as far as it was fetched for its patches: its stored
  (compressed, sealed) frames at their offsets in a sparse file in the restore's state
  directory, beside the download item that says how to open them (``objects.ObjectRecord``).
  The newer members download first (the restore's first wave), the root's objects second; a
  root object refuses to start before its shard's spools are complete (``download``).
- *patch index*: a shard's patches sorted by their place in the restored stream, as five
  columns of 64-bit numbers (place, length, object, frame, offset in the frame) in one file,
  read through ``mmap``: a chain of scattered changes makes hundreds of thousands.

Every patch's frame is opened and checked (GCM, its plaintext CRC64NVME) when a root frame
first needs it: a spooled frame is checked before any of its bytes is written, as a fetched
one is. Decoded frames are kept in a small cache, since the root's frames arrive in stream
order and a member's frame holds the patches of many of them.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from shardvault.contracts.models import DownloadItem
from shardvault.data.pipeline import (
    FrameCodec,
    FrameSpan,
    Sealer,
    frame_place,
    frame_spans,
    unpack_frames,
)
from shardvault_agent.restore.objects import ObjectRecord

COLUMNS = 5  # place in the stream, length, object, frame, offset in the frame
CACHE_BYTES = 64 << 20  # decoded newer frames kept (a frame is 1 to 4 MiB)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def save_index(path: Path, keys: list[str], patches: Mapping[str, Sequence[int]]) -> None:
    """Writes a shard's patch index from its objects' patches (flat ``frame, offset in
    frame, length, place`` numbers, ``chain_placement.Placed.patches``); ``keys`` orders the
    objects. Patches never overlap, so their places alone order them."""
    flat = [np.asarray(patches.get(key, ()), dtype=np.int64).reshape(-1, 4) for key in keys]
    rows = np.concatenate([np.zeros((0, 4), dtype=np.int64), *flat])
    objects = np.repeat(np.arange(len(keys), dtype=np.int64), [len(f) for f in flat])
    order = np.argsort(rows[:, 3], kind="stable")
    columns = (rows[order, 3], rows[order, 2], objects[order], rows[order, 0], rows[order, 1])
    path.with_suffix(".keys").write_text(json.dumps(keys))
    path.write_bytes(np.concatenate(columns).tobytes())


def write_vectored(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Writes ``buffers`` back to back at ``offset`` of ``fd``, in calls of at most IOV_MAX
    buffers, until every byte is written."""
    while buffers:
        batch, buffers = buffers[:IOV_MAX], buffers[IOV_MAX:]
        size = sum(len(b) for b in batch)
        done = os.pwritev(fd, batch, offset)
        if done < size:  # a short write (a signal, a nearly full disk): the rest one by one
            rest = memoryview(b"".join(batch))[done:]
            while rest:
                n = os.pwrite(fd, rest, offset + done)
                rest, done = rest[n:], done + n
        offset += size


class _Spooled:
    """A newer member's object as spooled: how to read and open each of its frames."""

    def __init__(
        self, record: ObjectRecord, sealer_of: Callable[[DownloadItem], Sealer | None]
    ) -> None:
        self.item = record.spooled_item()
        self.spans = frame_spans(
            unpack_frames(self.item.frames), self.item.frame_size, self.item.length
        )
        self.sealer = sealer_of(self.item)
        self.fd = os.open(record.spool, os.O_RDONLY)

    def stored(self, frame: int) -> tuple[FrameSpan, bytes]:
        span = self.spans[frame]
        return span, os.pread(self.fd, span.stored_size, span.stored_offset)


class Overlay:
    """A shard's patches, read from its patch index and its newer members' spools."""

    def __init__(
        self,
        index: Path,
        record_of: Callable[[str], ObjectRecord],
        sealer_of: Callable[[DownloadItem], Sealer | None],
    ) -> None:
        self.keys: list[str] = json.loads(index.with_suffix(".keys").read_text())
        self._file = open(index, "rb")  # noqa: SIM115 (closed by close())
        size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._numbers = memoryview(self._map if self._map else array("q")).cast("B").cast("q")
        n = len(self._numbers) // COLUMNS
        self._columns = [self._numbers[c * n : (c + 1) * n] for c in range(COLUMNS)]
        self.places, self.lengths, self.objects, self.frames, self.insides = self._columns
        self._record_of, self._sealer_of = record_of, sealer_of
        self._spooled: dict[int, _Spooled] = {}
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._cached = 0
        self._guard = threading.Lock()
        self._codecs = threading.local()  # a zstd context is not thread-safe

    def write(self, fd: int, data: memoryview, at: int, place: int) -> None:
        """Writes a root piece, ``data`` for ``place`` of the restored stream (at ``at`` of
        ``fd``), with the patches that fall on it laid in."""
        end = place + len(data)
        places, lengths = self.places, self.lengths
        i = bisect.bisect_right(places, place) - 1
        if i < 0 or places[i] + lengths[i] <= place:
            i += 1
        if i >= len(places) or places[i] >= end:
            os.pwrite(fd, data, at)
            return
        buffers: list[memoryview] = []
        cursor = place
        while i < len(places) and places[i] < end:
            start = places[i]
            lo, hi = max(start, place), min(start + lengths[i], end)
            if lo > cursor:
                buffers.append(data[cursor - place : lo - place])
            plain = self._plain(self.objects[i], self.frames[i])
            inside = self.insides[i] + lo - start
            buffers.append(memoryview(plain)[inside : inside + hi - lo])
            cursor = hi
            i += 1
        if cursor < end:
            buffers.append(data[cursor - place :])
        write_vectored(fd, buffers, at)

    def _plain(self, obj: int, frame: int) -> bytes:
        """A newer member's frame, opened and checked; kept while the cache has room."""
        with self._guard:
            plain = self._cache.get((obj, frame))
            if plain is not None:
                self._cache.move_to_end((obj, frame))
                return plain
            spooled = self._spooled.get(obj)
            if spooled is None:
                record = self._record_of(self.keys[obj])
                spooled = self._spooled[obj] = _Spooled(record, self._sealer_of)
        span, stored = spooled.stored(frame)
        # One codec a thread per data key (a chain has one, or none): not one per object.
        codecs = self._codecs.__dict__.setdefault("by_key", {})
        check = spooled.sealer.check if spooled.sealer else None
        codec = codecs.get(check)
        if codec is None:
            codec = codecs[check] = FrameCodec(sealer=spooled.sealer)
        item = spooled.item
        plain = codec.decode(stored, span, frame_place(item.place, frame), where=item.key)
        with self._guard:
            if (obj, frame) not in self._cache:
                self._cache[(obj, frame)] = plain
                self._cached += len(plain)
            while self._cached > CACHE_BYTES and len(self._cache) > 1:
                _, dropped = self._cache.popitem(last=False)
                self._cached -= len(dropped)
        return plain

    def close(self) -> None:
        with self._guard:
            for spooled in self._spooled.values():
                os.close(spooled.fd)
            self._spooled.clear()
            self._cache.clear()
            for column in self._columns:  # the map cannot close while views of it live
                column.release()
            self._numbers.release()
            if self._map is not None:
                self._map.close()
            self._file.close()
