"""The backup state machine on the local stack (real ASL, real MinIO, agent processes)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from pathlib import Path

import boto3

from functions.reap_execution import lambda_handler
from shardvault.aws.materialize import materialize
from shardvault.aws.readback import load_manifest
from shardvault.client import operations as ops
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.data.pipeline import frame_spans, plaintext_crc, unpack_frames
from shardvault.local.lambda_bridge import LambdaContext

from .conftest import entered_states, output, record_posts


def content_hash(path) -> str:
    """An ordered hash of every row: the snapshot is a new file, so compare its data."""
    digest = hashlib.sha256()
    with sqlite3.connect(path) as db:
        for row in db.execute("SELECT id, shard, payload FROM items ORDER BY id"):
            digest.update(repr(row).encode())
    return digest.hexdigest()


def test_backup_of_three_nodes_reads_leaders_and_reads_back_equal(
    make_cluster, tmp_path, monkeypatch
):
    cluster = make_cluster(nodes=3, size_mb=30)
    posted: list[str] = []
    record_posts(monkeypatch, lambda command, args: posted.append(command))
    progress = cluster.backup()
    assert progress.status == "SUCCEEDED", progress.cause
    # Each node packs its data in the Upload map, and its block map at its stop (with its
    # tail; SQLite has none): three packs, six uploads.
    assert (posted.count("pack"), posted.count("upload")) == (3, 6)
    summary = output(progress)
    assert summary["shards"] == ["shard-1", "shard-2", "shard-3"]
    assert summary["verification"].endswith("by attributes)")
    assert summary["objects"] == 3  # data objects; block maps are an index, not counted

    svc = cluster.stack.services()
    manifest = load_manifest(svc.store_bucket, summary["manifest_key"])
    # Each shard was read from its leader, never from the follower's stale copy.
    assert {s.shard_id: s.node_id for s in manifest.shards} == {
        f"shard-{i}": f"{cluster.name}-node-{i}" for i in (1, 2, 3)
    }
    # Each shard's block map is stored (for the next incremental) and kept by its agent.
    for shard in manifest.shards:
        assert shard.blockmap is not None
        node = next(c for c in cluster.configs if c["node_id"] == shard.node_id)
        cached = (
            Path(node["state_dir"]) / "blockmaps" / shard.shard_id / f"{manifest.backup_id}.map"
        )
        obj = shard.blockmap
        spans = frame_spans(unpack_frames(obj.frames), obj.frame_size, obj.length)
        assert crc64nvme_of_bytes(cached.read_bytes()) == plaintext_crc(spans)
    roots = materialize(manifest, svc.store_bucket, tmp_path / "readback")
    for shard_id, source in cluster.sources.items():
        restored = roots[shard_id] / source.name
        assert content_hash(restored) == content_hash(source)
        with sqlite3.connect(restored) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert cluster.open_uploads() == []
    assert cluster.held_checkpoints() == []
    (record,) = cluster.records()
    assert record["status"] == "COMPLETE"


def test_parts_that_fail_twice_succeed_through_the_agents_retries(make_cluster):
    cluster = make_cluster(nodes=2, size_mb=20, env={"SHARDVAULT_AGENT_FAULTS": "upload_part=2"})
    progress = cluster.backup()
    assert progress.status == "SUCCEEDED", progress.cause
    log = cluster.agent_log(cluster.configs[0]["node_id"])
    assert log.count("injected failure 1 of part 1") >= 1
    assert log.count("injected failure 2 of part 1") >= 1


def failed_by_parts(make_cluster, size_mb: int, faults: str):
    """A two-node cluster whose agents fail every try (two each) of the parts ``faults``
    names, and its backup, which fails: the cluster, the execution and the catalog record."""
    cluster = make_cluster(
        nodes=2,
        size_mb=size_mb,
        agent={"part_attempts": 2},
        env={"SHARDVAULT_AGENT_FAULTS": faults},
    )
    execution = cluster.start_backup()
    progress = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)
    assert progress.status == "FAILED"
    (record,) = cluster.records()
    assert record["status"] == "FAILED"
    return cluster, execution, record


def assert_nothing_left(cluster) -> None:
    """What a failed backup's cleanup leaves, read from outside: nothing."""
    assert cluster.open_uploads() == []  # every open upload was aborted
    assert cluster.store_keys() == []  # no partial object remains (nor a whole one)
    assert cluster.held_checkpoints() == []  # every agent released its checkpoint
    # The lock is released: the next backup of the cluster may start.
    assert cluster.stack.services().catalog.lock_holder(cluster.name) is None


