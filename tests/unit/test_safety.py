"""Guards against data an agent or a store could get wrong: paths, short streams, foreign
answers, released checkpoints, tablespaces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError
from shardvault_agent.backup import commands as backup_commands
from shardvault_agent.commands import Commands
from shardvault_agent.engines.postgres import tablespaces
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from shardvault.aws.materialize import StreamWriter
from shardvault.backup import check_listings_match_sources
from shardvault.backup.planner import check_scanned
from shardvault.contracts.commands import Listing
from shardvault.contracts.models import FileEntry, ObjectPlan, Phase, ShardListing
from shardvault.errors import (
    BackupReleased,
    CheckpointNotFound,
    ChecksumMismatch,
    EngineError,
    InvalidRequest,
    UnknownCommand,
)

from .support import backup_context, handle, sqlite_agent


@pytest.mark.parametrize("path", ["../etc/passwd", "/abs", "a/../b", "a//b", "./a", "", "a\\b"])
def test_file_paths_that_could_escape_the_restore_root_are_refused(path):
    with pytest.raises(ValidationError, match="plain relative path"):
        FileEntry(path=path, size=1)


def test_plain_paths_and_directories_are_accepted():
    assert FileEntry(path="base/1/1259", size=8192).path == "base/1/1259"
    assert FileEntry(path="pg_wal/", size=0).path == "pg_wal/"


def test_a_stream_shorter_than_its_files_is_an_error(tmp_path):
    writer = StreamWriter(tmp_path, [FileEntry(path="a", size=4), FileEntry(path="b", size=4)])
    writer.write(memoryview(b"12345"))
    with pytest.raises(ChecksumMismatch, match="short"):
        writer.close()


def test_empty_files_and_directories_after_the_last_byte_are_created(tmp_path):
    files = [
        FileEntry(path="a", size=2),
        FileEntry(path="d/", size=0),
        FileEntry(path="d/e", size=0),
    ]
    writer = StreamWriter(tmp_path, files)
    writer.write(memoryview(b"hi"))
    writer.close()
    assert (tmp_path / "a").read_bytes() == b"hi"
    assert (tmp_path / "d" / "e").read_bytes() == b""


def listing(shard: str, node: str) -> ShardListing:
    return ShardListing(shard_id=shard, node_id=node, phase=Phase.DATA, files=[])


def test_answers_must_come_from_the_nodes_asked():
    check_listings_match_sources(backup_context(), [listing("s1", "n1"), listing("s2", "n2")])
    with pytest.raises(InvalidRequest, match="expected"):
        check_listings_match_sources(backup_context(), [listing("s1", "n1"), listing("s2", "n1")])
    with pytest.raises(InvalidRequest):
        check_listings_match_sources(backup_context(), [listing("s1", "n1")])


@pytest.fixture
def sqlite_commands(tmp_path: Path) -> Commands:
    config = sqlite_agent(tmp_path)
    return Commands(config, SqliteAdapter(config), RateLimiter(None), sender=None)


def test_a_checkpoint_after_release_is_refused_and_holds_nothing(sqlite_commands):
    args = {"backup_id": "b1", "shard_ids": ["s1"]}
    handle(sqlite_commands, "release", args)  # e.g. the backup failed elsewhere first
    with pytest.raises(CheckpointNotFound, match="already released"):
        handle(sqlite_commands, "checkpoint", args)
    state = sqlite_commands.config.state_dir
    assert not (state / "snapshots" / "b1").exists()
    assert not (state / "backups" / "b1").exists()


def test_a_retried_checkpoint_returns_the_same_listing(sqlite_commands):
    args = {"backup_id": "b2", "shard_ids": ["s1"]}
    first = handle(sqlite_commands, "checkpoint", args)
    assert handle(sqlite_commands, "checkpoint", args) == first
    handle(sqlite_commands, "release", args)
    assert not (sqlite_commands.config.state_dir / "snapshots" / "b2" / "s1").exists()


def test_a_checkpoint_told_the_parents_answers_with_its_scan_as_a_separate_scan_would(
    sqlite_commands,
):
    """One command where there were two: the listing carries the scan's answer (a full's:
    every byte sent), and a control plane that still sends ``scan`` after a plain checkpoint
    gets the same answer."""
    merged = handle(
        sqlite_commands, "checkpoint", {"backup_id": "b3", "shard_ids": ["s1"], "parents": {}}
    )
    (shard,) = merged["shards"]
    assert shard["delta_bytes"] is None
    assert shard["extents"] == ""
    check_scanned([Listing.model_validate(merged)])

    plain = handle(sqlite_commands, "checkpoint", {"backup_id": "b4", "shard_ids": ["s1"]})
    with pytest.raises(UnknownCommand, match="without scanning it: it is older"):
        check_scanned(
            [Listing.model_validate(plain)]
        )  # planned, it would be an incremental that says nothing changed
    scanned = handle(
        sqlite_commands, "scan", {"backup_id": "b4", "shard_ids": ["s1"], "parents": {}}
    )
    check_scanned([Listing.model_validate(scanned)])
    same = ("files", "extents", "delta_bytes", "scan_seconds")
    assert {k: scanned["shards"][0][k] for k in same} == {k: shard[k] for k in same}


def test_a_checkpoint_taken_again_is_scanned_again(sqlite_commands):
    """An agent restarted in the middle of a Checkpoint command runs it again. A checkpoint it
    no longer holds (PostgreSQL's backup mode dies with the session) is taken anew, and the
    scan answer saved for the lost one, extents of other bytes, must not answer for it."""
    args = {"backup_id": "b6", "shard_ids": ["s1"], "parents": {}}
    handle(sqlite_commands, "checkpoint", args)
    backup_dir = sqlite_commands.backup.files.backup_dir("b6")
    # What a lost incremental's scan left behind: its answer and its block map.
    stale = {"extents": "c3RhbGU=", "delta_bytes": 5, "scan_seconds": 0.1}
    (backup_dir / "s1.extents.json").write_text(json.dumps(stale))
    (backup_dir / "s1.map").write_bytes(b"SVBM")
    shard = sqlite_commands.shards()["s1"]
    shutil.rmtree(sqlite_commands.engine.copy_dir("b6", shard))  # the hold is lost
    assert not sqlite_commands.engine.holds(shard, "b6")

    again = handle(sqlite_commands, "checkpoint", args)

    (answer,) = again["shards"]
    assert (answer["extents"], answer["delta_bytes"]) == ("", None)  # this capture's scan
    assert not (backup_dir / "s1.map").exists()


@pytest.mark.parametrize("flow", ["checkpoint+scan", "scan command"])
def test_stop_announces_an_incrementals_map_only_to_a_control_plane_that_plans_it_there(
    sqlite_commands, flow
):
    """A control plane that scans in the Checkpoint command plans an incremental's map with
    the data (the scan's answer announces it); one that still sends ``scan`` plans maps with
    the tail only, and would otherwise never upload it."""
    args = {"backup_id": "b7", "shard_ids": ["s1"]}
    handle(sqlite_commands, "checkpoint", args)
    backup_dir = sqlite_commands.backup.files.backup_dir("b7")
    answer = {"extents": "", "delta_bytes": 0, "scan_seconds": 0.1}  # as a scan saved it
    if flow == "scan command":
        answer["map_with_tail"] = True
    (backup_dir / "s1.extents.json").write_text(json.dumps(answer))
    (backup_dir / "s1.map").write_bytes(b"the map of this incremental")

    (stopped,) = handle(sqlite_commands, "stop", args)["shards"]

    announced = stopped.get("blockmap_bytes")
    assert announced == (len(b"the map of this incremental") if flow == "scan command" else None)


def test_a_pack_the_release_overtakes_leaves_nothing_behind(tmp_path, monkeypatch):
    """A release (the reaper's, or the failure path's) may run while a pack still reads: it
    removes the backup's directory under the pack, which then fails. What the pack wrote
    after that (a full's block hashes) must go too, or it outlives the backup."""
    config = sqlite_agent(tmp_path, rows=300)
    cmds = Commands(config, SqliteAdapter(config), RateLimiter(None), sender=None)
    args = {"backup_id": "b8", "shard_ids": ["s1"]}
    (listing,) = handle(cmds, "checkpoint", {**args, "parents": {}})["shards"]
    plan = ObjectPlan(
        backup_id="b8", cluster="c", node_id="n1", shard_id="s1", phase=Phase.DATA, index=0,
        key="k", stream_offset=0, length=listing["bytes"], part_size=8 << 20, part_count=1,
    )  # fmt: skip
    packing = backup_commands.pack_object

    def released_while_packing(*pack_args, **kwargs):
        packed = packing(*pack_args, **kwargs)
        handle(cmds, "release", args)
        return packed

    monkeypatch.setattr(backup_commands, "pack_object", released_while_packing)
    with pytest.raises(FileNotFoundError, match="partial"):  # its packed copy went
        handle(cmds, "pack", {"object": plan.model_dump(mode="json")})
    assert not cmds.backup.files.backup_dir("b8").exists()


class ReleasedBetweenTries:
    """A sender whose first try of a part fails (the store timed out), after which the
    backup's failure path releases it, as another node's failed part makes it do."""

    def __init__(self, release) -> None:
        self.release, self.tries = release, 0

    def send(self, key, part, url, body):
        self.tries += 1
        with body():  # the first try reads its part
            pass
        self.release()
        with body():  # the next try finds the packed copy gone
            raise AssertionError("the packed copy outlived the release")


def test_a_part_whose_backup_is_released_between_tries_says_so(tmp_path):
    """A run saw a backup fail with a part's FileNotFoundError as its cause, where the store's
    RequestTimeout was the cause: a release removed the packed copy between two tries, the
    next try blamed the network, and its note hid the first. The part now fails as
    BackupReleased, and the daemon notes no cause for that (tests/unit/test_doorbell.py)."""
    config = sqlite_agent(tmp_path, rows=300)
    args = {"backup_id": "b9", "shard_ids": ["s1"]}
    cmds = Commands(config, SqliteAdapter(config), RateLimiter(None), sender=None)
    cmds.backup.sender = ReleasedBetweenTries(lambda: handle(cmds, "release", args))
    (listing,) = handle(cmds, "checkpoint", {**args, "parents": {}})["shards"]
    plan = ObjectPlan(
        backup_id="b9", cluster="c", node_id="n1", shard_id="s1", phase=Phase.DATA, index=0,
        key="k", stream_offset=0, length=listing["bytes"], part_size=8 << 20, part_count=1,
    )  # fmt: skip
    sums = handle(cmds, "pack", {"object": plan.model_dump(mode="json")})
    upload = {
        "object": plan.model_dump(mode="json"),
        "checksums": sums,
        "upload_id": "u1",
        "parts": [{"part_number": 1, "url": "https://store.invalid/part"}],
    }
    with pytest.raises(BackupReleased, match="already released"):
        handle(cmds, "upload", upload)
    assert cmds.backup.sender.tries == 1
    assert not cmds.backup.files.backup_dir("b9").exists()


def test_a_tablespace_that_leads_nowhere_or_inside_is_refused_with_the_reason(tmp_path):
    data_dir, outside = tmp_path / "data", tmp_path / "disk2"
    (data_dir / "pg_tblspc").mkdir(parents=True)
    outside.mkdir()
    link = data_dir / "pg_tblspc" / "16384"
    link.symlink_to(outside)
    tablespaces.check(data_dir, "s1")  # a tablespace on another disk is backed up
    outside.rmdir()
    with pytest.raises(EngineError, match=r"16384.*leads to no directory") as gone:
        tablespaces.check(data_dir, "s1")
    assert "mount the tablespace's disk" in gone.value.fix
    link.unlink()
    (data_dir / "inside").mkdir()
    link.symlink_to(data_dir / "inside")
    with pytest.raises(EngineError, match="inside the data directory"):
        tablespaces.check(data_dir, "s1")
