"""Transfer: read an object's bytes from a shard's files, checksum them, upload the parts.

The agent never holds a whole part in memory: bytes are read in 1 MiB chunks, checksummed
as they stream, and sent as the request body. Files are read twice (checksum, then upload)
and never copied. Each part's URL is bound to its checksum, so when a live file (a PostgreSQL
data directory) changed a part in between, the store rejects it: that part alone is read
again into a stable *spool* copy, returned as changed, signed again and sent from the copy.

Part retries: exponential backoff with full jitter; an expired URL ends the command with
``PresignedUrlExpired`` so the state machine signs again (only the parts still missing).
"""

from __future__ import annotations

import io
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import urllib3

from shardvault.checksums import READ_CHUNK, crc64nvme, to_b64
from shardvault.errors import PartUploadFailed, PresignedUrlExpired, SourceChanged
from shardvault.models import FileEntry, ObjectChecksums, ObjectPlan, PartChecksum, UploadedPart
from shardvault.planning import PartRange, part_ranges
from shardvault.store import CHECKSUM_HEADER
from shardvault.streams import StreamIndex
from shardvault_agent.ratelimit import RateLimiter

log = logging.getLogger("shardvault.agent.transfer")
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
CHECKSUM_ERRORS = ("BadDigest", "XAmzContentChecksumMismatch", "InvalidChecksum")


class PartRejected(Exception):
    """The store refused a part's bytes: they do not match the checksum the URL was signed
    for (a live file rewritten since it was checksummed, or bytes damaged on the way)."""


class InjectedFault(ConnectionError):
    """A failure the test harness asked for (``SHARDVAULT_AGENT_FAULTS``)."""


@dataclass
class Faults:
    """Test-only fault injection: fail the first ``part_failures`` tries of every part; wait
    ``first_try_delay`` seconds before the first try of every part (URLs expire); report a
    stale checksum for part 1 of every object (as if the file changed after checksumming)."""

    part_failures: int = 0
    first_try_delay: float = 0.0
    stale_checksum: bool = False
    _seen: dict[tuple[str, int], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_env(cls) -> Faults:
        spec = dict(
            item.split("=", 1)
            for item in os.environ.get("SHARDVAULT_AGENT_FAULTS", "").split(",")
            if "=" in item
        )
        return cls(
            part_failures=int(spec.get("upload_part", 0)),
            first_try_delay=float(spec.get("first_try_delay", 0)),
            stale_checksum=spec.get("stale_checksum") == "1",
        )

    def after_checksum(self, sums: ObjectChecksums) -> ObjectChecksums:
        if not self.stale_checksum:
            return sums
        first = sums.parts[0].model_copy(update={"crc64nvme": to_b64(12345)})
        return sums.model_copy(update={"parts": [first, *sums.parts[1:]]})

    def before_part(self, key: str, part_number: int) -> None:
        with self._lock:
            seen = self._seen.get((key, part_number), 0)
            self._seen[(key, part_number)] = seen + 1
        if seen == 0 and self.first_try_delay:
            time.sleep(self.first_try_delay)
        if seen < self.part_failures:
            raise InjectedFault(f"injected failure {seen + 1} of part {part_number} of {key}")


class StreamReader(io.RawIOBase):
    """Reads ``length`` bytes of a stream from ``offset`` as one file-like object. A file
    that shrank or vanished since the listing reads as zeros: the engine's log repairs it."""

    def __init__(
        self, root: Path, files: list[FileEntry], offset: int, length: int, limiter: RateLimiter
    ) -> None:
        self.root, self.limiter, self.remaining = root, limiter, length
        self.segments = StreamIndex(files).segments(offset, length)
        self.current: tuple[BinaryIO | None, int] | None = None

    def readable(self) -> bool:
        return True

    def _next_segment(self) -> bool:
        self._close_current()
        seg = next(self.segments, None)
        if seg is None:
            return False
        try:
            handle: BinaryIO | None = open(self.root / seg.path, "rb")  # noqa: SIM115
            handle.seek(seg.file_offset)
        except (FileNotFoundError, IsADirectoryError):
            handle = None
        self.current = (handle, seg.length)
        return True

    def _close_current(self) -> None:
        if self.current and self.current[0]:
            self.current[0].close()
        self.current = None

    def read(self, size: int = -1) -> bytes:
        while self.remaining > 0:
            if (not self.current or self.current[1] == 0) and not self._next_segment():
                break
            handle, left = self.current
            want = min(left, READ_CHUNK if size < 0 else size, self.remaining)
            data = handle.read(want) if handle else b""
            data += b"\0" * (want - len(data))  # shrunk or vanished file
            self.current = (handle, left - want)
            self.remaining -= want
            self.limiter.take(want)
            return data
        self._close_current()
        return b""

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def chunks(reader: BinaryIO, size: int) -> Iterator[bytes]:
    left = size
    while left > 0:
        data = reader.read(min(READ_CHUNK, left))
        if not data:
            raise SourceChanged(f"stream ended {left} bytes early.", fix="retry the backup.")
        left -= len(data)
        yield data


def checksum_object(
    item: ObjectPlan, root: Path, files: list[FileEntry], limiter: RateLimiter
) -> ObjectChecksums:
    """One pass over the object: per-part and full-object CRC64NVME."""
    reader = StreamReader(root, files, item.stream_offset, item.length, limiter)
    parts, whole = [], 0
    for part in part_ranges(item.length, item.part_size):
        crc = 0
        for data in chunks(reader, part.size):
            crc, whole = crc64nvme(data, crc), crc64nvme(data, whole)
        parts.append(
            PartChecksum(part_number=part.part_number, size=part.size, crc64nvme=to_b64(crc))
        )
    return ObjectChecksums(key=item.key, parts=parts, crc64nvme=to_b64(whole))


@dataclass
class PartSender:
    """Uploads parts through presigned URLs with per-part retries."""

    http: urllib3.PoolManager
    attempts: int
    faults: Faults
    sleep: Callable[[float], None] = time.sleep
    base_delay: float = 0.2
    max_delay: float = 10.0

    def send(
        self, key: str, part: PartChecksum, url: str, body: Callable[[], BinaryIO]
    ) -> UploadedPart:
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                self.sleep(random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt)))
            try:
                self.faults.before_part(key, part.part_number)
                with body() as stream:
                    response = self.http.request(
                        "PUT",
                        url,
                        body=stream,
                        headers={"Content-Length": str(part.size), CHECKSUM_HEADER: part.crc64nvme},
                        retries=False,
                        timeout=urllib3.Timeout(connect=10, read=300),
                    )
            except (urllib3.exceptions.HTTPError, OSError) as error:
                last = f"{type(error).__name__}: {error}"
                log.info(
                    "part %d of %s, try %d failed: %s", part.part_number, key, attempt + 1, last
                )
                continue
            text = response.data.decode(errors="replace")
            if response.status == 200:
                return UploadedPart(
                    part_number=part.part_number,
                    etag=response.headers["ETag"],
                    crc64nvme=part.crc64nvme,
                )
            if response.status == 403 and "expired" in text.lower():
                raise PresignedUrlExpired(
                    f"the URL of part {part.part_number} of {key} expired.",
                    fix="sign again (the state machine does this).",
                )
            last = f"HTTP {response.status}: {text[:300]}"
            log.info("part %d of %s, try %d failed: %s", part.part_number, key, attempt + 1, last)
            if response.status == 400 and any(e in text for e in CHECKSUM_ERRORS):
                raise PartRejected(last)
            if response.status not in RETRYABLE_STATUS:
                break
        raise PartUploadFailed(
            f"part {part.part_number} of {key} failed after {self.attempts} tries: {last}",
            fix="check the network path from this node to the store; the backup retries it.",
        )


