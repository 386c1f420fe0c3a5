"""The local scheduler starts exactly the backups the policy's cron expressions put in a
window, in their time zones, a full winning a minute both claim."""

from __future__ import annotations

from datetime import UTC, datetime

from shardvault.client.operations import ClientConfig
from shardvault.config.policy import parse_policy
from shardvault.local import scheduler

POLICY = """
version: 1
clusters:
  paris:
    engine: postgres
    schedule: {timezone: Europe/Paris, full: "0 2 * * 0", incremental: "0 2 * * *"}
    vault: {storage_class: DEEP_ARCHIVE, object_lock: {mode: GOVERNANCE, days: 30}}
    retention: {keep_daily: 7}
  utc:
    engine: sqlite
    schedule: {full: "30 3 * * *"}
    vault: {storage_class: GLACIER_IR, object_lock: {mode: COMPLIANCE, days: 14}}
    retention: {keep_daily: 3}
"""


def test_due_backups_follow_each_clusters_time_zone_and_cadence():
    policy = parse_policy(POLICY)
    # Saturday 2026-11-21 00:00 UTC to Monday 2026-11-23 00:00 UTC.
    fired = scheduler.due(
        policy, datetime(2026, 11, 21, tzinfo=UTC), datetime(2026, 11, 23, tzinfo=UTC)
    )
    as_utc = [
        (at.astimezone(UTC).strftime("%a %H:%M"), name, str(kind)) for at, name, kind in fired
    ]
    assert as_utc == [
        ("Sat 01:00", "paris", "incremental"),  # 02:00 in Paris (UTC+1 in November)
        ("Sat 03:30", "utc", "full"),
        ("Sun 01:00", "paris", "full"),  # Sunday: the full wins the minute
        ("Sun 03:30", "utc", "full"),
    ]


def test_a_tick_starts_each_due_backup_once():
    policy = parse_policy(POLICY)
    started = []

    def start(config, request):
        started.append((request.cluster, request.requested_by))
        return f"arn:{len(started)}"

    config = ClientConfig("sm", "catalog")
    since, until = (
        datetime(2026, 11, 22, 0, 0, tzinfo=UTC),
        datetime(2026, 11, 22, 2, 0, tzinfo=UTC),
    )
    lines = scheduler.tick(policy, config, since, until, start)
    assert started == [("paris", "schedule:full")]
    assert lines[0]["execution"] == "arn:1"
    assert scheduler.tick(policy, config, until, until, start) == []  # nothing twice
