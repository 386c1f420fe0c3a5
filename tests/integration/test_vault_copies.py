"""Vault copies: each verified backup is also copied to the policy's GCS targets, through
Google's own client against fake-gcs-server behind the proxy that answers as GCS does on
retention. Each copy is read back from GCS (class, Locked retention, CRC32C and MD5 of the
bytes whose CRC64NVME is the manifest's); an incremental holds its chain there too; a target
that fails leaves the stack vault's copy and the other targets' in place, and says so.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta

import boto3
import pytest
from google.api_core import exceptions as gcs_errors
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from shardvault.assurance.drills import DrillRequest
from shardvault.aws.tables import Catalog, table
from shardvault.client import operations as ops
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import Manifest, VaultTarget
from shardvault.lifecycle import promote
from shardvault.local.demo import table_digests
from shardvault.local.ports import free_port

from .conftest import output, run_cli
from .test_vault import context_of

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
    """The stack's GCS as an operator sees it (not held to the copy writers' role), with
    ``new_bucket()`` making a bucket as the guide says (object retention on)."""
    client = stack.gcs_admin()
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
    assert target.records()[0]["source"] == "copy:offsite"
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source)
    # What was staged for the agents is gone from the store once the restore ended.
    svc = stack.services()
    assert not svc.store_bucket.holds_any(f"{svc.store.prefix}/_staged/")


def test_a_damaged_gcs_copy_is_refused_by_name(make_cluster, make_target, policy_for, gcs, stack):
    cluster = make_cluster(nodes=2, size_mb=2)
    bucket = gcs.new_bucket()
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", bucket)))
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    copy = cluster.records()[0]["vault_copies"]["offsite"]
    manifest = Manifest.model_validate_json(
        gcs.bucket(bucket).blob(copy["manifest_key"]).download_as_bytes()
    )
    # The last object staged: those before it are in the store when it is found damaged.
    victim = [o for s in manifest.shards for st in s.streams for o in st.objects][-1]
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


def test_a_drill_from_a_gcs_copy_proves_that_copy(make_cluster, make_target, policy_for, gcs):
    cluster = make_cluster(nodes=2, size_mb=2)
    bucket = gcs.new_bucket()
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", bucket)))
    assert cluster.backup().status == "SUCCEEDED"
    target = make_target(nodes=1)

    drill = DrillRequest(
        cluster=cluster.name, target_cluster=target.name, from_vault="offsite", keep_minutes=0
    )
    progress = ops.wait_drill(
        cluster.client, ops.start_drill(cluster.client, drill), interval=0.2, timeout=600
    )

    assert progress.status == "SUCCEEDED", progress.cause
    (record,) = Catalog(table(cluster.stack.settings.catalog_table)).drills(cluster.name)
    assert record.status == "passed"
    (restore,) = target.records()
    assert (restore["status"], restore["source"]) == ("COMPLETE", "copy:offsite")
    # The drill read GCS through objects staged in the store, and they are gone again.
    svc = cluster.stack.services()
    assert not svc.store_bucket.holds_any(f"{svc.store.prefix}/_staged/")


def test_verify_of_a_gcs_copy_finds_a_replaced_or_rotted_object(
    make_cluster, policy_for, gcs, stack
):
    cluster = make_cluster(nodes=1, size_mb=2)
    bucket = gcs.new_bucket()
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", bucket)))
    full_id, incremental_id = cluster.full_then_incremental()
    config = cluster.client

    whole = ops.run_verify(config, cluster.name, incremental_id, 100.0, from_vault="offsite")

    assert whole.status == "SUCCEEDED", whole.cause
    assert [c["location"] for c in whole.record["chain"]] == ["copy:offsite"] * 2
    assert whole.record["read"] > 0
    copy = {r["backup_id"]: r for r in cluster.records()}[incremental_id]["vault_copies"]
    assert copy["offsite"]["verify"] == "ok"
    assert "verify" not in {r["backup_id"]: r for r in cluster.records()}[incremental_id]

    # Bitrot the provider serves: found by reading back.
    manifest_key = {r["backup_id"]: r for r in cluster.records()}[full_id]["vault_copies"][
        "offsite"
    ]["manifest_key"]
    manifest = Manifest.model_validate_json(
        gcs.bucket(bucket).blob(manifest_key).download_as_bytes()
    )
    victim = next(o for s in manifest.shards for o in s.objects)
    stack.gcs.rot(bucket, victim.key)
    rotted = ops.run_verify(config, cluster.name, incremental_id, 100.0, from_vault="offsite")
    assert rotted.status == "FAILED"
    assert rotted.error == "BackupDamaged"
    assert f"{victim.key} reads back with CRC64NVME" in rotted.cause
    stack.gcs.rotted.clear()

    # An object written over behind the retention (on the fake itself): a new generation.
    behind = storage.Client(
        project="local",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": stack._fake_gcs.endpoint},
    )  # the fake itself: past the retention GCS would enforce
    behind.bucket(bucket).blob(victim.key).upload_from_string(b"x" * victim.stored_bytes)
    replaced = ops.run_verify(config, cluster.name, incremental_id, 0.0, from_vault="offsite")
    assert replaced.status == "FAILED"
    assert f"{victim.key} is version" in replaced.cause
    copy = {r["backup_id"]: r for r in cluster.records()}[incremental_id]["vault_copies"]
    assert copy["offsite"]["verify"] == "damaged"


def test_a_copy_cut_short_by_its_budget_goes_on_from_the_next_object(
    make_cluster, policy_for, gcs, stack, monkeypatch
):
    cluster = make_cluster(nodes=3, size_mb=2)
    bucket = gcs.new_bucket()
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", bucket)))
    monkeypatch.setattr(stack.settings, "promote_budget_seconds", 0.0)  # one object a call

    backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    (record,) = cluster.records()
    copy = record["vault_copies"]["offsite"]
    assert copy["state"] == "COPIED"
    assert copy["seconds"] > 0
    objects = copy["objects"]
    assert objects >= 3
    # One object a call for each target (the call that writes the stack vault's manifest
    # copies the first object to the target): the Promote task ran that often.
    history = boto3.client("stepfunctions").get_execution_history(
        executionArn=record["execution_id"], maxResults=1000
    )["events"]
    promotes = [
        e
        for e in history
        if e["type"] == "TaskStateEntered" and e["stateEnteredEventDetails"]["name"] == "Promote"
    ]
    assert len(promotes) >= 2 * objects - 1
    assert len(gcs_objects(gcs, bucket)) == objects + 1  # and the manifest


def test_check_tries_each_copy_target_as_promotion_will(make_cluster, policy_for, gcs, tmp_path):
    cluster = make_cluster(nodes=1, size_mb=1)
    good, plain = gcs.new_bucket(), f"plain-{datetime.now(UTC):%H%M%S%f}"
    gcs.create_bucket(plain)  # created without object retention
    policy_for(
        cluster.name,
        vault=vault_with(
            gcs_copy("good", good), gcs_copy("plain", plain), gcs_copy("gone", "no-such-bucket")
        ),
    )
    assert cluster.backup().status == "SUCCEEDED"

    done = run_cli(
        cluster.stack, "check", cluster.name, "--policy", str(tmp_path / "policy.yaml"), "--json"
    )

    assert done.returncode == 1, done.stdout + done.stderr
    checks = {c["check"]: c for c in json.loads(done.stdout)["checks"]}
    found = checks["vault copy target good"]
    assert found["ok"], found
    (probe,) = [b for name, b in gcs_objects(gcs, good).items() if "/check/" in name]
    assert probe.retention.mode == "Locked"  # as promotion locks, read back from GCS
    assert not checks["vault copy target plain"]["ok"]
    assert "object retention disabled" in checks["vault copy target plain"]["detail"]
    assert not checks["vault copy target gone"]["ok"]
    assert "no-such-bucket" in checks["vault copy target gone"]["detail"]
    assert "docs/guide/vault-copies.md" in checks["vault copy target gone"]["fix"]


def test_a_target_added_after_promotion_is_skipped_by_a_retried_call(
    make_cluster, policy_for, gcs, stack
):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(cluster.name)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    policy_for(cluster.name, vault=vault_with(gcs_copy("later", gcs.new_bucket())))
    record = output(backup)
    context = context_of(cluster, record, VaultTarget(storage_class="GLACIER_IR", lock_days=1))

    again = promote.promote(context, record, stack.services(), 0)  # a Lambda's retry

    assert again["remaining"] == 0
    (item,) = cluster.records()
    assert item["vault_copies"]["later"]["state"] == "SKIPPED"
    assert item["vault_copies"]["later"]["reason"] == "its staging copy was gone"
    assert "promotion" not in item


def test_every_gcs_call_of_the_copy_path_is_one_the_published_role_allows(
    make_cluster, make_target, policy_for, gcs, stack
):
    """The stack's GCS answers the functions as if they held exactly the custom role the guide
    publishes: promotion, a restore from the copy, its verify and check all pass, and a call
    outside the role (a delete) is refused by name."""
    cluster = make_cluster(nodes=1, size_mb=1)
    bucket = gcs.new_bucket()
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", bucket)))
    denied_before = len(stack.gcs.denied)
    assert cluster.backup().status == "SUCCEEDED"
    restored = make_target(nodes=1).restore(cluster.name, from_vault="offsite")
    assert restored.status == "SUCCEEDED", restored.cause
    verified = ops.run_verify(cluster.client, cluster.name, "latest", 100.0, from_vault="offsite")
    assert verified.status == "SUCCEEDED", verified.cause
    assert stack.gcs.denied[denied_before:] == []

    writer = storage.Client(
        project="local",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": stack.settings.gcs_endpoint},
    )
    name = next(iter(gcs_objects(gcs, bucket)))
    with pytest.raises(gcs_errors.Forbidden, match=r"storage\.objects\.delete"):
        writer.bucket(bucket).blob(name).delete()


def test_a_backup_expired_from_the_stack_is_restored_from_the_copy_that_outlives_it(
    make_cluster, make_target, policy_for, gcs, stack
):
    """Retention expires a backup from the store and the stack vault only: a copy keeps it
    for its own retention, and restore --from-vault reads it there, its chain with it."""
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name, vault=vault_with(gcs_copy("offsite", gcs.new_bucket())))
    full_id, incremental_id = cluster.full_then_incremental()
    catalog = Catalog(table(stack.settings.catalog_table))
    for backup_id in (full_id, incremental_id):  # as shardvault.lifecycle.expire leaves them
        expired = BackupItem.changes(status="EXPIRED", expired_at=datetime.now(UTC).timestamp())
        catalog.update(cluster.name, backup_id, expired)
    target = make_target(nodes=1)

    refused = target.restore(cluster.name, backup_id=incremental_id)
    restored = target.restore(cluster.name, from_vault="offsite")  # the newest held there

    assert refused.status == "FAILED"
    assert f"backup {incremental_id} is EXPIRED, not COMPLETE" in refused.cause
    assert restored.status == "SUCCEEDED", restored.cause
    sources = {r.get("source_backup_id"): r.get("source") for r in target.records()}
    assert sources[incremental_id] == "copy:offsite", target.records()
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source)
