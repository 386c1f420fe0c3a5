"""Scheduled cuts (shardvault.backup.cuts): the policy's period, the local scheduler's ticks,
the cut's catalog item from the nodes' answers (or a node's failure), which cut and base a
restore takes, and the catalog's readers of backups never paging through cut items."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from shardvault.backup import cuts
from shardvault.client.operations import ClientConfig
from shardvault.config.policy import parse_policy
from shardvault.contracts.catalog import CutItem, CutShardPoint, cut_key
from shardvault.contracts.models import (
    Engine,
    Manifest,
    NodeRecord,
    RestoreRequest,
    RestoreTarget,
    ShardInfo,
    is_cut_id,
)
from shardvault.errors import InvalidRequest, ShardVaultError, TargetOutOfRange
from shardvault.lifecycle.sweep import forget_cuts
from shardvault.local import scheduler
from shardvault.wal.archive import ShardArchive

from .support import backup_item, leader_node, moto_services

POLICY = """
version: 1
clusters:
  bank:
    engine: postgres
    schedule: {full: "0 2 * * *"}
    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}
    retention: {keep_daily: 7}
    cut: {commit_lock: 4242, database: bank, every_minutes: 15}
"""
ENTERED = "2026-12-06T10:15:00.000Z"
SIX = "000000010000000000000006"
INSTANT = datetime(2026, 12, 6, 10, 15, 2, tzinfo=UTC).timestamp()


def test_cuts_fall_on_the_clocks_multiples_of_their_period_one_per_late_tick() -> None:
    policy = parse_policy(POLICY)
    since, until = (
        datetime(2026, 12, 6, 10, 1, tzinfo=UTC),
        datetime(2026, 12, 6, 10, 50, tzinfo=UTC),
    )
    assert [at.minute for at in policy.clusters["bank"].cut.fires(since, until)] == [15, 30, 45]
    # A tick that comes late takes the newest due cut, not each it missed.
    assert scheduler.cuts_due(policy, since, until) == [
        (datetime(2026, 12, 6, 10, 45, tzinfo=UTC), "bank")
    ]
    started = []
    lines = scheduler.tick(
        policy,
        ClientConfig("sm", "catalog", cut_state_machine_arn="arn:cut-machine"),
        since,
        until,
        start_cut=lambda config, cluster, by: started.append((cluster, by)) or "arn:cut",
    )
    assert started == [("bank", "schedule:cut")]
    assert [line["kind"] for line in lines] == ["cut"]
    # A stack started by an older release has no cut machine: the tick says so, starts none.
    assert scheduler.tick(policy, ClientConfig("sm", "catalog"), since, until) == []


@pytest.mark.parametrize(
    ("cut", "problem"),
    [
        ("{every_minutes: 7}", "not one of the periods"),
        ("{every_minutes: 0}", "not one of the periods"),
        ("{every_minutes: '15'}", "every_minutes"),
    ],
)
def test_a_period_the_schedules_cannot_keep_is_refused_by_name(cut: str, problem: str) -> None:
    with pytest.raises(ShardVaultError, match=problem):
        parse_policy(POLICY.replace("{commit_lock: 4242, database: bank, every_minutes: 15}", cut))


def test_scheduled_cuts_of_an_engine_without_restore_points_are_refused() -> None:
    with pytest.raises(ShardVaultError, match="sqlite makes no restore point"):
        parse_policy(POLICY.replace("engine: postgres", "engine: sqlite"))


def marker(shard: str, at: float, pause: str | None = None, wal: str = "000000010000000000000003"):
    found = {
        "cut_name": "cut-x",
        "cut_lsn": "0/3000100",
        "cut_at": f"{at:.6f}",
        "cut_late_seconds": "0.000000",
        "cut_wal": wal,
    }
    return found | ({"cut_pause": pause} if pause else {})


def step(results: list[dict]) -> cuts.CutStep:
    return cuts.CutStep(
        phase="record",
        request={"cluster": "bank", "requested_by": "schedule:cut"},
        execution_id="arn:exec",
        plan={"cut_id": "cut-x", "entered": ENTERED, "margin_seconds": 2.0, "commit_lock": 4242},
        results=results,
    )


def answer(node: str, shard: str, at: float, pause: str) -> dict:
    return {"node_id": node, "shards": [{"shard_id": shard, "marker": marker(shard, at, pause)}]}


def test_a_cut_is_recorded_with_each_shards_point_its_skew_and_its_pause(monkeypatch) -> None:
    at = INSTANT
    with moto_services(monkeypatch) as svc:
        row = cuts.record(
            step(
                [
                    answer("n1", "s1", at + 0.001, f"{at} {at + 0.001} {at + 0.010}"),
                    answer("n2", "s2", at + 0.003, f"{at} {at + 0.002} {at + 0.011}"),
                ]
            ),
            svc,
            at + 1,
        )
        (item,) = svc.catalog.cuts("bank")
    assert row["cut_id"] == item.cut_id == "cut-x"
    assert item.backup_id == cut_key("cut-x")
    assert item.instant == pytest.approx(INSTANT)
    assert (item.status, item.cut_paused, item.best_effort) == ("complete", True, False)
    assert item.cut_skew_seconds == pytest.approx(0.002)
    assert item.shards["s2"] == CutShardPoint(
        node_id="n2", lsn="0/3000100", wal="000000010000000000000003", at=at + 0.003
    )
    assert item.requested_by == "schedule:cut"


def test_a_node_that_failed_its_cut_is_named_in_a_failed_item_then_raised(monkeypatch) -> None:
    failure = {"Error": "EngineError", "Cause": "cannot create restore point cut-x on shard s2"}
    with moto_services(monkeypatch) as svc:
        results = [answer("n1", "s1", INSTANT, ""), {"node_id": "n2", "error": failure}]
        with pytest.raises(Exception, match="cannot create restore point"):
            cuts.record(step(results), svc, INSTANT + 1)
        (item,) = svc.catalog.cuts("bank")
    assert item.status == "failed"
    assert item.error == "n2: EngineError"
    assert "cannot create restore point" in (item.cause or "")


def cut(cut_id: str, instant: float, **fields) -> CutItem:
    points = {"s1": CutShardPoint(node_id="n1", lsn="0/1", wal="000000010000000000000005", at=0)}
    values = {"status": "complete", "commit_lock": 1, "cut_paused": True, "shards": points}
    return CutItem(
        cluster="bank",
        backup_id=cut_key(cut_id),
        cut_id=cut_id,
        instant=instant,
        **(values | fields),
    )


def cut_id(epoch: float, suffix: str) -> str:
    """A cut id as the plan names it: the plan's second (before the instant), then hex."""
    return "cut-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(epoch - 2)) + "-" + suffix


