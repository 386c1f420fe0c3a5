"""The cut's skew across nodes under write load (issue 11): how far apart, in time, a backup's
restore points are on the nodes of one cluster, each node busy with pgbench.

Usage::

    .venv/bin/python bench/cut_skew.py --nodes 3 --backups 10 --scale 10
    .venv/bin/python bench/cut_skew.py --nodes 3 --backups 20 --scale 10 --commit-lock 4242
    .venv/bin/python bench/cut_skew.py --nodes 3 --backups 20 --commit-lock 4242 --no-writer

The local stack (moto's Step Functions running the real ASL, MinIO as the store) and one real
PostgreSQL per node, each filled by ``pgbench -i`` and written to by ``pgbench -c 2`` for the
whole run; an agent per node. It takes ``--backups`` backups in a row (incrementals where the
chain allows: the cut does not depend on how much is copied) and reads back from the catalog
each one's *cut skew* (the spread of the restore points' creation times,
``clock_timestamp()`` beside ``pg_create_restore_point`` on each node), how late its latest
node came to the cut instant, and the spread of its ``pg_backup_start`` calls (the
*checkpoint spread*, what ShardVault reported as skew before cuts), with the pgbench
transactions per second over the run. All nodes share one machine and one clock: the skew
measured here is the agents' scheduling and PostgreSQL's latency under load, with no clock
offset between hosts (NTP keeps those to a millisecond or a few on a LAN; it adds to the skew).

With ``--commit-lock KEY`` the cluster's policy sets ``cut: {commit_lock: KEY, database:
postgres}`` (the commit pause, ``shardvault.contracts.cut``, in the writer's database) and a
*distributed writer* runs beside pgbench: rounds of one row
committed on every node, each round holding the lock shared on every node
(``pg_try_advisory_lock_shared``; a refusal lets go of all and retries after 1 ms), as the
README asks of an application's distributed commits, at most ``--distributed-rate`` rounds a
second (100), in a process of its own (``--no-writer``: none, pgbench alone). Per backup it
reads whether the cut was
paused (every node held the lock at one shared moment) and the longest node's pause, split
from its markers (waiting for the lock, lock to restore point, the hold), and checks
afterwards that pgbench, which takes no lock, went on. Throughout, a probe on the first
server measures the machine's own wake-up latency for a sleeping backend (``WakeProbe``):
the one wake-up inside a pause, its hold's end, cannot be quicker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from shardvault.aws.readback import load_manifest
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest
from shardvault.local import demo
from shardvault.local.postgres import start_pgbench, stop_process
from shardvault.local.stack import LocalStack
from shardvault.restore.sources import source_of

FAST_AGENT = {"heartbeat_interval_seconds": 1.0, "poll_interval_seconds": 0.05}
POLICY = """version: 1
clusters:
  cut:
    engine: postgres
    schedule: {{full: '0 2 * * *'}}
    vault: {{storage_class: GLACIER_IR, object_lock: {{mode: GOVERNANCE, days: 1}}}}
    retention: {{keep_daily: 1}}
    cut: {{commit_lock: {key}, database: postgres}}
"""


class DistributedWriter:
    """Rounds of one row committed on every server under the commit lock (module docstring),
    in a process of its own: a thread would take the interpreter from the local stack's
    Lambda handlers in this process, and the nodes' stop commands would come late for it.
    ``rounds``: how many were committed."""

    def __init__(self, servers: list[Any], key: int, rate: float) -> None:
        for server in servers:
            server.psql("CREATE TABLE IF NOT EXISTS rounds (n int PRIMARY KEY)")
        spawn = multiprocessing.get_context("spawn")
        self.done, self.stopping = spawn.Value("q", 0), spawn.Event()
        self.process = spawn.Process(
            target=commit_rounds,
            args=([s.conninfo for s in servers], key, rate, self.done, self.stopping),
        )

    @property
    def rounds(self) -> int:
        return int(self.done.value)

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        self.stopping.set()
        self.process.join(timeout=30)


class WakeProbe:
    """The machine's own wake-up latency for a sleeping PostgreSQL backend, under the same
    load: a session on one server sleeps 10 ms over and over (``pg_sleep``, as the cut's hold
    does) and the server's clock says how much longer each took. A paused cut's tail cannot be
    shorter than this one wake-up's. In a process of its own, as ``DistributedWriter``."""

    def __init__(self, server: Any) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.queue, self.stopping = spawn.Queue(), spawn.Event()
        self.process = spawn.Process(
            target=sleep_overshoots, args=(server.conninfo, self.queue, self.stopping)
        )

    def start(self) -> None:
        self.process.start()

    def stop(self) -> list[float]:
        self.stopping.set()
        overshoots = self.queue.get(timeout=60)
        self.process.join(timeout=30)
        return overshoots


