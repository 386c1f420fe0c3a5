"""``shardvault demo`` and ``shardvault local``: the local stack, and the end-to-end demo on
it (back up a 3-node cluster, restore it, compare it with its source, drill it)."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.commands import drills
from shardvault.client.follow import follow
from shardvault.client.output import console, errors
from shardvault.client.records import read_bytes
from shardvault.contracts.catalog import BackupItem, recorded_stored_bytes
from shardvault.contracts.models import (
    BackupRequest,
    RestoreRequest,
)
from shardvault.data.planning import MiB


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands; none takes ``cli``'s deployment options (it makes its own, or takes
    its catalog optionally)."""
    demo = sub.add_parser("demo", help="local end-to-end backup of a 3-node cluster")
    demo.add_argument("--engine", choices=["sqlite", "postgres"], default="sqlite")
    demo.add_argument("--size-mb", type=int, default=240, help="SQLite data size (MiB)")
    demo.add_argument("--pgbench-scale", type=int, default=20, help="PostgreSQL data per node")
    demo.add_argument("--dir", type=Path, default=DEFAULT_STACK_DIR)
    demo.add_argument("--no-minio", action="store_true", help="use moto's S3 as the store")
    demo.set_defaults(run=run_demo)

    local = sub.add_parser("local", help="the local stack")
    local.add_argument("action", choices=["up", "down"])
    local.add_argument("--dir", type=Path, default=DEFAULT_STACK_DIR)
    local.add_argument("--no-minio", action="store_true", help="up: use moto's S3 as the store")
    local.set_defaults(run=run_local)
    return ()


DEFAULT_STACK_DIR = Path("local-stack")


def run_local(args: argparse.Namespace) -> int:
    """``local up`` runs the stack until Ctrl-C or ``local down`` (SIGTERM, handled as Ctrl-C
    so the stack stops its agents and MinIO); ``local down`` stops the one in ``--dir``."""
    from shardvault.local.stack import LocalStack, stop_running_stack

    root = args.dir.resolve()
    if args.action == "down":
        pid = stop_running_stack(root)
        console.print(f"local stack in {root} (pid {pid}) stopped")
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with LocalStack(root, use_minio=not args.no_minio) as stack:
            console.print(
                f"local stack up: control plane {stack.endpoint}, "
                f"store {stack.settings.store_endpoint}"
            )
            console.print(
                f"use: shardvault backup CLUSTER --wait --stack-env {stack.root / 'stack.env'}"
            )
            console.print(f"stop: Ctrl-C, or shardvault local down --dir {root}")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        console.print("local stack stopped")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from shardvault.local.stack import LocalStack

    root = args.dir.resolve()
    started = time.monotonic()
    with LocalStack(root, use_minio=not args.no_minio) as stack:
        store = (
            "MinIO " + stack.settings.store_endpoint
            if stack.settings.verify_mode == "attributes"
            else "moto S3 (read-back verification)"
        )
        console.print(f"[bold]local stack[/]: control plane {stack.endpoint}; store: {store}")
        ops.act_as(stack.operator_binding())  # the CLI's calls, judged by the operator's policy
        try:
            done = demo_cycle(args, stack, root)
        finally:
            ops.act_as(None)
        if refused := stack.refused_calls():  # what the stack refused, though nothing failed
            for holder, action, resource in refused:
                errors.print(f"[bold red]refused[/]: {holder} {action} on {resource}")
            return 1
    if done:
        console.print(
            f"demo finished in {time.monotonic() - started:.1f} s; logs in {root} "
            "(functions.log, agents/*.log, minio.log)"
        )
    return 0 if done else 1


