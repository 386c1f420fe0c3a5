"""Restore on a target node: lay out shards, download their objects, finish and check them.

Terms:
- *restore_dir*: where this node keeps restored shards, one directory per shard
  (``restore_dir/<shard_id>``), configured per agent.
- *staging*: ``restore_dir/.incoming/<restore_id>/<shard_id>``: the files are created there
  at their final sizes by ``prepare_restore`` and filled in place by ``download``; only
  ``finish_restore`` moves a complete, verified shard to its final directory and starts it,
  so nothing half-restored is ever started.
- *state*: ``state_dir/restores/<restore_id>/``: the layout of each shard, the parts each
  object has received (so a retried or resumed download fetches only what is missing), the
  objects verified whole, and what ``finish_restore`` started (so ``abort_restore`` can undo it).
- *adopted shard*: a shard this node restored and checked, recorded in
  ``state_dir/adopted.json``; the agent holds it as if it were in its configuration (it is
  registered, and backups of the new cluster read it), so a restored cluster is protected
  without editing agent configs.

Every part is checked against its checksum as it is written, and every object against the
manifest's full-object checksum (combined from its parts' checksums): there is no
verification pass after the last byte.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from array import array
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardvault import errors
from shardvault.aws.tables import INBOX_TTL_SECONDS
from shardvault.contracts.commands import ParentMap
from shardvault.contracts.extents import unpack_numbers
from shardvault.contracts.models import DownloadItem, Encryption, unpack_files
from shardvault.data.checksums import combine, to_b64
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
from shardvault.data.streams import StreamIndex
from shardvault.errors import (
    ChecksumMismatch,
    DownloadIncomplete,
    RestoreValidationFailed,
    ShardVaultError,
    TargetNotEmpty,
    TargetNotReady,
    TargetTooSmall,
)
from shardvault_agent.chain_placement import Placed, place_chain
from shardvault_agent.checks import raise_if_refused
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import EngineAdapter, Finishing
from shardvault_agent.keys import DataKeys
from shardvault_agent.overlay import Overlay, save_index
from shardvault_agent.statefiles import write_json
from shardvault_agent.transfer import Downloader, SpoolReader, inlined

log = logging.getLogger("shardvault.agent.restore")
INCOMING = ".incoming"


def occupied(restore_dir: Path | None) -> list[str]:
    """Shard directories ``restore_dir`` already holds (reported with each heartbeat)."""
    if restore_dir is None or not restore_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in restore_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and any(p.iterdir())
    )


def room(config: AgentConfig) -> int | None:
    """Bytes this node offers restores: free space, capped by ``restore_capacity_bytes``."""
    if config.restore_dir is None:
        return None
    config.restore_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(config.restore_dir).free
    cap = config.restore_capacity_bytes
    return free if cap is None else min(free, cap)


# A chain member's object's placements: flat ``frame, offset in frame, length, stream offset``
# numbers (``chain_placement.object_placements``), resolved to files once per object, per frame:
# (offset in frame, length, fd, offset in the file, stream offset).
Pieces = dict[int, list[tuple[int, int, int, int, int]]]
Write = tuple[int, int, int]  # fd, file offset, length


@dataclass
class ShardFiles:
    """A staged shard's stream of one phase: writes land at the right place of each file."""

    root: Path
    index: StreamIndex
    handles: dict[str, int] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)

    def write(self, stream_offset: int, data: bytes) -> None:
        view = memoryview(data)
        for seg in self.index.segments(stream_offset, len(data)):
            start = seg.stream_offset - stream_offset
            os.pwrite(self._fd(seg.path), view[start : start + seg.length], seg.file_offset)

    def resolve(self, numbers: Sequence[int]) -> Pieces:
        """Per frame, its pieces as ``(offset in frame, length, file descriptor, file
        offset, stream offset)``, from flat placements: each piece is found in its files once,
        before the download, so that placing a chain member's tens of thousands of 8 KiB
        pieces costs one ``pwrite`` each. A piece inside one file (nearly all) takes one
        bisect."""
        starts, files = self.index.starts, self.index.files
        fds: dict[int, int] = {}
        resolved: Pieces = {}
        for i in range(0, len(numbers), 4):
            frame, inside, length, target = numbers[i : i + 4]
            runs = resolved.setdefault(frame, [])
            k = bisect.bisect_right(starts, target) - 1
            if target + length <= starts[k + 1]:
                fd = fds.get(k)
                if fd is None:
                    fd = fds[k] = self._fd(files[k].path)
                runs.append((inside, length, fd, target - starts[k], target))
                continue
            for seg in self.index.segments(target, length):
                at = inside + seg.stream_offset - target
                runs.append(
                    (at, seg.length, self._fd(seg.path), seg.file_offset, seg.stream_offset)
                )
        return resolved

    def writes(self, stream_offset: int, length: int) -> list[Write]:
        """Where a contiguous range of the stream lands, file by file."""
        return [
            (self._fd(seg.path), seg.file_offset, seg.length)
            for seg in self.index.segments(stream_offset, length)
        ]

    def _fd(self, path: str) -> int:
        with self.guard:
            if path not in self.handles:
                self.handles[path] = os.open(self.root / path, os.O_WRONLY)
            return self.handles[path]

    def close(self) -> None:
        for fd in self.handles.values():
            os.close(fd)
        self.handles.clear()


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux: the fsync at finish does it all
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Asks the kernel to start writing ``[offset, offset + length)`` of ``fd`` to disk now.

    Without it the downloaded bytes sit dirty in the page cache (below the kernel's background
    threshold nothing is written for 30 s), and the flush at finish (PostgreSQL fsyncs its
    data directory when recovery starts) writes them all while the restore waits: 2.4 s for
    1.5 GiB in the benchmark. Started per part, writeback overlaps the download. PostgreSQL
    does the same for its own writes (``pg_flush_data``). Durability still comes from the
    fsync at finish; this only moves the work earlier."""
    if SYNC_FILE_RANGE is not None and length > 0:
        SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE)  # advisory: errors ignored


@dataclass(frozen=True)
class ChainJob:
    """What a node lays out of a restore's chains after its prepare answered: the chain
    shards, the newer members' objects it prefetches (item, URL), those not yet spooled."""

    restore_id: str
    chains: list[dict[str, Any]]
    prefetch: list[tuple[DownloadItem, str]]
    to_spool: list[tuple[DownloadItem, str]]


