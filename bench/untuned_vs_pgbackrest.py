"""ShardVault against pgBackRest 2.59.1 as its users run it, on a dataset nobody tuned for, in
one run on one machine (issue 47): fulls, incrementals, a synthesized full, and restores to a
validated server, rounds alternating which tool goes first.

Usage::

    PYTHONPATH=.:agents:bench .venv/bin/python bench/untuned_vs_pgbackrest.py \\
        [--scale-gb 2.7] [--runs 3] [--pgbackrest-bin /opt/pgbackrest-2.59.1/bin/pgbackrest] \\
        [--pgbench-seconds 30] [--out bench/results]

Terms:

* *environment*: ``backup_vs_peers.py``'s, set up by its code (``setup``): one PostgreSQL 15
  (``initdb --data-checksums``, ``wal_level=replica``, ``shared_buffers=512MB``, WAL archived
  by pgBackRest's ``archive-push``), the local stack (moto's Step Functions running the real
  ASL, the Lambda handlers in this process, MinIO as the store) with one source agent and one
  restore-target agent, and pgBackRest's own MinIO over TLS. Two things differ: the data and
  pgBackRest's configuration (below).
* *dataset*: ``untuned.py``'s, built by ``untuned.build`` at ``--scale-gb`` (default 2.7 GB of
  tables with their TOAST and indexes): TOAST-heavy jsonb documents, random hex text, a
  list-partitioned table, an UNLOGGED table, and pgbench (scale 30 at the default) in a
  second database; ``VACUUM (FREEZE, ANALYZE)`` and a ``CHECKPOINT`` at its end.
* *pgBackRest*: the binary of ``--pgbackrest-bin`` (default ``$PGBACKREST_BIN``, else
  ``/opt/pgbackrest-2.59.1/bin/pgbackrest``), configured by ``peers.PgBackRest.as_users_run_it``:
  ``compress-type=zst`` at its default level (3), ``process-max=2``, ``repo1-bundle=y``,
  ``repo1-block=y``, ``start-fast=y``; the same binary is the server's ``archive_command``.
* *policy*: the bench cluster's entry in a policy file of the work directory, which the
  stack's ``settings.policy_file`` is pointed at: ``engine: postgres``, a vault at GLACIER_IR
  (GOVERNANCE lock for a day; no thaw), ``incremental: {synthesized_fulls: 1}``, and the
  defaults otherwise (zstd level ``DEFAULT_COMPRESSION_LEVEL``, not encrypted). By default
  the stack has no vault (``settings.vault_url`` unset), so the policy's vault is not used:
  both tools back up into and restore from MinIO. With ``--vault`` every ShardVault backup's
  execution ends with its promotion (the Promote state: a copy from the store, MinIO, into
  the vault, moto's S3 in this process), after its record turned COMPLETE; and ShardVault's
  restores of promoted backups read the vault.
* *standard change*: ``untuned.change(nth=...)``: 1 % of ``notes`` rewritten as one id range
  (where it starts turns with ``nth``), 500 documents inserted or replaced, ``pgbench -n -c 4
  -j 2 -T --pgbench-seconds`` (30) in the second database, a ``CHECKPOINT``. Round ``r`` makes
  changes ``nth = 2r - 2`` (step 2) and ``2r - 1`` (step 3).
* *source values*: ``untuned.values`` of the source (per table, rows and an order-independent
  hash), taken right before the backups they belong to and after the change they follow,
  then a ``CHECKPOINT`` (untimed): reading rows written since the last vacuum sets their hint
  bits, so each backup after a change holds the change and the hints of its rows, alike for
  both tools and for the incremental and the synthesized full.
* *settled*: before each timed run, as ``backup_vs_peers.py``: both agents back at their idle
  poll rate, WAL archiving caught up, ``sync``.
* *warm-ups* (untimed, not recorded; ``incremental_vs_peers.py``'s): one ShardVault full
  before the first round, deleted from the store (the local stack's first backup pays its
  start-up); and, in each round before the timed restores, ShardVault's restore of the round's
  read full (the host takes back guest memory left free for long).

Each round (``--runs``, default 3; the tool that goes first alternates: ShardVault in odd
rounds, pgBackRest in even ones):

1. *full*: source values, then ShardVault's read full (``read_full``, whatever the policy) and
   ``pgbackrest backup --type=full``.
2. the standard change, source values, then ShardVault's incremental (of the read full) and
   ``pgbackrest backup --type=incr``.
3. the standard change again (the next ``nth``), source values, then ShardVault's
   *synthesized full*: a full request that the policy makes synthesized (its node scans and
   sends only the changes since the incremental, and the ``Synthesize`` state copies the
   chain's objects into it inside the store). The run fails unless its record says
   ``synthesized_from`` (else it was read, and its ``full_reason`` says why). pgBackRest has
   nothing to compare with here: it is compared with ShardVault's own incremental of step 2
   (the same kind of change, on the same data).
4. *restores*, each into an empty directory, timed to a recovered, running server that passed
   ``pg_amcheck --all --heapallindexed``: ShardVault's restores of the read full (step 1) and
   of the synthesized full (step 3), its restore request asking ``heapallindexed`` (its
   default is off), timed from ``start_restore`` to the execution's end (the agent's own
   checks, ``pg_amcheck`` included, before it reports success); pgBackRest's restore of its
   newest backup (the incr of step 2: its full and that incr), ``--type=immediate`` then
   promote, timed from the command's start to ``pg_amcheck --all --heapallindexed``'s
   success (``backup_vs_peers.pgbackrest_restore``). Odd rounds in that order, even rounds
   in the reverse one. After each (untimed), the restored server's values are compared with
   the source values of the backup's step; the run fails on a difference (after the
   round's three restores, once the results measured so far are written).

Measured, per backup:

* *wall time*: pgBackRest, the command's start to its exit. ShardVault, from ``start_backup``
  to its record turning COMPLETE (the catalog's ``completed_at``, written by Finalize once
  the manifest is; ``seconds``, compared with pgBackRest's), and to the execution's end
  (``execution_end_seconds``: the vault promotion too). The record's own
  ``duration_seconds`` (from admission to COMPLETE) is kept as ``catalog_duration_seconds``.
* *stored bytes*: ShardVault, the catalog's ``stored_bytes`` (data, WAL tail and block map
  objects; equal to the manifest's and to a listing of the store, else the run fails:
  ``backup_vs_peers.shardvault_stored``); pgBackRest, its backup path in the bucket plus the
  archived WAL the backup needs (``backup_vs_peers.pgbackrest_stored``).
* *client CPU*: pgBackRest, the CPU of its processes (the command and its workers);
  ShardVault, the CPU of the agent process from ``start_backup`` to the end of the agent's
  last command of the backup (sampled every 0.1 s on a thread: ``CpuTrace``). The control
  plane (this process: moto and the Lambda handlers) runs off the host on AWS and is not
  counted (it is kept in the JSON). *CPU-s per GB read* (fulls): that CPU over the GB (10^9
  bytes) of database files the full read: ShardVault's data stream, pgBackRest's backup size
  (the WAL tail that ShardVault's agent reads and stores, and pgBackRest's ``archive-push``
  outside the backup, is not counted; the agent's CPU for it is).
* *bytes read* (``MiB read``): ShardVault, the data stream and the WAL tail, plus for an
  incremental or a synthesized full its scan (the files changed since the parent, the
  catalog's ``data_read_bytes``) and only the changes as its data stream; pgBackRest, its
  backup's size (a full) or what an incr copied (``delta``).
* *host time* (incremental and synthesized full): what the backup cost the database host:
  the agent's *busy time* (the union of its commands' intervals for that backup: checkpoint,
  scan, packs, uploads, stop, release; from the agent's log) and its CPU as above.
* *synthesized full*: its time to COMPLETE and to the execution's end, its ``Synthesize``
  state's seconds (all of its budgeted calls; run beside Release, so it overlaps the agent's
  release) and their share of the time to COMPLETE, the Promote state's seconds, the objects
  copied (the catalog's ``synthesis_objects``), and its stored bytes split into its own data
  objects (the changes its node sent), the chain's copies, and WAL tail and block map.
* *agent peak RSS*: ``VmHWM`` of the backup agent and of the restore agent (peak since each
  started: over the whole run), against 300 MB.

Figures are given per round and of the medians; every ratio is ShardVault's figure over its
reference's, per round (in round order) and of the medians, against the issue's targets
(``RATIOS``). Raw results go to ``--out`` as JSON, the tables to stdout and beside the JSON as
Markdown (``untuned_vs_pgbackrest-<UTC time>``; a failed run writes what it measured as
``untuned_vs_pgbackrest-failed-<UTC time>`` first). Everything started is stopped and the work
directory removed on the way out (an ExitStack), also on failure, Ctrl-C or SIGTERM
(``--keep`` keeps the directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import backup_vs_peers as bvp
import boto3
import incremental_vs_peers as ivp
import report
import untuned
from peers import PGBACKREST_BIN_ENV, PgBackRest, avoid_empty_put_stall, process_cpu
from report import MiB

from shardvault.client import operations as ops
from shardvault.config.policy import load_policy
from shardvault.contracts.models import BackupKind, BackupRequest, Phase, RestoreRequest

NAME = "untuned_vs_pgbackrest"
DEFAULT_PGBACKREST = "/opt/pgbackrest-2.59.1/bin/pgbackrest"
GB = 10**9
MEMORY_LIMIT = ivp.MEMORY_LIMIT  # the "< 300 MB" of agent peak RSS
VAULT = "{storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}"
POLICY = (
    "version: 1\n"
    "clusters:\n"
    f"  {bvp.CLUSTER}:\n"
    "    engine: postgres\n"
    "    schedule: {full: '0 2 * * 0', incremental: '0 2 * * 1-6'}\n"
    f"    vault: {VAULT}\n"
    "    retention: {keep_daily: 7}\n"
    "    incremental: {synthesized_fulls: 1}\n"
)

SV_FULL, PGBR_FULL = "shardvault-full", "pgbackrest-full"
SV_INCR, PGBR_INCR = "shardvault-incr", "pgbackrest-incr"
SV_SYNTH = "shardvault-synthesized-full"
SV_RESTORE_FULL = "shardvault-restore-read-full"
SV_RESTORE_SYNTH = "shardvault-restore-synthesized-full"
PGBR_RESTORE = "pgbackrest-restore-newest"
LABELS = {
    SV_FULL: "ShardVault read full",
    PGBR_FULL: "pgBackRest full",
    SV_INCR: "ShardVault incremental (step 2)",
    PGBR_INCR: "pgBackRest incr (step 2)",
    SV_SYNTH: "ShardVault synthesized full (step 3)",
    SV_RESTORE_FULL: "ShardVault restore of the read full",
    SV_RESTORE_SYNTH: "ShardVault restore of the synthesized full",
    PGBR_RESTORE: "pgBackRest restore of its newest (full + incr) + start + amcheck",
}
say = bvp.say


@dataclass(frozen=True)
class Ratio:
    """``tool``'s ``key`` ÷ ``peer``'s ``peer_key``, per round and of the medians; ``limit``:
    the issue's target (None: shown, no target)."""

    name: str
    tool: str
    key: str
    peer: str
    peer_key: str
    limit: float | None