def demo_cycle(args: argparse.Namespace, stack: Any, root: Path) -> bool:
    """The demo's cluster backed up, changed, backed up again, restored and drilled; whether
    every step passed."""
    from shardvault.local import demo

    with console.status("creating the demo cluster's data"):
        cluster = demo.demo_cluster(
            args.engine, root, size_mb=args.size_mb, scale=args.pgbench_scale
        )
    try:
        for config in cluster.agent_configs:
            stack.start_agent(config)
        stack.wait_for_nodes([c["node_id"] for c in cluster.agent_configs])
        console.print(
            f"[bold]cluster {cluster.name}[/]: {len(cluster.agent_configs)} nodes, "
            f"engine {cluster.engine}, agents registered"
        )
        config = stack.client_config()
        full = demo_backup(config, cluster.name, incremental=False)
        if full is None:
            return False
        with console.status("changing 1 % of each shard's rows"):
            rows = cluster.change(0.01)
        console.print(
            f"[bold]change[/]: {rows:,} rows rewritten, one contiguous range in each shard"
        )
        incremental = demo_backup(config, cluster.name, incremental=True)
        if incremental is None:
            return False
        print_reduction(full, incremental)
        with console.status("changing 1 % of each shard's rows again"):
            cluster.change(0.01)
        synthesized = demo_backup(config, cluster.name, incremental=False)
        if synthesized is None:
            return False
        print_synthesized(synthesized, full)
        source = cluster.digests()  # no write since the last backup: what it must restore
        return restore_demo(stack, cluster, root, synthesized.backup_id, source) and drill_demo(
            stack, cluster, root
        )
    finally:
        cluster.stop()


DEMO_COPY = "offsite"  # the local policy's GCS copy of the demo clusters, restored from
DEMO_CHECKS = {  # a query each restored shard must answer true
    "sqlite": "SELECT count(*) > 0 FROM items",
    "postgres": "SELECT count(*) > 0 FROM pgbench_accounts",
}


def demo_backup(config: ops.ClientConfig, cluster: str, *, incremental: bool) -> BackupItem | None:
    """One backup of the demo cluster, followed; its record, or None when it failed."""
    request = BackupRequest(cluster=cluster, incremental=incremental, requested_by="demo")
    outcome = follow(config, ops.start_backup(config, request))
    if outcome.status != "SUCCEEDED" or outcome.record is None:
        return None
    record = BackupItem.from_item(outcome.record)
    print_held(record)
    return record


def print_held(record: BackupItem) -> None:
    """Where the backup is held, as each vault target reported it back."""
    places = []
    if record.location == "vault":
        places.append(
            f"stack vault {record.storage_class} {record.lock_mode} until {record.retain_until}"
        )
    for name, copy in record.vault_copies.items():
        if copy.state == "COPIED":
            held = f"{copy.retention_mode} until {copy.retain_until}"
            provider = "S3" if copy.kind == "aws" else "GCS"
            places.append(f"{name} ({provider} {copy.storage_class}, {held})")
        else:
            places.append(f"{name}: [bold red]{copy.state}[/] {copy.reason or ''}")
    if places:
        console.print("[bold]held in[/]: " + "; ".join(places))


def print_reduction(full: BackupItem, incremental: BackupItem) -> None:
    """What the incremental sent against its full: the data reduction the demo shows."""
    stored, of_full = recorded_stored_bytes(incremental), recorded_stored_bytes(full)
    console.print(
        f"[bold]incremental[/]: read {read_bytes(incremental) / MiB:,.1f} MiB to find what "
        f"changed since its parent, sent "
        f"{(incremental.bytes or 0) / MiB:,.1f} MiB of changed blocks, "
        f"uploaded {stored / MiB:,.1f} MiB: [bold]{stored / of_full:.1%}[/] of the full's "
        f"{of_full / MiB:,.1f} MiB"
    )


def print_synthesized(synthesized: BackupItem, full: BackupItem) -> None:
    """What the policy's synthesized full read and copied, against the first full's read."""
    if not synthesized.synthesized_from:
        console.print(f"[bold]full[/]: read from the database ({synthesized.full_reason})")
        return
    console.print(
        f"[bold]synthesized full[/]: sent {(synthesized.data_bytes or 0) / MiB:,.1f} MiB of "
        f"changes (the first full read {read_bytes(full) / MiB:,.1f} MiB) and copied the "
        f"{synthesized.synthesis_objects or 0} objects of its chain inside the store; it "
        "stands alone as a full"
    )


