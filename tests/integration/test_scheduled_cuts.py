"""Scheduled cluster-wide cuts (shardvault.backup.cuts) on three real PostgreSQL nodes whose
WAL the agents archive, under a two-phase-commit "bank" workload that holds the commit lock as
docs/guide/cluster-cut.md prescribes (tests/integration/bank.py).

Checked in the restored servers themselves, never from the product's report: a restore to each
scheduled cut holds the bank's opening total and no transfer with one leg only; a restore to a
plain time that falls between a slow transfer's two commits holds that half-transfer (what a
time target does to a cluster, and proof that the check finds one)."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from shardvault.client import operations as ops
from shardvault.config.policy import load_policy
from shardvault.contracts.catalog import CutItem
from shardvault.local import scheduler
from shardvault.local.postgres import restored_instance

from . import bank
from .conftest import ArchivingNode, client_of, names, output, run_cli

ROOT = Path(__file__).resolve().parents[2]
KEY = 4242  # the commit lock
CUTS = 3  # paused cuts restored to
SLOW_ID = 10**9  # the slow transfer's id (the workload's start at 1)
# Prepared transactions are what the workload is made of (PostgreSQL's default allows none).
SETTINGS = {"max_prepared_transactions": "20"}


@pytest.fixture
def bank_cluster(stack, tmp_path, policy_for):
    """Three archiving nodes of one cluster, each the leader of its shard and holding a bank
    account, cut every 5 minutes with the commit pause (the ticks below play the clock)."""
    cluster = f"cut{next(names)}"
    nodes = [
        ArchivingNode(stack, tmp_path, 0.2, cluster=cluster, index=i, settings=SETTINGS)
        for i in (1, 2, 3)
    ]
    policy_for(
        cluster,
        engine="postgres",
        archive="{max_delay_seconds: 0.2}",
        cut=f"{{commit_lock: {KEY}, database: {bank.DATABASE}, every_minutes: 5}}",
    )
    bank.set_up([n.server.conninfo for n in nodes])
    for node in nodes:
        node.start_agent()
    yield cluster, nodes
    for node in nodes:
        node.stop()


def scheduled_cut(stack, minute: int) -> CutItem:
    """The cut the scheduler starts at ``minute`` (a multiple of 5) of a day long past: the
    local scheduler's tick over the second before it, as its loop would make it."""
    policy = load_policy(Path(stack.settings.policy_file))
    due = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=minute)
    client = client_of(stack)
    started = scheduler.tick(policy, client, due - timedelta(seconds=1), due)
    (cut,) = [s for s in started if s["kind"] == "cut"]
    outcome = ops.wait_cut(client, cut["execution"])
    assert outcome.status == "SUCCEEDED", outcome.cause
    return CutItem.model_validate(outcome.record)


def settle(nodes: list[ArchivingNode]) -> None:
    """Every node's WAL so far archived: its segment switched and stored."""
    for node in nodes:
        last = node.server.psql("SELECT pg_walfile_name(pg_switch_wal())")
        node.wait_archived(last)


def restored_bank(progress: ops.Progress) -> dict:
    shards = output(progress)["shards"]
    return bank.check([restored_instance(s).conninfo for s in shards])


def recovered_to(progress: ops.Progress) -> set[str]:
    return {s["recovered_to"] for s in output(progress)["shards"]}


