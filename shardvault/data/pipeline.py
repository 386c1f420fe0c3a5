"""The part pipeline: how a stream's bytes become stored bytes, and back, in one place.

Backup:  read -> cut into frames -> compress -> seal -> checksum parts -> (upload)
Restore: (download by range) -> checksum -> open -> decompress -> verify -> write

Terms:
- *frame*: the unit of compression, encryption and end-to-end checking: ``frame_size`` bytes
  of plaintext (``shardvault.data.planning.frame_size_for``; an object's last frame may be
  shorter), encoded on its own, so a restore decodes any frame it fetched by byte range
  without the frames before it.
- *level*: the zstd level a frame is compressed at: the policy's, or with ``auto`` the one
  ``shardvault.data.levels`` chooses for each stretch of frames. A reader needs no level.
- *encoded frame*: one codec byte (``RAW`` or ``ZSTD``) and the body. A frame that zstd does
  not shrink by at least ``RAW_THRESHOLD`` is stored raw: incompressible data (already
  compressed columns, encrypted tablespaces) costs a fast zstd pass and no inflation.
- *sealed frame*: with encryption, the encoded frame as AES-256-GCM ciphertext (12-byte
  nonce, ciphertext, 16-byte tag). Its associated data names the frame's place (``place``:
  cluster, backup, shard, phase, object and frame index), so a frame moved or swapped in the
  store fails to open.
- *frame table*: per object, each frame's stored size and its plaintext CRC64NVME, packed
  (``pack_frames``); the manifest keeps it, and a restore checks every frame's plaintext
  against it (end-to-end: what is written equals what was read).
- *stored object*: its frames back to back. The part size (the one size knob) cuts the stored
  object into parts exactly as before; frames know nothing of parts, parts nothing of frames.
- *spare cores*: a pack encodes its frames one after another on its own thread, and an agent
  runs several packs at once, which keeps every core busy while there are enough of them.
  When fewer packs run than the machine has cores (at the end of a full, its last object,
  often the slowest to compress: a table's indexes), a pack hands frames to ``SpareCores``'
  helper threads while it reads and encodes the next one itself, so a lone pack is not held
  to one core. A core is idle only if other processes leave it so too (``others``: the agent
  measures the cores the database and everything else kept busy, ``hostcpu``). Frames are
  still written in order, and the stored bytes are the same.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Container, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import BinaryIO, NamedTuple

import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shardvault.contracts.models import Compression, PartChecksum
from shardvault.data.checksums import combine, crc64nvme, to_b64
from shardvault.data.frames import FrameInfo, pack_frames, unpack_frames
from shardvault.data.levels import FAST, LevelChooser
from shardvault.data.planning import frame_size_for
from shardvault.errors import ChecksumMismatch, FrameUnreadable, WrongKey

RAW, ZSTD = 0, 1
RAW_THRESHOLD = 0.97  # a frame must shrink by 3 % to be stored compressed
NONCE_SIZE, TAG_SIZE, KEY_SIZE = 12, 16, 32
# Frames on an agent's helper threads at once, at most (``SpareCores``): each holds up to
# 4 MiB of plaintext and its encoding, so a host of many cores does not hold hundreds of MiB.
MOST_HANDED = 3


@dataclass(frozen=True)
class FrameSpan:
    """Where one frame is: its bytes in the stored object and its plaintext in the object's
    range of the stream."""

    index: int
    stored_offset: int
    stored_size: int
    plain_offset: int
    plain_size: int
    crc64nvme: int


def frame_spans(frames: list[FrameInfo], frame_size: int, length: int) -> list[FrameSpan]:
    """The spans of an object of ``length`` plaintext bytes cut into ``frame_size`` frames."""
    spans, stored = [], 0
    for i, frame in enumerate(frames):
        plain_offset = i * frame_size
        plain = min(frame_size, length - plain_offset)
        spans.append(FrameSpan(i, stored, frame.stored_size, plain_offset, plain, frame.crc64nvme))
        stored += frame.stored_size
    return spans


def key_check(key: bytes) -> str:
    """A check value of a data key (HMAC of a constant): a reader tells a wrong key from a
    damaged frame before it opens any frame. It reveals nothing usable about the key."""
    return hmac.new(key, b"shardvault key check", hashlib.sha256).hexdigest()[:16]


class Sealer:
    """AES-256-GCM under one data key (a chain's)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise WrongKey(
                f"a data key must be {KEY_SIZE} bytes, not {len(key)}.",
                fix="unwrap the backup's data key with KMS; never derive one.",
            )
        self.aead, self.check = AESGCM(key), key_check(key)

    def seal(self, data: bytes, place: bytes) -> bytes:
        nonce = os.urandom(NONCE_SIZE)  # random: 2^32 frames per key stay far from collisions
        return nonce + self.aead.encrypt(nonce, data, place)

    def open(self, data: bytes, place: bytes) -> bytes:
        try:
            return self.aead.decrypt(data[:NONCE_SIZE], data[NONCE_SIZE:], place)
        except InvalidTag as error:
            raise FrameUnreadable(
                f"a frame at {place.decode(errors='replace')} fails authentication: its bytes "
                "were changed, or it was moved from another place in the store.",
                fix="the object is damaged or tampered with: restore another backup, and "
                "check who can write to the bucket.",
            ) from error


