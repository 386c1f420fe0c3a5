"""Retention decisions (``shardvault.lifecycle.retention.decide``).

Property-based over generated histories (hypothesis): the decision equals a reference model of
restic's keep rules written differently (grouping by bucket), and what a user relies on always
holds: the newest backup survives, every chain a surviving backup needs survives, a rule keeps
at most one backup per bucket and at most its count, nothing is deleted before its Object Lock
date, expiring younger than the class's minimum billed duration is charged and said so, and
deletions go in batches S3 accepts. Holds (a backup retention expired is deleted only once its
class's paid minimum has passed) move deletions, never what is kept, and never keep a parent
for a held child. Then a few hand-built histories with their expected decision, to read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from datetime import UTC, datetime, timedelta
from itertools import product
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvault.config.policy import BackupKind, Retention
from shardvault.lifecycle.costs import monthly_storage_cost
from shardvault.lifecycle.retention import (
    BackupRecord,
    RetentionDecision,
    RetentionError,
    Rule,
    decide,
    deletion_batches,
)
from shardvault.pricing.prices import DAYS_PER_MONTH, STORAGE, StorageClass

NOW = datetime(2026, 11, 22, 12, tzinfo=UTC)  # a Sunday, in ISO week 2026-W47
PROMPT = {"delete_before_paid_minimum": True}  # no holds: deleted when retention expires
GiB = 2**30
ZONES = ["UTC", "Europe/Paris", "America/New_York", "Pacific/Auckland", "Asia/Kolkata"]

# The buckets, written independently of the module: day, ISO week, month, year.
BUCKET_OF: dict[Rule, Callable[[datetime], Hashable]] = {
    Rule.DAILY: lambda at: at.date(),
    Rule.WEEKLY: lambda at: at.isocalendar()[:2],
    Rule.MONTHLY: lambda at: (at.year, at.month),
    Rule.YEARLY: lambda at: at.year,
}


def counts_of(keep: Retention) -> dict[Rule, int]:
    return {
        Rule.DAILY: keep.keep_daily,
        Rule.WEEKLY: keep.keep_weekly,
        Rule.MONTHLY: keep.keep_monthly,
        Rule.YEARLY: keep.keep_yearly,
    }


# --- Generated histories -----------------------------------------------------------------------
@st.composite
def histories(draw: st.DrawFn) -> list[BackupRecord]:
    """Backups of one or two clusters, ending at NOW. Gaps of minutes to weeks put several
    backups in one bucket or leave buckets empty. An incremental's parent is an earlier backup
    of its cluster (usually the one before it); some backups are still under Object Lock."""
    clusters = draw(st.sampled_from([["a"], ["a", "b"]]))
    count = draw(st.integers(1, 40))
    minutes = st.one_of(st.integers(1, 12 * 60), st.integers(12 * 60, 40 * 24 * 60))
    gaps = draw(st.lists(minutes, min_size=count, max_size=count))
    at = NOW - timedelta(minutes=sum(gaps[1:]))
    backups: list[BackupRecord] = []
    for n, gap in enumerate(gaps):
        at += timedelta(minutes=gap) if n else timedelta(0)
        cluster = draw(st.sampled_from(clusters))
        earlier = [b.backup_id for b in backups if b.cluster == cluster]
        parent = None
        if earlier and draw(st.booleans()):
            parent = draw(st.sampled_from([earlier[-1], *earlier]))
        lock_days = draw(st.sampled_from([None, 1, 7, 30, 90]))
        backups.append(
            BackupRecord(
                backup_id=f"b{n:03d}",
                cluster=cluster,
                completed_at=at,
                kind=BackupKind.INCREMENTAL if parent else BackupKind.FULL,
                parent_id=parent,
                storage_class=draw(st.sampled_from(list(StorageClass))),
                retain_until=at + timedelta(days=lock_days) if lock_days else None,
                bytes=draw(st.integers(0, 5 * 1024 * GiB)),
                objects=draw(st.integers(1, 2000)),
            )
        )
    return backups


@st.composite
def retentions(draw: st.DrawFn) -> Retention:
    """Keep counts; the policy refuses all zeros (it would keep only the newest)."""
    counts = st.tuples(st.integers(0, 10), st.integers(0, 6), st.integers(0, 14), st.integers(0, 3))
    daily, weekly, monthly, yearly = draw(counts.filter(any))
    return Retention(keep_daily=daily, keep_weekly=weekly, keep_monthly=monthly, keep_yearly=yearly)


# --- The reference model -----------------------------------------------------------------------
def kept_by_rules(
    backups: list[BackupRecord], keep: Retention, zone: ZoneInfo
) -> dict[Rule, set[str]]:
    """Per rule and cluster: the buckets ordered by their newest backup, the first N of them,
    and the newest backup of each."""
    kept: dict[Rule, set[str]] = defaultdict(set)
    by_cluster: dict[str, list[BackupRecord]] = defaultdict(list)
    for b in backups:
        by_cluster[b.cluster].append(b)
    for group in by_cluster.values():
        newest_first = sorted(group, key=lambda b: b.completed_at, reverse=True)
        kept[Rule.NEWEST].add(newest_first[0].backup_id)
        for rule, count in counts_of(keep).items():
            newest_of_bucket: dict[Hashable, str] = {}
            for b in newest_first:
                newest_of_bucket.setdefault(
                    BUCKET_OF[rule](b.completed_at.astimezone(zone)), b.backup_id
                )
            kept[rule] |= set(list(newest_of_bucket.values())[:count])
    return kept


def chain(backup_id: str, by_id: dict[str, BackupRecord]) -> list[str]:
    """The backups ``backup_id`` needs to restore: its parent, that one's parent, ..."""
    needs, parent = [], by_id[backup_id].parent_id
    while parent:
        needs.append(parent)
        parent = by_id[parent].parent_id
    return needs