def test_parts_that_keep_failing_end_in_cleanup_with_nothing_left_behind(make_cluster):
    cluster, execution, record = failed_by_parts(make_cluster, 20, "upload_part=1000")
    states = entered_states(execution)
    assert "Flush" in states  # two nodes flush first, so that their checkpoints are close
    assert "Stop" not in states  # a failed upload never reaches the tail of the backup
    assert "ReleaseAfterFailure" in states
    assert "Cleanup" in states
    assert record["error"] == "UploadIncomplete"
    assert record["aborted_uploads"] >= 1  # uploads were open when the failure struck
    assert_nothing_left(cluster)


def test_an_object_signed_at_plan_that_never_arrives_fails_the_backup_by_name(make_cluster):
    """A full's block maps are packed at the stop and fit one part: the plan signs their
    PutObject URLs and no Complete follows their transfer. When every try of those PUTs fails,
    Finalize, which checks the tail's objects, finds them missing in the store and names one;
    the failure path leaves nothing behind."""
    faults = "upload_part=1000,upload_part_of=/blockmap-"
    cluster, execution, record = failed_by_parts(make_cluster, 6, faults)
    assert "Stop" in entered_states(execution)  # the data objects went up; the maps did not
    assert record["error"] in ("UploadIncomplete", "PartUploadFailed"), record
    assert "blockmap-" in record["cause"], record["cause"]
    assert_nothing_left(cluster)  # the data objects that did arrive are deleted too


def test_expired_part_urls_are_signed_again(make_cluster):
    from shardvault.aws.lambda_support import services

    settings = services().settings
    # URLs live 2 s; the agent waits 3 s before the first try of each part, so every first
    # URL has expired when used. The state machine signs again and the retry goes through.
    services().settings = settings.model_copy(update={"url_ttl_seconds": 2})
    try:
        cluster = make_cluster(
            nodes=1, size_mb=10, env={"SHARDVAULT_AGENT_FAULTS": "first_try_delay=3"}
        )
        progress = cluster.backup()
    finally:
        services().settings = settings
    assert progress.status == "SUCCEEDED", progress.cause
    assert "failed: PresignedUrlExpired" in cluster.agent_log(cluster.configs[0]["node_id"])


def test_parts_damaged_on_the_way_are_refused_by_the_store_and_sent_again(make_cluster, tmp_path):
    # The first try of every part sends one flipped bit: each URL is bound to the part's
    # checksum, so the store refuses those bytes, and the agent sends the part again from its
    # packed copy. The stored objects are exactly what was read.
    cluster = make_cluster(nodes=2, size_mb=12, env={"SHARDVAULT_AGENT_FAULTS": "corrupt_part=1"})
    progress = cluster.backup()
    assert progress.status == "SUCCEEDED", progress.cause
    log = cluster.agent_log(cluster.configs[0]["node_id"])
    assert "part 1 of" in log
    assert any(e in log for e in ("BadDigest", "XAmzContentChecksumMismatch", "InvalidChecksum"))
    svc = cluster.stack.services()
    manifest = load_manifest(svc.store_bucket, progress.record["manifest_key"])
    roots = materialize(manifest, svc.store_bucket, tmp_path / "readback")
    for shard_id, source in cluster.sources.items():
        assert content_hash(roots[shard_id] / source.name) == content_hash(source)


