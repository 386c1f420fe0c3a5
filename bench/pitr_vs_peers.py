"""ShardVault's point-in-time restore against pgBackRest's, to the same target time in the same
WAL, in one run on one machine (issue 11: "a point-in-time restore of scale 100 plus 10 minutes
of WAL: wall time reported next to pgBackRest's restore to the same target").

Usage::

    .venv/bin/python bench/pitr_vs_peers.py [--scale 100] [--load-seconds 600] [--rate 500]
        [--runs 2] [--out bench/results]
    .venv/bin/python bench/pitr_vs_peers.py --scale 5 --load-seconds 60 --mark-seconds 15 --runs 1

The environment is ``backup_vs_peers.py``'s, set up by its code: one PostgreSQL 15 instance
(``initdb --data-checksums``, ``wal_level=replica``, ``shared_buffers=512MB``) filled by
``pgbench -i -s SCALE``; the local stack (moto Step Functions running the real ASL, Lambda
handlers in this process, MinIO as the store) with one source agent and one restore-target
agent; pgBackRest (``$PGBACKREST_BIN``, else ``pgbackrest`` on ``PATH``) as its users run it
(``peers.PgBackRest.as_users_run_it``: ``compress-type=zst`` at its default level 3,
``process-max=2``, ``repo1-bundle=y``, ``repo1-block=y``) into a second MinIO over TLS.
Then, as ``wal_archive.py`` sets each tool's archiving up:

* both tools archive the same server's WAL: ``archive_command`` is ShardVault's push (the
  system python3 running a copy of ``walspool.py``, ``--spool DIR``) *and then* pgBackRest's
  ``archive-push``; both must succeed, so each archive holds every segment. ShardVault's
  source agent gets that spool as its shard's ``wal_spool_dir`` (``archive_poll_seconds``
  0.2; the bench cluster is not in the local policy file, so ``archive.max_delay_seconds`` is
  the policy's default, 60). pgBackRest runs with ``archive-async=y`` and a spool path, for
  ``archive-push`` and for the restore's ``archive-get`` (prefetch, its default queue of
  128 MiB, ``process-max=2``): what its documentation recommends for a busy archive; its file log at
  ``detail`` (one line per segment fetched, for the WAL figures below).
* once the chain archived a first segment end to end: a ShardVault full backup, then
  ``pgbackrest backup --type=full`` (timed as ``backup_vs_peers.py`` times them).
* the *load*: ``pgbench -n -c 4 -j 2 -R RATE -T LOAD_SECONDS`` (rate-limited, so the WAL
  volume is the same whatever the machine does meanwhile). Every ``--mark-seconds`` (from the
  load's start) a *marker* row goes into ``marks(n int, at timestamptz default
  clock_timestamp())``.
* the *target*: halfway between the second-to-last and the last marker (near the load's end).
  After the load: ``pg_switch_wal()``, then wait until PostgreSQL's archiver reports the last
  segment archived (both commands succeeded), ShardVault's spool is empty and the segment is in
  a batch whose index is in the store.

Each round (``--runs``; the order alternates: round 1 ShardVault first, round 2 pgBackRest
first, ...) runs both restores, each into an empty directory, after the machine is settled as
in ``backup_vs_peers.py`` (both agents at their idle poll rate, archiving caught up, ``sync``):

1. ShardVault: ``RestoreRequest(target={"time": T})`` (the CLI's ``--target-time``) into the
   restore agent's one-node cluster: the base backup's frames and the archive's batches from
   the base's WAL on downloaded and checked, recovery to T, promoted, ``pg_amcheck --all``
   passed; timed from ``start_restore`` to the execution's end (``shardvault_restore``).
2. pgBackRest: ``pgbackrest restore --set=<its full> --type=time --target=T
   --target-action=promote --archive-mode=off``, the server started, recovered (its
   ``restore_command`` is ``archive-get``), promoted, then the same ``pg_amcheck --all``; timed
   from the command's start to ``pg_amcheck``'s success (``pgbackrest_restore``).

After each (untimed) the restored server is checked: its markers must be exactly those written
up to T; its new timeline's history file gives the LSN where recovery stopped.

Measured, per restore: *wall time*; *WAL replayed*, that stop LSN minus the base backup's end
(ShardVault: the manifest's cut or stop LSN; pgBackRest: ``pgbackrest info``'s stop LSN);
*WAL fetched*: ShardVault, the archive's batches the restore downloaded (from the base's
segment to the end of the archive: their stored bytes, their WAL bytes, and how many the
restore agent's log shows downloaded); pgBackRest, the segments its ``archive-get`` logs
found: the async process's fetches (``detail``; prefetch included), with any "found ... in the
archive asynchronously" hand-over to PostgreSQL its foreground logs (none were in its file log
in the runs so far: ``wal_handed_segments`` 0), their stored bytes in its repository and 16 MiB
each.
The ratio is ShardVault's wall time ÷ pgBackRest's, per round and of the medians.

Raw results go to ``--out`` as JSON, the table beside it as Markdown (and to stdout).
Everything started is stopped and the work directory removed on the way out, also on failure,
Ctrl-C or SIGTERM (``--keep`` keeps the directory).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import backup_vs_peers as bvp
import report
import wal_archive
from peers import (
    PGBACKREST_BUCKET,
    PGBACKREST_REPO_PATH,
    STANZA,
    PgBackRest,
    avoid_empty_put_stall,
    list_keys,
)

from shardvault.contracts.models import BackupRequest, Manifest, RestoreRequest
from shardvault.contracts.pgwal import DEFAULT_SEGMENT_SIZE, lsn_number
from shardvault.local.postgres import PostgresInstance, give_to_postgres
from shardvault.wal import archive

say = bvp.say
MiB = report.MiB
SV, PGBR = "shardvault-pitr", "pgbackrest-pitr"
SV_BACKUP, PGBR_BACKUP = "shardvault-full", "pgbackrest-full"
CLIENTS, JOBS = 4, 2
ARCHIVE_POLL_SECONDS = 0.2  # wal_archive.py's (and the integration tests')
ARCHIVE_TIMEOUT = 1800.0
LOAD_GRACE = 120.0
REPO_SEGMENT = re.compile(r"[0-9A-F]{24}-[0-9a-f]{40}(\.\w+)?")  # <segment>-<sha1>.zst
# archive-get's log lines: the async process's (detail) "found <segment> in the repo1: 15-1
# archive", fetched into the spool; the foreground's (info) "found <segment> in the archive
# asynchronously", handed to PostgreSQL.
FETCHED = re.compile(r"found ([0-9A-F]{24}) in the repo")
HANDED = re.compile(r"found ([0-9A-F]{24}) in the archive")
TPS = re.compile(r"tps = ([\d.]+) \(without initial connection time\)")
PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
LATENCY = re.compile(r"latency average = ([\d.]+) ms")
LAG = re.compile(r"rate limit schedule lag: avg ([\d.]+)")


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bvp.add_environment_arguments(parser)
    parser.add_argument("--load-seconds", type=int, default=600, help="pgbench load (-T)")
    parser.add_argument("--rate", type=int, default=500, help="pgbench's rate limit (-R), tps")
    parser.add_argument(
        "--mark-seconds", type=int, default=60, help="seconds between marker rows in the load"
    )
    # backup_vs_peers' setup also makes the s3transfer controls' clients; none run here.
    parser.set_defaults(runs=2, s3_chunk_mib=8, s3_concurrency=4, s3_signed_payload=False)
    args = parser.parse_args(argv)
    bvp.check_environment_arguments(parser, args)
    if min(args.load_seconds, args.rate, args.mark_seconds) < 1:
        parser.error("--load-seconds, --rate and --mark-seconds must be at least 1")
    if args.load_seconds <= args.mark_seconds:
        parser.error("--load-seconds must exceed --mark-seconds: the target is between markers")
    return args


# --- pgBackRest: async archiving, restores to a time ---------------------------------------------
@dataclass
class PitrPgBackRest(wal_archive.AsyncPgBackRest):
    """``wal_archive.AsyncPgBackRest`` (its repository the one ``backup_vs_peers`` created)
    whose ``restore`` goes to ``target_time`` when one is set: ``PgBackRest.restore`` times
    the command; this only swaps ``--type=immediate`` for ``--type=time --target=...``."""

    target_time: str | None = None

    def config_text(self) -> str:
        # detail: the async archive-get logs each segment it fetches (prefetch included).
        return super().config_text().replace("log-level-file=info", "log-level-file=detail")

    def run(self, *args: str) -> str:
        if args and args[0] == "restore" and self.target_time is not None:
            kept = tuple(a for a in args if a != "--type=immediate")
            args = (*kept, "--type=time", f"--target={self.target_time}")
        return super().run(*args)

    def log_sizes(self) -> dict[Path, int]:
        return {p: p.stat().st_size for p in (self.base / "log").glob("*.log")}

    def logged_since(self, sizes: dict[Path, int]) -> str:
        """What its log files got since ``sizes`` (``log_sizes``) was taken."""
        text = []
        for path in sorted((self.base / "log").glob("*.log")):
            with open(path, "rb") as log:
                log.seek(sizes.get(path, 0))
                text.append(log.read().decode(errors="replace"))
        return "".join(text)


# --- setup --------------------------------------------------------------------------------------
@dataclass
class Pitr:
    """What the runs share besides ``bvp.Bench``: the spool, the backups and the target."""

    bench: bvp.Bench
    spool: Path
    pgbackrest: PitrPgBackRest
    sv_manifest: Manifest | None = None
    pgbr_label: str = ""
    marks: list[tuple[int, datetime]] = field(default_factory=list)
    target: datetime | None = None


def archive_both(bench: bvp.Bench, cleanup: contextlib.ExitStack) -> Pitr:
    """Turns on ShardVault's archiving beside pgBackRest's (now async) on the source (see the
    module docstring): the chained ``archive_command``, the source agent restarted with the
    spool."""
    root = bench.root
    spool = root / "spool"
    spool.mkdir()
    give_to_postgres(spool)
    pgbackrest = PitrPgBackRest(
        bench.pgbackrest.base,
        bench.tls_minio,
        instance=bench.pg,
        process_max=bench.pgbackrest.process_max,
        compress_type=bench.pgbackrest.compress_type,
        binary=bench.pgbackrest.binary,
        bundle=bench.pgbackrest.bundle,
        block=bench.pgbackrest.block,
        spool_path=root / "pgbackrest-spool",
    )
    pgbackrest.write_config()  # the same file and repository, now with archive-async
    bench.pgbackrest = pgbackrest
    push = bvp.push_command(bvp.copy_push_client(root), spool)
    command = f"{push} && {pgbackrest.archive_command}"
    bench.pg.psql(f"ALTER SYSTEM SET archive_command = {wal_archive.quoted(command)}")
    bench.pg.psql("SELECT pg_reload_conf()")
    config = bvp.agent_config(bench.args, root, bench.pg, cleanup)
    config["shards"][0]["wal_spool_dir"] = str(spool)
    config["archive_poll_seconds"] = ARCHIVE_POLL_SECONDS
    bench.stack.stop_agent(bvp.NODE_ID)
    bench.agent_pid = bvp.start_agent(bench.stack, config, cleanup)
    bench.setup["archive_command"] = command.replace(str(root), "<work>")
    return Pitr(bench, spool, pgbackrest)


def shardvault_holds(pitr: Pitr, last: str) -> bool:
    """ShardVault's archive holds every WAL file up to ``last`` (``wal_archive``'s test: the
    spool empty, ``last`` in a recorded batch)."""
    if any(pitr.spool.iterdir()):
        return False
    svc = pitr.bench.stack.services()
    batches = archive.archived_batches(svc, bvp.CLUSTER, bvp.SHARD_ID, last)
    return any(f["name"] == last for b in batches for f in b["files"])


def switch_and_wait(pitr: Pitr, timeout: float = ARCHIVE_TIMEOUT) -> dict[str, Any]:
    """Closes the current segment, waits until both archives hold it; returns its name and
    the wait."""
    pg, started = pitr.bench.pg, time.monotonic()
    last = wal_archive.switch_segment(pg)
    deadline = started + timeout
    while not (wal_archive.last_archived(pg) >= last and shardvault_holds(pitr, last)):
        if time.monotonic() > deadline:
            counts = pg.psql("SELECT * FROM pg_stat_archiver")
            raise TimeoutError(
                f"{last} not in both archives after {timeout:.0f} s; pg_stat_archiver: "
                f"{counts}; spool: {sorted(p.name for p in pitr.spool.iterdir())[:5]}. "
                f"Server log:\n{pg.log_tail(10)}"
            )
        time.sleep(0.2)
    return {"segment": last, "wait_seconds": round(time.monotonic() - started, 1)}


def backups(pitr: Pitr, runs: dict[str, list[dict[str, Any]]]) -> None:
    """A ShardVault full backup, then a pgBackRest full (each timed, after settling)."""
    bench = pitr.bench
    for name in (SV_BACKUP, PGBR_BACKUP):
        quiet = bvp.quiet_agents(bench)
        bvp.settle(bench)
        if name == SV_BACKUP:
            backup = bvp.shardvault_backup(bench, BackupRequest(cluster=bvp.CLUSTER))
            pitr.sv_manifest = backup.manifest
            shard = backup.manifest.shards[0]
            result = backup.result | {
                "end_lsn": shard.marker.get("cut_lsn") or shard.marker.get("stop_lsn"),
                "wal_from": archive.wal_from(backup.manifest, bvp.SHARD_ID),
            }
            bench.agents_busy_until = time.monotonic() + bench.busy_window
        else:
            result = bench.pgbackrest.backup_full()
            pitr.pgbr_label = result["label"]
            info = pgbackrest_backup_info(pitr)
            result |= {"end_lsn": info["lsn"]["stop"], "archive": info["archive"]}
        runs.setdefault(name, []).append(result | quiet)
        say(f"  {name}: {result['seconds']:.1f} s, {result['bytes'] / MiB:,.0f} MiB")


def pgbackrest_backup_info(pitr: Pitr) -> dict[str, Any]:
    return next(b for b in pitr.pgbackrest.info()["backup"] if b["label"] == pitr.pgbr_label)


# --- the load -----------------------------------------------------------------------------------
def pgbench_command(pg: PostgresInstance, args: argparse.Namespace) -> list[str]:
    return [
        str(pg.bin_dir / "pgbench"), "-n", "-c", str(CLIENTS), "-j", str(JOBS),
        "-R", str(args.rate), "-T", str(args.load_seconds), *pg._client_args(), "postgres",
    ]  # fmt: skip


def mark_during(pg: PostgresInstance, every: float, stop: threading.Event, errors: list) -> None:
    """A marker row at the load's start and every ``every`` seconds after it, until ``stop``."""
    n, started = 0, time.monotonic()
    try:
        while True:
            pg.psql(f"INSERT INTO marks (n) VALUES ({n})")
            n += 1
            if stop.wait(max(0.0, started + n * every - time.monotonic())):
                return
    except Exception as error:  # reported by the caller
        errors.append(error)