def is_locked(b: BackupRecord) -> bool:
    return b.retain_until is not None and b.retain_until > NOW


def expected(
    backups: list[BackupRecord], keep: Retention, zone: ZoneInfo
) -> tuple[set[str], set[str], set[str]]:
    """(kept, locked, expired) as the rules, chains and locks say."""
    by_id = {b.backup_id: b for b in backups}
    by_rule = kept_by_rules(backups, keep, zone)
    kept = set().union(*by_rule.values())
    protected = kept | {b.backup_id for b in backups if is_locked(b)}
    for backup_id in protected:
        kept |= set(chain(backup_id, by_id))
    locked = protected - kept
    return kept, locked, set(by_id) - kept - locked


# --- Properties --------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(histories(), retentions(), st.sampled_from(ZONES))
def test_the_decision_is_restics_rules_plus_chains_and_locks(
    backups: list[BackupRecord], keep: Retention, zone_name: str
) -> None:
    zone = ZoneInfo(zone_name)
    decision = decide(backups, keep, NOW, zone, **PROMPT)
    kept, locked, expired = expected(backups, keep, zone)
    assert {k.backup_id for k in decision.keep} == kept
    assert {lk.backup_id for lk in decision.locked} == locked
    assert set(decision.expire) == expired
    assert len(decision.expire) == len(expired)  # each once
    reference = kept_by_rules(backups, keep, zone)
    for rule in (Rule.NEWEST, *BUCKET_OF):
        by_rule = {k.backup_id for k in decision.keep if rule in {r.rule for r in k.reasons}}
        assert by_rule == reference[rule], rule


@settings(max_examples=400, deadline=None)
@given(histories(), retentions(), st.sampled_from(ZONES))
def test_what_retention_must_never_do(
    backups: list[BackupRecord], keep: Retention, zone_name: str
) -> None:
    zone = ZoneInfo(zone_name)
    decision = decide(backups, keep, NOW, zone)
    by_id = {b.backup_id: b for b in backups}
    expired = set(decision.expire)
    survivors = {k.backup_id for k in decision.keep} | {lk.backup_id for lk in decision.locked}
    # The newest backup of each cluster survives.
    for cluster in {b.cluster for b in backups}:
        newest = max((b for b in backups if b.cluster == cluster), key=lambda b: b.completed_at)
        assert newest.backup_id in survivors
    # A surviving incremental keeps its whole chain: nothing it needs is expired.
    for backup_id in survivors:
        assert not set(chain(backup_id, by_id)) & expired, f"{backup_id} loses its chain"
    assert decision.unrestorable == []
    # Nothing is deleted before its Object Lock retain-until date.
    assert not {b for b in expired if is_locked(by_id[b])}
    # In each cluster, a rule keeps one backup per bucket and at most its count of them.
    for cluster, (rule, limit) in product({b.cluster for b in backups}, counts_of(keep).items()):
        by_rule = [
            by_id[k.backup_id]
            for k in decision.keep
            if by_id[k.backup_id].cluster == cluster and rule in {r.rule for r in k.reasons}
        ]
        buckets = [BUCKET_OF[rule](b.completed_at.astimezone(zone)) for b in by_rule]
        assert len(by_rule) <= limit, (cluster, rule)
        assert len(set(buckets)) == len(buckets), (cluster, rule)
    # Expired newest first, so a deletion cut short never leaves a child without its parent.
    times = [by_id[b].completed_at for b in decision.expire]
    assert times == sorted(times, reverse=True)