def frame_place(object_place: str, index: int) -> bytes:
    """The associated data of a frame: where it belongs (see ``Sealer``)."""
    return f"shardvault/1 {object_place} frame {index}".encode()


class FrameCodec:
    """Encodes frames at the ``compression``'s level (a fixed one, or ``auto``'s choice per
    stretch of frames: ``level_for``) with an optional sealer, and decodes them. Not shared
    between threads: a zstd context is not thread-safe. ``cores``: what ``auto`` weighs
    the upload bandwidth against (default: the cores this process may run on)."""

    def __init__(
        self,
        compression: Compression | int | None = None,
        sealer: Sealer | None = None,
        cores: int | None = None,
    ) -> None:
        if compression is None or isinstance(compression, int):
            compression = Compression(level=compression if compression is not None else FAST)
        self.decompressor = zstandard.ZstdDecompressor()
        self.sealer = sealer
        self._compressors: dict[int, zstandard.ZstdCompressor] = {}
        fixed = compression.level if isinstance(compression.level, int) else None
        self.level = FAST if fixed is None else fixed  # of the latest frame
        self.chooser: LevelChooser | None = None
        if fixed is None:
            cores = cores or len(os.sched_getaffinity(0))
            self.chooser = LevelChooser(compression.upload_mib_s, cores, self.compress)

    def compress(self, level: int, plain: bytes) -> bytes:
        """``plain`` as one zstd frame. A level's context is made on first use: a restore's
        codecs only decode, and a compression context at level 3 holds about a MiB."""
        compressor = self._compressors.get(level)
        if compressor is None:
            compressor = self._compressors[level] = zstandard.ZstdCompressor(level=level)
        return compressor.compress(plain)

    def level_for(self, index: int, plain: bytes) -> int:
        """The level of an object's frame ``index``, asked in frame order."""
        if self.chooser is not None:
            self.level = self.chooser.level_for(index, plain)
        return self.level

    def encode(self, plain: bytes, place: bytes, level: int | None = None) -> bytes:
        """``plain`` encoded at ``level`` (None: the fixed level, or ``auto``'s latest)."""
        level = self.level if level is None else level
        body = self.chooser.take_output(level, plain) if self.chooser else None  # the probe's
        if body is None:
            body = self.compress(level, plain) if plain else b""
        if len(body) <= len(plain) * RAW_THRESHOLD:
            encoded = bytes([ZSTD]) + body
        else:
            encoded = bytes([RAW]) + plain
        return self.sealer.seal(encoded, place) if self.sealer else encoded

    def decode(self, stored: bytes, span: FrameSpan, place: bytes, where: str = "") -> bytes:
        """The frame's plaintext, checked against its recorded CRC64NVME; ``where`` names the
        object in errors (its key)."""
        frame = f"frame {span.index}" + (f" of {where}" if where else "")
        encoded = self.sealer.open(stored, place) if self.sealer else stored
        codec, body = encoded[:1], encoded[1:]
        try:
            if codec == bytes([ZSTD]):
                plain = self.decompressor.decompress(body, max_output_size=span.plain_size)
            elif codec == bytes([RAW]):
                plain = body
            else:
                raise FrameUnreadable(
                    f"{frame} has an unknown codec {codec!r}.",
                    fix="restore it with a newer ShardVault, or restore another backup.",
                )
        except zstandard.ZstdError as error:
            raise FrameUnreadable(
                f"{frame} does not decompress: {error}.",
                fix="the object is damaged in the store: restore another backup.",
            ) from error
        crc = crc64nvme(plain)
        if len(plain) != span.plain_size or crc != span.crc64nvme:
            raise ChecksumMismatch(
                f"{frame} decoded to {len(plain)} bytes with CRC64NVME {to_b64(crc)}; "
                f"the backup read {span.plain_size} bytes with {to_b64(span.crc64nvme)}.",
                fix="the object is damaged in the store: restore another backup.",
            )
        return plain


