"""Promotion time and cost per vault target, for a backup of about 1 GiB of data nobody tuned
for (incompressible rows): the stack's vault, two GCS copy targets (NEARLINE, ARCHIVE) and an
Object Lock bucket in another AWS account (DEEP_ARCHIVE).

Usage::

    PYTHONPATH=.:agents .venv/bin/python bench/vault_copies.py --size-mib 1024 --runs 3 \\
        --out bench/results

The local stack runs as in the tests: moto's control plane and vault in this process, MinIO as
the store, fake-gcs-server behind the retention proxy as GCS. A cluster of three SQLite nodes
holds ``--size-mib`` of random rows; its policy promotes into the vault at GLACIER_IR with a
one-day lock and copies to two GCS buckets (NEARLINE and ARCHIVE, one-day retention) and to
account B's bucket (a second moto account, through its role; DEEP_ARCHIVE, COMPLIANCE for a
day). Each run is a new full backup.

Measured per run, all read back from the backup's catalog item:

* *stack vault*: ``promoted_at - completed_at`` (the Promote task's first calls: copy, read
  back each lock, write the vault manifest);
* *each copy*: its record's ``seconds``, the time the promote function spent copying to it
  (stream from the store, CRC64NVME checked on the way; GCS's CRC32C and MD5 compared, or
  account B's CRC64NVME; class and retention read back; the copy's manifest), over every
  budgeted call;
* *backup*: start to SUCCEEDED, promotion included.

What a copy costs is priced from the price table (``shardvault.pricing.prices``): the bytes
leaving AWS once (none to account B in the stack's region), a month in the target's class,
its minimum billed duration, and one write per object. These are local figures: the store,
the vault, account B and GCS are on this machine, so the time is the pipeline's (reading,
checking, writing), not a network's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardvault.aws.tables import Catalog, table
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest
from shardvault.local import demo
from shardvault.local.account_b import ACCOUNT_B, KMS_KEY, ROLE_ARN
from shardvault.local.stack import LocalStack
from shardvault.pricing.prices import (
    AWS_EGRESS_INTERNET_GB,
    GB,
    GCS_STORAGE,
    STORAGE,
    StorageClass,
)

CLUSTER = "bench"
TARGETS = {"near": "NEARLINE", "cold": "ARCHIVE"}
ACCOUNT_B_TARGET = ("b", "DEEP_ARCHIVE")


def policy(root: Path) -> Path:
    copies = ", ".join(
        f"{{name: {name}, kind: gcs, project: bench, bucket: bench-{name}, "
        f"storage_class: {cls}, retention: {{days: 1}}}}"
        for name, cls in TARGETS.items()
    )
    name, cls = ACCOUNT_B_TARGET
    copies += (
        f", {{name: {name}, kind: aws, account: '{ACCOUNT_B}', bucket: bench-vault-b, "
        f"region: us-east-1, role_arn: '{ROLE_ARN}', external_id: bench-b, "
        f"kms_key: '{KMS_KEY}', storage_class: {cls}, object_lock: {{days: 1}}}}"
    )
    path = root / "policy.yaml"
    path.write_text(
        "version: 1\nclusters:\n"
        f"  {CLUSTER}:\n"
        "    engine: sqlite\n"
        "    schedule: {full: '0 2 * * *'}\n"
        "    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}, "
        f"copies: [{copies}]}}\n"
        "    retention: {keep_daily: 1}\n"
    )
    return path


def one_run(stack: LocalStack, config: ops.ClientConfig) -> dict[str, Any]:
    started = time.monotonic()
    execution = ops.start_backup(config, BackupRequest(cluster=CLUSTER, requested_by="bench"))
    progress = ops.wait_backup(config, execution, interval=0.2, timeout=1800)
    wall = time.monotonic() - started
    if progress.status != "SUCCEEDED":
        raise SystemExit(f"backup failed: {progress.error}: {progress.cause}")
    backup_id = progress.record["backup_id"]
    record = Catalog(table(stack.settings.catalog_table)).get(CLUSTER, backup_id)
    if record is None or not record.completed_at or not record.promoted_at:
        raise SystemExit(f"backup {backup_id} was not promoted: {record}")
    return {
        "backup_id": backup_id,
        "stored_bytes": record.stored_bytes,
        "objects": record.objects,
        "backup_seconds": round(wall, 2),
        "stack_vault_seconds": round(record.promoted_at - record.completed_at, 2),
        "copies": {
            name: {"seconds": copy.seconds, "state": copy.state, "class": copy.storage_class}
            for name, copy in record.vault_copies.items()
        },
    }


def costs(stored_bytes: int, objects: int) -> dict[str, dict[str, float]]:
    """One backup's cost in each target: once (egress, writes) and a month kept (storage; the
    class's minimum billed duration is paid whatever the retention)."""
    gb = stored_bytes / GB
    vault = STORAGE[StorageClass.GLACIER_IR]
    out = {
        "stack vault (GLACIER_IR)": {
            "once_usd": (objects + 1) * vault.put,
            "month_usd": gb * vault.storage_gb_month,
            "minimum_days": vault.minimum_days,
        }
    }
    for name, cls in TARGETS.items():
        prices = GCS_STORAGE[cls]
        out[f"{name} (GCS {cls})"] = {
            "once_usd": gb * AWS_EGRESS_INTERNET_GB + (objects + 1) * prices.put,
            "month_usd": gb * prices.storage_gb_month,
            "minimum_days": prices.minimum_days,
        }
    name, cls = ACCOUNT_B_TARGET
    b = STORAGE[StorageClass(cls)]
    out[f"{name} (account B {cls})"] = {  # one region: no data transfer charge
        "once_usd": (objects + 1) * b.put,
        "month_usd": gb * b.storage_gb_month,
        "minimum_days": b.minimum_days,
    }
    return out


