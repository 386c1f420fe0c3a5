"""Restore into a new cluster of another node count, on the local stack with real MinIO.

The restored data must equal the source's (an ordered hash of every table), every shard must
pass its engine checks, and a failed restore must leave nothing placed or started.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import boto3

from functions.reap_execution import lambda_handler as reap_handler
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest, RestoreRequest
from shardvault.local.demo import table_digests
from shardvault.local.lambda_bridge import LambdaContext
from shardvault.restore import thaw as thaw_step

from .conftest import client_of, entered_states, glob_under_removal, output


def test_a_three_node_backup_restores_into_two_nodes_with_equal_data(make_cluster, make_target):
    cluster = make_cluster(nodes=3, size_mb=6)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    target = make_target(nodes=2)

    restored = target.restore(cluster.name, validation_queries=["SELECT count(*) > 0 FROM items"])

    assert restored.status == "SUCCEEDED", restored.cause
    summary = output(restored)
    assert summary["validation"] == "passed"
    assert summary["backup_id"] == backup.record["backup_id"]
    placed = {s["shard_id"]: s for s in summary["shards"]}
    assert sorted(placed) == ["shard-1", "shard-2", "shard-3"]
    assert {s["node_id"] for s in placed.values()} == {c["node_id"] for c in target.configs}
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source), shard_id
        assert placed[shard_id]["checks"][f"integrity_check {db.name}"] == "ok"
    (record,) = target.records()
    assert record["status"] == "COMPLETE"
    assert record["bytes_done"] == record["bytes_total"] > 0
    # No staging is left behind, not even the restore's empty staging directory.
    assert not list(target.restore_dir(0).parent.glob("*/.incoming/*"))


def test_a_restored_cluster_is_backed_up_without_new_agent_configs(make_cluster, make_target):
    """The target agents adopt the shards they restored: the new cluster's own backup holds
    every shard, and restoring that backup gives the source's data again."""
    cluster = make_cluster(nodes=3, size_mb=3)
    assert cluster.backup().status == "SUCCEEDED"
    target = make_target(nodes=2)
    assert target.restore(cluster.name).status == "SUCCEEDED"

    execution = ops.start_backup(client_of(target.stack), BackupRequest(cluster=target.name))
    backup = ops.wait_backup(client_of(target.stack), execution, interval=0.2, timeout=600)

    assert backup.status == "SUCCEEDED", backup.cause
    assert output(backup)["shards"] == ["shard-1", "shard-2", "shard-3"]
    again = make_target(nodes=1)
    restored = again.restore(target.name)
    assert restored.status == "SUCCEEDED", restored.cause
    for shard_id, source in cluster.sources.items():
        (db,) = list(again.restore_dir(0).glob(f"{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source), shard_id


def test_plan_only_places_shards_and_moves_nothing(make_cluster, make_target):
    cluster = make_cluster(nodes=3, size_mb=3)
    assert cluster.backup().status == "SUCCEEDED"
    target = make_target(nodes=2)

    plan = target.restore(cluster.name, plan_only=True)

    assert plan.status == "SUCCEEDED", plan.cause
    placements = output(plan)["placements"]
    assert sorted(p["shard_id"] for p in placements) == ["shard-1", "shard-2", "shard-3"]
    assert target.records() == []
    assert not any(
        target.restore_dir(i).exists() and any(target.restore_dir(i).iterdir()) for i in range(2)
    )


def test_a_replaced_object_in_the_store_fails_the_restore_and_starts_nothing(
    make_cluster, make_target
):
    cluster = make_cluster(nodes=3, size_mb=3)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED"
    svc = cluster.stack.services()
    key = sorted(k for k in cluster.store_keys() if "/shard-2/data-" in k)[0]
    body = svc.store_s3.get_object(Bucket=svc.store.bucket, Key=key)["Body"].read()
    damaged = body[:100] + bytes([body[100] ^ 0xFF]) + body[101:]
    svc.store_s3.put_object(Bucket=svc.store.bucket, Key=key, Body=damaged)
    target = make_target(nodes=2)

    restored = target.restore(cluster.name)

    assert restored.status == "FAILED"
    assert restored.error == "ChecksumMismatch", restored.cause
    (record,) = target.records()
    assert record["status"] == "FAILED"
    assert key in record["cause"]  # the agent's own cause, not "a task timed out"
    # Nothing half-restored is placed or started: every restore_dir is empty again.
    for i in range(2):
        root = target.restore_dir(i)
        assert [p for p in root.rglob("*") if p.is_file()] == [], root


def test_requests_the_target_cannot_take_are_refused_before_any_change(make_cluster, make_target):
    cluster = make_cluster(nodes=3, size_mb=3)
    assert cluster.backup().status == "SUCCEEDED"
    small = make_target(nodes=2, capacity=1024 * 1024)

    refused = small.restore(cluster.name)

    assert refused.status == "FAILED"
    assert refused.error == "TargetTooSmall", refused.cause
    assert small.records() == []


def test_request_model_names_latest_by_default():
    assert RestoreRequest(cluster="a", target_cluster="b").backup_id == "latest"


def test_an_archived_backup_waits_for_its_objects_to_thaw_before_downloading(
    make_cluster, make_target, monkeypatch
):
    # MinIO has no archive classes: the thaw step reports frozen objects twice (what S3 does
    # while a Bulk restore runs), then none. The real thaw is tested against moto's S3.
    cluster = make_cluster(nodes=3, size_mb=2)
    assert cluster.backup().status == "SUCCEEDED"
    polls: list[int] = []

    def still_frozen(context, attempt, svc):
        polls.append(attempt)
        frozen = 3 if len(polls) <= 2 else 0
        return {"frozen": frozen, "requested": 0, "attempt": attempt + 1, "wait_seconds": 1}

    monkeypatch.setattr(thaw_step, "thaw", still_frozen)
    target = make_target(nodes=2)

    execution = target.start_restore(cluster.name)
    restored = ops.wait_restore(client_of(target.stack), execution, interval=0.2, timeout=300)

    assert restored.status == "SUCCEEDED", restored.cause
    states = entered_states(execution)
    assert states.count("WaitForThaw") == 2
    assert polls == [0, 1, 2]
    # Nothing was downloaded before the last thaw poll found every object readable.
    assert states.index("Download") > max(i for i, s in enumerate(states) if s == "Thaw")


def test_a_restore_interrupted_by_an_agent_restart_resumes_where_it_stopped(
    make_cluster, make_target
):
    cluster = make_cluster(
        nodes=1, size_mb=24
    )  # one shard: one object of several 8 MiB reads (random rows do not compress)
    assert cluster.backup().status == "SUCCEEDED"
    slow = {"rate_limit_bytes_per_second": 4 * 2**20, "upload_parallelism": 1}
    target = make_target(nodes=1, agent=slow)
    node = target.configs[0]

    execution = target.start_restore(cluster.name)
    state = Path(node["state_dir"]) / "restores"
    deadline = time.monotonic() + 120
    while not any(p.read_text().strip() for p in state.glob("*/objects/*.parts")):
        assert time.monotonic() < deadline, "no part was ever downloaded"
        time.sleep(0.05)
    target.stack.stop_agent(node["node_id"], kill=True)  # mid-object
    target.stack.start_agent(node)  # its inbox still holds the download: it picks it up
    restored = ops.wait_restore(client_of(target.stack), execution, interval=0.2, timeout=300)

    assert restored.status == "SUCCEEDED", restored.cause
    resumed = re.search(r"resuming, (\d+) of (\d+) reads already here", target.agent_log(0))
    assert resumed, "the restarted agent fetched the object from the start"
    assert 0 < int(resumed[1]) < int(resumed[2])
    (db,) = list(target.restore_dir(0).glob("shard-1/*.db"))
    assert table_digests(db) == table_digests(cluster.sources["shard-1"])


def test_an_aborted_restore_is_reaped_and_leaves_nothing_placed(make_cluster, make_target):
    """Stopping a restore execution skips AbortOnNodes; the reaper (the same EventBridge rule
    as for backups) has every target node undo what the restore placed."""
    cluster = make_cluster(nodes=2, size_mb=24)
    assert cluster.backup().status == "SUCCEEDED"
    slow = {"rate_limit_bytes_per_second": 2 * 2**20, "upload_parallelism": 1}
    target = make_target(nodes=2, agent=slow)
    execution = target.start_restore(cluster.name)
    states = [Path(c["state_dir"]) / "restores" for c in target.configs]
    deadline = time.monotonic() + 120
    while not any(p.read_text().strip() for s in states for p in s.glob("*/objects/*.parts")):
        assert time.monotonic() < deadline, "no part was ever downloaded"
        time.sleep(0.05)
    sfn = boto3.client("stepfunctions")
    sfn.stop_execution(executionArn=execution)
    event = {
        "detail": {
            "executionArn": execution,
            "status": "ABORTED",
            "input": sfn.describe_execution(executionArn=execution)["input"],
        }
    }

    outcome = reap_handler(event, LambdaContext(function_name="shardvault-reap_execution"))

    assert outcome["reaped"] is True, outcome
    assert outcome["nodes"] == sorted(c["node_id"] for c in target.configs)
    (record,) = target.records()
    assert record["status"] == "FAILED"
    assert "reaper" in record["cause"]
    deadline = time.monotonic() + 60
    placed_dirs = [target.restore_dir(i) for i in range(2)]
    while placed := [p for d in placed_dirs for p in glob_under_removal(d, "**/*") if p.is_file()]:
        assert time.monotonic() < deadline, f"still placed: {placed[:3]}"
        time.sleep(0.2)
    # The agents keep only the tombstone that turns late downloads away. A download still in
    # flight at the abort ends at its next read and removes what it wrote on its way out, so
    # the state converges rather than being clean at the instant staging is.
    while kept := [p for s in states for p in s.iterdir() if not p.name.endswith(".aborted")]:
        assert time.monotonic() < deadline, f"still in the agents' state: {kept[:3]}"
        time.sleep(0.2)
    again = reap_handler(event, LambdaContext(function_name="shardvault-reap_execution"))
    assert again["reaped"] is False
