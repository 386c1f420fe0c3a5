"""Vault copies: each verified backup is also copied to the policy's GCS targets, through
Google's own client against fake-gcs-server behind the proxy that answers as GCS does on
retention. Each copy is read back from GCS (class, Locked retention, CRC32C and MD5 of the
bytes whose CRC64NVME is the manifest's); an incremental holds its chain there too; a target
that fails leaves the stack vault's copy and the other targets' in place, and says so.
"""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from google.api_core import exceptions as gcs_errors
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from shardvault.contracts.models import Manifest
from shardvault.local.demo import table_digests
from shardvault.local.ports import free_port

from .conftest import output

GLACIER_IR = "{storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}"


def vault_with(*copies: str) -> str:
    return GLACIER_IR + ", copies: [" + ", ".join(copies) + "]}"


def gcs_copy(name: str, bucket: str, storage_class: str = "NEARLINE", **more: str) -> str:
    fields = {
        "name": name,
        "kind": "gcs",
        "project": "local",
        "bucket": bucket,
        "storage_class": storage_class,
        "retention": "{days: 2}",
        **more,
    }
    return "{" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}"


@pytest.fixture
def gcs(stack):
    """A client of the stack's GCS, with ``new_bucket()`` making a bucket as an operator does."""
    client = storage.Client(
        project="local",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": stack.settings.gcs_endpoint},
    )
    made = iter(range(1000))

    def bucket() -> str:
        name = f"copies-{id(client) % 10_000}-{next(made)}-{datetime.now(UTC):%H%M%S%f}"
        client.create_bucket(name, enable_object_retention=True)
        return name

    client.new_bucket = bucket
    return client


def gcs_objects(gcs, bucket: str) -> dict[str, object]:
    return {blob.name: blob for blob in gcs.list_blobs(bucket)}


def test_a_verified_backup_is_copied_to_each_gcs_target_in_its_class_and_locked(
    make_cluster, policy_for, gcs, stack
):
    cluster = make_cluster(nodes=2, size_mb=3)
    nearline, archive = gcs.new_bucket(), gcs.new_bucket()
    policy_for(
        cluster.name,
        vault=vault_with(
            gcs_copy("near", nearline), gcs_copy("cold", archive, "ARCHIVE", prefix="vault")
        ),
    )

    backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    assert output(backup)["copies"] == {"near": "COPIED", "cold": "COPIED"}
    (record,) = cluster.records()
    assert record["location"] == "vault"
    assert "promotion" not in record
    for name, bucket, storage_class in (
        ("near", nearline, "NEARLINE"),
        ("cold", archive, "ARCHIVE"),
    ):
        copy = record["vault_copies"][name]
        assert (copy["state"], copy["bucket"], copy["storage_class"]) == (
            "COPIED",
            bucket,
            storage_class,
        )
        assert copy["retention_mode"] == "Locked"
        until = datetime.fromisoformat(copy["retain_until"])
        assert timedelta(days=1.9) < until - datetime.now(UTC) < timedelta(days=2.1)
        # What GCS holds, read from GCS: the manifest names every object, each in its class,
        # Locked at least until the recorded date, with the bytes the stack vault holds.
        held = gcs_objects(gcs, bucket)
        blob = gcs.bucket(bucket).blob(
            copy["manifest_key"], generation=int(copy["manifest_generation"])
        )
        manifest = Manifest.model_validate_json(blob.download_as_bytes())
        objects = [o for s in manifest.shards for o in s.objects]
        assert len(objects) == copy["objects"]
        assert objects
        svc = stack.services()
        vault_manifest = Manifest.model_validate_json(
            svc.vault_bucket.read(record["vault_manifest_key"], record["vault_manifest_version"])
        )
        vaulted = {o.crc64nvme: o for s in vault_manifest.shards for o in s.objects}
        for obj in objects:
            found = held[obj.key]
            assert obj.key.startswith("vault/" if name == "cold" else "shardvault/")
            assert found.storage_class == storage_class
            assert found.retention.mode == "Locked"
            assert found.retention.retain_until_time >= until
            in_vault = svc.vault_bucket.read(vaulted[obj.crc64nvme].key)
            assert found.md5_hash == base64.b64encode(hashlib.md5(in_vault).digest()).decode()
        # Locked: GCS refuses to delete a copy before its retention ends.
        with pytest.raises(gcs_errors.Forbidden):
            gcs.bucket(bucket).blob(objects[0].key).delete()
    # Every target holds it: the staging copy is gone.
    assert cluster.store_keys() == []


def test_an_incremental_holds_its_chain_in_the_target_and_a_fulls_target_skips_it(
    make_cluster, policy_for, gcs
):
    cluster = make_cluster(nodes=1, size_mb=2)
    chained, fulls = gcs.new_bucket(), gcs.new_bucket()
    policy_for(
        cluster.name,
        vault=vault_with(gcs_copy("chain", chained), gcs_copy("fulls", fulls, select="fulls")),
    )

    full_id, incremental_id = cluster.full_then_incremental()

    records = {r["backup_id"]: r for r in cluster.records()}
    incremental = records[incremental_id]["vault_copies"]
    assert incremental["chain"]["state"] == "COPIED"
    skipped = incremental["fulls"]
    assert (skipped["state"], skipped["reason"]) == ("SKIPPED", "select: fulls takes fulls only")
    assert records[full_id]["vault_copies"]["fulls"]["state"] == "COPIED"
    # The full's copy is held (in GCS, and as recorded) at least as long as the incremental's.
    until = datetime.fromisoformat(incremental["chain"]["retain_until"])
    full_copy = records[full_id]["vault_copies"]["chain"]
    assert datetime.fromisoformat(full_copy["retain_until"]) >= until
    full_prefix = full_copy["manifest_key"].rsplit("/", 1)[0]
    for name, blob in gcs_objects(gcs, chained).items():
        if name.startswith(full_prefix):
            assert blob.retention.retain_until_time >= until, name


