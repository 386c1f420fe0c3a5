"""The cut's skew across nodes under write load (issue 11): how far apart, in time, a backup's
restore points are on the nodes of one cluster, each node busy with pgbench.

Usage::

    .venv/bin/python bench/cut_skew.py --nodes 3 --backups 10 --scale 10

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
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from shardvault import operations as ops
from shardvault.local import demo
from shardvault.local.postgres import start_pgbench, stop_process
from shardvault.local.stack import LocalStack
from shardvault.models import BackupRequest

FAST_AGENT = {"heartbeat_interval_seconds": 1.0, "poll_interval_seconds": 0.05}


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
    with LocalStack(root / "stack") as stack:
        for config in cluster.agent_configs:
            stack.start_agent(config | FAST_AGENT)
        stack.wait_for_nodes([c["node_id"] for c in cluster.agent_configs])
        client = stack.client_config()
        seconds = 600
        loads = [start_pgbench(s, clients=2, seconds=seconds) for s in cluster.servers.values()]
        backups = []
        servers = list(cluster.servers.values())
        try:
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
                    r
                    for r in stack.services().catalog.backups(cluster.name)
                    if r["backup_id"] == progress.record["backup_id"]
                )
                backups.append(
                    {
                        "backup_id": record["backup_id"],
                        "kind": record.get("kind"),
                        "cut_skew_seconds": float(record["cut_skew_seconds"]),
                        "cut_late_seconds": float(record.get("cut_late_seconds") or 0),
                        "checkpoint_spread_seconds": float(record["checkpoint_skew_seconds"]),
                        "duration_seconds": float(record["duration_seconds"]),
                    }
                )
                print(json.dumps(backups[-1]), flush=True)
            elapsed = time.monotonic() - started
            written = [transactions(s) - b for s, b in zip(servers, before, strict=True)]
        finally:
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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--backups", type=int, default=10)
    parser.add_argument("--scale", type=int, default=10, help="pgbench scale per node")
    parser.add_argument("--out", type=Path, help="write the results as JSON here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        result = run(args, Path(root))
    summary = {k: v for k, v in result.items() if k != "backups"}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