def test_an_aborted_execution_is_reaped_and_leaves_nothing_behind(make_cluster, stack):
    """Stopping an execution skips its failure path; the reaper (an EventBridge rule on AWS)
    aborts the uploads, removes partial objects, releases the checkpoints and the lock."""
    slow = {"rate_limit_bytes_per_second": 2 * 2**20, "upload_parallelism": 1}
    cluster = make_cluster(nodes=2, size_mb=24, agent=slow)
    execution = cluster.start_backup()
    deadline = time.monotonic() + 60
    while not cluster.open_uploads():  # mid-upload
        assert time.monotonic() < deadline, "no upload ever started"
        time.sleep(0.1)
    sfn = boto3.client("stepfunctions")
    sfn.stop_execution(executionArn=execution)
    described = sfn.describe_execution(executionArn=execution)
    event = {
        "detail": {
            "executionArn": execution,
            "status": "ABORTED",
            "input": described["input"],
        }
    }

    outcome = lambda_handler(event, LambdaContext(function_name="shardvault-reap_execution"))

    assert outcome["reaped"] is True
    (record,) = cluster.records()
    assert record["status"] == "FAILED"
    assert "reaper" in record["cause"]
    assert cluster.open_uploads() == []
    assert stack.services().catalog.lock_holder(cluster.name) is None
    deadline = time.monotonic() + 30
    while cluster.held_checkpoints():  # the agents run the token-less release
        assert time.monotonic() < deadline, f"still held: {cluster.held_checkpoints()}"
        time.sleep(0.2)
    # Reaping twice, or a backup that ended normally, changes nothing.
    again = lambda_handler(event, LambdaContext(function_name="shardvault-reap_execution"))
    assert again["reaped"] is False


def _listing_answers(arn: str) -> list[dict]:
    """What the agents answered their listing commands (checkpoint, stop), as the execution's
    state carries it to the plan steps."""
    return [
        answer
        for e in ops.execution_history(arn)
        if e.get("stateEnteredEventDetails", {}).get("name") in ("PlanData", "PlanTail")
        for answer in json.loads(e["stateEnteredEventDetails"]["input"])["results"]
    ]


def test_listings_go_through_the_work_bucket_and_the_history_keeps_receipts(make_cluster):
    """A Map gathers every node's answer into the execution's state (256 KiB): the agents put
    their listings in the work bucket, and the history holds a receipt of each."""
    cluster = make_cluster(nodes=2, size_mb=4)
    execution = cluster.start_backup()
    progress = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)
    assert progress.status == "SUCCEEDED", progress.cause
    answers = _listing_answers(execution)
    assert len(answers) == 4  # two nodes, checkpoint and stop
    for answer in answers:
        assert set(answer) == {"node_id", "answer_bytes", "answer_crc64nvme"}
    svc = cluster.stack.services()
    backup_id = progress.record["backup_id"]
    for phase in ("data", "tail"):
        read = []  # each shard from its leader: once in all the answers of a phase
        for config in cluster.configs:
            kept = svc.get_work(svc.answer_key(backup_id, phase, config["node_id"]))
            assert kept["node_id"] == config["node_id"]
            read += [s["shard_id"] for s in kept["shards"] if s["files"]]
        assert sorted(read) == sorted(cluster.sources)


def test_an_answer_that_is_not_its_receipts_fails_the_backup_and_is_cleaned_up(make_cluster):
    cluster = make_cluster(nodes=2, size_mb=4, env={"SHARDVAULT_AGENT_FAULTS": "corrupt_answer=1"})
    execution = cluster.start_backup()
    progress = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)
    assert progress.status == "FAILED"
    assert "Upload" not in entered_states(execution)  # nothing was planned from it
    (record,) = cluster.records()
    assert record["status"] == "FAILED"
    assert record["error"] == "AnswerMismatch"
    assert "is not the one its agent sent" in record["cause"]
    assert cluster.store_keys() == []
    assert cluster.held_checkpoints() == []
    assert cluster.stack.services().catalog.lock_holder(cluster.name) is None
