"""A shard's size in the registry: measured by walking its data, at most once a
``SIZE_TTL_SECONDS`` however often a busy agent heartbeats (the walk of a large data
directory ran beside a backup's reads in every heartbeat), and again after a restore."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from shardvault_agent import daemon
from shardvault_agent.engines.base import tree_bytes

from .support import moto_services, sqlite_agent


def test_the_size_is_measured_once_a_ttl_and_again_after_a_restore(
    tmp_path: Path, monkeypatch
) -> None:
    with moto_services(monkeypatch):
        agent = daemon.Agent(sqlite_agent(tmp_path, rows=4), nodes_table="n", inbox_table="i")
    measured: list[str] = []
    real = agent.engine.shard_bytes
    monkeypatch.setattr(
        agent.engine, "shard_bytes", lambda shard: measured.append(shard.shard_id) or real(shard)
    )
    clock = [1000.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: clock[0])
    shard = agent.commands.shards()["s1"]
    db = shard.path

    first = agent.shard_info(shard).bytes
    assert first == db.stat().st_size > 0
    with open(db, "ab") as grown:
        grown.write(b"\0" * 65536)
    clock[0] += daemon.SIZE_TTL_SECONDS - 1
    assert agent.shard_info(shard).bytes == first  # heartbeats within the TTL: no walk
    assert measured == ["s1"]
    clock[0] += 1
    assert agent.shard_info(shard).bytes == first + 65536
    assert measured == ["s1", "s1"]

    monkeypatch.setattr(agent.commands, "run", lambda command, args: {})
    monkeypatch.setattr(agent, "beat", lambda: None)
    agent.run_command({"command": "finish_restore", "args": {}})
    assert agent.shard_info(shard).bytes == first + 65536
    assert measured == ["s1", "s1", "s1"]  # a restore changes shards: measured at once


def test_tree_bytes_counts_files_and_linked_files_once_and_skips_linked_directories(
    tmp_path: Path,
) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"x" * 10)
    (tmp_path / "d" / "e" / "b").write_bytes(b"x" * 100)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "big").write_bytes(b"x" * 1000)
    os.symlink(tmp_path / "outside", tmp_path / "d" / "linked_dir")
    os.symlink(tmp_path / "outside" / "big", tmp_path / "d" / "linked_file")
    assert tree_bytes(tmp_path / "d") == 10 + 100 + 1000


def test_tree_bytes_counts_a_file_removed_during_the_walk_as_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "kept").write_bytes(b"x" * 10)
    (tmp_path / "gone").write_bytes(b"x" * 100)
    real_scandir = os.scandir

    def removing(path):  # the file goes between its listing and its stat
        entries = list(real_scandir(path))
        (tmp_path / "gone").unlink()
        return contextlib.nullcontext(entries)

    monkeypatch.setattr(os, "scandir", removing)
    assert tree_bytes(tmp_path) == 10