RATIOS = (
    Ratio("full backup wall: ShardVault to COMPLETE ÷ pgBackRest", SV_FULL, "seconds",
          PGBR_FULL, "seconds", 0.8),
    Ratio("full backup wall: ShardVault to the execution's end (vault promotion included) ÷ "
          "pgBackRest", SV_FULL, "execution_end_seconds", PGBR_FULL, "seconds", None),
    Ratio("full stored bytes: ShardVault (data + tail + block map) ÷ pgBackRest (backup path "
          "+ its WAL)", SV_FULL, "catalog_stored_bytes", PGBR_FULL, "stored_bytes", 1.05),
    Ratio("full client CPU-s per GB read: ShardVault agent ÷ pgBackRest", SV_FULL,
          "cpu_per_gb_read", PGBR_FULL, "cpu_per_gb_read", None),
    Ratio("incremental wall: ShardVault to COMPLETE ÷ pgBackRest incr", SV_INCR, "seconds",
          PGBR_INCR, "seconds", None),
    Ratio("incremental stored bytes: ShardVault ÷ pgBackRest incr", SV_INCR,
          "catalog_stored_bytes", PGBR_INCR, "stored_bytes", None),
    Ratio("synthesized full host time (agent busy) ÷ incremental's", SV_SYNTH,
          "host_busy_seconds", SV_INCR, "host_busy_seconds", 1.2),
    Ratio("synthesized full host CPU (agent) ÷ incremental's", SV_SYNTH, "agent_cpu_seconds_own",
          SV_INCR, "agent_cpu_seconds_own", 1.2),
    Ratio("synthesized full to COMPLETE ÷ read full to COMPLETE", SV_SYNTH, "seconds", SV_FULL,
          "seconds", None),
    Ratio("synthesized full restore ÷ read full restore", SV_RESTORE_SYNTH, "seconds",
          SV_RESTORE_FULL, "seconds", 1.1),
    Ratio("ShardVault restore of the read full ÷ pgBackRest restore + start + amcheck",
          SV_RESTORE_FULL, "seconds", PGBR_RESTORE, "seconds", 0.9),
    Ratio("ShardVault restore of the synthesized full ÷ pgBackRest restore + start + amcheck",
          SV_RESTORE_SYNTH, "seconds", PGBR_RESTORE, "seconds", 0.9),
)  # fmt: skip


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bvp.add_environment_arguments(parser)
    for action in parser._actions:  # backup_vs_peers' pgbench scale and archiving: unused here
        if action.dest in ("scale", "shardvault_archive"):
            action.help = argparse.SUPPRESS
    parser.add_argument(
        "--scale-gb",
        type=float,
        default=untuned.DEFAULT_SCALE_GB,
        help="the untuned dataset's size, GB of tables with TOAST and indexes",
    )
    parser.add_argument(
        "--pgbackrest-bin",
        default=os.environ.get(PGBACKREST_BIN_ENV) or DEFAULT_PGBACKREST,
        help=f"the pgbackrest binary (default ${PGBACKREST_BIN_ENV}, else {DEFAULT_PGBACKREST})",
    )
    parser.add_argument(
        "--vault",
        action="store_true",
        help="promote ShardVault's backups into the local vault (moto's S3, in this process) "
        "and restore from there; by default the stack has no vault, so both tools back up "
        "into and restore from MinIO",
    )
    parser.add_argument(
        "--pgbench-seconds",
        type=int,
        default=untuned.PGBENCH_SECONDS,
        help="pgbench's seconds in each standard change",
    )
    # backup_vs_peers' setup also makes the s3transfer controls' clients; none run here.
    parser.set_defaults(s3_chunk_mib=8, s3_concurrency=4, s3_signed_payload=False)
    args = parser.parse_args(argv)
    bvp.check_environment_arguments(parser, args)
    if args.shardvault_archive:
        parser.error("--shardvault-archive is not supported here")
    if args.scale_gb <= 0 or args.pgbench_seconds < 0:
        parser.error("--scale-gb must be positive and --pgbench-seconds at least 0")
    if not os.access(args.pgbackrest_bin, os.X_OK):
        parser.error(f"no pgbackrest binary at {args.pgbackrest_bin} (--pgbackrest-bin)")
    return args