def run_load(pitr: Pitr) -> dict[str, Any]:
    """The rate-limited pgbench with its markers; then the target, between the last two."""
    bench, args = pitr.bench, pitr.bench.args
    pg = bench.pg
    lsn = pg.psql("SELECT pg_current_wal_lsn()")
    first = wal_archive.current_segment(pg)
    stop, errors = threading.Event(), []
    command = pgbench_command(pg, args)
    say(f"load: {shlex.join(command[:11])} for {args.load_seconds} s")
    started = time.time()
    load = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/"
    )
    marker = threading.Thread(target=mark_during, args=(pg, args.mark_seconds, stop, errors))
    marker.start()
    try:
        output, _ = load.communicate(timeout=args.load_seconds + LOAD_GRACE)
    finally:
        stop.set()
        marker.join()
        if load.poll() is None:
            load.kill()
    seconds = time.time() - started
    tps, processed = TPS.search(output), PROCESSED.search(output)
    if load.returncode != 0 or not (tps and processed) or errors:
        raise RuntimeError(f"pgbench exited with {load.returncode} ({errors}):\n{output}")
    wal = int(pg.psql(f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn}')"))
    rows = pg.psql("SELECT n, at FROM marks WHERE n >= 0 ORDER BY n").splitlines()
    pitr.marks = [(int(n), datetime.fromisoformat(at)) for n, at in (r.split("|") for r in rows)]
    if len(pitr.marks) < 2:
        raise RuntimeError(f"{len(pitr.marks)} markers: the target needs two")
    (_, before), (_, after) = pitr.marks[-2:]
    pitr.target = before + (after - before) / 2
    latency, lag = LATENCY.search(output), LAG.search(output)
    return {
        "command": shlex.join(command).replace(str(pg.socket_dir), "<socket>"),
        "rate": args.rate,
        "tps": float(tps[1]),
        "transactions": int(processed[1]),
        "latency_ms": float(latency[1]) if latency else None,
        "schedule_lag_ms": float(lag[1]) if lag else None,
        "seconds": round(seconds, 1),
        "wal_bytes": wal,
        "first_segment": first,
        "markers": len(pitr.marks),
        "marks": [(n, at.isoformat()) for n, at in pitr.marks],
        "target": pitr.target.isoformat(),
    }


# --- restores -----------------------------------------------------------------------------------
HISTORY = (
    "SELECT pg_read_file('pg_wal/' || name) FROM pg_ls_waldir() "
    "WHERE name LIKE '%.history' ORDER BY name DESC LIMIT 1"
)


def restored_values(instance: PostgresInstance) -> dict[str, Any]:
    """The restored server's markers and where its recovery stopped (its newest timeline's
    history file: the switch point's LSN)."""
    marks = instance.psql("SELECT coalesce(string_agg(n::text, ',' ORDER BY n), '') FROM marks")
    history = instance.psql(HISTORY).strip().splitlines()
    switch = history[-1].split()[1] if history else None
    return {"marks": [int(n) for n in marks.split(",") if n], "stop_lsn": switch}


def expected_marks(pitr: Pitr) -> list[int]:
    assert pitr.target is not None
    return [n for n, at in pitr.marks if at <= pitr.target]


def checked(pitr: Pitr, result: dict[str, Any], base_end: str) -> dict[str, Any]:
    """The restore's result with the markers compared and the WAL it replayed."""
    (values,) = result.pop("checked").values()
    expected = expected_marks(pitr)
    matches = values["marks"] == expected
    if not matches:
        say(f"  RESTORED MARKERS DIFFER: {values['marks']} where {expected} were expected")
    stop = values["stop_lsn"]
    replayed = lsn_number(stop) - lsn_number(base_end) if stop else None
    return result | {
        "restored_marks": values["marks"],
        "expected_marks": expected,
        "marks_match": matches,
        "stop_lsn": stop,
        "base_end_lsn": base_end,
        "wal_replayed_bytes": replayed,
    }


def shardvault_pitr(pitr: Pitr) -> dict[str, Any]:
    bench, manifest = pitr.bench, pitr.sv_manifest
    assert manifest is not None
    assert pitr.target is not None
    request = RestoreRequest(
        cluster=bvp.CLUSTER,
        target_cluster=bvp.RESTORE_CLUSTER,
        replace=True,
        target={"time": pitr.target.isoformat()},
    )
    result = bvp.shardvault_restore(bench, request, restored_values)
    shard = manifest.shards[0]
    base_end = shard.marker.get("cut_lsn") or shard.marker.get("stop_lsn")
    # The archive after the base (as it was at the restore: the source wrote nothing to
    # archive since), and what the node's WAL feed fetched of it (the restore's summary).
    found = archive.after_backup(bench.stack.services(), manifest, bvp.SHARD_ID)
    batches = found.batches if found else []
    fed = batches[: result.get("wal_batches_fetched") or 0]
    return checked(pitr, result, base_end) | {
        "wal_batches": len(batches),
        "wal_batches_fetched": result.get("wal_batches_fetched"),
        "wal_fetched_stored_bytes": result.get("wal_stored_bytes_fetched"),
        "wal_fetched_bytes": result.get("wal_bytes_fetched"),
        "wal_fetched_segments": sum(len(b["files"]) for b in fed),
        "wal_first": found.first if found else None,
        "wal_last": found.last if found else None,
    }


def pgbackrest_pitr(pitr: Pitr) -> dict[str, Any]:
    bench, tool = pitr.bench, pitr.pgbackrest
    assert pitr.target is not None
    tool.target_time = pitr.target.isoformat()
    sizes = tool.log_sizes()
    try:
        result = bvp.pgbackrest_restore(bench, pitr.pgbr_label, restored_values)
    finally:
        tool.target_time = None
    logged = tool.logged_since(sizes)
    handed = sorted(set(HANDED.findall(logged)))
    found = sorted(set(FETCHED.findall(logged)) | set(handed))
    prefix = f"{PGBACKREST_REPO_PATH.strip('/')}/archive/{STANZA}/"
    stored = {
        name[:24]: obj["Size"]
        for obj in list_keys(bench.tls_s3, PGBACKREST_BUCKET, prefix)
        if REPO_SEGMENT.fullmatch(name := obj["Key"].rsplit("/", 1)[-1])
    }
    base_end = pgbackrest_backup_info(pitr)["lsn"]["stop"]
    return checked(pitr, result, base_end) | {
        "wal_fetched_segments": len(found),
        "wal_handed_segments": len(handed),
        "wal_fetched_bytes": len(found) * DEFAULT_SEGMENT_SIZE,
        "wal_fetched_stored_bytes": sum(stored.get(name, 0) for name in found),
        "wal_first": found[0] if found else None,
        "wal_last": found[-1] if found else None,
    }


RESTORES = {SV: shardvault_pitr, PGBR: pgbackrest_pitr}


def restore_rounds(pitr: Pitr, runs: dict[str, list[dict[str, Any]]]) -> None:
    bench = pitr.bench
    for index in range(1, bench.args.runs + 1):
        order = (SV, PGBR) if index % 2 else (PGBR, SV)
        say(f"round {index} of {bench.args.runs}: {' then '.join(order)}")
        for name in order:
            quiet = bvp.quiet_agents(bench)
            bvp.settle(bench)
            load = os.getloadavg()[0]
            result = RESTORES[name](pitr) | {"round": index, "load_before": load} | quiet
            if name == SV:
                bench.agents_busy_until = time.monotonic() + bench.busy_window
            runs.setdefault(name, []).append(result)
            say(
                f"  {name}: {result['seconds']:.1f} s, markers "
                f"{'match' if result['marks_match'] else 'DIFFER'}, WAL replayed "
                f"{(result['wal_replayed_bytes'] or 0) / MiB:,.0f} MiB, fetched "
                f"{result['wal_fetched_bytes'] / MiB:,.0f} MiB "
                f"({result['wal_fetched_stored_bytes'] / MiB:,.0f} MiB stored)"
            )


# --- summary ------------------------------------------------------------------------------------
def median_of(tool_runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in tool_runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    keys = (
        "seconds",
        "wal_replayed_bytes",
        "wal_fetched_bytes",
        "wal_fetched_stored_bytes",
        "wal_fetched_segments",
    )
    for name in (SV, PGBR):
        tool_runs = runs.get(name, [])
        summary[name] = {key: median_of(tool_runs, key) for key in keys} | {
            "runs": len(tool_runs),
            "seconds_each": [round(r["seconds"], 1) for r in tool_runs],
            "marks_match": all(r["marks_match"] for r in tool_runs),
        }
    sv_runs = runs.get(SV, [])
    for state, key in (("Download", "download_seconds"), ("Finish", "finish_seconds")):
        values = [r["states"].get(state) for r in sv_runs if r.get("states")]
        summary[SV][key] = statistics.median(values) if values else None
    summary[PGBR]["restore_seconds"] = median_of(runs.get(PGBR, []), "restore_seconds")
    by_round = {r["round"]: r["seconds"] for r in runs.get(PGBR, [])}
    per_round = [r["seconds"] / by_round[r["round"]] for r in runs.get(SV, [])]
    sv, pgbr = summary[SV]["seconds"], summary[PGBR]["seconds"]
    summary["ratio_of_medians"] = sv / pgbr if sv and pgbr else None
    summary["ratio_per_round"] = [round(r, 3) for r in per_round]
    for name in (SV_BACKUP, PGBR_BACKUP):
        summary[name] = {"seconds": median_of(runs.get(name, []), "seconds")}
    return summary


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MiB:,.0f}"


def markdown(pitr: Pitr, runs: dict, summary: dict, command: str) -> str:
    bench = pitr.bench
    load = bench.setup["load"]
    postgres = bvp._output_line([str(bench.pg.bin_dir / "postgres"), "--version"])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"### Point-in-time restore: ShardVault against pgBackRest (issue 11)\n\n"
        f"```\n{command}\n```\n\n"
        f"ShardVault at {bvp._git_version()}, {when}; {postgres}; "
        f"{bench.pgbackrest.version()}; {os.cpu_count()} CPUs ({bvp._cpu_model()}). "
        f"Scale {bench.args.scale} ({bench.setup['database_bytes'] / MiB:,.0f} MiB database), "
        f"both tools archiving the same WAL (`archive_command`: ShardVault's push, then "
        f"pgBackRest's async `archive-push`); a full backup by each; then "
        f"{load['seconds']:.0f} s of `pgbench -n -c {CLIENTS} -j {JOBS} -R {load['rate']}` "
        f"({load['tps']:,.1f} tps, {load['wal_bytes'] / MiB:,.0f} MiB of WAL), a marker row "
        f"every {bench.args.mark_seconds} s. Target: halfway between the last two markers "
        f"({load['target']}). Each restore into an empty directory, timed to a promoted server "
        f"that passed `pg_amcheck --all`; the restored markers checked against the source's. "
        f"{summary[SV]['runs']} round(s), alternating which tool goes first."
    )
    rows = [
        "| restore to the target time | wall s (each round) | WAL replayed, MiB (base end "
        "to stop) | WAL fetched, MiB (segments) | of it stored, MiB | markers |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    labels = {
        SV: "ShardVault (`--target-time`; base + archive batches from the local stack)",
        PGBR: f"{bench.pgbackrest.version()} (`--type=time`, async archive-get, process-max=2, "
        "zst, bundles, block incremental, TLS)",
    }
    for name in (SV, PGBR):
        entry = summary[name]
        if not entry["runs"]:
            rows.append(f"| {labels[name]} | not run | | | | |")
            continue
        each = ", ".join(f"{s:.1f}" for s in entry["seconds_each"])
        rows.append(
            f"| {labels[name]} | {entry['seconds']:.1f} ({each}) | "
            f"{_mib(entry['wal_replayed_bytes'])} | {_mib(entry['wal_fetched_bytes'])} "
            f"({entry['wal_fetched_segments']:.0f}) | {_mib(entry['wal_fetched_stored_bytes'])} | "
            f"{'exact' if entry['marks_match'] else 'DIFFER'} |"
        )
    ratio = summary["ratio_of_medians"]
    per_round = ", ".join(f"{r:.2f}" for r in summary["ratio_per_round"])
    sv_backup, pgbr_backup = summary[SV_BACKUP]["seconds"], summary[PGBR_BACKUP]["seconds"]
    split = (
        f"Where the time went (medians): ShardVault's Download state (the base's frames) "
        f"{summary[SV].get('download_seconds') or 0:.1f} s and Finish (recovery to the target "
        "fed the archive's batches as it replays, promotion, pg_amcheck) "
        f"{summary[SV].get('finish_seconds') or 0:.1f} s; "
        f"pgBackRest's restore command (the base's files) "
        f"{summary[PGBR].get('restore_seconds') or 0:.1f} s, then start, recovery, promotion "
        f"and pg_amcheck."
    )
    notes = [
        f"ShardVault ÷ pgBackRest wall time: **{ratio:.2f}** of the medians (per round: "
        f"{per_round})."
        if ratio
        else "No ratio: a restore did not run.",
        f"Full backups before the load (one each): ShardVault {sv_backup:.1f} s, pgBackRest "
        f"{pgbr_backup:.1f} s.",
        split,
        "WAL fetched: ShardVault, the archive's batches its WAL feed fetched (those recovery "
        "reached and a few ahead; WAL bytes, stored: compressed, as downloaded); pgBackRest, the "
        "segments its archive-get logged found (async prefetch included; 16 MiB each; stored: "
        "zst).",
    ]
    return "\n\n".join([head, "\n".join(rows), "\n".join(f"- {n}" for n in notes)]) + "\n"


