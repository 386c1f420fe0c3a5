"""Which backups expire: a pure decision over a cluster's backups, its keep counts and now.

Terms:
- *bucket*: the day, ISO week, month or year a backup completed in, in the schedule's zone.
- *keep rules*, as restic's ``forget``: ``keep_daily = N`` keeps the newest backup of each of
  the N most recent days that have backups (days without one do not count), and likewise for
  ISO weeks, months and years. A backup kept by any rule is kept; the newest is always kept.
- *chain*: an incremental restores only with its parent, that parent's parent, and so on down
  to a full. Every backup in the chain of a kept or locked backup is kept too (rule ``chain``),
  so expiring never breaks a restore of what remains.
- *locked*: not kept, but its Object Lock retain-until date is still ahead, so it cannot be
  deleted yet; a later run expires it.
- *early deletion*: expiring a backup younger than its storage class's minimum billed duration;
  its charge is reported with the decision, never hidden.
- *paid minimum*: S3 bills an object deleted before its class's minimum billed duration for
  the days it has left, so deleting it sooner saves nothing. *paid until*: when the backup
  landed in its class (promotion) plus that minimum.
- *held*: not kept and not locked, but not deleted either: its paid minimum has not passed.
  It stays in the catalog, listed and restorable, until the *hold's end*, and a later run
  deletes it. Retention's choice of what to keep does not change, only the deletion date. A
  held backup does not keep its parent (that would extend the parent beyond what was paid for
  it): an incremental is held at most until its parent's own deletion, and is deleted, newest
  first, in the run that deletes its parent. ``delete_before_paid_minimum`` in the policy
  turns holds off (deletion when retention expires, early-deletion charge paid).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta, tzinfo
from enum import StrEnum
from typing import TypeVar

from pydantic import AwareDatetime, Field, model_validator

from shardvault.config.policy import BackupKind, Retention
from shardvault.contracts.catalog import BackupItem, recorded_stored_bytes
from shardvault.contracts.models import BackupStatus, Frozen
from shardvault.errors import ShardVaultError
from shardvault.pricing.prices import STORAGE, StorageClass
from shardvault.pricing.storage_costs import early_deletion_charge, monthly_storage_cost

DELETE_OBJECTS_MAX_KEYS = 1000  # S3 DeleteObjects takes at most 1,000 keys per request
T = TypeVar("T")


class RetentionError(ShardVaultError):
    """The backups given to retention contradict each other (a catalog to repair)."""


class BackupRecord(Frozen):
    """One verified backup, as the catalog lists it."""

    backup_id: str
    cluster: str
    completed_at: AwareDatetime
    kind: BackupKind
    parent_id: str | None = None  # incrementals: the backup this one holds the changes since
    storage_class: StorageClass
    retain_until: AwareDatetime | None = None  # Object Lock: the latest of its objects'
    bytes: int = Field(ge=0)
    objects: int = Field(1, ge=1)
    landed_at: AwareDatetime | None = None  # in its class (promotion); None: at completion

    @property
    def paid_until(self) -> datetime:
        """When its class's minimum billed duration has passed (see *paid minimum*)."""
        landed = self.landed_at or self.completed_at
        return landed + timedelta(days=STORAGE[self.storage_class].minimum_days)

    @model_validator(mode="after")
    def _parent_matches_kind(self) -> BackupRecord:
        if (self.kind == BackupKind.INCREMENTAL) != (self.parent_id is not None):
            raise ValueError(f"backup {self.backup_id}: an incremental, and only it, has a parent")
        return self


def from_catalog(cluster: str, items: Iterable[BackupItem]) -> list[BackupRecord]:
    """The cluster's complete backups among catalog items, as retention and costs see them:
    failed, running and expired ones are not kept and cost nothing to keep."""
    out = []
    for r in items:
        if r.status != BackupStatus.COMPLETE or r.cluster != cluster:
            continue
        until, promoted = r.retain_until, r.promoted_at
        out.append(
            BackupRecord(
                backup_id=r.backup_id,
                cluster=cluster,
                completed_at=datetime.fromtimestamp(r.completed_at or 0, UTC),
                kind=r.kind,
                parent_id=r.parent_id,
                storage_class=r.storage_class or "STANDARD",
                retain_until=datetime.fromisoformat(until) if until else None,
                bytes=recorded_stored_bytes(r),
                objects=max(1, r.objects or 1),
                landed_at=datetime.fromtimestamp(promoted, UTC) if promoted else None,
            )
        )
    return out


class Rule(StrEnum):
    NEWEST = "newest"
    DAILY = "daily"
    WEEKLY = "weekly"
    MONTHLY = "monthly"
    YEARLY = "yearly"
    CHAIN = "chain"


class KeepReason(Frozen):
    rule: Rule
    detail: str  # the bucket ("2026-11-03", "2026-W45", "2026-11", "2026") or the dependent


class Kept(Frozen):
    backup_id: str
    reasons: list[KeepReason]


class Locked(Frozen):
    backup_id: str
    retain_until: datetime