# --- setup --------------------------------------------------------------------------------------
def setup(args: argparse.Namespace, root: Path, cleanup: contextlib.ExitStack) -> bvp.Bench:
    """``backup_vs_peers``' environment with pgBackRest as its users run it, the untuned
    dataset, and the bench cluster's policy (module docstring)."""
    bench = bvp.setup(
        args,
        root,
        cleanup,
        make_pgbackrest=lambda base, minio: PgBackRest.as_users_run_it(
            base, minio, binary=args.pgbackrest_bin
        ),
        load=lambda pg: untuned.build(pg, scale_gb=args.scale_gb, say=say),
    )
    path = root / "policy.yaml"
    path.write_text(POLICY)
    load_policy(str(path))  # refused here, not at the first backup
    bench.stack.settings.policy_file = str(path)
    if not args.vault:  # no vault: backups stay in the store, restores read MinIO
        bench.stack.settings.vault_url = None
    bench.setup["vault"] = bool(args.vault)
    bench.setup["policy"] = POLICY
    bench.setup["pgbackrest"] = bench.pgbackrest.settings() | {
        "version": bench.pgbackrest.version()
    }
    return bench


# --- CPU of the agent ---------------------------------------------------------------------------
class CpuTrace:
    """The CPU seconds a process has used, sampled every ``interval`` seconds on a thread while
    the trace runs, so that what it had used by a moment known only later (the end of the
    agent's last command, its record turning COMPLETE) can be read: ``used_by``."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-trace", daemon=True)

    def _sample(self) -> None:
        self.samples.append((time.time(), process_cpu(self.pid)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> CpuTrace:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def used_by(self, moment: float) -> float:
        """CPU seconds from the trace's start to ``moment`` (epoch; linear between samples)."""
        start = self.samples[0][1]
        before = [s for s in self.samples if s[0] <= moment]
        after = [s for s in self.samples if s[0] > moment]
        if not before:
            return 0.0
        if not after:
            return round(self.samples[-1][1] - start, 2)
        (t0, c0), (t1, c1) = before[-1], after[0]
        return round(c0 + (c1 - c0) * (moment - t0) / (t1 - t0) - start, 2)


