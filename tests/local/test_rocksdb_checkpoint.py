"""A RocksDB checkpoint that raced with a compaction (a file its MANIFEST names is missing
from the copy) does not open, so it is made again; one that never opens fails the backup by
name and leaves no copy behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from rocksdict import Options, Rdict
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines import rocksdb

from shardvault.errors import EngineError


@pytest.fixture
def adapter(tmp_path: Path) -> rocksdb.RocksdbAdapter:
    source = tmp_path / "db"
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(str(source), options)
    for i in range(5000):
        db[b"k%06d" % i] = b"v" * 100
    db.flush()
    db.close()
    config = AgentConfig(
        node_id="n1",
        cluster="c",
        engine="rocksdb",
        shards=[ShardConfig(shard_id="s1", data_dir=source)],
        state_dir=tmp_path / "state",
    )
    return rocksdb.RocksdbAdapter(config)


def racing_copy(monkeypatch: pytest.MonkeyPatch, races: int) -> list[int]:
    """``copy_database`` that loses an SST file (as a compaction would) ``races`` times."""
    calls: list[int] = []
    real = rocksdb.copy_database

    def copy(source: Path, target: Path) -> None:
        real(source, target)
        calls.append(1)
        if len(calls) <= races:
            next(target.glob("*.sst")).unlink()

    monkeypatch.setattr(rocksdb, "copy_database", copy)
    return calls


def test_a_copy_that_lost_a_file_is_made_again(adapter, tmp_path, monkeypatch):
    calls = racing_copy(monkeypatch, races=1)
    shard = adapter.config.shards[0]
    capture = adapter.checkpoint(shard, "b1", tmp_path / "work")
    assert len(calls) == 2
    assert capture.marker["keys"] == "5000"
    assert rocksdb.database_digest(capture.root) == (5000, capture.marker["digest"])
    adapter.release(shard, "b1")
    assert adapter.held_backups() == set()


def test_a_copy_that_never_opens_fails_by_name_and_holds_nothing(adapter, tmp_path, monkeypatch):
    calls = racing_copy(monkeypatch, races=rocksdb.ATTEMPTS)
    with pytest.raises(EngineError, match="no consistent copy in 5 attempts"):
        adapter.checkpoint(adapter.config.shards[0], "b1", tmp_path / "work")
    assert len(calls) == rocksdb.ATTEMPTS
    assert adapter.held_backups() == set()
    assert not (tmp_path / "state" / "rocksdb").exists() or not any(
        (tmp_path / "state" / "rocksdb").rglob("*")
    )