@dataclass
class UploadOutcome:
    uploaded: list[UploadedPart]  # every part the store holds, old and new
    changed: list[PartChecksum]  # parts whose bytes changed: to sign again with these


def upload_object(
    item: ObjectPlan,
    sums: ObjectChecksums,
    urls: dict[int, str],
    open_part: Callable[[PartChecksum, PartRange], BinaryIO],
    respool: Callable[[PartRange], PartChecksum],
    sender: PartSender,
    parallelism: int,
    done: dict[int, UploadedPart],
    on_part: Callable[[UploadedPart], None],
) -> UploadOutcome:
    """Sends every part that has a URL and is not already ``done``. ``open_part`` opens a
    part's bytes. A part the store rejects for its checksum is read again into a stable copy
    by ``respool``: if its checksum is unchanged the bytes were damaged on the way and are sent
    again; otherwise the part is returned as changed, to be signed again."""
    ranges = {p.part_number: p for p in part_ranges(item.length, item.part_size)}
    todo = [p for p in sums.parts if p.part_number in urls and p.part_number not in done]

    def send(part: PartChecksum) -> UploadedPart:
        r = ranges[part.part_number]
        url = urls[part.part_number]
        return sender.send(item.key, part, url, lambda: open_part(part, r))

    def one(part: PartChecksum) -> UploadedPart | PartChecksum:
        try:
            uploaded = send(part)
        except PartRejected:
            fresh = respool(ranges[part.part_number])
            if fresh.crc64nvme != part.crc64nvme:
                log.info("part %d of %s changed since checksummed", part.part_number, item.key)
                return fresh
            uploaded = send(part)  # same bytes: damaged on the way; the spool is sent now
        on_part(uploaded)
        return uploaded

    changed: list[PartChecksum] = []
    with ThreadPoolExecutor(max_workers=parallelism) as pool:
        for result in pool.map(one, todo):
            if isinstance(result, UploadedPart):
                done[result.part_number] = result
            else:
                changed.append(result)
    return UploadOutcome([done[n] for n in sorted(done)], changed)
