"""The scale model's check (docs/ARCHITECTURE.md, "Scale model"): a full backup of a cluster of
N simulated nodes, through the local stack's control plane (moto's Step Functions running the
real ASL, the Lambda handlers in process).

Usage::

    .venv/bin/python bench/fleet_sim.py --nodes 3 --nodes 40 --nodes 100 --nodes 300 \
        --pg-listing 10

The nodes are *fake agents that answer at once*: each is registered in the node registry with
one shard, and one thread reads the inbox table and answers every command as a real agent
does (flush, checkpoint with its scan, stop, release; the listing commands' answers put in the
work bucket through their answer URLs, a receipt sent with the token). Each shard lists no
file, or with ``--pg-listing SCALE`` the files of a real PostgreSQL data directory after
``pgbench -i -s SCALE``, sized 0: the listings are as long as a real node's, and no object is
planned, so what is measured is the control plane alone:

- the backup execution's history events (AWS fails a Standard execution past 25,000) and
  the largest state it carried (AWS's limit is 256 KiB), from its history;
- the time from the execution's start to the last checkpoint answered, and from the first
  checkpoint answered to the last (the spread of the Checkpoint step);
- the wall time of the backup.

moto's interpreter is not AWS's: it runs a Map's children about one after another where AWS
runs up to the Map's MaxConcurrency at once, so times here are an upper bound of the control
plane's own work; the history events are AWS's events, as moto records them (a Distributed
Map's children apart, as AWS keeps them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import urllib3

from shardvault.aws.tables import Inbox, plain, scan_all
from shardvault.client import operations as ops
from shardvault.contracts.models import (
    AGENT_PROTOCOL,
    BackupRequest,
    FileEntry,
    NodeRecord,
    ShardInfo,
    pack_files,
)
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.local.stack import LocalStack

CLUSTER = "fleet"
SETTLE_SECONDS = 0.3


def register(stack: LocalStack, cluster: str, nodes: int) -> list[str]:
    """Fake nodes, one shard each, heartbeating (as far as validation can tell) for an hour."""
    registry = stack.services().nodes
    ids = []
    for i in range(nodes):
        node_id = f"{cluster}-{i:04d}"
        registry.put(
            NodeRecord(
                node_id=node_id,
                cluster=cluster,
                engine="sqlite",
                shards=[ShardInfo(shard_id=f"s{i:04d}", role="leader")],
                free_bytes=1 << 40,
                version="sim",
                protocol=AGENT_PROTOCOL,
                heartbeat_at=time.time(),
                heartbeat_every=3600.0,
            )
        )
        ids.append(node_id)
    return ids


def listing(shard_id: str, files: list[FileEntry]) -> dict[str, Any]:
    """A shard of ``files``, as a full's checkpoint (with its scan) answers it."""
    return {
        "shard_id": shard_id,
        "files": pack_files(files),
        "marker": {},
        "checkpoint_at": time.time(),
        "mutable": False,
        "bytes": 0,
        "extents": "",
        "delta_bytes": None,
        "scan_seconds": None,
    }


def answer(
    command: str, node_id: str, args: dict[str, Any], files: list[FileEntry]
) -> dict[str, Any]:
    shards = args.get("shard_ids", [])
    if command == "flush":
        return {"node_id": node_id, "flushed": shards}
    if command in ("checkpoint", "scan", "stop"):
        return {"node_id": node_id, "shards": [listing(s, files) for s in shards]}
    if command == "release":
        return {"node_id": node_id, "released": True}
    raise ValueError(f"the simulation has no answer to {command!r}")


