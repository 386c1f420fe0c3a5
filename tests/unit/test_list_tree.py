"""An engine's listing of a shard's files (``engines.base.list_tree``): what a restore
recreates, in the order the plan cuts streams. Paths sort by component (``a/x`` before
``a-b``), a skipped directory is kept empty, a link to a file is its target's bytes, a link
to a directory is left out, and a file or directory removed during the walk is not an error."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardvault_agent.engines.base import list_tree


def tree(root: Path) -> Path:
    for rel, body in {
        "PG_VERSION": b"15\n",
        "a/x": b"1",
        "a-b/x": b"22",
        "a.b/y": b"333",
        "base/1/16384": b"x" * 10,
        "base/1/16384_fsm": b"f",
        "pg_wal/000000010000000000000001": b"w" * 5,
        "pg_wal/archive_status/x.done": b"",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(body)
    (root / "empty").mkdir()
    os.symlink(root / "a.b" / "y", root / "link_to_file")
    os.symlink(root / "base", root / "link_to_dir")
    os.symlink(root / "nowhere", root / "dangling")
    return root


def test_the_listing_is_sorted_by_component_and_keeps_skipped_directories_empty(tmp_path):
    root = tree(tmp_path / "shard")
    entries = list_tree(
        root, skip_dir=lambda rel: rel == "pg_wal", skip_file=lambda rel: rel.endswith("_fsm")
    )
    assert [(e.path, e.size) for e in entries] == [
        ("PG_VERSION", 3),
        ("a/", 0),
        ("a/x", 1),
        ("a-b/", 0),
        ("a-b/x", 2),
        ("a.b/", 0),
        ("a.b/y", 3),
        ("base/", 0),
        ("base/1/", 0),
        ("base/1/16384", 10),
        ("empty/", 0),
        ("link_to_file", 3),  # the target's bytes; the links to a directory and to nothing: out
        ("pg_wal/", 0),  # skipped: recreated empty, nothing under it listed
    ]


def test_what_is_removed_during_the_walk_is_left_out(tmp_path):
    root = tree(tmp_path / "shard")

    def drop_a_database(rel: str) -> bool:  # as DROP DATABASE would, just before its walk
        if rel == "base/1":
            shutil.rmtree(root / rel)
        return False

    def drop_a_file(rel: str) -> bool:  # as a vacuum's truncation would, as it is listed
        if rel == "a.b/y":
            (root / rel).unlink()
        return False

    paths = [e.path for e in list_tree(root, skip_dir=drop_a_database, skip_file=drop_a_file)]
    assert "PG_VERSION" in paths
    assert "base/1/" in paths  # listed before it went
    assert "base/1/16384" not in paths
    assert "a.b/y" not in paths
    assert "a/x" in paths
