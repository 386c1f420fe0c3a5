"""The WAL feed: a point-in-time restore's archive batches fetched while recovery replays
(PostgreSQL's WAL; MariaDB's binary logs, asked for by the adapter's replay the same way).

Recovery starts as soon as the base is in place. PostgreSQL asks its ``restore_command``
(``engines.postgres.restore.feed_command``) for one WAL file at a time; the command waits
only until that file is in the *WAL directory* (``.shardvault-wal/`` in the data directory),
then links it into ``pg_wal`` (a link's cost, where a copy of 16 MiB took 17 ms of
recovery's time per segment), and the feed fetches the batches holding the files recovery
asks for and the next few, in parallel, so that replay rarely waits and nothing far past
where recovery stops is fetched.

Terms:
- *batch*: one archive object (``Phase.WAL`` download item): consecutive WAL files, frames
  checked as they land and the object as a whole against its CRC64NVME, like any download.
- *planned*: ``.planned/<name>``, an empty file per WAL file the archive holds for this
  restore, written before the server starts: a name not planned (a newer timeline's history,
  the segment after the archive's end) is answered "not in the archive" at once.
- *asked*: ``.asked/<name>``, written by the command as it starts waiting: the feed's
  *position* is the newest batch holding a segment recovery asked for.
- *ahead*: batches fetched past the position (``AHEAD``), at most ``PARALLEL`` at once; a
  batch holding an asked file that is not a segment (a timeline history) jumps the queue.
- *landing*: a batch's files are written under ``<incoming>/<shard>.wal/<batch>/``, read by
  read (``READ_BYTES`` of stored bytes each), and each first copy is renamed into the WAL
  directory as soon as all its frames have arrived and passed their checks: a file there is
  whole, and recovery waits for its file, not its batch. The batch is then checked whole.
- *failed*, *stopped*: ``.failed`` (holding the reason) and ``.stop`` in the WAL directory.
  The command then exits with 200, which makes recovery stop with an error instead of
  taking the missing file for the archive's end (which would promote the copy short). The
  feed stops when recovery is over (``recovered``), when the finish ends, and when the
  restore is aborted (``aborted``: its tombstone).
- *progress*: when a batch last landed or recovery last asked (``last_progress``): how long
  recovery may take is counted from it, not from the server's start.

The batches' URLs are signed as the node's finish starts; one that expires before recovery
reaches its batch fails the restore with ``url_ttl_seconds`` named (the fix: a base nearer the
target, or a longer lifetime).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from shardvault.contracts.commands import WalFed
from shardvault.contracts.models import DownloadItem, FileEntry
from shardvault.contracts.wal_archive import BINLOG_FILE
from shardvault.data.checksums import combine, to_b64
from shardvault.data.pipeline import Sealer
from shardvault.data.streams import StreamIndex
from shardvault.errors import (
    ChecksumMismatch,
    DownloadIncomplete,
    PresignedUrlExpired,
    ShardVaultError,
)
from shardvault_agent.restore.files import ShardFiles
from shardvault_agent.restore.reads import RangeRead, fetch_range, planned_reads
from shardvault_agent.transfer import Downloader

log = logging.getLogger("shardvault.agent.restore")

AHEAD = 4  # batches fetched past the newest one recovery asked from
PARALLEL = 2  # batches fetched at once: replay and decompression share the node's cores
POLL_SECONDS = 0.05
READ_BYTES = 2 * 1024 * 1024  # stored bytes per ranged read: about one compressed segment
PLANNED, ASKED, FAILED, STOPPED = ".planned", ".asked", ".failed", ".stop"


@dataclass(frozen=True)
class WalBatch:
    """One archive object of the feed: its item, its presigned GET, the WAL files it holds
    (their stream paths) and the names of those it supplies first (a file a later batch holds
    again is that batch's duplicate, ``wal.archive.wal_stream``)."""

    index: int
    item: DownloadItem
    url: str
    paths: list[str]
    names: list[str]


def wal_batches(files: list[FileEntry], signed: list[tuple[DownloadItem, str]]) -> list[WalBatch]:
    """The feed's batches in stream order, each with the files its byte range holds."""
    index = StreamIndex(files)
    batches = []
    for number, (item, url) in enumerate(sorted(signed, key=lambda s: s[0].stream_offset)):
        paths = [seg.path for seg in index.segments(item.stream_offset, item.length)]
        names = [PurePosixPath(p).name for p in paths if is_first_copy(p)]
        batches.append(WalBatch(number, item, url, paths, names))
    return batches


def is_first_copy(path: str) -> bool:
    """A stream path directly in the WAL directory (``dup/<batch>/`` holds the repeats)."""
    return len(PurePosixPath(path).parts) == 2


def is_segment(name: str) -> bool:
    """A file of the log's own sequence, which moves the feed's position: a WAL segment
    (24 hex digits; not a history, backup or partial file) or a binary log."""
    wal_segment = len(name) == 24 and all(c in "0123456789ABCDEF" for c in name)
    return wal_segment or BINLOG_FILE.fullmatch(name) is not None


@dataclass
class WalFeed:
    """Feeds one shard's WAL directory (see the module's terms). ``start`` before the server
    starts, ``stop`` once recovery is over (or failed); ``failure`` says why it stopped
    feeding, if it did."""

    wal_dir: Path
    landing: Path  # the batches' files land here first (same file system as ``wal_dir``)
    files: list[FileEntry]  # the WAL stream's
    batches: list[WalBatch]
    downloader: Downloader
    sealer_of: Callable[[DownloadItem], Sealer | None]
    aborted: Callable[[], bool] = lambda: False
    owner: tuple[int, int] | None = None  # the server's account (the agent as root)
    ahead: int = AHEAD
    parallel: int = PARALLEL
    read_bytes: int = READ_BYTES
    fetched: list[WalBatch] = field(default_factory=list)
    failure: ShardVaultError | None = None
    recovery_over: bool = False  # the server left recovery: later failures never mattered
    last_progress: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._index = StreamIndex(self.files)  # once: every batch's reads find files in it

    # --- the server's side ----------------------------------------------------------------
    def start(self) -> None:
        """Writes the planned names and the asked directory, then starts feeding."""
        for name in (PLANNED, ASKED):
            (self.wal_dir / name).mkdir(parents=True, exist_ok=True)
        for marker in (FAILED, STOPPED):
            (self.wal_dir / marker).unlink(missing_ok=True)
        self._asked()  # a retried finish's: read and removed before the server's files are
        self.last_progress = time.monotonic()
        for batch in self.batches:
            for name in batch.names:
                (self.wal_dir / PLANNED / name).touch()
        self._thread = threading.Thread(target=self._run, name="wal-feed", daemon=True)
        self._thread.start()

    def recovered(self) -> None:
        """The server left recovery: stop feeding (a batch that fails now was never needed),
        then remove the WAL directory, replayed. In that order: a batch still being placed
        would make the directory again (MariaDB takes any directory in its data for a
        database)."""
        self.recovery_over = True
        self.stop()
        shutil.rmtree(self.wal_dir, ignore_errors=True)

    def stop(self) -> None:
        """Stops feeding (the batches being fetched end first) and removes the landing."""
        self._stop.set()
        with contextlib.suppress(OSError):
            (self.wal_dir / STOPPED).touch()
        if self._thread is not None:
            self._thread.join()
        shutil.rmtree(self.landing, ignore_errors=True)

    def counted(self) -> WalFed:
        """What the feed fetched of what was planned."""
        return WalFed(
            planned=len(self.batches),
            fetched=len(self.fetched),
            bytes=sum(b.item.length for b in self.fetched),
            stored_bytes=sum(b.item.stored_length or b.item.length for b in self.fetched),
        )

    # --- feeding --------------------------------------------------------------------------
    def _run(self) -> None:
        """Feeds until every batch is in, or the feed stops; a failure of any kind is written
        to ``.failed`` (recovery must never wait for a feed that has ended)."""
        try:
            self._feed()
        except Exception as error:  # anything at all ends the feed, and says so
            self.failure = self.failure or DownloadIncomplete(
                f"the WAL feed stopped: {error!r}.",
                fix="restore again; if this repeats, report it with the agent's log.",
            )
        if self.failure is not None:
            (self.wal_dir / FAILED).write_text(f"{self.failure}\n")

    def _feed(self) -> None:
        batch_of = {name: b.index for b in self.batches for name in b.names}
        todo = list(self.batches)  # a retried finish's too: a crash may have torn files
        total = len(self.batches)
        position, jumped = 0, set[int]()  # recovery starts in the first batch
        with ThreadPoolExecutor(self.parallel, thread_name_prefix="wal-fetch") as pool:
            running: dict[Future[bool], WalBatch] = {}
            while (todo or running) and not self._stop.is_set():
                if self.aborted():
                    self.failure = self.failure or DownloadIncomplete(
                        "the restore was aborted while recovery replayed its WAL.",
                        fix="nothing to do: that restore has ended; start a new one.",
                    )
                    break
                for name in self._asked():
                    if (number := batch_of.get(name)) is None:
                        continue
                    log.info("recovery asked for %s (batch %d of %d)", name, number + 1, total)
                    self.last_progress = time.monotonic()
                    if is_segment(name):
                        position = max(position, number)
                    else:
                        jumped.add(number)
                while todo and len(running) < self.parallel and self.failure is None:
                    nxt = next((b for b in todo if b.index in jumped), None)
                    if nxt is None and todo[0].index <= position + self.ahead:
                        nxt = todo[0]
                    if nxt is None:
                        break
                    todo.remove(nxt)
                    running[pool.submit(self._fetch, nxt)] = nxt
                if not running:  # the window is in: wait for recovery to ask further
                    self._stop.wait(POLL_SECONDS)
                    continue
                done, _ = wait(running, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
                for future in done:
                    batch = running.pop(future)
                    self._landed(batch, future)
                if self.failure is not None and not running:
                    break

    def _landed(self, batch: WalBatch, future: Future[bool]) -> None:
        try:
            placed = future.result()
        except ShardVaultError as error:
            self.failure = self.failure or error
            return
        except OSError as error:  # the restore directory's disk: recovery must hear of it
            self.failure = self.failure or DownloadIncomplete(
                f"WAL batch {batch.item.key} could not be placed: {error}.",
                fix="check the restore directory's disk and permissions, then restore again.",
            )
            return
        if placed:
            self.fetched.append(batch)
            self.last_progress = time.monotonic()

    def _asked(self) -> list[str]:
        """The names the command asked for since the last look (their markers removed)."""
        names = []
        with contextlib.suppress(FileNotFoundError):
            for marker in os.scandir(self.wal_dir / ASKED):
                names.append(marker.name)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(marker.path)
        return names

    def _fetch(self, batch: WalBatch) -> bool:
        """Fetches one batch into its landing a read at a time, moving each file in as soon
        as its frames have all arrived and passed their checks (recovery waits for a file,
        not for its whole batch), then checks the batch whole; False: the feed stopped
        first."""
        item = batch.item
        root = self.landing / f"{batch.index:06d}"
        shutil.rmtree(root, ignore_errors=True)
        segments = list(self._index.segments(item.stream_offset, item.length))
        for seg in segments:
            path = root / seg.path
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as out:
                out.truncate(seg.length)
        files = ShardFiles(root, self._index)
        # Reads of about a segment's stored bytes, not the batch's one part: small GETs.
        reads = planned_reads(item.model_copy(update={"part_size": self.read_bytes}))
        crcs, waiting = [], deque(segments)
        try:
            for read in reads:
                if self._stop.is_set():
                    return False
                crcs.append(self._read(batch, read, files))
                landed = item.stream_offset + read.plain_offset + read.plain_size
                while waiting and waiting[0].stream_offset + waiting[0].length <= landed:
                    self._move_in(root, waiting.popleft().path)
        finally:
            files.close()
            shutil.rmtree(root, ignore_errors=True)
        whole = combine(zip(crcs, (r.size for r in reads), strict=True)) if reads else to_b64(0)
        if whole != item.crc64nvme:
            raise ChecksumMismatch(
                f"WAL batch {item.key} arrived with CRC64NVME {whole}; the archive recorded "
                f"{item.crc64nvme}.",
                fix="the archive's object is damaged in the store: restore to a target before "
                "it, or from a later backup.",
            )
        return True

    def _move_in(self, root: Path, path: str) -> None:
        """A landed file into the WAL directory, the server's account's as PostgreSQL's own
        segments are (the command links it into ``pg_wal``, where the server recycles it and
        later writes into it); a batch's repeat of a file an earlier one holds is dropped.
        Not synced: the WAL directory is scratch for this recovery, which a crash ends anyway
        (a retried finish fetches every batch again)."""
        if not is_first_copy(path):
            return
        landed = root / path
        if self.owner is not None:
            os.chown(landed, *self.owner)
        landed.chmod(0o600)
        landed.rename(self.wal_dir / PurePosixPath(path).name)

    def _read(self, batch: WalBatch, read: RangeRead, files: ShardFiles) -> str:
        """One ranged read of a batch (the downloader retries it by the agent's one retry
        policy); an expired URL is named with what bounds it."""
        sealer = self.sealer_of(batch.item)
        try:
            return fetch_range(self.downloader, batch.url, batch.item, read, files, sealer)
        except PresignedUrlExpired as error:
            raise DownloadIncomplete(
                f"the URL of WAL batch {batch.item.key} expired before recovery reached "
                f"it: {error.message}",
                fix="the batches' URLs are signed as the finish starts and live "
                "url_ttl_seconds (and no longer than the signing role's session): restore "
                "from a backup nearer the target, or raise url_ttl_seconds.",
            ) from error


__all__ = ["AHEAD", "PARALLEL", "WalBatch", "WalFeed", "is_segment", "wal_batches"]
