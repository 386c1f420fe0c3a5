"""The commands an agent runs for the state machines, each idempotent (``Commands``).

``Commands.run`` is the wire: it takes a command's arguments as the inbox item holds them
(JSON), reads them into the command's model (``shardvault.contracts.commands``), runs the
command's handler (``do_<name>``, which takes that model and answers with its result model)
and sends the answer back as JSON. A listing command's answer goes through its answer URL.

The handlers live with their workflow: a backup's in ``backup.commands.BackupCommands``, a
restore's in ``restore.Restorer``; ``Commands`` holds what they share (the shards this node
holds, one lock per backup or restore) and ``check``'s probe.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import boto3

from shardvault.contracts.commands import (
    Aborted,
    AbortRestoreArgs,
    AnswerReceipt,
    CommandResult,
    DownloadArgs,
    Downloaded,
    Finished,
    FinishRestoreArgs,
    ListingArgs,
    ParentMap,
    Prepared,
    PrepareRestoreArgs,
    ProbeArgs,
    Probed,
    parse_args,
)
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import InvalidRequest, StoreObjectDamaged, UnknownCommand
from shardvault_agent.backup.commands import BackupCommands
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import EngineAdapter
from shardvault_agent.keys import DataKeys
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.restore import Restorer
from shardvault_agent.transfer import Downloader, PartSender, inlined


class Commands:
    """A node's commands: the wire (``run``), the backup's (``backup``), the restore's
    (``restorer``) and the probe, over the shards this node holds."""

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
        self.backup = BackupCommands(
            config,
            engine,
            limiter,
            sender,
            self.keys,
            shards=self.shards,
            shards_named=self._shards,
            lock=self._lock,
            fetch_plain=self._fetch_object_plain,
        )

    @cached_property
    def restorer(self) -> Restorer:
        downloader = Downloader(self.sender.http, self.config.part_attempts, self.limiter)
        return Restorer(self.config, self.engine, downloader, self.keys)

    def _fetch_object_plain(self, parent: ParentMap, dest: Path) -> Path:
        return self.restorer.fetch_object_plain(parent, dest)  # the restorer is made lazily

    def run(self, name: str, wire_args: dict[str, Any]) -> dict[str, Any]:
        """Runs command ``name`` on its arguments as the inbox item holds them; its answer as
        the task result holds it (a listing command's: the receipt of its answer)."""
        handler = self.handler(name)
        args = parse_args(name, self._fetched_args(wire_args))
        # Only the fields the handler set: a listing not scanned must not look scanned
        # (``shardvault.backup.planner.check_scanned``).
        answer = handler(args).model_dump(mode="json", exclude_unset=True)
        if isinstance(args, ListingArgs):
            return self._hand_answer(name, args.answer_url, answer)
        return answer

    def handler(self, name: str) -> Callable[[Any], CommandResult]:
        """Command ``name``'s handler (``do_<name>``): a backup's, a restore's or the probe."""
        handler: Callable[[Any], CommandResult] | None = getattr(
            self, f"do_{name}", None
        ) or getattr(self.backup, f"do_{name}", None)
        if handler is None:
            raise UnknownCommand(
                f"command {name!r} is unknown to this agent.", fix="upgrade the agent."
            )
        return handler

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

    def held_backups(self) -> set[str]:
        return self.backup.files.held_backups()

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

    def _lock(self, backup_id: str) -> threading.Lock:
        """One lock per backup or restore: a backup's checkpoint, stop and release never
        overlap, nor a restore's prepare, finish and abort."""
        with self.locks_guard:
            return self.locks.setdefault(backup_id, threading.Lock())

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