def report(runs: list[dict[str, Any]]) -> str:
    def median(values: list[float]) -> float:
        return statistics.median(values)

    stored = int(median([r["stored_bytes"] for r in runs]))
    objects = int(median([r["objects"] for r in runs]))
    lines = [
        f"{len(runs)} runs, {stored / 2**20:,.0f} MiB stored in {objects} objects a backup "
        f"(medians; per run in the JSON)",
        "",
        "| target | promotion (s) | per run (s) | MiB/s | once (USD) | a month (USD) | "
        "minimum billed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    priced = costs(stored, objects)
    rows = [("stack vault (GLACIER_IR)", [r["stack_vault_seconds"] for r in runs])]
    rows += [
        (f"{name} (GCS {cls})", [r["copies"][name]["seconds"] for r in runs])
        for name, cls in TARGETS.items()
    ]
    name, cls = ACCOUNT_B_TARGET
    rows.append((f"{name} (account B {cls})", [r["copies"][name]["seconds"] for r in runs]))
    for label, seconds in rows:
        price = priced[label]
        lines.append(
            f"| {label} | {median(seconds):.2f} | {', '.join(f'{s:.2f}' for s in seconds)} | "
            f"{stored / 2**20 / median(seconds):,.0f} | {price['once_usd']:.4f} | "
            f"{price['month_usd']:.4f} | {price['minimum_days']:.0f} days |"
        )
    lines.append("")
    lines.append(
        f"backup, start to SUCCEEDED with every promotion: median "
        f"{median([r['backup_seconds'] for r in runs]):.1f} s"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vault-copies-") as work:
        root = Path(work)
        cluster = demo.sqlite_cluster(root, name=CLUSTER, nodes=3, size_mb=args.size_mib)
        with LocalStack(root / "stack", require_minio=True, policy_file=policy(root)) as stack:
            ops.act_as(stack.operator_binding())
            for config in cluster.agent_configs:
                stack.start_agent(config)
            stack.wait_for_nodes([c["node_id"] for c in cluster.agent_configs])
            config = stack.client_config()
            runs = [one_run(stack, config) for _ in range(args.runs)]
            ops.act_as(None)
    text = report(runs)
    print(text)
    if args.out:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"vault_copies-{stamp}.json").write_text(json.dumps(runs, indent=1))
        (args.out / f"vault_copies-{stamp}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