def test_a_restore_takes_the_named_cut_or_the_newest_paused_one_before_a_time(
    monkeypatch,
) -> None:
    a, b, c = cut_id(100, "00000a"), cut_id(50, "00000b"), cut_id(300, "00000c")
    with moto_services(monkeypatch) as svc:
        for item in (
            cut(a, 100.0),
            cut(b, 50.0, cut_paused=False),  # best-effort: skipped by a time
            cut(c, 300.0, status="failed", error="n2: EngineError"),
            *[cut(cut_id(1000 + n, f"{n:06x}"), 1000.0 + n) for n in range(40)],  # later
        ):
            svc.catalog.put(item)

        def resolve(**target) -> CutItem | None:
            return cuts.resolve(svc.catalog, "bank", RestoreTarget(**target))

        assert resolve(cut=b).cut_id == b  # named: as asked, best-effort or not
        assert resolve(cut_before=datetime.fromtimestamp(350, UTC)).cut_id == a
        assert resolve(name=a).cut_id == a  # a restore point named as a cut is that cut
        assert resolve(name="cut-20261206T101500Z-0a0b0c") is None  # an operator's own point
        assert resolve(name="before-upgrade") is None
        with pytest.raises(TargetOutOfRange, match="failed"):
            resolve(cut=c)
        with pytest.raises(TargetOutOfRange, match="1 best-effort skipped"):
            resolve(cut_before=datetime.fromtimestamp(60, UTC))
        with pytest.raises(TargetOutOfRange, match="no scheduled cut 'cut-z'"):
            resolve(cut="cut-z")


def test_a_cut_target_must_name_a_scheduled_cut() -> None:
    with pytest.raises(InvalidRequest, match="not a scheduled cut's name"):
        RestoreTarget(cut="before-upgrade")
    assert RestoreTarget(cut="cut-20261206T101500Z-0a0b0c").kind == "cut"