def paid_until(b: BackupRecord) -> datetime:
    return b.completed_at + timedelta(days=STORAGE[b.storage_class].minimum_days)


def expected_holds(backups: list[BackupRecord], expired: set[str]) -> dict[str, datetime]:
    """The reference model of holds, recursive over chains: an expired backup is held until
    its paid minimum, or its parent's hold's end if sooner; not at all once that has passed,
    or when its parent is deleted now or already gone."""
    by_id = {b.backup_id: b for b in backups}

    def end(backup_id: str) -> datetime | None:  # None: deleted now
        b = by_id[backup_id]
        if backup_id not in expired:
            return datetime.max.replace(tzinfo=UTC)  # stays (kept or locked)
        until = paid_until(b)
        if b.parent_id is not None:
            parent = end(b.parent_id) if b.parent_id in by_id else None
            if parent is None:
                return None
            until = min(until, parent)
        return until if until > NOW else None

    return {b: until for b in expired if (until := end(b)) is not None}


@settings(max_examples=400, deadline=None)
@given(histories(), retentions(), st.sampled_from(ZONES))
def test_holds_move_deletions_to_the_paid_minimum_and_keep_nothing_more(
    backups: list[BackupRecord], keep: Retention, zone_name: str
) -> None:
    zone = ZoneInfo(zone_name)
    prompt = decide(backups, keep, NOW, zone, **PROMPT)
    held = decide(backups, keep, NOW, zone)
    by_id = {b.backup_id: b for b in backups}
    # Retention's choice is unchanged: the same kept (for the same reasons) and locked.
    assert held.keep == prompt.keep
    assert held.locked == prompt.locked
    # What it expired is either held (until when the model says) or deleted now.
    holds = {h.backup_id: h.until for h in held.held}
    assert holds == expected_holds(backups, set(prompt.expire))
    assert set(held.expire) == set(prompt.expire) - set(holds)
    assert [b for b in prompt.expire if b not in holds] == held.expire  # still newest first
    for backup_id, until in holds.items():
        b = by_id[backup_id]
        assert NOW < until <= paid_until(b)
        # Never deleted before a held child: the parent is held at least as long, or stays.
        assert b.parent_id not in held.expire
        if b.parent_id in holds:
            assert until <= holds[b.parent_id]
    # What the held backups cost a month: billed whether deleted or not.
    assert held.held_monthly_usd == pytest.approx(
        sum(
            monthly_storage_cost(by_id[b].storage_class, by_id[b].bytes, by_id[b].objects)
            for b in holds
        )
    )


@settings(max_examples=300, deadline=None)
@given(histories(), retentions())
def test_early_deletion_is_charged_and_reported(
    backups: list[BackupRecord], keep: Retention
) -> None:
    decision = decide(backups, keep, NOW)
    by_id = {b.backup_id: b for b in backups}

    def age_days(b: BackupRecord) -> float:
        return (NOW - b.completed_at) / timedelta(days=1)

    too_young = {
        b
        for b in decision.expire
        if age_days(by_id[b]) < STORAGE[by_id[b].storage_class].minimum_days
    }
    assert {e.backup_id for e in decision.early_deletions} == too_young
    for e in decision.early_deletions:
        b = by_id[e.backup_id]
        full_minimum = monthly_storage_cost(b.storage_class, b.bytes, b.objects) * (
            e.minimum_days / DAYS_PER_MONTH
        )
        assert e.minimum_days == STORAGE[b.storage_class].minimum_days
        assert 0 < e.charge_usd <= full_minimum
    assert decision.early_deletion_charge_usd == pytest.approx(
        sum(e.charge_usd for e in decision.early_deletions)
    )
    # What expiring saves is what the expired backups cost a month.
    assert decision.monthly_saving_usd == pytest.approx(
        sum(
            monthly_storage_cost(by_id[b].storage_class, by_id[b].bytes, by_id[b].objects)
            for b in decision.expire
        )
    )


