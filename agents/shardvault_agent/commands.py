"""The commands an agent runs for the state machines, each idempotent.

``Commands.run`` is the wire: it takes a command's arguments as the inbox item holds them
(JSON), reads them into the command's model (``shardvault.contracts.commands``), runs the
command's handler (``do_<name>``, which takes that model and answers with its result model)
and sends the answer back as JSON. A listing command's answer goes through its answer URL.

A backup's *captures* and *scans* (``captures``) are kept under
``state_dir/backups/<backup_id>/``; release deletes that directory. Uploaded parts are
recorded as they finish, so a retried upload sends only the parts still missing.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import cached_property, partial
from pathlib import Path
from typing import Any, BinaryIO

import boto3

from shardvault.contracts.commands import (
    Aborted,
    AbortRestoreArgs,
    AnswerReceipt,
    CheckpointArgs,
    CommandResult,
    DownloadArgs,
    Downloaded,
    Finished,
    FinishRestoreArgs,
    FlushArgs,
    Flushed,
    ListedShard,
    Listing,
    ListingArgs,
    PackArgs,
    PackedObject,
    PackSpec,
    ParentMap,
    Prepared,
    PrepareRestoreArgs,
    ProbeArgs,
    Probed,
    ReleaseArgs,
    Released,
    ScanArgs,
    StopArgs,
    UploadArgs,
    Uploaded,
    parse_args,
)
from shardvault.contracts.cut import CutRequest
from shardvault.contracts.extents import pack_within, unpack_extents
from shardvault.contracts.models import (
    Encryption,
    FileEntry,
    ObjectChecksums,
    ObjectPlan,
    PartChecksum,
    Phase,
    UploadedPart,
    UploadLimits,
    pack_files,
)
from shardvault.data.checksums import crc64nvme_of_bytes, crc64nvme_of_stream
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
from shardvault.errors import (
    BackupReleased,
    CheckpointNotFound,
    InvalidRequest,
    StoreObjectDamaged,
    UnknownCommand,
)
from shardvault_agent.backup.blockmap import BlockMap
from shardvault_agent.backup.captures import SavedCapture, ShardScan
from shardvault_agent.backup.hostcpu import OthersCores
from shardvault_agent.backup.mappedscreen import MappedScreener
from shardvault_agent.backup.scan import (
    DeltaReader,
    PackHasher,
    assemble_map,
    save_identities,
    scan_capture,
    write_fragment,
)
from shardvault_agent.backup.sourceguard import SourceGuard
from shardvault_agent.backup.throttle import (
    AdaptiveLimiter,
    LatencySignal,
    Signal,
    StallSignal,
    pressure_files,
)
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import BlockScreen, Capture, EngineAdapter
from shardvault_agent.keys import DataKeys
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.restore import Restorer
from shardvault_agent.statefiles import write_json
from shardvault_agent.transfer import (
    Downloader,
    PartSender,
    inlined,
    pack_object,
    read_range,
    stream_source,
    upload_object,
)
from shardvault_agent.wal.archiver import Archiver

log = logging.getLogger("shardvault.agent")

EXTENTS_BUDGET = 40_000  # per shard: about 10,000 scattered pages before they coarsen
KEPT_MAPS = 2  # block maps kept per shard: the newest backup's, and the one before
ARCHIVE_WAIT_SECONDS = 600.0  # for the archive to record a tail's WAL (the Stop task beats)


class Commands:
    def __init__(
        self,
        config: AgentConfig,
        engine: EngineAdapter,
        limiter: RateLimiter,
        sender: PartSender,
        keys: DataKeys | None = None,
    ) -> None:
        self.config, self.engine, self.limiter, self.sender = config, engine, limiter, sender
        self.keys = keys or DataKeys(lambda: boto3.client("kms"))
        self.locks: dict[str, threading.Lock] = {}
        self.locks_guard = threading.Lock()
        self.backup_limiters: dict[str, RateLimiter] = {}
        self.guards: dict[str, SourceGuard] = {}
        # Idle cores a pack may borrow (shardvault.data.pipeline), none the database is using.
        self.spare = SpareCores(others=OthersCores())
        # The helper that reads screened ranges through a mapping (backup.mappedscreen).
        self.mapped = MappedScreener()
        # The WAL archiver (set by the daemon when a shard archives): a tail that refers to
        # the archive waits for it (``_archived_tails``).
        self.archiver: Archiver | None = None

    @cached_property
    def restorer(self) -> Restorer:
        downloader = Downloader(self.sender.http, self.config.part_attempts, self.limiter)
        return Restorer(self.config, self.engine, downloader, self.keys)

    def run(self, name: str, wire_args: dict[str, Any]) -> dict[str, Any]:
        """Runs command ``name`` on its arguments as the inbox item holds them; its answer as
        the task result holds it (a listing command's: the receipt of its answer)."""
        handler: Callable[[Any], CommandResult] | None = getattr(self, f"do_{name}", None)
        if handler is None:
            raise UnknownCommand(
                f"command {name!r} is unknown to this agent.", fix="upgrade the agent."
            )
        args = parse_args(name, self._fetched_args(wire_args))
        # Only the fields the handler set: a listing not scanned must not look scanned
        # (``shardvault.backup.planner.check_scanned``).
        answer = handler(args).model_dump(mode="json", exclude_unset=True)
        if isinstance(args, ListingArgs):
            return self._hand_answer(name, args.answer_url, answer)
        return answer

    def _hand_answer(self, command: str, url: str, answer: dict[str, Any]) -> dict[str, Any]:
        """Puts a listing command's answer in the work bucket through its URL and returns the
        receipt the task token carries (``shardvault.backup.answers``): a listing is too long
        for a task result."""
        body = json.dumps(answer, separators=(",", ":")).encode()
        self.sender.send_answer(url, body, f"the answer of {command}")
        receipt = AnswerReceipt(
            node_id=self.config.node_id,
            answer_bytes=len(body),
            answer_crc64nvme=crc64nvme_of_bytes(body),
        )
        return receipt.model_dump(mode="json")

    def _fetched_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """The command's arguments, those too large for its inbox item read from the store
        through their presigned URL (``shardvault.workflow.dispatch.work_args``)."""
        return inlined(self.restorer.downloader, args)

    # --- state on disk -------------------------------------------------------------------------
    @property
    def backups_dir(self) -> Path:
        return self.config.state_dir / "backups"

    def backup_dir(self, backup_id: str) -> Path:
        return self.backups_dir / backup_id

    def held_backups(self) -> set[str]:
        """Backups this node holds state of: its captures, and the engine's own (snapshots)."""
        captured = {p.name for p in self.backups_dir.glob("*") if p.is_dir()}
        return captured | self.engine.held_backups()

    def _capture_path(self, backup_id: str, shard_id: str, phase: Phase) -> Path:
        return self.backup_dir(backup_id) / f"{shard_id}.{phase}.json"

    def save_capture(
        self, backup_id: str, shard_id: str, phase: Phase, capture: Capture, at: float
    ) -> None:
        path = self._capture_path(backup_id, shard_id, phase)
        SavedCapture.taken(capture, at).save(path)

    def load_capture(self, backup_id: str, shard_id: str, phase: Phase) -> SavedCapture:
        path = self._capture_path(backup_id, shard_id, phase)
        what = f"{phase} capture of shard {shard_id} for backup {backup_id}"
        return SavedCapture.load(path, what)

    def _limits_path(self, backup_id: str) -> Path:
        return self.backup_dir(backup_id) / "upload-limits.json"

    def save_limits(self, backup_id: str, limits: UploadLimits | None) -> None:
        """Keeps the policy's upload limits the checkpoint command brought, for the backup's
        pack and upload commands (they survive an agent restart like the captures)."""
        kept = limits or UploadLimits()
        write_json(self._limits_path(backup_id), kept.model_dump(mode="json"))

    def limits(self, backup_id: str) -> tuple[RateLimiter, int]:
        """The rate limiter and the parts sent at once for a backup: the stricter of the
        policy's (sent with the checkpoint) and this agent's configuration. A backup has a
        limiter of its own, which checks its source guard before every read; with the
        policy's adaptive throttle, it steers under that cap (``throttle``)."""
        limits = self._upload_limits(backup_id)
        parallelism = min(self.config.upload_parallelism, limits.parallelism or sys.maxsize)
        with self.locks_guard:
            limiter = self.backup_limiters.get(backup_id)
        if limiter is not None:
            return limiter, parallelism
        # Made outside the lock (an adaptive one asks the server for its baseline), kept
        # under it. Release leaves its tombstone before it takes these away: a command that
        # passed its own check before the release must not make them again.
        adaptive = self._adaptive(backup_id, limits)
        floor = self._floor(backup_id, limits) if adaptive else 0.0
        made = self._backup_limiter(backup_id, limits, adaptive, floor)
        try:
            with self.locks_guard:
                self._refuse_released(backup_id)
                limiter = self.backup_limiters.setdefault(backup_id, made)
        finally:
            if self.backup_limiters.get(backup_id) is not made:
                self._close_limits(backup_id, made)
        return limiter, parallelism

    def _close_limits(self, backup_id: str, limiter: RateLimiter | None) -> None:
        """Stops a backup's controller, and its guard unless another limiter of the backup
        still reads through it."""
        if isinstance(limiter, AdaptiveLimiter):
            limiter.close()
        with self.locks_guard:
            kept = backup_id in self.backup_limiters
            guard = None if kept else self.guards.pop(backup_id, None)
        if guard is not None:
            guard.close()

    def _upload_limits(self, backup_id: str) -> UploadLimits:
        path = self._limits_path(backup_id)
        return (
            UploadLimits.model_validate_json(path.read_text()) if path.exists() else UploadLimits()
        )

    def _adaptive(self, backup_id: str, limits: UploadLimits) -> bool:
        """Whether the backup's reads are steered: ``adaptive``, or ``auto`` on a source in
        use (some shard's server has clients other than ShardVault's now, as its engine's
        probe sees them; an engine without a probe cannot tell, and reads static). Asked once,
        as the backup starts reading; a probe that fails counts as no client."""
        if limits.throttle != "auto":
            return limits.throttle == "adaptive"
        for shard in self.shards().values():
            probe = None
            try:
                probe = self.engine.health_probe(shard)
                if probe is not None and probe.ask():
                    log.info(
                        "backup %s: shard %s's source is in use: adaptive",
                        backup_id,
                        shard.shard_id,
                    )
                    return True
            except Exception as error:  # the throttle never fails a backup
                log.warning(
                    "backup %s: shard %s not asked for its clients: %s",
                    backup_id,
                    shard.shard_id,
                    error,
                )
            finally:
                if probe is not None:
                    probe.close()
        return False

    def _backup_limiter(
        self, backup_id: str, limits: UploadLimits, adaptive: bool, floor: float
    ) -> RateLimiter:
        """The backup's own bucket, charging the agent's (its cap is shared by all)."""
        guard = self._guard(backup_id, limits)
        rate, own = limits.rate_limit_bytes_per_second, self.config.rate_limit_bytes_per_second
        if adaptive:
            ceiling = min((r for r in (rate, own) if r is not None), default=None)
            return AdaptiveLimiter(
                floor, ceiling, self._throttle_signals, guard=guard.check, parent=self.limiter
            )
        stricter = rate if rate is not None and (own is None or rate < own) else None
        return RateLimiter(stricter, parent=self.limiter, guard=guard.check)

    def _guard(self, backup_id: str, limits: UploadLimits) -> SourceGuard:
        """What the backup holds of its shards' log, watched from now until its release."""
        shards = list(self.shards().values())
        with self.locks_guard:
            guard = self.guards.get(backup_id)
            if guard is None:
                guard = SourceGuard(
                    backup_id,
                    lambda: [h for s in shards if (h := self.engine.held_log(s, backup_id))],
                    limits.max_held_log_bytes,
                    limits.min_source_free_percent,
                )
                self.guards[backup_id] = guard
        return guard

    def _floor(self, backup_id: str, limits: UploadLimits) -> float:
        """An adaptive backup's floor: the rate that reads the node's captured data once
        within the policy's window, and no less than the policy's floor."""
        captured = [
            self.load_capture(backup_id, shard_id, Phase.DATA)
            for shard_id in self.shards()
            if self._capture_path(backup_id, shard_id, Phase.DATA).exists()
        ]
        data_bytes = sum(capture.bytes for capture in captured)
        window = limits.throttle_window_seconds
        return max(limits.throttle_floor_bytes_per_second or 1, data_bytes / window)

    def _throttle_signals(self) -> list[Signal]:
        """The CPU and IO stall of the first shard's server's cgroup (one server per node is
        the rule; else the host's), and each shard's probe. A probe that cannot take its
        baseline is left out (its session closed): the other signals still steer."""
        cfg, shards = self.config, list(self.shards().values())
        pid = next((p for s in shards if (p := self.engine.server_pid(s))), None)
        signals: list[Signal] = [
            StallSignal(f"{resource} stall", path, cfg.throttle_stall_margin, time.monotonic)
            for resource, path in pressure_files(pid).items()
            if path.exists()
        ]
        slack = cfg.throttle_latency_slack_ms / 1000
        for shard in shards:
            if (probe := self.engine.health_probe(shard)) is None:
                continue
            name = f"{shard.shard_id} latency"
            try:
                signals.append(LatencySignal(name, probe, cfg.throttle_latency_ratio, slack))
            except Exception as error:
                probe.close()
                log.warning("throttle: no %s signal: %s", name, error)
        return signals

    def _encryption_path(self, backup_id: str) -> Path:
        return self.backup_dir(backup_id) / "encryption.json"

    def save_encryption(self, backup_id: str, encryption: Encryption | None) -> None:
        """Keeps the backup's wrapped data key (never the key itself) for its pack commands."""
        path = self._encryption_path(backup_id)
        if encryption:
            write_json(path, encryption.model_dump(mode="json"))
        else:
            path.unlink(missing_ok=True)

    def encryption(self, backup_id: str) -> Encryption | None:
        path = self._encryption_path(backup_id)
        return Encryption.model_validate_json(path.read_text()) if path.exists() else None

    def shards(self) -> dict[str, ShardConfig]:
        """The shards this node holds: its configuration's, and those it restored and adopted
        (a configured shard of the same id wins)."""
        adopted = self.restorer.adopted_shards() if self.config.restore_dir else []
        return {s.shard_id: s for s in [*adopted, *self.config.shards]}

    def _shards(self, shard_ids: list[str]) -> list[ShardConfig]:
        shards = self.shards()
        missing = [s for s in shard_ids if s not in shards]
        if missing:
            raise InvalidRequest(
                f"node {self.config.node_id} has no shard {', '.join(missing)}.",
                fix="check the agent config; the registry and the config disagree.",
            )
        return [shards[s] for s in shard_ids]

    def _listed(self, backup_id: str, phase: Phase, shard_id: str) -> ListedShard:
        capture = self.load_capture(backup_id, shard_id, phase)
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

    # --- commands ------------------------------------------------------------------------------
    def do_probe(self, args: ProbeArgs) -> Probed:
        """``shardvault check``'s round trip (``shardvault.assurance.probe``): puts the probe's
        bytes through their checksum-bound URL and reads them back through the other, as a backup's
        parts and a restore's ranges go."""
        body = base64.b64decode(args.body)
        started = time.monotonic()
        self.sender.send_probe(args.put_url, body, args.crc64nvme)
        stored = time.monotonic()
        read = bytearray(len(body))

        def write(position: int, chunk: bytes) -> None:
            read[position : position + len(chunk)] = chunk

        self.restorer.downloader.fetch(args.get_url, "the probe object", 0, len(body), write)
        if bytes(read) != body:
            raise StoreObjectDamaged(
                "the probe object read back differs from the bytes this node put.",
                fix="check what stands between this node and the store (a proxy that rewrites "
                "bodies, a cache); backups from this node cannot be trusted until it is fixed.",
            )
        return Probed(
            node_id=self.config.node_id,
            put_seconds=round(stored - started, 3),
            get_seconds=round(time.monotonic() - stored, 3),
        )

    def do_flush(self, args: FlushArgs) -> Flushed:
        shards = self._shards(args.shard_ids)
        for shard in shards:
            self.engine.flush(shard)
        return Flushed(node_id=self.config.node_id, flushed=[s.shard_id for s in shards])

    def _tombstone(self, backup_id: str) -> Path:
        return self.config.state_dir / "released" / backup_id

    def _refuse_released(self, backup_id: str) -> None:
        if self._tombstone(backup_id).exists():
            raise BackupReleased(
                f"backup {backup_id} was already released on this node.",
                fix="nothing to do: that backup has ended; start a new one.",
            )

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
            self._refuse_released(backup_id)
            self.save_limits(backup_id, args.upload)
            self.save_encryption(backup_id, args.encryption)
            for shard in shards:
                self._take_checkpoint(backup_id, shard, args.flush, args.archived_tails)
            self.limits(backup_id)  # an adaptive throttle's baseline comes before the reads
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
        taken = self.engine.holds(shard, backup_id) or self._stopped_before(
            backup_id, shard.shard_id
        )
        if taken and self._capture_path(backup_id, shard.shard_id, Phase.DATA).exists():
            return
        # Taken (again): what a lost checkpoint's scan saved describes other files.
        self._discard_scan(backup_id, shard.shard_id)
        if flush and not self.engine.checkpoint_flushes:
            self.engine.flush(shard)
        at = time.time()
        capture = self.engine.checkpoint(
            shard, backup_id, self.backup_dir(backup_id), log_archived=archived_tails
        )
        self.save_capture(backup_id, shard.shard_id, Phase.DATA, capture, at)

    def _stopped_before(self, backup_id: str, shard_id: str) -> bool:
        return self._capture_path(backup_id, shard_id, Phase.TAIL).exists()

    # --- scan (incrementals; see scan.py) -------------------------------------------------------
    def _map_path(self, backup_id: str, shard_id: str) -> Path:
        return self.backup_dir(backup_id) / f"{shard_id}.map"

    def _extents_path(self, backup_id: str, shard_id: str) -> Path:
        return self.backup_dir(backup_id) / f"{shard_id}.extents.json"

    def _hashes_dir(self, backup_id: str, shard_id: str) -> Path:
        """A full's hash fragments, one per data object (``scan.PackHasher``)."""
        return self.backup_dir(backup_id) / "hashes" / shard_id

    def _discard_scan(self, backup_id: str, shard_id: str) -> None:
        """Removes a shard's scan answer, block map, hash fragments (with the identities
        beside them) and packed copies: they belong to one capture, and a checkpoint taken
        again replaces it. A packed copy is reused for an identical object plan, and a lost
        capture's plan can be identical (the same blocks changed) while its bytes are older
        than the new checkpoint's start."""
        self._extents_path(backup_id, shard_id).unlink(missing_ok=True)
        self._map_path(backup_id, shard_id).unlink(missing_ok=True)
        shutil.rmtree(self._hashes_dir(backup_id, shard_id), ignore_errors=True)
        for summary in self._packed_dir(backup_id).glob("*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                if json.loads(summary.read_text())["object"]["shard_id"] == shard_id:
                    summary.with_suffix(".bin").unlink(missing_ok=True)
                    summary.unlink(missing_ok=True)

    def _saved_scan(self, backup_id: str, shard_id: str) -> ShardScan | None:
        return ShardScan.load(self._extents_path(backup_id, shard_id))

    def _hashed_in_pack(self, backup_id: str, shard_id: str) -> bool:
        """A full (its scan found no parent: every byte is sent) has its block map made of
        its packs' hashes, not by a scan."""
        scan = self._saved_scan(backup_id, shard_id)
        return scan is not None and scan.is_full

    def _map_goes_with_tail(self, backup_id: str, shard_id: str) -> bool:
        """A full's map (joined at Stop), or an incremental's scanned by a Scan command (its
        map is planned with the tail)."""
        scan = self._saved_scan(backup_id, shard_id)
        return scan is not None and (scan.is_full or scan.map_with_tail)

    def cached_map(self, shard_id: str, backup_id: str) -> Path:
        """Where this node keeps the block map of a backup it made, for the next incremental."""
        return self.config.state_dir / "blockmaps" / shard_id / f"{backup_id}.map"

    def parent_map(self, shard_id: str, parent: ParentMap | None) -> Path | None:
        """The parent's block map: the cached file when its CRC64NVME is the plaintext CRC the
        manifest records for the map (its frames'), else fetched from the store and decoded
        through the pipeline. The cache is read whole to be checked: correctness never
        depends on it. None: no parent (a full)."""
        if parent is None:
            return None
        path = self.cached_map(shard_id, parent.backup_id)
        obj = parent.object
        spans = frame_spans(unpack_frames(obj.frames), obj.frame_size, obj.length)
        if path.exists():
            with open(path, "rb") as cached:
                if crc64nvme_of_stream(cached) == plaintext_crc(spans):
                    return path
        fetched = self.restorer.fetch_object_plain(parent, path.with_suffix(".fetching"))
        return fetched.replace(path)

    def do_scan(self, args: ScanArgs) -> Listing:
        """Hashes every block of each shard's capture into this backup's block map and
        compares it with the parent's; returns the listings with each shard's changed extents
        (packed, coarsened to fit) and what the scan read and took."""
        backup_id, shards = args.backup_id, self._shards(args.shard_ids)
        with self._lock(backup_id):
            self._refuse_released(backup_id)
            return self._scanned(backup_id, shards, args.parents, args.pack, map_with_data=False)

    def _scanned(
        self,
        backup_id: str,
        shards: list[ShardConfig],
        parents: dict[str, ParentMap],
        pack: PackSpec | None = None,
        map_with_data: bool = True,
    ) -> Listing:
        limiter, _ = self.limits(backup_id)
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
        saved = self._extents_path(backup_id, shard_id)
        if (retried := ShardScan.load(saved)) is not None:  # a retried scan: the first answer
            return retried
        parent_path = self.parent_map(shard_id, parent)
        capture = self.load_capture(backup_id, shard_id, Phase.DATA)
        # Identities are judged against the checkpoint's time, for engines that trust them.
        trusted = capture.checkpoint_at if capture.trust_identity else None
        if parent is None or parent_path is None:  # a full: its packs hash the whole stream
            hashes_dir = self._hashes_dir(backup_id, shard_id)
            save_identities(hashes_dir, capture.root, capture.files, trusted)
            full = ShardScan(extents="", delta_bytes=None, scan_seconds=None)
            full.save(saved)
            return full
        screen = parent_screen(self.engine, self.config.node_id, capture.marker, parent)
        with BlockMap(parent_path) as parent_blocks:
            scan = scan_capture(
                capture.root, capture.files, limiter, parent_blocks,
                self._map_path(backup_id, shard_id),
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
            {"blockmap_bytes": self._map_path(backup_id, shard_id).stat().st_size}
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
            self._refuse_released(backup_id)
            return self._stopped(backup_id, shards, args.cut, args.pack)

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
            if self._stopped_before(backup_id, shard.shard_id):
                return  # a retried stop: this shard's tail is captured
            capture = self.engine.stop(shard, backup_id, self.backup_dir(backup_id), cut)
            self.save_capture(backup_id, shard.shard_id, Phase.TAIL, capture, time.time())

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
        if not self._map_goes_with_tail(backup_id, shard_id):
            return listed
        block_map = self._map_path(backup_id, shard_id)
        if not block_map.exists():
            files = self.load_capture(backup_id, shard_id, Phase.DATA).files
            assemble_map(self._hashes_dir(backup_id, shard_id), files, block_map)
        return listed.model_copy(update={"blockmap_bytes": block_map.stat().st_size})

    def _archived_tails(self, backup_id: str, shards: list[ShardConfig]) -> None:
        """Waits until the archive has recorded the log each tail refers to instead of
        holding it (``archived_through`` in its marker: PostgreSQL's archived tail), so that
        Finalize finds it there; a retried stop waits again (nothing if it is stored)."""
        for shard in shards:
            marker = self.load_capture(backup_id, shard.shard_id, Phase.TAIL).marker
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
        tombstone = self._tombstone(backup_id)
        tombstone.parent.mkdir(parents=True, exist_ok=True)
        tombstone.touch()
        with self._lock(backup_id):
            for shard in self._shards(args.shard_ids):
                self.engine.release(shard, backup_id)
            shutil.rmtree(self.backup_dir(backup_id), ignore_errors=True)
        with self.locks_guard:
            limiter = self.backup_limiters.pop(backup_id, None)
        self._close_limits(backup_id, limiter)
        return Released(node_id=self.config.node_id, released=True)

    def _lock(self, backup_id: str) -> threading.Lock:
        """One lock per backup: checkpoint, stop and release of a backup never overlap."""
        with self.locks_guard:
            return self.locks.setdefault(backup_id, threading.Lock())

    def _packed_dir(self, backup_id: str) -> Path:
        """The backup's packed copies (``.bin``) and their summaries (``.json``)."""
        return self.backup_dir(backup_id) / "packed"

    def _packed_path(self, item: ObjectPlan) -> Path:
        """The packed copy of an object (its stored bytes), until every part is uploaded."""
        digest = hashlib.sha256(item.key.encode()).hexdigest()[:24]
        return self._packed_dir(item.backup_id) / f"{digest}.bin"

    def do_pack(self, args: PackArgs) -> ObjectChecksums:
        """Reads the object's range of the stream once, through the part pipeline (frames,
        zstd, sealing), into a packed copy; returns the stored bytes' checksums and the frame
        table. A retried pack returns what the first one packed: the URLs signed next are
        bound to those bytes."""
        item = args.object
        self._refuse_released(item.backup_id)
        try:
            return self._packed(item)
        finally:
            # Released meanwhile (the reaper's or the failure path's release removes the
            # directory under a pack, which may then fail): leave nothing, whatever it wrote.
            if self._tombstone(item.backup_id).exists():
                shutil.rmtree(self.backup_dir(item.backup_id), ignore_errors=True)

    def _packed(self, item: ObjectPlan) -> ObjectChecksums:
        """The checksums of ``item``'s packed copy: packed before for this very plan (at the
        scan, or by a pack this retries), or packed now."""
        path = self._packed_path(item)
        summary = path.with_suffix(".json")
        if summary.exists() and path.exists():
            saved = json.loads(summary.read_text())
            if saved.get("object") == item.model_dump(mode="json"):
                return ObjectChecksums.model_validate(saved["checksums"])
        return self._pack(item, path, summary)

    def _pack(self, item: ObjectPlan, path: Path, summary: Path) -> ObjectChecksums:
        limiter, _ = self.limits(item.backup_id)
        capture = self._capture_of(item)
        sealer = self.keys.sealer(self.encryption(item.backup_id))
        codec = FrameCodec(level=item.compression_level, sealer=sealer)
        path.parent.mkdir(parents=True, exist_ok=True)
        unfinished = path.with_suffix(".partial")
        source, hasher = self._source(item, capture, limiter), self._hasher(item, capture, limiter)
        with open(unfinished, "wb") as out:
            read = hasher.tap(source) if hasher else source
            packed = pack_object(item, read, codec, out, self.spare)
        if hasher is not None:  # kept before the summary: a pack with a summary has its hashes
            hashes = self._hashes_dir(item.backup_id, item.shard_id)
            write_fragment(hashes, item.stream_offset, item.length, hasher.fragment())
        sums = ObjectChecksums(
            key=item.key,
            parts=packed.parts,
            crc64nvme=packed.crc64nvme,
            stored_length=packed.stored_length,
            frames=pack_frames(packed.frames),
            key_check=sealer.check if sealer else None,
            throttle=limiter.snapshot() if isinstance(limiter, AdaptiveLimiter) else None,
            held_log_bytes=guard.peak if (guard := self.guards.get(item.backup_id)) else None,
        )
        unfinished.replace(path)
        if item.phase == Phase.BLOCKMAP:
            self.keep_map(item)
        saved = {"object": item.model_dump(mode="json"), "checksums": sums.model_dump(mode="json")}
        write_json(summary, saved)
        return sums

    def _hasher(
        self, item: ObjectPlan, capture: SavedCapture, limiter: RateLimiter
    ) -> PackHasher | None:
        """A full's data objects hash the blocks they read, for its block map."""
        if item.phase != Phase.DATA or not self._hashed_in_pack(item.backup_id, item.shard_id):
            return None
        read_at = partial(read_range, capture.root, capture.files, limiter=limiter)
        return PackHasher(capture.files, item.stream_offset, item.length, read_at)

    def _capture_of(self, item: ObjectPlan) -> SavedCapture:
        """What an object reads: a phase's capture, or the shard's block map file."""
        if item.phase != Phase.BLOCKMAP:
            return self.load_capture(item.backup_id, item.shard_id, item.phase)
        path = self._map_path(item.backup_id, item.shard_id)
        if not path.exists():
            raise CheckpointNotFound(
                f"this agent holds no block map of shard {item.shard_id} for {item.backup_id}.",
                fix="retry the backup (the agent may have been restarted or released it).",
            )
        files = [FileEntry(path=path.name, size=path.stat().st_size)]
        return SavedCapture(root=path.parent, files=files, checkpoint_at=path.stat().st_mtime)

    def keep_map(self, item: ObjectPlan) -> None:
        """Keeps a packed block map for the next incremental (checked against the manifest
        before it is used: ``parent_map``); older ones go."""
        cache = self.cached_map(item.shard_id, item.backup_id)
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._map_path(item.backup_id, item.shard_id), cache.with_suffix(".tmp"))
        cache.with_suffix(".tmp").replace(cache)
        kept = sorted(cache.parent.glob("*.map"), key=lambda p: p.stat().st_mtime)
        for old in kept[:-KEPT_MAPS]:
            old.unlink(missing_ok=True)

    def _source(
        self, item: ObjectPlan, capture: SavedCapture, limiter: RateLimiter
    ) -> Callable[[int], bytes]:
        """What an object holds: a range of its shard's stream, or, for an incremental's data,
        of its delta stream (the changed extents the scan found)."""
        root, files = capture.root, capture.files
        scan = self._saved_scan(item.backup_id, item.shard_id)
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
        self._refuse_released(item.backup_id)  # a late command must not recreate its state
        # What was sent is recorded per upload: a multipart upload's id, or (a single PUT,
        # ``upload_id`` None) the object's key.
        digest = hashlib.sha256((args.upload_id or item.key).encode()).hexdigest()[:24]
        record = self.backup_dir(item.backup_id) / "uploads" / f"{digest}.jsonl"
        record.parent.mkdir(parents=True, exist_ok=True)
        done = {p.part_number: p for p in _read_parts(record)}
        if all(p.part_number in done for p in sums.parts):  # a retried upload that had ended
            return Uploaded(parts=[done[n] for n in sorted(done)])
        packed = self._packed_path(item)
        if not packed.exists():
            raise CheckpointNotFound(
                f"this agent holds no packed copy of {item.key} for backup {item.backup_id}.",
                fix="retry the backup (the agent's state_dir was lost or released).",
            )
        limiter, parallelism = self.limits(item.backup_id)

        def open_part(part: PartChecksum) -> BinaryIO:
            try:
                handle = open(packed, "rb")  # noqa: SIM115 (closed by _Limited's with)
            except FileNotFoundError:
                # Released between two tries (the failure path of another node's part): say
                # so, rather than retry a copy that is gone and blame the network.
                self._refuse_released(item.backup_id)
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
            if self._tombstone(item.backup_id).exists():
                # Released while this upload ran: leave nothing behind that release removed.
                shutil.rmtree(self.backup_dir(item.backup_id), ignore_errors=True)
        if len(uploaded) == len(sums.parts):  # all stored: the copy is not needed again
            packed.unlink(missing_ok=True)
        return Uploaded(parts=uploaded)

    # --- restore (``backup_id`` is the restore's id) -------------------------------------------
    def do_prepare_restore(self, args: PrepareRestoreArgs) -> Prepared:
        with self._lock(args.backup_id):
            return self.restorer.prepare(args)

    def do_download(self, args: DownloadArgs) -> Downloaded:
        return self.restorer.download(args)

    def do_finish_restore(self, args: FinishRestoreArgs) -> Finished:
        with self._lock(args.backup_id):
            return self.restorer.finish(args)

    def do_abort_restore(self, args: AbortRestoreArgs) -> Aborted:
        with self._lock(args.backup_id):
            return self.restorer.abort(args.backup_id)


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