# A prefetched object being spooled: its reads, and one future (the CRC64NVME) per read.
Spooling = list[tuple[DownloadItem, list["RangeRead"], list[Future[str]]]]


class Restorer:
    def __init__(
        self, config: AgentConfig, engine: EngineAdapter, downloader: Downloader, keys: DataKeys
    ) -> None:
        self.config, self.engine, self.downloader, self.keys = config, engine, downloader, keys
        # Finish and abort of one restore may run at once (the reaper's abort arrives while a
        # finish is starting a server): each shard's finish and the abort take turns, so an
        # abort never misses a server that is starting.
        self._turns: dict[str, threading.Lock] = {}
        self._turns_guard = threading.Lock()
        self._adoption_guard = threading.Lock()  # adopted.json: one writer at a time
        # Each layered chain's overlay, shared by the downloads of its root's objects.
        self._overlays: dict[tuple[str, str], Overlay] = {}
        self._overlays_guard = threading.Lock()
        # Each restore's chains being placed and prefetched after its prepare answered
        # (``prepare``): when its downloads may start (placed and spooled), and when all of
        # it is done (landed), which finish and abort wait for.
        self._chains: dict[str, tuple[Future[None], Future[None]]] = {}
        self._chains_guard = threading.Lock()
        self._chains_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chains")

    def _turn(self, restore_id: str) -> threading.Lock:
        with self._turns_guard:
            return self._turns.setdefault(restore_id, threading.Lock())

    # --- places ------------------------------------------------------------------------------
    @property
    def restore_dir(self) -> Path:
        if self.config.restore_dir is None:
            raise TargetNotReady(
                f"node {self.config.node_id} accepts no restores: its agent has no restore_dir.",
                fix="set restore_dir in the agent's configuration and restart it.",
            )
        return self.config.restore_dir

    @property
    def restores_dir(self) -> Path:
        return self.config.state_dir / "restores"

    def state(self, restore_id: str) -> Path:
        return self.restores_dir / restore_id

    def staging(self, restore_id: str, shard_id: str) -> Path:
        return self.restore_dir / INCOMING / restore_id / shard_id

    def final(self, shard_id: str) -> Path:
        return self.restore_dir / shard_id

    def held_restores(self) -> set[str]:
        """Restores this node holds state or staging of."""
        ids = {p.name for p in self.restores_dir.glob("*") if p.is_dir()}  # not the tombstones
        if self.config.restore_dir is not None:
            ids |= {p.name for p in (self.restore_dir / INCOMING).glob("*") if p.is_dir()}
        return ids

    def drop_staging(self, restore_id: str) -> bool:
        """Removes what a finished restore left in staging and its spools; True if there
        was any."""
        dropped = self._drop_spools(restore_id)
        staging = self.restore_dir / INCOMING / restore_id
        if not staging.exists():
            return dropped
        shutil.rmtree(staging, ignore_errors=True)
        return True

    def _drop_spools(self, restore_id: str) -> bool:
        """Removes a restore's spools (a chain's newer objects, stored: ``overlay``), needed
        no more once its objects are all written; True if there were any."""
        spools = list((self.state(restore_id) / "objects").glob("*.spool"))
        for spool in spools:
            spool.unlink(missing_ok=True)
        return bool(spools)

    def _layout(self, restore_id: str, shard_id: str) -> dict[str, Any]:
        path = self.state(restore_id) / f"{shard_id}.layout.json"
        if not path.exists():
            raise DownloadIncomplete(
                f"node {self.config.node_id} has no layout of shard {shard_id} for restore "
                f"{restore_id} (was it prepared here?).",
                fix="start the restore again; an agent's state_dir must survive restarts.",
            )
        return json.loads(path.read_text())

    def _aborted(self, restore_id: str) -> Path:
        return self.restores_dir / f"{restore_id}.aborted"

    def _refuse_aborted(self, restore_id: str) -> None:
        if self._aborted(restore_id).exists():
            raise DownloadIncomplete(
                f"restore {restore_id} was aborted on node {self.config.node_id}.",
                fix="nothing to do: that restore has ended; start a new one.",
            )

    def _object_done(self, restore_id: str, key: str) -> Path:
        return self.state(restore_id) / "objects" / (hashlib.sha256(key.encode()).hexdigest()[:32])

    # --- prepare -----------------------------------------------------------------------------
    def prepare(self, args: dict[str, Any]) -> dict[str, Any]:
        """Checks the target directories and room, then creates each shard's files at their
        final sizes in staging. A second call (a retry, a resumed restore) keeps what is there.

        A chain's shards are laid out after the answer (``_prepare_chains``): the chain is
        placed and the newer members' objects are *prefetched* (``prefetch``: their items and
        presigned URLs) while the state machine goes on to the Download map, whose downloads
        wait for that work (``_await_chains``) and fail with its error if it failed."""
        restore_id, replace = args["backup_id"], bool(args.get("replace"))
        self._refuse_aborted(restore_id)
        self._raise_recorded_failure(restore_id)  # e.g. its chains' layout failed before
        shards = args["shards"]
        total = 0
        for shard in shards:
            final = self.final(shard["shard_id"])
            if final.exists() and any(final.iterdir()) and not replace:
                raise TargetNotEmpty(
                    f"{final} on node {self.config.node_id} already holds data.",
                    fix='restore with "replace": true, or empty that directory.',
                )
            for stream in shard["streams"]:
                total += sum(f.size for f in unpack_files(stream["files"]))
        prefetch = [
            (DownloadItem.model_validate(d["object"]), d["url"])
            for d in inlined(self.downloader, args.get("prefetch") or {}).get("downloads", [])
        ]
        state = self.state(restore_id)
        fresh = [s for s in shards if not (state / f"{s['shard_id']}.layout.json").exists()]
        needed = sum(
            sum(f.size for st in s["streams"] for f in unpack_files(st["files"])) for s in fresh
        )
        to_spool = [(i, url) for i, url in prefetch if not self._spooled(i.restore_id, i.key)]
        self._check_room(needed, [item for item, _ in to_spool])
        for shard in fresh:
            if not shard.get("chain"):
                self._lay_out(restore_id, shard)
        chains = [shard for shard in fresh if shard.get("chain")]
        if chains or prefetch:
            self._start_chains(ChainJob(restore_id, chains, prefetch, to_spool))
        return {
            "node_id": self.config.node_id,
            "prepared": [s["shard_id"] for s in shards],
            "bytes": total,
            # Fetched after this answer: finish counts them (objects and bytes).
            "prefetched": {"objects": len(prefetch)},
        }

    def _start_chains(self, job: ChainJob) -> None:
        with self._chains_guard:
            running = self._chains.get(job.restore_id)
            if running is not None and not running[1].done():
                return  # a retried prepare: the first one's work goes on
            ready: Future[None] = Future()
            done = self._chains_pool.submit(self._prepare_chains, job, ready)
            self._chains[job.restore_id] = (ready, done)

    def _prepare_chains(self, job: ChainJob, ready: Future[None]) -> None:
        """Fetches each object not yet spooled whole into its spool (checked against its
        CRC64NVME) while the chains are placed; then the downloads may start (``ready``: the
        root's frames find every patch), while it writes from the spools the bytes the root
        does not cover (elsewhere than the root's). Records its failure for the downloads
        and finish to report."""
        try:
            with ThreadPoolExecutor(max_workers=self.config.upload_parallelism) as pool:
                spooling = self._start_spooling(pool, job.to_spool)
                try:
                    for shard in job.chains:  # placing a chain takes a while: fetches go on
                        self._lay_out(job.restore_id, shard)
                except BaseException:  # stop fetching
                    for _, _, futures in spooling:
                        for future in futures:
                            future.cancel()
                    raise
                self._end_spooling(spooling)
            ready.set_result(None)
            landed = [self._download(item, url, from_spool=True) for item, url in job.prefetch]
            write_json(
                self.state(job.restore_id) / "prefetched.json",
                {"objects": len(landed), "bytes": sum(r["bytes"] for r in landed)},
            )
        except Exception as error:
            failed = (
                error
                if isinstance(error, ShardVaultError)
                else DownloadIncomplete(
                    f"node {self.config.node_id} could not lay out restore {job.restore_id}'s "
                    f"chains: {type(error).__name__}: {error}",
                    fix="start the restore again (it resumes what was downloaded).",
                )
            )
            self._record_failure(job.restore_id, failed)
            if not ready.done():
                ready.set_exception(failed)
            if failed is error:
                raise
            raise failed from error

    def _await_chains(self, restore_id: str, last: bool = False) -> None:
        """Waits until the restore's chains are placed and spooled here (``last``: wholly
        done, and nothing will wait for them again: finish, abort), if that is under way;
        raises what failed it."""
        with self._chains_guard:
            stages = self._chains.pop(restore_id, None) if last else self._chains.get(restore_id)
        if stages is not None:
            stages[1 if last else 0].result()

    def _check_room(self, needed: int, to_spool: list[DownloadItem]) -> None:
        """Room for the shards' files in restore_dir, and for the prefetched objects' spools
        in state_dir (both together when they share a file system)."""
        available = room(self.config) or 0
        spools = sum(r.size for item in to_spool for r in planned_reads(item))
        if needed > available:
            raise TargetTooSmall(
                f"node {self.config.node_id} needs {needed} bytes for its shards but has "
                f"{available}.",
                fix="free space in restore_dir, or restore into more nodes.",
            )
        if not spools:
            return
        state_dir = self.restores_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(state_dir).free
        shared = self.restore_dir.exists() and (
            os.stat(state_dir).st_dev == os.stat(self.restore_dir).st_dev
        )
        if spools + (needed if shared else 0) > free:
            raise TargetTooSmall(
                f"node {self.config.node_id} needs {spools} bytes in state_dir ({state_dir}) "
                "for the newer backups of the chain it restores (kept there, compressed, until "
                f"the full's blocks are written), {'besides its shards, ' if shared else ''}"
                f"but has {free}.",
                fix="free space in state_dir (or move it to a larger disk), or restore into "
                "more nodes.",
            )

    def _spooled(self, restore_id: str, key: str) -> bool:
        """Whether an object is in: written, or spooled whole (a prefetched one, whose
        uncovered bytes may still be on their way from the spool)."""
        marker = self._object_done(restore_id, key)
        return marker.with_suffix(".ok").exists() or marker.with_suffix(".spooled").exists()

    def _start_spooling(
        self, pool: ThreadPoolExecutor, prefetch: list[tuple[DownloadItem, str]]
    ) -> Spooling:
        """Starts fetching every read of each object into its spool, at the reads' offsets."""
        spooling: Spooling = []
        for item, url in prefetch:
            marker = self._object_done(item.restore_id, item.key)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.with_suffix(".item").write_text(item.model_dump_json())
            marker.with_suffix(".spool").unlink(missing_ok=True)  # a retry starts it anew
            reads = planned_reads(item)
            futures = [pool.submit(self._spool_read, item, url, read) for read in reads]
            spooling.append((item, reads, futures))
        return spooling

    def _spool_read(self, item: DownloadItem, url: str, read: RangeRead) -> str:
        self._refuse_aborted(item.restore_id)
        path = self._object_done(item.restore_id, item.key).with_suffix(".spool")
        spool = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            return self.downloader.fetch(
                url,
                item.key,
                read.offset,
                read.size,
                lambda position, chunk: os.pwrite(spool, chunk, read.offset + position),
            )
        finally:
            os.close(spool)

    def _end_spooling(self, spooling: Spooling) -> None:
        """Waits for the spooling reads; marks each object spooled once its bytes are whole
        (their CRC64NVME is the manifest's), else fails by name and leaves no spool."""
        for item, reads, futures in spooling:
            crcs = [future.result() for future in futures]
            whole = combine(zip(crcs, (r.size for r in reads), strict=True))
            marker = self._object_done(item.restore_id, item.key)
            if whole != item.crc64nvme:
                marker.with_suffix(".spool").unlink(missing_ok=True)
                raise ChecksumMismatch(
                    f"object {item.key} of shard {item.shard_id} arrived with CRC64NVME "
                    f"{whole}; the manifest says {item.crc64nvme}.",
                    fix="the object is damaged or replaced in the store: restore another backup.",
                )
            marker.with_suffix(".spooled").touch()

    def _lay_out(self, restore_id: str, shard: dict[str, Any]) -> None:
        """Creates the shard's files, then places its chain, if it restores one; the layout,
        written last, marks the shard done. Not side by side: placing is the interpreter's
        work (about a second for a chain of scattered changes at scale 100), and a thread
        creating files beside it waited for the interpreter's lock at each system call, so
        side by side took as long as one after the other."""
        shard = dict(shard)
        self._create_files(restore_id, shard["shard_id"], shard["streams"])
        self._place(restore_id, shard)
        write_json(self.state(restore_id) / f"{shard['shard_id']}.layout.json", shard)

    def _place(self, restore_id: str, shard: dict[str, Any]) -> None:
        """Places the shard's chain, if it restores one, and saves what its downloads need:
        each object's placements and patches, and the shard's patch index."""
        # Layered: the control plane downloads the newer members' objects first (two waves).
        if chain := shard.pop("chain", None):
            placed = place_chain(chain, layered=True)
            self._save_placements(restore_id, placed)
            # Every object that writes a byte, which finish requires: an object that failed
            # for good in the Download map (it tolerates failures) must not pass unnoticed.
            shard["chain_objects"] = sorted(placed.placements.keys() | placed.patches.keys())
            if placed.patches:  # what the root's objects wait for (see _refuse_early)
                keys = sorted(placed.patches)
                save_index(self._patch_index(restore_id, shard["shard_id"]), keys, placed.patches)
                shard["patched_objects"] = [o["key"] for o in chain[0]["objects"]]
                shard["patch_objects"] = keys

    def _create_files(self, restore_id: str, shard_id: str, streams: list[dict[str, Any]]) -> None:
        """The shard's files in staging at their final sizes, sparse until their bytes
        arrive, and its directories (a second call keeps what is there)."""
        root = self.staging(restore_id, shard_id)
        root.mkdir(parents=True, exist_ok=True)
        made = {root}  # each directory made once: a thousand files lie in a few dozen of them
        for stream in streams:
            for entry in unpack_files(stream["files"]):
                path = root / entry.path
                if entry.path.endswith("/"):
                    path.mkdir(parents=True, exist_ok=True)
                    made.add(path)
                    continue
                if path.parent not in made:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    made.add(path.parent)
                # Three system calls a file, not a buffered file object's six: each may wait
                # for the interpreter's lock while spools arrive, or for the file system
                # (which held runs of creations up to two seconds in the benchmarks).
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
                try:
                    os.ftruncate(fd, entry.size)
                finally:
                    os.close(fd)

    def _patch_index(self, restore_id: str, shard_id: str) -> Path:
        return self.state(restore_id) / f"{shard_id}.patchindex"

    def _save_placements(self, restore_id: str, placed: Placed) -> None:
        """Each chain object's placements and patches, as 64-bit numbers, and the bytes it
        supplies (read back per download)."""
        for key, supplied in placed.supplied.items():
            path = self._object_done(restore_id, key)
            path.parent.mkdir(parents=True, exist_ok=True)
            for suffix, numbers in (
                (".placements", placed.placements),
                (".patches", placed.patches),
            ):
                if key in numbers:  # int64 in the machine's order, as ``array("q")`` reads them
                    path.with_suffix(suffix).write_bytes(numbers[key].tobytes())
            path.with_suffix(".supplied").write_text(str(supplied))

    def _chain_placements(self, item: DownloadItem) -> tuple[list[int], list[int], int]:
        """Where a chain object's needed bytes go, as prepare placed them (flat numbers, see
        ``Pieces``), its patches (kept for the root's frames, ``overlay``), and how many
        bytes of the restored stream they supply; none when newer backups of the chain
        replaced all of its bytes."""
        path = self._object_done(item.restore_id, item.key)
        found = []
        for suffix in (".placements", ".patches"):
            numbers = array("q")
            if path.with_suffix(suffix).exists():
                numbers.frombytes(path.with_suffix(suffix).read_bytes())
            found.append(numbers.tolist())
        supplied = path.with_suffix(".supplied")
        return found[0], found[1], int(supplied.read_text()) if supplied.exists() else 0

    def _overlay(self, restore_id: str, shard_id: str, layout: dict[str, Any]) -> Overlay:
        """The shard's overlay, opened once for the downloads of its root's objects."""
        encryption = layout.get("encryption")

        def sealer_of(item: DownloadItem) -> Sealer | None:
            wrapped = Encryption.model_validate(encryption) if encryption else None
            return self.keys.sealer(wrapped, item.key_check)

        with self._overlays_guard:
            overlay = self._overlays.get((restore_id, shard_id))
            if overlay is None:
                overlay = self._overlays[(restore_id, shard_id)] = Overlay(
                    self._patch_index(restore_id, shard_id),
                    lambda key: self._object_done(restore_id, key).with_suffix(".spool"),
                    sealer_of,
                )
            return overlay

    def _close_overlays(self, restore_id: str) -> None:
        with self._overlays_guard:
            for key in [k for k in self._overlays if k[0] == restore_id]:
                self._overlays.pop(key).close()

    # --- download ----------------------------------------------------------------------------
    def download(self, args: dict[str, Any]) -> dict[str, Any]:
        """Fetches one object into its shard's staged files. A damaged object fails the
        restore on this node for good: later downloads and finish report the same error, so
        the restore ends with its real cause whatever order the tasks end in."""
        item = DownloadItem.model_validate(args["object"])
        self._refuse_aborted(item.restore_id)
        self._await_chains(item.restore_id)
        self._raise_recorded_failure(item.restore_id)
        try:
            return self._download(item, args["url"])
        except ShardVaultError as error:
            if not error.transient:
                self._record_failure(item.restore_id, error)
            raise

    def _failure_path(self, restore_id: str) -> Path:
        return self.state(restore_id) / "failed.json"

    def _record_failure(self, restore_id: str, error: ShardVaultError) -> None:
        path = self._failure_path(restore_id)
        if not path.exists() and path.parent.exists():
            failure = {"name": error.name, "message": error.message, "fix": error.fix}
            path.write_text(json.dumps(failure))

    def _raise_recorded_failure(self, restore_id: str) -> None:
        path = self._failure_path(restore_id)
        if path.exists():
            failure = json.loads(path.read_text())
            kind = getattr(errors, failure["name"], None)
            if not (isinstance(kind, type) and issubclass(kind, ShardVaultError)):
                kind = DownloadIncomplete
            raise kind(failure["message"], fix=failure["fix"])

    def _download(self, item: DownloadItem, url: str, from_spool: bool = False) -> dict[str, Any]:
        """Answers ``bytes``: the bytes of the restored streams it supplied (the restore's
        progress; a layered chain's root writes more, which newer members' patches
        replace). ``from_spool``: a prefetched object, read from its spool (checked whole
        as it was fetched), whose frames that patch the root's stay there."""
        placements, patches, written = self._placements(item)
        done_marker = self._object_done(item.restore_id, item.key)
        if done_marker.with_suffix(".ok").exists():
            return {"key": item.key, "bytes": written, "resumed": True}
        layout = self._layout(item.restore_id, item.shard_id)
        self._refuse_early(item, layout)
        stream = next(s for s in layout["streams"] if s["phase"] == item.phase)
        files = ShardFiles(
            self.staging(item.restore_id, item.shard_id), StreamIndex(unpack_files(stream["files"]))
        )
        record = done_marker.with_suffix(".parts")
        record.parent.mkdir(parents=True, exist_ok=True)
        done = _read_done(record)
        sealer = self._sealer(item, layout)
        pieces = None if placements is None else files.resolve(placements)  # opens files
        overlay = (
            self._overlay(item.restore_id, item.shard_id, layout)
            if item.key in layout.get("patched_objects", ())
            else None
        )
        spool = self._spool(item, done_marker) if patches and not from_spool else None
        frames = (
            None
            if pieces is None
            else pieces.keys() | (set() if from_spool else set(patches[0::4]))
        )
        source = SpoolReader(done_marker.with_suffix(".spool")) if from_spool else self.downloader
        reads = planned_reads(item, frames)
        todo = [r for r in reads if r.number not in done]
        if done:
            log.info("%s: resuming, %d of %d reads already here", item.key, len(done), len(reads))
        guard = threading.Lock()

        def fetch(read: RangeRead) -> None:
            self._refuse_aborted(item.restore_id)  # the reaper's abort: stop at the next read
            crc = fetch_range(source, url, item, read, files, sealer, pieces, spool, overlay)
            for fd, offset, length in written_ranges(item, read, files, pieces):
                start_writeback(fd, offset, length)
            with guard, record.open("a") as out:
                out.write(f"{read.number} {crc}\n")
            done[read.number] = crc

        try:
            with ThreadPoolExecutor(max_workers=self.config.upload_parallelism) as pool:
                for future in [pool.submit(fetch, r) for r in todo]:
                    future.result()
        finally:
            files.close()  # durability comes at finish, once per shard (see sync_tree)
            if spool is not None:
                os.close(spool)
            if self._aborted(item.restore_id).exists():  # aborted meanwhile: leave nothing
                shutil.rmtree(self.state(item.restore_id), ignore_errors=True)
        whole = combine((done[r.number], r.size) for r in reads) if reads else to_b64(0)
        if pieces is None and whole != item.crc64nvme:  # some frames only: each was checked
            record.unlink(missing_ok=True)  # a retry must fetch it all again
            raise ChecksumMismatch(
                f"object {item.key} of shard {item.shard_id} arrived with CRC64NVME {whole}; the "
                f"manifest says {item.crc64nvme}.",
                fix="the object is damaged or replaced in the store: restore another backup.",
            )
        done_marker.with_suffix(".ok").touch()
        if from_spool and not patches:  # nothing of it is laid into the root's frames
            done_marker.with_suffix(".spool").unlink(missing_ok=True)
        return {"key": item.key, "bytes": written, "resumed": len(todo) < len(reads)}

    def _placements(self, item: DownloadItem) -> tuple[list[int] | None, list[int], int]:
        """Where an object's bytes go (None: whole, from its stream offset), its patches and
        the bytes of the restored streams it supplies."""
        if item.from_chain:
            return self._chain_placements(item)
        if item.pieces:  # an older control plane's pieces
            return unpack_numbers(item.pieces), [], item.placed_bytes
        return None, [], item.placed_bytes

    def _sealer(self, item: DownloadItem, layout: dict[str, Any]) -> Sealer | None:
        encryption = layout.get("encryption")
        return self.keys.sealer(
            item.encryption  # a WAL batch's own key
            or (Encryption.model_validate(encryption) if encryption else None),
            item.key_check,
        )

    @staticmethod
    def _spool(item: DownloadItem, done_marker: Path) -> int:
        """Opens the spool of a newer member's object whose frames patch the root's (see
        ``overlay``), beside the item that says how to open them."""
        done_marker.with_suffix(".item").write_text(item.model_dump_json())
        return os.open(done_marker.with_suffix(".spool"), os.O_WRONLY | os.O_CREAT, 0o600)

    def _refuse_early(self, item: DownloadItem, layout: dict[str, Any]) -> None:
        """A layered chain's root objects are written with the newer members' blocks laid in:
        a root object written before all of those have arrived would miss some. The state
        machine orders them (two download waves); this makes the order a checked rule."""
        if item.key not in layout.get("patched_objects", ()):
            return
        missing = [
            k for k in layout.get("patch_objects", []) if not self._spooled(item.restore_id, k)
        ]
        if missing:
            raise DownloadIncomplete(
                f"object {item.key} of the full at the root of shard {item.shard_id}'s chain "
                f"came before {len(missing)} of the newer backups' objects, e.g. {missing[0]}, "
                "were in: it would be written without their blocks.",
                fix="the restore failed: start it again.",
            )

    # --- whole objects (a parent's block map) ---------------------------------------------
    def fetch_object_plain(self, source: ParentMap, dest: Path) -> Path:
        """Fetches a stored object whole through ``source.url`` and writes its plaintext to
        ``dest``, every frame checked (and opened with the backup's key when sealed)."""
        obj = source.object
        spans = frame_spans(unpack_frames(obj.frames), obj.frame_size, obj.length)
        sealer = self.keys.sealer(source.encryption, obj.key_check)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as out:
            sink = FrameSink(
                spans,
                FrameCodec(sealer=sealer),
                source.place,
                lambda offset, plain: os.pwrite(out.fileno(), plain, offset),
                where=obj.key,
            )
            size = sum(s.stored_size for s in spans)
            crc = self.downloader.fetch(source.url, obj.key, 0, size, sink.receive)
        if crc != obj.crc64nvme or not sink.complete:
            dest.unlink(missing_ok=True)
            raise ChecksumMismatch(
                f"{obj.key} arrived with CRC64NVME {crc}; the manifest says {obj.crc64nvme}.",
                fix="the object is damaged in the store: run a full backup (omit --incremental).",
            )
        return dest

    # --- finish ------------------------------------------------------------------------------
    def finish(self, args: dict[str, Any]) -> dict[str, Any]:
        restore_id = args["backup_id"]
        self._refuse_aborted(restore_id)
        self._await_chains(restore_id, last=True)
        self._raise_recorded_failure(restore_id)
        self._close_overlays(restore_id)  # every object is in: no more patches to lay in
        prefetched = self.state(restore_id) / "prefetched.json"
        results = []
        for shard_id in args["shard_ids"]:
            with self._turn(restore_id):
                self._refuse_aborted(restore_id)
                results.append(self._finish_shard(restore_id, shard_id, args))
        with contextlib.suppress(OSError):  # every shard moved out: staging is empty now
            (self.restore_dir / INCOMING / restore_id).rmdir()
        self._drop_spools(restore_id)  # every shard restored (a failure's abort drops them)
        answer: dict[str, Any] = {"node_id": self.config.node_id, "shards": results}
        if prefetched.exists():  # the restore's progress counts them now (finalize)
            answer["prefetched"] = json.loads(prefetched.read_text())
        return answer

    def _started(self, restore_id: str) -> dict[str, Any]:
        path = self.state(restore_id) / "started.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _note_started(self, restore_id: str, shard_id: str, info: dict[str, Any]) -> None:
        """Adds ``info`` to what this restore started of the shard (its path, the server
        it started, the server it replaced, its result)."""
        started = self._started(restore_id)
        started[shard_id] = started.get(shard_id, {}) | info
        write_json(self.state(restore_id) / "started.json", started)

    def _finish_shard(self, restore_id: str, shard_id: str, args: dict[str, Any]) -> dict:
        started = self._started(restore_id).get(shard_id)
        if started and started.get("result"):
            return started["result"]  # a retried finish: already done
        layout = self._layout(restore_id, shard_id)
        needed = [o["key"] for s in layout["streams"] for o in s["objects"]]
        missing = [
            key
            for key in dict.fromkeys(needed + layout.get("chain_objects", []))
            if not self._object_done(restore_id, key).with_suffix(".ok").exists()
        ]
        if missing:
            raise DownloadIncomplete(
                f"shard {shard_id} on node {self.config.node_id} misses {len(missing)} object(s), "
                f"e.g. {missing[0]}.",
                fix="the restore failed: start it again (it resumes what was downloaded).",
            )
        final, staged = self.final(shard_id), self.staging(restore_id, shard_id)
        began = time.monotonic()
        if staged.exists() and not self.engine.fsyncs_restored_files:
            sync_tree(staged)  # before the shard counts as restored
        synced = time.monotonic()
        aside = self.restore_dir / INCOMING / restore_id / f"{shard_id}.replaced"
        replaced: dict[str, Any] = {}
        if staged.exists():
            if final.exists():
                replaced = self._stop_replaced(final)
                # Whose copy it set aside (an earlier restore's adoption): its own to put back.
                if owner := self.adopted().get(shard_id, {}).get("restore_id"):
                    replaced["replaced_restore"] = owner
                final.rename(aside)  # put back by abort_restore, deleted once checks pass
            staged.rename(final)
        self._note_started(restore_id, shard_id, {"path": str(final), **replaced})
        result = self.engine.finish(self._finishing(restore_id, shard_id, final, args))
        raise_if_refused(shard_id, result["checks"])
        if not result["checks_passed"]:
            raise RestoreValidationFailed(
                f"shard {shard_id} on node {self.config.node_id} failed its checks: "
                f"{result['checks']}.",
                fix="if a validation query failed, check that it is right for this data; "
                "otherwise the backup may be damaged: restore another backup and report this "
                "one.",
            )
        checked = time.monotonic()
        shutil.rmtree(aside, ignore_errors=True)
        log.info(
            "%s: shard %s synced in %.2f s, started and checked in %.2f s, the copy it "
            "replaced removed in %.2f s",
            restore_id, shard_id, synced - began, checked - synced, time.monotonic() - checked,
        )  # fmt: skip
        self._note_started(restore_id, shard_id, {"result": result})
        self._adopt(restore_id, shard_id, result)
        return result

    def _finishing(
        self, restore_id: str, shard_id: str, root: Path, args: dict[str, Any]
    ) -> Finishing:
        def note_server(server: dict[str, Any]) -> None:
            self._note_started(restore_id, shard_id, {"path": str(root), "server": server})

        return Finishing(
            shard_id=shard_id,
            root=root,
            layout=self._layout(restore_id, shard_id),
            validation_queries=args.get("validation_queries", []),
            heapallindexed=bool(args.get("heapallindexed")),
            servers_given=[
                i["server"] for i in self._started(restore_id).values() if "server" in i
            ],
            note_server=note_server,
        )

    def _stop_replaced(self, final: Path) -> dict[str, Any]:
        """Stops the server a replaced shard runs (an earlier restore's copy): its files move
        aside, and its socket and port would keep the new copy from starting. Returns what
        ``_undo`` needs to start it again if this restore fails."""
        server = self.engine.serving(final)
        if server is None:
            return {}
        log.info("stopping the server of %s (%s): the restore replaces it", final, server)
        self.engine.stop_server(final)
        return {"replaced": server}

    # --- adoption ----------------------------------------------------------------------------
    @property
    def _adoption_file(self) -> Path:
        return self.config.state_dir / "adopted.json"

    def adopted(self) -> dict[str, dict[str, Any]]:
        """Adopted shards by id: ``{"restore_id", "shard": <ShardConfig fields>}``, and the
        entry it replaced as ``previous`` (put back if this restore is aborted)."""
        path = self._adoption_file
        return json.loads(path.read_text()) if path.exists() else {}

    def adopted_shards(self) -> list[ShardConfig]:
        return [ShardConfig.model_validate(e["shard"]) for e in self.adopted().values()]

    def _adopt(self, restore_id: str, shard_id: str, result: dict[str, Any]) -> None:
        shard = self.engine.adoptable(shard_id, result)
        if shard is None:
            log.warning("shard %s not adopted: its directory holds no single database", shard_id)
            return
        with self._adoption_guard:
            adopted = self.adopted()
            entry: dict[str, Any] = {"restore_id": restore_id, "shard": shard}
            if (previous := adopted.get(shard_id)) and previous["restore_id"] != restore_id:
                entry["previous"] = {k: previous[k] for k in ("restore_id", "shard")}
            adopted[shard_id] = entry
            write_json(self._adoption_file, adopted)

    def _unadopt(self, restore_id: str, shard_id: str) -> None:
        with self._adoption_guard:
            adopted = self.adopted()
            entry = adopted.get(shard_id)
            if entry is None or entry["restore_id"] != restore_id:
                return
            if "previous" in entry:
                adopted[shard_id] = entry["previous"]
            else:
                del adopted[shard_id]
            write_json(self._adoption_file, adopted)

    # --- abort -------------------------------------------------------------------------------
    def abort(self, args: dict[str, Any]) -> dict[str, Any]:
        """Undoes the restore on this node: stops what it started, removes what it placed
        (putting back what it replaced) and its staging. Safe to call at any point, twice."""
        restore_id = args["backup_id"]
        self._aborted(restore_id).parent.mkdir(parents=True, exist_ok=True)
        self._prune_tombstones(restore_id)
        self._aborted(restore_id).touch()
        with contextlib.suppress(Exception):  # its reads stop at the tombstone
            self._await_chains(restore_id, last=True)
        self._close_overlays(restore_id)
        with self._turn(restore_id):
            self._undo(restore_id)
        return {"node_id": self.config.node_id, "aborted": True}

    def _prune_tombstones(self, restore_id: str) -> None:
        """Other restores' tombstones older than twice the inbox items' life
        (``INBOX_TTL_SECONDS``; DynamoDB's TTL deletes late): no command of those restores can
        still arrive. A restore drill's teardown aborts every week."""
        oldest = time.time() - TOMBSTONE_LIFE_SECONDS
        for tombstone in self.restores_dir.glob("*.aborted"):
            if tombstone == self._aborted(restore_id):
                continue
            with contextlib.suppress(OSError):
                if tombstone.stat().st_mtime < oldest:
                    tombstone.unlink()

    def _undo(self, restore_id: str) -> None:
        incoming = self.restore_dir / INCOMING / restore_id
        adopted = self.adopted()
        for shard_id, info in self._started(restore_id).items():
            if adopted_since(adopted.get(shard_id, {}), restore_id, info):
                # A later restore (with replace) put its own shard there and adopted it: that
                # one is not this restore's to stop or remove (an abort that comes late, e.g.
                # at reconcile after the node was away). An adoption of an *earlier* restore
                # is the copy this one set aside: it goes back below.
                continue
            final = Path(info["path"])
            if info.get("server"):
                self.engine.stop_server(final, immediate=True)
            shutil.rmtree(final, ignore_errors=True)
            for beside in self.engine.server_files(final):  # its socket directory, its log
                remove_server_file(beside)
            self._unadopt(restore_id, shard_id)
            aside = incoming / f"{shard_id}.replaced"
            if aside.exists():
                aside.rename(final)
                if info.get("replaced"):
                    self.engine.start_server(final, info["replaced"])
        shutil.rmtree(incoming, ignore_errors=True)
        shutil.rmtree(self.state(restore_id), ignore_errors=True)