@given(st.integers(0, 3500))  # as many versions as a large backup has
def test_deletions_go_in_batches_s3_accepts(count: int) -> None:
    keys = [(f"backups/c/b/{n}", f"version-{n}") for n in range(count)]
    batches = deletion_batches(keys)
    assert all(1 <= len(batch) <= 1000 for batch in batches)
    assert [key for batch in batches for key in batch] == keys  # all of them, in order
    assert len(batches) == -(-len(keys) // 1000)  # as few requests as possible


@pytest.mark.parametrize("size", [0, 1001])
def test_a_batch_size_s3_refuses_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="outside 1 to 1000"):
        deletion_batches(["k"], size)


# --- Hand-built histories ----------------------------------------------------------------------
def backup(name: str, at: datetime, **fields) -> BackupRecord:
    values = {
        "backup_id": name,
        "cluster": "c",
        "completed_at": at,
        "kind": BackupKind.FULL,
        "storage_class": StorageClass.DEEP_ARCHIVE,
        "bytes": GiB,
    }
    return BackupRecord(**(values | fields))


def weekly_fulls_daily_incrementals(lock_days: int) -> list[BackupRecord]:
    """Fulls on Sundays Nov 8, 15 and 22 at 02:00 UTC, incrementals on the days between, each
    the child of the backup before it: f08, i09 ... i14, f15, i16 ... i21, f22."""
    backups: list[BackupRecord] = []
    for day in range(8, 23):
        at = datetime(2026, 11, day, 2, tzinfo=UTC)
        full = at.weekday() == 6
        backups.append(
            backup(
                f"{'f' if full else 'i'}{day:02d}",
                at,
                kind=BackupKind.FULL if full else BackupKind.INCREMENTAL,
                parent_id=None if full else backups[-1].backup_id,
                storage_class=StorageClass.GLACIER_IR,
                retain_until=at + timedelta(days=lock_days),
            )
        )
    return backups


def why(decision: RetentionDecision) -> dict[str, set[str]]:
    return {k.backup_id: {str(r.rule) for r in k.reasons} for k in decision.keep}


def test_two_days_and_two_weeks_keep_this_weeks_chain_and_last_sundays_full() -> None:
    decision = decide(
        weekly_fulls_daily_incrementals(lock_days=7),
        Retention(keep_daily=2, keep_weekly=2),
        NOW,
        **PROMPT,
    )
    assert why(decision) == {
        "f22": {"newest", "daily", "weekly"},  # newest of Nov 22 and of ISO week 47
        "i21": {"daily"},  # newest of Nov 21
        "i20": {"chain"},  # i21 restores only with i20 ... i16 and f15
        "i19": {"chain"},
        "i18": {"chain"},
        "i17": {"chain"},
        "i16": {"chain"},
        "f15": {"weekly", "chain"},  # newest of ISO week 46 (Nov 9-15)
    }
    # Newest first: a deletion cut short leaves no incremental without its parent.
    assert decision.expire == ["i14", "i13", "i12", "i11", "i10", "i09", "f08"]
    assert decision.locked == []
    # GLACIER_IR bills 90 days; these are 8 to 14 days old: charged, and said so.
    assert [e.backup_id for e in decision.early_deletions] == decision.expire
    assert all(e.minimum_days == 90 for e in decision.early_deletions)
    assert decision.early_deletion_charge_usd > 0


def test_a_locked_incremental_keeps_its_chain_until_its_date() -> None:
    decision = decide(
        weekly_fulls_daily_incrementals(lock_days=10), Retention(keep_daily=2, keep_weekly=2), NOW
    )
    # i14 is locked until Nov 24 02:00; while it waits, so does everything it needs.
    assert [lk.backup_id for lk in decision.locked] == ["i14"]
    first_week = ["i13", "i12", "i11", "i10", "i09", "f08"]
    assert all(why(decision)[b] == {"chain"} for b in first_week)
    assert decision.expire == []
    # Two days later i14 is free, and the whole first week goes.
    later = decide(
        weekly_fulls_daily_incrementals(lock_days=10),
        Retention(keep_daily=2, keep_weekly=2),
        NOW + timedelta(days=2),
        **PROMPT,
    )
    assert later.expire == ["i14", "i13", "i12", "i11", "i10", "i09", "f08"]


