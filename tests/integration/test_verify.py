"""``shardvault verify`` checks a backup and every ancestor its restore needs where the
catalog says they are (here: the vault), without a restore; what it finds is recorded in the
backup's catalog record, and a changed object is named with exit status 1."""

from __future__ import annotations

import json
import subprocess

from shardvault.readback import load_manifest

from .conftest import run_cli


def verify_cli(stack, *args: str) -> subprocess.CompletedProcess:
    return run_cli(stack, "verify", *args)


def test_verify_checks_a_chain_in_the_vault_and_names_a_changed_object(make_cluster, policy_for):
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

    # A new version of one of the full's objects under the same key (Object Lock keeps the
    # old version, but a restore reads the newest): the incremental's chain is damaged.
    svc = cluster.stack.services()
    manifest = load_manifest(
        svc.vault_s3, svc.vault.bucket, {r["backup_id"]: r for r in cluster.records()}[full_id][
            "vault_manifest_key"]
    )  # fmt: skip
    changed = manifest.shards[0].streams[0].objects[0].key
    body = svc.vault_s3.get_object(Bucket=svc.vault.bucket, Key=changed)["Body"].read()
    svc.vault_s3.put_object(Bucket=svc.vault.bucket, Key=changed, Body=body[:-1] + b"\0")

    damaged = verify_cli(cluster.stack, cluster.name, incr_id)
    assert damaged.returncode == 1, damaged.stdout
    assert "BackupDamaged" in damaged.stderr
    assert changed in " ".join(damaged.stderr.split())
    record = {r["backup_id"]: r for r in cluster.records()}[incr_id]
    assert record["verify"]["result"] == "damaged"
    assert any(changed in p for p in record["verify"]["problems"])

    unknown = verify_cli(cluster.stack, cluster.name, "20200101T000000Z-000000")
    assert unknown.returncode == 3
    assert "BackupNotFound" in unknown.stderr
