"""Continuous WAL archiving under write load: what it costs PostgreSQL's throughput and how far
behind the archive runs, for ShardVault's spool and agent against pgBackRest's async push.

Usage::

    .venv/bin/python bench/wal_archive.py --scale 20 --seconds 60
    .venv/bin/python bench/wal_archive.py --scale 5 --seconds 15 --runs 3 --skip-pgbackrest

One PostgreSQL 15 *template* is made once (``init_instance`` with ``backup_vs_peers``'s
settings: ``wal_level=replica``, ``shared_buffers=512MB``, ``archive_mode=on``; ``pgbench -i -s
SCALE``; a checkpoint; stopped). Every run of every configuration gets a *fresh server*: a copy
of that template (same data, same WAL position, so every run starts alike) with its own
``archive_command`` appended to ``postgresql.conf`` before it starts (no reload race). Each
round runs the configurations in this order, so that noise from the shared machine hits all:

1. ``baseline``: ``archive_command = '/bin/true'``.
2. ``shardvault``: the system python3 running a copy of ``agents/shardvault_agent/wal/walspool.py``
   (``--spool DIR --max-bytes 2^34 %p``, as ``tests/integration/conftest.py``'s
   ``ArchivingNode`` sets it up), and a ShardVault agent (``wal_spool_dir``, ``archive_poll_seconds
   0.2``, other settings at their defaults) storing the spool into the local stack (moto control
   plane in this process, MinIO as the store). The cluster's policy says
   ``archive: {max_delay_seconds: --max-delay}``; each run has its own cluster name, so runs never
   share an archive.
3. ``pgbackrest``: pgBackRest 2.45 ``archive-push`` with ``archive-async=y``, a spool path,
   ``process-max=2``, ``compress-type=zst``, into its own MinIO over TLS (``peers.PgBackRest``,
   as ``backup_vs_peers.py`` runs it), each run its own repository path and a fresh stanza.

A run: start the server (and the agent, or create the stanza); close the current segment
(``pg_switch_wal``) and wait until it is archived, end to end (primes every path); ``sync``;
then ``pgbench -c CLIENTS -j min(CLIENTS, cores) -T SECONDS -n`` (no rate limit); when it
exits, ``pg_switch_wal`` closes the last segment and the run waits until the archive is
complete: ``baseline`` and ``pgbackrest``, ``pg_stat_archiver`` shows that segment archived
(pgBackRest's async push answers PostgreSQL only once the segment is in its repository);
``shardvault``, the spool is empty and the segment is in a batch whose index is in the store.

Measured, per run (all in the JSON; the table pools or spreads them):

* *tps*: pgbench's own (without connection time); its ratio to the same round's baseline.
* *WAL written*: the LSN distance over the load; *segments produced*: from the segment the load
  started in to the one switched out after it. *Archived*: ShardVault, the segments in the
  indexes (``archive.archived_batches``); pgBackRest, the segments listed in its repository;
  baseline, ``pg_stat_archiver.archived_count``'s delta.
* *lag*, per segment (p50 / p99 / max, pooled over the runs): a thread samples
  ``pg_current_wal_lsn()`` and ``pg_stat_archiver.last_archived_wal`` every 0.1 s on one
  connection; a segment is *closed* when PostgreSQL writes past it and *handed over* when
  ``last_archived_wal`` reaches it (each the midpoint of the two samples around it: ±0.05 s).
  *Handed over* is what PostgreSQL waits for: the spool's fsync for ShardVault, the repository
  for pgBackRest's async push (which pushes ahead of PostgreSQL's calls, so a segment can be
  in its store before it is handed over). *In store*: ShardVault, the batch's ``archived_at``
  in its index (the archive function's clock: this machine's); pgBackRest, the segment
  object's ``LastModified`` in MinIO. ShardVault's *push to store* is exact: ``archived_at -
  pushed_at`` (the spool file's mtime).
* *stored bytes*: ShardVault, the batches' objects and their indexes; pgBackRest, the segment
  objects (its ``archive.info`` files are left out); ÷ the archived segments' 16 MiB each.
* *complete after load*: pgbench's exit to the archive complete (as above; polled every 0.1 s).
* *CPU*: the machine's busy cores during the load (``/proc/stat``: other work on the shared
  machine counts too); the agent's CPU seconds and peak RSS. Not measured: pgBackRest's CPU
  (its async process detaches from PostgreSQL's archiver) and the control plane's in this
  process (on AWS, Lambda's).

A failed pgBackRest run is reported in its row (and the JSON) and the benchmark goes on; a
failed baseline or ShardVault run ends it. The table and a JSON summary go to stdout; with
``--out DIR`` the full results (every segment's lags) are written there too. The work
directory (a temp dir under ``--out``, default ``/tmp``) and everything started (PostgreSQL,
MinIO twice, moto, agents, pgBackRest's async processes) are stopped and removed at the end,
also on failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Protocol

import backup_vs_peers as bvp
import psycopg
import report
import yaml
from peers import (
    PGBACKREST_BUCKET,
    PGBACKREST_REPO_PATH,
    STANZA,
    PgBackRest,
    ensure_bucket,
    list_keys,
    peak_rss_bytes,
    process_cpu,
    s3_client_for,
    start_tls_minio,
)

from shardvault.contracts import layout
from shardvault.contracts.pgwal import DEFAULT_SEGMENT_SIZE, SEGMENT_NAME, segment_number
from shardvault.local import demo
from shardvault.local.minio import MinioServer
from shardvault.local.postgres import (
    PostgresInstance,
    attach_instance,
    find_pg_bin_dir,
    give_to_postgres,
    init_instance,
    pgbench_init,
    start_pgbench,
    stop_process,
)
from shardvault.local.stack import LocalStack
from shardvault.wal import archive

KINDS = ("baseline", "shardvault", "pgbackrest")
LABELS = {
    "baseline": "archive_command = '/bin/true' (baseline)",
    "shardvault": "ShardVault: walspool.py push + agent to the local stack",
    "pgbackrest": "pgBackRest 2.45 archive-push, async, process-max=2, zst, TLS",
}
MiB = 1024 * 1024
ARCHIVE_POLL_SECONDS = 0.2  # ArchivingNode's; the default (1 s) would add up to 1 s of lag
CLUSTER_PREFIX = "walbench"  # + the round: each ShardVault run archives into its own cluster
SHARD_ID = "shard-1"
SAMPLE_SECONDS = 0.1  # one query on an open connection: far below the load's noise
DONE_POLL_SECONDS = 0.1
PRIME_TIMEOUT = 180.0  # a configuration that cannot archive one segment fails here, early
COMPLETE_TIMEOUT = 1800.0
LOAD_GRACE = 120.0  # pgbench -T may overrun its time a little (a transaction in flight)
GONE_TIMEOUT = 60.0
TPS = re.compile(r"tps = ([\d.]+) \(without initial connection time\)")
PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=20, help="pgbench scale (20 ≈ 300 MiB)")
    parser.add_argument("--seconds", type=int, default=60, help="pgbench load per run")
    parser.add_argument("--clients", type=int, default=4, help="pgbench clients (-c)")
    parser.add_argument(
        "--max-delay",
        type=float,
        default=1.0,
        help="ShardVault's archive.max_delay_seconds (policy): a WAL file's longest wait for "
        "others to share its batch",
    )
    parser.add_argument("--runs", type=int, default=1, help="rounds: runs of each configuration")
    parser.add_argument("--skip-pgbackrest", action="store_true", help="no pgBackRest runs")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="parent of the work directory (removed at the end) and where the full results "
        "JSON is written (default: the work directory under TMP, and no results file)",
    )
    args = parser.parse_args(argv)
    if min(args.scale, args.seconds, args.clients, args.runs) < 1:
        parser.error("--scale, --seconds, --clients and --runs must be at least 1")
    if not 0 < args.max_delay <= 3600:
        parser.error("--max-delay must be > 0 and <= 3600 (the policy's bounds)")
    args.kinds = [k for k in KINDS if not (k == "pgbackrest" and args.skip_pgbackrest)]
    return args


# --- WAL segment names --------------------------------------------------------------------------
def segment_name(timeline: str, number: int) -> str:
    per_high = 0x100000000 // DEFAULT_SEGMENT_SIZE
    return f"{timeline}{number // per_high:08X}{number % per_high:08X}"


def current_segment(pg: PostgresInstance) -> str:
    # + 1: pg_walfile_name of an LSN right at a segment boundary names the segment before it,
    # and right after pg_switch_wal the LSN is exactly there.
    return pg.psql("SELECT pg_walfile_name(pg_current_wal_lsn() + 1)")


def switch_segment(pg: PostgresInstance) -> str:
    """Closes the segment being written (so that it is archived); returns its name."""
    return pg.psql("SELECT pg_walfile_name(pg_switch_wal())")


def last_archived(pg: PostgresInstance) -> str:
    return pg.psql("SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver")


def archiver_counts(pg: PostgresInstance) -> tuple[int, int]:
    row = pg.psql("SELECT archived_count, failed_count FROM pg_stat_archiver")
    archived, failed = row.split("|")
    return int(archived), int(failed)


@dataclass(frozen=True)
class Window:
    """The segments a run's load wrote: ``first`` (written when it began) to ``last`` (switched
    out after it ended), one timeline."""

    first: str
    last: str

    @property
    def segments(self) -> list[str]:
        numbers = range(segment_number(self.first), segment_number(self.last) + 1)
        return [segment_name(self.first[:8], n) for n in numbers]

    def holds(self, name: str) -> bool:
        return bool(SEGMENT_NAME.fullmatch(name)) and self.first <= name <= self.last


# --- sampling PostgreSQL ------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    at: float
    writing: str  # the segment PostgreSQL writes
    archived: str  # pg_stat_archiver.last_archived_wal ('' before the first)


class SegmentWatch:
    """Samples, on one connection (a psql per sample would cost a process start each), which
    segment PostgreSQL writes and which it last archived: when each segment was closed and
    when its archive_command succeeded."""

    QUERY = (
        "SELECT pg_walfile_name(pg_current_wal_lsn() + 1), coalesce(last_archived_wal, '') "
        "FROM pg_stat_archiver"
    )

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.samples: list[Sample] = []
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="segment-watch", daemon=True)

    def start(self) -> SegmentWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        if self.error:
            raise RuntimeError(f"sampling PostgreSQL failed: {self.error}") from self.error

    def _run(self) -> None:
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                while True:
                    # One more sample once stop() is called: the run stops the watch right
                    # after the archive is complete, maybe before a sample saw it.
                    last = self.stopping.is_set()
                    writing, archived = conn.execute(self.QUERY).fetchone()
                    self.samples.append(Sample(time.time(), writing, archived))
                    if last:
                        return
                    self.stopping.wait(SAMPLE_SECONDS)
        except Exception as error:  # reported by stop()
            self.error = error

    def first_time(self, reached: Callable[[Sample], bool]) -> float | None:
        """The midpoint of the two samples around the first one where ``reached`` holds."""
        for i, sample in enumerate(self.samples):
            if reached(sample):
                return sample.at if i == 0 else (self.samples[i - 1].at + sample.at) / 2
        return None

    def closed_at(self, segment: str) -> float | None:
        return self.first_time(lambda s: s.writing > segment)

    def handed_at(self, segment: str) -> float | None:
        return self.first_time(lambda s: s.archived >= segment)


# --- the configurations -------------------------------------------------------------------------
@dataclass
class Env:
    """What every run shares: the template, the local stack, pgBackRest's TLS MinIO."""

    args: argparse.Namespace
    root: Path
    template: Path  # the template's data directory (stopped)
    stack: LocalStack
    tls_minio: MinioServer | None
    tls_s3: Any
    push_client: Path  # the copy of walspool.py the postgres user runs


