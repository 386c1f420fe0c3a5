"""What the CLI shows of a backup or a restore as the catalog records it: the cells of
``list`` and ``show``, a backup's summary, a restore's result."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.output import console, sized
from shardvault.contracts.catalog import BackupItem, CopyRecord, recorded_stored_bytes
from shardvault.contracts.models import (
    ThrottleReport,
)
from shardvault.data.planning import MiB
from shardvault.errors import InvalidRequest


def chain_root_of(config: ops.ClientConfig, record: BackupItem) -> BackupItem | None:
    """The full an incremental's chain starts with (None for a full, or when it is gone)."""
    root = record.chain_root
    if not record.is_incremental or not root:
        return None
    try:
        return ops.show_backup(config, record.cluster, root)
    except InvalidRequest:
        return None


def backup_type(record: BackupItem) -> str:
    """``full`` (synthesized from a chain, or read), or ``incremental`` with its depth in the
    chain and its parent."""
    if record.synthesized_from:
        return f"full, synthesized from the chain of {record.synthesized_from}"
    if not record.is_incremental:
        return "full"
    return f"incremental, depth {record.depth}, of {record.parent_id}"


def read_bytes(record: BackupItem) -> int:
    """What the backup read from the databases: an incremental reads (and hashes) the blocks
    of the files that changed since its parent, but those whose headers prove them unchanged
    (``data_screened_bytes``), and sends only the changed blocks (``bytes``); records before
    incrementals hold ``bytes``."""
    return record.read_bytes or record.bytes or 0


def read_cell(record: BackupItem) -> str:
    screened = record.data_screened_bytes
    if not screened:
        return sized(read_bytes(record))
    return f"{sized(read_bytes(record))}; {sized(screened)} more vouched for by page headers"


def full_share(record: BackupItem, root: BackupItem | None) -> float | None:
    """An incremental's stored bytes over its chain's full's; None when the full is gone from
    the catalog."""
    full = recorded_stored_bytes(root) if root else 0
    return recorded_stored_bytes(record) / full if full else None


def share_of_full(record: BackupItem, root: BackupItem | None) -> str:
    """``full_share`` as the table shows it; fulls are 100 %."""
    if not record.is_incremental:
        return "100 %" if record.bytes is not None else ""
    share = full_share(record, root)
    return "?" if share is None else f"{share:.1%}"


def recovered_to(shard: dict[str, Any]) -> str:
    """Where a restored shard's recovery stopped: a point-in-time target, the backup's cut,
    or its own copy's end."""
    kind, where = shard.get("recovery_target"), shard.get("recovered_to")
    if kind:
        return {"name": f"restore point {where}", "lsn": f"LSN {where}"}.get(kind, str(where))
    if where:
        return f"restore point {where}"
    return "end of its copy"


def objects_cell(record: BackupItem) -> str:
    """What the backup keeps in the store: its data objects (what a restore downloads), its
    block maps (in its stored bytes) and its manifest."""
    data = record.objects
    if data is None:
        return ""
    maps = record.blockmap_objects
    if maps is None:  # recorded before block maps were counted
        return f"{data} data objects, with their block maps and the manifest"
    return f"{data} data + {maps} block maps + 1 manifest = {data + maps + 1} stored"


def cut_cell(record: BackupItem) -> str:
    """Where a restore of the backup stops every node: its restore point, and the skew."""
    if record.cut_name is None:
        return "none (each shard restores to where its own copy ends)"
    skew = (record.cut_skew_seconds or 0) * 1000
    cell = f"restore point {record.cut_name}, skew {skew:.1f} ms"
    late = record.cut_late_seconds or 0
    if late >= 0.001:  # below a millisecond: the agents' wake-up, not lateness worth a word
        cell += f" (a node came {late * 1000:.0f} ms after the cut instant)"
    paused, pause = record.cut_paused, record.cut_pause_seconds or 0
    if paused is True:
        cell += f"; commits paused at most {pause * 1000:.1f} ms"
    elif paused is False:
        cell += "; commit pause not held on every node at once: best-effort"
    return cell


