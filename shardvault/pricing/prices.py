"""The one price table: AWS list prices in us-east-1, as ``shared/reference/aws-facts.md`` has
them (checked against stored AWS documentation, November 2026).

Terms:
- *GB*: AWS bills storage in GB of 2**30 bytes (its own worked figures use 1 TB = 1,024 GB).
- *GB-month*: one GB stored for one average month of ``DAYS_PER_MONTH`` days.
- *minimum billed duration*: an object deleted sooner is billed for the days it has left.
- *archive metadata*: every GLACIER or DEEP_ARCHIVE object adds 40 KB of billed metadata,
  32 KB at the archive rate and 8 KB at STANDARD.

A value commented UNCONFIRMED has no primary source in the reference: measure it or look it up
before relying on it. Every other value is quoted from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

KB = 1024
GB = 1024**3
DAYS_PER_MONTH = 365.25 / 12


class StorageClass(StrEnum):
    STANDARD = "STANDARD"
    STANDARD_IA = "STANDARD_IA"
    GLACIER_IR = "GLACIER_IR"
    GLACIER = "GLACIER"  # S3 Glacier Flexible Retrieval
    DEEP_ARCHIVE = "DEEP_ARCHIVE"


# Classes a vault may use (STANDARD is where uploads are staged and restored copies live).
VAULT_CLASSES = (
    StorageClass.STANDARD_IA,
    StorageClass.GLACIER_IR,
    StorageClass.GLACIER,
    StorageClass.DEEP_ARCHIVE,
)
# Classes whose objects must be restored (a temporary copy at STANDARD) before they are read.
ARCHIVE_CLASSES = frozenset({StorageClass.GLACIER, StorageClass.DEEP_ARCHIVE})

ARCHIVE_METADATA_AT_CLASS = 32 * KB
ARCHIVE_METADATA_AT_STANDARD = 8 * KB


class RestoreTier(StrEnum):
    EXPEDITED = "EXPEDITED"
    STANDARD = "STANDARD"
    BULK = "BULK"


@dataclass(frozen=True)
class ClassPrices:
    """What one storage class costs. Request prices are USD per request."""

    storage_gb_month: float
    minimum_days: int  # minimum billed duration
    minimum_object_bytes: int  # smaller objects are billed as this size
    put: float  # PUT, COPY, POST: CreateMultipartUpload, UploadPart, Complete, CopyObject
    get: float  # GET, HEAD, GetObjectAttributes
    transition: float  # a lifecycle transition into this class
    retrieval_gb: float  # reading an object that needs no restore (IA, GLACIER_IR)


STORAGE: dict[StorageClass, ClassPrices] = {
    StorageClass.STANDARD: ClassPrices(
        storage_gb_month=0.023,
        minimum_days=0,
        minimum_object_bytes=0,
        put=0.005 / 1000,
        get=0.0004 / 1000,  # UNCONFIRMED: not in the reference
        transition=0.0,  # nothing transitions into STANDARD
        retrieval_gb=0.0,
    ),
    StorageClass.STANDARD_IA: ClassPrices(
        storage_gb_month=0.0125,
        minimum_days=30,
        minimum_object_bytes=128 * KB,
        put=0.01 / 1000,
        get=0.001 / 1000,  # UNCONFIRMED
        transition=0.01 / 1000,  # UNCONFIRMED
        retrieval_gb=0.01,  # UNCONFIRMED
    ),
    StorageClass.GLACIER_IR: ClassPrices(
        storage_gb_month=0.004,
        minimum_days=90,
        minimum_object_bytes=128 * KB,
        put=0.02 / 1000,
        get=0.01 / 1000,  # UNCONFIRMED
        transition=0.02 / 1000,  # UNCONFIRMED
        retrieval_gb=0.03,  # UNCONFIRMED
    ),
    StorageClass.GLACIER: ClassPrices(
        storage_gb_month=0.0036,
        minimum_days=90,
        minimum_object_bytes=0,
        put=0.03 / 1000,
        get=0.0004 / 1000,  # UNCONFIRMED (GET of a restored copy)
        transition=0.03 / 1000,
        retrieval_gb=0.0,  # archived: priced per restore tier below
    ),
    StorageClass.DEEP_ARCHIVE: ClassPrices(
        storage_gb_month=0.00099,
        minimum_days=180,
        minimum_object_bytes=0,
        put=0.05 / 1000,  # UNCONFIRMED
        get=0.0004 / 1000,  # UNCONFIRMED (GET of a restored copy)
        transition=0.05 / 1000,
        retrieval_gb=0.0,  # archived: priced per restore tier below
    ),
}


@dataclass(frozen=True)
class RestorePrices:
    per_gb: float
    per_request: float  # one restore request per object
    ready_within_hours: float


RESTORE: dict[tuple[StorageClass, RestoreTier], RestorePrices] = {
    (StorageClass.GLACIER, RestoreTier.EXPEDITED): RestorePrices(0.03, 10.0 / 1000, 5 / 60),
    (StorageClass.GLACIER, RestoreTier.STANDARD): RestorePrices(0.01, 0.05 / 1000, 5.0),
    (StorageClass.GLACIER, RestoreTier.BULK): RestorePrices(0.0, 0.0, 12.0),
    # Per-request prices of Deep Archive restores: UNCONFIRMED (the reference's totals of about
    # $20.9 and $2.6 per TB at 256 MB objects are consistent with them).
    (StorageClass.DEEP_ARCHIVE, RestoreTier.STANDARD): RestorePrices(0.02, 0.10 / 1000, 12.0),
    (StorageClass.DEEP_ARCHIVE, RestoreTier.BULK): RestorePrices(0.0025, 0.025 / 1000, 48.0),
}


def thaw_tiers(storage_class: StorageClass) -> list[RestoreTier]:
    """The restore tiers S3 offers for an archived class (none for a class read directly):
    DEEP_ARCHIVE has no Expedited tier."""
    return [tier for (cls, tier) in RESTORE if cls == storage_class]


# A restore's execution must outlive the slowest thaw it may wait for (DEEP_ARCHIVE's Bulk, 48
# h), then its downloads: statemachines/restore.asl.json's TimeoutSeconds (72 h) holds this.
SLOWEST_THAW_HOURS = max(prices.ready_within_hours for prices in RESTORE.values())

# --- a GCS vault target (docs/design/vault-targets.md) ---------------------------------------
# Google Cloud Storage's cold classes, regional (us-central1), from Google's pricing page as a
# transcription of 2026-09 has it: storage and retrieval UNCONFIRMED (no primary source here),
# minimum durations from Google's storage-class documentation. GCS bills an object deleted or
# replaced sooner than its minimum as if stored for the rest of it, as S3 does; a read pays the
# class's retrieval per GB, and no thaw is needed (every class reads at once).
GCS_VAULT_CLASSES = ("NEARLINE", "COLDLINE", "ARCHIVE")
GCS_STORAGE: dict[str, ClassPrices] = {
    "NEARLINE": ClassPrices(
        storage_gb_month=0.010,
        minimum_days=30,
        minimum_object_bytes=0,
        put=0.01 / 1000,  # UNCONFIRMED: class A operation
        get=0.001 / 1000,  # UNCONFIRMED: class B operation
        transition=0.0,  # written in its class, never transitioned
        retrieval_gb=0.01,
    ),
    "COLDLINE": ClassPrices(
        storage_gb_month=0.004,
        minimum_days=90,
        minimum_object_bytes=0,
        put=0.02 / 1000,  # UNCONFIRMED
        get=0.01 / 1000,  # UNCONFIRMED
        transition=0.0,
        retrieval_gb=0.02,
    ),
    "ARCHIVE": ClassPrices(
        storage_gb_month=0.0012,
        minimum_days=365,
        minimum_object_bytes=0,
        put=0.05 / 1000,  # UNCONFIRMED
        get=0.05 / 1000,  # UNCONFIRMED
        transition=0.0,
        retrieval_gb=0.05,
    ),
}
# UNCONFIRMED: data transfer between two AWS regions (an aws copy target in another region
# than the stack's); between accounts in one region it is free.
AWS_INTER_REGION_GB = 0.02
# Bytes leaving AWS for another provider (a GCS target's copy), and leaving Google for AWS (a
# restore from it, staged back into the work bucket): first-tier internet prices per GB.
AWS_EGRESS_INTERNET_GB = 0.09  # UNCONFIRMED: S3 data transfer out, first 10 TB a month
GCS_EGRESS_INTERNET_GB = 0.12  # UNCONFIRMED: GCS network egress, first 10 TB a month

# Orchestration.
STATE_TRANSITION = 0.025 / 1000  # Step Functions Standard, retries included
LAMBDA_GB_SECOND = 0.0000133334  # arm64; UNCONFIRMED
LAMBDA_REQUEST = 0.20 / 1_000_000  # UNCONFIRMED
DYNAMODB_WRITE = 0.625 / 1_000_000  # on-demand write request unit
DYNAMODB_READ = 0.125 / 1_000_000  # on-demand read request unit
SQS_REQUEST = 0.40 / 1_000_000  # UNCONFIRMED: standard queue, per request (a long poll is one)

# The deployment itself, whatever it backs up.
KMS_KEY_MONTH = 1.00  # UNCONFIRMED: a customer-managed key, per month (requests apart)
ALARM_MONTH = 0.10  # UNCONFIRMED: a standard-resolution metric alarm, per metric, per month
CUSTOM_METRIC_MONTH = 0.30  # UNCONFIRMED: a custom metric (first 10,000 of an account)
DASHBOARD_MONTH = 3.00  # UNCONFIRMED: a dashboard (an account's first three are free)
PUT_METRIC_DATA_REQUEST = 0.01 / 1000  # UNCONFIRMED
