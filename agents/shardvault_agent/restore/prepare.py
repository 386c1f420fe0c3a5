"""Prepare: a target node checks its room and lays out each shard before any byte arrives.

*Lay out*: create the shard's files in staging at their final sizes (sparse until their bytes
arrive), place its chain if it restores one (``chain_placement``), and save its layout, last
(``places.LaidOut``: it marks the shard laid out). A second prepare (a retry, a resumed
restore) keeps what is there.

*Chain work*: a chain's shards are laid out after prepare has answered, and the chain's newer
objects are *prefetched* (the prepare's ``prefetch``: their items and presigned URLs) into
spools meanwhile, while the state machine goes on to the Download map. Its downloads wait
until the chains are placed and the spools whole (``ChainWork.wait``: *ready*); finish and
abort wait until the prefetched objects have landed too (*done*). A failure there is recorded
for the downloads and finish to report.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shardvault.contracts.commands import (
    Prefetch,
    PrefetchArgs,
    Prepared,
    PrepareRestoreArgs,
    ShardLayout,
)
from shardvault.contracts.commands import Prefetched as PrefetchedCount
from shardvault.contracts.models import DownloadItem, Phase, unpack_files
from shardvault.data.checksums import combine
from shardvault.errors import (
    ChecksumMismatch,
    DownloadIncomplete,
    ShardVaultError,
    TargetNotEmpty,
    TargetTooSmall,
)
from shardvault_agent.config import AgentConfig
from shardvault_agent.restore import linked
from shardvault_agent.restore.chain_placement import place_chain
from shardvault_agent.restore.download import Downloads
from shardvault_agent.restore.overlay import save_index
from shardvault_agent.restore.places import LaidOut, Places, room
from shardvault_agent.restore.reads import RangeRead, planned_reads
from shardvault_agent.transfer import Downloader, inlined

log = logging.getLogger("shardvault.agent.restore")

Signed = tuple[DownloadItem, str]  # an object to fetch, and its presigned GET
# A prefetched object being spooled: its reads, and one future (the CRC64NVME) per read.
Spooling = list[tuple[DownloadItem, list[RangeRead], list[Future[str]]]]


@dataclass(frozen=True)
class ChainJob:
    """What a node lays out of a restore's chains after its prepare answered: the chain
    shards, the newer members' objects it prefetches, those not yet spooled."""

    restore_id: str
    chains: list[ShardLayout]
    prefetch: list[Signed]
    to_spool: list[Signed]


class ChainWork:
    """Each restore's chain work under way: when its downloads may start (*ready*), and when
    all of it is done (*done*)."""

    def __init__(self) -> None:
        self._running: dict[str, tuple[Future[None], Future[None]]] = {}
        self._guard = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chains")

    def start(self, restore_id: str, work: Callable[[Future[None]], None]) -> None:
        """Runs ``work`` (told when the downloads may start) unless it runs already."""
        with self._guard:
            running = self._running.get(restore_id)
            if running is not None and not running[1].done():
                return  # a retried prepare: the first one's work goes on
            ready: Future[None] = Future()
            done = self._pool.submit(work, ready)
            self._running[restore_id] = (ready, done)

    def wait(self, restore_id: str, last: bool = False) -> None:
        """Waits until the restore's chains are placed and spooled here (``last``: wholly
        done, and nothing will wait for them again: finish, abort), if that is under way;
        raises what failed it."""
        with self._guard:
            stages = self._running.pop(restore_id, None) if last else self._running.get(restore_id)
        if stages is not None:
            stages[1 if last else 0].result()


