"""ShardVault's block-level incremental backups and chain restores against pgBackRest's
file-level incrementals, in one run on one machine (issue 10).

Usage::

    .venv/bin/python bench/incremental_vs_peers.py [--scale 100] [--runs 3] [--out bench/results]
    .venv/bin/python bench/incremental_vs_peers.py --scale 300 --runs 1 --memory-only

The environment is ``backup_vs_peers.py``'s, set up by its code: one PostgreSQL 15 instance
(``initdb --data-checksums``, ``wal_level=replica``, ``shared_buffers=512MB``, WAL archived by
pgBackRest's ``archive-push``) filled by ``pgbench -i -s SCALE``; the local stack (moto Step
Functions running the real ASL, Lambda handlers in this process, MinIO as the store) with one
source agent and one restore-target agent; pgBackRest 2.45 (``compress-type=zst`` at its
default level 3, ``process-max=2``, ``start-fast=y``) into a second MinIO over TLS. The bench
cluster is not in the local policy file, so ShardVault runs at the policy's defaults: zstd
level 1, not encrypted, ``incremental.max_chain`` 6 (a chain of a full and 6 incrementals is
allowed, and the 7th incremental request after a full would be made as a full:
``shardvault.backup.admission.chain_for``).

Each round (``--runs``) builds one chain per tool, both tools in step, each timed backup or
restore run once per tool so that noise from the shared machine hits both alike:

1. *full*: a ShardVault full backup, then ``pgbackrest backup --type=full``.
2. Six *changes*, each followed by a ShardVault incremental (``incremental=True``; the run
   fails unless the manifest says ``incremental`` at the expected depth) and a ``pgbackrest
   backup --type=incr``: (1) the *1 % update*, ``UPDATE pgbench_accounts SET abalance =
   abalance + 1 WHERE aid BETWEEN k AND k + rows/100 - 1``, one contiguous key range;
   (2) *10,000 transactions*: ``pgbench -n -c 4 -j 2 -t 2500``, pgbench's default TPC-B-like
   script (random accounts); then (3) to (6) alternate the two again, each update at another
   key range (``UPDATE_AT``). Incrementals 1 and 2 are the issue's two cases; 3 to 6 make the
   chain a restore has to assemble. After each change, untimed: ``CHECKPOINT``, so that
   neither tool's checkpoint has more dirty pages to write than the other's.
3. *full after the chain*: right after both 6th incrementals (no write in between), a
   ShardVault full of that same data, before anything reads the tables: a read sets hint bits
   and prunes pages, so a full taken after step 4 would hold pages that the chains' restores
   have to hint and prune during their recovery and ``pg_amcheck`` (logged as full pages,
   with checksums on) and its restore would not.
4. *source values*: the source's ``count(*)``, ``sum(abalance)``, ``sum(aid * abalance)`` of
   ``pgbench_accounts``, the count and ``sum(delta)`` of ``pgbench_history`` and the balance
   sums of tellers and branches.
5. *restores*, each into an empty directory, timed to a recovered, running server that passed
   ``pg_amcheck --all`` (as ``backup_vs_peers.py`` times them): ShardVault's restore of its 6th
   incremental (the chain: full + 6), ShardVault's restore of the full of step 3, pgBackRest's
   restore of its 6th incr. After each (untimed) the restored server's values are compared
   with the source values of step 4: a backup restores to its own end point, and nothing
   was written between the backups and the capture. Before them, untimed and not recorded,
   a *warm-up*: ShardVault's restore of the full of step 3. These machines' host takes back
   guest memory left free for long (docs/BENCHMARKS.md, the caveat of 2026-11-25), so the
   first restore after the backups wrote its data directory into memory that had to come
   back first, and paid for it: in a harness at scale 300 the chain restored in 15.3 s and
   the full in 8.4 s when the chain came first, 9.5 s and 10.2 s when the full did. After the
   warm-up every timed restore writes into memory its predecessor freed; and the order of
   the three turns by one each round, so that over ``--runs 3`` each goes first once.

Before the first round, untimed and not recorded (its time is printed), a *warm-up backup*:
one ShardVault full, then deleted. The local stack's first backup pays once what a stack
that has been running does not: the state machine's definition parsed, the handlers' modules
imported and their clients built, the agent's first commands (on 2026-11-28 the first full
took 7.0 to 7.3 s and 3.2 to 3.5 s of the control plane's CPU, the next ones 5.6 to 6.6 s and
2.4 to 2.6 s; dev probe). Without it round 1's full measured that start-up rather than a
backup, and ``--runs 1`` measured nothing else. pgBackRest starts a new process per command
and has no such state to build.

``--memory-only`` runs, per round, only a ShardVault full, the 1 % update, an incremental and
the restore of that incremental, for the agents' peak memory at large scales.

Before each timed run the machine is settled as in ``backup_vs_peers.py``: both agents back at
their idle poll rate, WAL archiving caught up, ``sync``. ShardVault's backups of a round are
deleted from the store, and pgBackRest's previous rounds' backups expired, at the end of each
round (untimed; disk space).

Measured, per backup:

* *wall time* (``seconds``): ShardVault, ``start_backup`` to the execution's stop;
  pgBackRest, the command's start to its exit.
* *data bytes stored* (``data_stored_bytes``, compressed): ShardVault, the stored bytes of the
  backup's ``data`` stream objects (an incremental's hold the changed 8 KiB blocks only);
  pgBackRest, the files under its backup path but its ``backup.manifest`` and copy (an incr
  holds each file whose size or time changed, whole).
* *WAL bytes stored* (``wal_stored_bytes``, compressed): ShardVault, the ``tail`` stream's
  objects (backup label and the WAL from start to stop); pgBackRest, the archived WAL segments
  from the backup's archive start to stop (``backup_vs_peers.pgbackrest_stored``).
* *index bytes stored* (``index_stored_bytes``): ShardVault, the block map object
  (``ManifestShard.blockmap``, 16 bytes of xxh3-128 per 8 KiB block of the data) plus
  ``manifest.json``; pgBackRest, ``backup.manifest`` and its copy.
* *stored bytes* (``stored_bytes``): everything the backup added to its bucket: the three
  above. ShardVault's are listed from the store and must equal its manifest's and catalog
  record's ``stored_bytes`` (``backup_vs_peers.shardvault_stored``, else the run fails).
* *bytes read* (``bytes_read``, plaintext): ShardVault, an incremental's scan reads the whole
  data stream (every block hashed for the block map) and its pack the delta (the changed
  blocks); a full reads its stream once (its packs hash what they read); plus the tail;
  pgBackRest, the ``delta`` of ``pgbackrest info`` (the size of the files it copied) — its
  WAL is read by ``archive-push``, outside the backup.
* *scan*: the agent's own ``scan_seconds`` (read and hash every block, compare with the
  parent's map; from the data listing in the work bucket), the ``checkpoint`` command's time
  in the agent's log (the checkpoint, then the scan: adds getting and checking the parent's
  map), and the ``Checkpoint`` state's time in the execution history (adds the hops through
  Step Functions and the inbox).
* *phases* of a ShardVault backup (from the execution history; they add up to its time):
  ``checkpoint`` (Validate, PrepareScan, and Flush where several nodes flush first),
  ``scan`` (Checkpoint: each node's checkpoint and scan, one command; a lone node flushes
  in it), ``plan``
  (PlanData), ``upload`` (the data objects' Upload map), ``tail`` (CheckUploads, Stop,
  PlanTail, the tail's Upload map; a full's block map goes with its tail, an
  incremental's with its data; a lone node's incremental stops in its Checkpoint command,
  with no Stop or PlanTail) and ``finalize`` (Release, Finalize).
* *data bytes sent* (``data_bytes``, plaintext, before compression): ShardVault, the changed
  blocks (a full: every block); pgBackRest, the files it copied.
* *agent peak RSS*: ``VmHWM`` of each agent process (peak since it started).

Measured, per restore: its wall time (as above); the bytes it wrote (ShardVault: the restored
backup's data and tail streams, since a restore summary's ``bytes`` and ``objects`` are the
restored backup's own, for an incremental its delta; pgBackRest: the backup's size); whether
the restored values equal the source's; for ShardVault, the seconds of each state of the
execution and the restore agent's ``download`` commands (its log), summed over the objects
of the chain's root and of its incrementals.

Ratios are given of the medians, and per round (min / median / max of the rounds' ratios);
the issue's targets (``TARGETS``, ``MEMORY_LIMIT``) say whether they held in every round or
only on the medians. Raw results go to ``--out`` as JSON, the tables to stdout and beside the
JSON as Markdown. Everything started is stopped and the work directory removed on the way out
(an ExitStack), also on failure, Ctrl-C or SIGTERM (``--keep`` keeps the directory).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import backup_vs_peers as bvp
import report
from botocore.exceptions import ClientError
from peers import (
    PGBACKREST_BUCKET,
    avoid_empty_put_stall,
    delete_prefix,
    list_keys,
    process_cpu,
)
from report import MiB, Target

from shardvault.client import operations as ops
from shardvault.contracts.models import BackupKind, BackupRequest, Manifest, Phase, RestoreRequest
from shardvault.local.postgres import PostgresInstance

# The chain's changes, in order: incremental n follows CHANGES[n - 1].
UPDATE, TRANSACTIONS = "update", "transactions"
CHANGES = (UPDATE, TRANSACTIONS, UPDATE, TRANSACTIONS, UPDATE, TRANSACTIONS)
UPDATE_AT = (0.10, 0.45, 0.80)  # where the 1st, 2nd, 3rd update's range starts (of the rows)
UPDATE_FRACTION = 0.01
PGBENCH_ARGS = ("-n", "-c", "4", "-j", "2", "-t", "2500")  # 10,000 transactions
ROWS_PER_SCALE = 100_000  # pgbench_accounts rows per unit of scale
MEMORY_LIMIT = 300 * 10**6  # bytes: the "< 300 MB" of agent peak RSS
CHANGE_TEXT = {
    UPDATE: "1 % contiguous update",
    TRANSACTIONS: "10,000 pgbench transactions (-c 4 -j 2 -t 2500)",
}
PGBACKREST_MANIFEST = re.compile(r"/backup\.manifest(\.copy)?$")
SOURCE_VALUES = (
    "SELECT (SELECT count(*) || ',' || sum(abalance) || ',' || sum(aid::numeric * abalance) "
    "FROM pgbench_accounts), (SELECT count(*) || ',' || coalesce(sum(delta), 0) "
    "FROM pgbench_history), (SELECT sum(tbalance) FROM pgbench_tellers), "
    "(SELECT sum(bbalance) FROM pgbench_branches)"
)
SV_FULL, PGBR_FULL, SV_FULL_AFTER = "shardvault-full", "pgbackrest-full", "shardvault-full-after"
SV_RESTORE_CHAIN, SV_RESTORE_FULL = "shardvault-restore-chain", "shardvault-restore-full"
PGBR_RESTORE_CHAIN = "pgbackrest-restore-chain"
WARM_UP = "warm-up restore (untimed: not recorded)"
WARM_UP_BACKUP = "warm-up backup (untimed: not recorded)"


def sv_incr(depth: int) -> str:
    return f"shardvault-incr{depth}"


def pgbr_incr(depth: int) -> str:
    return f"pgbackrest-incr{depth}"


TARGETS = (
    Target("1 % update: ShardVault incremental's data bytes stored ÷ its full's",
           sv_incr(1), SV_FULL, "data_stored_bytes", 0.03),
    Target("1 % update: ShardVault incremental's wall time ÷ its full's",
           sv_incr(1), SV_FULL, "seconds", 0.3),
    Target("10,000 transactions: ShardVault incremental's data bytes stored ÷ pgBackRest "
           "incr's", sv_incr(2), pgbr_incr(2), "data_stored_bytes", 0.3),
    Target("10,000 transactions: ShardVault incremental's bytes stored, all (data, WAL, block "
           "map, manifest) ÷ pgBackRest incr's (files, manifest, WAL)",
           sv_incr(2), pgbr_incr(2), "stored_bytes", 0.3),
    Target("ShardVault restore of the chain (full + 6) ÷ its restore of a full of the same data",
           SV_RESTORE_CHAIN, SV_RESTORE_FULL, "seconds", 1.2),
    Target("ShardVault restore of the chain ÷ pgBackRest's restore of its 6th incr",
           SV_RESTORE_CHAIN, PGBR_RESTORE_CHAIN, "seconds", 1.0),
)  # fmt: skip


say = bvp.say


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bvp.add_environment_arguments(parser)
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="per round only a ShardVault full, the 1 %% update, an incremental and its "
        "restore: the agents' peak memory (e.g. --scale 300 --runs 1)",
    )
    # backup_vs_peers' setup also makes the s3transfer controls' clients; none run here.
    parser.set_defaults(s3_chunk_mib=8, s3_concurrency=4, s3_signed_payload=False)
    args = parser.parse_args(argv)
    bvp.check_environment_arguments(parser, args)
    return args


# --- the changes (not timed) --------------------------------------------------------------------
def wal_lsn(pg: PostgresInstance) -> str:
    return pg.psql("SELECT pg_current_wal_lsn()")


def wal_since(pg: PostgresInstance, lsn: str) -> int:
    return int(pg.psql(f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn}')"))


def contiguous_update(pg: PostgresInstance, scale: int, nth: int) -> dict[str, Any]:
    """The ``nth`` (0-based) 1 % update of a round: one contiguous range of account ids."""
    rows = scale * ROWS_PER_SCALE
    width = max(1, int(rows * UPDATE_FRACTION))
    first = 1 + int(rows * UPDATE_AT[nth % len(UPDATE_AT)])
    pg.psql(
        "UPDATE pgbench_accounts SET abalance = abalance + 1 "
        f"WHERE aid BETWEEN {first} AND {first + width - 1}"
    )
    return {"first_aid": first, "rows": width}


def pgbench_transactions(pg: PostgresInstance) -> dict[str, Any]:
    """pgbench's default script, ``PGBENCH_ARGS``; returns its throughput."""
    client = ["-h", str(pg.socket_dir), "-p", str(pg.port), "-U", "postgres"]
    cmd = [str(pg.bin_dir / "pgbench"), *PGBENCH_ARGS, *client, "postgres"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd="/", check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed: {done.stdout}{done.stderr}")
    processed = re.search(r"number of transactions actually processed: (\d+)", done.stdout)
    tps = re.search(r"tps = ([\d.]+)", done.stdout)
    return {
        "transactions": int(processed[1]) if processed else None,
        "tps": float(tps[1]) if tps else None,
    }


def apply_change(bench: bvp.Bench, change: str, nth: int) -> dict[str, Any]:
    """Makes the change, then a checkpoint; returns what it did and the WAL it wrote."""
    started, lsn = time.monotonic(), wal_lsn(bench.pg)
    if change == UPDATE:
        done = contiguous_update(bench.pg, bench.args.scale, nth)
    else:
        done = pgbench_transactions(bench.pg)
    bench.pg.psql("CHECKPOINT")
    return {
        "change": change,
        **done,
        "wal_bytes": wal_since(bench.pg, lsn),
        "seconds": round(time.monotonic() - started, 1),
    }


def source_values(instance: PostgresInstance) -> dict[str, str]:
    """Values that differ unless the data equals the source's at the backup (see the module
    docstring)."""
    accounts, history, tellers, branches = instance.psql(SOURCE_VALUES).split("|")
    return {"accounts": accounts, "history": history, "tellers": tellers, "branches": branches}


# --- timed runs ---------------------------------------------------------------------------------
def measure(
    bench: bvp.Bench,
    runs: dict[str, list[dict[str, Any]]],
    name: str,
    rnd: int,
    run: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Settles the machine (as ``backup_vs_peers.run_round``), runs ``run``, records it."""
    quiet = bvp.quiet_agents(bench)
    bvp.settle(bench)
    load = os.getloadavg()[0]
    result = run() | {"round": rnd, "load_before": load} | quiet
    if name.startswith("shardvault") or name in (WARM_UP, WARM_UP_BACKUP):  # ShardVault's too
        bench.agents_busy_until = time.monotonic() + bench.busy_window
    runs.setdefault(name, []).append(result)
    stored = result.get("stored_bytes")
    stored_text = "" if stored is None else f", {stored / MiB:,.2f} MiB stored"
    data = result.get("data_stored_bytes")
    data_text = "" if data is None else f" ({data / MiB:,.2f} MiB data)"
    say(f"  {name}: {result['seconds']:.1f} s{stored_text}{data_text} (load {load:.2f})")
    return result


def scanned_bytes(bench: bvp.Bench, manifest: Manifest) -> int:
    """What an incremental's scan read: its stream but the files it found unchanged."""
    record = bench.stack.services().catalog.get(bvp.CLUSTER, manifest.backup_id)
    if record is None or record.data_read_bytes is None:
        raise RuntimeError(f"backup {manifest.backup_id} records no data_read_bytes")
    return record.data_read_bytes


def phases(spans: list[tuple[str, float, float]], end: float) -> dict[str, float]:
    """Seconds per phase of a backup (see the module docstring); they add up to its time."""
    first: dict[str, tuple[float, float]] = {}
    for name, entered, exited in spans:
        first.setdefault(name, (entered, exited))
    # A backup of one node flushes in its Checkpoint command: no Flush state.
    flushed = first["Flush"][1] if "Flush" in first else first["Checkpoint"][0]
    checkpoint, plan = first["Checkpoint"][1], first["PlanData"][1]
    # A lone node's incremental stops in its Checkpoint command: no Stop, every upload a tail's.
    stop = first["Stop"][0] if "Stop" in first else -math.inf
    data_upload = [s for s in spans if s[0] == "Upload" and s[2] <= stop]
    uploaded = data_upload[0][2] if data_upload else plan
    release = first["Release"][0]
    return {
        "checkpoint": flushed,
        "scan": checkpoint - flushed,
        "plan": plan - checkpoint,
        "upload": uploaded - plan,
        "tail": release - uploaded,
        "finalize": end - release,
    }


def agent_scan_seconds(bench: bvp.Bench, backup_id: str) -> float | None:
    """The agent's own ``scan_seconds`` for the shard, from the data listing in the work
    bucket (None if the listing is gone)."""
    svc = bench.stack.services()
    key = svc.work_key(backup_id, "listings", Phase.DATA, f"{bvp.SHARD_ID}.json")
    try:
        return svc.get_work(key).get("scan_seconds")
    except ClientError:  # a listing gone (expired) only loses this figure
        return None


def shardvault_split(bench: bvp.Bench, backup: bvp.ShardVaultBackup) -> dict[str, Any]:
    """A ShardVault backup's bytes by stream (data, WAL tail, block map, manifest), what it
    read, and where its time went."""
    manifest = backup.manifest
    data = bvp.stream_of(manifest, Phase.DATA)
    tail = bvp.stream_of(manifest, Phase.TAIL)
    maps = [shard.blockmap for shard in manifest.shards if shard.blockmap]
    stream_bytes = sum(f.size for f in data.files)
    data_bytes = sum(o.length for o in data.objects)
    tail_bytes = sum(o.length for o in tail.objects)
    blockmap_stored = sum(o.stored_bytes for o in maps)
    spans, end = report.state_spans(ops.execution_history(backup.arn), bvp.TOP_LEVEL_STATES)
    states = report.state_seconds(spans)
    commands = report.agent_commands(bench.agent_log.read_text(), manifest.backup_id)
    return {
        "kind": manifest.kind.value,
        "depth": manifest.chain.depth if manifest.chain else 0,
        "root_id": manifest.chain.root_id if manifest.chain else manifest.backup_id,
        "stream_bytes": stream_bytes,
        "data_bytes": data_bytes,
        "data_stored_bytes": sum(o.stored_bytes for o in data.objects),
        "wal_bytes": tail_bytes,
        "wal_stored_bytes": sum(o.stored_bytes for o in tail.objects),
        "blockmap_bytes": sum(o.length for o in maps),
        "blockmap_stored_bytes": blockmap_stored,
        "index_stored_bytes": blockmap_stored + backup.result["stored_manifest_bytes"],
        # An incremental's scan reads the files that changed since its parent (the catalog's
        # data_read_bytes), its pack the delta; a full's pack reads the stream once and
        # hashes it.
        "bytes_read": (scanned_bytes(bench, manifest) if manifest.chain else 0)
        + data_bytes
        + tail_bytes,
        "phases": phases(spans, end),
        "states": states,
        "scan_seconds": agent_scan_seconds(bench, manifest.backup_id),
        "scan_command_seconds": sum(
            c["end"] - c["start"] for c in commands if c["command"] == "checkpoint"
        ),
        "scan_state_seconds": states.get("Checkpoint"),
        "agent": report.agent_split(commands),
    }


def shardvault_backup(bench: bvp.Bench, incremental: bool, depth: int) -> dict[str, Any]:
    """A timed ShardVault backup that must be of the expected kind and depth (an incremental
    silently made as a full would measure the wrong thing)."""
    backup = bvp.shardvault_backup(
        bench, BackupRequest(cluster=bvp.CLUSTER, incremental=incremental)
    )
    split = shardvault_split(bench, backup)
    want = BackupKind.INCREMENTAL if incremental else BackupKind.FULL
    if (split["kind"], split["depth"]) != (want.value, depth):
        raise RuntimeError(
            f"ShardVault backup {backup.manifest.backup_id} is a {split['kind']} at depth "
            f"{split['depth']}, not a {want.value} at depth {depth}: the chain broke."
        )
    return backup.result | split | {"prefix": backup.prefix}


def pgbackrest_split(bench: bvp.Bench, label: str) -> dict[str, Any]:
    """pgBackRest's backup ``label``: its files, manifest and WAL in the bucket."""
    stored = bvp.pgbackrest_stored(bench, label)
    keys = list_keys(bench.tls_s3, PGBACKREST_BUCKET, bench.pgbackrest.backup_prefix(label))
    manifest = sum(obj["Size"] for obj in keys if PGBACKREST_MANIFEST.search(obj["Key"]))
    return stored | {
        "data_stored_bytes": stored["stored_backup_path_bytes"] - manifest,
        "wal_stored_bytes": stored["stored_wal_bytes"],
        "index_stored_bytes": manifest,
    }


def pgbackrest_backup(bench: bvp.Bench, backup_type: str, prior: str | None) -> dict[str, Any]:
    """A timed pgBackRest backup; an incr must continue ``prior``."""
    minio_before = process_cpu(bench.tls_minio.process.pid)
    result = bench.pgbackrest.backup(backup_type)
    minio_cpu = process_cpu(bench.tls_minio.process.pid) - minio_before
    info = next(b for b in bench.pgbackrest.info()["backup"] if b["label"] == result["label"])
    if info["type"] != backup_type or (prior and info.get("prior") != prior):
        raise RuntimeError(
            f"pgBackRest's backup {result['label']} is a {info['type']} of "
            f"{info.get('prior')}, not a {backup_type} of {prior}."
        )
    return (
        result
        | pgbackrest_split(bench, result["label"])
        | {
            "bytes_read": result["delta_bytes"],
            "data_bytes": result["delta_bytes"],
            "minio_cpu_seconds": round(minio_cpu, 2),
        }
    )


def checked_restore(result: dict[str, Any], source: dict[str, str]) -> dict[str, Any]:
    """The restore's result with ``data_matches``: every restored shard's values equal the
    source's."""
    checked = result.get("checked", {})
    matches = bool(checked) and all(values == source for values in checked.values())
    if not matches:
        say(f"  RESTORED DATA DIFFERS from the source: {result.get('checked')} vs {source}")
    return result | {"source_values": source, "data_matches": matches}


def shardvault_restore(
    bench: bvp.Bench, backup: dict[str, Any], source: dict[str, str]
) -> dict[str, Any]:
    """ShardVault's restore of ``backup`` (its backup run's result). ``bytes`` is what the
    restore wrote, the backup's data and tail streams (the restore summary's ``bytes`` and
    ``objects`` are the restored backup's own: for an incremental its delta, not its chain's;
    kept as ``summary_bytes`` and ``summary_objects``)."""
    request = RestoreRequest(
        cluster=bvp.CLUSTER,
        target_cluster=bvp.RESTORE_CLUSTER,
        backup_id=backup["backup_id"],
        replace=True,
    )
    result = bvp.shardvault_restore(bench, request, source_values)
    written = backup["stream_bytes"] + backup["wal_bytes"]
    summary = {"summary_bytes": result["bytes"], "summary_objects": result["objects"]}
    commands = report.agent_commands(bench.restore_agent_log.read_text(), result["restore_id"])
    split = restore_commands(commands, backup["root_id"])
    return checked_restore(result | summary | split | {"bytes": written}, source)


def restore_commands(commands: list[dict[str, Any]], root_id: str) -> dict[str, Any]:
    """The restore agent's commands (its log): prepare, finish, and the downloads, their
    times summed over the objects of the chain's root (the full) and of its incrementals (the
    restored backup's tail among them)."""
    downloads = [c for c in commands if c["command"] == "download"]
    root, incrementals = 0.0, 0.0
    for command in downloads:
        seconds = command["end"] - command["start"]
        # <prefix>/<cluster>/<backup id>/<shard>/<object>
        if command["key"].split("/")[-3] == root_id:
            root += seconds
        else:
            incrementals += seconds
    seconds = {c["command"]: c["end"] - c["start"] for c in commands if c["command"] != "download"}
    return {
        "download_objects": len(downloads),
        "download_wall": report.busy_seconds([(c["start"], c["end"]) for c in downloads]),
        "download_sum_root": root,
        "download_sum_incrementals": incrementals,
        "prepare_seconds": seconds.get("prepare_restore"),
        "finish_seconds": seconds.get("finish_restore"),
    }


def pgbackrest_restore(bench: bvp.Bench, label: str, source: dict[str, str]) -> dict:
    return checked_restore(bvp.pgbackrest_restore(bench, label, source_values), source)


# --- rounds -------------------------------------------------------------------------------------
@dataclass
class Chain:
    """What one round made: ShardVault's backups (their runs' results) and pgBackRest's
    labels, in order."""

    index: int
    sv_backups: list[dict[str, Any]] = field(default_factory=list)  # their results
    pgbr_labels: list[str] = field(default_factory=list)


def sv_step(
    bench: bvp.Bench, runs: dict, chain: Chain, name: str, depth: int, extra: dict | None = None
) -> dict[str, Any]:
    """A timed ShardVault backup of the chain: a full at depth 0, else an incremental."""
    result = measure(
        bench, runs, name, chain.index,
        lambda: shardvault_backup(bench, depth > 0, depth) | (extra or {}),
    )  # fmt: skip
    chain.sv_backups.append(result)
    return result


def pgbr_step(
    bench: bvp.Bench, runs: dict, chain: Chain, name: str, depth: int, extra: dict | None = None
) -> dict[str, Any]:
    """A timed pgBackRest backup of the chain: a full at depth 0, else an incr of the last."""
    backup_type, prior = ("incr", chain.pgbr_labels[-1]) if depth else ("full", None)
    result = measure(
        bench, runs, name, chain.index,
        lambda: pgbackrest_backup(bench, backup_type, prior) | (extra or {}),
    )  # fmt: skip
    chain.pgbr_labels.append(result["label"])
    return result


def change_then_backups(
    bench: bvp.Bench, runs: dict, chain: Chain, depth: int, with_peer: bool = True
) -> None:
    """Change ``depth`` of the chain, then each tool's incremental of it."""
    change = CHANGES[depth - 1]
    done = apply_change(bench, change, CHANGES[: depth - 1].count(change))
    say(f"  change {depth}: {done}")
    sv_step(bench, runs, chain, sv_incr(depth), depth, {"change": done})
    if with_peer:
        pgbr_step(bench, runs, chain, pgbr_incr(depth), depth, {"change": done})


def run_round(bench: bvp.Bench, chain: Chain, runs: dict) -> None:
    """Full, six changes each followed by both tools' incrementals, a ShardVault full of the
    end state, then the three restores (see the module docstring)."""
    sv_step(bench, runs, chain, SV_FULL, 0)
    pgbr_step(bench, runs, chain, PGBR_FULL, 0)
    for depth in range(1, len(CHANGES) + 1):
        change_then_backups(bench, runs, chain, depth)
    sv_chain_end, pgbr_chain_end = chain.sv_backups[-1], chain.pgbr_labels[-1]
    # The full of the same data is taken before anything reads the tables: a read sets hint
    # bits and prunes pages (PostgreSQL writes both, logged as full pages with checksums on),
    # so a full taken after the reads below would hold different pages, which its restore's
    # recovery and pg_amcheck would not have to hint and prune as the chains' restores do.
    full = sv_step(bench, runs, chain, SV_FULL_AFTER, 0)
    source = source_values(bench.pg)  # no write since both 6th incrementals and the full
    say(f"  source values: {source}")
    rnd = chain.index
    restores = [
        (SV_RESTORE_CHAIN, lambda: shardvault_restore(bench, sv_chain_end, source)),
        (SV_RESTORE_FULL, lambda: shardvault_restore(bench, full, source)),
        (PGBR_RESTORE_CHAIN, lambda: pgbackrest_restore(bench, pgbr_chain_end, source)),
    ]
    measure(bench, {}, WARM_UP, rnd, lambda: shardvault_restore(bench, full, source))
    turn = (rnd - 1) % len(restores)
    for name, restore in restores[turn:] + restores[:turn]:
        measure(bench, runs, name, rnd, restore)


def run_memory_round(bench: bvp.Bench, chain: Chain, runs: dict) -> None:
    """A ShardVault full, the 1 % update, an incremental, and the restore of it."""
    sv_step(bench, runs, chain, SV_FULL, 0)
    change_then_backups(bench, runs, chain, 1, with_peer=False)
    source = source_values(bench.pg)
    last = chain.sv_backups[-1]
    measure(
        bench, runs, SV_RESTORE_CHAIN, chain.index, lambda: shardvault_restore(bench, last, source)
    )


def clean_up_round(bench: bvp.Bench, chain: Chain) -> None:
    """Deletes the round's ShardVault backups and expires pgBackRest's earlier rounds' (disk
    space; not timed). pgBackRest never expires its newest backup with --set, so this round's
    chain stays until the next round ends; expiring a full expires its incrs with it."""
    for backup in chain.sv_backups:
        delete_prefix(bench.store_s3, bench.store_bucket, backup["prefix"])
    for backup in bench.pgbackrest.info()["backup"]:
        if backup["type"] == "full" and backup["label"] not in chain.pgbr_labels:
            bench.pgbackrest.expire(backup["label"])


def warm_up_backup(bench: bvp.Bench) -> None:
    """One ShardVault full before the rounds, not recorded, then deleted (see the module
    docstring: the local stack's first backup pays its start-up)."""
    result = measure(bench, {}, WARM_UP_BACKUP, 0, lambda: shardvault_backup(bench, False, 0))
    delete_prefix(bench.store_s3, bench.store_bucket, result["prefix"])


def run_rounds(bench: bvp.Bench) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    if not bench.args.memory_only:
        warm_up_backup(bench)
    for index in range(1, bench.args.runs + 1):
        say(f"round {index} of {bench.args.runs}")
        chain = Chain(index)
        (run_memory_round if bench.args.memory_only else run_round)(bench, chain, runs)
        clean_up_round(bench, chain)
    return runs


# --- summary ------------------------------------------------------------------------------------
BYTE_KEYS = (
    "bytes_read",
    "data_stored_bytes",
    "wal_stored_bytes",
    "blockmap_stored_bytes",
    "index_stored_bytes",
    "stored_bytes",
    "data_bytes",
    "stream_bytes",
    "scan_seconds",
    "scan_command_seconds",
    "scan_state_seconds",
    "client_cpu_seconds",
    "bytes",
)


def label(name: str) -> str:
    if name.startswith("shardvault-incr") or name.startswith("pgbackrest-incr"):
        depth = int(name.rsplit("incr", 1)[1])
        tool = "ShardVault incremental" if name.startswith("shardvault") else "pgBackRest incr"
        return f"{tool} {depth} (after {CHANGE_TEXT[CHANGES[depth - 1]]})"
    return {
        SV_FULL: "ShardVault full",
        PGBR_FULL: "pgBackRest full",
        SV_FULL_AFTER: "ShardVault full of the chain's end state",
        SV_RESTORE_CHAIN: "ShardVault restore of its last incremental (the chain)",
        SV_RESTORE_FULL: "ShardVault restore of the full of the same data",
        PGBR_RESTORE_CHAIN: "pgBackRest restore of its 6th incr",
    }[name]


# Prepare: a chain's includes fetching its newer members' objects (prefetched); Download: the
# root's objects with the newer blocks laid in, and the WAL (a full's: all of its objects).
RESTORE_STATES = ("Validate", "Plan", "Thaw", "Prepare", "Download", "Finish")
RESTORE_COMMANDS = (
    "download_objects",
    "download_wall",
    "download_sum_root",
    "download_sum_incrementals",
    "agent_cpu_seconds",
    "control_plane_cpu_seconds",
)


def median_or_none(tool_runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run.get(key) for run in tool_runs]
    return None if any(v is None for v in values) else statistics.median(values)


def tool_summary(name: str, tool_runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": label(name),
        "seconds": report.spread([run["seconds"] for run in tool_runs]),
        **{key: median_or_none(tool_runs, key) for key in BYTE_KEYS},
    }
    if "phases" in tool_runs[0]:
        out["phases"] = {
            phase: statistics.median(run["phases"][phase] for run in tool_runs)
            for phase in tool_runs[0]["phases"]
        }
        out["agent"] = {
            key: statistics.median(run["agent"][key] for run in tool_runs)
            for key in tool_runs[0]["agent"]
        }
    if "data_matches" in tool_runs[0]:
        out["data_matches"] = all(run["data_matches"] for run in tool_runs)
    if "data_matches" in tool_runs[0] and "states" in tool_runs[0]:  # ShardVault's restores
        out["states"] = {
            state: statistics.median(run["states"].get(state, 0.0) for run in tool_runs)
            for state in RESTORE_STATES
        }
        out["commands"] = {key: median_or_none(tool_runs, key) for key in RESTORE_COMMANDS}
    return out


def pair(runs: dict, mine: str, theirs: str, key: str) -> dict[str, Any] | None:
    """``mine``'s ``key`` ÷ ``theirs``': of the medians, and per round."""
    if not (runs.get(mine) and runs.get(theirs)):
        return None
    return {
        "of_medians": report.median_of(runs[mine], key) / report.median_of(runs[theirs], key),
        "per_round": report.pair_ratios(runs[mine], runs[theirs], key),
    }


def step_ratios(runs: dict) -> list[dict[str, Any]]:
    """Per backup of the chain (the full, then each incremental): ShardVault ÷ pgBackRest for
    time, data stored and all stored; and ShardVault's own time and data against its full."""
    steps = [(0, SV_FULL, PGBR_FULL, "full")]
    steps += [
        (depth, sv_incr(depth), pgbr_incr(depth), CHANGE_TEXT[change])
        for depth, change in enumerate(CHANGES, start=1)
    ]
    return [
        {
            "depth": depth,
            "change": change,
            "seconds_vs_peer": pair(runs, mine, theirs, "seconds"),
            "data_vs_peer": pair(runs, mine, theirs, "data_stored_bytes"),
            "stored_vs_peer": pair(runs, mine, theirs, "stored_bytes"),
            "seconds_vs_full": pair(runs, mine, SV_FULL, "seconds") if depth else None,
            "data_vs_full": pair(runs, mine, SV_FULL, "data_stored_bytes") if depth else None,
        }
        for depth, mine, theirs, change in steps
        if runs.get(mine) and (depth or runs.get(theirs))  # a full only beside pgBackRest's
    ]


def memory_results(runs: dict) -> list[dict[str, Any]]:
    """The agents' peak RSS (VmHWM over the whole run) against ``MEMORY_LIMIT``."""
    out = []
    for who, names in (
        ("backup agent", [n for n in runs if n.startswith("shardvault") and "restore" not in n]),
        ("restore agent", [n for n in runs if n.startswith("shardvault-restore")]),
    ):
        peaks = [run["agent_peak_rss"] for n in names for run in runs[n]]
        if peaks:
            peak = max(peaks)
            out.append({"agent": who, "peak_rss": peak, "held": peak < MEMORY_LIMIT})
    return out


def summarize(runs: dict) -> dict[str, Any]:
    return {
        "tools": {name: tool_summary(name, tool_runs) for name, tool_runs in runs.items()},
        "targets": report.target_results(runs, TARGETS),
        "steps": step_ratios(runs),
        "memory": memory_results(runs),
    }


# --- Markdown -----------------------------------------------------------------------------------
def _mib(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value / MiB:,.{digits}f}"


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


STORED_KEYS = ("data_stored_bytes", "wal_stored_bytes", "index_stored_bytes", "stored_bytes")


def backups_table(summary: dict[str, Any]) -> str:
    rows = [
        "| backup | wall s min / median / max | MiB read | MiB of data sent (plaintext) | "
        "MiB stored: data | WAL | block map + manifest | all | scan s (agent; command; state) "
        "| client CPU s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for info in summary["tools"].values():
        if "data_matches" in info:
            continue
        scan = (
            "—"
            if info["scan_seconds"] is None
            else f"{info['scan_seconds']:.1f}; {info['scan_command_seconds']:.1f}; "
            f"{info['scan_state_seconds']:.1f}"
        )
        cells = [
            info["label"],
            report.spread_text(info["seconds"], 1),
            _mib(info["bytes_read"], 0),
            _mib(info["data_bytes"], 1),
            *(_mib(info[key], 2) for key in STORED_KEYS),
            scan,
            _s(info["client_cpu_seconds"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def restores_table(summary: dict[str, Any]) -> str:
    rows = [
        "| restore (+ recovery, start, pg_amcheck) | wall s min / median / max | MiB written | "
        "restored values = source's (every round) |",
        "| --- | --- | --- | --- |",
    ]
    rows += [
        f"| {info['label']} | {report.spread_text(info['seconds'], 1)} | "
        f"{_mib(info['bytes'], 0)} | "
        f"{'yes' if info['data_matches'] else 'NO'} |"
        for info in summary["tools"].values()
        if "data_matches" in info
    ]
    return "\n".join(rows)


def _ratio(result: dict[str, Any] | None, digits: int = 2) -> str:
    if not result:
        return "—"
    return f"{result['of_medians']:.{digits}f} ({report.spread_text(result['per_round'], digits)})"


def steps_table(summary: dict[str, Any]) -> str:
    rows = [
        "| backup | ShardVault ÷ pgBackRest: wall time | data stored | all stored | "
        "ShardVault incremental ÷ its full: wall time | data stored |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows += [
        f"| {s['depth']}: {s['change']} | {_ratio(s['seconds_vs_peer'])} | "
        f"{_ratio(s['data_vs_peer'], 3)} | {_ratio(s['stored_vs_peer'], 3)} | "
        f"{_ratio(s['seconds_vs_full'])} | {_ratio(s['data_vs_full'], 3)} |"
        for s in summary["steps"]
    ]
    return "\n".join(rows)


def targets_table(summary: dict[str, Any]) -> str:
    rows = report.target_rows(summary, digits=3)
    rows += [
        f"| {m['agent']} peak RSS (VmHWM, whole run) | {m['peak_rss'] / 10**6:.0f} MB "
        f"({m['peak_rss'] / MiB:.0f} MiB) | — | < {MEMORY_LIMIT // 10**6} MB | "
        f"{'yes' if m['held'] else 'no'} |"
        for m in summary["memory"]
    ]
    rows += [
        f"| {info['label']}: restored values = source's | — | — | equal | "
        f"{'yes, every round' if info['data_matches'] else 'NO'} |"
        for info in summary["tools"].values()
        if "data_matches" in info
    ]
    return "\n".join(rows)


def time_split_table(summary: dict[str, Any]) -> str:
    """ShardVault's phases (medians) for each of its backups."""
    shardvault = {k: v for k, v in summary["tools"].items() if "phases" in v}
    names = list(next(iter(shardvault.values()))["phases"]) if shardvault else []
    rows = [
        "| ShardVault backup (medians, s) | "
        + " | ".join(names)
        + " | agent: checkpoint + scan command | agent: pack wall | agent: upload wall |",
        "| --- |" + " --- |" * (len(names) + 3),
    ]
    for info in shardvault.values():
        agent = info["agent"]
        rows.append(
            f"| {info['label']} | "
            + " | ".join(f"{info['phases'][n]:.2f}" for n in names)
            + f" | {info['scan_command_seconds']:.2f} | {agent['pack_wall']:.2f} | "
            f"{agent['upload_wall']:.2f} |"
        )
    return "\n".join(rows)


def restore_split_table(summary: dict[str, Any]) -> str:
    """ShardVault's restores by state of the execution, the restore agent's download
    commands and the CPU (medians)."""
    restores = [info for info in summary["tools"].values() if "states" in info]
    rows = [
        "| ShardVault restore (medians, s) | "
        + " | ".join(RESTORE_STATES)
        + " | download commands: objects; wall; summed, root full's objects; incrementals' "
        "| CPU s: restore agent; control plane |",
        "| --- |" + " --- |" * (len(RESTORE_STATES) + 2),
    ]
    for info in restores:
        c = info["commands"]
        rows.append(
            f"| {info['label']} | "
            + " | ".join(f"{info['states'][state]:.2f}" for state in RESTORE_STATES)
            + f" | {c['download_objects']:.0f}; {c['download_wall']:.2f}; "
            f"{c['download_sum_root']:.2f}; {c['download_sum_incrementals']:.2f} | "
            f"{c['agent_cpu_seconds']:.1f}; {c['control_plane_cpu_seconds']:.1f} |"
        )
    return "\n".join(rows)


def markdown(summary: dict[str, Any]) -> str:
    parts = [
        "Backups:\n\n" + backups_table(summary),
        "Restores:\n\n" + restores_table(summary),
        "Targets (issue 10):\n\n" + targets_table(summary),
    ]
    if summary["steps"]:
        parts.append(
            "Ratios per backup of the chain (of the medians; in brackets min / median / max per "
            "round):\n\n" + steps_table(summary)
        )
    parts.append("Where ShardVault's time goes:\n\n" + time_split_table(summary))
    parts.append(restore_split_table(summary))
    return "\n\n".join(parts) + "\n"


# --- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    avoid_empty_put_stall()
    signal.signal(signal.SIGTERM, bvp._terminate)
    started = time.time()
    with contextlib.ExitStack() as cleanup:
        root = bvp.make_workdir(args, cleanup)
        bench = bvp.setup(args, root, cleanup)
        say(f"setup done in {time.time() - started:.0f} s: {bench.setup}")
        runs = run_rounds(bench)
        summary = summarize(runs)
        text = markdown(summary)
        path = bvp.write_results(
            bench, runs, summary, started, name="incremental_vs_peers", markdown=text
        )
        say("stopping everything")
    print(text)
    print(f"Raw results: {path}; benchmark wall time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
