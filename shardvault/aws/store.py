"""Store access: every S3 call the control plane makes goes through a ``Bucket``.

A *store* is ``s3://bucket/prefix`` plus an optional endpoint (MinIO locally); the vault and
the work bucket are buckets too. ``Bucket`` is the one storage interface: an object's bytes,
listings and deletions, multipart uploads, presigned URLs, the store's own checksums, Object
Lock and thaws, each as one method over one client and one bucket (restic's backends are
the model). Its retry policy is the client's (``s3_client``: botocore's standard mode), so
there is one; faults are injected in front of the server (``shardvault.local.s3_answers``),
never inside.

Uploads are multipart, or one PUT for an object of one part, with a full-object CRC64NVME
checksum, so the store itself can tell whether the object it holds is the one the agent
read; the signer never sees the data, only checksums.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
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
RETRY_ATTEMPTS = 5
DELETE_BATCH = 1000  # keys per DeleteObjects request (S3's limit)


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

    def bucket_through(self, client: Any) -> Bucket:
        """This store's bucket, through ``client`` (a bound one: the caller's role)."""
        return Bucket(client, self.bucket)


def s3_client(
    endpoint: str | None = None,
    credentials: tuple[str, str] | None = None,
    *,
    session_token: str | None = None,
    region: str | None = None,
    **config: Any,
) -> Any:
    """An S3 client; path-style addressing for custom endpoints (MinIO has no DNS buckets).
    Without ``credentials`` it uses the default chain (a Lambda's role on AWS);
    ``session_token`` with them: an assumed role's session; ``region``: another region's
    buckets than the stack's (a copy target's)."""
    # One retry policy for every call: botocore's standard mode (throttling and transient
    # errors, with backoff), ``RETRY_ATTEMPTS`` tries in all.
    options: dict[str, Any] = {
        "signature_version": "s3v4",
        "retries": {"mode": "standard", "max_attempts": RETRY_ATTEMPTS},
        **config,
    }
    if endpoint:
        options["s3"] = {"addressing_style": "path"}
    else:
        # The bucket's regional host (the client's region is the stack's, where it made its
        # buckets). botocore would otherwise sign URLs for the global host, which answers a
        # new bucket's requests with 307 for up to a day and which regions opened after
        # March 2019 refuse: an agent's first upload would fail.
        options["s3"] = {"addressing_style": "virtual", "us_east_1_regional_endpoint": "regional"}
    keys: dict[str, Any] = {}
    if credentials:
        keys = {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]}
    if session_token:
        keys["aws_session_token"] = session_token
    if region:
        keys["region_name"] = region
    return boto3.client("s3", endpoint_url=endpoint, config=Config(**options), **keys)


def is_missing(error: ClientError) -> bool:
    """Whether an S3 error says the object (or its key) is not there."""
    return error.response.get("Error", {}).get("Code") in MISSING


def versioned(bucket: str, key: str, version_id: str | None) -> dict[str, str]:
    """The parameters that name one object, or one version of it (``version_id``)."""
    named = {"Bucket": bucket, "Key": key}
    return (named | {"VersionId": version_id}) if version_id else named


def readable_now(head: dict[str, Any]) -> bool:
    """Whether an object's bytes can be read now, by its ``HeadObject``: not archived
    (GLACIER_IR reads at once), or archived and thawed."""
    if head.get("StorageClass") not in ARCHIVE_CLASSES:
        return True
    return 'ongoing-request="false"' in (head.get("Restore") or "")


@dataclass(frozen=True)
class Bucket:
    """One bucket through one client: the storage interface (the module docstring)."""

    client: Any = field(repr=False)
    name: str

    def _named(self, key: str, version_id: str | None = None) -> dict[str, str]:
        return versioned(self.name, key, version_id)

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    # --- objects ----------------------------------------------------------------------------
    def get(self, key: str, version_id: str | None = None, **options: Any) -> dict[str, Any]:
        """GetObject's answer (its ``Body`` streams); ``options``: e.g. ``IfNoneMatch``."""
        return self.client.get_object(**self._named(key, version_id), **options)  # type: ignore[no-any-return]

    def read(self, key: str, version_id: str | None = None) -> bytes:
        return self.get(key, version_id)["Body"].read()  # type: ignore[no-any-return]

    def head(self, key: str, version_id: str | None = None) -> dict[str, Any]:
        return self.client.head_object(**self._named(key, version_id))  # type: ignore[no-any-return]

    def put(self, key: str, body: bytes, **options: Any) -> dict[str, Any]:
        """PutObject; ``options``: its checksum, content type, class, lock."""
        return self.client.put_object(Bucket=self.name, Key=key, Body=body, **options)  # type: ignore[no-any-return]

    def upload(self, body: Any, key: str, options: dict[str, Any]) -> None:
        """Writes a stream of unknown length (a managed upload: multipart when large)."""
        self.client.upload_fileobj(body, self.name, key, ExtraArgs=options)

    def copy_from(
        self, source: Bucket, key: str, to_key: str, options: dict[str, Any], config: Any
    ) -> None:
        """Copies ``source``'s ``key`` to ``to_key`` here, within the server (CopyObject, or
        UploadPartCopy for a large one)."""
        from_ = {"Bucket": source.name, "Key": key}
        self.client.copy(from_, self.name, to_key, ExtraArgs=options, Config=config)

    def copy_within(self, key: str, to_key: str) -> None:
        """One CopyObject inside this bucket, with a full-object CRC64NVME of the copy."""
        self.client.copy_object(
            Bucket=self.name,
            Key=to_key,
            CopySource={"Bucket": self.name, "Key": key},
            ChecksumAlgorithm="CRC64NVME",
        )

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.name, Key=key)

    def delete_batch(self, objects: Sequence[tuple[str, str | None]]) -> list[dict[str, Any]]:
        """Deletes up to ``DELETE_BATCH`` (key, version) at once; the errors S3 answered."""
        named = [{"Key": k, "VersionId": v} if v else {"Key": k} for k, v in objects]
        answer = self.client.delete_objects(
            Bucket=self.name, Delete={"Objects": named, "Quiet": True}
        )
        return answer.get("Errors", [])  # type: ignore[no-any-return]

    def delete_keys(self, keys: list[str]) -> None:
        """Deletes the objects of ``keys`` in batches."""
        for start in range(0, len(keys), DELETE_BATCH):
            self.delete_batch([(k, None) for k in keys[start : start + DELETE_BATCH]])

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every object under ``prefix`` in batches; returns how many."""
        deleted = 0
        for page in self._pages("list_objects_v2", prefix):
            keys = [(o["Key"], None) for o in page.get("Contents", [])]
            if keys:
                self.delete_batch(keys)
                deleted += len(keys)
        return deleted

    # --- listings -----------------------------------------------------------------------------
    def _pages(self, operation: str, prefix: str) -> Iterator[dict[str, Any]]:
        yield from self.client.get_paginator(operation).paginate(Bucket=self.name, Prefix=prefix)

    def objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Every object under ``prefix``, as ListObjectsV2 lists it (key, size, time)."""
        for page in self._pages("list_objects_v2", prefix):
            yield from page.get("Contents", [])

    def keys(self, prefix: str) -> list[str]:
        return sorted(o["Key"] for o in self.objects(prefix))

    def holds_any(self, prefix: str) -> bool:
        """Whether any object's key begins with ``prefix`` (one short listing)."""
        found = self.client.list_objects_v2(Bucket=self.name, Prefix=prefix, MaxKeys=1)
        return bool(found.get("KeyCount"))

    def versions(self, prefix: str) -> list[tuple[str, str | None]]:
        """Every (key, version id) under ``prefix``, delete markers included; an unversioned
        bucket's ids (``null``) are None."""
        out: list[tuple[str, str | None]] = []
        for page in self._pages("list_object_versions", prefix):
            for item in page.get("Versions", []) + page.get("DeleteMarkers", []):
                version = item.get("VersionId")
                out.append((item["Key"], None if version in (None, "null") else version))
        return out

    # --- multipart uploads --------------------------------------------------------------------
    def create_upload(self, key: str) -> str:
        answer = self.client.create_multipart_upload(
            Bucket=self.name, Key=key, ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
        )
        return answer["UploadId"]  # type: ignore[no-any-return]

    def uploaded_parts(self, key: str, upload_id: str) -> dict[int, str]:
        """Part number to ETag of the parts the store already holds (resuming an upload)."""
        parts: dict[int, str] = {}
        paginator = self.client.get_paginator("list_parts")
        for page in paginator.paginate(Bucket=self.name, Key=key, UploadId=upload_id):
            parts.update({p["PartNumber"]: p["ETag"] for p in page.get("Parts", [])})
        return parts

    def complete_upload(
        self, key: str, upload_id: str, parts: list[UploadedPart], crc_b64: str
    ) -> bool:
        """Completes an upload; False when there is none (a retry after S3 completed it:
        the object's own checksum then decides)."""
        try:
            self._complete(key, upload_id, parts, crc_b64)
        except self.client.exceptions.NoSuchUpload:
            return False
        return True

    def _complete(self, key: str, upload_id: str, parts: list[UploadedPart], crc_b64: str) -> None:
        self.client.complete_multipart_upload(
            Bucket=self.name,
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

    def open_uploads(self, prefix: str) -> list[dict[str, Any]]:
        """Open multipart uploads under ``prefix``. Lists without a prefix and filters here:
        MinIO lists uploads only for an exact key, so a prefix would silently find none."""
        paginator = self.client.get_paginator("list_multipart_uploads")
        return [
            upload
            for page in paginator.paginate(Bucket=self.name)
            for upload in page.get("Uploads", [])
            if upload["Key"].startswith(prefix)
        ]

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.client.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id)

    def abort_uploads(self, prefix: str) -> int:
        """Aborts every open multipart upload under ``prefix``; returns how many."""
        uploads = self.open_uploads(prefix)
        for upload in uploads:
            self.abort_upload(upload["Key"], upload["UploadId"])
        return len(uploads)

    # --- presigned URLs (an agent holds no credentials) ---------------------------------------
    def presign_get(self, key: str, ttl: int, version_id: str | None = None) -> str:
        """A URL that reads one object (by ranges, if the reader asks); with ``version_id``,
        that version of it (S3 then authorizes s3:GetObjectVersion)."""
        return self.client.generate_presigned_url(  # type: ignore[no-any-return]
            "get_object", Params=self._named(key, version_id), ExpiresIn=ttl
        )

    def presign_put(self, key: str, ttl: int, crc_b64: str | None = None) -> str:
        """A URL that writes one object: with ``crc_b64``, only the bytes of that CRC64NVME."""
        params = {"Bucket": self.name, "Key": key}
        if crc_b64 is not None:
            params["ChecksumCRC64NVME"] = crc_b64
        return self.client.generate_presigned_url("put_object", Params=params, ExpiresIn=ttl)  # type: ignore[no-any-return]

    def presign_part(
        self, key: str, upload_id: str, part_number: int, crc_b64: str, ttl: int
    ) -> str:
        """A URL that accepts exactly one content: the bytes whose CRC64NVME is ``crc_b64``."""
        return self.client.generate_presigned_url(  # type: ignore[no-any-return]
            "upload_part",
            Params={
                "Bucket": self.name,
                "Key": key,
                "UploadId": upload_id,
                "PartNumber": part_number,
                "ChecksumCRC64NVME": crc_b64,
            },
            ExpiresIn=ttl,
        )

    # --- the store's own account of an object -------------------------------------------------
    def stored_checksum(self, key: str, version_id: str | None = None) -> tuple[str | None, int]:
        """The store's own full-object CRC64NVME of an object (or of its ``version_id``; no
        download), and its size."""
        attrs = self.client.get_object_attributes(
            **self._named(key, version_id), ObjectAttributes=["Checksum", "ObjectSize"]
        )
        checksum = attrs.get("Checksum", {})
        composite = checksum.get("ChecksumType") == "COMPOSITE"
        crc = None if composite else checksum.get("ChecksumCRC64NVME")
        return crc, attrs.get("ObjectSize", -1)

    def readback_checksum(self, key: str, version_id: str | None = None) -> tuple[str, int]:
        """CRC64NVME and size by reading the object (or its ``version_id``) back (stores
        without checksum attributes)."""
        body = self.get(key, version_id, ChecksumMode="DISABLED")["Body"]
        size = 0

        def chunks() -> Iterator[bytes]:
            nonlocal size
            for chunk in body.iter_chunks(1024 * 1024):
                size += len(chunk)
                yield chunk

        crc = crc64nvme_of_chunks(chunks())
        return crc, size

    # --- Object Lock, tags and thaws ----------------------------------------------------------
    def lock(self, key: str, version_id: str | None, mode: str, until: datetime) -> None:
        """Sets (or extends) one object's Object Lock retention."""
        self.client.put_object_retention(
            **self._named(key, version_id), Retention={"Mode": mode, "RetainUntilDate": until}
        )

    def tag(self, key: str, tags: dict[str, str]) -> None:
        tag_set = [{"Key": k, "Value": v} for k, v in tags.items()]
        self.client.put_object_tagging(Bucket=self.name, Key=key, Tagging={"TagSet": tag_set})

    def thawed(self, key: str, version_id: str | None, days: int, tier: str) -> str:
        """``readable`` (not archived, or thawed), ``thawing``, or ``requested``: a thaw of
        an archived object was asked for now, for ``days`` at ``tier``."""
        head = self.head(key, version_id)
        if readable_now(head):
            return "readable"
        if head.get("Restore"):
            return "thawing"
        self.thaw(key, version_id, days, tier)
        return "requested"

    def thaw(self, key: str, version_id: str | None, days: int, tier: str) -> None:
        """Asks for a readable copy of an archived object, for ``days``, at ``tier``."""
        self.client.restore_object(
            **self._named(key, version_id),
            RestoreRequest={"Days": days, "GlacierJobParameters": {"Tier": tier}},
        )