class FakeAgents:
    """One thread answering every inbox item at once; notes when each checkpoint was answered."""

    def __init__(self, stack: LocalStack, files: list[FileEntry]) -> None:
        self.inbox = Inbox(stack.services().inbox.table)
        self.sfn = boto3.client("stepfunctions")
        self.http = urllib3.PoolManager()
        self.files = files
        self.answer_bytes = 0
        self.stop = threading.Event()
        self.checkpoints: list[float] = []
        self.answered = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        table = self.inbox.table
        while not self.stop.is_set():
            items = scan_all(table)
            # The doorbell counters and failure notes start with "#". A command is answered
            # once its dispatch has returned: moto drops an answer that comes before its task
            # waits for it (a real agent is never that fast).
            settled = time.time() - SETTLE_SECONDS
            commands = [
                plain(i)
                for i in items
                if not i["command_id"].startswith("#") and float(i["posted_at"]) < settled
            ]
            for item in commands:
                self.handle(item)
            if not commands:
                time.sleep(0.02)

    def handle(self, item: dict[str, Any]) -> None:
        command, node_id = item["command"], item["node_id"]
        token = item.get("task_token")
        if token:
            args = item.get("args") or {}
            output = answer(command, node_id, args, self.files)
            if url := args.get("answer_url"):  # as a real agent does (shardvault.workflow.dispatch)
                output = self.hand(url, output)
            self.sfn.send_task_success(taskToken=token, output=json.dumps(output, default=str))
        if command == "checkpoint":
            self.checkpoints.append(time.time())
        self.answered += 1
        self.inbox.remove(node_id, item["command_id"], item["dispatch_id"])

    def hand(self, url: str, output: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(output, separators=(",", ":")).encode()
        response = self.http.request("PUT", url, body=body)
        assert response.status == 200, response.data
        self.answer_bytes = max(self.answer_bytes, len(body))
        receipt = {"answer_bytes": len(body), "answer_crc64nvme": crc64nvme_of_bytes(body)}
        return {"node_id": output["node_id"], **receipt}

    def __enter__(self) -> FakeAgents:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def largest_state(events: list[dict[str, Any]]) -> int:
    """The largest input or output a state received or gave, in bytes."""
    sizes = [0]
    for event in events:
        for details in event.values():
            if isinstance(details, dict):
                for field in ("input", "output"):
                    if isinstance(details.get(field), str):
                        sizes.append(len(details[field].encode()))
    return max(sizes)


def simulate(stack: LocalStack, nodes: int, files: list[FileEntry]) -> dict[str, Any]:
    """One full backup of a cluster of ``nodes`` fake nodes (its own cluster name), each
    shard listing ``files``."""
    cluster = f"{CLUSTER}{nodes}"
    register(stack, cluster, nodes)
    with FakeAgents(stack, files) as agents:
        client = stack.client_config()
        started = time.time()
        arn = ops.start_backup(client, BackupRequest(cluster=cluster, requested_by="sim"))
        progress = ops.wait_backup(client, arn, interval=0.5, timeout=3600)
        wall = time.time() - started
    events = ops.execution_history(arn)
    checkpoints = sorted(agents.checkpoints)
    return {
        "nodes": nodes,
        "status": progress.status,
        "error": progress.error,
        "history_events": len(events),
        "largest_state_bytes": largest_state(events),
        "to_last_checkpoint_s": round(checkpoints[-1] - started, 2) if checkpoints else None,
        "checkpoint_spread_s": round(checkpoints[-1] - checkpoints[0], 2) if checkpoints else None,
        "wall_s": round(wall, 2),
        "commands_answered": agents.answered,
        "largest_answer_bytes": agents.answer_bytes,
    }


def pg_listing(scale: int) -> list[FileEntry]:
    """One real PostgreSQL shard's files: a data directory after ``pgbench -i -s SCALE``
    (``pg_wal`` apart, as a checkpoint lists them)."""
    from shardvault.local.postgres import find_pg_bin_dir, init_instance, run_as_postgres

    with tempfile.TemporaryDirectory() as root:
        instance = init_instance(Path(root) / "pg")
        try:
            pgbench = str(find_pg_bin_dir() / "pgbench")
            where = ["-h", str(instance.socket_dir), "-p", str(instance.port), "-U", "postgres"]
            command = run_as_postgres([pgbench, "-i", "-s", str(scale), *where, "postgres"])
            subprocess.run(command, check=True, capture_output=True, cwd="/")
            files = [
                FileEntry(path=p.relative_to(instance.data_dir).as_posix(), size=p.stat().st_size)
                for p in instance.data_dir.rglob("*")
                if p.is_file() and "pg_wal" not in p.relative_to(instance.data_dir).parts
            ]
        finally:
            instance.stop(mode="immediate")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, action="append", default=[])
    parser.add_argument(
        "--pg-listing", type=int, metavar="SCALE", help="also weigh a real PostgreSQL listing"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here too")
    args = parser.parse_args()
    files: list[FileEntry] = []
    if args.pg_listing:
        real = pg_listing(args.pg_listing)
        weight = {"pgbench_scale": args.pg_listing, "files": len(real)}
        print(json.dumps(weight | {"packed_chars": len(pack_files(real))}), flush=True)
        # The same paths, sized 0: as long, and nothing is planned for the fakes to upload.
        files = [FileEntry(path=f.path, size=0) for f in real]
    results = []
    with tempfile.TemporaryDirectory() as root, LocalStack(Path(root), use_minio=False) as stack:
        for n in args.nodes:
            result = simulate(stack, n, files)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