# --- ShardVault's backups -----------------------------------------------------------------------
READ_FULL, INCREMENTAL, SYNTHESIZED = "read full", "incremental", "synthesized full"


def states_named(states: dict[str, float], name: str) -> float:
    """Seconds of every entry of state ``name`` (``report.state_seconds`` labels the second
    ``Name#2``)."""
    return round(sum(v for k, v in states.items() if k.split("#")[0] == name), 3)


def check_kind(backup_id: str, want: str, record: Any, split: dict[str, Any]) -> None:
    """Fails the run unless the backup is what the step asked for."""
    kind, depth, synthesized = split["kind"], split["depth"], record.synthesized_from
    got = (
        SYNTHESIZED
        if kind == BackupKind.FULL.value and synthesized
        else READ_FULL
        if kind == BackupKind.FULL.value
        else INCREMENTAL
    )
    if got != want or (want == INCREMENTAL and depth != 1):
        why = f" (full_reason: {record.full_reason})" if want == SYNTHESIZED else ""
        raise RuntimeError(
            f"ShardVault backup {backup_id} is a {got} at depth {depth}, not a {want}{why}."
        )


def shardvault_backup(bench: bvp.Bench, request: BackupRequest, want: str) -> dict[str, Any]:
    """A timed ShardVault backup that must be a ``want``; its times to COMPLETE and to the
    execution's end, its host time and CPU, and its stored bytes (module docstring)."""
    with CpuTrace(bench.agent_pid) as trace:
        backup = bvp.shardvault_backup(bench, request)
    manifest = backup.manifest
    split = ivp.shardvault_split(bench, backup)
    record = ops.show_backup(bench.client, bvp.CLUSTER, manifest.backup_id)
    check_kind(manifest.backup_id, want, record, split)
    execution = boto3.client("stepfunctions").describe_execution(executionArn=backup.arn)
    started = execution["stopDate"].timestamp() - backup.result["seconds"]
    commands = report.agent_commands(bench.agent_log.read_text(), manifest.backup_id)
    last_command = max(c["end"] for c in commands)
    data = bvp.stream_of(manifest, Phase.DATA)
    own = [o for o in data.objects if o.layer is None]
    copies = [o for o in data.objects if o.layer is not None]
    own_bytes = sum(o.length for o in own)
    # What the node read: a full's data stream once; an incremental's and a synthesized
    # full's scan (the files changed since the parent: data_read_bytes), then their changes.
    scanned = (record.data_read_bytes or 0) if want != READ_FULL else 0
    bytes_read = scanned + own_bytes + split["wal_bytes"]
    agent_cpu = trace.used_by(last_command)
    completed = float(record.completed_at or 0.0)
    result = backup.result | split
    return result | {
        "prefix": backup.prefix,
        "seconds": round(completed - started, 3),  # to COMPLETE
        "execution_end_seconds": backup.result["seconds"],
        "catalog_duration_seconds": record.duration_seconds,
        "catalog_stored_bytes": record.stored_bytes,
        "pack_cpu_seconds": record.pack_cpu_seconds,  # as the agent reports it
        "frame_levels": record.frame_levels,
        "compression_level": (json.loads(record.context or "{}").get("compression") or {}).get(
            "level"
        ),
        "bytes_read": bytes_read,
        "synthesize_seconds": states_named(split["states"], "Synthesize"),
        "promote_seconds": states_named(split["states"], "Promote"),
        "finalize_seconds": states_named(split["states"], "Finalize"),
        "host_busy_seconds": round(
            report.busy_seconds([(c["start"], c["end"]) for c in commands]), 3
        ),
        "host_commands": len(commands),
        "last_command_seconds": round(last_command - started, 3),
        # the agent's CPU for the backup (to its last command), to COMPLETE and to the end
        "agent_cpu_seconds_own": agent_cpu,
        "agent_cpu_to_complete": trace.used_by(completed),
        # a read full's, per GB of its data stream (module docstring); none of the others
        "cpu_per_gb_read": round(agent_cpu / (own_bytes / GB), 3)
        if want == READ_FULL and own_bytes
        else None,
        "own_data_bytes": own_bytes,
        "own_data_stored_bytes": sum(o.stored_bytes for o in own),
        "copied_data_stored_bytes": sum(o.stored_bytes for o in copies),
        "copied_objects": len(copies),
        "synthesized_from": record.synthesized_from,
        "synthesized_in_row": record.synthesized_in_row,
        "synthesis_objects": record.synthesis_objects,
        "synthesis_copied": record.synthesis_copied,
        "full_reason": record.full_reason,
        "data_read_bytes": record.data_read_bytes,
        "location": record.location,
    }


