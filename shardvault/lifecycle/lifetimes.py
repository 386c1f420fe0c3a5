"""How long retention will keep a backup, and the vault class that costs least for that life.

Terms:
- *expected lifetime*: from a backup's completion to the retention run that expires it, when
  the schedule goes on making backups as it says (fulls and incrementals) and retention runs
  after each one (as ``costs.simulate_lifetimes`` models a year): what the keep rules, the
  chains of later kept backups and the Object Lock leave it. Only later backups decide when a
  backup expires (keep rules count newer buckets; chains run from newer backups to older), so
  earlier ones need not be simulated. It is followed for ``LIFETIME_HORIZON`` at most: no
  class's minimum billed duration is longer, so a longer life changes no choice.
- *cost for a lifetime*: what a backup costs in a class over its whole stay: the class's
  storage for the longer of its lifetime and the class's minimum billed duration, plus the
  requests that land its objects there (one copy each, at the class's PUT price). Why the
  longer of the two: S3 bills an object deleted before its class's minimum for the days it
  has left, and retention holds such a backup until the minimum has passed
  (``retention``: *held*), so a short life pays the minimum either way, as storage the backup
  still uses (it stays listed and restorable) rather than a charge for nothing.
- *lifetime class*: the class a backup lands in. The class with the least cost for its
  expected lifetime among the policy's ``storage_class`` and the vault classes with a shorter
  minimum billed duration (each restores at least as fast); the policy's class on a tie, or
  when the policy sets ``vault.class_by_lifetime: false`` (it forces its class).

Why not simply "a backup expiring before a class's minimum does not land there": that rule
moved the modeled case's dailies and weeklies (kept 7 to 35 days) from DEEP_ARCHIVE to
STANDARD_IA and doubled the bill ($79 against $40 a month). DEEP_ARCHIVE's 180 days at
$0.00099 per GB-month cost less than STANDARD_IA's 30 days at $0.0125, so a backup kept a week
is still cheapest in DEEP_ARCHIVE, minimum paid. So the rule is honest by comparing costs: a
backup lands in a class whose minimum it will not live out only when that class is still the
cheapest with the minimum paid. At list prices the minimum alone never tips the choice
(per GB, every archive class's minimum costs less than a shorter-minimum class's); the
per-object prices do, for backups of a few MiB per object, where a cheaper PUT outweighs
the storage.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from shardvault.config.policy import BackupKind, ClusterPolicy, Vault
from shardvault.data.planning import choose_part_size, object_size_for
from shardvault.lifecycle.retention import BackupRecord, decide
from shardvault.pricing.prices import DAYS_PER_MONTH, STORAGE, VAULT_CLASSES, StorageClass
from shardvault.pricing.storage_costs import monthly_storage_cost

DAY = timedelta(days=1)
LIFETIME_HORIZON = timedelta(days=max(STORAGE[c].minimum_days for c in VAULT_CLASSES))
_OURS = "ours"


def expected_lifetime(
    cluster: ClusterPolicy, completed_at: datetime, *, lock_days: int | None = None
) -> timedelta:
    """How long retention keeps a backup completed at ``completed_at`` (at most
    ``LIFETIME_HORIZON``). ``lock_days``: the backup's Object Lock days when a request raised
    the policy's. Its kind does not matter: later backups chain to it either way."""
    lock = timedelta(days=cluster.vault.object_lock.days if lock_days is None else lock_days)

    def record(backup_id: str, at: datetime, kind: BackupKind, parent: str) -> BackupRecord:
        return BackupRecord(
            backup_id=backup_id,
            cluster="lifetime",
            completed_at=at,
            kind=kind,
            parent_id=parent if kind == BackupKind.INCREMENTAL else None,
            storage_class=StorageClass.STANDARD,  # no holds: the life retention gives it
            retain_until=at + lock,
            bytes=0,
        )

    live = [record(_OURS, completed_at, BackupKind.FULL, "")]
    fires = cluster.schedule.fires(completed_at, completed_at + LIFETIME_HORIZON)
    for n, (at, due) in enumerate(fires):
        live.append(record(f"{n:06d}", at, due, live[-1].backup_id))
        gone = set(decide(live, cluster.retention, at, cluster.schedule.zone).expire)
        if _OURS in gone:
            return at - completed_at
        live = [b for b in live if b.backup_id not in gone]
    return LIFETIME_HORIZON


def objects_in(storage_class: StorageClass, size: int) -> int:
    """How many objects the planner cuts ``size`` bytes into for the class."""
    return max(1, -(-size // object_size_for(choose_part_size(size, storage_class))))


def cost_for_lifetime(storage_class: StorageClass, size: int, lifetime: timedelta) -> float:
    """A backup's cost over its stay in the class (see *cost for a lifetime*)."""
    objects = objects_in(storage_class, size)
    days = max(lifetime / DAY, STORAGE[storage_class].minimum_days)
    stay = monthly_storage_cost(storage_class, size, objects) * days / DAYS_PER_MONTH
    return stay + objects * STORAGE[storage_class].put


def lifetime_class(vault: Vault, lifetime: timedelta, size: int) -> StorageClass:
    """The class a backup of ``size`` stored bytes that lives ``lifetime`` lands in (see
    *lifetime class*)."""
    chosen = vault.storage_class
    if not vault.class_by_lifetime:
        return chosen
    shorter = [c for c in VAULT_CLASSES if STORAGE[c].minimum_days < STORAGE[chosen].minimum_days]
    return min([chosen, *shorter], key=lambda c: cost_for_lifetime(c, size, lifetime))


def backup_class(
    cluster: ClusterPolicy, completed_at: datetime, size: int, *, lock_days: int | None = None
) -> StorageClass:
    """The lifetime class of one backup of the cluster of about ``size`` stored bytes."""
    if not cluster.vault.class_by_lifetime:
        return cluster.vault.storage_class  # no simulation needed
    lifetime = expected_lifetime(cluster, completed_at, lock_days=lock_days)
    return lifetime_class(cluster.vault, lifetime, size)
