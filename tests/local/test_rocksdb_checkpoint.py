"""A RocksDB checkpoint made while its owner flushes and compacts: the SST files made during
the copy are linked after its MANIFEST, so it opens at the first attempt, and the ones that
MANIFEST does not name are left out. A copy that raced anyway (a file its MANIFEST names is
missing) does not open, so it is made again; one that never opens fails the backup by name and
leaves no copy behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from rocksdict import Options, Rdict
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines import rocksdb

from shardvault.errors import EngineError


def write(source: Path, first: int, count: int, *, compact: bool = False) -> None:
    """The owner writes ``count`` keys and flushes them into a new SST file (and compacts)."""
    db = Rdict(str(source), Options(raw_mode=True))
    for i in range(first, first + count):
        db[b"k%06d" % i] = b"v" * 100
    db.flush()
    if compact:
        db.compact_range(None, None)  # the files listed before are removed
    db.close()


def opens(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Counts the copy's opens (one per attempt that got as far)."""
    calls: list[Path] = []
    real = rocksdb.read_copy

    def read_copy(root: Path) -> tuple[int, str, set[str]]:
        calls.append(root)
        return real(root)

    monkeypatch.setattr(rocksdb, "read_copy", read_copy)
    return calls


def sst_names(root: Path) -> set[str]:
    return {p.name for p in root.glob("*.sst")}


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


def test_a_flush_and_compaction_during_the_copy_is_caught_up_at_the_first_attempt(
    adapter, tmp_path, monkeypatch
):
    source = adapter.config.shards[0].data_dir
    before = sst_names(source)
    real = rocksdb.link_or_copy
    raced: list[int] = []

    def link(src: Path, dst: Path) -> None:
        if not raced:  # while the first SST file is being linked
            raced.append(1)
            write(source, 4500, 1000, compact=True)  # overlapping keys: files rewritten
        real(src, dst)

    monkeypatch.setattr(rocksdb, "link_or_copy", link)
    attempts = opens(monkeypatch)
    capture = adapter.checkpoint(adapter.config.shards[0], "b1", tmp_path / "work")
    assert raced
    assert not before & sst_names(source)  # the listed files were compacted away
    assert len(attempts) == 1
    assert capture.marker["keys"] == "5500"
    assert sst_names(capture.root) == rocksdb.read_copy(capture.root)[2]
    assert {f.path for f in capture.files if f.path.endswith(".sst")} == sst_names(capture.root)


def test_a_file_made_after_the_copys_manifest_is_left_out(adapter, tmp_path, monkeypatch):
    source = adapter.config.shards[0].data_dir
    real = rocksdb.link_new_ssts
    passes: list[int] = []

    def link_new_ssts(src: Path, dst: Path, names: list[str]) -> None:
        passes.append(1)
        if len(passes) == 2:  # the MANIFEST is copied: a flush now makes a file it does not name
            write(source, 5000, 1000)
            names = sorted(p.name for p in source.glob("*.sst"))
        real(src, dst, names)

    monkeypatch.setattr(rocksdb, "link_new_ssts", link_new_ssts)
    capture = adapter.checkpoint(adapter.config.shards[0], "b1", tmp_path / "work")
    assert capture.marker["keys"] == "5000"  # the copy is the state its MANIFEST names
    assert sst_names(source) - sst_names(capture.root)  # the new file was linked, then removed
    assert sst_names(capture.root) == rocksdb.read_copy(capture.root)[2]