@dataclass
class PackedObject:
    """What packing an object produced: the stored bytes' parts and checksum, its frames, and
    what it cost: the CPU-seconds of the pack's thread and of the helpers that encoded its
    frames (reading, hashing, compressing, sealing, checksumming), and its frames per zstd
    level."""

    parts: list[PartChecksum]
    crc64nvme: str
    stored_length: int
    frames: list[FrameInfo]
    cpu_seconds: float = 0.0
    levels: Counter[int] = field(default_factory=Counter)


class Encoded(NamedTuple):
    """A frame a helper thread encoded, and the CPU-seconds it took."""

    stored: bytes
    cpu_seconds: float


class PartCutter:
    """Checksums stored bytes as they are written, cut at part boundaries."""

    def __init__(self, part_size: int) -> None:
        self.part_size = part_size
        self.parts: list[PartChecksum] = []
        self.crc = self.filled = self.total = 0

    def add(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.part_size - self.filled)
            self.crc = crc64nvme(view[:take], self.crc)
            self.filled += take
            self.total += take
            view = view[take:]
            if self.filled == self.part_size:
                self._close_part()

    def _close_part(self) -> None:
        self.parts.append(
            PartChecksum(
                part_number=len(self.parts) + 1, size=self.filled, crc64nvme=to_b64(self.crc)
            )
        )
        self.crc = self.filled = 0

    def finish(self) -> list[PartChecksum]:
        if self.filled or not self.parts:
            self._close_part()
        return self.parts


class SpareCores:
    """The machine's cores a pack may borrow (see *spare cores*): a frame goes to a helper
    thread only while the packs, the frames already handed out and the cores other processes
    keep busy (``others()``, None: not known) leave a core idle, so packs that keep every
    core busy encode on their own threads alone (more threads than cores cost CPU in passing
    the interpreter's lock, and gain no time) and a busy database keeps its cores, and only
    while fewer than ``most`` frames are out (``MOST_HANDED``: the memory they hold)."""

    def __init__(
        self,
        cores: int | None = None,
        most: int = MOST_HANDED,
        others: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.cores = cores or len(os.sched_getaffinity(0))
        self.others = others
        self.most = max(min(most, self.cores - 1), 1)  # frames handed out at once, at most
        self._busy = 0  # packs running, and frames on helper threads
        self._handed = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.most, thread_name_prefix="encode")
        self._codecs = threading.local()  # a zstd context is not thread-safe

    @contextmanager
    def packing(self) -> Iterator[SpareCores]:
        """Counts a pack's own thread as busy while it runs."""
        with self._lock:
            self._busy += 1
        try:
            yield self
        finally:
            self._release()

    def encode(
        self, codec: FrameCodec, plain: bytes, place: bytes, level: int
    ) -> Future[Encoded] | None:
        """``plain`` encoded as ``codec`` would at ``level``, on a helper thread if a core is
        idle, with the CPU-seconds it took; None if none is (the caller encodes it itself)."""
        others = self.others() or 0.0
        with self._lock:
            if self._busy + others >= self.cores or self._handed >= self.most:
                return None
            self._busy += 1
            self._handed += 1
        try:
            return self._pool.submit(self._encode, level, codec.sealer, plain, place)
        except RuntimeError:  # the interpreter is exiting: the caller encodes it
            self._release(handed=True)
            return None

    def _encode(self, level: int, sealer: Sealer | None, plain: bytes, place: bytes) -> Encoded:
        started = time.thread_time()
        try:
            codec: FrameCodec | None = getattr(self._codecs, "codec", None)
            if codec is None or codec.sealer is not sealer:
                codec = self._codecs.codec = FrameCodec(level, sealer)  # one a thread, kept
            return Encoded(codec.encode(plain, place, level), time.thread_time() - started)
        finally:  # before the future is done: whoever waits on it sees the core idle again
            self._release(handed=True)

    def _release(self, handed: bool = False) -> None:
        with self._lock:
            self._busy -= 1
            if handed:
                self._handed -= 1


