"""A GCS vault target's bucket (``shardvault.gcp.storage.GcsBucket``) through Google's own
client against fake-gcs-server behind its retention proxy, as GCS answers: a copy lands in its
class with a Locked retention and proves equal to the manifest's bytes; a damaged staging copy
commits nothing to GCS; a resumed copy proves the object already there; a copy held weaker
than asked is refused by name.
"""

from __future__ import annotations

import io
import os
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import ChecksumMismatch, PromotionFailed
from shardvault.gcp.storage import GcsBucket, check_held
from shardvault.local.fakegcs import start_fake_gcs
from shardvault.local.gcs_answers import GcsAnswersProxy

UNTIL = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)


@pytest.fixture(scope="module")
def gcs_client(tmp_path_factory):
    log = tmp_path_factory.mktemp("fakegcs") / "fake-gcs.log"
    with start_fake_gcs(log) as server, GcsAnswersProxy(server.endpoint) as proxy:
        yield storage.Client(
            project="shardvault-test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": proxy.endpoint},
        )


@pytest.fixture
def vault(gcs_client) -> GcsBucket:
    bucket = gcs_client.create_bucket(f"vault-{uuid.uuid4().hex[:8]}", enable_object_retention=True)
    return GcsBucket(gcs_client, bucket.name)


def source(body: bytes):
    return lambda: io.BytesIO(body)


@pytest.mark.parametrize("size", [0, 300_000, 9 * 1024 * 1024])  # 9 MiB: a resumable upload
def test_a_copy_lands_locked_in_its_class_and_proves_the_manifests_bytes(vault, size):
    body = os.urandom(size)

    copy = vault.copy_in(
        source(body), "b1/data/1", size, crc64nvme_of_bytes(body), "ARCHIVE", UNTIL
    )

    assert (copy.storage_class, copy.retention_mode, copy.retain_until) == (
        "ARCHIVE",
        "Locked",
        UNTIL,
    )
    check_held(copy, "ARCHIVE", UNTIL)
    assert vault.read_back("b1/data/1") == copy
    if size:
        assert vault.read("b1/data/1", size - 100, size) == body[-100:]


@pytest.mark.parametrize("size", [300_000, 9 * 1024 * 1024])
def test_a_damaged_staging_copy_commits_nothing_to_gcs(vault, size):
    body = os.urandom(size)
    damaged = bytearray(body)
    damaged[-1] ^= 0xFF  # the last byte: found only as the last chunk is read

    with pytest.raises(ChecksumMismatch) as refused:
        vault.copy_in(
            source(bytes(damaged)), "b1/data/1", size, crc64nvme_of_bytes(body), "NEARLINE", UNTIL
        )

    assert "Nothing was committed" in str(refused.value)
    assert vault.read_back("b1/data/1") is None  # nothing locked that is not the backup's


def test_a_resumed_copy_proves_the_object_already_there(vault):
    body = os.urandom(50_000)
    first = vault.copy_in(
        source(body), "b1/manifest.json", len(body), crc64nvme_of_bytes(body), "COLDLINE", UNTIL
    )

    again = vault.copy_in(
        source(body), "b1/manifest.json", len(body), crc64nvme_of_bytes(body), "COLDLINE", UNTIL
    )

    assert again == first  # the same generation: nothing written twice


def test_another_object_at_the_key_is_refused_not_replaced(vault):
    other, body = os.urandom(50_000), os.urandom(50_000)
    vault.copy_in(
        source(other), "b1/data/1", len(other), crc64nvme_of_bytes(other), "COLDLINE", UNTIL
    )

    with pytest.raises(ChecksumMismatch) as refused:
        vault.copy_in(
            source(body), "b1/data/1", len(body), crc64nvme_of_bytes(body), "COLDLINE", UNTIL
        )

    assert "another object holds its key" in refused.value.fix
    assert vault.read("b1/data/1", 0, 100) == other[:100]


def test_a_copy_held_weaker_than_asked_is_refused_by_name(vault):
    body = os.urandom(1000)
    copy = vault.copy_in(
        source(body), "b1/data/1", len(body), crc64nvme_of_bytes(body), "NEARLINE", None
    )

    with pytest.raises(PromotionFailed) as refused:
        check_held(copy, "ARCHIVE", UNTIL)

    assert "class NEARLINE, not ARCHIVE" in str(refused.value)
    assert "retention none" in str(refused.value)
