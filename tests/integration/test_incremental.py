"""Incremental backups send only what changed (issue 10; restores of chains are next)."""

from __future__ import annotations

import sqlite3

import pytest

from shardvault.aws.readback import load_manifest
from shardvault.client import operations as ops

from .conftest import entered_states, record_posts, rot_in_vault

pytestmark = pytest.mark.minio


def count_upload_steps(monkeypatch) -> dict[str, int]:
    """Counts the Upload map's Sign and Complete calls (their Lambdas) from now on."""
    from shardvault import backup

    counts = {"sign": 0, "complete": 0}
    for step in counts:
        original = getattr(backup, step)

        def counted(*args, _step=step, _original=original, **kwargs):
            counts[_step] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(backup, step, counted)
    return counts


def scattered_incremental(make_cluster, policy_for, every: int):
    """A one-node cluster backed up whole, then incrementally after every ``every``-th row
    changed; returns its source database and the incremental."""
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name)
    assert cluster.backup().status == "SUCCEEDED"
    (source,) = cluster.sources.values()
    with sqlite3.connect(source) as conn:
        conn.execute(f"UPDATE items SET payload = randomblob(200) WHERE rowid % {every} = 0")
    last = cluster.backup(incremental=True)
    assert last.status == "SUCCEEDED", last.cause
    return cluster, source, last


def test_an_incremental_sends_only_the_changed_blocks(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=8)
    policy_for(cluster.name)
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    (db,) = cluster.sources.values()
    with sqlite3.connect(db) as conn:  # one row changes
        conn.execute("UPDATE items SET payload = randomblob(100) WHERE rowid = 7")

    execution = cluster.start_backup(incremental=True)
    incremental = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)

    assert incremental.status == "SUCCEEDED", incremental.cause
    assert "Flush" not in entered_states(execution)  # one node: it flushed in its checkpoint
    records = {r["backup_id"]: r for r in cluster.records()}
    child = records[incremental.record["backup_id"]]
    assert child["kind"] == "incremental"
    assert child["parent_id"] == full.record["backup_id"]
    assert child["depth"] == 1
    parent = records[full.record["backup_id"]]
    # A changed row is a few blocks: far less than a twentieth of the full's data.
    assert child["data_bytes"] < parent["data_bytes"] / 20


def test_a_small_incrementals_changes_are_packed_at_its_scan_and_upload_with_its_tail(
    make_cluster, make_target, policy_for, monkeypatch
):
    """The node packs the incremental's changes and block map right after its scan, then
    stops in the same command (the cluster's only node: no Stop map); they upload after the
    stop, in the tail's Upload map (SQLite has no tail: the only one), where no Pack task runs
    for them. The restore equals the source, and the agent keeps no packed copy once the
    backup ends."""
    from pathlib import Path

    from shardvault.local.demo import table_digests

    cluster = make_cluster(nodes=1, size_mb=4)
    policy_for(cluster.name)
    assert cluster.backup().status == "SUCCEEDED"
    (db,) = cluster.sources.values()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE items SET payload = randomblob(200) WHERE rowid % 50 = 0")

    posted: list[str] = []
    record_posts(monkeypatch, lambda command, args: posted.append(command))
    steps = count_upload_steps(monkeypatch)
    execution = cluster.start_backup(incremental=True)
    incremental = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)

    assert incremental.status == "SUCCEEDED", incremental.cause
    states = entered_states(execution)
    assert "Stop" not in states
    assert states.count("Upload") == 1
    # Both objects (the changes and the block map) came packed, with their checksums, and
    # fit one part: signed at plan, each is one PutObject with no Sign or Complete of its
    # own; CheckUploads verified both by their stored checksums and counted their progress.
    assert sorted(posted) == ["checkpoint", "release", "upload", "upload"]
    assert steps == {"sign": 0, "complete": 0}
    backup_id = incremental.record["backup_id"]
    (record,) = [r for r in cluster.records() if r["backup_id"] == backup_id]
    assert record["data_packed"] is True
    assert 0 < record["data_bytes"] < record["bytes_total"]
    assert (record["objects_done"], record["bytes_done"]) == (2, record["bytes_total"])
    svc = cluster.stack.services()
    manifest = load_manifest(svc.vault_bucket, record["vault_manifest_key"])
    (shard,) = manifest.shards
    stored = [o for o in shard.objects if f"/{backup_id}/" in o.key]  # not its parent's
    assert [(o.part_count, o.verified_by) for o in stored] == [(1, "attributes")] * 2
    assert cluster.open_uploads() == []
    (config,) = cluster.configs
    assert not list(Path(config["state_dir"]).rglob("packed/*"))  # gone at release
    target = make_target(nodes=1)
    restored = target.restore(cluster.name, backup_id=backup_id)
    assert restored.status == "SUCCEEDED", restored.cause
    (shard_id,) = cluster.sources
    (copy,) = target.restore_dir(0).glob(f"{shard_id}/*.db")
    assert table_digests(copy) == table_digests(db)


