"""What keeping bytes in a storage class costs: pure functions over the price table (``prices``).

Terms:
- *storage cost*: keeping bytes for a month in a class, with the minimum object size and each
  archived object's metadata billed.
- *early-deletion charge*: the storage still due for the days a deleted object falls short of
  its class's minimum billed duration.

Both ``costs`` (pricing backups and forecasts) and ``retention`` (reporting what expiring
saves and costs) use these; keeping them here lets ``costs`` import ``retention`` without a
cycle.
"""

from __future__ import annotations

from shardvault.pricing.prices import (
    ARCHIVE_CLASSES,
    ARCHIVE_METADATA_AT_CLASS,
    ARCHIVE_METADATA_AT_STANDARD,
    DAYS_PER_MONTH,
    GB,
    STORAGE,
    StorageClass,
)


def billed_gb(storage_class: StorageClass, size: int, objects: int = 1) -> tuple[float, float]:
    """GB billed at the class's rate, and GB billed at STANDARD (archive metadata)."""
    at_class = max(size, objects * STORAGE[storage_class].minimum_object_bytes)
    at_standard = 0
    if storage_class in ARCHIVE_CLASSES:
        at_class += objects * ARCHIVE_METADATA_AT_CLASS
        at_standard = objects * ARCHIVE_METADATA_AT_STANDARD
    return at_class / GB, at_standard / GB


def monthly_storage_cost(storage_class: StorageClass, size: int, objects: int = 1) -> float:
    at_class, at_standard = billed_gb(storage_class, size, objects)
    standard = STORAGE[StorageClass.STANDARD].storage_gb_month
    return at_class * STORAGE[storage_class].storage_gb_month + at_standard * standard


def early_deletion_charge(
    storage_class: StorageClass, size: int, objects: int, age_days: float
) -> float:
    """What deleting at ``age_days`` costs on top: the storage due for the days still short."""
    short_days = STORAGE[storage_class].minimum_days - age_days
    if short_days <= 0:
        return 0.0
    at_class, _ = billed_gb(storage_class, size, objects)
    return at_class * STORAGE[storage_class].storage_gb_month * short_days / DAYS_PER_MONTH
