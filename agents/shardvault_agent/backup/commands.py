"""The backup commands a node runs for the state machines, each idempotent
(``BackupCommands``): flush, checkpoint (with its scan, and for a lone node its stop), scan,
stop, pack, upload and release.

A *listing* is what checkpoint, scan and stop answer: each shard's files as its engine captured
them and, after a scan, the changed extents against its parent. Objects are *packed* (read once
through the part pipeline into a packed copy, whose checksums the control plane signs URLs for)
and then *uploaded* part by part; each part sent is recorded, so a retried upload sends only the
parts still missing. What the commands keep between them lives in ``state.BackupFiles``; how
hard they may read, in ``limits.BackupLimits``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import BinaryIO

from shardvault.contracts.commands import (
    CheckpointArgs,
    CutAnswer,
    CutArgs,
    CutShard,
    FlushArgs,
    Flushed,
    ListedShard,
    Listing,
    PackArgs,
    PackedObject,
    PackSpec,
    ParentMap,
    ReleaseArgs,
    Released,
    ScanArgs,
    StopArgs,
    UploadArgs,
    Uploaded,
)
from shardvault.contracts.cut import CutRequest
from shardvault.contracts.extents import pack_within, unpack_extents
from shardvault.contracts.models import (
    FileEntry,
    ObjectChecksums,
    ObjectPlan,
    PartChecksum,
    Phase,
    UploadedPart,
    pack_files,
)
from shardvault.data.checksums import crc64nvme_of_stream
from shardvault.data.pipeline import (
    FrameCodec,
    SpareCores,
    frame_spans,
    pack_frames,
    plaintext_crc,
    unpack_frames,
)
from shardvault.data.planning import (
    OBJECTS_IN_FLIGHT_PER_NODE,
    blockmap_listings,
    listings_from_results,
    plan_objects,
)
from shardvault.errors import CheckpointNotFound
from shardvault_agent.backup.blockmap import BlockMap
from shardvault_agent.backup.captures import SavedCapture, ShardScan
from shardvault_agent.backup.hostcpu import OthersCores
from shardvault_agent.backup.limits import BackupLimits
from shardvault_agent.backup.mappedscreen import MappedScreener
from shardvault_agent.backup.scan import (
    DeltaReader,
    PackHasher,
    assemble_map,
    save_identities,
    scan_capture,
    write_fragment,
)
from shardvault_agent.backup.state import KEPT_CUT_SECONDS, BackupFiles
from shardvault_agent.backup.throttle import AdaptiveLimiter
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import BlockScreen, EngineAdapter
from shardvault_agent.keys import DataKeys
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.statefiles import write_json
from shardvault_agent.transfer import (
    PartSender,
    pack_object,
    read_range,
    stream_source,
    upload_object,
)
from shardvault_agent.wal.archiver import Archiver

log = logging.getLogger("shardvault.agent")

EXTENTS_BUDGET = 40_000  # per shard: about 10,000 scattered pages before they coarsen
ARCHIVE_WAIT_SECONDS = 600.0  # for the archive to record a tail's WAL (the Stop task beats)

ShardsNamed = Callable[[list[str]], list[ShardConfig]]
FetchPlain = Callable[[ParentMap, Path], Path]


class BackupCommands:
    """A node's backup commands. ``shards_named`` resolves a command's shard ids (refusing an
    unknown one); ``lock`` is the one lock per backup that checkpoint, stop and release take;
    ``fetch_plain`` fetches a stored object whole (a parent's block map)."""

    def __init__(
        self,
        config: AgentConfig,
        engine: EngineAdapter,
        limiter: RateLimiter,
        sender: PartSender,
        keys: DataKeys,
        shards: Callable[[], dict[str, ShardConfig]],
        shards_named: ShardsNamed,
        lock: Callable[[str], threading.Lock],
        fetch_plain: FetchPlain,
    ) -> None:
        self.config, self.engine, self.sender, self.keys = config, engine, sender, keys
        self._shards, self._lock, self._fetch_plain = shards_named, lock, fetch_plain
        self.files = BackupFiles(config, engine)
        self.cut_lock = threading.Lock()
        self.limits = BackupLimits(config, engine, limiter, self.files, shards)
        # Idle cores a pack may borrow (shardvault.data.pipeline), none the database is using.
        self.spare = SpareCores(others=OthersCores())
        # The helper that reads screened ranges through a mapping (backup.mappedscreen).
        self.mapped = MappedScreener()
        # The WAL archiver (set by the daemon when a shard archives): a tail that refers to
        # the archive waits for it (``_archived_tails``).
        self.archiver: Archiver | None = None

    def _listed(self, backup_id: str, phase: Phase, shard_id: str) -> ListedShard:
        capture = self.files.load_capture(backup_id, shard_id, phase)
        return ListedShard(
            shard_id=shard_id,
            files=pack_files(capture.files),
            marker=capture.marker,
            checkpoint_at=capture.checkpoint_at,
            mutable=capture.mutable,
            bytes=capture.bytes,
        )

    def _listing(self, backup_id: str, phase: Phase, shards: list[ShardConfig]) -> Listing:
        listed = [self._listed(backup_id, phase, shard.shard_id) for shard in shards]
        return Listing(node_id=self.config.node_id, shards=listed)

    def do_flush(self, args: FlushArgs) -> Flushed:
        shards = self._shards(args.shard_ids)
        for shard in shards:
            self.engine.flush(shard)
        return Flushed(node_id=self.config.node_id, flushed=[s.shard_id for s in shards])

    def do_checkpoint(self, args: CheckpointArgs) -> Listing:
        """Takes each shard's checkpoint, then, when the command names the parents, scans it
        (one round trip). Without ``parents`` it answers with the listing alone: a backup of
        more nodes than a Map runs at once scans in a Scan step apart. With ``flush`` (a
        backup of this node alone) it flushes each shard first, as the Flush command would
        have, unless the engine's checkpoint flushes itself (``checkpoint_flushes``). With
        ``stop`` (an incremental of this node alone) it also ends the backup and packs the
        tail once every changed block is packed, as the Stop command would have (``stopped``
        in the answer); a change too large to pack at the scan is stopped by the Stop
        command, after the Upload map has read it."""
        backup_id, shards = args.backup_id, self._shards(args.shard_ids)
        with self._lock(backup_id):
            self.files.refuse_released(backup_id)
            self.files.save_limits(backup_id, args.upload)
            self.files.save_encryption(backup_id, args.encryption)
            for shard in shards:
                self._take_checkpoint(backup_id, shard, args.flush, args.archived_tails)
            self.limits.of(backup_id)  # an adaptive throttle's baseline comes before the reads
            if args.parents is None:
                return self._listing(backup_id, Phase.DATA, shards)
            listing = self._scanned(backup_id, shards, args.parents, args.pack)
            if args.stop is None or any(s.packed is None for s in listing.shards):
                return listing
            assert args.pack is not None  # the model's rule: a stop comes with its pack
            # The cut's instant is now: this node is the backup's only one.
            cut = args.stop.cut.entered_at(datetime.now(UTC).isoformat())
            stopped = self._stopped(backup_id, shards, cut, args.pack)
            return listing.model_copy(update={"stopped": stopped})

    def _take_checkpoint(
        self, backup_id: str, shard: ShardConfig, flush: bool, archived_tails: bool
    ) -> None:
        """Takes and saves one shard's checkpoint, unless a command this retries took it."""
        # A retried command: the checkpoint is held, or was already stopped (by this
        # command's ``stop``; an engine holds nothing after its stop). Taken again, the data
        # would be read after the stop and paired with the first tail.
        taken = self.engine.holds(shard, backup_id) or self.files.stopped_before(
            backup_id, shard.shard_id
        )
        if taken and self.files.capture_path(backup_id, shard.shard_id, Phase.DATA).exists():
            return
        # Taken (again): what a lost checkpoint's scan saved describes other files.
        self.files.discard_scan(backup_id, shard.shard_id)
        if flush and not self.engine.checkpoint_flushes:
            self.engine.flush(shard)
        at = time.time()
        capture = self.engine.checkpoint(
            shard, backup_id, self.files.backup_dir(backup_id), log_archived=archived_tails
        )
        self.files.save_capture(backup_id, shard.shard_id, Phase.DATA, capture, at)

    def parent_map(self, shard_id: str, parent: ParentMap | None) -> Path | None:
        """The parent's block map: the cached file when its CRC64NVME is the plaintext CRC the
        manifest records for the map (its frames'), else fetched from the store and decoded
        through the pipeline. The cache is read whole to be checked: correctness never
        depends on it. None: no parent (a full)."""
        if parent is None:
            return None
        path = self.files.cached_map(shard_id, parent.backup_id)
        obj = parent.object
        spans = frame_spans(unpack_frames(obj.frames), obj.frame_size, obj.length)
        if path.exists():
            with open(path, "rb") as cached:
                if crc64nvme_of_stream(cached) == plaintext_crc(spans):
                    return path
        fetched = self._fetch_plain(parent, path.with_suffix(".fetching"))
        return fetched.replace(path)

    def do_scan(self, args: ScanArgs) -> Listing:
        """Hashes every block of each shard's capture into this backup's block map and
        compares it with the parent's; returns the listings with each shard's changed extents
        (packed, coarsened to fit) and what the scan read and took."""
        backup_id, shards = args.backup_id, self._shards(args.shard_ids)
        with self._lock(backup_id):
            self.files.refuse_released(backup_id)
            return self._scanned(backup_id, shards, args.parents, args.pack, map_with_data=False)

    def _scanned(
        self,
        backup_id: str,
        shards: list[ShardConfig],
        parents: dict[str, ParentMap],
        pack: PackSpec | None = None,
        map_with_data: bool = True,
    ) -> Listing:
        limiter, _ = self.limits.of(backup_id)
        listed = []
        for shard in shards:
            parent = parents.get(shard.shard_id)
            scan = self._scan_shard(backup_id, shard.shard_id, parent, limiter, map_with_data)
            listing = self._listed(backup_id, Phase.DATA, shard.shard_id)
            listed.append(listing.model_copy(update=scan.model_dump()))
            if not scan.is_full:
                log.info(
                    "%s: scanned shard %s in %.3f s: %d bytes changed",
                    backup_id, shard.shard_id, scan.scan_seconds, scan.delta_bytes,
                )  # fmt: skip
        scanned = Listing(node_id=self.config.node_id, shards=listed)
        return self._pack_listed(backup_id, scanned, pack, Phase.DATA) if pack else scanned

    def _pack_listed(
        self, backup_id: str, listing: Listing, pack: PackSpec, phase: Phase
    ) -> Listing:
        """Packs this node's objects of ``phase`` (with the block maps its answer announces)
        right after the command that listed them: an incremental's changes at its scan
        (``shardvault.backup.scanning``), every tail at its stop. They are cut as the control
        plane cuts them, and each is listed with its checksums in its shard's answer
        (``packed``). Not a full's data (packed in the Upload map, several at a time), nor
        more objects than the Upload map holds on this node at once: the disk holds no more
        packed bytes than it would have.
        Every shard of an answer packed has ``packed`` (empty when it changed nothing)."""
        started = time.monotonic()
        if phase == Phase.DATA and any(s.delta_bytes is None for s in listing.shards):
            return listing
        # The plan step's own listings of this answer: the objects are the ones it will plan.
        listings = listings_from_results([listing], phase) + blockmap_listings([listing])
        objects = plan_objects(backup_id=backup_id, listings=listings, **pack.model_dump())
        if not objects or len(objects) > OBJECTS_IN_FLIGHT_PER_NODE:
            return listing
        with ThreadPoolExecutor(len(objects)) as pool:
            sums = list(pool.map(self._packed, objects))
        packed = [
            shard.model_copy(
                update={
                    "packed": [
                        PackedObject(object=item, checksums=checksums)
                        for item, checksums in zip(objects, sums, strict=True)
                        if item.shard_id == shard.shard_id
                    ]
                }
            )
            for shard in listing.shards
        ]
        seconds = time.monotonic() - started
        log.info("%s: packed %d %s objects in %.3f s", backup_id, len(objects), phase, seconds)
        return listing.model_copy(update={"shards": packed})

    def _scan_shard(
        self,
        backup_id: str,
        shard_id: str,
        parent: ParentMap | None,
        limiter: RateLimiter,
        map_with_data: bool,
    ) -> ShardScan:
        if (retried := self.files.saved_scan(backup_id, shard_id)) is not None:
            return retried  # a retried scan answers as the first did
        saved = self.files.scan_path(backup_id, shard_id)
        parent_path = self.parent_map(shard_id, parent)
        capture = self.files.load_capture(backup_id, shard_id, Phase.DATA)
        # Identities are judged against the checkpoint's time, for engines that trust them.
        trusted = capture.checkpoint_at if capture.trust_identity else None
        if parent is None or parent_path is None:  # a full: its packs hash the whole stream
            hashes_dir = self.files.hashes_dir(backup_id, shard_id)
            save_identities(hashes_dir, capture.root, capture.files, trusted)
            full = ShardScan(extents="", delta_bytes=None, scan_seconds=None)
            full.save(saved)
            return full
        screen = parent_screen(self.engine, self.config.node_id, capture.marker, parent)
        with BlockMap(parent_path) as parent_blocks:
            scan = scan_capture(
                capture.root, capture.files, limiter, parent_blocks,
                self.files.map_path(backup_id, shard_id),
                trusted_before=trusted, screen=screen, mapped=self.mapped,
            )  # fmt: skip
        if scan.screened_bytes:
            log.info(
                "%s: shard %s: %d bytes proven unchanged by their headers, %d bytes judged "
                "through a mapping",
                backup_id, shard_id, scan.screened_bytes, scan.mapped_bytes,
            )  # fmt: skip
        packed, extents = pack_within(scan.extents, EXTENTS_BUDGET)
        where_the_map_goes = (
            # The scan wrote the map: it is uploaded with the data.
            {"blockmap_bytes": self.files.map_path(backup_id, shard_id).stat().st_size}
            if map_with_data
            else {"map_with_tail": True}
        )
        answer = ShardScan(
            extents=packed,
            delta_bytes=sum(n for _, n in extents),
            scan_seconds=scan.scan_seconds,
            unchanged_bytes=scan.unchanged_bytes,
            screened_bytes=scan.screened_bytes,
            parent_id=parent.backup_id,
            **where_the_map_goes,
        )
        answer.save(saved)
        return answer

    def do_stop(self, args: StopArgs) -> Listing:
        backup_id, shards = args.backup_id, self._shards(args.shard_ids)
        with self._lock(backup_id):
            self.files.refuse_released(backup_id)
            return self._stopped(backup_id, shards, args.cut, args.pack)

    def do_cut(self, args: CutArgs) -> CutAnswer:
        """A scheduled cut (``shardvault.backup.cuts``): the restore point on each shard at the
        cut's instant, side by side, each answered once it is on disk. A redelivered command
        answers the points already made (``BackupFiles.saved_cut``)."""
        cut_id, shards = args.backup_id, self._shards(args.shard_ids)

        def cut(shard: ShardConfig) -> CutShard:
            marker = self.files.saved_cut(cut_id, shard.shard_id)
            if marker is None:
                marker = self.engine.cut(shard, args.cut)
                self.files.save_cut(cut_id, shard.shard_id, marker)
            return CutShard(shard_id=shard.shard_id, marker=marker)

        with self.cut_lock:  # one cut at a time: a redelivered one finds the first's markers
            self.files.forget_cuts(time.time() - KEPT_CUT_SECONDS)
            with ThreadPoolExecutor(max_workers=max(1, len(shards))) as pool:
                answers = [f.result() for f in [pool.submit(cut, s) for s in shards]]
        return CutAnswer(node_id=self.config.node_id, shards=answers)

    def _stopped(
        self,
        backup_id: str,
        shards: list[ShardConfig],
        cut: CutRequest | None,
        pack: PackSpec | None,
    ) -> Listing:
        """Ends each shard's backup (cut at ``cut``'s instant), lists the tails and packs them
        (``pack``); the caller holds the backup's lock."""

        def stop(shard: ShardConfig) -> None:
            if self.files.stopped_before(backup_id, shard.shard_id):
                return  # a retried stop: this shard's tail is captured
            capture = self.engine.stop(shard, backup_id, self.files.backup_dir(backup_id), cut)
            self.files.save_capture(backup_id, shard.shard_id, Phase.TAIL, capture, time.time())

        # Side by side: each shard ends its backup, then all cut at the one instant.
        with ThreadPoolExecutor(max_workers=max(1, len(shards))) as pool:
            for future in [pool.submit(stop, shard) for shard in shards]:
                future.result()
        self._archived_tails(backup_id, shards)
        tails = [self._tail_listed(backup_id, shard.shard_id) for shard in shards]
        listing = Listing(node_id=self.config.node_id, shards=tails)
        return self._pack_listed(backup_id, listing, pack, Phase.TAIL) if pack else listing

    def _tail_listed(self, backup_id: str, shard_id: str) -> ListedShard:
        """A shard's tail, with the block map when it goes with the tail: a full's, joined
        from its packs' hashes now. An incremental's went with the data (its scan wrote it)."""
        listed = self._listed(backup_id, Phase.TAIL, shard_id)
        if not self.files.map_goes_with_tail(backup_id, shard_id):
            return listed
        block_map = self.files.map_path(backup_id, shard_id)
        if not block_map.exists():
            files = self.files.load_capture(backup_id, shard_id, Phase.DATA).files
            assemble_map(self.files.hashes_dir(backup_id, shard_id), files, block_map)
        return listed.model_copy(update={"blockmap_bytes": block_map.stat().st_size})

    def _archived_tails(self, backup_id: str, shards: list[ShardConfig]) -> None:
        """Waits until the archive has recorded the log each tail refers to instead of
        holding it (``archived_through`` in its marker: PostgreSQL's archived tail), so that
        Finalize finds it there; a retried stop waits again (nothing if it is stored)."""
        for shard in shards:
            marker = self.files.load_capture(backup_id, shard.shard_id, Phase.TAIL).marker
            if through := marker.get("archived_through"):
                # The daemon tells the engine which shards its archiver stores: only theirs
                # refer to the archive.
                assert self.archiver is not None
                started = time.monotonic()
                self.archiver.wait_archived(shard.shard_id, through, ARCHIVE_WAIT_SECONDS)
                log.info(
                    "backup %s: shard %s's WAL through %s is archived (waited %.2f s)",
                    backup_id,
                    shard.shard_id,
                    through,
                    time.monotonic() - started,
                )

    def do_release(self, args: ReleaseArgs) -> Released:
        """Releases everything held for the backup and leaves a tombstone, so that a
        checkpoint still in flight, or replayed after a restart, gives up instead of taking
        a checkpoint nobody will release. The lock makes release wait for such a checkpoint."""
        backup_id = args.backup_id
        tombstone = self.files.tombstone(backup_id)
        tombstone.parent.mkdir(parents=True, exist_ok=True)
        tombstone.touch()
        with self._lock(backup_id):
            for shard in self._shards(args.shard_ids):
                self.engine.release(shard, backup_id)
            self.files.remove(backup_id)
        self.limits.release(backup_id)
        return Released(node_id=self.config.node_id, released=True)

    def do_pack(self, args: PackArgs) -> ObjectChecksums:
        """Reads the object's range of the stream once, through the part pipeline (frames,
        zstd, sealing), into a packed copy; returns the stored bytes' checksums and the frame
        table. A retried pack returns what the first one packed: the URLs signed next are
        bound to those bytes."""
        item = args.object
        self.files.refuse_released(item.backup_id)
        try:
            return self._packed(item)
        finally:
            # Released meanwhile (the reaper's or the failure path's release removes the
            # directory under a pack, which may then fail): leave nothing, whatever it wrote.
            if self.files.released(item.backup_id):
                self.files.remove(item.backup_id)

    def _packed(self, item: ObjectPlan) -> ObjectChecksums:
        """The checksums of ``item``'s packed copy: packed before for this very plan (at the
        scan, or by a pack this retries), or packed now."""
        path = self.files.packed_path(item)
        summary = path.with_suffix(".json")
        if summary.exists() and path.exists():
            saved = json.loads(summary.read_text())
            if saved.get("object") == item.model_dump(mode="json"):
                return ObjectChecksums.model_validate(saved["checksums"])
        return self._pack(item, path, summary)

    def _pack(self, item: ObjectPlan, path: Path, summary: Path) -> ObjectChecksums:
        limiter, _ = self.limits.of(item.backup_id)
        capture = self._capture_of(item)
        sealer = self.keys.sealer(self.files.encryption(item.backup_id))
        codec = FrameCodec(item.compression, sealer, cores=self.spare.cores)
        path.parent.mkdir(parents=True, exist_ok=True)
        unfinished = path.with_suffix(".partial")
        source, hasher = self._source(item, capture, limiter), self._hasher(item, capture, limiter)
        with open(unfinished, "wb") as out:
            read = hasher.tap(source) if hasher else source
            packed = pack_object(item, read, codec, out, self.spare)
        if hasher is not None:  # kept before the summary: a pack with a summary has its hashes
            hashes = self.files.hashes_dir(item.backup_id, item.shard_id)
            write_fragment(hashes, item.stream_offset, item.length, hasher.fragment())
        sums = ObjectChecksums(
            key=item.key,
            parts=packed.parts,
            crc64nvme=packed.crc64nvme,
            stored_length=packed.stored_length,
            frames=pack_frames(packed.frames),
            key_check=sealer.check if sealer else None,
            throttle=limiter.snapshot() if isinstance(limiter, AdaptiveLimiter) else None,
            held_log_bytes=self.limits.peak_held_log(item.backup_id),
            pack_cpu_seconds=round(packed.cpu_seconds, 4),
            frame_levels=dict(packed.levels),
        )
        unfinished.replace(path)
        if item.phase == Phase.BLOCKMAP:
            self.files.keep_map(item)
        saved = {"object": item.model_dump(mode="json"), "checksums": sums.model_dump(mode="json")}
        write_json(summary, saved)
        return sums

    def _hasher(
        self, item: ObjectPlan, capture: SavedCapture, limiter: RateLimiter
    ) -> PackHasher | None:
        """A full's data objects hash the blocks they read, for its block map."""
        if item.phase != Phase.DATA or not self.files.hashed_in_pack(item.backup_id, item.shard_id):
            return None
        read_at = partial(read_range, capture.root, capture.files, limiter=limiter)
        return PackHasher(capture.files, item.stream_offset, item.length, read_at)

    def _capture_of(self, item: ObjectPlan) -> SavedCapture:
        """What an object reads: a phase's capture, or the shard's block map file."""
        if item.phase != Phase.BLOCKMAP:
            return self.files.load_capture(item.backup_id, item.shard_id, item.phase)
        path = self.files.map_path(item.backup_id, item.shard_id)
        if not path.exists():
            raise CheckpointNotFound(
                f"this agent holds no block map of shard {item.shard_id} for {item.backup_id}.",
                fix="retry the backup (the agent may have been restarted or released it).",
            )
        files = [FileEntry(path=path.name, size=path.stat().st_size)]
        return SavedCapture(root=path.parent, files=files, checkpoint_at=path.stat().st_mtime)

    def _source(
        self, item: ObjectPlan, capture: SavedCapture, limiter: RateLimiter
    ) -> Callable[[int], bytes]:
        """What an object holds: a range of its shard's stream, or, for an incremental's data,
        of its delta stream (the changed extents the scan found)."""
        root, files = capture.root, capture.files
        scan = self.files.saved_scan(item.backup_id, item.shard_id)
        packed = scan.extents if scan is not None else ""
        if item.phase == Phase.DATA and packed:
            changed = unpack_extents(packed)
            delta = DeltaReader(root, files, changed, item.stream_offset, item.length, limiter)
            return delta.read
        return stream_source(root, files, item.stream_offset, item.length, limiter)

    def do_upload(self, args: UploadArgs) -> Uploaded:
        """Sends the packed copy's parts that have a URL and are not yet stored."""
        item, sums = args.object, args.checksums
        urls = {p.part_number: p.url for p in args.parts}
        self.files.refuse_released(item.backup_id)  # a late command must not recreate its state
        # What was sent is recorded per upload: a multipart upload's id, or (a single PUT,
        # ``upload_id`` None) the object's key.
        record = self.files.sent_parts_path(item.backup_id, args.upload_id or item.key)
        record.parent.mkdir(parents=True, exist_ok=True)
        done = {p.part_number: p for p in _read_parts(record)}
        if all(p.part_number in done for p in sums.parts):  # a retried upload that had ended
            return Uploaded(parts=[done[n] for n in sorted(done)])
        packed = self.files.packed_path(item)
        if not packed.exists():
            raise CheckpointNotFound(
                f"this agent holds no packed copy of {item.key} for backup {item.backup_id}.",
                fix="retry the backup (the agent's state_dir was lost or released).",
            )
        limiter, parallelism = self.limits.of(item.backup_id)

        def open_part(part: PartChecksum) -> BinaryIO:
            try:
                handle = open(packed, "rb")  # noqa: SIM115 (closed by _Limited's with)
            except FileNotFoundError:
                # Released between two tries (the failure path of another node's part): say
                # so, rather than retry a copy that is gone and blame the network.
                self.files.refuse_released(item.backup_id)
                raise
            handle.seek((part.part_number - 1) * item.part_size)
            return _Limited(handle, part.size, limiter)

        def on_part(part: UploadedPart) -> None:
            with record.open("a") as out:
                out.write(part.model_dump_json() + "\n")

        try:
            uploaded = upload_object(
                item.key, sums.parts, urls, open_part, self.sender, parallelism, done, on_part
            )
        finally:
            if self.files.released(item.backup_id):
                # Released while this upload ran: leave nothing behind that release removed.
                self.files.remove(item.backup_id)
        if len(uploaded) == len(sums.parts):  # all stored: the copy is not needed again
            packed.unlink(missing_ok=True)
        return Uploaded(parts=uploaded)


def parent_screen(
    engine: EngineAdapter, node_id: str, marker: dict[str, str], parent: ParentMap
) -> BlockScreen | None:
    """The engine's block screen against ``parent`` (``scan``: it reads only the headers of
    blocks it can vouch for), for a parent this node made: a device and inode name a file on
    one host only. None for a parent of another node."""
    if parent.node_id != node_id:
        return None
    return engine.block_screen(marker, parent.marker)


def _read_parts(path: Path) -> list[UploadedPart]:
    if not path.exists():
        return []
    return [
        UploadedPart.model_validate_json(line)
        for line in path.read_text().splitlines()
        if line.strip()
    ]


class _Limited:
    """``size`` bytes of an open file from where it stands, whose reads pay the rate limiter
    (a packed copy's bytes count like the source's)."""

    def __init__(self, handle: BinaryIO, size: int, limiter: RateLimiter) -> None:
        self.handle, self.remaining, self.limiter = handle, size, limiter

    def read(self, size: int = -1) -> bytes:
        want = self.remaining if size < 0 else min(size, self.remaining)
        data = self.handle.read(want)
        self.remaining -= len(data)
        self.limiter.take(len(data))
        return data

    def __enter__(self) -> _Limited:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()