def test_a_target_that_fails_leaves_the_vault_and_other_copies_and_says_so(
    make_cluster, policy_for, gcs, stack, monkeypatch
):
    cluster = make_cluster(nodes=1, size_mb=2)
    good = gcs.new_bucket()
    policy_for(
        cluster.name,
        vault=vault_with(gcs_copy("gone", "no-such-bucket-here"), gcs_copy("good", good)),
    )

    backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    (record,) = cluster.records()
    assert record["location"] == "vault"
    assert record["promotion"] == "PARTIAL"
    gone = record["vault_copies"]["gone"]
    assert gone["state"] == "FAILED"
    assert "no-such-bucket-here" in gone["reason"]
    assert record["vault_copies"]["good"]["state"] == "COPIED"
    assert gcs_objects(gcs, good)  # the other target's copy is there


def test_an_unreachable_gcs_leaves_the_backup_promoted_to_the_stack_vault(
    make_cluster, policy_for, gcs, stack, monkeypatch
):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", gcs.new_bucket())))
    monkeypatch.setattr(stack.settings, "gcs_endpoint", f"http://127.0.0.1:{free_port()}")

    backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    (record,) = cluster.records()
    assert (record["location"], record["promotion"]) == ("vault", "PARTIAL")
    assert record["vault_copies"]["offsite"]["state"] == "FAILED"
    assert "Connection" in record["vault_copies"]["offsite"]["reason"]


def test_a_weekly_target_takes_the_first_full_of_each_iso_week(make_cluster, policy_for, gcs):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(
        cluster.name, vault=vault_with(gcs_copy("weekly", gcs.new_bucket(), select="weekly"))
    )

    first, second = cluster.backup(), cluster.backup()

    assert (first.status, second.status) == ("SUCCEEDED", "SUCCEEDED")
    records = {r["backup_id"]: r["vault_copies"]["weekly"] for r in cluster.records()}
    assert records[first.record["backup_id"]]["state"] == "COPIED"
    skipped = records[second.record["backup_id"]]
    assert skipped["state"] == "SKIPPED"
    assert skipped["reason"] == (
        f"select: weekly, and {first.record['backup_id']} is this ISO week's copy"
    )


def test_a_restore_from_a_gcs_copy_stages_it_and_restores_into_another_node_count(
    make_cluster, make_target, policy_for, gcs, stack
):
    cluster = make_cluster(nodes=3, size_mb=3)
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", gcs.new_bucket(), "ARCHIVE")))
    _full_id, incremental_id = cluster.full_then_incremental()
    target = make_target(nodes=2)

    restored = target.restore(cluster.name, backup_id=incremental_id, from_vault="offsite")

    assert restored.status == "SUCCEEDED", restored.cause
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source)
    # What was staged for the agents is gone from the store once the restore ended.
    svc = stack.services()
    assert not svc.store_bucket.holds_any(f"{svc.store.prefix}/_staged/")


def test_a_damaged_gcs_copy_is_refused_by_name(make_cluster, make_target, policy_for, gcs, stack):
    cluster = make_cluster(nodes=1, size_mb=2)
    bucket = gcs.new_bucket()
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", bucket)))
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    copy = cluster.records()[0]["vault_copies"]["offsite"]
    manifest = Manifest.model_validate_json(
        gcs.bucket(bucket).blob(copy["manifest_key"]).download_as_bytes()
    )
    victim = next(o for s in manifest.shards for o in s.objects if o.stored_bytes > 100)
    stack.gcs.rot(bucket, victim.key)
    target = make_target(nodes=1)

    restored = target.restore(cluster.name, from_vault="offsite")

    assert restored.status == "FAILED"
    assert "ChecksumMismatch" in restored.error
    assert f"vault target 'offsite' holds a damaged copy of {victim.key}" in restored.cause
    svc = stack.services()
    assert not svc.store_bucket.holds_any(f"{svc.store.prefix}/_staged/")


def test_an_unknown_vault_target_or_one_without_the_backup_is_refused_before_anything(
    make_cluster, make_target, policy_for, gcs
):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(
        cluster.name,
        vault=vault_with(gcs_copy("offsite", gcs.new_bucket(), select="weekly")),
    )
    first, second = cluster.backup(), cluster.backup()
    assert (first.status, second.status) == ("SUCCEEDED", "SUCCEEDED")
    target = make_target(nodes=1)

    unknown = target.restore(cluster.name, from_vault="elsewhere")
    skipped = target.restore(
        cluster.name, backup_id=second.record["backup_id"], from_vault="offsite"
    )

    assert unknown.status == "FAILED"
    assert "has no vault target named 'elsewhere'" in unknown.cause
    assert "use one of stack, offsite" in unknown.cause
    assert skipped.status == "FAILED"
    assert "has no copy in vault target 'offsite' (SKIPPED: select: weekly" in skipped.cause
    assert target.records() == []  # refused at Validate: nothing recorded, nothing posted
    assert target.inbox_items() == []