def sleep_overshoots(conninfo: str, queue: Any, stopping: Any) -> None:
    overshoots = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while not stopping.is_set():
            took = conn.execute(
                "SELECT extract(epoch FROM clock_timestamp() - t) FROM "
                "(SELECT clock_timestamp() AS t) start, LATERAL pg_sleep(0.01)"
            ).fetchone()[0]
            overshoots.append(float(took) - 0.01)
    queue.put(overshoots)


def commit_rounds(conninfos: list[str], key: int, rate: float, done: Any, stopping: Any) -> None:
    """Rounds at ``rate`` a second at most (0: as fast as they go)."""
    conns = [psycopg.connect(c, autocommit=True) for c in conninfos]
    started = time.monotonic()
    try:
        while not stopping.is_set():
            if rate and (ahead := started + done.value / rate - time.monotonic()) > 0:
                time.sleep(ahead)
            held = []
            for conn in conns:
                if not conn.execute("SELECT pg_try_advisory_lock_shared(%s)", (key,)).fetchone()[0]:
                    break
                held.append(conn)
            if len(held) == len(conns):
                for conn in conns:
                    conn.execute("INSERT INTO rounds VALUES (%s)", (done.value,))
                done.value += 1
            for conn in held:
                conn.execute("SELECT pg_advisory_unlock_shared(%s)", (key,))
            if len(held) < len(conns):
                time.sleep(0.001)
    finally:
        for conn in conns:
            conn.close()


