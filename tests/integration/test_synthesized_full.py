"""Synthesized fulls (issue 47): with ``incremental.synthesized_fulls`` a scheduled full reads
only the changes since the chain's newest backup and copies the chain beneath them inside the
store; the result stands alone (its own objects, its own lock), restores into another node
count, verifies, and the older chain's staging copy goes once it is promoted. Every call runs
under the IAM the template grants (the local stack's gate)."""

from __future__ import annotations

import sqlite3

import pytest

from shardvault.aws.readback import load_manifest

from .conftest import run_cli

pytestmark = pytest.mark.minio


def change(cluster, step: int) -> None:
    """Scattered updates and new rows on every source database."""
    for db in cluster.sources.values():
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE items SET payload = randomblob(200) WHERE rowid % 89 = ?", (step,))
            conn.execute(
                "INSERT INTO items(shard, payload) SELECT shard, randomblob(300) FROM items "
                "LIMIT 40"
            )


def check_stands_alone(cluster, record: dict, chain: list[str]) -> None:
    """The vault's manifest of a synthesized full from ``chain`` names only objects under its
    own prefix, each locked, in one layer per backup of the chain and its own changes."""
    synth_id = record["backup_id"]
    svc = cluster.stack.services()
    manifest = load_manifest(
        svc.vault_bucket, record["vault_manifest_key"], record.get("vault_manifest_version")
    )
    assert manifest.kind == "full"
    assert manifest.chain is None
    assert manifest.synthesized_from == chain[-1]
    for shard in manifest.shards:
        data = next(s for s in shard.streams if s.phase == "data")
        assert [layer.backup_id for layer in data.layers] == chain
        assert data.layers[0].extents is None
        assert data.layers[1].extents is not None
        assert {o.layer for o in data.objects} == {0, 1, None}
        for obj in shard.objects:
            assert f"/{synth_id}/" in obj.key, obj.key
            head = svc.vault_s3.head_object(
                Bucket=svc.vault.bucket, Key=obj.key, VersionId=obj.version_id
            )
            assert head["ObjectLockMode"] == "GOVERNANCE"


def test_a_synthesized_full_reads_only_the_changes_and_restores_alone(
    make_cluster, make_target, policy_for
):
    cluster = make_cluster(nodes=2, size_mb=4)
    policy_for(cluster.name, incremental="{synthesized_fulls: 1}")
    first = cluster.backup()
    assert first.status == "SUCCEEDED", first.cause
    assert first.record["full_reason"].startswith("no chain to synthesize from")
    change(cluster, 0)
    incremental = cluster.backup(incremental=True)
    assert incremental.status == "SUCCEEDED", incremental.cause
    change(cluster, 1)

    synthesized = cluster.backup()  # a full, as the schedule asks for one

    assert synthesized.status == "SUCCEEDED", synthesized.cause
    record = synthesized.record
    synth_id, incr_id, first_id = (r.record["backup_id"] for r in (synthesized, incremental, first))
    assert record["kind"] == "full"
    assert record["depth"] == 0
    assert record["chain_root"] == synth_id
    assert not record.get("ancestors")
    assert record["synthesized_from"] == incr_id
    assert record["synthesized_in_row"] == 1
    # The nodes sent what an incremental sends, not the databases.
    assert record["data_bytes"] < first.record["data_bytes"] / 3
    # The vault's manifest names only the synthesized full's own objects, each of the chain's
    # data objects copied under its prefix, in layers: the full's, then the incremental's.
    check_stands_alone(cluster, record, [first_id, incr_id])
    # The chain's staging copy went once the synthesized full was in the vault; the new
    # chain's stays for the next synthesized full.
    stored = cluster.store_keys()
    assert not [k for k in stored if f"/{first_id}/" in k or f"/{incr_id}/" in k]
    assert any(f"/{synth_id}/" in k for k in stored)
    records = {r["backup_id"]: r for r in cluster.records()}
    assert not records[first_id].get("staging_kept")
    assert records[synth_id]["staging_kept"]

    verified = run_cli(cluster.stack, "verify", cluster.name, synth_id, "--read-data", "100")
    assert verified.returncode == 0, verified.stdout + verified.stderr

    target = make_target(nodes=1)
    restored = target.restore(cluster.name, backup_id=synth_id)
    assert restored.status == "SUCCEEDED", restored.cause
    target.check_tables_equal(cluster.sources)

    # One synthesized full in a row, as the policy says: the next full is read.
    change(cluster, 2)
    read = cluster.backup()
    assert read.status == "SUCCEEDED", read.cause
    assert not read.record.get("synthesized_from")
    assert "in a row were synthesized" in read.record["full_reason"]
    assert read.record["data_bytes"] > 3 * record["data_bytes"]


