"""S3 semantics the design relies on, checked against a real MinIO."""

from __future__ import annotations

import os

import pytest
import urllib3

from shardvault import backup
from shardvault.checksums import crc64nvme_of_bytes
from shardvault.errors import ChecksumMismatch
from shardvault.models import UploadedPart
from shardvault.store import CHECKSUM_HEADER, complete_upload, create_upload, presign_part

MiB = 1024 * 1024


@pytest.fixture
def store(stack):
    svc = stack.services()
    return svc, svc.store_s3, svc.store.bucket


def put(url: str, body: bytes, crc: str):
    return urllib3.PoolManager().request(
        "PUT", url, body=body, headers={CHECKSUM_HEADER: crc, "Content-Length": str(len(body))}
    )


def test_a_part_url_accepts_only_the_bytes_it_was_signed_for(store):
    _svc, s3, bucket = store
    key = "tests/bound-url"
    good, bad = os.urandom(5 * MiB), os.urandom(5 * MiB)
    upload_id = create_upload(s3, bucket, key)
    url = presign_part(s3, bucket, key, upload_id, 1, crc64nvme_of_bytes(good), 300)
    try:
        # Other bytes under the signed checksum: the store rejects them (checksum mismatch).
        assert put(url, bad, crc64nvme_of_bytes(good)).status == 400
        # Other bytes with their own (unsigned) checksum: the signature does not match.
        assert put(url, bad, crc64nvme_of_bytes(bad)).status == 403
        assert put(url, good, crc64nvme_of_bytes(good)).status == 200
    finally:
        s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)


def test_an_object_verifies_by_its_attributes_without_download(store):
    svc, s3, bucket = store
    key = "tests/verified"
    parts = [os.urandom(5 * MiB), os.urandom(3 * MiB)]
    upload_id = create_upload(s3, bucket, key)
    uploaded = []
    for n, body in enumerate(parts, start=1):
        crc = crc64nvme_of_bytes(body)
        response = put(presign_part(s3, bucket, key, upload_id, n, crc, 300), body, crc)
        uploaded.append(UploadedPart(part_number=n, etag=response.headers["ETag"], crc64nvme=crc))
    whole = crc64nvme_of_bytes(b"".join(parts))
    complete_upload(s3, bucket, key, upload_id, uploaded, whole)
    assert backup.verify_object(svc, key, whole, 8 * MiB) == "attributes"
    # A wrong expectation is caught (after a read-back confirms the store's answer).
    with pytest.raises(ChecksumMismatch, match="CRC64NVME"):
        backup.verify_object(svc, key, crc64nvme_of_bytes(b"other"), 8 * MiB)
    s3.delete_object(Bucket=bucket, Key=key)
