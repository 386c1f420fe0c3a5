"""Google Cloud Storage: one bucket of a GCS vault target (``GcsBucket``), the second provider
a verified backup can be copied to (docs/design/vault-targets.md).

Terms:

- *copy in*: one object streamed from the store into the bucket once, in the target's class,
  with its retention, never replacing an object that is already there (``ifGenerationMatch=0``).
- *proof*: what GCS reports of a copy, read back after it lands: its CRC32C and MD5, its
  class, its retention. GCS computes no CRC64NVME, the checksum the manifest records. So
  ``copy_in`` computes all three on the bytes it streams. The CRC64NVME must be the
  manifest's (these are the backup's bytes), and GCS's CRC32C and MD5 must be the ones
  computed on the same bytes (GCS holds them). Together they prove that GCS holds the
  manifest's bytes.
- *retention*: per-object, ``Locked`` (GCS lets it be extended, never shortened, and refuses
  deleting or replacing the object before it ends), or the bucket's own retention policy.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO

import google_crc32c
from google.api_core import exceptions as gcs_errors
from google.api_core.retry import Retry
from google.cloud.storage.retry import DEFAULT_RETRY

from shardvault.config.settings import Settings
from shardvault.config.targets import GcsTarget
from shardvault.data.checked_stream import CheckedStream
from shardvault.errors import ChecksumMismatch, PromotionFailed
from shardvault.gcp.credentials import client

LOCKED = "Locked"
PROOF = (
    "GCS's CRC32C and MD5 of every object equal those of the streamed bytes, whose CRC64NVME "
    "is the manifest's"
)
READ_CHUNK = 8 * 1024 * 1024
# The custom role a copy target's writers are bound to (docs/guide/vault-copies.md): write and
# read objects, set a retention, read the bucket's settings; never delete, never shorten a
# Locked retention (no storage.objects.delete, no overrideUnlockedRetention). The local stack
# answers every GCS call as if its caller held exactly this (shardvault/local/gcs_iam.py).
COPY_WRITER_PERMISSIONS = frozenset(
    {
        "storage.objects.create",
        "storage.objects.get",
        "storage.objects.list",
        "storage.objects.update",
        "storage.objects.setRetention",
        "storage.buckets.get",
    }
)


@dataclass(frozen=True)
class GcsCopy:
    """One object as GCS reports it after it landed (the module docstring's *proof*)."""

    key: str
    size: int
    crc32c: str  # base64, as GCS reports it
    md5: str  # base64
    generation: int
    storage_class: str
    retention_mode: str | None
    retain_until: datetime | None

    @property
    def version(self) -> str:
        return str(self.generation)

    def proof(self) -> dict[str, Any]:
        return {"version": self.version, "crc32c": self.crc32c, "md5": self.md5}


class _GcsDigests:
    """GCS's own checksums (CRC32C and MD5) of the bytes a checked stream passes."""

    def __init__(self) -> None:
        self.crc32c = google_crc32c.Checksum()
        self.md5 = hashlib.md5(usedforsecurity=False)

    def update(self, chunk: bytes) -> None:
        self.crc32c.update(chunk)
        self.md5.update(chunk)

    @property
    def sent(self) -> tuple[str, str]:
        """The CRC32C and MD5 of the bytes sent, in GCS's form (base64)."""
        return _b64(self.crc32c.digest()), _b64(self.md5.digest())


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


@dataclass(frozen=True)
class GcsBucket:
    """One GCS bucket through one ``google.cloud.storage.Client``."""

    client: Any
    name: str
    # The client library's own retry policy (backoff on 429, 5xx and lost connections), with
    # how long it keeps trying: every call here is idempotent or conditional on a generation.
    retry: Retry = DEFAULT_RETRY
    proof_text = PROOF
    retention_mode = LOCKED

    @property
    def where(self) -> str:
        return f"gs://{self.name}"

    def check_held(self, copy: GcsCopy, storage_class: str, retain_until: datetime | None) -> None:
        check_held(copy, storage_class, retain_until)

    @property
    def _bucket(self) -> Any:
        return self.client.bucket(self.name)

    def copy_in(
        self,
        open_source: Callable[[], BinaryIO],
        key: str,
        size: int,
        expected_crc64nvme: str,
        storage_class: str,
        retain_until: datetime | None,
    ) -> GcsCopy:
        """Streams ``size`` bytes from ``open_source()`` into ``key`` and returns the copy as
        GCS reports it, proven equal to the bytes the manifest records (the module docstring).
        An object already at ``key`` (a resumed promotion's) is not replaced: the source is
        read again, and GCS's copy must prove equal to it."""
        blob = self._bucket.blob(key)
        blob.storage_class = storage_class
        if retain_until is not None:
            blob.retention.mode = LOCKED
            blob.retention.retain_until_time = retain_until
        digests = _GcsDigests()
        stream = CheckedStream(
            open_source(), key, size, expected_crc64nvme, into="GCS", observers=[digests]
        )
        try:
            blob.upload_from_file(
                stream, size=size, checksum="crc32c", if_generation_match=0, retry=self.retry
            )
        except gcs_errors.PreconditionFailed:  # copied before: a resumed promotion
            digests = _GcsDigests()
            stream = CheckedStream(
                open_source(), key, size, expected_crc64nvme, into="GCS", observers=[digests]
            )
            while stream.read(READ_CHUNK):
                pass
        copy = self.read_back(key)
        if copy is None or copy.size != size or (copy.crc32c, copy.md5) != digests.sent:
            got = "nothing" if copy is None else f"CRC32C {copy.crc32c}, MD5 {copy.md5}"
            raise ChecksumMismatch(
                f"GCS reports {got} for {key}; the store's copy has CRC32C {digests.sent[0]}, "
                f"MD5 {digests.sent[1]}.",
                fix="the copy did not land whole, or another object holds its key: check the "
                "bucket (ShardVault writes each key once), then promote again.",
            )
        return copy

    def read_back(self, key: str, version: str | None = None) -> GcsCopy | None:
        """The object (its live generation, or ``version``) as GCS reports it now, or None
        when there is none."""
        blob = self._bucket.get_blob(key, generation=_generation(version), retry=self.retry)
        if blob is None:
            return None
        retention = blob.retention
        return GcsCopy(
            key=key,
            size=int(blob.size),
            crc32c=blob.crc32c,
            md5=blob.md5_hash,
            generation=int(blob.generation),
            storage_class=blob.storage_class,
            retention_mode=retention.mode,
            retain_until=retention.retain_until_time,
        )

    def read(self, key: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes ``[start, end)`` of an object."""
        blob = self._bucket.blob(key, generation=_generation(version))
        return blob.download_as_bytes(start=start, end=end - 1)  # type: ignore[no-any-return]

    def read_all(self, key: str, version: str | None = None) -> bytes:
        """An object's bytes (generation ``version``'s, when given: the one a record names)."""
        blob = self._bucket.blob(key, generation=_generation(version))
        return blob.download_as_bytes(retry=self.retry)  # type: ignore[no-any-return]

    def open(self, key: str, version: str | None = None) -> BinaryIO:
        """An object's bytes as a stream, read in chunks as they are consumed."""
        blob = self._bucket.blob(key, generation=_generation(version))
        return blob.open("rb", chunk_size=READ_CHUNK, retry=self.retry)  # type: ignore[no-any-return]

    def extend(self, key: str, until: datetime, version: str | None = None) -> GcsCopy:
        """Extends a Locked retention to ``until`` (GCS allows extending, never shortening)
        unless it already reaches that far; returns the object as read back. Retention is
        the live generation's (``version`` is an S3 target's)."""
        copy = self.read_back(key)
        if copy is None:
            raise PromotionFailed(
                f"GCS holds no {key}, which a newer incremental's chain needs.",
                fix="start a full backup (a new chain); the incremental stays in the stack vault.",
            )
        if copy.retain_until is not None and copy.retain_until >= until:
            return copy
        blob = self._bucket.blob(key)
        blob.retention.mode = LOCKED
        blob.retention.retain_until_time = until
        blob.patch(retry=self.retry)
        return self.read_back(key) or copy

    def readable_class(self, storage_class: str) -> str:
        return storage_class  # every GCS class reads at once

    def thawed(self, key: str, version: str | None, days: int, tier: str) -> str:
        """Every GCS class reads at once: nothing to thaw."""
        return "readable"

    def object_retention_enabled(self) -> bool:
        """Whether the bucket lets objects carry their own retention (set at its creation)."""
        bucket = self.client.get_bucket(self.name, retry=self.retry)
        return bool(bucket.object_retention_mode == "Enabled")

    def locked_retention_days(self) -> float | None:
        """The bucket's retention policy in days when it is locked, as GCS reports it; None
        when it has none or it can still be removed."""
        bucket = self.client.get_bucket(self.name, retry=self.retry)
        if not bucket.retention_policy_locked or not bucket.retention_period:
            return None
        return int(bucket.retention_period) / 86400


def _generation(version: str | int | None) -> int | None:
    return int(version) if version else None


def check_held(copy: GcsCopy, storage_class: str, retain_until: datetime | None) -> None:
    """Refuses a copy GCS does not hold as asked: another class, or a retention that ends
    sooner (or is not locked)."""
    problems = []
    if copy.storage_class != storage_class:
        problems.append(f"class {copy.storage_class}, not {storage_class}")
    if retain_until is not None and (
        copy.retention_mode != LOCKED
        or copy.retain_until is None
        or copy.retain_until < retain_until
    ):
        problems.append(
            f"retention {copy.retention_mode or 'none'} until {copy.retain_until}, not Locked "
            f"until {retain_until.isoformat()}"
        )
    if problems:
        raise PromotionFailed(
            f"GCS holds {copy.key} with {'; '.join(problems)}.",
            fix="check the bucket's settings (object retention enabled, the class allowed) and "
            "the federated identity's roles; the backup stays restorable from the store.",
        )


def target_bucket(target: GcsTarget, settings: Settings) -> GcsBucket:
    """The bucket of a GCS copy target: through the settings' emulator on the local stack,
    else through workload identity federation, its calls retried for ``gcs_retry_seconds``."""
    identity = target.workload_identity
    if settings.gcs_endpoint is None and identity is None:
        raise PromotionFailed(
            f"copy {target.name!r} names no workload_identity, and no GCS emulator is set.",
            fix="add the copy's workload_identity (its pool's audience) to the policy: on AWS "
            "the promote function reaches GCS only through it.",
        )
    storage_client = client(
        target.project,
        audience=identity.audience if identity else None,
        service_account=identity.service_account if identity else None,
        endpoint=settings.gcs_endpoint,
    )
    retry = DEFAULT_RETRY.with_timeout(settings.gcs_retry_seconds)
    return GcsBucket(storage_client, target.bucket, retry)
