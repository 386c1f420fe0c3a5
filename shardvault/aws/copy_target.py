"""An aws vault copy target: an Object Lock bucket in another AWS account (*account B*),
reached through a role there that the promote function assumes (docs/design/vault-targets.md).

Terms:

- *copy in*: one object streamed from the store into B's bucket in the target's class, locked
  in COMPLIANCE mode until its retain-until and encrypted under B's KMS key (SSE-KMS), with
  S3's full-object CRC64NVME. The stream is checked on its way (``CheckedStream``: the
  manifest's CRC64NVME before the last bytes leave), so B never commits, and never locks,
  bytes that are not the backup's. An object already there with the manifest's checksum (a
  resumed promotion's) is not written again.
- *proof*: what B's S3 reports after the copy landed: its CRC64NVME (the manifest's own
  checksum, so the proof is end to end), its size, version, class, lock and KMS key.
- *the role's reach*: B's role may put objects, set and read their retention, read them back
  and thaw them; it may not delete or shorten a lock (COMPLIANCE refuses that to anyone),
  and B's bucket policy caps what it may ask (``shardvault.aws.vault_account``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, BinaryIO

from botocore.exceptions import ClientError

from shardvault.aws.services import Services
from shardvault.aws.store import Bucket, is_missing
from shardvault.config.targets import AwsTarget
from shardvault.data.checked_stream import CheckedStream
from shardvault.errors import ChecksumMismatch, PromotionFailed
from shardvault.pricing.prices import ARCHIVE_CLASSES

COMPLIANCE = "COMPLIANCE"
PROOF = "S3 in account B reports each object's full-object CRC64NVME, the manifest's own"


@dataclass(frozen=True)
class S3Copy:
    """One object as account B's S3 reports it (the module docstring's *proof*)."""

    key: str
    size: int
    crc64nvme: str | None
    version: str | None
    storage_class: str
    retention_mode: str | None
    retain_until: datetime | None
    kms_key: str | None

    def proof(self) -> dict[str, Any]:
        return {"version": self.version, "crc64nvme": self.crc64nvme}


@dataclass(frozen=True)
class S3TargetBucket:
    """Account B's bucket through a session of its role."""

    bucket: Bucket
    kms_key: str
    account: str
    proof_text = PROOF
    retention_mode = COMPLIANCE

    @property
    def name(self) -> str:
        return self.bucket.name

    @property
    def where(self) -> str:
        return f"s3://{self.name} (account {self.account})"

    def copy_in(
        self,
        open_source: Callable[[], BinaryIO],
        key: str,
        size: int,
        expected_crc64nvme: str,
        storage_class: str,
        retain_until: datetime | None,
    ) -> S3Copy:
        """Streams ``size`` bytes from ``open_source()`` into ``key``, locked until
        ``retain_until``; returns the copy as B reports it, proven to hold the manifest's
        CRC64NVME. A copy already there with it (a resumed promotion) is kept as it is."""
        copy = self.read_back(key)
        if copy is None or (copy.crc64nvme, copy.size) != (expected_crc64nvme, size):
            stream = CheckedStream(
                open_source(), key, size, expected_crc64nvme, into=f"account {self.account}"
            )
            options: dict[str, Any] = {
                "StorageClass": storage_class,
                "ChecksumAlgorithm": "CRC64NVME",
                "ServerSideEncryption": "aws:kms",
                "SSEKMSKeyId": self.kms_key,
            }
            if retain_until is not None:
                options |= {"ObjectLockMode": COMPLIANCE, "ObjectLockRetainUntilDate": retain_until}
            self.bucket.upload(stream, key, options)
            copy = self.read_back(key)
        if copy is None or (copy.crc64nvme, copy.size) != (expected_crc64nvme, size):
            got = "nothing" if copy is None else f"{copy.size} bytes, CRC64NVME {copy.crc64nvme}"
            raise ChecksumMismatch(
                f"{self.where} reports {got} for {key}; the manifest says {size} bytes, "
                f"CRC64NVME {expected_crc64nvme}.",
                fix="the copy did not land whole: promote again (a new version is written).",
            )
        if retain_until is not None and not locked_until(copy, retain_until):
            # S3 keeps the lock a multipart upload asked for; moto does not, and a copy that
            # landed without one has only the bucket's default: lock it as asked.
            self.bucket.lock(key, copy.version, COMPLIANCE, retain_until)
            copy = self.read_back(key, copy.version) or copy
        return copy

    def read_back(self, key: str, version: str | None = None) -> S3Copy | None:
        """The object (its newest version, or ``version``) as B reports it; None: not there."""
        try:
            head = self.bucket.head(key, version)
            crc, size = self.bucket.stored_checksum(key, head.get("VersionId"))
        except ClientError as error:
            if is_missing(error):
                return None
            raise
        until = head.get("ObjectLockRetainUntilDate")
        return S3Copy(
            key=key,
            size=size,
            crc64nvme=crc,
            version=head.get("VersionId"),
            storage_class=head.get("StorageClass", "STANDARD"),
            retention_mode=head.get("ObjectLockMode"),
            retain_until=until.astimezone(UTC) if until else None,
            kms_key=head.get("SSEKMSKeyId"),
        )

    def check_held(self, copy: S3Copy, storage_class: str, retain_until: datetime | None) -> None:
        """Refuses a copy B does not hold as asked: another class, another key, or a lock
        that is not COMPLIANCE or ends sooner."""
        problems = []
        if copy.storage_class != storage_class:
            problems.append(f"class {copy.storage_class}, not {storage_class}")
        if copy.kms_key != self.kms_key:
            problems.append(f"encrypted under {copy.kms_key or 'no KMS key'}, not {self.kms_key}")
        if retain_until is not None and not locked_until(copy, retain_until):
            problems.append(
                f"lock {copy.retention_mode or 'none'} until {copy.retain_until}, not "
                f"COMPLIANCE until {retain_until.isoformat()}"
            )
        if problems:
            raise PromotionFailed(
                f"{self.where} holds {copy.key} with {'; '.join(problems)}.",
                fix="check the bucket (Object Lock enabled, default encryption under the "
                "target's kms_key) and the role's grants in account B; the backup stays in "
                "the stack vault.",
            )

    def extend(self, key: str, until: datetime, version: str | None = None) -> S3Copy:
        """Extends a copy's COMPLIANCE lock to ``until`` (S3 lets a lock be extended, never
        shortened) unless it already reaches that far; returns it as read back."""
        copy = self.read_back(key, version)
        if copy is None:
            raise PromotionFailed(
                f"{self.where} holds no {key}, which a newer incremental's chain needs.",
                fix="start a full backup (a new chain); the incremental stays in the stack vault.",
            )
        if copy.retain_until is not None and copy.retain_until >= until:
            return copy
        self.bucket.lock(key, copy.version, COMPLIANCE, until)
        return self.read_back(key, copy.version) or copy

    def read_all(self, key: str, version: str | None = None) -> bytes:
        return self.bucket.read(key, version)

    def open(self, key: str, version: str | None = None) -> BinaryIO:
        return self.bucket.get(key, version)["Body"]  # type: ignore[no-any-return]

    def readable_class(self, storage_class: str) -> str:
        """GLACIER and DEEP_ARCHIVE need a thaw before a read: a manifest goes to STANDARD
        (a few KiB), as the stack vault's does."""
        return "STANDARD" if storage_class in ARCHIVE_CLASSES else storage_class

    def thawed(self, key: str, version: str | None, days: int, tier: str) -> str:
        """``readable`` (not archived, or thawed), ``thawing``, or ``requested``: an archived
        copy is thawed in account B (the role's s3:RestoreObject) before it is staged."""
        return self.bucket.thawed(key, version, days, tier)

    def read(self, key: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes ``[start, end)`` of an object."""
        body = self.bucket.get(key, version, Range=f"bytes={start}-{end - 1}")["Body"]
        return body.read()  # type: ignore[no-any-return]


def locked_until(copy: S3Copy, until: datetime) -> bool:
    """Whether the copy is held in COMPLIANCE mode at least until ``until``."""
    return (
        copy.retention_mode == COMPLIANCE
        and copy.retain_until is not None
        and copy.retain_until >= until
    )


def target_bucket(target: AwsTarget, svc: Services, session: str) -> S3TargetBucket:
    """Account B's bucket through a fresh session of the target's role (``session`` names it
    in B's CloudTrail: the backup or restore it is for)."""
    client = svc.assumed_s3(target.role_arn, target.external_id, target.region, session)
    return S3TargetBucket(Bucket(client, target.bucket), target.kms_key, target.account)