class Archiving(Protocol):
    kind: ClassVar[str]

    def archive_command(self) -> str: ...

    def attach(self, pg: PostgresInstance) -> None:
        """Called once the server runs, before anything is archived on purpose."""

    def done(self, pg: PostgresInstance, last: str) -> bool:
        """Whether every WAL file up to ``last`` is archived, end to end."""

    def cpu_seconds(self) -> float | None: ...

    def measure(self, window: Window) -> dict[str, Any]:
        """What the archive holds of ``window``: ``segments_archived``, ``stored_bytes``,
        ``stored_at`` (segment -> epoch seconds), and whatever else this tool tells."""

    def stop(self) -> None:
        """After the server stopped: whatever this configuration started is stopped."""


@dataclass
class Baseline:
    env: Env
    run_dir: Path
    index: int
    kind: ClassVar[str] = "baseline"

    def archive_command(self) -> str:
        return "/bin/true"

    def attach(self, pg: PostgresInstance) -> None:
        pass

    def done(self, pg: PostgresInstance, last: str) -> bool:
        return last_archived(pg) >= last

    def cpu_seconds(self) -> float | None:
        return None

    def measure(self, window: Window) -> dict[str, Any]:
        return {}  # nothing is stored: archived_count's delta counts the segments

    def stop(self) -> None:
        pass


