"""The README's first command: ``shardvault demo`` backs up a 3-node cluster (a full), changes
1 % of its rows, takes an incremental that uploads a small share of the full, restores that
incremental into 2 nodes and finds every table equal to the source."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys

import pytest

from shardvault.client.commands import local
from shardvault.local import demo

pytestmark = pytest.mark.minio


def test_the_demo_restores_its_incremental_equal_to_the_source(tmp_path):
    # Its own process, as the README runs it: a local stack's moto is per process, and the
    # test session's stack already holds the tables.
    command = [sys.executable, "-m", "shardvault.client.cli", "demo", "--size-mb", "12"]
    command += ["--dir", str(tmp_path / "demo")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)

    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    share = re.search(r"uploaded [\d.,]+ MiB: ([\d.]+)% of the full's", out)
    assert share, out
    assert float(share.group(1)) < 10  # 1 % of the rows changed
    assert len(re.findall(r"shard-\d .* yes", out)) == 3, out
    # Its last step: a restore drill, its verdict and RTO; its copy torn down.
    assert re.search(r"drill \S+ of demo: passed\s+RTO [\d.,]+ s \(start to validated\)", out), out
    assert not list((tmp_path / "demo" / "restored").glob("demo-drill-node-*/shard-*"))
    # What the restore wrote: the three shards whole, not the incremental's changes.
    restored = sorted((tmp_path / "demo" / "restored").rglob("*.db"))
    assert len(restored) == 3
    sources = sorted((tmp_path / "demo" / "data").glob("node-*/shard-*.db"))
    leaders = [s for s in sources if s.stem == f"shard-{s.parent.name.split('-')[1]}"]
    assert sorted(demo.table_digests(s)["items"] for s in leaders) == sorted(
        demo.table_digests(r)["items"] for r in restored
    )


def test_a_restored_shard_unlike_its_source_is_reported_and_fails_the_demo(tmp_path, capsys):
    shard_dir = tmp_path / "shard-1"
    shard_dir.mkdir()
    with sqlite3.connect(shard_dir / "shard-1.db") as db:
        db.execute("CREATE TABLE items(id INTEGER PRIMARY KEY, payload BLOB)")
        db.execute("INSERT INTO items(payload) VALUES (x'00')")
    shards = [{"shard_id": "shard-1", "node_id": "n1", "path": str(shard_dir)}]
    source = demo.table_digests(shard_dir / "shard-1.db")

    assert local.compare_with_source("sqlite", shards, {"shard-1": source})
    assert not local.compare_with_source("sqlite", shards, {"shard-1": {"items": "other"}})
    assert "NO" in capsys.readouterr().out
    # A shard the restore did not bring back fails it too.
    assert not local.compare_with_source("sqlite", shards, {"shard-1": source, "shard-2": source})
