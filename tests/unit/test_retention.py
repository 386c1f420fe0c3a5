"""Retention decisions over generated histories (hypothesis): the newest backup and every
chain a kept or locked backup needs survive; nothing locked is expired; the keep rules keep no
more than their counts; expired backups free their storage and early deletions are reported."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvault.policy import BackupKind, Retention
from shardvault.prices import StorageClass
from shardvault.retention import (
    BackupRecord,
    RetentionError,
    Rule,
    decide,
    deletion_batches,
)

NOW = datetime(2026, 11, 22, 12, tzinfo=UTC)
GiB = 2**30


@st.composite
def histories(draw: st.DrawFn) -> list[BackupRecord]:
    """A cluster's backups, oldest first: the first is a full; later ones are fulls or
    incrementals of the backup before them; some are still locked."""
    count = draw(st.integers(1, 40))
    gaps = draw(st.lists(st.integers(1, 24 * 40), min_size=count, max_size=count))  # hours
    at = NOW - timedelta(hours=sum(gaps))
    backups: list[BackupRecord] = []
    for n, gap in enumerate(gaps):
        at += timedelta(hours=gap)
        incremental = n > 0 and draw(st.booleans())
        lock_days = draw(st.sampled_from([None, 1, 30]))
        backups.append(
            BackupRecord(
                backup_id=f"b{n:03d}",
                cluster="c",
                completed_at=min(at, NOW),
                kind=BackupKind.INCREMENTAL if incremental else BackupKind.FULL,
                parent_id=backups[-1].backup_id if incremental else None,
                storage_class=draw(st.sampled_from(list(StorageClass))),
                retain_until=at + timedelta(days=lock_days) if lock_days else None,
                bytes=draw(st.integers(0, 5 * GiB)),
                objects=draw(st.integers(1, 20)),
            )
        )
    return backups


@st.composite
def retentions(draw: st.DrawFn) -> Retention:
    """Keep counts; the policy refuses all zeros (it would keep only the newest)."""
    counts = draw(st.tuples(st.integers(0, 10), st.integers(0, 6), st.integers(0, 4),
                            st.integers(0, 2)).filter(any))  # fmt: skip
    return Retention(
        keep_daily=counts[0], keep_weekly=counts[1], keep_monthly=counts[2], keep_yearly=counts[3]
    )


@settings(max_examples=300, deadline=None)
@given(histories(), retentions())
def test_what_retention_must_never_do(backups: list[BackupRecord], keep: Retention) -> None:
    decision = decide(backups, keep, NOW)
    by_id = {b.backup_id: b for b in backups}
    expired = set(decision.expire)
    kept = {k.backup_id for k in decision.keep}
    locked = {lk.backup_id for lk in decision.locked}
    # Every backup is decided exactly once.
    assert kept | expired | locked == set(by_id)
    assert not kept & expired
    assert not kept & locked
    assert not expired & locked
    # The newest backup always survives.
    newest = max(backups, key=lambda b: (b.completed_at, b.backup_id))
    assert newest.backup_id in kept
    # Nothing under Object Lock is expired.
    assert all(by_id[b].retain_until is None or by_id[b].retain_until <= NOW for b in expired)
    # Every surviving backup can still be restored: its whole chain survives.
    for backup_id in kept | locked:
        parent = by_id[backup_id].parent_id
        while parent:
            assert parent not in expired, f"{backup_id} needs {parent}"
            parent = by_id[parent].parent_id
    assert decision.unrestorable == []
    # Keep rules keep at most their counts (chains may keep more, by rule "chain").
    counts = {Rule.DAILY: keep.keep_daily, Rule.WEEKLY: keep.keep_weekly,
              Rule.MONTHLY: keep.keep_monthly, Rule.YEARLY: keep.keep_yearly}  # fmt: skip
    for rule, limit in counts.items():
        by_rule = [k for k in decision.keep if any(r.rule == rule for r in k.reasons)]
        assert len(by_rule) <= limit, rule
    # Expired newest first, so a deletion cut short never leaves a child without its parent.
    times = [by_id[b].completed_at for b in decision.expire]
    assert times == sorted(times, reverse=True)
    # The saving is what the expired backups cost; early deletions are reported, not hidden.
    assert decision.monthly_saving_usd >= 0
    assert {e.backup_id for e in decision.early_deletions} <= expired
    assert decision.early_deletion_charge_usd == pytest.approx(
        sum(e.charge_usd for e in decision.early_deletions)
    )


def backup(n: int, days_ago: float, **fields) -> BackupRecord:
    values = {
        "backup_id": f"b{n}",
        "cluster": "c",
        "completed_at": NOW - timedelta(days=days_ago),
        "kind": BackupKind.FULL,
        "storage_class": StorageClass.DEEP_ARCHIVE,
        "bytes": GiB,
    }
    return BackupRecord(**(values | fields))


def test_keep_daily_keeps_the_newest_of_each_day_and_reports_early_deletion() -> None:
    backups = [backup(n, days) for n, days in enumerate([3.5, 3.2, 2.2, 1.1, 0.1])]
    decision = decide(backups, Retention(keep_daily=2), NOW)
    assert [k.backup_id for k in decision.keep] == ["b4", "b3"]
    assert decision.expire == ["b2", "b1", "b0"]
    # DEEP_ARCHIVE bills 180 days: deleting after 1 to 4 days is charged, and said so.
    assert {e.backup_id for e in decision.early_deletions} == {"b0", "b1", "b2"}
    assert all(e.minimum_days == 180 for e in decision.early_deletions)
    assert decision.early_deletion_charge_usd > 0


def test_an_incremental_keeps_its_whole_chain() -> None:
    backups = [
        backup(0, 10),
        backup(1, 9, kind=BackupKind.INCREMENTAL, parent_id="b0"),
        backup(2, 8, kind=BackupKind.INCREMENTAL, parent_id="b1"),
        backup(3, 5),
    ]
    decision = decide(backups, Retention(keep_daily=1, keep_weekly=2), NOW)
    kept = {k.backup_id: {r.rule for r in k.reasons} for k in decision.keep}
    assert kept["b2"] == {Rule.WEEKLY}
    assert Rule.CHAIN in kept["b1"]
    assert Rule.CHAIN in kept["b0"]
    assert decision.expire == []


def test_a_locked_backup_waits_for_its_date() -> None:
    backups = [backup(0, 5, retain_until=NOW + timedelta(days=1)), backup(1, 0.1)]
    decision = decide(backups, Retention(keep_daily=1), NOW)
    assert decision.expire == []
    assert [lk.backup_id for lk in decision.locked] == ["b0"]


def test_a_catalog_that_contradicts_itself_is_refused() -> None:
    with pytest.raises(RetentionError, match="listed twice"):
        decide([backup(0, 1), backup(0, 2)], Retention(keep_daily=1), NOW)


@pytest.mark.parametrize("count", [0, 1, 999, 1000, 1001, 2500])
def test_deletions_go_in_batches_of_at_most_1000_keys(count: int) -> None:
    keys = [(f"k{i}", f"v{i}") for i in range(count)]
    batches = deletion_batches(keys)
    assert all(1 <= len(b) <= 1000 for b in batches)
    assert [k for b in batches for k in b] == keys