class Preparer:
    def __init__(
        self, config: AgentConfig, places: Places, downloads: Downloads, chains: ChainWork
    ) -> None:
        self.config, self.places, self.downloads, self.chains = config, places, downloads, chains

    def prepare(self, args: PrepareRestoreArgs) -> Prepared:
        """Checks the target directories and room, then lays out each shard not laid out
        yet; a chain's shards, with the prefetch, after the answer (the module docstring)."""
        restore_id = args.backup_id
        self.places.refuse_aborted(restore_id)
        self.places.raise_recorded_failure(restore_id)  # e.g. its chains' layout failed before
        for shard in args.shards:
            final = self.places.final(shard.shard_id)
            if final.exists() and any(final.iterdir()) and not args.replace:
                raise TargetNotEmpty(
                    f"{final} on node {self.config.node_id} already holds data.",
                    fix='restore with "replace": true, or empty that directory.',
                )
        fresh = [s for s in args.shards if not self.places.is_laid_out(restore_id, s.shard_id)]
        for shard in fresh:  # every linked directory allowed and empty, before anything
            staging = self.places.staging(restore_id, shard.shard_id)
            linked.to_make(staging, shard.shard_id, self._linked(restore_id, shard))
            linked.refuse_created(shard, self.config.node_id)
        prefetch = self._prefetch(args)
        to_spool = [
            (i, url) for i, url in prefetch if not self.places.object(restore_id, i.key).is_in
        ]
        self._check_room(sum(map(shard_bytes, fresh)), [item for item, _ in to_spool])
        for shard in fresh:
            if not shard.chain:
                self.lay_out(restore_id, shard)
        chains = [shard for shard in fresh if shard.chain]
        if chains or prefetch:
            job = ChainJob(restore_id, chains, prefetch, to_spool)
            self.chains.start(restore_id, lambda ready: self._chain_work(job, ready))
        return Prepared(
            node_id=self.config.node_id,
            prepared=[s.shard_id for s in args.shards],
            bytes=sum(map(shard_bytes, args.shards)),
            # Fetched after this answer: finish counts them (objects and bytes).
            prefetched=PrefetchedCount(objects=len(prefetch)),
        )

    def _prefetch(self, args: PrepareRestoreArgs) -> list[Signed]:
        """The prepare's prefetch."""
        return signed_downloads(self.downloads.downloader, args.prefetch)

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
        state_dir = self.places.restores_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(state_dir).free
        restore_dir = self.places.restore_dir
        shared = restore_dir.exists() and os.stat(state_dir).st_dev == os.stat(restore_dir).st_dev
        if spools + (needed if shared else 0) > free:
            raise TargetTooSmall(
                f"node {self.config.node_id} needs {spools} bytes in state_dir ({state_dir}) "
                "for the newer backups of the chain it restores (kept there, compressed, until "
                f"the full's blocks are written), {'besides its shards, ' if shared else ''}"
                f"but has {free}.",
                fix="free space in state_dir (or move it to a larger disk), or restore into "
                "more nodes.",
            )

    # --- chain work -----------------------------------------------------------------------
    def _chain_work(self, job: ChainJob, ready: Future[None]) -> None:
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
                        self.lay_out(job.restore_id, shard)
                except BaseException:  # stop fetching
                    for _, _, futures in spooling:
                        for future in futures:
                            future.cancel()
                    raise
                self._end_spooling(spooling)
            ready.set_result(None)
            landed = [self.downloads.land(item, url, from_spool=True) for item, url in job.prefetch]
            counted = PrefetchedCount(objects=len(landed), bytes=sum(d.bytes for d in landed))
            self.places.save_prefetched(job.restore_id, counted)
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
            self.places.record_failure(job.restore_id, failed)
            if not ready.done():
                ready.set_exception(failed)
            if failed is error:
                raise
            raise failed from error

    def _start_spooling(self, pool: ThreadPoolExecutor, prefetch: list[Signed]) -> Spooling:
        """Starts fetching every read of each object into its spool, at the reads' offsets."""
        spooling: Spooling = []
        for item, url in prefetch:
            record = self.places.object(item.restore_id, item.key)
            record.keep_item(item)
            record.drop_spool()  # a retry starts it anew
            reads = planned_reads(item)
            futures = [pool.submit(self._spool_read, item, url, read) for read in reads]
            spooling.append((item, reads, futures))
        return spooling

    def _spool_read(self, item: DownloadItem, url: str, read: RangeRead) -> str:
        self.places.refuse_aborted(item.restore_id)
        spool = self.places.object(item.restore_id, item.key).open_spool()
        try:
            return self.downloads.downloader.fetch(
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
            record = self.places.object(item.restore_id, item.key)
            if whole != item.crc64nvme:
                record.drop_spool()
                raise ChecksumMismatch(
                    f"object {item.key} of shard {item.shard_id} arrived with CRC64NVME "
                    f"{whole}; the manifest says {item.crc64nvme}.",
                    fix="the object is damaged or replaced in the store: restore another backup.",
                )
            record.mark_spooled()

    # --- lay out --------------------------------------------------------------------------
    def lay_out(self, restore_id: str, shard: ShardLayout) -> None:
        """Creates the shard's files, then places its chain, if it restores one; the layout,
        written last, marks the shard done. Not side by side: placing is the interpreter's
        work (about a second for a chain of scattered changes at scale 100), and a thread
        creating files beside it waited for the interpreter's lock at each system call, so
        side by side took as long as one after the other."""
        self._create_files(restore_id, shard)
        self.places.save_layout(restore_id, self._place(restore_id, shard))

    def _place(self, restore_id: str, shard: ShardLayout) -> LaidOut:
        """Places the shard's chain, if it restores one, and saves what its downloads need:
        each object's placements and patches, and the shard's patch index."""
        laid_out = LaidOut.model_validate(shard.model_dump(exclude={"chain"}))
        if not shard.chain:
            return laid_out
        # Layered: the control plane downloads the newer members' objects first (two waves).
        chain = [member.model_dump(mode="json") for member in shard.chain]
        placed = place_chain(chain, layered=True)
        for key, supplied in placed.supplied.items():
            record = self.places.object(restore_id, key)
            record.save_chain_part(placed.placements.get(key), placed.patches.get(key), supplied)
        needed = {"chain_objects": sorted(placed.placements.keys() | placed.patches.keys())}
        if placed.patches:  # what the root's objects wait for (``Downloads.refuse_early``)
            keys = sorted(placed.patches)
            save_index(self.places.patch_index(restore_id, shard.shard_id), keys, placed.patches)
            needed["patched_objects"] = [o.key for o in shard.chain[0].objects]
            needed["patch_objects"] = keys
        return laid_out.model_copy(update=needed)

    def _linked(self, restore_id: str, shard: ShardLayout) -> dict[str, Path]:
        return linked.placements(self.config, restore_id, shard)

    def _create_files(self, restore_id: str, shard: ShardLayout) -> None:
        """The shard's files in staging at their final sizes, sparse until their bytes
        arrive, and its directories, its linked ones first (``linked``: their files are
        written where they stay). A second call keeps what is there."""
        root = self.places.staging(restore_id, shard.shard_id)
        root.mkdir(parents=True, exist_ok=True)
        record = self.places.links_record(restore_id)
        record.parent.mkdir(parents=True, exist_ok=True)
        linked.lay_out(record, root, shard.shard_id, self._linked(restore_id, shard))
        made = {root}  # each directory made once: a thousand files lie in a few dozen of them
        for stream in shard.streams:
            for entry in unpack_files(stream.files):
                path = root / entry.path
                if entry.path.endswith("/"):
                    path.mkdir(parents=True, exist_ok=True)
                    made.add(path)
                    continue
                if stream.phase == Phase.WAL:  # fed as recovery replays (``walfeed``)
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


def signed_downloads(downloader: Downloader, sent: PrefetchArgs | None) -> list[Signed]:
    """Objects and their URLs a command was given (a prepare's prefetch, a finish's WAL),
    fetched first when they came by URL (too large for the inbox item)."""
    if sent is None:
        return []
    given = Prefetch.model_validate(inlined(downloader, sent.model_dump(mode="json")))
    return [(d.object, d.url) for d in given.downloads]


def shard_bytes(shard: ShardLayout) -> int:
    """The bytes of a shard's files, every stream's."""
    return sum(f.size for stream in shard.streams for f in unpack_files(stream.files))