def pgbackrest_backup(bench: bvp.Bench, backup_type: str, prior: str | None) -> dict[str, Any]:
    """``incremental_vs_peers.pgbackrest_backup``, with a full's CPU-s per GB of the database
    (its backup's size: what a full reads)."""
    result = ivp.pgbackrest_backup(bench, backup_type, prior)
    full = backup_type == "full" and result["bytes"]
    per_gb = result["client_cpu_seconds"] / (result["bytes"] / GB) if full else None
    return result | {"cpu_per_gb_read": round(per_gb, 3) if per_gb is not None else None}


# --- restores -----------------------------------------------------------------------------------
def shardvault_restore(
    bench: bvp.Bench, backup: dict[str, Any], source: dict[str, str]
) -> dict[str, Any]:
    """ShardVault's restore of ``backup`` (its run's result), pg_amcheck with
    ``--heapallindexed``; the restored values compared with ``source``."""
    request = RestoreRequest(
        cluster=bvp.CLUSTER,
        target_cluster=bvp.RESTORE_CLUSTER,
        backup_id=backup["backup_id"],
        replace=True,
        heapallindexed=True,
    )
    result = bvp.shardvault_restore(bench, request, untuned.values)
    commands = report.agent_commands(bench.restore_agent_log.read_text(), result["restore_id"])
    split = ivp.restore_commands(commands, backup["root_id"])
    written = backup["stream_bytes"] + backup["wal_bytes"]
    extra = {"summary_bytes": result["bytes"], "bytes": written, "backup_id": backup["backup_id"]}
    return ivp.checked_restore(result | split | extra, source)


def pgbackrest_restore(bench: bvp.Bench, label: str, source: dict[str, str]) -> dict[str, Any]:
    restored = bvp.pgbackrest_restore(bench, label, untuned.values, heapallindexed=True)
    return ivp.checked_restore(restored | {"label": label}, source)


# --- rounds -------------------------------------------------------------------------------------
def source_values(bench: bvp.Bench) -> dict[str, str]:
    """The source's values, then a ``CHECKPOINT`` (module docstring, *source values*)."""
    started = time.monotonic()
    values = untuned.values(bench)
    bench.pg.psql("CHECKPOINT")
    say(f"  source values in {time.monotonic() - started:.1f} s")
    return values


def standard_change(bench: bvp.Bench, nth: int) -> dict[str, Any]:
    done = untuned.change(bench, nth=nth, pgbench_seconds=bench.args.pgbench_seconds)
    say(f"  change {nth}: {done}")
    return done


def in_turn(rnd: int, steps: list[tuple[str, Callable[[], dict[str, Any]]]]) -> list:
    """``steps`` as given in odd rounds, reversed in even ones."""
    return steps if rnd % 2 else steps[::-1]


def run_round(bench: bvp.Bench, chain: ivp.Chain, runs: dict) -> list[str]:
    """One round (module docstring); returns the restores whose values differed."""
    rnd = chain.index
    measure = ivp.measure
    # 1. fulls
    full_values = source_values(bench)
    read_full = BackupRequest(cluster=bvp.CLUSTER, read_full=True)
    fulls = [
        (SV_FULL, lambda: shardvault_backup(bench, read_full, READ_FULL)),
        (PGBR_FULL, lambda: pgbackrest_backup(bench, "full", None)),
    ]
    for name, run in in_turn(rnd, fulls):
        result = measure(bench, runs, name, rnd, run)
        if name == SV_FULL:
            chain.sv_backups.append(result)
            sv_full = result
        else:
            chain.pgbr_labels.append(result["label"])
    # 2. the standard change, then both incrementals
    change = standard_change(bench, 2 * rnd - 2)
    incr_values = source_values(bench)
    incremental = BackupRequest(cluster=bvp.CLUSTER, incremental=True)
    incrementals = [
        (SV_INCR, lambda: shardvault_backup(bench, incremental, INCREMENTAL) | {"change": change}),
        (PGBR_INCR, lambda: pgbackrest_backup(bench, "incr", chain.pgbr_labels[-1])),
    ]
    for name, run in in_turn(rnd, incrementals):
        result = measure(bench, runs, name, rnd, run)
        if name == SV_INCR:
            chain.sv_backups.append(result)
        else:
            chain.pgbr_labels.append(result["label"])
    # 3. the change again, then the synthesized full
    change = standard_change(bench, 2 * rnd - 1)
    synth_values = source_values(bench)
    full = BackupRequest(cluster=bvp.CLUSTER)  # the policy makes it synthesized
    synth = measure(
        bench, runs, SV_SYNTH, rnd,
        lambda: shardvault_backup(bench, full, SYNTHESIZED) | {"change": change},
    )  # fmt: skip
    chain.sv_backups.append(synth)
    # 4. restores
    measure(bench, {}, ivp.WARM_UP, rnd, lambda: shardvault_restore(bench, sv_full, full_values))
    newest = chain.pgbr_labels[-1]
    restores = [
        (SV_RESTORE_FULL, lambda: shardvault_restore(bench, sv_full, full_values)),
        (SV_RESTORE_SYNTH, lambda: shardvault_restore(bench, synth, synth_values)),
        (PGBR_RESTORE, lambda: pgbackrest_restore(bench, newest, incr_values)),
    ]
    differed = []
    for name, run in in_turn(rnd, restores):
        if not measure(bench, runs, name, rnd, run)["data_matches"]:
            differed.append(f"round {rnd}: {name}")
    return differed