def p99_ms(ordered: list[float]) -> float:
    """The 99th percentile of sorted seconds, in ms (of 20 values, the largest)."""
    return round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1000, 2)


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {
        "min_ms": round(ordered[0] * 1000, 2),
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p90_ms": round(p90 * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def transactions(server: Any) -> int:
    """pgbench's transactions so far: one history row each."""
    return int(server.psql("SELECT count(*) FROM pgbench_history"))


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    cluster = demo.postgres_cluster(root, name="cut", nodes=args.nodes, scale=args.scale)
    stack_args: dict[str, Any] = {}
    if args.commit_lock is not None:
        (root / "policy.yaml").write_text(POLICY.format(key=args.commit_lock))
        stack_args["policy_file"] = root / "policy.yaml"
    servers = list(cluster.servers.values())
    writer = (
        DistributedWriter(servers, args.commit_lock, args.distributed_rate)
        if args.commit_lock is not None and not args.no_writer
        else None
    )
    with LocalStack(root / "stack", **stack_args) as stack:
        for config in cluster.agent_configs:
            stack.start_agent(config | FAST_AGENT)
        stack.wait_for_nodes([c["node_id"] for c in cluster.agent_configs])
        client = stack.client_config()
        seconds = 600
        loads = [start_pgbench(s, clients=2, seconds=seconds) for s in cluster.servers.values()]
        probe = WakeProbe(servers[0])
        backups, overshoots = [], []
        try:
            probe.start()
            if writer:
                writer.start()
            time.sleep(2)  # the load is running
            started, before = time.monotonic(), [transactions(s) for s in servers]
            for i in range(args.backups):
                execution = ops.start_backup(
                    client, BackupRequest(cluster=cluster.name, incremental=i > 0)
                )
                progress = ops.wait_backup(client, execution, interval=0.2, timeout=600)
                if progress.status != "SUCCEEDED":
                    raise RuntimeError(f"backup {i + 1} {progress.status}: {progress.cause}")
                record = next(
                    ops.as_row(r)
                    for r in stack.services().catalog.backups(cluster.name)
                    if r.backup_id == progress.record["backup_id"]
                )
                backups.append(
                    {
                        "backup_id": record["backup_id"],
                        "kind": record.get("kind"),
                        "cut_skew_seconds": float(record["cut_skew_seconds"]),
                        "cut_late_seconds": float(record.get("cut_late_seconds") or 0),
                        "checkpoint_spread_seconds": float(record["checkpoint_skew_seconds"]),
                        "duration_seconds": float(record["duration_seconds"]),
                        "cut_paused": record.get("cut_paused"),
                        "cut_pause_seconds": record.get("cut_pause_seconds"),
                        **pause_split(stack.services(), record),
                    }
                )
                print(json.dumps(backups[-1]), flush=True)
            elapsed = time.monotonic() - started
            written = [transactions(s) - b for s, b in zip(servers, before, strict=True)]
            rounds = writer.rounds if writer else 0
        finally:
            overshoots = probe.stop()
            if writer:
                writer.stop()
            for load in loads:
                stop_process(load)
            cluster.stop()
    return {
        "nodes": args.nodes,
        "scale": args.scale,
        "backups": backups,
        "cut_skew": spread([b["cut_skew_seconds"] for b in backups]),
        "late": spread([b["cut_late_seconds"] for b in backups]),
        "checkpoint_spread": spread([b["checkpoint_spread_seconds"] for b in backups]),
        "pgbench_tps_per_node": [round(n / elapsed) for n in written],
        "wakeup_overshoot": wakeups(overshoots),
        **(pauses(backups, rounds / elapsed) if args.commit_lock is not None else {}),
    }


def pause_split(svc: Any, record: dict[str, Any]) -> dict[str, Any]:
    """Where the longest node's pause went, from the manifest's markers (the server's clock):
    waiting for the lock, from the lock to the restore point, and from the point to letting
    go (the hold)."""
    location = "vault" if record.get("location") == "vault" else "store"
    key = record["vault_manifest_key"] if location == "vault" else record["manifest_key"]
    manifest = load_manifest(source_of(svc, location), key)
    nodes = []
    for shard in manifest.shards:
        if "cut_pause" not in shard.marker:
            continue
        asked, locked, released = (float(v) for v in shard.marker["cut_pause"].split())
        created = float(shard.marker["cut_at"])
        if locked:
            nodes.append((released - asked, locked - asked, created - locked, released - created))
    if not nodes:
        return {}
    _, lock_wait, to_point, hold = max(nodes)
    return {"pause_lock_wait_seconds": lock_wait, "pause_to_point_seconds": to_point,
            "pause_hold_seconds": hold}  # fmt: skip


def wakeups(overshoots: list[float]) -> dict[str, Any]:
    """How much longer than asked the probe's 10 ms sleeps took: min, median, p90, p99, max,
    and how many of them there were and ran 10 ms or more over."""
    if not overshoots:
        return {}
    ordered = sorted(overshoots)
    return spread(ordered) | {
        "p99_ms": p99_ms(ordered),
        "sleeps": len(ordered),
        "over_10_ms": sum(1 for o in ordered if o >= 0.01),
    }


def pauses(backups: list[dict[str, Any]], rounds_per_second: float) -> dict[str, Any]:
    """The commit pauses: how many cuts were paused, the longest node's pause per backup
    (min, median, p90, p99, max), and the distributed writer's rounds a second."""
    lengths = sorted(float(b["cut_pause_seconds"] or 0) for b in backups)
    parts = ("pause_lock_wait_seconds", "pause_to_point_seconds", "pause_hold_seconds")
    return {
        "cuts_paused": sum(1 for b in backups if b["cut_paused"] is True),
        "pause": spread(lengths) | {"p99_ms": p99_ms(lengths)},
        # The longest node's pause, split (its max is the backup whose part took longest).
        **{
            part.removesuffix("_seconds"): spread([b[part] for b in backups if part in b])
            for part in parts
            if any(part in b for b in backups)
        },
        "distributed_rounds_per_second": round(rounds_per_second),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--backups", type=int, default=10)
    parser.add_argument("--scale", type=int, default=10, help="pgbench scale per node")
    parser.add_argument(
        "--commit-lock",
        type=int,
        metavar="KEY",
        help="the policy's cut.commit_lock, with a distributed writer that honours it",
    )
    parser.add_argument(
        "--distributed-rate",
        type=float,
        default=100.0,
        metavar="N",
        help="with --commit-lock: the distributed writer's rounds a second, at most (0: as fast "
        "as they go)",
    )
    parser.add_argument(
        "--no-writer",
        action="store_true",
        help="with --commit-lock: no distributed writer, pgbench alone (it takes no lock): the "
        "pause the cut costs while no distributed commit is under way",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here too")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and keep it")
    args = parser.parse_args()
    if args.keep:  # the agents' logs stay there, to split a late node's time
        args.keep.mkdir(parents=True, exist_ok=True)
        result = run(args, args.keep)
    else:
        with tempfile.TemporaryDirectory() as root:
            result = run(args, Path(root))
    summary = {k: v for k, v in result.items() if k != "backups"}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
