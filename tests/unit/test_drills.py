"""Restore drills' pure parts: the policy section's checks, which backup a drill picks, the
verdict and RTO from a restore's outcome, stale copies, and the schedule."""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime

import boto3
import pytest

from shardvault.assurance import drills
from shardvault.assurance.drills import DrillContext, DrillRequest
from shardvault.client.operations import ClientConfig
from shardvault.config.policy import PolicyError, parse_policy
from shardvault.contracts.catalog import DrillItem, restore_key
from shardvault.errors import DrillAlreadyRunning, InvalidRequest
from shardvault.local import scheduler
from tests.unit.support import catalog_item

from .support import moto_services

BASE = """
version: 1
clusters:
  orders:
    engine: postgres
    schedule: {full: "0 2 * * *"}
    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}
    retention: {keep_daily: 7}
"""
DRILL = "    drill: {cron: '0 9 * * 3', timezone: Europe/Paris, target_cluster: orders-drill%s}\n"
DAY = 86400.0
NOW = 1_800_000_000.0
GONE = "arn:aws:states:us-east-1:123456789012:execution:drill:gone"  # no such execution


def policy_text(extra: str = "") -> str:
    return BASE + DRILL % extra


def test_a_drill_section_is_read_with_its_defaults():
    drill = parse_policy(policy_text()).clusters["orders"].drill
    assert drill.target_cluster == "orders-drill"
    assert (drill.backup, drill.within_days, drill.keep_minutes) == ("latest", 7, 60)
    assert drill.rto_target_minutes is None
    # Wednesdays at 09:00 in Paris: 08:00 UTC in November.
    fired = list(
        drill.fires(datetime(2026, 11, 23, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC))
    )
    assert [at.astimezone(UTC).strftime("%a %H:%M") for at in fired] == ["Wed 08:00"]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            BASE + "    drill: {cron: '0 9 * * 3', target_cluster: orders}\n",
            "a cluster this policy backs up",
        ),
        (policy_text(", validation_queries: ['DELETE FROM t']"), "validation_queries"),
        (policy_text(", keep_minutes: -1"), "keep_minutes"),
        (  # a SQLite shard is one database: refused here, not at every drill
            policy_text(", validation_queries: ['shop: SELECT true']").replace(
                "engine: postgres", "engine: sqlite"
            ),
            "a SQLite shard is one database",
        ),
        (policy_text(", backup: oldest"), "backup"),
    ],
)
def test_a_drill_that_could_harm_or_mean_nothing_is_refused_by_name(text, named):
    with pytest.raises(PolicyError) as refused:
        parse_policy(text)
    assert named in str(refused.value) + str(refused.value.fix)


def test_two_clusters_cannot_drill_into_one_target():
    second = BASE.replace("orders:", "billing:").split("clusters:\n")[1]
    text = policy_text() + second + DRILL % ""
    with pytest.raises(PolicyError, match="both drill into 'orders-drill'"):
        parse_policy(text)


def backup(backup_id: str, completed_at: float, status: str = "COMPLETE") -> dict:
    return {
        "cluster": "orders",
        "backup_id": backup_id,
        "status": status,
        "completed_at": completed_at,
        "manifest_key": f"backups/orders/{backup_id}/manifest.json",
    }


def drill_item(drill_id: str, **fields: object) -> dict:
    """A drill's item under the drilled cluster (``orders``), started at ``NOW``."""
    return {
        "cluster": "orders",
        "backup_id": f"drill#{drill_id}",
        "drill_id": drill_id,
        "status": "passed",
        "started_at": NOW,
        **fields,
    }


def test_a_drill_picks_the_newest_or_a_random_recent_complete_backup(monkeypatch):
    with moto_services(monkeypatch, policy=policy_text(", backup: random, within_days: 3")) as svc:
        for record in (
            backup("a-old", NOW - 10 * DAY),
            backup("b", NOW - 2 * DAY),
            backup("c", NOW - DAY),
            backup("d-failed", NOW - 1, status="FAILED"),
        ):
            svc.catalog.put(catalog_item(record))
        spec = svc.policy().clusters["orders"].drill
        request = DrillRequest(cluster="orders")
        picks = {
            drills.pick_backup(request, spec, svc, NOW, random.Random(seed)).backup_id
            for seed in range(20)
        }
        assert picks == {"b", "c"}  # complete and within 3 days; never the failed one
        latest = DrillRequest(cluster="orders", backup_id="latest")
        assert drills.pick_backup(latest, spec, svc, NOW, random.Random(0)).backup_id == "c"
        # Nothing in the window: the newest complete one.
        assert (
            drills.pick_backup(request, spec, svc, NOW + 30 * DAY, random.Random(0)).backup_id
            == "c"
        )