TOMBSTONE_LIFE_SECONDS = 2 * INBOX_TTL_SECONDS


def adopted_since(entry: dict[str, Any], restore_id: str, started: dict[str, Any]) -> bool:
    """Whether the shard's adopted ``entry`` is a *later* restore's, placed over what
    ``restore_id`` placed, rather than the copy ``restore_id`` itself set aside."""
    owner = entry.get("restore_id")
    if owner is None or owner == restore_id or owner == started.get("replaced_restore"):
        return False
    later = entry.get("previous")
    while later is not None:  # the later restore adopted over this one's adoption
        if later.get("restore_id") == restore_id:
            return True
        later = later.get("previous")
    # This restore never adopted, and noted no copy it set aside (an agent before that note):
    # restore ids begin with their start time, so the later one sorts after.
    return owner > restore_id


def remove_server_file(path: Path) -> None:
    """A restored server's socket directory or log, beside its shard: a directory is removed
    only when it holds no directory (a socket directory holds sockets and lock files; a shard
    directory that happens to bear the name holds more), a file only when it is one."""
    if path.is_symlink():
        return
    if path.is_dir():
        if not any(child.is_dir() for child in path.iterdir()):
            shutil.rmtree(path, ignore_errors=True)
    elif path.is_file():
        path.unlink(missing_ok=True)