def test_a_requested_read_full_reads_the_database(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name, incremental="{synthesized_fulls: 3}")
    assert cluster.backup().status == "SUCCEEDED"
    change(cluster, 0)

    read = cluster.backup(read_full=True)

    assert read.status == "SUCCEEDED", read.cause
    assert not read.record.get("synthesized_from")
    assert not read.record.get("full_reason")
    manifest_key = read.record["vault_manifest_key"]
    manifest = load_manifest(cluster.stack.services().vault_bucket, manifest_key)
    assert all(not s.layers for shard in manifest.shards for s in shard.streams)


def test_an_incremental_continues_a_synthesized_full_and_restores_every_layer(
    make_cluster, make_target, policy_for
):
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name, incremental="{synthesized_fulls: 2}")
    assert cluster.backup().status == "SUCCEEDED"
    change(cluster, 0)
    synthesized = cluster.backup()
    assert synthesized.record["synthesized_from"]
    change(cluster, 1)

    last = cluster.backup(incremental=True)

    assert last.status == "SUCCEEDED", last.cause
    synth_id = synthesized.record["backup_id"]
    assert last.record["parent_id"] == synth_id
    assert last.record["chain_root"] == synth_id
    target = make_target(nodes=2)
    restored = target.restore(cluster.name, backup_id=last.record["backup_id"])
    assert restored.status == "SUCCEEDED", restored.cause
    target.check_tables_equal(cluster.sources)


def test_a_chain_object_gone_from_the_store_fails_the_synthesis_by_name_and_leaves_nothing(
    make_cluster, policy_for
):
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name, incremental="{synthesized_fulls: 1}")
    first = cluster.backup()
    assert first.status == "SUCCEEDED"
    svc = cluster.stack.services()
    first_id = first.record["backup_id"]
    (gone,) = [k for k in cluster.store_keys() if f"/{first_id}/" in k and "/data-" in k][:1]
    svc.store_s3.delete_object(Bucket=svc.store.bucket, Key=gone)
    change(cluster, 0)

    failed = cluster.backup()

    assert failed.status == "FAILED"
    assert failed.record["error"] == "ParentUnavailable"
    assert gone in failed.cause
    assert "--read-full" in failed.cause
    failed_id = failed.record["backup_id"]
    assert not [k for k in cluster.store_keys() if f"/{failed_id}/" in k]
    uploads = svc.store_s3.list_multipart_uploads(Bucket=svc.store.bucket)
    assert not [u for u in uploads.get("Uploads", []) if failed_id in u["Key"]]
    (record,) = [r for r in cluster.records() if r["backup_id"] == failed_id]
    assert record["status"] == "FAILED"
    # The next full the operator asks for reads the database and succeeds.
    again = cluster.backup(read_full=True)
    assert again.status == "SUCCEEDED", again.cause
    # Its promotion released the older chain's kept staging copy, the gone object and all.
    assert not [k for k in cluster.store_keys() if f"/{first_id}/" in k]


def test_a_synthesis_cut_short_by_its_budget_resumes_where_it_stopped(
    make_cluster, make_target, policy_for, monkeypatch
):
    """A budget too short for one copy still copies one per call, and each call skips what
    an earlier one verified: the loop ends, the full is whole."""
    from shardvault.backup import synthesis

    cluster = make_cluster(nodes=2, size_mb=2)
    policy_for(cluster.name, incremental="{synthesized_fulls: 1}")
    assert cluster.backup().status == "SUCCEEDED"
    change(cluster, 0)
    monkeypatch.setattr(cluster.stack.settings, "promote_budget_seconds", 0.0)
    calls = []
    original = synthesis.synthesize

    def counted(context, svc):
        calls.append(original(context, svc))
        return calls[-1]

    monkeypatch.setattr(synthesis, "synthesize", counted)

    synthesized = cluster.backup()

    assert synthesized.status == "SUCCEEDED", synthesized.cause
    assert synthesized.record["synthesized_from"]
    assert len(calls) == synthesized.record["synthesis_objects"] >= 2
    assert [c["copied"] for c in calls] == list(range(1, len(calls) + 1))
    target = make_target(nodes=1)
    restored = target.restore(cluster.name, backup_id=synthesized.record["backup_id"])
    assert restored.status == "SUCCEEDED", restored.cause
    target.check_tables_equal(cluster.sources)


def test_a_cluster_that_stops_synthesizing_releases_its_kept_chain(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name, incremental="{synthesized_fulls: 1}")
    first = cluster.backup()
    assert first.status == "SUCCEEDED"
    first_id = first.record["backup_id"]
    assert [k for k in cluster.store_keys() if f"/{first_id}/" in k]  # kept for a synthesis
    policy_for(cluster.name)  # synthesized_fulls: 0
    change(cluster, 0)

    incremental = cluster.backup(incremental=True)

    assert incremental.status == "SUCCEEDED", incremental.cause
    assert not [k for k in cluster.store_keys() if f"/{first_id}/" in k]
    (record,) = [r for r in cluster.records() if r["backup_id"] == first_id]
    assert not record.get("staging_kept")