def restore_demo(
    stack: Any, cluster: Any, root: Path, backup_id: str, source: dict[str, dict[str, str]]
) -> bool:
    """Restores ``backup_id`` from its GCS copy (the local policy's ``offsite``) into a new
    cluster of two nodes (three shards: one node takes two), each shard checked by its engine
    and then compared, table by table, with its source's digests; restored servers are
    stopped at the end."""
    from shardvault.local import demo

    target = f"{cluster.name}-restored"
    targets = demo.restore_targets(root, name=target, engine=cluster.engine, nodes=2)
    for config in targets:
        stack.start_agent(config)
    try:
        stack.wait_for_nodes([c["node_id"] for c in targets])
        console.print(
            f"[bold]cluster {target}[/]: 2 empty nodes, agents registered; restoring from the "
            f"GCS copy {DEMO_COPY!r}"
        )
        config = stack.client_config()
        request = RestoreRequest(
            cluster=cluster.name,
            backup_id=backup_id,
            target_cluster=target,
            replace=True,  # a demo run again in the same directory restores over the last one
            from_vault=DEMO_COPY,
            validation_queries=[DEMO_CHECKS[cluster.engine]],
            requested_by="demo",
        )
        outcome = follow(config, ops.start_restore(config, request), ops.wait_restore, "restore")
        shards = (outcome.record or {}).get("shards", [])
        try:
            equal = outcome.status == "SUCCEEDED" and compare_with_source(
                cluster.engine, shards, source
            )
        finally:
            stop_restored_servers(shards)
        return equal
    finally:
        for config in targets:
            stack.stop_agent(config["node_id"])


def drill_demo(stack: Any, cluster: Any, root: Path) -> bool:
    """A restore drill of the demo cluster, as its policy's schedule would run it (its newest
    backup into two drill nodes, its validation query), with the copy torn down at once; prints
    the verdict and the RTO."""
    import shutil

    from shardvault.assurance.drills import DrillRequest
    from shardvault.local import demo

    target = f"{cluster.name}-drill"  # the local policy's drill target
    nodes = demo.restore_targets(root, name=target, engine=cluster.engine, nodes=2)
    for config in nodes:  # a demo run again in the same directory starts its drill nodes empty
        shutil.rmtree(config["restore_dir"], ignore_errors=True)
        shutil.rmtree(config["state_dir"], ignore_errors=True)
        stack.start_agent(config)
    try:
        stack.wait_for_nodes([c["node_id"] for c in nodes])
        config = stack.client_config()
        request = DrillRequest(cluster=cluster.name, keep_minutes=0, requested_by="demo")
        outcome = drills.follow_drill(config, ops.start_drill(config, request))
        return outcome.status == "SUCCEEDED"
    finally:
        for config in nodes:
            stack.stop_agent(config["node_id"])


def compare_with_source(
    engine: str, shards: list[dict[str, Any]], source: dict[str, dict[str, str]]
) -> bool:
    """Prints, per restored shard, whether every table equals its source's; True if all do."""
    from shardvault.local.demo import restored_digests

    table = Table("shard", "node", "tables", "equal to the source", title="Restored data")
    equal = True
    for shard in shards:
        restored = restored_digests(engine, shard)
        expected = source.get(shard["shard_id"], {})
        same = restored == expected
        equal = equal and same
        verdict = "[green]yes[/]" if same else "[bold red]NO[/]"
        table.add_row(shard["shard_id"], shard.get("node_id", ""), str(len(restored)), verdict)
    console.print(table)
    return equal and len(shards) == len(source)


def stop_restored_servers(shards: list[dict[str, Any]]) -> None:
    from shardvault.local.postgres import stop_server

    for shard in shards:
        if shard.get("port"):
            stop_server(Path(shard["path"]))