@dataclass
class ShardVaultArchiving:
    env: Env
    run_dir: Path
    index: int
    kind: ClassVar[str] = "shardvault"
    agent: subprocess.Popen | None = None

    @property
    def cluster(self) -> str:
        return f"{CLUSTER_PREFIX}-{self.index}"

    @property
    def node_id(self) -> str:
        return f"{self.cluster}-n1"

    @property
    def spool(self) -> Path:
        return self.run_dir / "spool"

    def archive_command(self) -> str:
        self.spool.mkdir()
        give_to_postgres(self.spool)  # the push writes as the server's user
        return bvp.push_command(self.env.push_client, self.spool)

    def attach(self, pg: PostgresInstance) -> None:
        shard = {
            "shard_id": SHARD_ID,
            "role": "leader",
            "data_dir": str(pg.data_dir),
            "conninfo": pg.conninfo,
            "wal_spool_dir": str(self.spool),
        }
        config = demo.agent_config(self.run_dir, self.cluster, self.node_id, "postgres", [shard])
        config["archive_poll_seconds"] = ARCHIVE_POLL_SECONDS
        self.agent = self.env.stack.start_agent(config)
        self.env.stack.wait_for_nodes([self.node_id])

    def batches(self, since: str) -> list[dict[str, Any]]:
        return archive.archived_batches(self.env.stack.services(), self.cluster, SHARD_ID, since)

    def done(self, pg: PostgresInstance, last: str) -> bool:
        # The spool first (no request): the agent deletes a file only once its batch is
        # recorded, and PostgreSQL pushes in order, so an empty spool and ``last`` in an index
        # mean every file before it is in the store too.
        if any(self.spool.iterdir()):
            return False
        return any(f["name"] == last for b in self.batches(last) for f in b["files"])

    def cpu_seconds(self) -> float | None:
        return process_cpu(self.agent.pid) if self.agent else None

    def measure(self, window: Window) -> dict[str, Any]:
        svc = self.env.stack.services()
        prefix = layout.archive_prefix(svc.store.prefix, self.cluster, SHARD_ID)
        sizes = {o["Key"]: o["Size"] for o in list_keys(svc.store_bucket, prefix)}
        batches = [
            b
            for b in self.batches(window.first)
            if any(window.holds(f["name"]) for f in b["files"])
        ]
        files = [(f, b) for b in batches for f in b["files"] if window.holds(f["name"])]
        return {
            "segments_archived": len({f["name"] for f, _ in files}),
            "stored_bytes": sum(
                sizes[b["key"]] + sizes[layout.index_key(b["key"])] for b in batches
            ),
            "stored_at": {f["name"]: b["archived_at"] for f, b in files},
            "push_to_store": [round(b["archived_at"] - f["pushed_at"], 3) for f, b in files],
            "batches": len(batches),
            "agent_peak_rss": peak_rss_bytes(self.agent.pid) if self.agent else None,
        }

    def stop(self) -> None:
        self.env.stack.stop_agent(self.node_id)