# --- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    avoid_empty_put_stall()
    signal.signal(signal.SIGTERM, bvp._terminate)
    started = time.time()
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as cleanup:
        root = bvp.make_workdir(args, cleanup)
        # Runs after everything else stopped (LIFO): pgBackRest's async processes, by pid.
        cleanup.callback(wal_archive.wait_gone, str(root / "pgbackrest" / "pgbackrest.conf"))
        bench = bvp.setup(args, root, cleanup, make_pgbackrest=PgBackRest.as_users_run_it)
        say(f"setup done in {time.time() - started:.0f} s: {bench.setup}")
        pitr = archive_both(bench, cleanup)
        bench.pg.psql("CREATE TABLE marks (n int, at timestamptz DEFAULT clock_timestamp())")
        bench.setup["primed"] = switch_and_wait(pitr)
        say(f"both archives hold {bench.setup['primed']}")
        backups(pitr, runs)
        bench.setup["load"] = run_load(pitr)
        say(f"load done: {bench.setup['load']}")
        bench.setup["after_load"] = switch_and_wait(pitr)
        say(f"both archives hold {bench.setup['after_load']}; target {pitr.target}")
        restore_rounds(pitr, runs)
        summary = summarize(runs)
        command = shlex.join([".venv/bin/python", "bench/pitr_vs_peers.py", *sys.argv[1:]])
        text = markdown(pitr, runs, summary, command)
        path = bvp.write_results(bench, runs, summary, started, name="pitr_vs_peers", markdown=text)
        say("stopping everything")
    print(text)
    print(f"Raw results: {path}; benchmark wall time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