class Held(Frozen):
    """Expired by retention, deleted only at ``until`` (see *held*)."""

    backup_id: str
    until: datetime
    storage_class: StorageClass
    minimum_days: int

    @property
    def reason(self) -> str:
        return f"paid minimum of {self.storage_class}"

    def describe(self) -> str:
        """How ``list``, ``show`` and retention's report say it, e.g. "held until
        2026-06-01: paid minimum of DEEP_ARCHIVE"."""
        return f"held until {self.until.date()}: {self.reason}"


class EarlyDeletion(Frozen):
    backup_id: str
    storage_class: StorageClass
    age_days: float
    minimum_days: int
    charge_usd: float


class RetentionDecision(Frozen):
    now: datetime
    keep: list[Kept]  # newest first
    expire: list[str]  # newest first: a deletion cut short never orphans a surviving incremental
    locked: list[Locked]
    held: list[Held]  # newest first
    early_deletions: list[EarlyDeletion]
    unrestorable: list[str]  # kept or locked, but a backup of their chain is already gone
    monthly_saving_usd: float  # storage no longer billed once the expired backups are deleted
    early_deletion_charge_usd: float
    held_monthly_usd: float  # storage of the held backups: billed whether deleted or not


BUCKETS: dict[Rule, Callable[[datetime], str]] = {
    Rule.DAILY: lambda at: at.date().isoformat(),
    Rule.WEEKLY: lambda at: "{}-W{:02d}".format(*at.isocalendar()[:2]),
    Rule.MONTHLY: lambda at: f"{at.year}-{at.month:02d}",
    Rule.YEARLY: lambda at: f"{at.year}",
}


def keep_counts(keep: Retention) -> dict[Rule, int]:
    return {
        Rule.DAILY: keep.keep_daily,
        Rule.WEEKLY: keep.keep_weekly,
        Rule.MONTHLY: keep.keep_monthly,
        Rule.YEARLY: keep.keep_yearly,
    }


def decide(
    backups: Sequence[BackupRecord],
    keep: Retention,
    now: datetime,
    zone: tzinfo = UTC,
    *,
    delete_before_paid_minimum: bool = False,
) -> RetentionDecision:
    """Which backups to keep (and why), expire, hold until their paid minimum, or leave
    locked; each cluster on its own."""
    if now.tzinfo is None:
        raise RetentionError("now has no time zone.", fix="pass an aware datetime.")
    _check_catalog(backups)
    clusters: dict[str, list[BackupRecord]] = defaultdict(list)
    for backup in backups:
        clusters[backup.cluster].append(backup)
    reasons: dict[str, list[KeepReason]] = {}
    for group in clusters.values():
        reasons |= _reasons(group, keep, now, zone)
    newest_first = sorted(backups, key=lambda b: (b.completed_at, b.backup_id), reverse=True)
    unkept = [b for b in newest_first if b.backup_id not in reasons and not _locked(b, now)]
    holds = {} if delete_before_paid_minimum else _holds(backups, unkept, now)
    expired = [b for b in unkept if b.backup_id not in holds]
    early = [e for e in (_early_deletion(b, now) for b in expired) if e is not None]
    return RetentionDecision(
        now=now,
        keep=[
            Kept(backup_id=b.backup_id, reasons=reasons[b.backup_id])
            for b in newest_first
            if b.backup_id in reasons
        ],
        expire=[b.backup_id for b in expired],
        locked=[
            Locked(backup_id=b.backup_id, retain_until=b.retain_until)
            for b in newest_first
            if b.backup_id not in reasons and _locked(b, now)
        ],
        held=[
            Held(
                backup_id=b.backup_id,
                until=holds[b.backup_id],
                storage_class=b.storage_class,
                minimum_days=STORAGE[b.storage_class].minimum_days,
            )
            for b in unkept
            if b.backup_id in holds
        ],
        early_deletions=early,
        unrestorable=_unrestorable(backups, reasons, now),
        monthly_saving_usd=_monthly_storage(expired),
        early_deletion_charge_usd=sum(e.charge_usd for e in early),
        held_monthly_usd=_monthly_storage(b for b in unkept if b.backup_id in holds),
    )


def _monthly_storage(backups: Iterable[BackupRecord]) -> float:
    return sum(monthly_storage_cost(b.storage_class, b.bytes, b.objects) for b in backups)


def hold_end(paid_until: datetime, parent_deleted_at: datetime | None) -> datetime:
    """When a hold ends: at the paid minimum, or with the parent if it goes first (a held
    incremental never extends its parent). ``parent_deleted_at`` None: a full, or a parent
    that stays (kept, locked) as long as the child is held."""
    if parent_deleted_at is None:
        return paid_until
    return min(paid_until, parent_deleted_at)


