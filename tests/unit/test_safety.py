"""Guards against data an agent or a store could get wrong: paths, short streams, foreign
answers, released checkpoints, tablespaces."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from shardvault_agent.commands import Commands
from shardvault_agent.config import ShardConfig
from shardvault_agent.engines.postgres import refuse_tablespaces
from shardvault_agent.engines.sqlite import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from shardvault.backup import check_listings_match_sources
from shardvault.backup.planner import check_scanned
from shardvault.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    EngineError,
    InvalidRequest,
    UnknownCommand,
)
from shardvault.materialize import StreamWriter
from shardvault.models import BackupContext, FileEntry, Phase, ShardListing, Source

from .support import sqlite_agent


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


def context() -> BackupContext:
    return BackupContext(
        backup_id="b",
        cluster="c",
        engine="sqlite",
        sources=[Source(node_id="n1", shard_ids=["s1"]), Source(node_id="n2", shard_ids=["s2"])],
        store_url="s3://bucket/p",
        started_at=0.0,
    )


def listing(shard: str, node: str) -> ShardListing:
    return ShardListing(shard_id=shard, node_id=node, phase=Phase.DATA, files=[])


def test_answers_must_come_from_the_nodes_asked():
    check_listings_match_sources(context(), [listing("s1", "n1"), listing("s2", "n2")])
    with pytest.raises(InvalidRequest, match="expected"):
        check_listings_match_sources(context(), [listing("s1", "n1"), listing("s2", "n1")])
    with pytest.raises(InvalidRequest):
        check_listings_match_sources(context(), [listing("s1", "n1")])


@pytest.fixture
def sqlite_commands(tmp_path: Path) -> Commands:
    config = sqlite_agent(tmp_path)
    return Commands(config, SqliteAdapter(config), RateLimiter(None), sender=None)


def test_a_checkpoint_after_release_is_refused_and_holds_nothing(sqlite_commands):
    args = {"backup_id": "b1", "shard_ids": ["s1"]}
    sqlite_commands.do_release(args)  # e.g. the backup failed elsewhere first
    with pytest.raises(CheckpointNotFound, match="already released"):
        sqlite_commands.do_checkpoint(args)
    state = sqlite_commands.config.state_dir
    assert not (state / "snapshots" / "b1").exists()
    assert not (state / "backups" / "b1").exists()


def test_a_retried_checkpoint_returns_the_same_listing(sqlite_commands):
    args = {"backup_id": "b2", "shard_ids": ["s1"]}
    first = sqlite_commands.do_checkpoint(args)
    assert sqlite_commands.do_checkpoint(args) == first
    sqlite_commands.do_release(args)
    assert not (sqlite_commands.config.state_dir / "snapshots" / "b2" / "s1").exists()


def test_a_checkpoint_told_the_parents_answers_with_its_scan_as_a_separate_scan_would(
    sqlite_commands,
):
    """One command where there were two: the listing carries the scan's answer (a full's:
    every byte sent), and a control plane that still sends ``scan`` after a plain checkpoint
    gets the same answer."""
    merged = sqlite_commands.do_checkpoint({"backup_id": "b3", "shard_ids": ["s1"], "parents": {}})
    (shard,) = merged["shards"]
    assert shard["delta_bytes"] is None
    assert shard["extents"] == ""
    check_scanned([merged])

    plain = sqlite_commands.do_checkpoint({"backup_id": "b4", "shard_ids": ["s1"]})
    with pytest.raises(UnknownCommand, match="without scanning it: it is older"):
        check_scanned([plain])  # planned, it would be an incremental that says nothing changed
    scanned = sqlite_commands.do_scan({"backup_id": "b4", "shard_ids": ["s1"], "parents": {}})
    check_scanned([scanned])
    same = ("files", "extents", "delta_bytes", "scan_seconds")
    assert {k: scanned["shards"][0][k] for k in same} == {k: shard[k] for k in same}


def test_postgres_tablespaces_are_refused_with_the_reason(tmp_path):
    (tmp_path / "pg_tblspc").mkdir()
    (tmp_path / "pg_tblspc" / "16384").symlink_to(tmp_path)
    shard = ShardConfig(shard_id="s1", data_dir=tmp_path, conninfo="host=/nowhere")
    with pytest.raises(EngineError, match="tablespaces"):
        refuse_tablespaces(shard)