def test_restores_to_scheduled_cuts_keep_every_transfer_whole_and_a_time_does_not(
    bank_cluster, stack, make_target, record_property
) -> None:
    cluster, nodes = bank_cluster
    client = client_of(stack)
    early = run_cli(stack, "cut", cluster, "--wait")  # before any backup: no base reaches it
    assert early.returncode == 0, early.stdout + early.stderr
    assert "paused" in early.stdout, early.stdout
    backup = nodes[0].backup()
    assert backup.status == "SUCCEEDED", backup.cause
    paused, committed = cuts_under_load(stack, nodes, record_property)
    unarchived = scheduled_cut(stack, 5 * (2 * CUTS + 1))  # its segment not closed yet
    into = make_target(nodes=3, engine="postgres")
    refusals(into, cluster, unarchived.cut_id, cut_id(early.stdout))

    settle(nodes)
    listed = run_cli(stack, "cuts", cluster, "--json")
    assert listed.returncode == 0, listed.stderr
    assert all(c.cut_id in listed.stdout for c in paused)
    # Each cut, named three ways: by --target-cut, as a restore point, the newest before a time.
    last = paused[-1]
    targets = [
        ({"cut": paused[0].cut_id}, paused[0].cut_id),
        ({"name": paused[1].cut_id}, paused[1].cut_id),
        ({"cut_before": datetime.fromtimestamp(last.instant + 0.5, UTC).isoformat()}, last.cut_id),
    ]
    for n, (target, expected) in enumerate(targets):
        progress = into.restore(cluster, target=target, replace=n > 0)
        assert progress.status == "SUCCEEDED", progress.cause
        assert recovered_to(progress) == {expected}
        found = restored_bank(progress)
        record_property(f"cut {expected}", found)
        assert found["total"] == found["opening"], found
        assert found["half"] == [], found
        assert found["committed"] > 0, found

    between = datetime.fromtimestamp(sum(committed) / 2, UTC)  # one host, one clock
    progress = into.restore(cluster, target={"time": between.isoformat()}, replace=True)
    assert progress.status == "SUCCEEDED", progress.cause
    found = restored_bank(progress)
    record_property("plain time", found)
    assert SLOW_ID in found["half"], found  # its debit restored, its credit not

    swept = ops.run_retention(client, cluster, dry_run=False)
    assert swept.status == "SUCCEEDED", swept.cause
    left = {c.cut_id for c in ops.list_cuts(client, cluster)}
    assert cut_id(early.stdout) not in left  # no kept backup reaches it: forgotten
    assert {c.cut_id for c in paused} <= left


def cuts_under_load(stack, nodes, record_property) -> tuple[list[CutItem], list[float]]:
    """Scheduled cuts while the bank transfers, until ``CUTS`` of them paused; then one slow
    transfer, outside any cut, its two commits half a second apart. The paused cuts, and the
    slow transfer's commit times."""
    stop = Path(nodes[0].config["state_dir"]).parent / "bank.stop"
    conninfos = [n.server.conninfo for n in nodes]
    workload = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.bank", "--key", str(KEY), "--seconds", "300",
         "--stop-file", str(stop), *conninfos],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # transfers under way
        cuts = [scheduled_cut(stack, 5 * n) for n in range(1, 2 * CUTS + 1)]
        paused = [c for c in cuts if c.cut_paused][:CUTS]
        assert len(paused) == CUTS, [(c.cut_id, c.cut_paused, c.cut_pause_seconds) for c in cuts]
        sessions = bank.open_sessions(conninfos)
        committed = bank.Bank(sessions, KEY, SLOW_ID).transfer(0, 1, 7, gap=0.5)
        for session in sessions:
            session.close()
        time.sleep(0.5)  # later commits on every node: a time target finds one after it
    finally:
        stop.touch()
        ran, _ = workload.communicate(timeout=60)
    record_property("workload", ran)
    assert workload.returncode == 0
    return paused, committed


def refusals(into, cluster: str, unarchived: str, early: str) -> None:
    """Cuts a restore cannot reach are refused by name, before anything is written."""
    for target, phrase in (
        ({"cut": unarchived}, "not archived yet"),
        ({"cut": "cut-20200101T000000Z-0a0b0c"}, "has no scheduled cut"),
        ({"cut": early}, "no complete backup that completed before cut"),
    ):
        refused = into.restore(cluster, target=target)
        assert refused.error == "TargetOutOfRange", refused.cause
        assert phrase in refused.cause, refused.cause
    assert into.records() == []


def cut_id(text: str) -> str:
    """The cut id ``shardvault cut --wait`` printed."""
    return next(word for word in text.split() if word.startswith("cut-"))
