"""Store access: the S3 operations of a backup, against AWS S3 or any S3-compatible server.

A *store* is ``s3://bucket/prefix`` plus an optional endpoint (MinIO locally). Uploads are
multipart, or one PUT for an object of one part, with a full-object CRC64NVME checksum, so the
store itself can tell whether the object it holds is the one the agent read; the signer never
sees the data, only checksums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from shardvault.contracts.models import UploadedPart
from shardvault.data.checksums import crc64nvme_of_chunks
from shardvault.errors import InvalidRequest
from shardvault.pricing.prices import ARCHIVE_CLASSES

CHECKSUM_HEADER = "x-amz-checksum-crc64nvme"
MISSING = ("NoSuchKey", "404", "NotFound")  # how S3 and MinIO say an object is not there


@dataclass(frozen=True)
class StoreLocation:
    bucket: str
    prefix: str
    endpoint: str | None = None
    credentials: tuple[str, str] | None = field(default=None, repr=False)

    @classmethod
    def parse(
        cls, url: str, endpoint: str | None = None, credentials: tuple[str, str] | None = None
    ) -> StoreLocation:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise InvalidRequest(
                f"store URL {url!r} is not of the form s3://bucket/prefix.",
                fix="set the store to s3://<bucket>/<optional prefix>.",
            )
        return cls(parsed.netloc, parsed.path.strip("/"), endpoint or None, credentials)

    def client(self, **config: Any) -> Any:
        return s3_client(self.endpoint, self.credentials, **config)


def s3_client(
    endpoint: str | None = None, credentials: tuple[str, str] | None = None, **config: Any
) -> Any:
    """An S3 client; path-style addressing for custom endpoints (MinIO has no DNS buckets).
    Without ``credentials`` it uses the default chain (a Lambda's role on AWS)."""
    options: dict[str, Any] = {"signature_version": "s3v4", **config}
    if endpoint:
        options["s3"] = {"addressing_style": "path"}
    else:
        # The bucket's regional host (the client's region is the stack's, where it made its
        # buckets). botocore would otherwise sign URLs for the global host, which answers a
        # new bucket's requests with 307 for up to a day and which regions opened after
        # March 2019 refuse: an agent's first upload would fail.
        options["s3"] = {"addressing_style": "virtual", "us_east_1_regional_endpoint": "regional"}
    keys = {}
    if credentials:
        keys = {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]}
    return boto3.client("s3", endpoint_url=endpoint, config=Config(**options), **keys)


def is_missing(error: ClientError) -> bool:
    """Whether an S3 error says the object (or its key) is not there."""
    return error.response.get("Error", {}).get("Code") in MISSING


def create_upload(s3: Any, bucket: str, key: str) -> str:
    response = s3.create_multipart_upload(
        Bucket=bucket, Key=key, ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
    )
    return response["UploadId"]


def presign_get(s3: Any, bucket: str, key: str, ttl: int, version_id: str | None = None) -> str:
    """A URL that reads one object (by ranges, if the reader asks); with ``version_id``, that
    version of it (S3 then authorizes s3:GetObjectVersion)."""
    return s3.generate_presigned_url(
        "get_object", Params=versioned(bucket, key, version_id), ExpiresIn=ttl
    )


def versioned(bucket: str, key: str, version_id: str | None) -> dict[str, str]:
    """The parameters that name one object, or one version of it (``version_id``)."""
    named = {"Bucket": bucket, "Key": key}
    return (named | {"VersionId": version_id}) if version_id else named


def presign_put(s3: Any, bucket: str, key: str, ttl: int, crc_b64: str | None = None) -> str:
    """A URL that writes one object: with ``crc_b64``, only the bytes of that CRC64NVME."""
    params = {"Bucket": bucket, "Key": key}
    if crc_b64 is not None:
        params["ChecksumCRC64NVME"] = crc_b64
    return s3.generate_presigned_url("put_object", Params=params, ExpiresIn=ttl)


