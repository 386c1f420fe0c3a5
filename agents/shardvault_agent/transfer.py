"""Transfer: the agent's end of the part pipeline (``shardvault.data.pipeline``).

Backup: ``pack`` reads an object's range of a shard's stream once, frames, compresses (and
seals) it into a *packed* copy in the backup's spool, checksumming the stored bytes per part;
the URLs signed next are bound to those checksums, and ``upload_object`` sends the parts from
the packed copy. The copy is stable, so a live file (a PostgreSQL data directory) that changes
after it was read cannot make a part differ from its checksum: the object stores exactly the
bytes read (PostgreSQL's WAL replay repairs pages changed during the backup, as for any base
backup).

Restore: ``Downloader`` reads byte ranges of a stored object through one presigned URL.

Both directions retry through the one policy of ``shardvault_agent.retry``.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import urllib3

from shardvault.aws.store import CHECKSUM_HEADER
from shardvault.contracts.models import FileEntry, ObjectPlan, PartChecksum, UploadedPart
from shardvault.data.checksums import READ_CHUNK, crc64nvme, to_b64
from shardvault.data.pipeline import FrameCodec, PackedObject, SpareCores, pack
from shardvault.data.streams import StreamIndex
from shardvault.errors import (
    DownloadIncomplete,
    PartDownloadFailed,
    PartUploadFailed,
    PresignedUrlExpired,
    RestoreWriteFailed,
    ShardVaultError,
    SourceChanged,
    StoreObjectDamaged,
    TargetTooSmall,
)
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.retry import RETRYABLE_STATUS, TryAgain, retrying

log = logging.getLogger("shardvault.agent.transfer")
CHECKSUM_ERRORS = ("BadDigest", "XAmzContentChecksumMismatch", "InvalidChecksum")
TIMEOUT = urllib3.Timeout(connect=10, read=300)


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


def read_exactly(reader: StreamReader, size: int) -> bytes:
    """``size`` bytes of the stream (a reader returns at most one file's bytes per read)."""
    pieces, left = [], size
    while left > 0:
        data = reader.read(left)
        if not data:
            raise SourceChanged(f"stream ended {left} bytes early.", fix="retry the backup.")
        pieces.append(data)
        left -= len(data)
    return b"".join(pieces)


def pack_object(
    item: ObjectPlan,
    read: Callable[[int], bytes],
    codec: FrameCodec,
    out: BinaryIO,
    spare: SpareCores | None = None,
) -> PackedObject:
    """Reads the object's bytes through ``read(n)`` (exactly ``n`` bytes) once and writes its
    stored bytes to ``out``, borrowing ``spare`` cores while any are idle."""
    return pack(read, item.length, item.frame_size, item.part_size, codec, out, item.place, spare)


def stream_source(
    root: Path, files: list[FileEntry], offset: int, length: int, limiter: RateLimiter
) -> Callable[[int], bytes]:
    """A reader of ``length`` bytes of a stream from ``offset``, exactly as asked."""
    reader = StreamReader(root, files, offset, length, limiter)
    return lambda n: read_exactly(reader, n)


def read_range(
    root: Path, files: list[FileEntry], offset: int, length: int, limiter: RateLimiter
) -> bytes:
    """``length`` bytes of a stream from ``offset`` (zeros where a file ran short)."""
    return stream_source(root, files, offset, length, limiter)(length)


# S3's answers that a new URL mends, not a new try of this one: the signing role's session
# ended (400 ExpiredToken on AWS, 403 "expired" on MinIO), or the URL names a host that
# redirects (307 to the bucket's region while a new bucket's name spreads; a redirect cannot
# be followed, the signature covers the host).
RESIGN_CODES = ("ExpiredToken", "TokenRefreshRequired", "TemporaryRedirect", "PermanentRedirect")
# A body the store waited for too long (400 RequestTimeout): the network's, worth another try.
RETRY_CODES = ("RequestTimeout",)


def error_code(text: str) -> str:
    """The ``<Code>`` of an S3 error document ("" when there is none)."""
    match = re.search(r"<Code>([^<]+)</Code>", text)
    return match.group(1) if match else ""


# A store that keeps refusing freshly signed URLs (a bucket in another region than the one
# signed for, a signer's clock far off) is not mended by signing again: after this many new
# URLs for one part, the part fails as any other refused answer does (the Map's retries, then
# UploadIncomplete) instead of going round Sign and Transfer until the execution times out.
MAX_RESIGNS = 5


def _status_error(
    response: urllib3.BaseHTTPResponse, what: str, resigns: Counter[str] | None = None
) -> str:
    """Names an HTTP error answer; one that a new URL mends ends the transfer (sign again)."""
    text = response.data.decode(errors="replace")
    code = error_code(text)
    if code in RESIGN_CODES or (response.status == 403 and "expired" in text.lower()):
        answer = f"is no longer accepted (HTTP {response.status} {code})"
    elif response.status in (301, 307):
        where = response.headers.get("Location", "another host")
        answer = f"was redirected (HTTP {response.status}) to {where}"
    else:
        return f"HTTP {response.status}: {text[:300]}"
    resigns = Counter() if resigns is None else resigns
    resigns[what] += 1
    if resigns[what] > MAX_RESIGNS:
        return f"HTTP {response.status} {code}: the URL {answer} after {MAX_RESIGNS} new ones"
    raise PresignedUrlExpired(
        f"the URL of {what} {answer}.",
        fix="sign again with the bucket's regional endpoint (the state machine does this).",
    )


def retryable(status: int, why: str) -> bool:
    return status in RETRYABLE_STATUS or any(code in why for code in RETRY_CODES)


@dataclass
class PartSender:
    """Uploads parts, and the listing commands' answers, through presigned URLs, retried by
    the agent's one policy."""

    http: urllib3.PoolManager
    attempts: int
    sleep: Callable[[float], None] = time.sleep
    # New URLs asked for per part, for the sender's life (the agent's): see MAX_RESIGNS.
    resigns: Counter[str] = field(default_factory=Counter)

    def send(
        self, key: str, part: PartChecksum, url: str, body: Callable[[], BinaryIO]
    ) -> UploadedPart:
        headers = {"Content-Length": str(part.size), CHECKSUM_HEADER: part.crc64nvme}
        etag = self._put(url, headers, body, f"part {part.part_number} of {key}")
        return UploadedPart(part_number=part.part_number, etag=etag, crc64nvme=part.crc64nvme)

    def send_answer(self, url: str, body: bytes, what: str) -> None:
        """Puts a command's answer (``shardvault.workflow.dispatch``: answers by URL). The URL binds
        no checksum; the control plane checks the object against the one the task answer sends."""

        self._put(url, {"Content-Length": str(len(body))}, lambda: io.BytesIO(body), what)

    def send_probe(self, url: str, body: bytes, crc64nvme: str) -> None:
        """Puts ``shardvault check``'s probe through a URL bound to its checksum, as a part's."""
        headers = {"Content-Length": str(len(body)), CHECKSUM_HEADER: crc64nvme}
        self._put(url, headers, lambda: io.BytesIO(body), "the probe object")

    def send_file(self, url: str, path: Path, size: int, crc64nvme: str, what: str) -> None:
        """Puts a whole packed file (a WAL batch) through a URL bound to its checksum."""
        headers = {"Content-Length": str(size), CHECKSUM_HEADER: crc64nvme}
        self._put(url, headers, lambda: open(path, "rb"), what)  # noqa: SIM115 - closed by _try

    def _put(
        self, url: str, headers: dict[str, str], body: Callable[[], BinaryIO], what: str
    ) -> str:
        """PUTs ``body()`` (opened again for each try); returns the stored object's ETag."""
        try:
            for attempt in retrying(self.attempts, self.sleep):
                with attempt:
                    return self._try(url, headers, body, what)
        except TryAgain as last:
            raise PartUploadFailed(
                f"{what} failed after {self.attempts} tries: {last.why}",
                fix="check the network path from this node to the store; the backup retries it.",
            ) from None
        raise AssertionError("unreachable")  # retrying() ends in a return or a raise

    def _try(
        self, url: str, headers: dict[str, str], body: Callable[[], BinaryIO], what: str
    ) -> str:
        try:
            with body() as stream:
                response = self.http.request(
                    "PUT", url, body=stream, headers=headers, retries=False, timeout=TIMEOUT
                )
        except (urllib3.exceptions.HTTPError, OSError) as error:
            log.info("%s: try failed: %s: %s", what, type(error).__name__, error)
            raise TryAgain(f"{type(error).__name__}: {error}") from error
        if response.status == 200:
            return response.headers["ETag"]
        why = _status_error(response, what, self.resigns)
        log.info("%s: try failed: %s", what, why)
        if retryable(response.status, why) or (
            # The packed copy is stable: bytes the store finds different from their checksum
            # were damaged on the way, and the next try sends them again.
            response.status == 400 and any(e in why for e in CHECKSUM_ERRORS)
        ):
            raise TryAgain(why)
        raise PartUploadFailed(
            f"{what} was refused: {why}",
            fix="check the store's answer above; the backup is cleaned up and can be retried.",
        )


def upload_object(
    key: str,
    parts: list[PartChecksum],
    urls: dict[int, str],
    open_part: Callable[[PartChecksum], BinaryIO],
    sender: PartSender,
    parallelism: int,
    done: dict[int, UploadedPart],
    on_part: Callable[[UploadedPart], None],
) -> list[UploadedPart]:
    """Sends every part that has a URL and is not already ``done``; returns every part the
    store holds, old and new."""
    todo = [p for p in parts if p.part_number in urls and p.part_number not in done]

    def one(part: PartChecksum) -> UploadedPart:
        uploaded = sender.send(key, part, urls[part.part_number], lambda: open_part(part))
        on_part(uploaded)
        return uploaded

    with ThreadPoolExecutor(max_workers=parallelism) as pool:
        for uploaded in pool.map(one, todo):
            done[uploaded.part_number] = uploaded
    return [done[n] for n in sorted(done)]


def local_write_error(error: OSError, key: str) -> ShardVaultError:
    """A write into staging failed: the disk, not the network. Named, and never retried."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return TargetTooSmall(
            f"the disk of restore_dir filled up while writing {key}: {error.strerror}.",
            fix="free space on this node's restore_dir (or set restore_capacity_bytes to "
            "what it can really hold), then start the restore again.",
        )
    return RestoreWriteFailed(
        f"writing {key} into restore_dir failed: {error}.",
        fix="check this node's disk and restore_dir (permissions, read-only or failing "
        "disk), then start the restore again.",
    )


@dataclass
class Downloader:
    """Reads byte ranges of a stored object through one presigned URL, retried by the agent's
    one policy."""

    http: urllib3.PoolManager
    attempts: int
    limiter: RateLimiter
    sleep: Callable[[float], None] = time.sleep

    def fetch(
        self, url: str, key: str, offset: int, size: int, write: Callable[[int, bytes], None]
    ) -> str:
        """Hands bytes ``[offset, offset + size)`` of the object to ``write(position, data)``
        as they stream (a retry starts again at position 0); returns their CRC64NVME. Network
        trouble is retried; a local write error is not (``local_write_error``), nor is a store
        that cuts every try at the same byte (``StoreObjectDamaged``)."""
        cut_at: set[int | None] = set()
        try:
            for attempt in retrying(self.attempts, self.sleep):
                with attempt:
                    return self._try(url, key, offset, size, write, cut_at)
        except TryAgain as last:
            if self.attempts > 1 and len(cut_at) == 1 and None not in cut_at:
                raise StoreObjectDamaged(
                    f"the store cut every read of bytes {offset}-{offset + size - 1} of {key} at "
                    f"byte {offset + (cut_at.pop() or 0)} ({self.attempts} tries: {last.why}): "
                    "it cannot read that object, e.g. bitrot found by its own checksums.",
                    fix="restore another backup (this one cannot be read whole), and repair the "
                    "store (MinIO: 'mc admin heal'); then run a new backup.",
                ) from None
            raise PartDownloadFailed(
                f"bytes {offset}-{offset + size - 1} of {key} failed after {self.attempts} "
                f"tries: {last.why}",
                fix="check the network path from this node to the store; the restore retries it.",
            ) from None
        raise AssertionError("unreachable")

    def _try(
        self,
        url: str,
        key: str,
        offset: int,
        size: int,
        write: Callable[[int, bytes], None],
        cut_at: set[int | None],
    ) -> str:
        try:
            response = self.http.request(
                "GET",
                url,
                headers={"Range": f"bytes={offset}-{offset + size - 1}"},
                preload_content=False,
                retries=False,
                timeout=TIMEOUT,
            )
        except (urllib3.exceptions.HTTPError, OSError) as error:
            cut_at.add(None)  # never reached the store: not the object's fault
            raise TryAgain(f"{type(error).__name__}: {error}") from error
        got = 0
        try:
            if response.status != 206:
                cut_at.add(None)
                why = _status_error(response, f"the download of {key}")
                if retryable(response.status, why):
                    raise TryAgain(why)
                raise PartDownloadFailed(
                    f"the store refused bytes {offset}-{offset + size - 1} of {key}: {why}",
                    fix="check that the backup's objects are still in the store; restore "
                    "another backup if they are gone.",
                )
            crc = 0
            for chunk in response.stream(READ_CHUNK):
                self.limiter.take(len(chunk))
                try:
                    write(got, chunk)
                except OSError as error:
                    raise local_write_error(error, key) from error
                crc, got = crc64nvme(chunk, crc), got + len(chunk)
            if got == size:
                return to_b64(crc)
            cut_at.add(got)
            raise TryAgain(f"the store sent {got} of {size} bytes")
        except (urllib3.exceptions.HTTPError, OSError) as error:
            # A connection the store closed mid-body marks where it cut; a timeout is the
            # network's (or a slow store's) and says nothing about the object.
            timed_out = isinstance(error, (urllib3.exceptions.TimeoutError, TimeoutError))
            cut_at.add(got if response.status == 206 and not timed_out else None)
            raise TryAgain(f"{type(error).__name__}: {error}") from error
        finally:
            response.release_conn()


def inlined(downloader: Downloader, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with the part too large for an inbox item read from the store through its
    presigned URL (``args_url``, ``args_size``: ``shardvault.workflow.dispatch.work_args``)."""
    url = args.get("args_url")
    if not url:
        return args
    size = int(args["args_size"])
    body = bytearray(size)

    def write(position: int, chunk: bytes) -> None:
        body[position : position + len(chunk)] = chunk

    downloader.fetch(url, "the command's arguments", 0, size, write)
    rest = {k: v for k, v in args.items() if k not in ("args_url", "args_size")}
    return json.loads(body) | rest


@dataclass
class SpoolReader:
    """Reads an object's bytes from its spool, a local copy fetched and checked whole before
    (a chain's prefetched objects): ``Downloader.fetch``'s contract, from disk."""

    path: Path

    def fetch(
        self, url: str, key: str, offset: int, size: int, write: Callable[[int, bytes], None]
    ) -> str:
        crc, got = 0, 0
        with open(self.path, "rb") as spool:
            while got < size:
                chunk = os.pread(spool.fileno(), min(READ_CHUNK, size - got), offset + got)
                if not chunk:
                    raise DownloadIncomplete(
                        f"the spool of {key} ends at byte {offset + got}, before the "
                        f"{size} bytes asked for at {offset}.",
                        fix="the restore failed: start it again (it fetches the object anew).",
                    )
                write(got, chunk)
                crc, got = crc64nvme(chunk, crc), got + len(chunk)
        return to_b64(crc)