def _holds(
    backups: Sequence[BackupRecord], unkept: Sequence[BackupRecord], now: datetime
) -> dict[str, datetime]:
    """The unkept backups held, and until when (see *held*). Parents first: an incremental
    whose parent is deleted by this run, or already gone, is not held."""
    by_id = {b.backup_id: b for b in backups}
    candidates = sorted(unkept, key=lambda b: (b.completed_at, b.backup_id))
    deleted = {b.backup_id for b in candidates}  # until found held below
    held: dict[str, datetime] = {}
    for backup in candidates:
        parent_end = None
        if backup.kind == BackupKind.INCREMENTAL:
            parent = by_id.get(backup.parent_id or "")
            if parent is None or (parent.backup_id in deleted and parent.backup_id not in held):
                continue
            parent_end = held.get(parent.backup_id)  # None: the parent stays (kept, locked)
        until = hold_end(backup.paid_until, parent_end)
        if now < until:
            held[backup.backup_id] = until
    return held


def _locked(backup: BackupRecord, now: datetime) -> bool:
    return backup.retain_until is not None and backup.retain_until > now


def _reasons(
    group: list[BackupRecord], keep: Retention, now: datetime, zone: tzinfo
) -> dict[str, list[KeepReason]]:
    """Why each kept backup of one cluster is kept: its rules, then the chains that need it."""
    newest_first = sorted(group, key=lambda b: (b.completed_at, b.backup_id), reverse=True)
    local = [b.completed_at.astimezone(zone) for b in newest_first]
    reasons: dict[str, list[KeepReason]] = defaultdict(list)
    reasons[newest_first[0].backup_id].append(_reason(Rule.NEWEST, "newest"))
    for rule, count in keep_counts(keep).items():
        last_bucket, kept = None, 0
        for backup, at in zip(newest_first, local, strict=True):
            if kept == count:
                break
            bucket = BUCKETS[rule](at)
            if bucket != last_bucket:  # the newest backup of a bucket comes first
                reasons[backup.backup_id].append(_reason(rule, bucket))
                last_bucket, kept = bucket, kept + 1
    by_id = {b.backup_id: b for b in group}
    for backup in newest_first:  # a parent is older than its child: one pass protects chains
        needed = backup.backup_id in reasons or _locked(backup, now)
        if needed and backup.parent_id in by_id:
            reasons[backup.parent_id].append(_reason(Rule.CHAIN, backup.backup_id))
    return dict(reasons)


def _reason(rule: Rule, detail: str) -> KeepReason:
    return KeepReason.model_construct(rule=rule, detail=detail)  # built from validated input


def _unrestorable(
    backups: Sequence[BackupRecord], kept: dict[str, list[KeepReason]], now: datetime
) -> list[str]:
    """Kept or locked backups whose chain misses a backup (newest first)."""
    oldest_first = sorted(backups, key=lambda b: (b.completed_at, b.backup_id))
    by_id = {b.backup_id: b for b in backups}
    whole: dict[str, bool] = {}
    for backup in oldest_first:  # parents first
        parent = by_id.get(backup.parent_id or "")
        whole[backup.backup_id] = backup.kind == BackupKind.FULL or (
            parent is not None and parent.cluster == backup.cluster and whole[parent.backup_id]
        )
    return [
        b.backup_id
        for b in reversed(oldest_first)
        if not whole[b.backup_id] and (b.backup_id in kept or _locked(b, now))
    ]


def _early_deletion(backup: BackupRecord, now: datetime) -> EarlyDeletion | None:
    age_days = (now - (backup.landed_at or backup.completed_at)) / timedelta(days=1)
    minimum = STORAGE[backup.storage_class].minimum_days
    if age_days >= minimum:
        return None
    return EarlyDeletion(
        backup_id=backup.backup_id,
        storage_class=backup.storage_class,
        age_days=age_days,
        minimum_days=minimum,
        charge_usd=early_deletion_charge(
            backup.storage_class, backup.bytes, backup.objects, age_days
        ),
    )


def _check_catalog(backups: Sequence[BackupRecord]) -> None:
    by_id: dict[str, BackupRecord] = {}
    for backup in backups:
        if backup.backup_id in by_id:
            raise RetentionError(
                f"backup {backup.backup_id} is listed twice.",
                fix="list each backup once (repair the catalog from the manifests).",
            )
        by_id[backup.backup_id] = backup
    for backup in backups:
        parent = by_id.get(backup.parent_id or "")
        if parent is not None and parent.completed_at >= backup.completed_at:
            raise RetentionError(
                f"backup {backup.backup_id} completed before its parent {parent.backup_id}.",
                fix="repair the catalog from the manifests: a parent completes first.",
            )


def deletion_batches(keys: Sequence[T], size: int = DELETE_OBJECTS_MAX_KEYS) -> list[list[T]]:
    """``keys`` cut into batches for S3 ``DeleteObjects`` (at most 1,000 keys each).

    The vault is versioned (Object Lock needs it): give ``(key, version_id)`` pairs, since a
    delete without a version id only adds a delete marker and the bytes stay billed."""
    if not 1 <= size <= DELETE_OBJECTS_MAX_KEYS:
        raise ValueError(f"batch size {size} is outside 1 to {DELETE_OBJECTS_MAX_KEYS}")
    return [list(keys[i : i + size]) for i in range(0, len(keys), size)]