def presign_part(
    s3: Any, bucket: str, key: str, upload_id: str, part_number: int, crc_b64: str, ttl: int
) -> str:
    """A URL that accepts exactly one content: the bytes whose CRC64NVME is ``crc_b64``."""
    return s3.generate_presigned_url(
        "upload_part",
        Params={
            "Bucket": bucket,
            "Key": key,
            "UploadId": upload_id,
            "PartNumber": part_number,
            "ChecksumCRC64NVME": crc_b64,
        },
        ExpiresIn=ttl,
    )


def uploaded_parts(s3: Any, bucket: str, key: str, upload_id: str) -> dict[int, str]:
    """Part number to ETag of the parts the store already holds (resuming an upload)."""
    parts: dict[int, str] = {}
    paginator = s3.get_paginator("list_parts")
    for page in paginator.paginate(Bucket=bucket, Key=key, UploadId=upload_id):
        parts.update({p["PartNumber"]: p["ETag"] for p in page.get("Parts", [])})
    return parts


def complete_upload(
    s3: Any, bucket: str, key: str, upload_id: str, parts: list[UploadedPart], crc_b64: str
) -> None:
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        ChecksumCRC64NVME=crc_b64,
        ChecksumType="FULL_OBJECT",
        MultipartUpload={
            "Parts": [
                {"PartNumber": p.part_number, "ETag": p.etag, "ChecksumCRC64NVME": p.crc64nvme}
                for p in sorted(parts, key=lambda p: p.part_number)
            ]
        },
    )


def readable_now(head: dict[str, Any]) -> bool:
    """Whether an object's bytes can be read now, by its ``HeadObject``: not archived
    (GLACIER_IR reads at once), or archived and thawed."""
    if head.get("StorageClass") not in ARCHIVE_CLASSES:
        return True
    return 'ongoing-request="false"' in (head.get("Restore") or "")


def stored_checksum(
    s3: Any, bucket: str, key: str, version_id: str | None = None
) -> tuple[str | None, int]:
    """The store's own full-object CRC64NVME of an object (or of its ``version_id``; no
    download), and its size."""
    attrs = s3.get_object_attributes(
        **versioned(bucket, key, version_id), ObjectAttributes=["Checksum", "ObjectSize"]
    )
    checksum = attrs.get("Checksum", {})
    crc = checksum.get("ChecksumCRC64NVME") if checksum.get("ChecksumType") != "COMPOSITE" else None
    return crc, attrs.get("ObjectSize", -1)


def readback_checksum(
    s3: Any, bucket: str, key: str, version_id: str | None = None
) -> tuple[str, int]:
    """CRC64NVME and size by reading the object (or its ``version_id``) back (stores without
    checksum attributes)."""
    body = s3.get_object(**versioned(bucket, key, version_id), ChecksumMode="DISABLED")["Body"]
    size = 0

    def chunks():
        nonlocal size
        for chunk in body.iter_chunks(1024 * 1024):
            size += len(chunk)
            yield chunk

    crc = crc64nvme_of_chunks(chunks())
    return crc, size


def open_uploads(s3: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Open multipart uploads under ``prefix``. Lists without a prefix and filters here:
    MinIO lists uploads only for an exact key, so a prefix would silently find none."""
    paginator = s3.get_paginator("list_multipart_uploads")
    return [
        upload
        for page in paginator.paginate(Bucket=bucket)
        for upload in page.get("Uploads", [])
        if upload["Key"].startswith(prefix)
    ]


def abort_uploads(s3: Any, bucket: str, prefix: str) -> int:
    """Aborts every open multipart upload under ``prefix``; returns how many."""
    uploads = open_uploads(s3, bucket, prefix)
    for upload in uploads:
        s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return len(uploads)


def delete_keys(s3: Any, bucket: str, keys: list[str]) -> None:
    """Deletes the objects of ``keys`` in batches of up to 1,000."""
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        s3.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def delete_prefix(s3: Any, bucket: str, prefix: str) -> int:
    """Deletes every object under ``prefix`` in batches of up to 1,000 keys."""
    deleted = 0
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            deleted += len(keys)
    return deleted