def test_days_are_counted_in_the_schedules_time_zone() -> None:
    # 23:30 and 00:30 UTC are two days in UTC, one day (Nov 22) in Paris.
    backups = [
        backup("early", datetime(2026, 11, 20, 12, tzinfo=UTC)),
        backup("late", datetime(2026, 11, 21, 23, 30, tzinfo=UTC)),
        backup("newest", datetime(2026, 11, 22, 0, 30, tzinfo=UTC)),
    ]
    keep = Retention(keep_daily=2)
    assert decide(backups, keep, NOW, UTC, **PROMPT).expire == ["early"]
    assert decide(backups, keep, NOW, ZoneInfo("Europe/Paris"), **PROMPT).expire == ["late"]


def test_deep_archive_deleted_after_days_is_charged_for_the_rest_of_180() -> None:
    backups = [backup(f"b{n}", NOW - timedelta(days=d)) for n, d in enumerate([200, 3, 0.1])]
    decision = decide(backups, Retention(keep_daily=1), NOW, **PROMPT)
    assert decision.expire == ["b1", "b0"]
    (early,) = decision.early_deletions  # b0 is past 180 days: no charge
    assert early.backup_id == "b1"
    assert early.minimum_days == 180
    assert early.age_days == pytest.approx(3)
    # 177 of 180 days still due on 1 GiB (+ 32 KiB of archive metadata) at $0.00099/GB-month.
    assert early.charge_usd == pytest.approx(0.00099 * 177 / DAYS_PER_MONTH, rel=1e-3)


def test_a_deep_archive_backup_is_held_until_its_180_days_unless_the_policy_deletes_early():
    backups = [backup(f"b{n}", NOW - timedelta(days=d)) for n, d in enumerate([200, 3, 0.1])]
    decision = decide(backups, Retention(keep_daily=1), NOW)
    # b0 is past its 180 days: deleted; b1, 3 days old, is held 177 days more, not charged.
    assert decision.expire == ["b0"]
    (held,) = decision.held
    assert held.backup_id == "b1"
    assert held.until == NOW - timedelta(days=3) + timedelta(days=180)
    assert held.describe() == "held until 2027-05-18: paid minimum of DEEP_ARCHIVE"
    assert decision.early_deletions == []
    assert decision.held_monthly_usd == pytest.approx(0.00099 + 40 * 2**10 / GiB * 0.023, rel=0.1)
    # Kept as retention decided: the hold moves only the deletion.
    assert [k.backup_id for k in decision.keep] == ["b2"]
    # The day its minimum has passed, it goes.
    later = decide(backups, Retention(keep_daily=1), held.until + timedelta(minutes=1))
    assert "b1" in later.expire
    assert later.held == []
    # Erasure duties: the policy deletes when retention expires, and pays for it.
    prompt = decide(backups, Retention(keep_daily=1), NOW, delete_before_paid_minimum=True)
    assert prompt.expire == ["b1", "b0"]
    assert prompt.held == []


def test_the_hold_counts_from_when_the_backup_landed_in_its_class() -> None:
    landed = NOW - timedelta(days=2)
    backups = [
        backup("old", NOW - timedelta(days=181), landed_at=landed),
        backup("new", NOW - timedelta(hours=1)),
    ]
    (held,) = decide(backups, Retention(keep_daily=1), NOW).held
    assert held.until == landed + timedelta(days=180)


def test_an_incremental_is_held_no_longer_than_its_parent() -> None:
    # A full 170 days old (10 days of its 180 left) and its incremental 100 days old: neither
    # kept. The full is held 10 days; its child with it, not 80 (it never extends the parent).
    full_at, child_at = NOW - timedelta(days=170), NOW - timedelta(days=100)
    backups = [
        backup("f", full_at),
        backup("i", child_at, kind=BackupKind.INCREMENTAL, parent_id="f"),
        backup("newest", NOW - timedelta(hours=1)),
    ]
    decision = decide(backups, Retention(keep_daily=1), NOW)
    assert {h.backup_id: h.until for h in decision.held} == {
        "i": full_at + timedelta(days=180),
        "f": full_at + timedelta(days=180),
    }
    assert decision.expire == []
    # Once the full's minimum has passed, both go, the child first, it charged its 70 days left.
    later = decide(backups, Retention(keep_daily=1), full_at + timedelta(days=181))
    assert later.expire == ["i", "f"]
    assert [e.backup_id for e in later.early_deletions] == ["i"]


