"""The commands an agent runs for the backup state machine, each idempotent.

A *capture* (files, root, marker) is saved under ``state_dir/backups/<backup_id>/`` the
moment it is taken, so later commands (pack, upload, stop) and a retried command find
it; release deletes that directory. Uploaded parts are recorded as they finish, so a retried
upload sends only the parts still missing.
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

from shardvault.contracts.commands import Listing, parse_args
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
    ListingTooLarge,
    StoreObjectDamaged,
    UnknownCommand,
)
from shardvault_agent.archiver import Archiver
from shardvault_agent.blockmap import BlockMap
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import BlockScreen, Capture, EngineAdapter
from shardvault_agent.hostcpu import OthersCores
from shardvault_agent.keys import DataKeys
from shardvault_agent.mappedscreen import MappedScreener
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.restore import Restorer
from shardvault_agent.scan import (
    DeltaReader,
    PackHasher,
    assemble_map,
    save_identities,
    scan_capture,
    write_fragment,
)
from shardvault_agent.sourceguard import SourceGuard
from shardvault_agent.statefiles import write_json
from shardvault_agent.throttle import (
    AdaptiveLimiter,
    LatencySignal,
    Signal,
    StallSignal,
    pressure_files,
)
from shardvault_agent.transfer import (
    Downloader,
    PartSender,
    inlined,
    pack_object,
    read_range,
    stream_source,
    upload_object,
)

log = logging.getLogger("shardvault.agent")

MAX_LISTING_CHARS = 200_000  # an inline answer: room in the 256 KiB task result for the rest
EXTENTS_BUDGET = 40_000  # per shard: about 10,000 scattered pages before they coarsen
KEPT_MAPS = 2  # block maps kept per shard: the newest backup's, and the one before
ARCHIVE_WAIT_SECONDS = 600.0  # for the archive to record a tail's WAL (the Stop task beats)


def check_fits_task_result(result: dict[str, Any]) -> None:
    """An answer sent inline (a control plane that gives no answer URL) must fit in the task
    result: a listing too long for it is refused by name."""
    for shard in result.get("shards", []):
        packed = shard.get("files", "")  # a listing command's (finish_restore's have none)
        if len(packed) > MAX_LISTING_CHARS:
            raise ListingTooLarge(
                f"shard {shard['shard_id']} lists {len(packed)} characters of files "
                "(packed), more than one task result holds.",
                fix="upgrade the ShardVault stack: it takes listings of any length through "
                "the work bucket.",
            )


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
        # The helper that reads screened ranges through a mapping (shardvault_agent.mappedscreen).
        self.mapped = MappedScreener()
        # The WAL archiver (set by the daemon when a shard archives): a tail that refers to
        # the archive waits for it (``_archived_tails``).
        self.archiver: Archiver | None = None

    @cached_property
    def restorer(self) -> Restorer:
        downloader = Downloader(self.sender.http, self.config.part_attempts, self.limiter)
        return Restorer(self.config, self.engine, downloader, self.keys)

    def run(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        handler: Callable[[dict[str, Any]], dict[str, Any]] | None = getattr(
            self, f"do_{name}", None
        )
        if handler is None:
            raise UnknownCommand(
                f"command {name!r} is unknown to this agent.", fix="upgrade the agent."
            )
        fetched = self._fetched_args(args)
        parse_args(name, fetched)  # the contract both sides hold (shardvault.contracts.commands)
        result = handler(fetched)
        if url := args.get("answer_url"):
            return self._hand_answer(name, url, result)
        check_fits_task_result(result)
        return result

    def _hand_answer(self, command: str, url: str, answer: dict[str, Any]) -> dict[str, Any]:
        """Puts a listing command's answer in the work bucket through its URL and returns the
        receipt the task token carries (``shardvault.backup.answers``)."""
        body = json.dumps(answer, separators=(",", ":")).encode()
        self.sender.send_answer(url, body, f"the answer of {command}")
        return {
            "node_id": self.config.node_id,
            "answer_bytes": len(body),
            "answer_crc64nvme": crc64nvme_of_bytes(body),
        }

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
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "root": str(capture.root),
            "files": [[f.path, f.size] for f in capture.files],
            "marker": capture.marker,
            "mutable": capture.mutable,
            "trust_identity": capture.trust_identity,
            "checkpoint_at": at,
        }
        write_json(path, record)

    def load_capture(self, backup_id: str, shard_id: str, phase: Phase) -> dict[str, Any]:
        path = self._capture_path(backup_id, shard_id, phase)
        if not path.exists():
            raise CheckpointNotFound(
                f"this agent holds no {phase} capture of shard {shard_id} for backup {backup_id}.",
                fix="retry the backup (the agent may have been restarted or released it).",
            )
        record = json.loads(path.read_text())
        record["files"] = [FileEntry(path=p, size=s) for p, s in record["files"]]
        return record

    def _limits_path(self, backup_id: str) -> Path:
        return self.backup_dir(backup_id) / "upload-limits.json"

    def save_limits(self, backup_id: str, limits: dict[str, Any] | None) -> None:
        """Keeps the policy's upload limits the checkpoint command brought, for the backup's
        pack and upload commands (they survive an agent restart like the captures)."""
        checked = UploadLimits.model_validate(limits or {})
        write_json(self._limits_path(backup_id), checked.model_dump(mode="json"))

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
        data_bytes = sum(f.size for capture in captured for f in capture["files"])
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

    def save_encryption(self, backup_id: str, encryption: dict[str, Any] | None) -> None:
        """Keeps the backup's wrapped data key (never the key itself) for its pack commands."""
        path = self._encryption_path(backup_id)
        if encryption:
            write_json(path, Encryption.model_validate(encryption).model_dump(mode="json"))
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

    def _shards(self, args: dict[str, Any]) -> list[ShardConfig]:
        shards = self.shards()
        missing = [s for s in args.get("shard_ids", []) if s not in shards]
        if missing:
            raise InvalidRequest(
                f"node {self.config.node_id} has no shard {', '.join(missing)}.",
                fix="check the agent config; the registry and the config disagree.",
            )
        return [shards[s] for s in args.get("shard_ids", [])]

    def _listing_result(
        self, backup_id: str, phase: Phase, shards: list[ShardConfig]
    ) -> dict[str, Any]:
        out = []
        for shard in shards:
            record = self.load_capture(backup_id, shard.shard_id, phase)
            out.append(
                {
                    "shard_id": shard.shard_id,
                    "files": pack_files(record["files"]),
                    "marker": record["marker"],
                    "checkpoint_at": record["checkpoint_at"],
                    "mutable": record["mutable"],
                    "bytes": sum(f.size for f in record["files"]),
                }
            )
        return {"node_id": self.config.node_id, "shards": out}

    # --- commands ------------------------------------------------------------------------------
    def do_probe(self, args: dict[str, Any]) -> dict[str, Any]:
        """``shardvault check``'s round trip (``shardvault.assurance.probe``): puts the probe's
        bytes through their checksum-bound URL and reads them back through the other, as a backup's
        parts and a restore's ranges go."""
        body = base64.b64decode(args["body"])
        started = time.monotonic()
        self.sender.send_probe(args["put_url"], body, args["crc64nvme"])
        stored = time.monotonic()
        read = bytearray(len(body))

        def write(position: int, chunk: bytes) -> None:
            read[position : position + len(chunk)] = chunk

        self.restorer.downloader.fetch(args["get_url"], "the probe object", 0, len(body), write)
        if bytes(read) != body:
            raise StoreObjectDamaged(
                "the probe object read back differs from the bytes this node put.",
                fix="check what stands between this node and the store (a proxy that rewrites "
                "bodies, a cache); backups from this node cannot be trusted until it is fixed.",
            )
        return {
            "node_id": self.config.node_id,
            "put_seconds": round(stored - started, 3),
            "get_seconds": round(time.monotonic() - stored, 3),
        }

    def do_flush(self, args: dict[str, Any]) -> dict[str, Any]:
        shards = self._shards(args)
        for shard in shards:
            self.engine.flush(shard)
        return {"node_id": self.config.node_id, "flushed": [s.shard_id for s in shards]}

    def _tombstone(self, backup_id: str) -> Path:
        return self.config.state_dir / "released" / backup_id

    def _refuse_released(self, backup_id: str) -> None:
        if self._tombstone(backup_id).exists():
            raise BackupReleased(
                f"backup {backup_id} was already released on this node.",
                fix="nothing to do: that backup has ended; start a new one.",
            )

    def do_checkpoint(self, args: dict[str, Any]) -> dict[str, Any]:
        """Takes each shard's checkpoint, then (when the command names the parents, as the
        backup state machine's does) scans it: one command, one round trip, where there were
        two. Without ``parents`` it answers with the listing alone, for a control plane that
        still sends ``scan`` on its own. With ``flush`` (a backup of this node alone) it
        flushes each shard first, as the Flush command would have, unless the engine's
        checkpoint flushes itself (``checkpoint_flushes``). With ``stop`` (an
        incremental of this node alone) it also ends the backup and packs the tail once every
        changed block is packed, as the Stop command would have (``stopped`` in the answer);
        a change too large to pack at the scan is stopped by the Stop command, after the
        Upload map has read it."""
        backup_id, shards = args["backup_id"], self._shards(args)
        with self._lock(backup_id):
            self._refuse_released(backup_id)
            self.save_limits(backup_id, args.get("upload"))
            self.save_encryption(backup_id, args.get("encryption"))
            for shard in shards:
                # A retried command: the checkpoint is held, or was already stopped (by this
                # command's ``stop``; an engine holds nothing after its stop). Taken again, the
                # data would be read after the stop and paired with the first tail.
                taken = self.engine.holds(shard, backup_id) or self._stopped_before(
                    backup_id, shard.shard_id
                )
                if taken and self._capture_path(backup_id, shard.shard_id, Phase.DATA).exists():
                    continue
                # Taken (again): what a lost checkpoint's scan saved describes other files.
                self._discard_scan(backup_id, shard.shard_id)
                if args.get("flush") and not self.engine.checkpoint_flushes:
                    self.engine.flush(shard)
                at = time.time()
                capture = self.engine.checkpoint(
                    shard,
                    backup_id,
                    self.backup_dir(backup_id),
                    log_archived=bool(args.get("archived_tails")),
                )
                self.save_capture(backup_id, shard.shard_id, Phase.DATA, capture, at)
            self.limits(backup_id)  # an adaptive throttle's baseline comes before the reads
            if "parents" not in args:
                return self._listing_result(backup_id, Phase.DATA, shards)
            result = self._scanned(backup_id, shards, args["parents"], args.get("pack"))
            if args.get("stop") and all("packed" in s for s in result["shards"]):
                # The cut's instant is now: this node is the backup's only one.
                now = datetime.now(UTC).isoformat()
                cut = CutRequest.model_validate({**args["stop"]["cut"], "entered": now})
                result["stopped"] = self._stopped(backup_id, shards, cut, args["pack"])
            return result

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

    def _saved_scan(self, backup_id: str, shard_id: str) -> dict[str, Any]:
        saved = self._extents_path(backup_id, shard_id)
        return json.loads(saved.read_text()) if saved.exists() else {}

    def _hashed_in_pack(self, backup_id: str, shard_id: str) -> bool:
        """A full (its scan found no parent: every byte is sent) has its block map made of
        its packs' hashes, not by a scan."""
        scan = self._saved_scan(backup_id, shard_id)
        return bool(scan) and scan["delta_bytes"] is None

    def _map_goes_with_tail(self, backup_id: str, shard_id: str) -> bool:
        """A full's map (joined at Stop), or an incremental's scanned by a ``scan`` command:
        a control plane that still sends one plans block maps with the tail only."""
        scan = self._saved_scan(backup_id, shard_id)
        return bool(scan) and (scan["delta_bytes"] is None or scan.get("map_with_tail", False))

    def cached_map(self, shard_id: str, backup_id: str) -> Path:
        """Where this node keeps the block map of a backup it made, for the next incremental."""
        return self.config.state_dir / "blockmaps" / shard_id / f"{backup_id}.map"

    def parent_map(self, shard_id: str, parent: dict[str, Any] | None) -> Path | None:
        """The parent's block map: the cached file when its CRC64NVME is the plaintext CRC the
        manifest records for the map (its frames'), else fetched from the store and decoded
        through the pipeline. The cache is read whole to be checked: correctness never
        depends on it. None: no parent (a full)."""
        if not parent:
            return None
        path = self.cached_map(shard_id, parent["backup_id"])
        obj = parent["object"]
        spans = frame_spans(unpack_frames(obj["frames"]), obj["frame_size"], obj["length"])
        if path.exists():
            with open(path, "rb") as cached:
                if crc64nvme_of_stream(cached) == plaintext_crc(spans):
                    return path
        fetched = self.restorer.fetch_object_plain(parent, path.with_suffix(".fetching"))
        return fetched.replace(path)

    def do_scan(self, args: dict[str, Any]) -> dict[str, Any]:
        """Hashes every block of each shard's capture into this backup's block map and
        compares it with the parent's; returns the listings with each shard's changed extents
        (packed, coarsened to fit) and what the scan read and took."""
        backup_id, shards = args["backup_id"], self._shards(args)
        with self._lock(backup_id):
            self._refuse_released(backup_id)
            parents, pack = args.get("parents", {}), args.get("pack")
            return self._scanned(backup_id, shards, parents, pack, map_with_data=False)

    def _scanned(
        self,
        backup_id: str,
        shards: list[ShardConfig],
        parents: dict[str, Any],
        pack: dict[str, Any] | None = None,
        map_with_data: bool = True,
    ) -> dict[str, Any]:
        limiter, _ = self.limits(backup_id)
        result = self._listing_result(backup_id, Phase.DATA, shards)
        for shard, listed in zip(shards, result["shards"], strict=True):
            scan = self._scan_shard(backup_id, shard.shard_id, parents, limiter, map_with_data)
            listed.update(scan)
            if scan["delta_bytes"] is not None:
                log.info(
                    "%s: scanned shard %s in %.3f s: %d bytes changed",
                    backup_id, shard.shard_id, scan["scan_seconds"], scan["delta_bytes"],
                )  # fmt: skip
        if pack:
            self._pack_listed(backup_id, result, pack, Phase.DATA)
        return result

    def _pack_listed(
        self, backup_id: str, result: dict[str, Any], pack: dict[str, Any], phase: Phase
    ) -> None:
        """Packs this node's objects of ``phase`` (with the block maps its answer announces)
        right after the command that listed them: an incremental's changes at its scan
        (``shardvault.backup.scanning``), every tail at its stop. They are cut as the control
        plane cuts them, and each is listed with its checksums in its shard's answer
        (``packed``). Not a full's data (packed in the Upload map, several at a time), nor
        more objects than the Upload map holds on this node at once: the disk holds no more
        packed bytes than it would have.
        Every shard of an answer packed has ``packed`` (empty when it changed nothing)."""
        started = time.monotonic()
        if phase == Phase.DATA and any(s.get("delta_bytes") is None for s in result["shards"]):
            return
        # The plan step's own listings of this answer: the objects are the ones it will plan.
        listed = Listing.model_validate(result)
        listings = listings_from_results([listed], phase) + blockmap_listings([listed])
        objects = plan_objects(backup_id=backup_id, listings=listings, **pack)
        if not objects or len(objects) > OBJECTS_IN_FLIGHT_PER_NODE:
            return
        with ThreadPoolExecutor(len(objects)) as pool:
            sums = list(pool.map(self._packed, objects))
        for listed in result["shards"]:
            listed["packed"] = [
                {"object": item.model_dump(mode="json"), "checksums": checksums}
                for item, checksums in zip(objects, sums, strict=True)
                if item.shard_id == listed["shard_id"]
            ]
        seconds = time.monotonic() - started
        log.info("%s: packed %d %s objects in %.3f s", backup_id, len(objects), phase, seconds)

    def _scan_shard(
        self,
        backup_id: str,
        shard_id: str,
        parents: dict[str, Any],
        limiter: RateLimiter,
        map_with_data: bool,
    ) -> dict[str, Any]:
        saved = self._extents_path(backup_id, shard_id)
        if saved.exists():  # a retried scan: the first one's answer
            return json.loads(saved.read_text())
        parent_path = self.parent_map(shard_id, parents.get(shard_id))
        capture = self.load_capture(backup_id, shard_id, Phase.DATA)
        # Identities are judged against the checkpoint's time, for engines that trust them.
        trusted = capture["checkpoint_at"] if capture.get("trust_identity") else None
        root = Path(capture["root"])
        if parent_path is None:  # a full: its objects hold the whole stream, its packs hash it
            hashes_dir = self._hashes_dir(backup_id, shard_id)
            save_identities(hashes_dir, root, capture["files"], trusted)
            answer = {"extents": "", "delta_bytes": None, "scan_seconds": None}
            write_json(saved, answer)
            return answer
        parent_args = parents.get(shard_id) or {}
        screen = parent_screen(self.engine, self.config.node_id, capture["marker"], parent_args)
        with BlockMap(parent_path) as parent:
            scan = scan_capture(
                root, capture["files"], limiter, parent, self._map_path(backup_id, shard_id),
                trusted_before=trusted, screen=screen, mapped=self.mapped,
            )  # fmt: skip
        if scan.screened_bytes:
            log.info(
                "%s: shard %s: %d bytes proven unchanged by their headers, %d bytes judged "
                "through a mapping",
                backup_id, shard_id, scan.screened_bytes, scan.mapped_bytes,
            )  # fmt: skip
        packed, extents = pack_within(scan.extents, EXTENTS_BUDGET)
        answer = {
            "extents": packed,
            "delta_bytes": sum(n for _, n in extents),
            "scan_seconds": scan.scan_seconds,
            "unchanged_bytes": scan.unchanged_bytes,
            "screened_bytes": scan.screened_bytes,
            "parent_id": parent_args.get("backup_id"),
        }
        if map_with_data:  # the scan wrote the map: it is uploaded with the data
            answer["blockmap_bytes"] = self._map_path(backup_id, shard_id).stat().st_size
        else:
            answer["map_with_tail"] = True
        write_json(saved, answer)
        return answer

    def do_stop(self, args: dict[str, Any]) -> dict[str, Any]:
        backup_id, shards = args["backup_id"], self._shards(args)
        cut = CutRequest.model_validate(args["cut"]) if args.get("cut") else None
        with self._lock(backup_id):
            self._refuse_released(backup_id)
            return self._stopped(backup_id, shards, cut, args.get("pack"))

    def _stopped(
        self,
        backup_id: str,
        shards: list[ShardConfig],
        cut: CutRequest | None,
        pack: dict[str, Any] | None,
    ) -> dict[str, Any]:
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
        result = self._listing_result(backup_id, Phase.TAIL, shards)
        for shard, listed in zip(shards, result["shards"], strict=True):
            # A full's map is joined from its packs' hashes now, and goes with the tail;
            # an incremental's went with the data (its scan wrote it).
            if not self._map_goes_with_tail(backup_id, shard.shard_id):
                continue
            block_map = self._map_path(backup_id, shard.shard_id)
            if not block_map.exists():
                files = self.load_capture(backup_id, shard.shard_id, Phase.DATA)["files"]
                assemble_map(self._hashes_dir(backup_id, shard.shard_id), files, block_map)
            listed["blockmap_bytes"] = block_map.stat().st_size
        if pack:
            self._pack_listed(backup_id, result, pack, Phase.TAIL)
        return result

    def _archived_tails(self, backup_id: str, shards: list[ShardConfig]) -> None:
        """Waits until the archive has recorded the log each tail refers to instead of
        holding it (``archived_through`` in its marker: PostgreSQL's archived tail), so that
        Finalize finds it there; a retried stop waits again (nothing if it is stored)."""
        for shard in shards:
            marker = self.load_capture(backup_id, shard.shard_id, Phase.TAIL)["marker"]
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

    def do_release(self, args: dict[str, Any]) -> dict[str, Any]:
        """Releases everything held for the backup and leaves a tombstone, so that a
        checkpoint still in flight, or replayed after a restart, gives up instead of taking
        a checkpoint nobody will release. The lock makes release wait for such a checkpoint."""
        backup_id = args["backup_id"]
        tombstone = self._tombstone(backup_id)
        tombstone.parent.mkdir(parents=True, exist_ok=True)
        tombstone.touch()
        with self._lock(backup_id):
            for shard in self._shards(args):
                self.engine.release(shard, backup_id)
            shutil.rmtree(self.backup_dir(backup_id), ignore_errors=True)
        with self.locks_guard:
            limiter = self.backup_limiters.pop(backup_id, None)
        self._close_limits(backup_id, limiter)
        return {"node_id": self.config.node_id, "released": True}

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

    def do_pack(self, args: dict[str, Any]) -> dict[str, Any]:
        """Reads the object's range of the stream once, through the part pipeline (frames,
        zstd, sealing), into a packed copy; returns the stored bytes' checksums and the frame
        table. A retried pack returns what the first one packed: the URLs signed next are
        bound to those bytes."""
        item = ObjectPlan.model_validate(args["object"])
        self._refuse_released(item.backup_id)
        try:
            return self._packed(item)
        finally:
            # Released meanwhile (the reaper's or the failure path's release removes the
            # directory under a pack, which may then fail): leave nothing, whatever it wrote.
            if self._tombstone(item.backup_id).exists():
                shutil.rmtree(self.backup_dir(item.backup_id), ignore_errors=True)

    def _packed(self, item: ObjectPlan) -> dict[str, Any]:
        """The checksums of ``item``'s packed copy: packed before for this very plan (at the
        scan, or by a pack this retries), or packed now."""
        path = self._packed_path(item)
        summary = path.with_suffix(".json")
        if summary.exists() and path.exists():
            saved = json.loads(summary.read_text())
            if saved.get("object") == item.model_dump(mode="json"):
                return saved["checksums"]
        return self._pack(item, path, summary)

    def _pack(self, item: ObjectPlan, path: Path, summary: Path) -> dict[str, Any]:
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
        result = sums.model_dump(mode="json")
        unfinished.replace(path)
        if item.phase == Phase.BLOCKMAP:
            self.keep_map(item)
        write_json(summary, {"object": item.model_dump(mode="json"), "checksums": result})
        return result

    def _hasher(
        self, item: ObjectPlan, capture: dict[str, Any], limiter: RateLimiter
    ) -> PackHasher | None:
        """A full's data objects hash the blocks they read, for its block map."""
        if item.phase != Phase.DATA or not self._hashed_in_pack(item.backup_id, item.shard_id):
            return None
        root, files = Path(capture["root"]), capture["files"]
        read_at = partial(read_range, root, files, limiter=limiter)
        return PackHasher(files, item.stream_offset, item.length, read_at)

    def _capture_of(self, item: ObjectPlan) -> dict[str, Any]:
        """What an object reads: a phase's capture, or the shard's block map file."""
        if item.phase != Phase.BLOCKMAP:
            return self.load_capture(item.backup_id, item.shard_id, item.phase)
        path = self._map_path(item.backup_id, item.shard_id)
        if not path.exists():
            raise CheckpointNotFound(
                f"this agent holds no block map of shard {item.shard_id} for {item.backup_id}.",
                fix="retry the backup (the agent may have been restarted or released it).",
            )
        return {
            "root": str(path.parent),
            "files": [FileEntry(path=path.name, size=path.stat().st_size)],
        }

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
        self, item: ObjectPlan, capture: dict[str, Any], limiter: RateLimiter
    ) -> Callable[[int], bytes]:
        """What an object holds: a range of its shard's stream, or, for an incremental's data,
        of its delta stream (the changed extents the scan found)."""
        root, files = Path(capture["root"]), capture["files"]
        extents = self._extents_path(item.backup_id, item.shard_id)
        packed = json.loads(extents.read_text())["extents"] if extents.exists() else ""
        if item.phase == Phase.DATA and packed:
            changed = unpack_extents(packed)
            delta = DeltaReader(root, files, changed, item.stream_offset, item.length, limiter)
            return delta.read
        return stream_source(root, files, item.stream_offset, item.length, limiter)

    def do_upload(self, args: dict[str, Any]) -> dict[str, Any]:
        """Sends the packed copy's parts that have a URL and are not yet stored."""
        item = ObjectPlan.model_validate(args["object"])
        sums = ObjectChecksums.model_validate(args["checksums"])
        urls = {p["part_number"]: p["url"] for p in args["parts"]}
        self._refuse_released(item.backup_id)  # a late command must not recreate its state
        # What was sent is recorded per upload: a multipart upload's id, or (a single PUT,
        # ``upload_id`` None) the object's key.
        digest = hashlib.sha256((args["upload_id"] or item.key).encode()).hexdigest()[:24]
        record = self.backup_dir(item.backup_id) / "uploads" / f"{digest}.jsonl"
        record.parent.mkdir(parents=True, exist_ok=True)
        done = {p.part_number: p for p in _read_parts(record)}
        if all(p.part_number in done for p in sums.parts):  # a retried upload that had ended
            return {"parts": [done[n].model_dump(mode="json") for n in sorted(done)]}
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
        return {"parts": [p.model_dump(mode="json") for p in uploaded]}

    # --- restore (``backup_id`` is the restore's id) -------------------------------------------
    def do_prepare_restore(self, args: dict[str, Any]) -> dict[str, Any]:
        with self._lock(args["backup_id"]):
            return self.restorer.prepare(args)

    def do_download(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.restorer.download(args)

    def do_finish_restore(self, args: dict[str, Any]) -> dict[str, Any]:
        with self._lock(args["backup_id"]):
            return self.restorer.finish(args)

    def do_abort_restore(self, args: dict[str, Any]) -> dict[str, Any]:
        with self._lock(args["backup_id"]):
            return self.restorer.abort(args)


def parent_screen(
    engine: EngineAdapter, node_id: str, marker: dict[str, str], parent: dict[str, Any]
) -> BlockScreen | None:
    """The engine's block screen against ``parent`` (``scan``: it reads only the headers of
    blocks it can vouch for), for a parent this node made: a device and inode name a file on
    one host only. None for a parent of another node, or of a control plane that does not
    say which."""
    if parent.get("node_id") != node_id:
        return None
    return engine.block_screen(marker, parent.get("marker") or {})


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