def sync_tree(root: Path) -> None:
    """fsync every file, then every directory, under ``root``: one flush per shard rather
    than one per object (on ext4 an fsync can flush the whole journal, so per-object fsyncs
    of concurrent downloads wait on each other)."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_done(path: Path) -> dict[int, str]:
    if not path.exists():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        number, _, crc = line.partition(" ")
        if crc:
            done[int(number)] = crc
    return done


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


# Written ranges closer than this are flushed as one: starting writeback of a range walks
# only its dirty pages, while one call per 8 KiB piece of a chain restore (tens of thousands)
# cost more than the download itself.
FLUSH_GAP = 1 << 20
# A merged range is flushed only when pieces fill at least this share of it: an incremental's
# scattered blocks spread a read's few writes over much of a file, and starting writeback
# there walks (and waits on) pages other reads are writing. Those are left to the fsync at
# finish; a full's frames, and the root of a chain's, stay dense and are flushed as they land.
FLUSH_DENSITY = 0.5


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


def dense_runs(writes: Iterable[Write]) -> list[Write]:
    merged: list[list[int]] = []  # [fd, start, end, bytes written]
    for fd, start, length in sorted(writes):
        end = start + length
        last = merged[-1] if merged else None
        if last and last[0] == fd and start <= last[2] + FLUSH_GAP:
            last[2] = max(last[2], end)
            last[3] += length
        else:
            merged.append([fd, start, end, length])
    return [
        (fd, start, end - start)
        for fd, start, end, written in merged
        if written >= FLUSH_DENSITY * (end - start)
    ]


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
