"""RocksDB shards copied while their applications write: three shards, each written by a
process of its own (RocksDB's default comparator, small memtables so that flushes and
compactions run during the copy), backed up, restored into two nodes; every restored key holds
the value its writer gave it and the keys are a prefix of what was written, and the restore
checked every pair against the backup's digest. An incremental sends the SST files made since
and little else."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from rocksdict import AccessType, Options, Rdict

from shardvault.aws.readback import load_manifest
from shardvault.local import demo

from .conftest import FAST_AGENT, Cluster, names, output

WRITER = """
import sys, time
from rocksdict import Options, Rdict
options = Options(raw_mode=True)
options.create_if_missing(True)
options.set_write_buffer_size(64 * 1024)
db = Rdict(sys.argv[1], options)
start, count, pause = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
for i in range(start, start + count):
    db[b"k%09d" % i] = b"v%09d" % i * 20
    if i % 100 == 0:
        time.sleep(pause)  # 100 keys per pause: the writes go on through the backup
db.flush()
db.close()
"""


def write(path: Path, start: int, count: int, pause: float = 0.0) -> subprocess.Popen:
    command = [sys.executable, "-c", WRITER, str(path), str(start), str(count), str(pause)]
    return subprocess.Popen(command)


def check_prefix(root: Path) -> int:
    """Every key of the copy is one its writer wrote, with its value, and they are 0..n-1."""
    db = Rdict(str(root), Options(raw_mode=True), access_type=AccessType.read_only(False))
    try:
        count = 0
        for key, value in db.items():
            assert key == b"k%09d" % count, key
            assert value == b"v%09d" % count * 20, key
            count += 1
    finally:
        db.close()
    return count


@pytest.fixture
def rocks_cluster(stack, tmp_path):
    name = f"rocks{next(names)}"
    configs, sources = [], {}
    for i in (1, 2, 3):
        shard_id = f"shard-{i}"
        sources[shard_id] = tmp_path / "rocks" / f"node-{i}"
        write(sources[shard_id], 0, 2000).wait(timeout=60)  # the database exists
        shard = {"shard_id": shard_id, "role": "leader", "data_dir": str(sources[shard_id])}
        config = demo.agent_config(tmp_path, name, f"{name}-node-{i}", "rocksdb", [shard])
        configs.append(config | FAST_AGENT)
    for config in configs:
        stack.start_agent(config)
    cluster = Cluster(stack, name, tmp_path, configs, sources)
    try:
        stack.wait_for_nodes([c["node_id"] for c in configs])
        yield cluster
    finally:
        cluster.stop()


def test_rocksdb_shards_copied_under_writes_restore_into_two_nodes(rocks_cluster, make_target):
    cluster = rocks_cluster
    writers = [write(path, 2000, 60_000, pause=0.01) for path in cluster.sources.values()]
    try:
        time.sleep(1)  # the writers are flushing and compacting
        full = cluster.backup()
    finally:
        for writer in writers:
            writer.wait(timeout=120)
    assert full.status == "SUCCEEDED", full.cause
    after = [write(path, 62_000, 3000) for path in cluster.sources.values()]
    for writer in after:
        writer.wait(timeout=60)
    incremental = cluster.backup(incremental=True)
    assert incremental.status == "SUCCEEDED", incremental.cause
    assert not list(Path(cluster.configs[0]["state_dir"]).glob("rocksdb/*"))  # released

    # The incremental sent the files made since the full, not the ones it already holds.
    svc = cluster.stack.services()
    manifests = [
        load_manifest(svc.store_bucket, b.record["manifest_key"]) for b in (full, incremental)
    ]
    new_ssts, others = 0, 0
    for shard_id in cluster.sources:
        before, now = (
            {f.path: f.size for s in m.shards if s.shard_id == shard_id for t in s.streams
             for f in t.files}
            for m in manifests
        )  # fmt: skip
        ssts = {path: size for path, size in now.items() if path.endswith(".sst")}
        assert any(path in before for path in ssts)  # some SST files were there already
        new_ssts += sum(size for path, size in ssts.items() if path not in before)
        others += sum(size for path, size in now.items() if path not in ssts)
    records = {r["backup_id"]: r for r in cluster.records()}
    sent = records[incremental.record["backup_id"]]["data_bytes"]
    assert 0 < new_ssts <= sent <= new_ssts + others, (sent, new_ssts, others)

    target = make_target(nodes=2, engine="rocksdb")
    counts = []
    for backup in (full, incremental):
        restored = target.restore(cluster.name, backup_id=backup.record["backup_id"], replace=True)
        assert restored.status == "SUCCEEDED", restored.cause
        shards = output(restored)["shards"]
        assert sorted(s["shard_id"] for s in shards) == ["shard-1", "shard-2", "shard-3"]
        assert len({s["node_id"] for s in shards}) == 2
        for shard in shards:
            assert list(shard["checks"].values()) == ["ok"]
            count = check_prefix(Path(shard["path"]))
            counts.append(count)
            assert count >= 2000
            if backup is incremental:
                assert count == 65_000  # everything: the writers had finished
    assert any(count < 62_000 for count in counts[:3])  # the full was copied mid-writes