def test_a_cuts_base_completed_before_it_and_its_segment_must_be_archived() -> None:
    early = backup_item(backup_id="20261206T090000Z-aaaaaa", status="COMPLETE", completed_at=50.0)
    late = backup_item(backup_id="20261206T100000Z-bbbbbb", status="COMPLETE", completed_at=150.0)
    request = RestoreRequest(cluster="bank", target_cluster="t", target=RestoreTarget(name="cut-a"))
    assert cuts.base_for(cut("cut-a", 100.0), request, [early, late]) == early
    with pytest.raises(TargetOutOfRange, match="no complete backup that completed before cut"):
        cuts.base_for(cut("cut-a", 10.0), request, [early, late])
    manifest = Manifest.model_construct(backup_id="b", shards=[type("S", (), {"shard_id": "s1"})()])
    short = ShardArchive("s1", "000000010000000000000002", "000000010000000000000004", 0.0, [], [])
    with pytest.raises(TargetOutOfRange, match="not archived yet"):
        cuts.check_reached(cut("cut-a", 100.0), manifest, [short])
    gap = ShardArchive(
        "s1", "000000010000000000000002", "000000010000000000000004", 0.0, [], [], newest=SIX
    )
    with pytest.raises(TargetOutOfRange, match="past a gap"):  # waiting would not help
        cuts.check_reached(cut("cut-a", 100.0), manifest, [gap])
    reached = ShardArchive(
        "s1", "000000010000000000000002", "000000010000000000000005", 0.0, [], []
    )
    cuts.check_reached(cut("cut-a", 100.0), manifest, [reached])


def test_readers_of_backups_never_read_the_cut_items_and_the_sweep_forgets_old_cuts(
    monkeypatch,
) -> None:
    with moto_services(monkeypatch) as svc:
        base = backup_item(
            cluster="bank",
            backup_id="20261206T090000Z-aaaaaa",
            status="COMPLETE",
            completed_at=150.0,
        )
        svc.catalog.put(base)
        for n in range(30):
            svc.catalog.put(cut(f"cut-{n:03d}", 100.0 + 10 * n))
        read = []
        svc.catalog.table.meta.client.meta.events.register(
            "after-call.dynamodb.Query",
            lambda parsed, **_: read.extend(i["backup_id"]["S"] for i in parsed["Items"]),
        )
        assert [b.backup_id for b in svc.catalog.backups("bank")] == [base.backup_id]
        assert svc.catalog.newest_backup_id("bank", "COMPLETE") == base.backup_id
        assert not [key for key in read if key.startswith("cut#")]
        assert forget_cuts(svc, "bank", base, dry_run=True) == 5  # instants 100 to 140
        assert len(svc.catalog.cuts("bank")) == 30
        assert forget_cuts(svc, "bank", base, dry_run=False) == 5
        assert min(c.instant for c in svc.catalog.cuts("bank")) == 150.0


def archiving_leader(**shard: object) -> NodeRecord:
    """A PostgreSQL leader of shard s1 whose agent archives its WAL and knows ``cut``."""
    info = ShardInfo(shard_id="s1", role="leader", wal_spool_bytes=0).model_copy(update=shard)
    update = {"engine": Engine.POSTGRES, "protocol": cuts.CUT_PROTOCOL, "shards": [info]}
    return leader_node("bank", time.time()).model_copy(update=update)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"wal_spool_bytes": None}, "archive no WAL: a cut there could never be"),
        ({"engine": Engine.SQLITE}, "run an engine that makes no restore point"),
    ],
)
def test_a_cut_no_restore_could_reach_is_refused_before_any_node_is_asked(
    monkeypatch, change: dict, refusal: str
) -> None:
    with moto_services(monkeypatch) as svc:
        svc.nodes.put(archiving_leader())  # made now: a node's heartbeat ages
        planned = cuts.plan(cuts.CutClusterRequest(cluster="bank"), svc, time.time())
        assert planned["nodes"] == [{"node_id": "bank-n1", "shard_ids": ["s1"]}]
        assert is_cut_id(planned["cut_id"])
        if "engine" in change:
            svc.nodes.put(archiving_leader().model_copy(update=change))
        else:
            svc.nodes.put(archiving_leader(**change))
        with pytest.raises(ShardVaultError, match=refusal):
            cuts.plan(cuts.CutClusterRequest(cluster="bank"), svc, time.time())
        assert svc.catalog.cuts("bank") == []
