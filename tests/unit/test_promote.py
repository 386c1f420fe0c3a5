"""Promotion's server-side copy as S3 does it, against moto's S3: an object of 5 GiB and more
is copied in parts (UploadPartCopy), S3 computes each copied part's CRC64NVME itself, and
the vault's copy carries the staging object's full-object checksum. (MinIO refuses such part
copies: tests/integration/test_vault.py covers the streamed fallback.)"""

from __future__ import annotations

import io
import os
from datetime import UTC, datetime, timedelta

import pytest
from boto3.s3.transfer import TransferConfig

from shardvault import promote
from shardvault.checksums import crc64nvme_of_bytes
from shardvault.models import ObjectResult, Phase, VaultTarget
from shardvault.planning import MiB
from shardvault.store import stored_checksum

from .support import moto_services

SMALL_PARTS = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)


@pytest.fixture
def svc(monkeypatch):
    with moto_services(
        monkeypatch, store_url="s3://staging-bucket/backups", vault_url="s3://vault-bucket/vault"
    ) as services:
        services.store_s3.create_bucket(Bucket="staging-bucket")
        services.vault_s3.create_bucket(Bucket="vault-bucket", ObjectLockEnabledForBucket=True)
        yield services


def test_a_large_object_is_copied_in_parts_by_the_server_with_its_checksum(svc, monkeypatch):
    data = os.urandom(12 * MiB)  # three copy parts at 5 MiB, as 5 GiB parts would be
    key = "backups/c/b1/s1/data-00000"
    svc.store_s3.upload_fileobj(
        io.BytesIO(data), "staging-bucket", key,
        ExtraArgs={"ChecksumAlgorithm": "CRC64NVME"}, Config=SMALL_PARTS,
    )  # fmt: skip
    obj = ObjectResult(
        key=key, node_id="n1", shard_id="s1", phase=Phase.DATA, index=0, stream_offset=0,
        length=len(data), part_size=5 * MiB, part_count=3, crc64nvme=crc64nvme_of_bytes(data),
        verified_by="attributes",
    )  # fmt: skip
    monkeypatch.setattr(promote, "COPY_CONFIG", SMALL_PARTS)
    part_copies, creates = [], []
    svc.vault_s3.meta.events.register(
        "before-call.s3.UploadPartCopy", lambda **kw: part_copies.append(kw["params"])
    )
    svc.vault_s3.meta.events.register(
        "before-call.s3.CreateMultipartUpload", lambda **kw: creates.append(kw["params"])
    )
    assert promote.same_server(svc)
    vault = VaultTarget(storage_class="DEEP_ARCHIVE", lock_mode="GOVERNANCE", lock_days=1)

    promote.copy_into_vault(svc, obj, vault, datetime.now(UTC) + timedelta(days=1))

    assert len(part_copies) == 3  # copied by the server, part by part: nothing streamed
    copied = promote.vault_key(svc, key)
    assert stored_checksum(svc.vault_s3, "vault-bucket", copied) == (obj.crc64nvme, len(data))
    assert svc.vault_s3.head_object(Bucket="vault-bucket", Key=copied)["StorageClass"] == (
        "DEEP_ARCHIVE"
    )
    # The upload is created locked (moto keeps no lock from CreateMultipartUpload, S3 does).
    (create,) = creates
    assert create["headers"]["x-amz-object-lock-mode"] == "GOVERNANCE"
    assert "x-amz-object-lock-retain-until-date" in create["headers"]
