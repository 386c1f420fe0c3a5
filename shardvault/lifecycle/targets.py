"""What every vault target shares: the store's layout under the target's own prefix, a
manifest that names the target's copies, the retain-until its copies are held to, and the
*target bucket* each provider's adapter offers (``TargetBucket``: a GCS bucket,
``shardvault.gcp.storage``; an Object Lock bucket in another account,
``shardvault.aws.copy_target``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, Protocol

from botocore.exceptions import ClientError
from google.api_core import exceptions as gcs_errors

from shardvault.aws.services import Services
from shardvault.aws.store import is_missing
from shardvault.config.targets import AwsTarget, VaultCopy
from shardvault.contracts.models import Encryption, Manifest, ObjectResult


class HeldCopy(Protocol):
    """One object as its provider reports it after it landed."""

    @property
    def key(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def version(self) -> str | None: ...  # S3's version id, GCS's generation
    @property
    def storage_class(self) -> str: ...
    @property
    def retention_mode(self) -> str | None: ...
    @property
    def retain_until(self) -> datetime | None: ...

    def proof(self) -> dict[str, Any]:
        """The version and the checksums the provider reported, as progress keeps them."""
        ...


class TargetBucket(Protocol):
    """A copy target's bucket, whatever its provider."""

    proof_text: str  # what the provider's checksums prove, as the catalog records it
    retention_mode: str  # the mode each copy is held in (GCS's Locked, S3's COMPLIANCE)

    @property
    def name(self) -> str: ...
    @property
    def where(self) -> str: ...  # the bucket as an error names it (gs://…, s3://… account B)

    def copy_in(
        self,
        open_source: Callable[[], BinaryIO],
        key: str,
        size: int,
        expected_crc64nvme: str,
        storage_class: str,
        retain_until: datetime | None,
    ) -> HeldCopy: ...
    def check_held(self, copy: Any, storage_class: str, retain_until: datetime | None) -> None: ...
    def read_back(self, key: str, version: str | None = None) -> HeldCopy | None: ...
    def extend(self, key: str, until: datetime, version: str | None = None) -> HeldCopy: ...
    def read_all(self, key: str, version: str | None = None) -> bytes: ...
    def open(self, key: str, version: str | None = None) -> BinaryIO: ...
    def read(self, key: str, start: int, end: int, version: str | None = None) -> bytes: ...
    def readable_class(self, storage_class: str) -> str:
        """The class nearest ``storage_class`` whose objects read without a thaw."""
        ...

    def thawed(self, key: str, version: str | None, days: int, tier: str) -> str:
        """``readable``, ``thawing``, or ``requested`` (a thaw of it was asked for now)."""
        ...


def is_gone(error: Exception) -> bool:
    """Whether a target's error says the object (or that version of it) is not there."""
    if isinstance(error, ClientError):
        return is_missing(error) or error.response.get("Error", {}).get("Code") == "NoSuchVersion"
    return isinstance(error, gcs_errors.NotFound)


def bucket_of(target: VaultCopy, svc: Services, session: str) -> TargetBucket:
    """The target's bucket through its provider's adapter (``session`` names an aws target's
    role session: the backup or restore it is for)."""
    if isinstance(target, AwsTarget):
        from shardvault.aws.copy_target import target_bucket as aws_bucket

        return aws_bucket(target, svc, session)
    from shardvault.gcp.storage import target_bucket as gcs_bucket

    return gcs_bucket(target, svc.settings)


def days_after(now: float, days: int) -> datetime:
    return datetime.fromtimestamp(math.ceil(now), UTC) + timedelta(days=days)


def moved_key(svc: Services, store_key: str, prefix: str) -> str:
    """A store key under another place's ``prefix``: every vault target keeps the store's
    layout."""
    relative = store_key.removeprefix(svc.store.prefix.strip("/") + "/")
    prefix = prefix.strip("/")
    return f"{prefix}/{relative}" if prefix else relative


def moved_manifest(
    manifest: Manifest,
    key_of: Callable[[str], str],
    versions: dict[str, str | None],
    wrap: Callable[[Encryption], Encryption] | None = None,
) -> Manifest:
    """The store's manifest as a vault target keeps it: each object at ``key_of(its store
    key)``, with the version (or generation) of its copy (``versions``, by store key); and
    with ``wrap``, every data key it holds (the backup's, an archived batch's) wrapped as the
    target keeps it (a copy's recovery key)."""

    def wrapped(encryption: Encryption | None) -> Encryption | None:
        return wrap(encryption) if wrap and encryption else encryption

    def moved_object(o: ObjectResult) -> ObjectResult:
        return o.model_copy(
            update={
                "key": key_of(o.key),
                "version_id": versions.get(o.key),
                "encryption": wrapped(o.encryption),
            }
        )

    return manifest.model_copy(
        update={
            "encryption": wrapped(manifest.encryption),
            "shards": [
                shard.model_copy(
                    update={
                        "streams": [
                            stream.model_copy(
                                update={"objects": [moved_object(o) for o in stream.objects]}
                            )
                            for stream in shard.streams
                        ],
                        "blockmap": moved_object(shard.blockmap) if shard.blockmap else None,
                    }
                )
                for shard in manifest.shards
            ],
        }
    )
