"""Finish and abort: a restored shard is moved in, started and checked; or all of it undone.

*Finish*: once every object of a shard is in, its staged files are synced, moved to the
shard's final directory (a copy already there, an earlier restore's, is stopped and set
aside) and handed to the engine, which starts the shard's server and runs its checks. A
shard that passes is adopted (``adoption``); the copy set aside is removed.

*Started*: ``state/<restore_id>/started.json`` notes, per shard, what finish did as it did
it (its path, the server it started, the server it replaced, its result), so that a retried
finish answers the same and an abort undoes exactly that.

*Abort*: stops what the restore started, removes what it placed (putting back what it
replaced), its staging and its state, and leaves a tombstone so that a command of the
restore that comes later stops. Safe at any point, twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from shardvault.aws.tables import INBOX_TTL_SECONDS
from shardvault.contracts.commands import (
    Aborted,
    Finished,
    FinishRestoreArgs,
    RestoredShard,
)
from shardvault.contracts.models import Phase, unpack_files
from shardvault.contracts.wal_archive import WAL_DIR
from shardvault.errors import DownloadIncomplete, RestoreValidationFailed, ShardVaultError
from shardvault_agent.checks import raise_if_refused
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.base import EngineAdapter, Finishing
from shardvault_agent.restore import linked
from shardvault_agent.restore.adoption import Adoption, adopted_since
from shardvault_agent.restore.download import Downloads
from shardvault_agent.restore.files import sync_tree
from shardvault_agent.restore.places import Places
from shardvault_agent.restore.prepare import ChainWork, Signed, signed_downloads
from shardvault_agent.restore.walfeed import WalFeed, wal_batches
from shardvault_agent.statefiles import write_json

log = logging.getLogger("shardvault.agent.restore")

# Other restores' tombstones older than this are pruned: twice the inbox items' life
# (DynamoDB's TTL deletes late), after which no command of theirs can still arrive.
TOMBSTONE_LIFE_SECONDS = 2 * INBOX_TTL_SECONDS


class Finisher:
    def __init__(
        self,
        config: AgentConfig,
        engine: EngineAdapter,
        places: Places,
        chains: ChainWork,
        downloads: Downloads,
        adoption: Adoption,
    ) -> None:
        self.config, self.engine, self.places = config, engine, places
        self.chains, self.downloads, self.adoption = chains, downloads, adoption
        # Finish and abort of one restore may run at once (the reaper's abort arrives while a
        # finish is starting a server): each shard's finish and the abort take turns, so an
        # abort never misses a server that is starting.
        self._turns: dict[str, threading.Lock] = {}
        self._turns_guard = threading.Lock()

    def _turn(self, restore_id: str) -> threading.Lock:
        with self._turns_guard:
            return self._turns.setdefault(restore_id, threading.Lock())

    # --- finish ---------------------------------------------------------------------------
    def finish(self, args: FinishRestoreArgs) -> Finished:
        restore_id = args.backup_id
        self.places.refuse_aborted(restore_id)
        self.chains.wait(restore_id, last=True)
        self.places.raise_recorded_failure(restore_id)
        self.downloads.close_overlays(restore_id)  # every object is in: no more patches
        wal = self._wal_downloads(args)
        results = []
        for shard_id in args.shard_ids:
            with self._turn(restore_id):
                self.places.refuse_aborted(restore_id)
                fed = wal.get(shard_id, [])
                results.append(self._finish_shard(restore_id, shard_id, args, fed))
        with contextlib.suppress(OSError):  # every shard moved out: staging is empty now
            self.places.incoming(restore_id).rmdir()
        self.places.drop_spools(restore_id)  # every shard restored (an abort drops them too)
        self.places.links_record(restore_id).unlink(missing_ok=True)  # placed for good
        shards = [RestoredShard.model_validate(result) for result in results]
        # The restore's progress counts the prefetched objects now (finalize).
        prefetched = self.places.prefetched(restore_id)
        if prefetched is None:
            return Finished(node_id=self.config.node_id, shards=shards)
        return Finished(node_id=self.config.node_id, shards=shards, prefetched=prefetched)

    def _started(self, restore_id: str) -> dict[str, dict[str, Any]]:
        path = self.places.state(restore_id) / "started.json"
        return json_or_empty(path)

    def _note_started(self, restore_id: str, shard_id: str, info: dict[str, Any]) -> None:
        """Adds ``info`` to what this restore started of the shard (its path, the server
        it started, the server it replaced, its result)."""
        started = self._started(restore_id)
        started[shard_id] = started.get(shard_id, {}) | info
        write_json(self.places.state(restore_id) / "started.json", started)

    def _wal_downloads(self, args: FinishRestoreArgs) -> dict[str, list[Signed]]:
        """A point-in-time restore's archive batches and their URLs, by shard."""
        by_shard: dict[str, list[Signed]] = {}
        for item, url in signed_downloads(self.downloads.downloader, args.wal):
            by_shard.setdefault(item.shard_id, []).append((item, url))
        return by_shard

    def _wal_feed(
        self, restore_id: str, shard_id: str, final: Path, signed: list[Signed]
    ) -> WalFeed | None:
        """The shard's WAL feed, started (None: no archive to replay)."""
        if not signed:
            return None
        layout = self.places.layout(restore_id, shard_id)
        files = unpack_files(layout.stream(Phase.WAL))
        feed = WalFeed(
            wal_dir=final / WAL_DIR,
            landing=self.places.incoming(restore_id) / f"{shard_id}.wal",
            files=files,
            batches=wal_batches(files, signed),
            downloader=self.downloads.downloader,
            sealer_of=lambda item: self.downloads.sealer(item, layout),
            aborted=self.places.aborted(restore_id).exists,
            owner=self.engine.server_account(),
        )
        feed.start()
        return feed

    def _finish_shard(
        self, restore_id: str, shard_id: str, args: FinishRestoreArgs, wal: list[Signed]
    ) -> dict[str, Any]:
        started = self._started(restore_id).get(shard_id)
        if started and started.get("result"):
            return started["result"]  # type: ignore[no-any-return]  # a retried finish
        self._check_all_in(restore_id, shard_id)
        final, staged = self.places.final(shard_id), self.places.staging(restore_id, shard_id)
        began = time.monotonic()
        if staged.exists() and not self.engine.fsyncs_restored_files:
            sync_tree(staged)  # before the shard counts as restored
        synced = time.monotonic()
        aside = self.places.incoming(restore_id) / f"{shard_id}.replaced"
        replaced: dict[str, Any] = {}
        if staged.exists():
            if final.exists():
                replaced = self._stop_replaced(final)
                # Whose copy it set aside (an earlier restore's adoption): its own to put back.
                if owner := self.adoption.adopted().get(shard_id, {}).get("restore_id"):
                    replaced["replaced_restore"] = owner
                final.rename(aside)  # put back by abort_restore, deleted once checks pass
            staged.rename(final)
        self._note_started(restore_id, shard_id, {"path": str(final), **replaced})
        result = self._start_and_check(restore_id, shard_id, final, args, wal)
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
        if aside.exists():
            linked.remove_with_copy(aside, self.places.restore_dir)
        log.info(
            "%s: shard %s synced in %.2f s, started and checked in %.2f s, the copy it "
            "replaced removed in %.2f s",
            restore_id, shard_id, synced - began, checked - synced, time.monotonic() - checked,
        )  # fmt: skip
        self._note_started(restore_id, shard_id, {"result": result})
        self.adoption.adopt(restore_id, shard_id, result)
        return result

    def _start_and_check(
        self,
        restore_id: str,
        shard_id: str,
        final: Path,
        args: FinishRestoreArgs,
        wal: list[Signed],
    ) -> dict[str, Any]:
        """The engine's finish of the shard in place, fed its archive's WAL as it recovers
        when it restores to a point in time."""
        feed = self._wal_feed(restore_id, shard_id, final, wal)
        finishing = self._finishing(restore_id, shard_id, final, args)
        if feed is None:
            return self.engine.finish(finishing)
        finishing.wal_done = feed.recovered
        finishing.wal_progress = lambda: feed.last_progress
        try:
            result = self.engine.finish(finishing)
        except ShardVaultError:
            # Recovery stopped on the feed's failure: that is the cause, not the server's
            # stop. After recovery, the server's own error (its checks) is the one.
            if feed.failure is not None and not feed.recovery_over:
                raise feed.failure from None
            raise
        finally:
            feed.stop()
        if feed.failure is not None:  # past where recovery stopped: never needed
            log.warning("%s: shard %s: %s", restore_id, shard_id, feed.failure)
        return result | {"wal": feed.counted().model_dump(mode="json")}

    def _check_all_in(self, restore_id: str, shard_id: str) -> None:
        """Every object of the shard is written: its streams', and every chain object that
        writes a byte (the Download map tolerates failures; none passes unnoticed)."""
        layout = self.places.layout(restore_id, shard_id)
        streams = [s for s in layout.streams if s.phase != Phase.WAL]  # fed at finish
        needed = [o.key for s in streams for o in s.objects] + layout.chain_objects
        missing = [
            key
            for key in dict.fromkeys(needed)
            if not self.places.object(restore_id, key).is_written
        ]
        if missing:
            raise DownloadIncomplete(
                f"shard {shard_id} on node {self.config.node_id} misses {len(missing)} object(s), "
                f"e.g. {missing[0]}.",
                fix="the restore failed: start it again (it resumes what was downloaded).",
            )

    def _finishing(
        self, restore_id: str, shard_id: str, root: Path, args: FinishRestoreArgs
    ) -> Finishing:
        def note_server(server: dict[str, Any]) -> None:
            self._note_started(restore_id, shard_id, {"path": str(root), "server": server})

        layout = self.places.layout(restore_id, shard_id)
        return Finishing(
            shard_id=shard_id,
            root=root,
            layout=layout.model_dump(mode="json"),
            validation_queries=args.validation_queries,
            heapallindexed=args.heapallindexed,
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

    # --- abort ----------------------------------------------------------------------------
    def abort(self, restore_id: str) -> Aborted:
        """Undoes the restore on this node (the module docstring)."""
        tombstone = self.places.aborted(restore_id)
        tombstone.parent.mkdir(parents=True, exist_ok=True)
        self._prune_tombstones(restore_id)
        tombstone.touch()
        with contextlib.suppress(Exception):  # its reads stop at the tombstone
            self.chains.wait(restore_id, last=True)
        self.downloads.close_overlays(restore_id)
        with self._turn(restore_id):
            self._undo(restore_id)
        return Aborted(node_id=self.config.node_id, aborted=True)

    def _prune_tombstones(self, restore_id: str) -> None:
        """Removes other restores' tombstones older than ``TOMBSTONE_LIFE_SECONDS``: a restore
        drill's teardown aborts every week."""
        oldest = time.time() - TOMBSTONE_LIFE_SECONDS
        for tombstone in self.places.restores_dir.glob("*.aborted"):
            if tombstone == self.places.aborted(restore_id):
                continue
            with contextlib.suppress(OSError):
                if tombstone.stat().st_mtime < oldest:
                    tombstone.unlink()

    def _undo(self, restore_id: str) -> None:
        incoming = self.places.incoming(restore_id)
        adopted = self.adoption.adopted()
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
            self.adoption.unadopt(restore_id, shard_id)
            aside = incoming / f"{shard_id}.replaced"
            if aside.exists():
                aside.rename(final)
                if info.get("replaced"):
                    self.engine.start_server(final, info["replaced"])
        linked.remove_placed(
            self.places.links_record(restore_id), self.config.restore_dir, restore_id
        )
        shutil.rmtree(incoming, ignore_errors=True)
        shutil.rmtree(self.places.state(restore_id), ignore_errors=True)


def json_or_empty(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


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
