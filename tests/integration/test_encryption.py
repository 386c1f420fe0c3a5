"""Client-side encryption: a reader of the bucket finds no plaintext, the data key is never
written down in the clear, and a restore opens every frame (issue 10)."""

from __future__ import annotations

import base64
import json
import secrets
import sqlite3
from pathlib import Path

import boto3
import pytest

from shardvault.aws.readback import load_manifest
from shardvault.client import operations as ops
from shardvault.contracts.models import Manifest
from shardvault.local.demo import table_digests

pytestmark = pytest.mark.minio


def plant(db: Path) -> bytes:
    """A row holding a random token: it stays verbatim in a compressed frame (nothing in it
    repeats), so only sealing can hide it."""
    token = secrets.token_hex(24).encode()
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS planted(secret TEXT)")
        conn.execute("INSERT INTO planted VALUES (?)", (token.decode(),))
    return token


def stored_objects(cluster, record: dict) -> tuple[Manifest, list[bytes]]:
    """The manifest and every object of a backup, read where they are (promoted: the vault)."""
    svc = cluster.stack.services()
    bucket, key = svc.store_bucket, record["manifest_key"]
    if record.get("location") == "vault":
        bucket, key = svc.vault_bucket, record["vault_manifest_key"]
    manifest = load_manifest(bucket, key)
    blobs = [
        bucket.read(obj.key)
        for shard in manifest.shards
        for stream in shard.streams
        for obj in stream.objects
    ]
    return manifest, blobs


def test_a_bucket_reader_without_the_key_finds_no_plaintext(make_cluster, make_target, policy_for):
    cluster = make_cluster(nodes=2, size_mb=2)
    tokens = [plant(path) for path in cluster.sources.values()]

    policy_for(cluster.name)  # encryption: none (the default): the control case
    plain = cluster.backup()
    assert plain.status == "SUCCEEDED", plain.cause
    _, blobs = stored_objects(cluster, record_of(cluster, plain))
    assert any(t in blob for t in tokens for blob in blobs)

    policy_for(cluster.name, encryption="kms")
    backup_execution = cluster.start_backup()
    sealed = ops.wait_backup(cluster.client, backup_execution, timeout=300)
    assert sealed.status == "SUCCEEDED", sealed.cause
    manifest, blobs = stored_objects(cluster, record_of(cluster, sealed))
    assert blobs
    assert not any(t in blob for t in tokens for blob in blobs)
    assert manifest.encryption is not None
    assert manifest.encryption.context["shardvault:cluster"] == cluster.name
    key = boto3.client("kms").decrypt(
        CiphertextBlob=base64.b64decode(manifest.encryption.wrapped_key),
        EncryptionContext=manifest.encryption.context,
    )["Plaintext"]
    forms = [key.hex(), base64.b64encode(key).decode(), repr(key)]

    target = make_target(nodes=1)
    restore_execution = target.start_restore(cluster.name, backup_id=sealed.record["backup_id"])
    restored = ops.wait_restore(cluster.client, restore_execution, timeout=300)
    assert restored.status == "SUCCEEDED", restored.cause
    for shard_id, source in cluster.sources.items():
        (db,) = target.restore_dir(0).glob(f"{shard_id}/*.db")
        assert table_digests(db) == table_digests(source)

    # The key in the clear is nowhere it could leak from: history, catalog, logs, work bucket.
    places = {
        "backup history": json.dumps(ops.execution_history(backup_execution), default=str),
        "restore history": json.dumps(ops.execution_history(restore_execution), default=str),
        "catalog": json.dumps(cluster.records() + target.records(), default=str),
        "agent logs": "".join(cluster.agent_log(c["node_id"]) for c in cluster.configs)
        + target.agent_log(0),
        "manifest": manifest.model_dump_json(),
        "work bucket": work_bucket_text(cluster),
    }
    for where, text in places.items():
        assert not any(form in text for form in forms), f"the data key appears in the {where}"


def record_of(cluster, progress: ops.Progress) -> dict:
    return next(r for r in cluster.records() if r["backup_id"] == progress.record["backup_id"])


def work_bucket_text(cluster) -> str:
    s3, bucket = boto3.client("s3"), cluster.stack.settings.work_bucket
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return "".join(
        s3.get_object(Bucket=bucket, Key=k)["Body"].read().decode(errors="replace") for k in keys
    )
