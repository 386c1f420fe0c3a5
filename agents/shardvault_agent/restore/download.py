"""Download: one object fetched into its shard's staged files (``Downloads``).

Every read is checked as it lands (each frame against its plaintext CRC64NVME, each format 1
part against its own) and noted in the object's record, so a retried or resumed download
fetches only what is missing; the object as a whole is checked against the manifest's
CRC64NVME. A damaged object fails the restore on this node for good: later downloads and
finish report the same error, so the restore ends with its real cause whatever order the
tasks end in.

*Chain objects*: an incremental's objects write only their placements (``objects``); a
layered chain's root writes its frames with the newer members' patches laid in
(``overlay``), so it waits for those (``refuse_early``).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardvault.contracts.commands import DownloadArgs, Downloaded, ParentMap
from shardvault.contracts.models import DownloadItem, unpack_files
from shardvault.data.checksums import combine, to_b64
from shardvault.data.pipeline import FrameCodec, FrameSink, Sealer, frame_spans, unpack_frames
from shardvault.data.streams import StreamIndex
from shardvault.errors import ChecksumMismatch, DownloadIncomplete, ShardVaultError
from shardvault_agent.config import AgentConfig
from shardvault_agent.keys import DataKeys
from shardvault_agent.restore.files import ShardFiles, start_writeback
from shardvault_agent.restore.objects import ChainPart, Placements
from shardvault_agent.restore.overlay import Overlay
from shardvault_agent.restore.places import LaidOut, Places
from shardvault_agent.restore.reads import RangeRead, fetch_range, planned_reads, written_ranges
from shardvault_agent.transfer import Downloader, SpoolReader

log = logging.getLogger("shardvault.agent.restore")


class Downloads:
    def __init__(
        self, config: AgentConfig, places: Places, downloader: Downloader, keys: DataKeys
    ) -> None:
        self.config, self.places, self.downloader, self.keys = config, places, downloader, keys
        # Each layered chain's overlay, shared by the downloads of its root's objects.
        self._overlays: dict[tuple[str, str], Overlay] = {}
        self._overlays_guard = threading.Lock()

    def download(self, args: DownloadArgs) -> Downloaded:
        """Fetches one object into its shard's staged files; a damaged one fails the restore
        on this node for good (the module docstring)."""
        item = args.object
        self.places.refuse_aborted(item.restore_id)
        self.places.raise_recorded_failure(item.restore_id)
        try:
            return self.land(item, args.url)
        except ShardVaultError as error:
            if not error.transient:
                self.places.record_failure(item.restore_id, error)
            raise

    def land(self, item: DownloadItem, url: str, from_spool: bool = False) -> Downloaded:
        """Answers ``bytes``: the bytes of the restored streams it supplied (the restore's
        progress; a layered chain's root writes more, which newer members' patches
        replace). ``from_spool``: a prefetched object, read from its spool (checked whole
        as it was fetched), whose frames that patch the root's stay there."""
        part = self._chain_part(item)
        record = self.places.object(item.restore_id, item.key)
        if record.is_written:
            return Downloaded(key=item.key, bytes=part.supplied, resumed=True)
        layout = self.places.layout(item.restore_id, item.shard_id)
        self.refuse_early(item, layout)
        staged = self.places.staging(item.restore_id, item.shard_id)
        files = ShardFiles(staged, StreamIndex(unpack_files(layout.stream(item.phase))))
        record.make_room()
        done = record.reads()
        sealer = self.sealer(item, layout)
        pieces = None if not item.from_chain else files.resolve(part.placements)  # opens files
        root_object = item.key in layout.patched_objects
        overlay = self._overlay(item.restore_id, item.shard_id, layout) if root_object else None
        spool = None
        if part.patches and not from_spool:  # its frames patch the root's: kept in its spool
            record.keep_item(item)
            spool = record.open_spool()
        frames = None if pieces is None else pieces.keys() | _patch_frames(part, from_spool)
        source = SpoolReader(record.spool) if from_spool else self.downloader
        reads = planned_reads(item, frames)
        todo = [r for r in reads if r.number not in done]
        if done:
            log.info("%s: resuming, %d of %d reads already here", item.key, len(done), len(reads))
        guard = threading.Lock()

        def fetch(read: RangeRead) -> None:
            self.places.refuse_aborted(item.restore_id)  # the reaper's abort: the next read
            crc = fetch_range(source, url, item, read, files, sealer, pieces, spool, overlay)
            for fd, offset, length in written_ranges(item, read, files, pieces):
                start_writeback(fd, offset, length)
            with guard:
                record.add_read(read.number, crc)
                done[read.number] = crc

        try:
            with ThreadPoolExecutor(max_workers=self.config.upload_parallelism) as pool:
                for future in [pool.submit(fetch, r) for r in todo]:
                    future.result()
        finally:
            files.close()  # durability comes at finish, once per shard (``files.sync_tree``)
            if spool is not None:
                os.close(spool)
            if self.places.aborted(item.restore_id).exists():  # aborted meanwhile: leave nothing
                shutil.rmtree(self.places.state(item.restore_id), ignore_errors=True)
        whole = combine((done[r.number], r.size) for r in reads) if reads else to_b64(0)
        if pieces is None and whole != item.crc64nvme:  # some frames only: each was checked
            record.forget_reads()  # a retry must fetch it all again
            raise ChecksumMismatch(
                f"object {item.key} of shard {item.shard_id} arrived with CRC64NVME {whole}; the "
                f"manifest says {item.crc64nvme}.",
                fix="the object is damaged or replaced in the store: restore another backup.",
            )
        record.mark_written()
        if from_spool and not part.patches:  # nothing of it is laid into the root's frames
            record.drop_spool()
        return Downloaded(key=item.key, bytes=part.supplied, resumed=len(todo) < len(reads))

    def _chain_part(self, item: DownloadItem) -> ChainPart:
        """What an object writes: a chain object's placements as prepare placed them, else
        the whole object from its stream offset."""
        if item.from_chain:
            return self.places.object(item.restore_id, item.key).chain_part()
        return ChainPart(Placements.of(), Placements.of(), item.length)

    def sealer(self, item: DownloadItem, layout: LaidOut) -> Sealer | None:
        # A WAL batch has its own data key; every other object, its shard's backup's.
        return self.keys.sealer(item.encryption or layout.encryption, item.key_check)

    def refuse_early(self, item: DownloadItem, layout: LaidOut) -> None:
        """A layered chain's root objects are written with the newer members' blocks laid in:
        a root object written before all of those have arrived would miss some. The state
        machine orders them (two download waves); this makes the order a checked rule."""
        if item.key not in layout.patched_objects:
            return
        missing = [
            key
            for key in layout.patch_objects
            if not self.places.object(item.restore_id, key).is_in
        ]
        if missing:
            raise DownloadIncomplete(
                f"object {item.key} of the full at the root of shard {item.shard_id}'s chain "
                f"came before {len(missing)} of the newer backups' objects, e.g. {missing[0]}, "
                "were in: it would be written without their blocks.",
                fix="the restore failed: start it again.",
            )

    # --- overlays -------------------------------------------------------------------------
    def _overlay(self, restore_id: str, shard_id: str, layout: LaidOut) -> Overlay:
        """The shard's overlay, opened once for the downloads of its root's objects."""

        def sealer_of(item: DownloadItem) -> Sealer | None:
            return self.keys.sealer(layout.encryption, item.key_check)

        with self._overlays_guard:
            overlay = self._overlays.get((restore_id, shard_id))
            if overlay is None:
                overlay = self._overlays[(restore_id, shard_id)] = Overlay(
                    self.places.patch_index(restore_id, shard_id),
                    lambda key: self.places.object(restore_id, key),
                    sealer_of,
                )
            return overlay

    def close_overlays(self, restore_id: str) -> None:
        with self._overlays_guard:
            for key in [k for k in self._overlays if k[0] == restore_id]:
                self._overlays.pop(key).close()

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


def _patch_frames(part: ChainPart, from_spool: bool) -> set[int]:
    """A chain object's frames that patch the root's, fetched into its spool (none from a
    spool: they are there already)."""
    return set() if from_spool else part.patches.frames
