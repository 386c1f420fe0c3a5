"""S3 semantics the design relies on, checked against a real MinIO."""

from __future__ import annotations

import json
import os

import pytest
import urllib3

from shardvault import backup
from shardvault.aws.store import CHECKSUM_HEADER
from shardvault.contracts.models import FileEntry, UploadedPart
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import ChecksumMismatch

MiB = 1024 * 1024


@pytest.fixture
def store(stack):
    svc = stack.services()
    return svc, svc.store_s3, svc.store_bucket


def put(url: str, body: bytes, crc: str):
    return urllib3.PoolManager().request(
        "PUT", url, body=body, headers={CHECKSUM_HEADER: crc, "Content-Length": str(len(body))}
    )


def test_a_part_url_accepts_only_the_bytes_it_was_signed_for(store):
    _svc, _s3, bucket = store
    key = "tests/bound-url"
    good, bad = os.urandom(5 * MiB), os.urandom(5 * MiB)
    upload_id = bucket.create_upload(key)
    url = bucket.presign_part(key, upload_id, 1, crc64nvme_of_bytes(good), 300)
    try:
        # Other bytes under the signed checksum: the store rejects them (checksum mismatch).
        assert put(url, bad, crc64nvme_of_bytes(good)).status == 400
        # Other bytes with their own (unsigned) checksum: the signature does not match.
        assert put(url, bad, crc64nvme_of_bytes(bad)).status == 403
        assert put(url, good, crc64nvme_of_bytes(good)).status == 200
    finally:
        bucket.abort_upload(key, upload_id)


def test_an_object_verifies_by_its_attributes_without_download(store):
    svc, s3, bucket = store
    key = "tests/verified"
    parts = [os.urandom(5 * MiB), os.urandom(3 * MiB)]
    upload_id = bucket.create_upload(key)
    uploaded = []
    for n, body in enumerate(parts, start=1):
        crc = crc64nvme_of_bytes(body)
        response = put(bucket.presign_part(key, upload_id, n, crc, 300), body, crc)
        uploaded.append(UploadedPart(part_number=n, etag=response.headers["ETag"], crc64nvme=crc))
    whole = crc64nvme_of_bytes(b"".join(parts))
    assert bucket.complete_upload(key, upload_id, uploaded, whole)
    assert backup.verify_object(svc, key, whole, 8 * MiB) == "attributes"
    # A wrong expectation is caught (after a read-back confirms the store's answer).
    with pytest.raises(ChecksumMismatch, match="CRC64NVME"):
        backup.verify_object(svc, key, crc64nvme_of_bytes(b"other"), 8 * MiB)
    s3.delete_object(Bucket=bucket.name, Key=key)