def warm_up(bench: bvp.Bench) -> None:
    """``incremental_vs_peers.warm_up_backup``: a full, untimed, deleted from the store (its
    vault copy stays). The policy reads it: the cluster has no chain yet."""
    ivp.warm_up_backup(bench)


def run_rounds(bench: bvp.Bench, runs: dict[str, list[dict[str, Any]]]) -> None:
    """The warm-up, then the rounds; stops after a round whose restored values differed."""
    warm_up(bench)
    for index in range(1, bench.args.runs + 1):
        say(f"round {index} of {bench.args.runs}")
        chain = ivp.Chain(index)
        differed = run_round(bench, chain, runs)
        ivp.clean_up_round(bench, chain)
        if differed:
            raise ValuesDiffer(differed)


class ValuesDiffer(RuntimeError):
    """A restored server's values differed from the source's (after the results are written)."""

    def __init__(self, restores: list[str]) -> None:
        super().__init__(
            "restored values differ from the source's: " + "; ".join(restores) + " (see the "
            "JSON's runs: checked against source_values)"
        )
        self.restores = restores


# --- summary ------------------------------------------------------------------------------------
def per_round(runs: list[dict[str, Any]], key: str) -> list[float | None]:
    return [run.get(key) for run in sorted(runs, key=lambda r: r["round"])]


def median_or_none(values: list[Any]) -> float | None:
    return None if not values or None in values else statistics.median(values)


def ratio_result(runs: dict, ratio: Ratio) -> dict[str, Any] | None:
    mine, theirs = runs.get(ratio.tool), runs.get(ratio.peer)
    if not (mine and theirs):
        return None
    by_round = {run["round"]: run.get(ratio.peer_key) for run in theirs}
    rounds = [
        (run["round"], run.get(ratio.key), by_round.get(run["round"]))
        for run in sorted(mine, key=lambda r: r["round"])
    ]
    values = {r: a / b for r, a, b in rounds if a is not None and b}
    top = median_or_none([run.get(ratio.key) for run in mine])
    bottom = median_or_none([run.get(ratio.peer_key) for run in theirs])
    of_medians = top / bottom if top is not None and bottom else None
    held = None
    if ratio.limit is not None and of_medians is not None:
        if values and max(values.values()) <= ratio.limit:
            held = "yes, every round"
        elif of_medians <= ratio.limit:
            held = "on the medians, not every round"
        else:
            held = "no"
    return {
        "name": ratio.name,
        "per_round": values,
        "of_medians": of_medians,
        "limit": ratio.limit,
        "held": held,
    }


def memory(runs: dict) -> list[dict[str, Any]]:
    out = []
    for who, names in (
        ("backup agent", (SV_FULL, SV_INCR, SV_SYNTH)),
        ("restore agent", (SV_RESTORE_FULL, SV_RESTORE_SYNTH)),
    ):
        peaks = [run["agent_peak_rss"] for name in names for run in runs.get(name, [])]
        if peaks:
            out.append({"agent": who, "peak_rss": max(peaks), "held": max(peaks) < MEMORY_LIMIT})
    return out


def summarize(runs: dict) -> dict[str, Any]:
    return {
        "ratios": [r for r in (ratio_result(runs, ratio) for ratio in RATIOS) if r],
        "memory": memory(runs),
        "restored_values_match": {
            name: all(run["data_matches"] for run in runs[name])
            for name in (SV_RESTORE_FULL, SV_RESTORE_SYNTH, PGBR_RESTORE)
            if runs.get(name)
        },
    }


# --- Markdown -----------------------------------------------------------------------------------
def cells(values: list[Any], digits: int = 1, scale: float = 1.0) -> str:
    """Per-round values (in round order), and their median."""
    if not values:
        return "—"
    shown = " / ".join("—" if v is None else f"{v / scale:,.{digits}f}" for v in values)
    median = median_or_none(values)
    if len(values) == 1 or median is None:
        return shown
    return f"{shown} (median {median / scale:,.{digits}f})"