def test_a_cluster_wider_than_a_node_map_scans_apart_and_still_chains(
    make_cluster, policy_for, monkeypatch
):
    """Past 1,000 nodes a Checkpoint map cannot run every node at once: each node then scans in
    a ``scan`` command of its own, after every checkpoint (the threshold is lowered to 1 so
    that 2 nodes show it), and its map goes with the tail."""
    monkeypatch.setattr("shardvault.contracts.deployment.NODE_MAP_CONCURRENCY", 1)
    cluster = make_cluster(nodes=2, size_mb=4)
    policy_for(cluster.name)
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    for db in cluster.sources.values():
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE items SET payload = randomblob(100) WHERE rowid = 2")

    incremental = cluster.backup(incremental=True)

    assert incremental.status == "SUCCEEDED", incremental.cause
    records = {r["backup_id"]: r for r in cluster.records()}
    child, parent = records[incremental.record["backup_id"]], records[full.record["backup_id"]]
    assert child["kind"] == "incremental"
    assert 0 < child["data_bytes"] < parent["data_bytes"] / 20
    assert child["data_blockmap_bytes"] == 0  # scanned apart: the maps went with the tail
    assert child["tail_blockmap_bytes"] > 0
    logs = "".join(p.read_text() for p in cluster.stack.root.glob("agents/*.log"))
    assert f"scan:{child['backup_id']}" in logs


def test_without_its_cache_the_agent_rebuilds_the_parents_map_from_the_store(
    make_cluster, policy_for
):
    import shutil
    from pathlib import Path

    cluster = make_cluster(nodes=1, size_mb=4)
    policy_for(cluster.name)
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    cache = Path(cluster.configs[0]["state_dir"]) / "blockmaps"
    assert any(cache.rglob("*.map"))
    shutil.rmtree(cache)  # a lost or wiped state_dir

    incremental = cluster.backup(incremental=True)

    assert incremental.status == "SUCCEEDED", incremental.cause
    records = {r["backup_id"]: r for r in cluster.records()}
    child = records[incremental.record["backup_id"]]
    assert child["kind"] == "incremental"
    assert child["data_bytes"] == 0  # nothing changed, and the store's map says so

    # An incremental's own map (uploaded beside its data, not with its tail) serves the next.
    shutil.rmtree(cache)
    grandchild = cluster.backup(incremental=True)
    assert grandchild.status == "SUCCEEDED", grandchild.cause
    record = {r["backup_id"]: r for r in cluster.records()}[grandchild.record["backup_id"]]
    assert record["parent_id"] == child["backup_id"]
    assert record["data_bytes"] == 0
    assert record["data_blockmap_bytes"] > 0