@dataclass
class AsyncPgBackRest(PgBackRest):
    """``peers.PgBackRest`` with asynchronous archive-push and its own repository path."""

    spool_path: Path | None = None
    repo_path: str = PGBACKREST_REPO_PATH

    def config_text(self) -> str:
        text = (
            super()
            .config_text()
            .replace(f"repo1-path={PGBACKREST_REPO_PATH}\n", f"repo1-path={self.repo_path}\n")
        )
        options = f"archive-async=y\nspool-path={self.spool_path}\n"
        return text.replace("[global]\n", f"[global]\n{options}", 1)

    def write_config(self) -> None:
        if self.spool_path is None:
            raise RuntimeError("async archive-push needs a spool path")
        self.spool_path.mkdir(parents=True, exist_ok=True)
        give_to_postgres(self.spool_path)
        super().write_config()


def processes_with(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (a path in this run's directory, so only
    processes this run started: pgBackRest's async push and its workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def wait_gone(marker: str, timeout: float = GONE_TIMEOUT) -> None:
    """Waits for those processes to exit (pgBackRest's async push does once its queue is
    empty); ends them (by pid) if they do not."""
    deadline = time.monotonic() + timeout
    while (pids := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


@dataclass
class PgBackRestArchiving:
    env: Env
    run_dir: Path
    index: int
    kind: ClassVar[str] = "pgbackrest"
    tool: AsyncPgBackRest = field(init=False)

    def __post_init__(self) -> None:
        if self.env.tls_minio is None:
            raise RuntimeError("pgBackRest's MinIO was not started")
        self.tool = AsyncPgBackRest(
            self.run_dir / "pgbackrest",
            self.env.tls_minio,
            compress_type="zst",
            spool_path=self.run_dir / "pgbackrest-spool",
            repo_path=f"/{CLUSTER_PREFIX}-{self.index}",  # the copies share a system id
        )

    def archive_command(self) -> str:
        # Its config file is written once the server runs (it names the port); the server
        # archives nothing before then.
        return self.tool.archive_command

    def attach(self, pg: PostgresInstance) -> None:
        self.tool.instance = pg
        self.tool.write_config()
        self.tool.stanza_create()

    def done(self, pg: PostgresInstance, last: str) -> bool:
        # Async: archive-push reports success only once the async process stored the segment.
        return last_archived(pg) >= last

    def cpu_seconds(self) -> float | None:
        return None  # the async process is detached: not measured

    def measure(self, window: Window) -> dict[str, Any]:
        prefix = f"{self.tool.repo_path.strip('/')}/archive/{STANZA}/"
        stored_at, stored_bytes = {}, 0
        for obj in list_keys(self.env.tls_s3, PGBACKREST_BUCKET, prefix):
            name = obj["Key"].rsplit("/", 1)[-1][:24]  # <segment>-<sha1>.zst
            if window.holds(name):
                stored_at[name] = obj["LastModified"].timestamp()
                stored_bytes += obj["Size"]
        return {
            "segments_archived": len(stored_at),
            "stored_bytes": stored_bytes,
            "stored_at": stored_at,
        }

    def stop(self) -> None:
        wait_gone(str(self.tool.config_path))


ARCHIVINGS: dict[str, type] = {
    "baseline": Baseline,
    "shardvault": ShardVaultArchiving,
    "pgbackrest": PgBackRestArchiving,
}


# --- setup --------------------------------------------------------------------------------------
def write_policy(path: Path, runs: int, max_delay: float) -> None:
    """One cluster per ShardVault run, as ``policy_for`` in the integration tests writes it."""
    entry = {
        "engine": "postgres",
        "schedule": {"full": "0 2 * * *"},
        "vault": {"storage_class": "GLACIER_IR", "object_lock": {"mode": "GOVERNANCE", "days": 1}},
        "retention": {"keep_daily": 1},
        "archive": {"max_delay_seconds": max_delay},
    }
    clusters = {f"{CLUSTER_PREFIX}-{i}": entry for i in range(1, runs + 1)}
    path.write_text(yaml.safe_dump({"version": 1, "clusters": clusters}, sort_keys=False))


def make_template(args: argparse.Namespace, root: Path, cleanup: contextlib.ExitStack) -> Path:
    """The data every run starts from: filled, checkpointed, stopped."""
    data = root / "template" / "data"
    cleanup.callback(bvp.stop_postgres_at, data)
    bvp.say(f"template: initdb, pgbench -i -s {args.scale}")
    pg = init_instance(data, settings=bvp.pg_settings("/bin/true"))
    pgbench_init(pg, args.scale)
    pg.psql("CHECKPOINT")
    pg.stop()
    return data


def setup(args: argparse.Namespace, root: Path, cleanup: contextlib.ExitStack) -> Env:
    policy = root / "policy.yaml"
    write_policy(policy, args.runs, args.max_delay)
    bvp.say("starting the local stack" + ("" if args.skip_pgbackrest else " and the TLS MinIO"))
    stack = LocalStack(root / "stack", require_minio=True, policy_file=policy)
    cleanup.callback(stack.stop)  # before start(): a half-started stack is stopped too
    stack.start()
    tls_minio, tls_s3 = None, None
    if not args.skip_pgbackrest:
        tls_minio = start_tls_minio(root / "minio-tls")
        cleanup.callback(tls_minio.stop)
        tls_s3 = s3_client_for(tls_minio)
        ensure_bucket(tls_s3, PGBACKREST_BUCKET)
    template = make_template(args, root, cleanup)
    return Env(args, root, template, stack, tls_minio, tls_s3, bvp.copy_push_client(root))


# --- one run ------------------------------------------------------------------------------------
def quoted(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def fresh_server(template: Path, run_dir: Path, archive_command: str) -> PostgresInstance:
    """A copy of the template with ``archive_command`` set before it starts (the last line of
    postgresql.conf wins), started on its own port."""
    data = run_dir / "data"
    shutil.copytree(template, data, symlinks=True)
    with open(data / "postgresql.conf", "a") as conf:
        conf.write(f"archive_command = {quoted(archive_command)}\n")
    return attach_instance(data)  # owned by the postgres user, started


def wait_done(pg: PostgresInstance, archiving: Archiving, last: str, timeout: float) -> float:
    """Polls until the archive holds everything up to ``last``; returns when it did."""
    deadline = time.monotonic() + timeout
    while not archiving.done(pg, last):
        if time.monotonic() > deadline:
            counts = pg.psql("SELECT * FROM pg_stat_archiver")
            raise TimeoutError(
                f"{archiving.kind}: {last} not archived after {timeout:.0f} s; "
                f"pg_stat_archiver: {counts}. Server log:\n{pg.log_tail(10)}"
            )
        time.sleep(DONE_POLL_SECONDS)
    return time.time()


def cpu_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def run_load(pg: PostgresInstance, args: argparse.Namespace) -> dict[str, Any]:
    """pgbench for ``--seconds`` at the rate the server sustains; its tps."""
    jobs = min(args.clients, os.cpu_count() or 1)  # more threads than cores only add switches
    load = start_pgbench(pg, clients=args.clients, jobs=jobs, seconds=args.seconds)
    try:
        output, _ = load.communicate(timeout=args.seconds + LOAD_GRACE)
    except BaseException:
        stop_process(load)
        raise
    tps, processed = TPS.search(output), PROCESSED.search(output)
    if load.returncode != 0 or not (tps and processed):
        raise RuntimeError(f"pgbench exited with {load.returncode}:\n{output}")
    return {"tps": float(tps[1]), "transactions": int(processed[1]), "pgbench_jobs": jobs}


def lags(
    window: Window, start: Callable[[str], float | None], end: Callable[[str], float | None]
) -> list[float]:
    """``end - start`` for each segment of the window where both are known."""
    out = []
    for segment in window.segments:
        began, ended = start(segment), end(segment)
        if began is not None and ended is not None:
            out.append(round(ended - began, 3))
    return out


def measure_load(env: Env, pg: PostgresInstance, archiving: Archiving) -> dict[str, Any]:
    """Primes archiving, runs the load, waits for the archive to be complete: the run's
    figures."""
    pg.psql("CREATE TABLE IF NOT EXISTS walbench_marker (at timestamptz DEFAULT now())")
    pg.psql("INSERT INTO walbench_marker DEFAULT VALUES")  # WAL in the segment to switch
    wait_done(pg, archiving, switch_segment(pg), PRIME_TIMEOUT)
    os.sync()  # the template's copy must not be written back during the load
    first, (archived0, failed0) = current_segment(pg), archiver_counts(pg)
    start_lsn = pg.psql("SELECT pg_current_wal_lsn()")
    watch = SegmentWatch(pg.conninfo).start()
    try:
        busy0, cpu0 = cpu_busy_seconds(), archiving.cpu_seconds()
        load_before = os.getloadavg()[0]  # other work on the shared machine, for the record
        started = time.time()
        load = run_load(pg, env.args)
        load_end = time.time()
        busy = cpu_busy_seconds() - busy0
        wal_bytes = int(pg.psql(f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{start_lsn}')"))
        window = Window(first, switch_segment(pg))
        complete_at = wait_done(pg, archiving, window.last, COMPLETE_TIMEOUT)
        cpu1 = archiving.cpu_seconds()
    finally:
        watch.stop()
    archived1, failed1 = archiver_counts(pg)
    measured = archiving.measure(window)
    stored_at = measured.pop("stored_at", {})
    segments_archived = measured.pop("segments_archived", archived1 - archived0)
    stored = measured.pop("stored_bytes", None)
    return {
        **load,
        "load_seconds": round(load_end - started, 2),
        "wal_bytes": wal_bytes,
        "first_segment": window.first,
        "last_segment": window.last,
        "segments_produced": len(window.segments),
        "segments_archived": segments_archived,
        "archived_count": archived1 - archived0,
        "failed_count": failed1 - failed0,
        "complete_after_load_seconds": round(complete_at - load_end, 2),
        "lag_handed": lags(window, watch.closed_at, watch.handed_at),
        "lag_stored": lags(window, watch.closed_at, stored_at.get),
        "stored_bytes": stored,
        "stored_ratio": stored / (segments_archived * DEFAULT_SEGMENT_SIZE) if stored else None,
        "cpu_busy_cores": round(busy / (load_end - started), 2),
        "load_before": round(load_before, 2),
        "agent_cpu_seconds": round(cpu1 - cpu0, 2) if cpu0 is not None else None,
        "samples": len(watch.samples),
        **measured,
    }


def run_once(env: Env, kind: str, index: int) -> dict[str, Any]:
    run_dir = env.root / f"{kind}-{index}"
    run_dir.mkdir()
    archiving: Archiving = ARCHIVINGS[kind](env, run_dir, index)
    try:
        pg = fresh_server(env.template, run_dir, archiving.archive_command())
        archiving.attach(pg)
        return {"round": index} | measure_load(env, pg, archiving)
    finally:
        bvp.stop_postgres_at(run_dir / "data")
        archiving.stop()
        shutil.rmtree(run_dir, ignore_errors=True)  # disk space: a copy per run


def run_rounds(env: Env) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in env.args.kinds}
    for index in range(1, env.args.runs + 1):
        bvp.say(f"round {index} of {env.args.runs}")
        for kind in env.args.kinds:
            try:
                result = run_once(env, kind, index)
            except Exception as error:
                if kind != "pgbackrest":
                    raise  # the baseline and ShardVault must work; the peer may be reported
                result = {"round": index, "error": f"{type(error).__name__}: {error}"}
                bvp.say(f"  {kind} FAILED: {result['error']}")
            else:
                bvp.say(
                    f"  {kind}: {result['tps']:.0f} tps, {result['segments_produced']} segments, "
                    f"{result['segments_archived']} archived, complete "
                    f"{result['complete_after_load_seconds']:.1f} s after the load"
                )
            runs[kind].append(result)
    return runs


# --- summary ------------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]  # nearest rank


def pooled(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    values = [v for run in runs for v in run.get(key) or []]
    if not values:
        return None
    return {
        "segments": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def spread_of(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> dict | None:
    values = [run[key] / scale for run in runs if run.get(key) is not None]
    return report.spread(values) if values else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    baseline = {r["round"]: r["tps"] for r in runs["baseline"] if "error" not in r}
    summary = {}
    for kind, kind_runs in runs.items():
        ok = [r for r in kind_runs if "error" not in r]
        entry: dict[str, Any] = {"label": LABELS[kind], "runs": len(kind_runs)}
        entry["errors"] = [r["error"] for r in kind_runs if "error" in r]
        if ok:
            ratios = [r["tps"] / baseline[r["round"]] for r in ok if r["round"] in baseline]
            entry |= {
                "tps": spread_of(ok, "tps"),
                "tps_ratio_per_round": report.spread(ratios) if ratios else None,
                "tps_ratio_of_medians": statistics.median(r["tps"] for r in ok)
                / statistics.median(baseline.values()),
                "wal_mib": spread_of(ok, "wal_bytes", MiB),
                "segments_produced": spread_of(ok, "segments_produced"),
                "segments_archived": spread_of(ok, "segments_archived"),
                "failed_count": spread_of(ok, "failed_count"),
                "lag_handed_s": pooled(ok, "lag_handed"),
                "lag_stored_s": pooled(ok, "lag_stored"),
                "push_to_store_s": pooled(ok, "push_to_store"),
                "stored_mib": spread_of(ok, "stored_bytes", MiB),
                "stored_ratio": spread_of(ok, "stored_ratio"),
                "complete_after_load_s": spread_of(ok, "complete_after_load_seconds"),
                "cpu_busy_cores": spread_of(ok, "cpu_busy_cores"),
                "load_before": spread_of(ok, "load_before"),
                "batches": spread_of(ok, "batches"),
                "agent_cpu_seconds": spread_of(ok, "agent_cpu_seconds"),
                "agent_peak_rss_mib": spread_of(ok, "agent_peak_rss", MiB),
            }
        summary[kind] = entry
    return summary


def cell(values: dict[str, float] | None, digits: int = 1) -> str:
    """One value, or min / median / max when the runs differ."""
    if not values:
        return "—"
    if values["min"] == values["max"]:
        return f"{values['median']:,.{digits}f}"
    return report.spread_text(values, digits)


def lag_cell(values: dict[str, float] | None) -> str:
    if not values:
        return "—"
    return " / ".join(f"{values[k]:.2f}" for k in ("p50", "p99", "max"))


def main_table(summary: dict[str, Any]) -> str:
    rows = [
        "| configuration | tps | ÷ baseline: of medians (per round) | WAL MiB written | "
        "segments produced / archived | archive_command done after the segment closed, s "
        "(p50 / p99 / max) | in the store after the segment closed, s (p50 / p99 / max) | "
        "stored MiB (÷ 16 MiB per archived segment) | archive complete after the load, s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in summary.values():
        # An error's text may span lines (a tool's output): one line in a table cell.
        errors = " ".join("; ".join(entry["errors"]).split())[:300]
        if "tps" not in entry:
            rows.append(f"| {entry['label']} | failed: {errors} |" + " |" * 7)
            continue
        label = entry["label"]
        if errors:
            label += f" ({len(entry['errors'])} of {entry['runs']} runs failed: {errors})"
        ratio = f"{entry['tps_ratio_of_medians']:.3f}"
        if entry["runs"] > 1 and entry["tps_ratio_per_round"]:
            ratio += f" ({report.spread_text(entry['tps_ratio_per_round'], 3)})"
        stored = "—"
        if entry["stored_mib"]:
            stored = f"{cell(entry['stored_mib'], 2)} ({cell(entry['stored_ratio'], 3)})"
        rows.append(
            f"| {label} | {cell(entry['tps'], 0)} | {ratio} | {cell(entry['wal_mib'])} | "
            f"{cell(entry['segments_produced'], 0)} / {cell(entry['segments_archived'], 0)} | "
            f"{lag_cell(entry['lag_handed_s'])} | {lag_cell(entry['lag_stored_s'])} | {stored} | "
            f"{cell(entry['complete_after_load_s'], 2)} |"
        )
    return "\n".join(rows)


def detail_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    shardvault = summary.get("shardvault", {})
    if "tps" in shardvault:
        lines.append(
            f"- ShardVault: {cell(shardvault['batches'], 0)} batches; push (spool file's mtime) to "
            f"the batch's index, s (p50 / p99 / max): {lag_cell(shardvault['push_to_store_s'])}; "
            f"agent CPU {cell(shardvault['agent_cpu_seconds'], 2)} s over the load and catch-up, "
            f"peak RSS {cell(shardvault['agent_peak_rss_mib'])} MiB."
        )
    for kind, entry in summary.items():
        if "tps" in entry:
            lines.append(
                f"- {kind}: machine CPU busy during the load {cell(entry['cpu_busy_cores'], 2)} "
                f"cores (of {os.cpu_count()}), load average before it "
                f"{cell(entry['load_before'], 2)}; archive_command failures "
                f"{cell(entry['failed_count'], 0)}."
            )
    if "pgbackrest" in summary:
        lines.append(
            "- pgBackRest: 'in the store' is the segment object's LastModified in its MinIO; "
            "it can come before 'archive_command done' (the async process pushes segments "
            "ahead of PostgreSQL's calls, which then find them done); its CPU is not measured "
            "(the async process detaches)."
        )
    return lines


def header(args: argparse.Namespace) -> str:
    postgres = bvp._output_line([str(find_pg_bin_dir() / "postgres"), "--version"])
    pgbackrest = "" if args.skip_pgbackrest else f", {bvp._output_line(['pgbackrest', 'version'])}"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"# Continuous WAL archiving under pgbench load\n\n"
        f"ShardVault at {bvp._git_version()}, {when}; {postgres}{pgbackrest}; "
        f"{os.cpu_count()} CPUs ({bvp._cpu_model()}). Scale {args.scale}, {args.seconds} s of "
        f"`pgbench -c {args.clients}` (no rate limit) per run, {args.runs} run(s) of each "
        f"configuration, each on a fresh copy of one template server; ShardVault's "
        f"archive.max_delay_seconds {args.max_delay}. Lags are sampled every {SAMPLE_SECONDS} s "
        f"(±{SAMPLE_SECONDS / 2} s), but push to store."
    )


def write_results(args: argparse.Namespace, runs: dict, summary: dict, text: str) -> Path | None:
    if args.out is None:
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"wal_archive-{stamp}.json"
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path.write_text(json.dumps({"args": arguments, "runs": runs, "summary": summary}, indent=1))
    path.with_suffix(".md").write_text(text + "\n")
    return path


def rounded(value: Any) -> Any:
    """``value`` with its floats to 3 decimals (the JSON printed, not the results file)."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def summary_document(args: argparse.Namespace, summary: dict, runs: dict) -> dict[str, Any]:
    """The printed JSON: what ran, the summary, and each run without its per-segment lists
    (those go to the results file only)."""
    return {
        "commit": bvp._git_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **{f"summary.{kind}": entry for kind, entry in summary.items()},
        **{
            f"runs.{kind}": [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rs]
            for kind, rs in runs.items()
        },
    }


def compact_json(document: dict[str, Any]) -> str:
    """One line per top-level entry: short enough to read, still one JSON object."""
    lines = [f" {json.dumps(key)}: {json.dumps(rounded(value))}" for key, value in document.items()]
    return "{\n" + ",\n".join(lines) + "\n}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, bvp._terminate)  # unwinds the ExitStack below
    started = time.time()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as cleanup:
        # backup_vs_peers' work directory: traversable by the postgres user, removed at exit.
        root = bvp.make_workdir(argparse.Namespace(workdir=args.out, keep=False), cleanup)
        env = setup(args, root, cleanup)
        runs = run_rounds(env)
        summary = summarize(runs)
        text = "\n\n".join([header(args), main_table(summary), "\n".join(detail_lines(summary))])
        bvp.say("stopping everything")
    path = write_results(args, runs, summary, text)
    print(text)
    print(f"\n```json\n{compact_json(summary_document(args, summary, runs))}\n```")
    saved = f"; full results in {path}" if path else ""
    print(f"\nBenchmark wall time {time.time() - started:.0f} s{saved}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