def backups_table(runs: dict) -> str:
    rows = [
        "| backup | wall s (ShardVault: to COMPLETE) | ShardVault: to the execution's end s "
        "| MiB stored | MiB read | client CPU s | CPU-s per GB read |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in (SV_FULL, PGBR_FULL, SV_INCR, PGBR_INCR, SV_SYNTH):
        if not runs.get(name):
            continue
        tool = runs[name]
        sv = name.startswith("shardvault")
        stored = "catalog_stored_bytes" if sv else "stored_bytes"
        read = "bytes_read" if sv else ("bytes" if name == PGBR_FULL else "delta_bytes")
        cpu = "agent_cpu_seconds_own" if sv else "client_cpu_seconds"
        per_gb = cells(per_round(tool, "cpu_per_gb_read"), 2) if "full" in name else "—"
        if name == SV_SYNTH:
            per_gb = "—"  # its bytes are its changes: no full's read to divide by
        rows.append(
            f"| {LABELS[name]} | {cells(per_round(tool, 'seconds'), 2)} | "
            f"{cells(per_round(tool, 'execution_end_seconds'), 2) if sv else '—'} | "
            f"{cells(per_round(tool, stored), 1, MiB)} | {cells(per_round(tool, read), 0, MiB)} | "
            f"{cells(per_round(tool, cpu), 2)} | {per_gb} |"
        )
    return "\n".join(rows)


def synthesized_table(runs: dict) -> str:
    synth, incr = runs.get(SV_SYNTH, []), runs.get(SV_INCR, [])
    if not synth:
        return ""
    rows = [
        ("host: agent busy s (union of its commands), synthesized full",
         cells(per_round(synth, "host_busy_seconds"), 2)),
        ("host: agent busy s, incremental (step 2)",
         cells(per_round(incr, "host_busy_seconds"), 2)),
        ("host: agent CPU s to its last command, synthesized full",
         cells(per_round(synth, "agent_cpu_seconds_own"), 2)),
        ("host: agent CPU s, incremental", cells(per_round(incr, "agent_cpu_seconds_own"), 2)),
        ("agent commands: synthesized full; incremental",
         f"{cells(per_round(synth, 'host_commands'), 0)}; "
         f"{cells(per_round(incr, 'host_commands'), 0)}"),
        ("start → agent's last command s (synthesized full)",
         cells(per_round(synth, "last_command_seconds"), 2)),
        ("start → COMPLETE s (catalog duration s)",
         f"{cells(per_round(synth, 'seconds'), 2)} "
         f"({cells(per_round(synth, 'catalog_duration_seconds'), 2)})"),
        ("Synthesize state s (all calls)", cells(per_round(synth, "synthesize_seconds"), 2)),
        ("Synthesize share of the time to COMPLETE",
         cells([s["synthesize_seconds"] / s["seconds"] for s in
                sorted(synth, key=lambda r: r["round"])], 3)),
        ("Finalize s; Promote s (all calls)",
         f"{cells(per_round(synth, 'finalize_seconds'), 2)}; "
         f"{cells(per_round(synth, 'promote_seconds'), 2)}"),
        ("start → execution's end s", cells(per_round(synth, "execution_end_seconds"), 2)),
        ("chain objects copied (synthesis_objects)",
         cells(per_round(synth, "synthesis_objects"), 0)),
        ("MiB stored, all (catalog)", cells(per_round(synth, "catalog_stored_bytes"), 1, MiB)),
        ("MiB stored: its own data objects (the changes sent)",
         cells(per_round(synth, "own_data_stored_bytes"), 2, MiB)),
        ("MiB stored: the incremental's data objects",
         cells(per_round(incr, "data_stored_bytes"), 2, MiB)),
        ("MiB stored: the chain's copies",
         cells(per_round(synth, "copied_data_stored_bytes"), 1, MiB)),
        ("MiB stored: WAL tail; block map",
         f"{cells(per_round(synth, 'wal_stored_bytes'), 2, MiB)}; "
         f"{cells(per_round(synth, 'blockmap_stored_bytes'), 2, MiB)}"),
        ("MiB the node read (scan of changed files + changes + tail): synthesized; incremental",
         f"{cells(per_round(synth, 'bytes_read'), 0, MiB)}; "
         f"{cells(per_round(incr, 'bytes_read'), 0, MiB)}"),
        ("synthesized_from (every round)",
         ", ".join(str(s["synthesized_from"]) for s in sorted(synth, key=lambda r: r["round"]))),
    ]  # fmt: skip
    return "\n".join(
        ["| synthesized full (per round; median) | value |", "| --- | --- |"]
        + [f"| {label} | {value} |" for label, value in rows]
    )


def restores_table(runs: dict) -> str:
    rows = [
        "| restore (to a running server that passed pg_amcheck --all --heapallindexed) | wall s "
        "| MiB written | restored values = source's |",
        "| --- | --- | --- | --- |",
    ]
    for name in (SV_RESTORE_FULL, SV_RESTORE_SYNTH, PGBR_RESTORE):
        if tool := runs.get(name):
            matches = ", ".join(
                "yes" if r["data_matches"] else "NO" for r in sorted(tool, key=lambda r: r["round"])
            )
            rows.append(
                f"| {LABELS[name]} | {cells(per_round(tool, 'seconds'), 2)} | "
                f"{cells(per_round(tool, 'bytes'), 0, MiB)} | {matches} |"
            )
    return "\n".join(rows)


def restore_split_table(runs: dict) -> str:
    rows = [
        "| ShardVault restore (medians, s) | "
        + " | ".join(ivp.RESTORE_STATES)
        + " | download wall | CPU s: restore agent; control plane |",
        "| --- |" + " --- |" * (len(ivp.RESTORE_STATES) + 2),
    ]
    for name in (SV_RESTORE_FULL, SV_RESTORE_SYNTH):
        if not (tool := runs.get(name)):
            continue
        states = [
            median_or_none([run["states"].get(s, 0.0) for run in tool]) for s in ivp.RESTORE_STATES
        ]
        rows.append(
            f"| {LABELS[name]} | "
            + " | ".join(f"{s:.2f}" for s in states)
            + f" | {median_or_none(per_round(tool, 'download_wall')):.2f} | "
            f"{median_or_none(per_round(tool, 'agent_cpu_seconds')):.1f}; "
            f"{median_or_none(per_round(tool, 'control_plane_cpu_seconds')):.1f} |"
        )
    return "\n".join(rows)


def ratios_table(summary: dict) -> str:
    rows = [
        "| ShardVault ÷ reference | per round | of the medians | target | held |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in summary["ratios"]:
        rounds = " / ".join(f"{v:.3f}" for _, v in sorted(r["per_round"].items())) or "—"
        medians = "—" if r["of_medians"] is None else f"{r['of_medians']:.3f}"
        limit = "—" if r["limit"] is None else f"≤ {r['limit']:g}"
        rows.append(f"| {r['name']} | {rounds} | {medians} | {limit} | {r['held'] or '—'} |")
    rows += [
        f"| {m['agent']} peak RSS (VmHWM, whole run) | — | {m['peak_rss'] / 10**6:.0f} MB | "
        f"< {MEMORY_LIMIT // 10**6} MB | {'yes' if m['held'] else 'no'} |"
        for m in summary["memory"]
    ]
    return "\n".join(rows)


def changes_table(runs: dict) -> str:
    rows = [
        "| round | change (step) | WAL MiB | notes rows | documents | pgbench tps | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    steps = [(run, 2) for run in runs.get(SV_INCR, [])] + [
        (run, 3) for run in runs.get(SV_SYNTH, [])
    ]
    for run, step in sorted(steps, key=lambda item: (item[0]["round"], item[1])):
        c = run.get("change") or {}
        documents = c.get("documents_inserted", 0) + c.get("documents_replaced", 0)
        rows.append(
            f"| {run['round']} | nth {c.get('nth')} (step {step}) | "
            f"{c.get('wal_bytes', 0) / MiB:,.1f} | {c.get('notes_rows')} | {documents} | "
            f"{c.get('pgbench_tps') or 0:,.0f} | {c.get('seconds')} |"
        )
    return "\n".join(rows)


def frame_levels(runs: dict) -> str:
    """The read fulls' frames per zstd level, as the agent reported them, e.g. " (the full's
    frames per level, each round: 1: 700, 3: 12; 1: 702, 3: 10)"."""
    counts = [run.get("frame_levels") for run in runs.get(SV_FULL, [])]
    shown = [", ".join(f"{k}: {v}" for k, v in sorted(c.items())) for c in counts if c]
    return f" (the full's frames per level, each round: {'; '.join(shown)})" if shown else ""


def setup_text(bench: bvp.Bench, runs: dict) -> str:
    loaded = bench.setup.get("loaded", {})
    tables = loaded.get("table_bytes", {})
    levels = sorted({run.get("compression_level") for run in runs.get(SV_FULL, [])}, key=str)
    pgbr = bench.setup["pgbackrest"]
    return "\n".join(
        [
            f"- dataset: untuned, --scale-gb {bench.args.scale_gb} "
            f"({loaded.get('dataset_bytes', 0) / GB:.2f} GB of tables: "
            + ", ".join(f"{k} {v / GB:.3f}" for k, v in tables.items())
            + f"; databases {loaded.get('database_bytes')}); pgbench scale "
            f"{loaded.get('pgbench_scale')}, random text by {loaded.get('random')}",
            f"- {pgbr['version']} ({pgbr['binary']}): compress-type={pgbr['compress_type']} "
            f"(default level), process-max={pgbr['process_max']}, "
            f"repo1-bundle={'y' if pgbr['bundle'] else 'n'}, "
            f"repo1-block={'y' if pgbr['block'] else 'n'}, start-fast=y, TLS MinIO",
            f"- ShardVault: zstd level {', '.join(map(str, levels))}{frame_levels(runs)}, "
            "not encrypted, "
            "incremental.synthesized_fulls 1; "
            + (
                f"vault {VAULT}: restores read the vault (moto's S3 in this process), "
                "pgBackRest's its TLS MinIO"
                if bench.setup.get("vault")
                else "no vault: both tools back up into and restore from MinIO"
            ),
            f"- rounds: {bench.args.runs}, ShardVault first in odd rounds; standard change with "
            f"pgbench -T {bench.args.pgbench_seconds}",
        ]
    )


def markdown(bench: bvp.Bench, runs: dict, summary: dict) -> str:
    parts = [
        "Setup:\n\n" + setup_text(bench, runs),
        "Ratios and the issue's targets (per round in round order; of the medians):\n\n"
        + ratios_table(summary),
        "Backups (per round; median):\n\n" + backups_table(runs),
        "Synthesized full against the incremental of the same kind of change:\n\n"
        + synthesized_table(runs),
        "Restores (per round; median):\n\n" + restores_table(runs),
        "Where ShardVault's restores went:\n\n" + restore_split_table(runs),
        "The changes:\n\n" + changes_table(runs),
    ]
    return "\n\n".join(parts) + "\n"


# --- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    avoid_empty_put_stall()
    signal.signal(signal.SIGTERM, bvp._terminate)
    started = time.time()
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as cleanup:
        root = bvp.make_workdir(args, cleanup)
        bench = setup(args, root, cleanup)
        say(f"setup done in {time.time() - started:.0f} s: {bench.setup}")
        failure: Exception | None = None
        try:
            run_rounds(bench, runs)
        except ValuesDiffer as error:
            failure = error  # the results are written first
        except Exception as error:
            partial = {"failed": repr(error), **summarize_partial(runs)}
            path = bvp.write_results(
                bench, runs, partial, started, name=f"{NAME}-failed", markdown=f"Failed: {error}\n"
            )
            say(f"failed; what was measured is in {path}")
            raise
        summary = summarize(runs)
        text = markdown(bench, runs, summary)
        path = bvp.write_results(bench, runs, summary, started, name=NAME, markdown=text)
        say("stopping everything")
    print(text)
    print(f"Raw results: {path}; benchmark wall time {time.time() - started:.0f} s.")
    if failure:
        raise failure
    return 0


def summarize_partial(runs: dict) -> dict[str, Any]:
    """What can be summarized of an interrupted run (nothing, if that fails too)."""
    try:
        return summarize(runs)
    except Exception:  # the failure being reported matters more
        return {}


if __name__ == "__main__":
    sys.exit(main())