def test_a_restore_of_an_incremental_assembles_its_chain(
    make_cluster, make_target, policy_for, monkeypatch
):
    from pathlib import Path

    posts: list[tuple[str, dict]] = []
    record_posts(monkeypatch, lambda command, args: posts.append((command, args)))
    cluster = make_cluster(nodes=2, size_mb=4)
    policy_for(cluster.name)
    full = cluster.backup()
    assert full.status == "SUCCEEDED"
    for step in range(3):  # three incrementals, each after some changes
        for db in cluster.sources.values():
            with sqlite3.connect(db) as conn:
                conn.execute(
                    "UPDATE items SET payload = randomblob(200) WHERE rowid % 97 = ?", (step,)
                )
                conn.execute(
                    "INSERT INTO items(shard, payload) "
                    "SELECT shard, randomblob(300) FROM items LIMIT 50"
                )
        last = cluster.backup(incremental=True)
        assert last.status == "SUCCEEDED", last.cause
    records = {r["backup_id"]: r for r in cluster.records()}
    assert records[last.record["backup_id"]]["depth"] == 3
    # Two nodes stop in the Stop map, to cut at one instant: each backup stopped both.
    assert [command for command, _ in posts].count("stop") == 2 * 4

    target = make_target(nodes=1)
    restored = target.restore(cluster.name, backup_id=last.record["backup_id"])

    assert restored.status == "SUCCEEDED", restored.cause
    target.check_tables_equal(cluster.sources)
    # Progress counts what the chain wrote, every member's objects, and ends at its totals.
    (progress,) = target.records()
    assert progress["bytes_done"] == progress["bytes_total"] == progress["bytes"]
    assert progress["objects_done"] == progress["objects_total"] == progress["objects"]
    assert progress["objects"] > records[last.record["backup_id"]]["objects"]
    # The node prefetched the newer members' objects as it prepared (its prepare command
    # lists them); the Download map then asked for the full's objects and the restored
    # backup's WAL only, each full's frame written with the newer blocks laid in (a full's
    # object before them is refused: see below).
    root = full.record["backup_id"]
    (prepare,) = [args for command, args in posts if command == "prepare_restore"]
    prefetched = {d["object"]["key"] for d in prepare["prefetch"]["downloads"]}
    asked = {args["object"]["key"] for command, args in posts if command == "download"}
    assert len(prefetched) == 6  # three incrementals, two shards
    assert not any(root in key for key in prefetched)
    assert len([key for key in asked if root in key]) >= 2  # an object per shard at least
    assert not prefetched & asked
    # The spools (the newer objects, stored) went with the restore's state.
    (config,) = target.configs
    assert not list(Path(config["state_dir"]).rglob("*.spool"))


def test_a_chain_too_large_for_an_inbox_item_reaches_the_node_by_url(
    make_cluster, make_target, policy_for, monkeypatch
):
    """A node's prepare arguments hold its shards' chains (every member's files, extents and
    objects): a long chain of scattered changes outgrows an inbox item (DynamoDB, 400 KB), so
    the dispatcher hands large arguments over as a presigned URL of their work object. The
    inline limit is lowered to 64 bytes so that a small chain shows it."""
    from shardvault.local.demo import table_digests

    monkeypatch.setattr("shardvault.workflow.dispatch.INLINE_ARGS_BYTES", 64)
    posted: list[tuple[str, dict]] = []
    record_posts(monkeypatch, lambda command, args: posted.append((command, args)))
    cluster, source, last = scattered_incremental(make_cluster, policy_for, every=13)

    target = make_target(nodes=1)
    restored = target.restore(cluster.name, backup_id=last.record["backup_id"])

    assert restored.status == "SUCCEEDED", restored.cause
    (db,) = target.restore_dir(0).glob("*/*.db")
    assert table_digests(db) == table_digests(source)
    prepares = [args for command, args in posted if command == "prepare_restore"]
    assert prepares
    for args in prepares:
        assert "shards" not in args
        assert args["args_size"] > 64
        assert args["args_url"].startswith("http")
        # The newer backup's objects it prefetches, with their URLs: by URL too.
        assert "downloads" not in args["prefetch"]
        assert args["prefetch"]["args_url"].startswith("http")


def test_a_damaged_cache_is_not_trusted(make_cluster, policy_for):
    """A cached block map whose bytes changed on the node (a disk, a hand) would make changed
    blocks look unchanged: it is checked against the manifest and fetched again."""
    from pathlib import Path

    cluster = make_cluster(nodes=1, size_mb=4)
    policy_for(cluster.name)
    assert cluster.backup().status == "SUCCEEDED"
    (cached,) = (Path(cluster.configs[0]["state_dir"]) / "blockmaps").rglob("*.map")
    damaged = bytearray(cached.read_bytes())
    damaged[-1] ^= 0xFF  # the last block's hash
    cached.write_bytes(bytes(damaged))

    incremental = cluster.backup(incremental=True)

    assert incremental.status == "SUCCEEDED", incremental.cause
    child = next(r for r in cluster.records() if r["backup_id"] == incremental.record["backup_id"])
    assert child["data_bytes"] == 0  # nothing changed, and the stored map says so


