"""The retention proxy in front of fake-gcs-server answers as GCS does where the fake does not
(``shardvault.local.gcs_answers``): a retained object is neither deleted nor replaced, a Locked
retention is extended but never shortened or removed, and the extended date is what every
answer reports. Checked through Google's own client, and against the fake alone, so a new
pinned fake that holds retention itself shows here."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import pytest
from google.api_core import exceptions as gcs_errors
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from shardvault.local import gcs_iam
from shardvault.local.fakegcs import start_fake_gcs
from shardvault.local.gcs_answers import GcsAnswersProxy

SOON = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
LATER = SOON + timedelta(days=60)


def client_for(endpoint: str) -> storage.Client:
    return storage.Client(
        project="shardvault-test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": endpoint},
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log = tmp_path_factory.mktemp("fakegcs") / "fake-gcs.log"
    with start_fake_gcs(log) as fake, GcsAnswersProxy(fake.endpoint) as proxy:
        yield fake, proxy


@pytest.fixture
def bucket(servers):
    _, proxy = servers
    name = f"vault-{uuid.uuid4().hex[:8]}"
    return client_for(proxy.endpoint).create_bucket(name, enable_object_retention=True)


def locked(bucket, name: str, until: datetime, body: bytes = b"backup") -> storage.Blob:
    blob = bucket.blob(name)
    blob.retention.mode = "Locked"
    blob.retention.retain_until_time = until
    blob.upload_from_string(body, if_generation_match=0)
    return blob


def test_the_fake_alone_does_not_hold_retention(servers):
    """Why the proxy exists: if this fails, the pinned fake holds retention itself."""
    fake, _ = servers
    bucket = client_for(fake.endpoint).create_bucket(f"raw-{uuid.uuid4().hex[:8]}")
    locked(bucket, "k", SOON).delete()
    assert bucket.get_blob("k") is None


def test_a_retained_object_is_neither_deleted_nor_replaced(bucket, servers):
    locked(bucket, "backups/b1/data/1", SOON, b"the backup")

    with pytest.raises(gcs_errors.Forbidden) as refused:
        bucket.blob("backups/b1/data/1").delete()
    assert "retained until" in str(refused.value)
    with pytest.raises(gcs_errors.Forbidden):
        bucket.blob("backups/b1/data/1").upload_from_string(b"ransom note")

    assert bucket.blob("backups/b1/data/1").download_as_bytes() == b"the backup"


def test_an_object_whose_retention_ended_may_go(bucket):
    blob = bucket.blob("old")
    blob.upload_from_string(b"x", if_generation_match=0)  # no retention
    blob.delete()
    assert bucket.get_blob("old") is None


def test_a_locked_retention_is_extended_and_reported_extended(bucket):
    blob = locked(bucket, "k", SOON)
    blob.retention.retain_until_time = LATER
    blob.patch()

    assert bucket.get_blob("k").retention.retain_until_time == LATER
    listed = {b.name: b.retention.retain_until_time for b in bucket.list_blobs()}
    assert listed["k"] == LATER


@pytest.mark.parametrize("change", ["shorten", "unlock", "remove"])
def test_a_locked_retention_is_never_weakened(bucket, change):
    blob = locked(bucket, "k", LATER)
    if change == "shorten":
        blob.retention.retain_until_time = SOON
    elif change == "unlock":
        blob.retention.mode = "Unlocked"
    else:
        blob.retention.mode = None
        blob.retention.retain_until_time = None

    with pytest.raises(gcs_errors.Forbidden):
        blob.patch()

    held = bucket.get_blob("k").retention
    assert (held.mode, held.retain_until_time) == ("Locked", LATER)


def test_a_bucket_reports_object_retention_and_refuses_it_when_created_without(servers):
    _, proxy = servers
    client = client_for(proxy.endpoint)
    with_retention = client.create_bucket(
        f"kept-{uuid.uuid4().hex[:8]}", enable_object_retention=True
    )
    without = client.create_bucket(f"plain-{uuid.uuid4().hex[:8]}")

    assert client.get_bucket(with_retention.name).object_retention_mode == "Enabled"
    assert client.get_bucket(without.name).object_retention_mode is None
    blob = without.blob("b1/data/1")
    blob.retention.mode = "Locked"
    blob.retention.retain_until_time = datetime.now(UTC) + timedelta(days=1)
    with pytest.raises(gcs_errors.BadRequest, match="Object retention is not enabled"):
        blob.upload_from_string(b"x", if_generation_match=0)
    without.blob("b1/data/2").upload_from_string(b"x")  # without a retention: taken


@pytest.mark.parametrize(
    ("method", "url", "body", "needs"),
    [
        ("POST", "/upload/storage/v1/b/v/o?uploadType=multipart&ifGenerationMatch=0", b"{}",
         {"storage.objects.create"}),
        ("POST", "/upload/storage/v1/b/v/o?uploadType=resumable&ifGenerationMatch=0",
         b'{"retention": {}}', {"storage.objects.create", "storage.objects.setRetention"}),
        ("POST", "/upload/storage/v1/b/v/o?uploadType=multipart", b"{}",
         {"storage.objects.create", "storage.objects.delete"}),  # it may replace one
        ("PUT", "/upload/storage/v1/b/v/o?uploadType=resumable&upload_id=x", b"", set()),
        ("GET", "/storage/v1/b/v/o/a%2Fb", b"", {"storage.objects.get"}),
        ("GET", "/download/storage/v1/b/v/o/a%2Fb?alt=media", b"", {"storage.objects.get"}),
        ("GET", "/storage/v1/b/v/o", b"", {"storage.objects.list"}),
        ("GET", "/storage/v1/b/v", b"", {"storage.buckets.get"}),
        ("PATCH", "/storage/v1/b/v/o/a%2Fb", b'{"retention": {}}',
         {"storage.objects.update", "storage.objects.setRetention"}),
        ("DELETE", "/storage/v1/b/v/o/a%2Fb", b"", {"storage.objects.delete"}),
        ("POST", "/storage/v1/b", b"{}", {"storage.buckets.create"}),
        ("POST", "/storage/v1/b/v/o/a/copyTo/b/w/o/c", b"", {"unmodelled"}),
    ],
)  # fmt: skip
def test_each_call_needs_what_gcs_asks_of_it(method, url, body, needs):
    assert gcs_iam.needed(method, urlsplit(url), body) == needs


def test_a_caller_holding_the_role_is_refused_what_it_lacks(servers):
    fake, _ = servers
    role = frozenset({"storage.objects.create", "storage.objects.get", "storage.buckets.get"})
    with GcsAnswersProxy(fake.endpoint, permissions=role) as proxy:
        admin = storage.Client(
            project="t",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": proxy.endpoint},
            extra_headers={gcs_iam.ADMIN_HEADER: "1"},
        )
        bucket = admin.create_bucket(f"role-{uuid.uuid4().hex[:8]}")
        caller = client_for(proxy.endpoint).bucket(bucket.name)
        caller.blob("b1/data/1").upload_from_string(b"x", if_generation_match=0)
        assert caller.blob("b1/data/1").download_as_bytes() == b"x"
        with pytest.raises(gcs_errors.Forbidden, match=r"storage\.objects\.delete"):
            caller.blob("b1/data/1").delete()
        with pytest.raises(gcs_errors.Forbidden, match=r"storage\.objects\.list"):
            list(client_for(proxy.endpoint).list_blobs(bucket.name))
        assert len(proxy.denied) == 2