def waiting_machine() -> str:
    """A state machine whose executions run for an hour (moto keeps them RUNNING whether or
    not its interpreter is on: a local stack in the same process turns it on)."""
    wait = {"StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 3600, "End": True}}}
    return boto3.client("stepfunctions").create_state_machine(
        name=f"m-{uuid.uuid4().hex[:8]}",
        definition=json.dumps(wait),
        roleArn="arn:aws:iam::123456789012:role/drill",
    )["stateMachineArn"]


def running_execution(machine: str = "", name: str = "") -> str:
    return boto3.client("stepfunctions").start_execution(
        stateMachineArn=machine or waiting_machine(), name=name or uuid.uuid4().hex
    )["executionArn"]


def test_a_drill_takes_its_target_and_a_second_is_refused_while_the_first_runs(monkeypatch):
    with moto_services(
        monkeypatch, policy=policy_text(", validation_queries: ['SELECT true']")
    ) as svc:
        svc.catalog.put(catalog_item(backup("b1", NOW - 60)))
        first = running_execution()
        started = drills.start(DrillRequest(cluster="orders"), svc, NOW, first)
        restore = started["restore"]
        assert restore["backup_id"] == "b1"
        assert restore["target_cluster"] == "orders-drill"
        assert restore["validation_queries"] == ["SELECT true"]
        assert started["restore_name"] == f"drill-{started['drill']['drill_id']}"
        assert started["teardown"] == []
        (record,) = svc.catalog.drills("orders")
        assert record.status == "running"
        assert record.keep_seconds == 3600
        assert svc.catalog.lock_holder("orders-drill", "#drill").execution_id == first
        # A retried start of the same execution goes on with its drill.
        again = drills.start(DrillRequest(cluster="orders"), svc, NOW + 1, first)
        assert again["drill"]["drill_id"] == started["drill"]["drill_id"]
        # Another execution is refused while the first runs, and writes nothing.
        with pytest.raises(DrillAlreadyRunning):
            drills.start(DrillRequest(cluster="orders"), svc, NOW + 2, running_execution())
        assert len(svc.catalog.drills("orders")) == 1
        # Once the first has ended (here: an execution moto does not know), the target is
        # taken over and the first one's copy is stale.
        gone = DrillItem.changes(execution_id=GONE)
        svc.catalog.update("orders", "drill#" + record.drill_id, gone)
        svc.catalog.put(
            catalog_item(
                {
                    "cluster": "orders-drill",
                    "backup_id": "#drill",
                    "holder": "x",
                    "execution_id": GONE,
                }
            )
        )
        third = drills.start(DrillRequest(cluster="orders"), svc, NOW + 3, running_execution())
        assert third["drill"]["stale"] == [record.drill_id]


def test_a_stopped_drill_whose_restore_still_runs_holds_its_target(monkeypatch):
    with moto_services(monkeypatch, policy=policy_text()) as svc:
        svc.catalog.put(catalog_item(backup("b1", NOW - 60)))
        restores = waiting_machine()
        svc.catalog.try_lock("orders-drill", "d1", GONE, key="#drill")  # its execution ended
        running_execution(restores, "drill-d1")  # but its nested restore has not
        with pytest.raises(DrillAlreadyRunning):
            drills.start(DrillRequest(cluster="orders"), svc, NOW, restore_machine=restores)
        # A retried start of an execution that took the lock and wrote no record goes on
        # with the lock's drill id, and the lock is released under it at the end.
        mine = running_execution()
        svc.catalog.put(
            catalog_item(
                {
                    "cluster": "orders-drill",
                    "backup_id": "#drill",
                    "holder": "d7",
                    "execution_id": mine,
                }
            )
        )
        started = drills.start(
            DrillRequest(cluster="orders"), svc, NOW, mine, restore_machine=restores
        )
        assert started["drill"]["drill_id"] == "d7"
        drill = DrillContext.model_validate(started["drill"])
        drills.note_teardown(drill, "after", [], [], svc, NOW)
        assert svc.catalog.lock_holder("orders-drill", "#drill") is None


def test_a_teardown_that_failed_as_a_whole_removes_no_copy_from_the_record(monkeypatch):
    with moto_services(monkeypatch) as svc:
        svc.catalog.put(catalog_item(drill_item("d0")))
        asked = [{"node_id": "n1", "restore_id": "r0", "drill_id": "d0"}]
        every = [{"restore_id": "*", "torn_down": False}]  # the ASL's TeardownFailed
        noted = drills.note_teardown(
            context(drill_id="d2", stale=["d0"]), "before", asked, every, svc, NOW
        )
        assert noted == {"removed": [], "left": ["d0"]}


def test_a_drill_never_restores_into_a_cluster_someone_backs_up(monkeypatch):
    other = BASE.replace("orders:", "billing:").split("clusters:\n")[1]
    with moto_services(monkeypatch, policy=policy_text() + other) as svc:
        svc.catalog.put(catalog_item(backup("b1", NOW - 60)))
        svc.catalog.put(
            catalog_item({**backup("a1", NOW - 60), "cluster": "analytics"})
        )  # not in the policy
        for target in ("orders", "billing", "analytics"):
            request = DrillRequest(cluster="orders", target_cluster=target)
            with pytest.raises(InvalidRequest, match="is backed up"):
                drills.start(request, svc, NOW)
        # billing's drill into orders' target: the target is orders' own.
        with pytest.raises(InvalidRequest, match="the drill target of cluster 'orders'"):
            drills.start(DrillRequest(cluster="billing", target_cluster="orders-drill"), svc, NOW)
        assert svc.catalog.drills("orders") == []
        assert svc.catalog.lock_holder("orders-drill", "#drill") is None


def test_a_drill_without_a_policy_section_or_a_target_is_refused(monkeypatch):
    with moto_services(monkeypatch, policy=BASE) as svc:
        svc.catalog.put(catalog_item(backup("b1", NOW - 60)))
        with pytest.raises(InvalidRequest, match="no drill in the policy"):
            drills.start(DrillRequest(cluster="orders"), svc, NOW)
        assert svc.catalog.drills("orders") == []


def test_a_refused_scheduled_drill_is_recorded_for_the_operator(monkeypatch):
    with moto_services(monkeypatch, policy=policy_text()) as svc:
        request = DrillRequest(cluster="orders", requested_by="schedule:drill")
        with pytest.raises(Exception, match="no complete backup"):
            drills.start(request, svc, NOW)
        (record,) = svc.catalog.drills("orders")
        assert record.status == "refused"
        assert record.error == "BackupNotFound"


def context(**changes) -> DrillContext:
    values = {
        "drill_id": "d1",
        "cluster": "orders",
        "target_cluster": "orders-drill",
        "backup_id": "b1",
        "started_at": NOW,
        "keep_seconds": 600,
        "rto_target_seconds": 120.0,
    }
    return DrillContext(**(values | changes))


def restore_record(svc, status: str = "COMPLETE", **fields) -> None:
    svc.catalog.put(
        catalog_item(
            {
                "cluster": "orders-drill",
                "backup_id": restore_key("r1"),
                "restore_id": "r1",
                "status": status,
                "source_cluster": "orders",
                "source_backup_id": "b1",
                "execution_id": "arn:aws:states:us-east-1:1:execution:restore:drill-d1",
                "placement": {"shard-1": "n1", "shard-2": "n2", "shard-3": "n1"},
                **fields,
            }
        )
    )


def test_a_validated_restore_passes_with_its_rto_and_its_copy_kept_then_torn_down(monkeypatch):
    with moto_services(monkeypatch) as svc:
        svc.catalog.put(catalog_item(drill_item("d1")))
        restore_record(svc)
        summary = {
            "completed_at": NOW + 90,
            "duration_seconds": 80,
            "bytes": 5 << 20,
            "shards": [{"checks": {"pg_amcheck --all": "ok", "query 1": "true"}}] * 3,
        }
        result = drills.record(context(), {"output": summary}, None, svc, NOW + 91)
        assert result["verdict"] == "passed"
        assert result["rto_seconds"] == 90
        assert result["keep_seconds"] == 600
        assert result["teardown"] == [
            {"node_id": "n1", "restore_id": "r1", "drill_id": "d1"},
            {"node_id": "n2", "restore_id": "r1", "drill_id": "d1"},
        ]
        (record,) = svc.catalog.drills("orders")
        assert record.checks_passed == 6
        assert record.nodes == ["n1", "n2"]
        # Slower than its target: slow, and the copy is kept and torn down all the same.
        slow = drills.record(context(rto_target_seconds=60.0), {"output": summary}, None, svc, NOW)
        assert slow["verdict"] == "slow"
        assert slow["error"] == "RtoOverTarget"
        assert slow["teardown"]


def test_a_failed_restore_fails_the_drill_with_the_nodes_cause(
    monkeypatch,
):
    with moto_services(monkeypatch) as svc:
        svc.catalog.put(catalog_item(drill_item("d1")))
        restore_record(svc, "FAILED", error="ChecksumMismatch", cause="object k: part 3 differs")
        nested = {"Status": "FAILED", "Error": "States.TaskFailed", "Cause": "generic"}
        error = {"Error": "States.TaskFailed", "Cause": json.dumps(nested)}
        result = drills.record(context(), None, error, svc, NOW)
        assert result["verdict"] == "failed"
        assert result["error"] == "ChecksumMismatch"
        assert result["cause"] == "object k: part 3 differs"
        # Its own failure path should have removed the copy; the undo runs again all the same.
        assert [t["node_id"] for t in result["teardown"]] == ["n1", "n2"]
        assert result["keep_seconds"] == 0
        # A failure the nested execution names with nulls is still named.
        bare = drills.record(context(drill_id="d9"), None, {"Error": None, "Cause": None}, svc, NOW)
        assert bare["error"] == "States.Runtime"


def test_copies_of_drills_that_ended_without_a_teardown_are_torn_down_first(monkeypatch):
    with moto_services(monkeypatch) as svc:
        restore_record(svc)
        ended = {"cluster": "orders", "target_cluster": "orders-drill", "execution_id": "x"}
        earlier = [
            ended | {"drill_id": "d1", "status": "passed", "restore_execution": "drill-d1"},
            ended
            | {
                "drill_id": "d0",
                "status": "passed",
                "restore_execution": "drill-d0",
                "torn_down_at": NOW,
            },
            # Refused before its Plan: nothing placed, stale only to be marked.
            ended | {"drill_id": "dx", "status": "failed", "restore_execution": "drill-dx"},
            # Another target's copy, its drill still running: not this drill's to remove.
            ended
            | {
                "drill_id": "dr",
                "status": "passed",
                "restore_execution": "drill-dr",
                "target_cluster": "elsewhere",
                "execution_id": running_execution(),
            },
        ]
        items = [
            DrillItem.model_validate({"backup_id": f"drill#{e['drill_id']}", "started_at": NOW} | e)
            for e in earlier
        ]
        stale, teardown = drills.stale_copies(items, "", svc)
        assert stale == ["d1", "dx"]
        assert teardown == [
            {"node_id": "n1", "restore_id": "r1", "drill_id": "d1"},
            {"node_id": "n2", "restore_id": "r1", "drill_id": "d1"},
        ]


def test_a_copy_a_node_could_not_tear_down_stays_recorded_for_the_next_drill(monkeypatch):
    with moto_services(monkeypatch) as svc:
        for drill_id in ("d0", "d1", "d2"):
            svc.catalog.put(catalog_item(drill_item(drill_id)))
        svc.catalog.try_lock("orders-drill", "d2", "arn:x", key="#drill")
        drill = context(drill_id="d2", stale=["d0", "d1"])
        asked = [
            {"node_id": "n1", "restore_id": "r0", "drill_id": "d0"},
            {"node_id": "n1", "restore_id": "r1", "drill_id": "d1"},
            {"node_id": "n2", "restore_id": "r1", "drill_id": "d1"},
        ]
        answers = [asked[0], asked[1], asked[2] | {"torn_down": False, "error": "States.Timeout"}]
        noted = drills.note_teardown(drill, "before", asked, answers, svc, NOW)
        assert noted == {"removed": ["d0"], "left": ["d1"]}
        assert svc.catalog.drills("orders")[1].torn_down_at is None
        assert svc.catalog.lock_holder("orders-drill", "#drill")  # held through the restore
        mine = [{"node_id": "n1", "restore_id": "r2", "drill_id": "d2"}]
        assert drills.note_teardown(drill, "after", mine, mine, svc, NOW)["removed"] == ["d2"]
        assert svc.catalog.drills("orders")[2].torn_down_at == NOW
        assert svc.catalog.lock_holder("orders-drill", "#drill") is None


def test_a_tick_starts_the_drills_that_fell_due():
    policy = parse_policy(policy_text())
    started = []

    def start_drill(config, request):
        started.append((request.cluster, request.requested_by))
        return "arn:drill"

    lines = scheduler.tick(
        policy,
        ClientConfig("sm", "catalog"),
        datetime(2026, 11, 25, 7, 0, tzinfo=UTC),
        datetime(2026, 11, 25, 9, 0, tzinfo=UTC),
        start=lambda *_: "arn:backup",
        start_drill=start_drill,
    )
    assert started == [("orders", "schedule:drill")]
    assert [line["kind"] for line in lines] == ["drill"]