def throttle_note(throttle: ThrottleReport | None) -> str:
    """An adaptive backup's rate as its agent last reported it, for the progress line."""
    if not throttle or not throttle.limited_by:
        return ""
    rate = throttle.rate_bytes_per_second or 0
    return f"; reading at {rate / MiB:,.1f} MiB/s (held back by {throttle.limited_by})"


def throttle_cell(throttle: ThrottleReport) -> str:
    """What an adaptive throttle did over the backup (as its agent last reported it)."""
    if not throttle.cuts:
        return "adaptive: never held back (the source stayed within its targets)"
    lowest = throttle.lowest_rate_bytes_per_second or 0
    cell = (
        f"adaptive: held back {throttle.cuts} times, {throttle.throttled_seconds:.1f} s "
        f"in all, lowest {lowest / MiB:,.1f} MiB/s (floor "
        f"{throttle.floor_bytes_per_second / MiB:,.1f} MiB/s)"
    )
    if throttle.limited_by:
        rate = throttle.rate_bytes_per_second or 0
        cell += f"; last {rate / MiB:,.1f} MiB/s, held back by {throttle.limited_by}"
    return cell


def held_cell(record: BackupItem) -> str:
    """The most WAL the backup held on its source (its replication slot), as last reported."""
    return f"{sized(record.held_log_bytes or 0)} at most, until the backup let it go"


def packing_cell(record: BackupItem) -> str:
    """What packing cost the agents: CPU-seconds, per GB read, and frames per zstd level,
    e.g. "41.2 s, 1.38 s per GB read; frames per zstd level 1: 700, 3: 12"."""
    seconds, read = record.pack_cpu_seconds or 0.0, read_bytes(record)
    per_gb = f", {seconds / (read / 1e9):.2f} s per GB read" if read else ""
    counts = ", ".join(
        f"{level}: {n:,}" for level, n in sorted((record.frame_levels or {}).items())
    )
    return f"{seconds:,.1f} s{per_gb}" + (f"; frames per zstd level {counts}" if counts else "")


def print_summary(record: BackupItem, root: BackupItem | None = None) -> None:
    table = Table(title="Backup complete", show_header=False)
    rows = [
        ("backup id", record.backup_id),
        ("type", backup_type(record)),
        ("nodes", ", ".join(record.nodes)),
        ("shards", ", ".join(record.shards)),
        ("bytes read", read_cell(record)),
    ]
    if record.is_incremental:
        rows.append(("changed bytes sent", sized(record.bytes or 0)))
    rows += [
        ("bytes stored", stored_cell(record)),
        ("of its full's stored bytes", share_of_full(record, root)),
        ("objects", objects_cell(record)),
        ("parts", str(record.parts or "")),
        ("duration", f"{record.duration_seconds or 0:.2f} s"),
        ("throughput", f"{record.throughput_mib_s or 0:.1f} MiB/s"),
        *([("throttle", throttle_cell(record.throttle))] if record.throttle else []),
        *([("source WAL held", held_cell(record))] if record.held_log_bytes else []),
        *([("packing CPU", packing_cell(record))] if record.pack_cpu_seconds else []),
        ("cut", cut_cell(record)),
        ("checkpoint spread", f"{(record.checkpoint_skew_seconds or 0) * 1000:.1f} ms"),
        ("verification", record.verification or ""),
        ("manifest", record.manifest_key or ""),
        (
            "estimated cost",
            f"${record.estimated_storage_usd_per_month or 0:.4f}/month to keep, "
            f"${record.estimated_overhead_usd or 0:.4f} to make",
        ),
    ]
    if record.location == "vault":
        rows += [
            ("vault", f"{record.storage_class}, {record.lock_mode} lock"),
            ("retain until", record.retain_until or ""),
            ("vault manifest", record.vault_manifest_key or ""),
        ]
    if record.promotion:
        rows.append(("promotion", record.promotion))
    for name, copy in record.vault_copies.items():
        rows.append((f"copy {name}", copy_cell(copy)))
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


