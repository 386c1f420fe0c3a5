"""fake-gcs-server answers the official Google Cloud Storage client as GCS does, for what a
GCS vault target relies on (docs/design/vault-targets.md): an object lands in the class it
was sent with, its CRC32C and MD5 are GCS's own, a byte range reads back, an object that
exists is not replaced by an upload that asks it not to be, and the retention sent with an
object is read back.

What the fake does not do (bucket retention policies, refusing deletes under a retention)
is listed there; these tests pin what it does, so a new pinned version that changes it fails
here first. A missing binary fails with the fix in the message: never a skip.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import uuid
from datetime import UTC, datetime, timedelta

import google_crc32c
import pytest
from google.api_core import exceptions as gcs_errors
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from shardvault.local.fakegcs import BINARY_ENV, FakeGcsNotFound, start_fake_gcs
from shardvault.local.ports import port_open


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    server = start_fake_gcs(tmp_path_factory.mktemp("fakegcs") / "fake-gcs.log")
    with server:
        client = storage.Client(
            project="shardvault-test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": server.endpoint},
        )
        yield server, client


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def test_an_object_lands_in_its_class_with_gcs_checksums(gcs):
    _, client = gcs
    bucket = client.create_bucket(f"vault-{uuid.uuid4().hex[:8]}")
    body = os.urandom(300_000)
    blob = bucket.blob("backups/b1/data/000001")
    blob.storage_class = "NEARLINE"
    blob.upload_from_file(io.BytesIO(body), checksum="crc32c", if_generation_match=0)

    stored = bucket.get_blob("backups/b1/data/000001")
    assert stored is not None
    assert stored.storage_class == "NEARLINE"
    assert stored.size == len(body)
    assert stored.crc32c == b64(google_crc32c.Checksum(body).digest())
    assert stored.md5_hash == b64(hashlib.md5(body).digest())
    assert stored.download_as_bytes(start=1000, end=1999) == body[1000:2000]  # end inclusive


def test_an_upload_that_must_create_does_not_replace(gcs):
    _, client = gcs
    bucket = client.create_bucket(f"vault-{uuid.uuid4().hex[:8]}")
    bucket.blob("manifest.json").upload_from_string(b"first", if_generation_match=0)
    with pytest.raises(gcs_errors.PreconditionFailed):
        bucket.blob("manifest.json").upload_from_string(b"second", if_generation_match=0)
    assert bucket.blob("manifest.json").download_as_bytes() == b"first"


def test_the_retention_sent_with_an_object_reads_back(gcs):
    _, client = gcs
    bucket = client.create_bucket(f"vault-{uuid.uuid4().hex[:8]}")
    until = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
    blob = bucket.blob("backups/b1/manifest.json")
    blob.retention.mode = "Locked"
    blob.retention.retain_until_time = until
    blob.upload_from_string(b"{}", if_generation_match=0)

    stored = bucket.get_blob("backups/b1/manifest.json")
    assert stored is not None
    assert stored.retention.mode == "Locked"
    assert stored.retention.retain_until_time == until


def test_the_server_stops_and_frees_its_port(tmp_path):
    server = start_fake_gcs(tmp_path / "fake-gcs.log")
    port = int(server.endpoint.rsplit(":", 1)[1])
    server.stop()
    assert server.process.returncode is not None
    assert not port_open(port)


def test_a_missing_binary_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "no-such-binary"))
    with pytest.raises(FakeGcsNotFound) as missing:
        start_fake_gcs(tmp_path / "fake-gcs.log")
    assert "go install github.com/fsouza/fake-gcs-server@v1.56.1" in str(missing.value)
    assert BINARY_ENV in str(missing.value)