def pack(
    read: Callable[[int], bytes],
    length: int,
    frame_size: int,
    part_size: int,
    codec: FrameCodec,
    out: BinaryIO,
    object_place: str,
    spare: SpareCores | None = None,
) -> PackedObject:
    """Reads ``length`` bytes through ``read(n)``, writes the stored object to ``out`` and
    returns its parts' checksums, its own and its frame table. With ``spare``, the pack counts
    as one of the host's running packs and may encode frames on idle cores (see *spare
    cores*); the stored bytes are the same. ``codec`` chooses each frame's level."""
    started = time.thread_time()
    with spare.packing() if spare else nullcontext():  # one of the running packs
        cutter, frames = PartCutter(part_size), []
        levels: Counter[int] = Counter()
        helpers_cpu = 0.0
        handed: deque[tuple[Future[Encoded], int]] = deque()  # frames on helpers, in order

        def put(stored: bytes, crc: int) -> None:
            out.write(stored)
            cutter.add(stored)
            frames.append(FrameInfo(len(stored), crc))

        def put_handed(keep: int) -> None:
            """Writes the handed frames, in order, that are done or more than ``keep``."""
            nonlocal helpers_cpu
            while handed and (len(handed) > keep or handed[0][0].done()):
                earlier, earlier_crc = handed.popleft()
                encoded = earlier.result()
                helpers_cpu += encoded.cpu_seconds
                put(encoded.stored, earlier_crc)

        for index, offset in enumerate(range(0, length, frame_size)):
            plain = read(min(frame_size, length - offset))
            place, crc = frame_place(object_place, index), crc64nvme(plain)
            level = codec.level_for(index, plain)
            levels[level] += 1
            probed = codec.chooser is not None and codec.chooser.probed_whole(plain)
            future = spare.encode(codec, plain, place, level) if spare and not probed else None
            if future is not None:
                handed.append((future, crc))
                put_handed(keep=spare.most if spare else 0)  # a bounded number held in memory
                continue
            stored = codec.encode(plain, place, level)
            put_handed(keep=0)  # the frames before this one first
            put(stored, crc)
        put_handed(keep=0)
        parts = cutter.finish()
        whole = combine((p.crc64nvme, p.size) for p in parts)
        cpu = time.thread_time() - started + helpers_cpu
        return PackedObject(parts, whole, cutter.total, frames, cpu, levels)


def fetch_ranges(spans: list[FrameSpan], target: int) -> Iterator[list[FrameSpan]]:
    """Consecutive frames grouped into ranged reads of about ``target`` stored bytes (the part
    size): few large GETs, each ending on a frame boundary."""
    group: list[FrameSpan] = []
    size = 0
    for span in spans:
        group.append(span)
        size += span.stored_size
        if size >= target:
            yield group
            group, size = [], 0
    if group:
        yield group


class FrameSink:
    """Receives a ranged read of stored bytes chunk by chunk and hands each complete frame's
    plaintext to ``write(plain_offset, plain)``. A retried read starts again at position 0.
    ``wanted``: the indexes of the frames to open; the others are passed over unopened (a
    chain member's frames kept stored for later, ``shardvault_agent.restore.overlay``)."""

    def __init__(
        self,
        spans: list[FrameSpan],
        codec: FrameCodec,
        object_place: str,
        write: Callable[[int, bytes], None],
        where: str = "",
        wanted: Container[int] | None = None,
    ) -> None:
        self.spans, self.codec, self.object_place, self.write = spans, codec, object_place, write
        self.where = where  # the object's key, for errors
        self.wanted = wanted
        self.start = spans[0].stored_offset if spans else 0
        self._reset()

    def _reset(self) -> None:
        self.next, self.buffer = 0, bytearray()

    def receive(self, position: int, chunk: bytes) -> None:
        if position == 0:
            self._reset()
        self.buffer += chunk
        while self.next < len(self.spans):
            span = self.spans[self.next]
            if len(self.buffer) < span.stored_size:
                return
            stored = bytes(self.buffer[: span.stored_size])
            del self.buffer[: span.stored_size]
            if self.wanted is None or span.index in self.wanted:
                place = frame_place(self.object_place, span.index)
                self.write(span.plain_offset, self.codec.decode(stored, span, place, self.where))
            self.next += 1

    @property
    def complete(self) -> bool:
        return self.next == len(self.spans) and not self.buffer


def plaintext_crc(spans: list[FrameSpan]) -> str:
    """The CRC64NVME of an object's plaintext, from its frames'."""
    return combine((to_b64(s.crc64nvme), s.plain_size) for s in spans)


__all__ = [
    "FrameCodec",
    "FrameInfo",
    "FrameSink",
    "FrameSpan",
    "PackedObject",
    "Sealer",
    "SpareCores",
    "fetch_ranges",
    "frame_size_for",
    "frame_spans",
    "key_check",
    "pack",
    "pack_frames",
    "unpack_frames",
]