def test_an_incrementals_promotion_keeps_its_chain_locked_as_long_as_itself(
    make_cluster, policy_for
):
    """The vault copy of an incremental restores only with its parent's: promotion extends
    the parent's Object Lock (objects, block map, manifest) to the child's retain-until, as
    the vault itself reports, and the catalog records the parent's new date."""
    from datetime import datetime

    from shardvault.aws.readback import load_manifest

    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name)  # a one-day lock
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    parent_until = datetime.fromisoformat(full.record["retain_until"])
    (db,) = cluster.sources.values()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE items SET payload = randomblob(100) WHERE rowid = 3")

    child = cluster.backup(incremental=True, vault={"lock_days": 5})  # stricter than the policy

    assert child.status == "SUCCEEDED", child.cause
    assert child.record["kind"] == "incremental"
    child_until = datetime.fromisoformat(child.record["retain_until"])
    assert (child_until - parent_until).days >= 3  # the parent alone would expire first
    svc = cluster.stack.services()
    manifest_key = full.record["vault_manifest_key"]
    manifest = load_manifest(svc.vault_bucket, manifest_key)
    keys = [*(o.key for s in manifest.shards for o in s.objects), manifest_key]
    assert any("/blockmap-" in k for k in keys)
    for key in keys:
        head = svc.vault_s3.head_object(Bucket=svc.vault.bucket, Key=key)
        assert head["ObjectLockMode"] == "GOVERNANCE"
        assert head["ObjectLockRetainUntilDate"] >= child_until, key
    records = {r["backup_id"]: r for r in cluster.records()}
    recorded = datetime.fromisoformat(records[full.record["backup_id"]]["retain_until"])
    assert recorded >= child_until


def test_a_fulls_object_before_the_newer_backups_objects_is_refused(
    make_cluster, make_target, policy_for, monkeypatch
):
    """A node lays a chain's full down whole with the newer backups' blocks laid in: a full's
    object written before those arrived would miss them. The node prefetches them as it
    prepares; with that prefetch lost here (signed empty), the node refuses the full's
    objects by name rather than restore wrong data."""
    from shardvault.restore import planner

    def signing_nothing(prefetch_key, svc):
        restore_id = prefetch_key.split("/")[-3]
        return {"url_key": svc.put_urls(restore_id, prefetch_key, {"downloads": []})}

    monkeypatch.setattr(planner, "sign_prefetch", signing_nothing)
    cluster, _, last = scattered_incremental(make_cluster, policy_for, every=7)

    target = make_target(nodes=1)
    restored = target.restore(cluster.name, backup_id=last.record["backup_id"])

    assert restored.status == "FAILED"
    assert restored.error == "DownloadIncomplete"
    assert "came before" in restored.cause
    assert not list(target.restore_dir(0).glob("*/*.db"))  # nothing half-restored in place


def test_a_damaged_newer_object_fails_the_chains_restore_by_name_and_leaves_nothing(
    make_cluster, make_target, policy_for
):
    """The newer backups' objects are fetched into spools after the node's prepare answered:
    one damaged in the vault fails the restore with its own error and key (the root's
    downloads and finish report what the node recorded), and nothing of it stays on the
    node: no restored file, no spool."""
    from pathlib import Path

    cluster, _, last = scattered_incremental(make_cluster, policy_for, every=7)
    svc = cluster.stack.services()
    incremental = last.record["backup_id"]
    vault, bucket = svc.vault_s3, svc.vault.bucket  # promoted: restores read the vault
    pages = vault.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    key = sorted(k for k in keys if incremental in k and "/data-" in k)[0]
    rot_in_vault(cluster.stack, key, 100)  # the locked version itself: restores read it
    target = make_target(nodes=1)

    restored = target.restore(cluster.name, backup_id=incremental)

    assert restored.status == "FAILED"
    assert restored.error == "ChecksumMismatch", restored.cause
    assert key in restored.cause
    assert [p for p in target.restore_dir(0).rglob("*") if p.is_file()] == []
    (config,) = target.configs
    assert not list(Path(config["state_dir"]).rglob("*.spool"))