def test_a_file_rewritten_after_packing_changes_nothing_that_is_stored(stack, tmp_path):
    """A live file rewritten between the pack and the upload: the upload sends the packed copy,
    so the stored object holds the bytes as they were read (WAL replay repairs the page)."""
    import sqlite3

    import urllib3
    from shardvault_agent.commands import Commands
    from shardvault_agent.config import AgentConfig, ShardConfig
    from shardvault_agent.engines.base import Capture
    from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
    from shardvault_agent.ratelimit import RateLimiter
    from shardvault_agent.transfer import PartSender

    from shardvault.aws.materialize import materialize
    from shardvault.contracts.commands import PackArgs, UploadArgs
    from shardvault.contracts.models import (
        Manifest,
        ManifestShard,
        ManifestStream,
        ObjectPlan,
        Phase,
    )  # fmt: skip
    from shardvault.data.planning import part_count

    svc = stack.services()
    live = tmp_path / "data" / "relation"
    live.parent.mkdir()
    live.write_bytes(os.urandom(10 * MiB) + b"row " * (5 * MiB // 4))
    db = tmp_path / "unused.db"
    sqlite3.connect(db).close()
    config = AgentConfig(
        node_id="n1", cluster="live", engine="sqlite",
        shards=[ShardConfig(shard_id="s1", path=db)], state_dir=tmp_path / "state",
    )  # fmt: skip
    sender = PartSender(http=urllib3.PoolManager(), attempts=3)
    agent = Commands(config, SqliteAdapter(config), RateLimiter(None), sender)
    files = [FileEntry(path="relation", size=live.stat().st_size)]
    capture = Capture(root=live.parent, files=files, mutable=True)
    agent.backup.files.save_capture("b1", "s1", Phase.DATA, capture, 0.0)
    item = ObjectPlan(
        backup_id="b1", cluster="live", node_id="n1", shard_id="s1", phase=Phase.DATA, index=0,
        key="backups/live/b1/s1/data-00000", stream_offset=0, length=15 * MiB,
        part_size=5 * MiB, part_count=part_count(15 * MiB, 5 * MiB),
    )  # fmt: skip

    sums = agent.backup.do_pack(PackArgs(backup_id="b1", object=item))
    as_read = live.read_bytes()
    with open(live, "r+b") as f:  # the database rewrites a page after the object was read
        f.seek(7 * MiB)
        f.write(os.urandom(8192))
    signed = backup.sign(item, sums, None, svc)
    urls = svc.get_work(signed["urls_key"])
    assert "Signature" not in json.dumps(signed)  # URLs stay out of the execution's history
    args = {"backup_id": "b1", "object": item.model_dump(), "upload_id": signed["upload_id"]}
    upload = UploadArgs.model_validate({**args, "checksums": signed["checksums"], **urls})
    sent = agent.backup.do_upload(upload)
    assert sorted(p.part_number for p in sent.parts) == [p.part_number for p in sums.parts]
    # Gone once all is stored.
    assert not list(agent.backup.files.packed_path(item).parent.glob("*.bin"))
    again = agent.backup.do_upload(upload)  # a retried task
    assert again.parts == sent.parts
    result = backup.complete(item, sums, signed["upload_id"], sent.parts, svc)
    assert result.verified_by == "attributes"
    stored = svc.store_s3.get_object(Bucket=svc.store.bucket, Key=item.key)["Body"].read()
    assert crc64nvme_of_bytes(stored) == sums.crc64nvme
    assert len(sums.parts) == 3  # 10 MiB stored raw (+1 byte a frame), the rest compressed
    assert len(stored) < 11 * MiB  # compressed
    manifest = Manifest(
        backup_id="b1", cluster="live", engine="sqlite", started_at=0, completed_at=0,
        checkpoint_skew_seconds=0, part_size=5 * MiB, bytes=15 * MiB, objects=1,
        parts=len(sums.parts), verification="", shards=[ManifestShard(
            shard_id="s1", node_id="n1", marker={}, checkpoint_at=0, streams=[ManifestStream(
                phase=Phase.DATA, files=files, objects=[result])])],
    )  # fmt: skip
    roots = materialize(manifest, svc.store_bucket, tmp_path / "readback")
    assert (roots["s1"] / "relation").read_bytes() == as_read  # the bytes as they were read


def test_a_manifest_read_again_unchanged_is_not_parsed_again(store, monkeypatch):
    # A restore reads a chain's manifests in three steps: the store answers the second read
    # with 304 (If-None-Match), and the manifest read before is used; a changed one is read.
    from shardvault.aws.readback import load_manifest
    from shardvault.contracts.models import Manifest

    _svc, s3, bucket = store
    key = "tests/manifest-cache/manifest.json"
    manifest = Manifest(
        backup_id="b1", cluster="c1", engine="sqlite", started_at=0, completed_at=0,
        checkpoint_skew_seconds=0, part_size=5 * MiB, bytes=0, objects=0, parts=0,
        verification="", shards=[],
    )  # fmt: skip
    s3.put_object(Bucket=bucket.name, Key=key, Body=manifest.model_dump_json())
    parsed = []
    parse = Manifest.model_validate_json
    monkeypatch.setattr(
        Manifest, "model_validate_json", lambda body: parsed.append(1) or parse(body)
    )

    first, second = load_manifest(bucket, key), load_manifest(bucket, key)
    assert first == second
    assert len(parsed) == 1  # the second read was answered 304
    s3.put_object(
        Bucket=bucket.name,
        Key=key,
        Body=manifest.model_copy(update={"cluster": "c2"}).model_dump_json(),
    )
    third = load_manifest(bucket, key)
    assert third.cluster == "c2"
    assert len(parsed) == 2
