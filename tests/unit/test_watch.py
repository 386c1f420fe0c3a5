"""The backup age the watch publishes: from the newest complete backup, or (none complete)
from the first recorded attempt, so a cluster that fails or is refused every night ages. Its
stalled spools, and the agents older than the control plane (their backups are refused)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from shardvault.assurance.watch import (
    NAMESPACE,
    OUTDATED_AGENTS_METRIC,
    SPOOL_STALL_SECONDS,
    backup_age_hours,
    observe,
    watch,
)
from shardvault.contracts.models import AGENT_PROTOCOL, ShardInfo
from tests.unit.support import catalog_item, leader_node, moto_services

HOUR = 3600.0


def record(backup_id: str, status: str, started_at: float, **fields: float) -> dict:
    return {
        "cluster": "a",
        "backup_id": backup_id,
        "status": status,
        "started_at": started_at,
        **fields,
    }


def test_the_age_runs_from_the_newest_complete_backup_or_the_first_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = 1_800_000_000.0
    with moto_services(monkeypatch) as svc:
        assert backup_age_hours(svc, "a", now) is None  # never attempted
        svc.catalog.put(catalog_item(record("20270115T000000Z-aaaaaa", "FAILED", now - 50 * HOUR)))
        svc.catalog.put(catalog_item(record("20270116T000000Z-bbbbbb", "REFUSED", now - 26 * HOUR)))
        assert backup_age_hours(svc, "a", now) == pytest.approx(50)
        svc.catalog.put(
            catalog_item(
                record(
                    "20270116T010000Z-cccccc",
                    "COMPLETE",
                    now - 30 * HOUR,
                    completed_at=now - 29 * HOUR,
                )
            )
        )
        svc.catalog.put(
            catalog_item(
                record(
                    "20270116T020000Z-dddddd",
                    "COMPLETE",
                    now - 10 * HOUR,
                    completed_at=now - 9 * HOUR,
                )
            )
        )
        svc.catalog.put(catalog_item(record("20270117T000000Z-eeeeee", "FAILED", now - 1 * HOUR)))
        assert backup_age_hours(svc, "a", now) == pytest.approx(9)


def test_a_spool_that_has_not_drained_for_15_minutes_counts_as_stalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = 1_800_000_000.0
    node = leader_node("a", heartbeat_at=now - 100)

    def spooled(shard_id: str, waiting: int, oldest: float) -> ShardInfo:
        return ShardInfo(
            shard_id=shard_id,
            role="leader",
            wal_spool_bytes=waiting,
            wal_spool_oldest_seconds=oldest,
        )

    shards = [
        spooled("stuck", 16 << 20, SPOOL_STALL_SECONDS - 50),  # + 100 s since the heartbeat
        spooled("busy", 16 << 20, SPOOL_STALL_SECONDS - 150),  # waiting, but not long
        spooled("drained", 0, 0.0),
        ShardInfo(shard_id="plain", role="leader"),  # no spool
    ]
    with moto_services(monkeypatch) as svc:
        svc.nodes.put(node.model_copy(update={"shards": shards}))
        assert observe(svc, now).stalled_spools == ["a/a-n1/stuck"]


def test_agents_older_than_the_control_plane_are_counted_and_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = 1_800_000_000.0
    current = leader_node("a", heartbeat_at=now)
    older = leader_node("b", heartbeat_at=now).model_copy(update={"protocol": AGENT_PROTOCOL - 1})
    with moto_services(monkeypatch) as svc:
        svc.nodes.put(current)
        svc.nodes.put(older)
        assert watch(svc, now)["outdated_nodes"] == [f"b/b-n1 (protocol {AGENT_PROTOCOL - 1})"]
        answer = svc.cloudwatch.get_metric_statistics(
            Namespace=NAMESPACE,
            MetricName=OUTDATED_AGENTS_METRIC,
            StartTime=datetime.fromtimestamp(now - 60, UTC),
            EndTime=datetime.fromtimestamp(now + 60, UTC),
            Period=60,
            Statistics=["Maximum"],
        )
        assert [point["Maximum"] for point in answer["Datapoints"]] == [1.0]
