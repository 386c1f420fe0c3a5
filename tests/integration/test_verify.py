"""``shardvault verify`` checks a backup and every ancestor its restore needs where the
catalog says they are (the vault, or the store), without a restore; what it finds is recorded
in the backup's catalog record, and a changed object is named with exit status 1. In the
vault, verify and restore read the versions promotion locked: a delete marker or a newer
version over a key (both allowed in a locked bucket) hides nothing."""

from __future__ import annotations

import json
import subprocess

from shardvault.aws.readback import load_manifest
from shardvault.client import operations as ops
from shardvault.local.demo import table_digests

from .conftest import client_of, run_cli


def verify_cli(stack, *args: str) -> subprocess.CompletedProcess:
    return run_cli(stack, "verify", *args)


def test_verify_and_restore_read_the_locked_versions_whatever_hides_them(
    make_cluster, make_target, policy_for
):
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name)  # a vault in GLACIER_IR: readable without a thaw
    full_id, incr_id = cluster.full_then_incremental()

    done = verify_cli(cluster.stack, cluster.name, "--read-data", "100", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["result"] == "ok"
    assert result["backup_id"] == incr_id  # latest
    assert [(c["backup_id"], c["location"]) for c in result["chain"]] == [
        (incr_id, "vault"),
        (full_id, "vault"),
    ]
    assert result["read"] == result["objects"] > 0  # 100%: every object read back
    record = {r["backup_id"]: r for r in cluster.records()}[incr_id]
    assert record["verify"]["result"] == "ok"
    assert record["verified_at"] > 0

    # Someone with the vault's own credentials writes over the full's first object (a new
    # version) and hides its second and the incremental's manifest behind delete markers:
    # S3 allows both in a locked bucket. Verify and restore read the versions promotion
    # locked, which are all still there.
    svc = cluster.stack.services()
    records = {r["backup_id"]: r for r in cluster.records()}
    full = load_manifest(
        svc.vault_bucket,
        records[full_id]["vault_manifest_key"],
        records[full_id]["vault_manifest_version"],
    )
    objects = [o for shard in full.shards for o in shard.objects]
    assert all(o.version_id for o in objects)  # each copy's locked version, recorded
    changed, hidden = objects[0].key, objects[1].key
    svc.vault_s3.put_object(Bucket=svc.vault.bucket, Key=changed, Body=b"not the backup")
    for key in (hidden, records[incr_id]["vault_manifest_key"]):
        svc.vault_s3.delete_object(Bucket=svc.vault.bucket, Key=key)  # a delete marker
    markers = svc.vault_s3.list_object_versions(
        Bucket=svc.vault.bucket, Prefix=f"{svc.vault.prefix}/{cluster.name}/"
    ).get("DeleteMarkers", [])
    assert {m["Key"] for m in markers} == {hidden, records[incr_id]["vault_manifest_key"]}

    again = verify_cli(cluster.stack, cluster.name, incr_id, "--read-data", "100", "--json")
    assert again.returncode == 0, again.stderr
    verified = json.loads(again.stdout)
    assert verified["result"] == "ok"
    # Intact, and said: someone wrote into the vault over these keys.
    covered = " ".join(verified["covered"])
    assert f"{changed}: a newer version covers" in covered
    assert f"{hidden}: a delete marker hides" in covered
    assert f"{records[incr_id]['vault_manifest_key']}: a delete marker hides" in covered
    shown = verify_cli(cluster.stack, cluster.name, incr_id)
    assert shown.returncode == 0, shown.stderr
    assert "were written over after promotion" in " ".join(shown.stdout.split())

    target = make_target(nodes=1)
    execution = target.start_restore(cluster.name, backup_id=incr_id)
    restored = ops.wait_restore(client_of(target.stack), execution, interval=0.2, timeout=300)
    assert restored.status == "SUCCEEDED", restored.cause
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source)


def test_verify_names_an_object_changed_in_the_store(make_cluster):
    cluster = make_cluster(nodes=1, size_mb=1)  # no vault: the backup stays in the store
    assert cluster.backup().status == "SUCCEEDED"
    (record,) = cluster.records()
    svc = cluster.stack.services()
    manifest = load_manifest(svc.store_bucket, record["manifest_key"])
    changed = manifest.shards[0].streams[0].objects[0].key
    body = svc.store_s3.get_object(Bucket=svc.store.bucket, Key=changed)["Body"].read()
    svc.store_s3.put_object(Bucket=svc.store.bucket, Key=changed, Body=body[:-1] + b"\0")

    damaged = verify_cli(cluster.stack, cluster.name, record["backup_id"])
    assert damaged.returncode == 1, damaged.stdout
    assert "BackupDamaged" in damaged.stderr
    assert changed in " ".join(damaged.stderr.split())
    (record,) = cluster.records()
    assert record["verify"]["result"] == "damaged"
    assert any(changed in p for p in record["verify"]["problems"])

    unknown = verify_cli(cluster.stack, cluster.name, "20200101T000000Z-000000")
    assert unknown.returncode == 3
    assert "BackupNotFound" in unknown.stderr


def test_an_object_the_store_finds_rotten_is_named_and_its_backup_is_not_restored(make_cluster):
    """Issue 44 (2 and 10), from outside: one byte flipped in MinIO's own file of an object
    (bitrot: MinIO breaks the body off as it serves it, while the checksum attribute it keeps
    still matches). ``verify --read-data`` names the object and records the backup damaged;
    a restore of it is then refused by name before anything is written: no restore recorded
    into the target, nothing posted to any node."""
    cluster = make_cluster(nodes=1, size_mb=2)  # no vault: the objects stay in MinIO
    assert cluster.backup().status == "SUCCEEDED"
    (record,) = cluster.records()
    svc = cluster.stack.services()
    manifest = load_manifest(svc.store_bucket, record["manifest_key"])
    rotten = max(manifest.shards[0].objects, key=lambda o: o.stored_bytes)
    stored = cluster.stack.root / "minio" / svc.store.bucket / rotten.key
    (part, *_) = sorted(stored.glob("*/part.*"))  # not inlined in xl.meta: a file of its own
    body = bytearray(part.read_bytes())
    body[len(body) // 2] ^= 0xFF
    part.write_bytes(bytes(body))

    found = verify_cli(cluster.stack, cluster.name, record["backup_id"], "--read-data", "100")
    assert found.returncode == 1, found.stdout + found.stderr
    assert "BackupDamaged" in found.stderr
    assert rotten.key in " ".join(found.stderr.split())
    assert "Traceback" not in found.stderr
    (record,) = cluster.records()
    assert record["verify"]["result"] == "damaged"
    assert any(rotten.key in p for p in record["verify"]["problems"])

    target = f"{cluster.name}-copy"
    refused = run_cli(
        cluster.stack, "restore", cluster.name, "--into", target,
        "--backup-id", record["backup_id"], "--wait",
    )  # fmt: skip
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "BackupDamaged" in refused.stderr
    assert "--accept-damaged" in " ".join(refused.stderr.split())
    assert ops.list_restores(client_of(cluster.stack), target) == []
    assert cluster.inbox_items() == []
