"""Continuous WAL archiving (shardvault.wal.archive, shardvault_agent.wal.archiver): every WAL
file a real PostgreSQL archives through shardvault-wal-push reaches the store, compressed (sealed
when the policy says so), in batches whose indexes describe it; the spool empties; an agent
killed while archiving loses nothing.

Checked from outside the agent's report: the store's objects and indexes, the WAL files' own
page addresses, the spool and state directories, the node's inbox partition."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from shardvault_agent.keys import DataKeys

from shardvault.assurance.verify import VerifyRequest, verify
from shardvault.assurance.watch import SPOOL_STALL_SECONDS, observe
from shardvault.aws.materialize import read_batch
from shardvault.aws.readback import load_manifest
from shardvault.client import operations as ops
from shardvault.contracts import layout, wal_archive
from shardvault.contracts.models import Encryption, Phase
from shardvault.contracts.pgwal import DEFAULT_SEGMENT_SIZE, SEGMENT_NAME, gaps, segment_number
from shardvault.data.pipeline import Sealer
from shardvault.errors import BackupDamaged, ChecksumMismatch, FrameUnreadable
from shardvault.local.postgres import restored_instance
from shardvault.restore.sources import source_of

from .conftest import ARCHIVE_MARKER as MARKER
from .conftest import client_of, output


def segments_in_sequence(files: dict[str, bytes]) -> list[str]:
    """The segments run without a gap, each the segment its name says (page address)."""
    segments = sorted(n for n in files if SEGMENT_NAME.fullmatch(n))
    assert segments
    assert not gaps(segments)
    for name in segments:
        data = files[name]
        assert len(data) == DEFAULT_SEGMENT_SIZE, name
        (page_address,) = struct.unpack_from("<Q", data, 8)
        assert page_address == segment_number(name) * DEFAULT_SEGMENT_SIZE, name
    return segments


def read_all(stack: Any, batches: list[dict[str, Any]], keys: DataKeys | None = None):
    svc = stack.services()
    files: dict[str, bytes] = {}
    for index in batches:
        encryption = index.get("encryption")
        sealer = keys.sealer(Encryption.model_validate(encryption)) if encryption else None
        files.update(read_batch(svc.store_bucket, index, sealer))
    return files


def raw_objects(stack: Any, batches: list[dict[str, Any]]) -> bytes:
    svc = stack.services()
    return b"".join(
        svc.store_s3.get_object(Bucket=svc.store.bucket, Key=b["key"])["Body"].read()
        for b in batches
    )


def test_every_archived_wal_file_reaches_the_store_compressed_and_in_sequence(archiving) -> None:
    node = archiving(delay=0.5)
    node.start_agent()
    last = node.write_segments(6)
    node.wait_archived(last)
    batches = node.batches()
    files = read_all(node.stack, batches)
    segments = segments_in_sequence(files)
    assert segments[-1] == last
    assert len(segments) >= 6
    # Compressed: the mostly empty tails of switched segments shrink to almost nothing.
    stored = sum(b["stored_length"] for b in batches)
    plain = sum(f["size"] for b in batches for f in b["files"])
    assert stored < plain / 5, (stored, plain)
    assert MARKER.encode() in b"".join(files.values())  # the rows are in the archive
    assert node.leftovers() == {"state": [], "requests": []}
    # Counted for the cost model, and no backup for 'list'.
    svc = node.stack.services()
    totals = svc.catalog.archive_totals(node.cluster)
    assert totals is not None
    assert totals.batches == len(batches)
    assert totals.stored_bytes == stored
    assert svc.catalog.backups(node.cluster) == []


def test_segments_that_arrive_together_share_one_object(archiving) -> None:
    node = archiving(delay=3.0)
    last = node.write_segments(5)  # spooled before the agent starts: one batch takes them
    node.start_agent()
    node.wait_archived(last)
    batches = node.batches()
    assert len(batches) == 1, [b["key"] for b in batches]
    assert len(batches[0]["files"]) >= 5


def test_a_sealed_archive_shows_a_bucket_reader_no_plaintext(archiving) -> None:
    node = archiving(delay=0.5, encryption="kms")
    node.start_agent()
    last = node.write_segments(3)
    node.wait_archived(last)
    batches = node.batches()
    assert all(b["encryption"] and b["encryption"]["key_check"] for b in batches)
    assert MARKER.encode() not in raw_objects(node.stack, batches)
    svc = node.stack.services()
    with pytest.raises(FrameUnreadable, match="fails authentication"):  # another key
        read_batch(svc.store_bucket, batches[0], Sealer(os.urandom(32)))
    # Read as if not sealed, a nonce's first byte is taken for the codec: unknown (most), zstd
    # that does not decode, or raw bytes that fail their checksum (2 in 256): never plaintext.
    with pytest.raises((FrameUnreadable, ChecksumMismatch)):
        read_batch(svc.store_bucket, batches[0], None)
    files = read_all(node.stack, batches, DataKeys(lambda: boto3.client("kms")))
    assert segments_in_sequence(files)[-1] == last
    assert MARKER.encode() in b"".join(files.values())


def test_an_agent_killed_while_archiving_loses_no_wal_file(archiving) -> None:
    node = archiving(delay=0.2)
    node.start_agent()
    first = node.write_segments(2)
    node.wait_archived(first)
    for _ in range(3):  # killed at whatever it was doing, with WAL still coming
        node.write_segments(3)
        time.sleep(0.3)
        node.stack.stop_agent(node.node_id, kill=True)
        node.write_segments(2)
        node.start_agent()
    last = node.write_segments(1)
    names_ = node.wait_archived(last)
    segments = [n for n in names_ if SEGMENT_NAME.fullmatch(n)]
    first_number = segment_number(segments[0])
    numbers = sorted({segment_number(n) for n in segments})
    assert numbers == list(range(first_number, segment_number(last) + 1))  # no gap
    segments_in_sequence(read_all(node.stack, node.batches()))
    assert node.server.psql("SELECT failed_count FROM pg_stat_archiver") == "0"
    assert node.leftovers() == {"state": [], "requests": []}


def test_the_daily_run_expires_the_wal_no_kept_backup_needs(archiving, monkeypatch) -> None:
    """WAL before the oldest complete backup's own goes with the retention run's sweep (a dry
    run only counts it); what follows it, and every history file, stays."""
    from shardvault.aws.lambda_support import services

    node = archiving(delay=0.2)
    node.start_agent()
    before = node.write_segments(3)
    node.wait_archived(before)
    backup = node.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    wal_from = backup.record["wal_from"][node.shard_id]
    after = node.write_segments(2)
    node.wait_archived(after)
    old = [b["key"] for b in node.batches() if b["files"][-1]["name"] < wal_from]
    listing = [[f["name"] for f in b["files"]] for b in node.batches()]
    assert old  # the segments written before the backup
    history = "00000002.history"  # as a restore's promotion archives it: never expired
    svc = node.stack.services()
    key = f"{layout.archive_prefix(svc.store.prefix, node.cluster, node.shard_id)}"
    kept_index = f"{key}{history}--{history}--{'b' * 32}.json"
    body = {"key": kept_index, "files": [{"name": history, "size": 0}]}
    svc.store_s3.put_object(Bucket=svc.store.bucket, Key=kept_index, Body=json.dumps(body))
    monkeypatch.setattr(services().settings, "sweep_grace_seconds", 0.0)
    client = client_of(node.stack)

    dry = ops.run_retention(client, node.cluster, dry_run=True)

    assert dry.status == "SUCCEEDED", dry.cause
    # The sweep is store-wide: other clusters' archives (earlier tests') may expire too.
    assert dry.record["sweep"]["expired_wal"].get(node.cluster) == 2 * len(old), (
        wal_from,
        listing,
    )  # object and index
    assert {b["key"] for b in node.batches()} >= set(old)

    real = ops.run_retention(client, node.cluster, dry_run=False)

    assert real.status == "SUCCEEDED", real.cause
    kept = node.batches()
    assert not {b["key"] for b in kept} & set(old)
    assert min(f["name"] for b in kept for f in b["files"] if len(f["name"]) == 24) <= wal_from
    assert after in node.archived()
    assert kept_index in {b["key"] for b in kept}  # the history file's batch stays


def test_a_spool_nobody_archives_is_reported_and_counted_stalled(archiving) -> None:
    node = archiving(delay=0.2)
    node.stack.start_agent(node.config, {"SHARDVAULT_ARCHIVE_FUNCTION": ""})  # not set up
    node.stack.wait_for_nodes([node.node_id])
    last = node.write_segments(2)
    svc = node.stack.services()
    deadline = time.monotonic() + 60
    # PostgreSQL's archiver hands segments to the spool after pg_switch_wal returns, and the
    # heartbeat reports every few seconds: wait for both before counting what is spooled.
    while node.server.psql("SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver") < last:
        assert time.monotonic() < deadline, "PostgreSQL never handed the segments to the spool"
        time.sleep(0.2)
    assert {last} <= {p.name for p in node.spool.iterdir()}  # spooled, not archived
    while (shard := svc.nodes.get(node.node_id).shards[0]).wal_spool_bytes < 2 * (
        DEFAULT_SEGMENT_SIZE
    ):  # nothing archived, nothing lost: both segments stay in the spool
        assert time.monotonic() < deadline, ("the heartbeat never reported the spool", shard)
        time.sleep(0.2)
    log = (node.stack.root / "agents" / f"{node.node_id}.log").read_text()
    assert "no archive function is named" in log
    later = time.time() + SPOOL_STALL_SECONDS + 60
    assert observe(svc, later).stalled_spools == [f"{node.cluster}/{node.node_id}/shard-1"]


def test_verify_checks_the_archive_a_point_in_time_restore_replays(archiving) -> None:
    node = archiving(delay=0.2)
    node.start_agent()
    assert node.backup().status == "SUCCEEDED"
    written = []
    for _ in range(3):  # a batch each
        written.append(node.write_segments(1))
        node.wait_archived(written[-1])
    svc = node.stack.services()
    request = VerifyRequest(cluster=node.cluster)
    whole = verify(request, svc, time.time())
    assert whole["result"] == "ok"
    assert whole["wal_archive"][node.shard_id]["to"] == written[-1]
    (middle,) = [b for b in node.batches() if written[1] in {f["name"] for f in b["files"]}]
    bucket = svc.store.bucket
    svc.store_s3.delete_object(Bucket=bucket, Key=middle["key"])
    with pytest.raises(BackupDamaged, match=f"{middle['key']} is missing"):
        verify(request, svc, time.time())
    svc.store_s3.delete_object(Bucket=bucket, Key=layout.index_key(middle["key"]))
    with pytest.raises(BackupDamaged, match="WAL archive misses segments after"):
        verify(request, svc, time.time())


def test_an_archiving_shards_backup_takes_its_wal_from_the_archive_and_restores_alone(
    archiving, make_target
) -> None:
    """The backup holds no WAL on the source and copies none from it: its tail is the backup
    label, and Finalize copies the archive's batches into the backup, which then restores
    after the archive's own batches are gone."""
    node = archiving(delay=300.0)  # the archiver would wait five minutes: the backup hurries it
    node.config["archive_handoff_mib"] = 0  # from the archive, however little WAL it holds
    node.start_agent()
    node.server.psql("CREATE TABLE kept (n int)")
    node.server.psql("INSERT INTO kept SELECT generate_series(1, 5000)")
    node.write_segments(2)  # WAL spooled before the backup, not yet archived (the delay)
    started = time.monotonic()

    backup = node.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    assert time.monotonic() - started < 120
    log = (node.stack.root / "agents" / f"{node.node_id}.log").read_text()
    assert "the archive keeps it now (slot dropped)" in log  # it handed off
    svc = node.stack.services()
    assert backup.record["location"] == "vault"  # promoted: the copies went too
    bucket = source_of(svc, "vault")
    manifest = load_manifest(bucket, backup.record["vault_manifest_key"])
    (shard,) = manifest.shards
    (tail,) = [s for s in shard.streams if s.phase == Phase.TAIL]
    assert tail.files[0].path == "backup_label"  # read on the source: the label alone
    (label,) = [o for o in tail.objects if o.place is None]
    assert label.length == tail.files[0].size
    through = shard.marker["archived_through"]
    in_pg_wal = {f.path.removeprefix("pg_wal/") for f in tail.files[1:]}
    first, last = segment_number(shard.marker["start_wal"]), segment_number(through)
    needed = set(range(first, last + 1))
    assert {segment_number(n) for n in in_pg_wal if SEGMENT_NAME.fullmatch(n)} >= needed
    prefix = backup.record["vault_manifest_key"].rsplit("/", 1)[0] + "/"
    for obj in tail.objects[1:]:  # the batches, copied into the backup as the store holds them
        assert obj.key.startswith(prefix)
        attrs = bucket.head(obj.key)
        assert attrs["ContentLength"] == obj.stored_length
    assert verify(VerifyRequest(cluster=node.cluster), svc, time.time())["result"] == "ok"
    for batch in node.batches():  # the archive's own retention may remove them
        svc.store_s3.delete_object(Bucket=svc.store.bucket, Key=batch["key"])
        svc.store_s3.delete_object(Bucket=svc.store.bucket, Key=layout.index_key(batch["key"]))
    node.server.psql("INSERT INTO kept SELECT generate_series(1, 100)")  # after the backup
    into = make_target(nodes=1, engine="postgres")

    progress = into.restore(node.cluster)

    assert progress.status == "SUCCEEDED", progress.cause
    (restored,) = output(progress)["shards"]
    copy = restored_instance(restored)
    assert copy.psql("SELECT count(*) FROM kept") == "5000"
    assert restored["checks"]["pg_amcheck --all"] == "ok"
    assert not (Path(restored["path"]) / wal_archive.WAL_DIR).exists()  # the extras removed


def test_a_quick_backup_of_an_archiving_shard_copies_its_few_segments_itself(archiving) -> None:
    """Under ``archive_handoff_mib`` (its default, 128 MiB) the backup keeps its slot and
    copies its WAL at stop, as without archiving: sooner than the archive's round trip."""
    node = archiving()
    node.start_agent()

    backup = node.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    svc = node.stack.services()
    bucket = source_of(svc, "vault")
    manifest = load_manifest(bucket, backup.record["vault_manifest_key"])
    (shard,) = manifest.shards
    assert "archived_through" not in shard.marker
    (tail,) = [s for s in shard.streams if s.phase == Phase.TAIL]
    assert any(SEGMENT_NAME.fullmatch(f.path.removeprefix("pg_wal/")) for f in tail.files)
    assert all(o.place is None for o in tail.objects)  # its own objects, no batch copies