def test_a_held_incremental_does_not_keep_its_parent_past_its_own_minimum() -> None:
    # The parent (in GLACIER_IR, 90 days) has passed its minimum; its child (in DEEP_ARCHIVE)
    # has not. The parent is deleted, so the child is not held: it goes first, charged.
    backups = [
        backup("f", NOW - timedelta(days=95), storage_class=StorageClass.GLACIER_IR),
        backup("i", NOW - timedelta(days=94), kind=BackupKind.INCREMENTAL, parent_id="f"),
        backup("newest", NOW - timedelta(hours=1)),
    ]
    decision = decide(backups, Retention(keep_daily=1), NOW)
    assert decision.held == []
    assert decision.expire == ["i", "f"]
    assert [e.backup_id for e in decision.early_deletions] == ["i"]


def test_an_incremental_whose_parent_is_kept_is_held_to_its_own_minimum() -> None:
    # f is the newest of ISO week 45, j of week 46: both kept weekly. f's incremental i, in
    # week 46 before j, is kept by no rule: held to its own 180 days (f stays anyway).
    backups = [
        backup("f", datetime(2026, 11, 8, 2, tzinfo=UTC)),
        backup(
            "i", datetime(2026, 11, 12, 2, tzinfo=UTC), kind=BackupKind.INCREMENTAL, parent_id="f"
        ),
        backup("j", datetime(2026, 11, 14, 2, tzinfo=UTC)),
        backup("newest", NOW - timedelta(hours=1)),
    ]
    decision = decide(backups, Retention(keep_weekly=3), NOW)
    assert why(decision)["f"] == {"weekly"}  # not kept for its held child
    assert [(h.backup_id, h.until) for h in decision.held] == [
        ("i", datetime(2026, 11, 12, 2, tzinfo=UTC) + timedelta(days=180))
    ]


def test_a_kept_backup_whose_chain_is_already_gone_is_reported() -> None:
    backups = [
        backup("i2", NOW - timedelta(days=1), kind=BackupKind.INCREMENTAL, parent_id="gone"),
    ]
    decision = decide(backups, Retention(keep_daily=1), NOW)
    assert decision.unrestorable == ["i2"]


@pytest.mark.parametrize(
    ("backups", "says"),
    [
        ([backup("b0", NOW), backup("b0", NOW - timedelta(days=1))], "listed twice"),
        (
            [
                backup("p", NOW),
                backup("c", NOW - timedelta(days=1), kind=BackupKind.INCREMENTAL, parent_id="p"),
            ],
            "completed before its parent",
        ),
    ],
    ids=["duplicate", "child-before-parent"],
)
def test_a_catalog_that_contradicts_itself_is_refused(
    backups: list[BackupRecord], says: str
) -> None:
    with pytest.raises(RetentionError, match=says) as raised:
        decide(backups, Retention(keep_daily=1), NOW)
    assert "repair the catalog" in raised.value.fix


def test_now_without_a_time_zone_is_refused() -> None:
    with pytest.raises(RetentionError, match="no time zone"):
        decide([], Retention(keep_daily=1), datetime(2026, 11, 22))


def test_a_forecast_that_fails_does_not_stop_the_daily_run(monkeypatch, caplog) -> None:
    """Issue 44 (1) left this open: ``decide_all`` forecast every cluster's budget unguarded,
    so one cluster's failing forecast failed the daily run for every cluster, and nothing was
    expired anywhere. Now the failure is logged and the decisions stand."""
    from types import SimpleNamespace

    from shardvault.lifecycle import expire

    decided = {"cluster": "a", "expire": ["b-old"], "monthly_saving_usd": 1.0}
    decided |= {"early_deletion_charge_usd": 0.0}
    monkeypatch.setattr(expire, "clusters_to_check", lambda requested, svc: ["a", "b"])
    monkeypatch.setattr(expire, "decide_cluster", lambda cluster, svc, now: cluster)
    monkeypatch.setattr(expire, "unfinished", lambda cluster, svc: [])
    monkeypatch.setattr(
        expire,
        "decision_summary",
        lambda cluster, decision, unfinished: decided | {"cluster": cluster},
    )

    def forecast(cluster: str, svc: object) -> str | None:
        if cluster == "a":
            raise ValueError("a forecast that cannot be made")
        return "b is over its budget"

    monkeypatch.setattr(expire, "budget_alert", forecast)
    notified: list[str] = []
    svc = SimpleNamespace(notify=lambda subject, message: notified.append(message["alert"]))

    result = expire.decide_all(None, svc, 0.0, dry_run=True)

    assert [e["cluster"] for e in result["expire"]] == ["a", "b"]  # both clusters decided
    assert result["budget_alerts"] == ["b is over its budget"]
    assert notified == ["b is over its budget"]
    assert "budget of cluster a not checked: ValueError" in caplog.text