def copy_cell(copy: CopyRecord) -> str:
    """One vault copy as its provider reported it back, or why there is none."""
    if copy.state != "COPIED":
        return f"{copy.state}: {copy.reason or ''}"
    scheme = "s3" if copy.kind == "aws" else "gs"
    keys = f", data keys under {copy.data_key}" if copy.data_key else ""
    return (
        f"{scheme}://{copy.bucket}/{copy.manifest_key}, {copy.storage_class}, "
        f"{copy.retention_mode} until {copy.retain_until}{keys}"
    )


def stored_cell(record: BackupItem) -> str:
    """Bytes in the store (compressed, sealed: what was uploaded) and their share of the bytes
    read."""
    stored, read = recorded_stored_bytes(record), read_bytes(record)
    share = f" ({stored / read:.1%} of read)" if read else ""
    return f"{stored:,}{share}"


def hold_note(record: BackupItem) -> str:
    """What retention's hold says of a complete backup it expired, e.g. "held until
    2026-06-01: paid minimum of DEEP_ARCHIVE" (empty: not held)."""
    if record.status != "COMPLETE" or not record.held_until:
        return ""
    until = record.held_until[:10]
    return f"held until {until}: {record.held_for or 'paid minimum of its class'}"


def backup_json(record: BackupItem, root: BackupItem | None) -> dict[str, Any]:
    """A backup's catalog record with what the table shows computed: ``read_bytes`` (from
    the databases), ``stored_bytes`` (in the store, after compression), and for an
    incremental ``share_of_full`` (its stored bytes over its chain's full's; None when the
    full is gone from the catalog)."""
    out = ops.as_row(record) | {"read_bytes": read_bytes(record)}
    if record.bytes is not None:
        out["stored_bytes"] = recorded_stored_bytes(record)
    if record.is_incremental:
        out["share_of_full"] = full_share(record, root)
    return out


def wal_fed_cell(summary: dict[str, Any]) -> str:
    """A point-in-time restore's WAL feed, e.g. "12 of 40 archive batches (190.0 MiB):
    recovery stopped before the rest"."""
    fetched, planned = summary.get("wal_batches_fetched", 0), summary["wal_batches"]
    mib = summary.get("wal_bytes_fetched", 0) / MiB
    text = f"{fetched} of {planned} archive batches ({mib:,.1f} MiB)"
    return text + (": recovery stopped before the rest" if fetched < planned else "")


def print_restore(summary: dict[str, Any]) -> None:
    read = str(summary.get("source") or "")
    source = f" (vault target {read.removeprefix('copy:')})" if read.startswith("copy:") else ""
    table = Table(show_header=False, title="Restore complete")
    rows = [
        ("restore id", summary.get("restore_id", "")),
        ("from", f"{summary.get('source_cluster')} / {summary.get('backup_id')}{source}"),
        ("into", summary.get("target_cluster", "")),
        ("bytes", f"{summary.get('bytes', 0):,} ({summary.get('bytes', 0) / MiB:.1f} MiB)"),
        ("objects", str(summary.get("objects", ""))),
        ("duration", f"{summary.get('duration_seconds', 0):.2f} s"),
        ("throughput", f"{summary.get('throughput_mib_s', 0):.1f} MiB/s"),
        ("validation", summary.get("validation", "")),
    ]
    if summary.get("wal_batches"):  # a point-in-time restore: what recovery was fed
        rows.insert(-1, ("WAL fed to recovery", wal_fed_cell(summary)))
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)
    restored = summary.get("shards", [])
    # Only a cut's restore says where recovery stopped: SQLite shards have nothing to add.
    cut = any(s.get("recovered_to") for s in restored)
    columns = ["shard", "node", "where", *(["recovered to"] if cut else []), "checks"]
    shards = Table(*columns, title="Restored shards")
    for s in restored:
        where = f"port {s['port']}" if s.get("port") else s.get("path", "")
        checks = ", ".join(f"{k}: {v}" for k, v in s.get("checks", {}).items())
        cells = [s["shard_id"], s["node_id"], where, *([recovered_to(s)] if cut else []), checks]
        shards.add_row(*cells)
    console.print(shards)
    if summary.get("validation") == "passed":
        target = summary.get("target_cluster", "")
        console.print(
            f"The agents of {target} hold these shards now: backups of {target} include "
            "them, with no change to the agents' configuration."
        )
