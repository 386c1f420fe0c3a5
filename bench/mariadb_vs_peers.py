"""ShardVault's full backup of a MariaDB server against ``mariabackup --stream`` piped through
zstd to S3, each under the same write load, in one run on one machine (issue 12).

Usage::

    .venv/bin/python bench/mariadb_vs_peers.py [--tables 5] [--rows 1000000] [--runs 3]
        [--load-fraction 0.7] [--no-restores] [--out bench/results] [--workdir /tmp/mbench]

Terms:

* *server*: one MariaDB 10.11 made and started by ``shardvault.local.mariadb.init_server``
  (``mariadbd --no-defaults`` on a Unix socket, as the mysql user when root), its InnoDB
  buffer pool set to 512 MiB once started (``BUFFER_POOL``), everything else at MariaDB's
  defaults (``innodb_flush_log_at_trx_commit=1``, a 96 MiB redo log).
* *dataset*: database ``sbtest`` with ``--tables`` tables ``sbtest<n>`` of ``--rows`` rows each,
  sysbench's oltp table (``id`` primary key, ``k`` with its secondary index ``k_<n>`` built
  after the rows, ``c CHAR(120)`` and ``pad CHAR(60)`` of groups of 11 random digits, as
  sysbench fills them), filled by ``INSERT ... SELECT`` from MariaDB's ``seq_<a>_to_<b>``
  sequence tables, ``FILL_CHUNK`` rows a transaction; and database ``bank``
  (``shardvault.local.mariadb.Transfers``' accounts and moves), which the write load writes.
  After the fill the dirty pages are flushed (untimed).
* *write load*: a process of its own (the local stack's control plane runs in this process,
  and a thread here would share its interpreter lock) holding one ``mariadb`` client session,
  sending one small transaction at a time, as ``Transfers`` does: two balance updates and an
  insert into the moves log, committed (one redo-log fsync each), then a ``SELECT`` of its
  number, whose answer is the commit's acknowledgement. It runs open loop at a fixed *rate*:
  transaction n is *due* at start + n / rate and sent when due, or at once when behind (the
  backlog is kept, as ``sysbench --rate`` keeps it). Its *maximum rate* is the same load
  without a rate, measured once after the fill (``--max-seconds``, after 3 s of warm-up);
  the rate of the runs is ``--load-fraction`` (0.7) of it. The load runs through every backup
  and its baseline, and is paused during restores.
* *backup window*: ShardVault's, ``start_backup`` to the execution's stop; the peer's, its
  first process's start to the upload's completion and both processes' exit. *tps during
  the backup*: transactions committed (acknowledged) in the window ÷ its length. *Baseline*:
  a window of the same length right after the machine is settled again following the backup,
  with no backup running; *tps ratio*: during ÷ baseline (its *drop*: 1 - ratio);
  *transactions short*: the baseline's tps times the window's length less the transactions
  committed in the window (unlike the ratio, not diluted by a longer window). *Latency*:
  a transaction's acknowledgement time less its due time (the backlog's wait included), p99
  over a window. *tps during the copy*: the same count over the part of the window in which
  mariabackup ran (ShardVault: the agent's ``checkpoint`` command, from its log; the peer:
  its whole window), ÷ the baseline's tps; *after the copy*: the same over the rest of
  ShardVault's window (packing and uploading the copy).
* *settled*: both agents back at their idle poll rate (``backup_vs_peers.quiet_agents``),
  ``sync``, and the write load caught up with its schedule (no backlog).
* *shardvault*: a full backup through the local stack (moto Step Functions running the real
  ASL, the Lambda handlers in this process, MinIO over plain HTTP as the store, one agent
  with ``engine: mariadb``), as ``backup_vs_peers.py`` runs it (its ``shardvault_backup`` is
  reused): the bench cluster is not in the local policy file, so zstd level 3, not
  encrypted. The agent runs ``mariabackup --backup --parallel=2`` into its state directory,
  then packs (zstd, CRC64NVME) and uploads the copy, and deletes it at Release.
* *mariabackup* (the peer, as its users run it): ``mariabackup --backup --stream=mbstream
  --parallel=2`` piped into ``zstd -3`` (``zstd`` from PATH; without it, the ``zstandard``
  package at level 3 in this process), uploaded from the pipe by boto3's ``upload_fileobj``
  (s3transfer's defaults: 8 MiB parts, 10 threads) as one object into a bucket of a second
  MinIO over TLS (``peers.start_tls_minio``, pgBackRest's in the other benchmarks). No shell:
  the processes are ``subprocess.Popen`` argument lists joined by pipes.
* *stored bytes*: listed from the bucket after the backup: ShardVault's objects and manifest
  under its prefix (checked against its manifest and catalog record by
  ``backup_vs_peers.shardvault_stored``); the peer's one object.
* *client CPU* of a backup: ShardVault, the agent (mariabackup included, a child it waited
  for) and this process (the control plane); the peer, mariabackup and zstd (each reaped with
  ``wait4``, which gives that child's own CPU) and this process (the upload). *MinIO CPU*: the
  receiving MinIO's. Restores' CPU is not reported: the servers they start are reaped lazily,
  so their CPU lands on whichever later call reaps them.
* *restores* (unless ``--no-restores``): ShardVault's restore of the round's backup into an
  empty one-node cluster (its second agent): download, decode and check every frame,
  ``mariabackup --prepare``, start ``mariadbd``, ``mariadb-check --all-databases``; timed from
  ``start_restore`` to the execution's stop. The peer: ``download_fileobj`` into ``zstd -d``
  into ``mbstream -x`` in an empty directory, then ``mariabackup --prepare`` and the same
  server start and ``mariadb-check`` as the agent's (ShardVault's end point). Each is split
  into its *download* (ShardVault: the Download state; the peer: to the extracted files) and
  the rest (ShardVault: the Finish state). After each, untimed: every balance of ``bank`` is
  explained by the moves log and they sum as they should
  (``shardvault.local.mariadb.consistent``), and every ``sbtest`` table holds the source's row
  count.

Each round runs both backups, then both restores; the order alternates (round 1 ShardVault
first, round 2 the peer first, ...), and each run starts on a settled machine. The round's
backups are deleted at its end (untimed; disk space). Ratios are ShardVault's ÷ the peer's, of
the medians and per round (min / median / max of the rounds' ratios). Raw results go to
``--out`` as JSON, the tables to stdout and beside the JSON as Markdown. Everything started
here (both MinIO servers, the servers, the local stack and its agents, the write load) is
stopped and the work directory removed on the way out, also on failure, Ctrl-C or SIGTERM
(``--keep`` keeps the directory).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import IO, Any

import backup_vs_peers as bvp
import probes
import report
import zstandard
from boto3.s3.transfer import TransferConfig
from peers import (
    delete_prefix,
    ensure_bucket,
    list_keys,
    process_cpu,
    s3_client_for,
    start_tls_minio,
)
from probes import Probe
from report import MiB, median_cell, spread_cell, spread_of
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.mariadb.checks import check_tables
from shardvault_agent.engines.mariadb.server import (
    MariadbServer,
    client_user,
    program,
    run,
    socket_for,
)

from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest, Phase, RestoreRequest
from shardvault.local import demo
from shardvault.local.mariadb import (
    ACCOUNTS,
    BALANCE,
    Transfers,
    consistent,
    init_server,
    stop_server,
)
from shardvault.local.minio import MinioServer
from shardvault.local.stack import LocalStack

SV, PEER = "shardvault", "mariabackup"
SV_RESTORE, PEER_RESTORE = "shardvault-restore", "mariabackup-restore"
BACKUPS = (SV, PEER)
PEER_BUCKET = "mariabackup"
PEER_OBJECT = "full.mbstream.zst"
REDO_COPY = "ib_logfile0"  # in a copy: the redo log mariabackup copied while it ran
ZSTD_LEVEL = 3
BUFFER_POOL = 512 * MiB
SBTEST, BANK = "sbtest", "bank"
RESTORE_CLUSTER = "bench-restored"
RESTORE_NODE = "restore-node-1"
FILL_CHUNK = 100_000  # rows per fill transaction
DIRTY_PAGES_LEFT = 200  # the fill's flush ends below this many dirty pages
FLUSH_TIMEOUT = 600.0
CATCH_UP_TIMEOUT = 300.0
EXIT_TIMEOUT = 600.0  # seconds a pipeline's process may take to exit once its stream ended
LOG_FLUSH = 0.2  # seconds between the write load's log flushes
RECORD = struct.Struct("<dd")  # a transaction: due, acknowledged (epoch seconds)
DEFAULT_WORKDIR = Path("/tmp/mbench")

say = bvp.say


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=5, help="sbtest tables")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per sbtest table")
    parser.add_argument("--runs", type=int, default=3, help="rounds (each tool once a round)")
    parser.add_argument(
        "--load-fraction", type=float, default=0.7, help="the write load's rate ÷ its maximum"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=20.0, help="how long the maximum rate is measured"
    )
    parser.add_argument("--no-restores", action="store_true", help="backups only")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results dir")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        help="parent of the work directory (created if absent, removed at the end if empty)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.tables < 1 or args.rows < 1:
        parser.error("--runs, --tables and --rows must be at least 1")
    if not 0 < args.load_fraction <= 1:
        parser.error("--load-fraction must be in (0, 1]")
    return args


# --- the dataset (not timed) --------------------------------------------------------------------
def digit_groups(groups: int) -> str:
    """SQL for sysbench's filler: ``groups`` groups of 11 random digits joined by ``-``."""
    group = "LPAD(FLOOR(RAND() * 100000000000), 11, '0')"
    return f"CONCAT_WS('-', {', '.join([group] * groups)})"


def sbtest_table(n: int, rows: int) -> str:
    """Creates ``sbtest<n>``, fills it in transactions of ``FILL_CHUNK`` rows (as sysbench's
    batched inserts: no fill-sized undo log), then builds its ``k`` index (as sysbench does)."""
    statements = [
        f"CREATE TABLE sbtest{n} (id INT NOT NULL AUTO_INCREMENT PRIMARY KEY, "
        "k INT NOT NULL DEFAULT 0, c CHAR(120) NOT NULL DEFAULT '', "
        "pad CHAR(60) NOT NULL DEFAULT '') ENGINE=InnoDB"
    ]
    for first in range(1, rows + 1, FILL_CHUNK):
        last = min(rows, first + FILL_CHUNK - 1)
        statements.append(
            f"INSERT INTO sbtest{n} (k, c, pad) SELECT FLOOR(1 + RAND() * {rows}), "
            f"{digit_groups(10)}, {digit_groups(5)} FROM seq_{first}_to_{last}"
        )
    statements.append(f"ALTER TABLE sbtest{n} ADD INDEX k_{n} (k)")
    return "; ".join(statements)


def dirty_pages(server: MariadbServer) -> int:
    row = server.sql("SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_pages_dirty'")
    return int(row.split()[1])


FLUSH_SETTINGS = {  # while the fill's pages are written; then back to what they were
    "innodb_io_capacity_max": "40000",  # first: it may not be below innodb_io_capacity
    "innodb_io_capacity": "20000",
    "innodb_max_dirty_pages_pct_lwm": "0.001",
    "innodb_max_dirty_pages_pct": "0",
}


def flush_dirty_pages(server: MariadbServer) -> float:
    """Lets InnoDB write its dirty pages now (not during the first timed run); returns the
    seconds it took."""
    names = list(FLUSH_SETTINGS)
    before = dict(zip(names, server.sql(f"SELECT @@{', @@'.join(names)}").split(), strict=True))
    for name, value in FLUSH_SETTINGS.items():
        server.sql(f"SET GLOBAL {name} = {value}")
    started = time.monotonic()
    try:
        while dirty_pages(server) > DIRTY_PAGES_LEFT:
            if time.monotonic() - started > FLUSH_TIMEOUT:
                raise RuntimeError(f"InnoDB still dirty after {FLUSH_TIMEOUT:.0f} s")
            time.sleep(0.5)
    finally:
        for name in reversed(names):
            server.sql(f"SET GLOBAL {name} = {before[name]}")
    os.sync()
    return time.monotonic() - started


def sbtest_counts(server: MariadbServer, tables: int) -> dict[str, int]:
    """Each sbtest table's row count."""
    return {
        f"sbtest{n}": int(server.sql(f"SELECT COUNT(*) FROM sbtest{n}", database=SBTEST))
        for n in range(1, tables + 1)
    }


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fill(server: MariadbServer, tables: int, rows: int) -> dict[str, Any]:
    """The dataset (see the module docstring); returns its sizes and how long it took."""
    say(f"filling {tables} sbtest tables of {rows:,} rows")
    started = time.monotonic()
    server.sql(f"CREATE DATABASE {SBTEST}")
    for n in range(1, tables + 1):
        server.sql(sbtest_table(n, rows), database=SBTEST)
    Transfers(server, BANK).create()
    filled = time.monotonic()
    flush_seconds = flush_dirty_pages(server)
    innodb = server.sql(
        "SELECT SUM(data_length + index_length) FROM information_schema.tables "
        f"WHERE engine = 'InnoDB' AND table_schema IN ('{SBTEST}', '{BANK}')"
    )
    return {
        "fill_seconds": round(filled - started, 1),
        "flush_seconds": round(flush_seconds, 1),
        "innodb_table_bytes": int(innodb),
        "data_dir_bytes": directory_bytes(server.data_dir),
    }


# --- the write load -----------------------------------------------------------------------------
def load_client(socket: str) -> list[str]:
    """One ``mariadb`` session on ``bank`` that answers each statement as it comes."""
    return [
        program("mariadb"),
        "--no-defaults",
        f"--socket={socket}",
        f"--user={client_user()}",
        "--batch",
        "--skip-column-names",
        "--unbuffered",
        BANK,
    ]


def transaction(client: subprocess.Popen, picks: random.Random, number: int) -> None:
    """One transfer (``Transfers``' statements), committed; returns once acknowledged."""
    src, dst = picks.sample(range(ACCOUNTS), 2)
    amount = picks.randint(1, 50)
    assert client.stdin is not None
    assert client.stdout is not None
    client.stdin.write(
        "START TRANSACTION; "
        f"UPDATE accounts SET balance = balance - {amount} WHERE id = {src}; "
        f"UPDATE accounts SET balance = balance + {amount} WHERE id = {dst}; "
        f"INSERT INTO moves (src, dst, amount, pad) VALUES ({src}, {dst}, {amount}, "
        f"REPEAT('x', 200)); COMMIT; SELECT {number};\n"
    )
    client.stdin.flush()
    answer = client.stdout.readline()
    if answer.strip() != str(number):
        raise RuntimeError(f"the write load's session answered {answer!r} to {number}")


def load_until_paused(
    client: subprocess.Popen,
    picks: random.Random,
    rate: float,
    running: Event,
    stop: Event,
    behind: Synchronized,
    log: IO[bytes],
) -> None:
    """Transactions on the open-loop schedule (``rate`` 0: back to back) until paused."""
    started, sent, flushed = time.time(), 0, time.monotonic()
    while running.is_set() and not stop.is_set():
        due = started + sent / rate if rate else time.time()
        if (wait := due - time.time()) > 0:
            time.sleep(wait)
        transaction(client, picks, sent)
        log.write(RECORD.pack(due, time.time()))
        sent += 1
        behind.value = (time.time() - started) * rate - sent if rate else 0.0
        if time.monotonic() - flushed > LOG_FLUSH:
            log.flush()
            flushed = time.monotonic()
    behind.value = 0.0
    log.flush()


def write_load(
    parent: int,
    socket: str,
    log_path: str,
    rate: Synchronized,
    running: Event,
    stop: Event,
    behind: Synchronized,
) -> None:
    """The write load's process: waits while paused, runs while ``running`` is set; ends
    when ``stop`` is set or its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops it through the parent
    picks = random.Random(7)
    client = subprocess.Popen(
        load_client(socket),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(f"{log_path}.err", "ab"),  # noqa: SIM115 - the client's, closed with it
        text=True,
        bufsize=1,
        cwd="/",
    )
    try:
        with open(log_path, "ab") as log:
            while not stop.is_set() and os.getppid() == parent:
                if running.wait(0.1):
                    load_until_paused(client, picks, rate.value, running, stop, behind, log)
    finally:
        assert client.stdin is not None
        client.stdin.close()
        client.wait(timeout=30)


@dataclass
class WriteLoad:
    """The parent's handle on the write load's process (see the module docstring)."""

    process: SpawnProcess
    log_path: Path
    rate: Synchronized
    running: Event
    stopping: Event
    behind: Synchronized

    @classmethod
    def start(cls, server: MariadbServer, log_path: Path) -> WriteLoad:
        context = multiprocessing.get_context("spawn")
        rate, behind = context.Value("d", 0.0), context.Value("d", 0.0)
        running, stopping = context.Event(), context.Event()
        process = context.Process(
            target=write_load,
            args=(os.getpid(), str(server.socket), str(log_path), rate, running, stopping, behind),
            name="write-load",
        )
        process.start()
        return cls(process, log_path, rate, running, stopping, behind)

    def run_at(self, rate: float) -> None:
        """Runs on a new schedule at ``rate`` transactions a second (0: back to back)."""
        self.pause()
        self.rate.value = rate
        self.running.set()

    def pause(self) -> None:
        self.running.clear()
        time.sleep(LOG_FLUSH + 0.1)  # its last transaction done, its log flushed

    def stop(self) -> None:
        self.stopping.set()
        self.running.clear()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)

    def catch_up(self, timeout: float = CATCH_UP_TIMEOUT) -> float:
        """Waits until the load is on schedule; returns how long that took."""
        started = time.monotonic()
        while self.behind.value > 1.0:
            if not self.process.is_alive():
                raise RuntimeError(f"the write load exited; see {self.log_path}.err")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"the write load is still behind after {timeout:.0f} s")
            time.sleep(0.2)
        return time.monotonic() - started

    def records(self) -> list[tuple[float, float]]:
        return list(RECORD.iter_unpack(self.log_path.read_bytes()))

    def window(self, start: float, end: float) -> dict[str, Any]:
        """What the load did from ``start`` to ``end`` (epoch seconds): see the docstring."""
        if (wait := end + 2 * LOG_FLUSH - time.time()) > 0:
            time.sleep(wait)
        if not self.process.is_alive():
            raise RuntimeError(f"the write load exited; see {self.log_path}.err")
        return window_figures(self.records(), start, end)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def window_figures(records: list[tuple[float, float]], start: float, end: float) -> dict:
    """Transactions acknowledged in [``start``, ``end``): their rate, their latencies, and
    the worst whole second's count."""
    acks = sorted(done for _, done in records)
    first, last = bisect.bisect_left(acks, start), bisect.bisect_left(acks, end)
    latencies = [done - due for due, done in records if start <= done < end]
    seconds = end - start
    per_second = Counter(int(done - start) for done in acks[first:last])
    whole = int(seconds)
    return {
        "seconds": seconds,
        "transactions": last - first,
        "tps": (last - first) / seconds,
        "worst_second_tps": min((per_second[i] for i in range(whole)), default=None),
        "latency_p50_ms": percentile(latencies, 0.50) * 1000,
        "latency_p99_ms": percentile(latencies, 0.99) * 1000,
    }


def max_rate(load: WriteLoad, seconds: float) -> dict[str, Any]:
    """The load back to back for ``seconds`` after 3 s of warm-up (see the docstring)."""
    load.run_at(0.0)
    time.sleep(3.0)
    start = time.time()
    time.sleep(seconds)
    figures = load.window(start, start + seconds)
    load.pause()
    return figures


# --- the environment ----------------------------------------------------------------------------
@dataclass
class MariaBench:
    """Everything the rounds need. It has the attributes that ``backup_vs_peers``' ShardVault
    helpers (``shardvault_backup``, ``shardvault_stored``, ``quiet_agents``, ``timeline``)
    read of its ``Bench``, so those are reused as they are."""

    args: argparse.Namespace
    root: Path
    stack: LocalStack
    server: MariadbServer
    tls_minio: MinioServer
    peer_s3: Any  # the peer's and the bench's client of the TLS MinIO
    store_s3: Any  # the control plane's client of the store
    probe: Probe
    agent_pid: int
    restore_agent_pid: int
    busy_window: float
    load: WriteLoad
    counts: dict[str, int]  # the source's sbtest row counts
    setup: dict[str, Any] = field(default_factory=dict)
    agents_busy_until: float = 0.0

    @property
    def client(self) -> ops.ClientConfig:
        return self.stack.client_config()

    @property
    def store_bucket(self) -> str:
        return self.stack.services().store.bucket

    @property
    def store_minio_pid(self) -> int:
        return self.stack._minio.process.pid

    @property
    def agent_log(self) -> Path:
        return self.stack.root / "agents" / f"{bvp.NODE_ID}.log"


@dataclass
class Round:
    """One round: its index and the backups its restores read (deleted at its end)."""

    index: int
    sv_backup_id: str = ""
    sv_prefix: str = ""
    peer_key: str = ""

    @property
    def order(self) -> tuple[str, str]:
        """ShardVault first in odd rounds, the peer first in even ones."""
        return BACKUPS if self.index % 2 else BACKUPS[::-1]


def remove_copy(data_dir: Path) -> None:
    """Stops a server on ``data_dir`` if one runs, then removes it, its socket directory and
    its log."""
    stop_server(data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(socket_for(data_dir).parent, ignore_errors=True)
    data_dir.with_name(f"{data_dir.name}.err").unlink(missing_ok=True)


def start_servers(
    root: Path, cleanup: contextlib.ExitStack
) -> tuple[MinioServer, LocalStack, MariadbServer]:
    say("starting the TLS MinIO (the peer's store), the local stack and MariaDB")
    tls_minio = start_tls_minio(root / "minio-tls")
    cleanup.callback(tls_minio.stop)
    stack = LocalStack(root / "stack", require_minio=True)
    cleanup.callback(stack.stop)  # before start(): a half-started stack is stopped too
    stack.start()
    data_dir = root / "maria" / "source"
    cleanup.callback(stop_server, data_dir)
    server = init_server(data_dir)
    server.sql(f"SET GLOBAL innodb_buffer_pool_size = {BUFFER_POOL}")
    return tls_minio, stack, server


def agent_configs(root: Path, server: MariadbServer) -> tuple[dict, dict]:
    """The source agent's config (one shard: the server) and the restore target's."""
    shard = {
        "shard_id": bvp.SHARD_ID,
        "role": "leader",
        "data_dir": str(server.data_dir),
        "socket": str(server.socket),
    }
    config = demo.agent_config(root, bvp.CLUSTER, bvp.NODE_ID, "mariadb", [shard])
    (restore,) = demo.restore_targets(root, name=RESTORE_CLUSTER, engine="mariadb", nodes=1)
    restore["node_id"] = RESTORE_NODE
    return config, restore


def setup(args: argparse.Namespace, root: Path, cleanup: contextlib.ExitStack) -> MariaBench:
    tls_minio, stack, server = start_servers(root, cleanup)
    peer_s3 = s3_client_for(tls_minio)
    ensure_bucket(peer_s3, PEER_BUCKET)
    filled = fill(server, args.tables, args.rows)
    config, restore_config = agent_configs(root, server)
    # Registered first, run last: after the restore agent stopped, its copy's server.
    cleanup.callback(remove_copy, Path(restore_config["restore_dir"]) / bvp.SHARD_ID)
    cleanup.callback(remove_copy, root / "peer-restored" / bvp.SHARD_ID)
    busy_window = max(
        AgentConfig.model_validate(c).busy_window_seconds for c in (config, restore_config)
    )
    load = WriteLoad.start(server, root / "load.bin")
    cleanup.callback(load.stop)
    bench = MariaBench(
        args=args,
        root=root,
        stack=stack,
        server=server,
        tls_minio=tls_minio,
        peer_s3=peer_s3,
        store_s3=stack.services().store_s3,
        probe=probes.install(),
        agent_pid=bvp.start_agent(stack, config, cleanup),
        restore_agent_pid=bvp.start_agent(stack, restore_config, cleanup),
        busy_window=busy_window,
        load=load,
        counts=sbtest_counts(server, args.tables),
        setup=filled,
    )
    (root / "logs").mkdir()
    bvp.quiet_agents(bench)
    say(f"measuring the write load's maximum rate for {args.max_seconds:.0f} s")
    bench.setup["max_rate"] = max_rate(load, args.max_seconds)
    bench.setup["rate"] = args.load_fraction * bench.setup["max_rate"]["tps"]
    return bench


def settle(bench: MariaBench) -> dict[str, Any]:
    """See *settled* in the module docstring; returns how long each part waited."""
    quiet = bvp.quiet_agents(bench)  # type: ignore[arg-type]  # a Bench by duck typing
    os.sync()
    return quiet | {"catch_up_seconds": round(bench.load.catch_up(), 1)}


# --- ShardVault ---------------------------------------------------------------------------------
def copy_window(bench: MariaBench, backup_id: str) -> tuple[float, float] | None:
    """When the agent's ``checkpoint`` command (mariabackup's copy) ran, from its log."""
    commands = report.agent_commands(bench.agent_log.read_text(), backup_id)
    found = [(c["start"], c["end"]) for c in commands if c["command"] == "checkpoint"]
    return found[0] if found else None


def shardvault_backup(bench: MariaBench, rnd: Round) -> dict[str, Any]:
    started = time.time()
    backup = bvp.shardvault_backup(bench, BackupRequest(cluster=bvp.CLUSTER))  # type: ignore[arg-type]
    rnd.sv_backup_id, rnd.sv_prefix = backup.manifest.backup_id, backup.prefix
    result = backup.result | {"window": (started, started + backup.result["seconds"])}
    result["copy_window"] = copy_window(bench, backup.manifest.backup_id)
    files = bvp.stream_of(backup.manifest, Phase.DATA).files
    result["redo_copied_bytes"] = sum(f.size for f in files if f.path == REDO_COPY)
    result["stream_bytes"] = backup.result["bytes"]
    with contextlib.suppress(ValueError):  # a history of unexpected shape loses the split only
        result |= bvp.timeline(bench, backup.arn, backup.manifest.backup_id)  # type: ignore[arg-type]
    return result


def restored_check(bench: MariaBench, server: MariadbServer) -> dict[str, Any]:
    """The restored copy's bank is consistent and its sbtest tables hold the source's rows."""
    total, moves = consistent(server, BANK)
    counts = sbtest_counts(server, len(bench.counts))
    return {
        "balances_sum_ok": total == ACCOUNTS * BALANCE,
        "moves": moves,
        "sbtest_rows_ok": counts == bench.counts,
    }


def shardvault_restore(bench: MariaBench, rnd: Round) -> dict[str, Any]:
    """The round's backup into the restore agent's one-node cluster (see the docstring)."""
    request = RestoreRequest(
        cluster=bvp.CLUSTER,
        target_cluster=RESTORE_CLUSTER,
        backup_id=rnd.sv_backup_id,
        replace=True,
    )
    pids = {"minio": bench.store_minio_pid}
    before = bvp.cpu_snapshot(pids)
    started = time.time()
    arn = ops.start_restore(bench.client, request)
    execution = bvp.wait_execution(arn)
    seconds = execution["stopDate"].timestamp() - started
    cpu = bvp.cpu_delta(before, bvp.cpu_snapshot(pids))
    if execution["status"] != "SUCCEEDED":
        cause = ops.readable_cause(execution.get("cause", ""))
        raise RuntimeError(f"ShardVault restore {execution['status']}: {cause}")
    (shard,) = json.loads(execution["output"])["shards"]
    copy = MariadbServer(Path(shard["path"]), Path(shard["socket"]))
    try:
        checked = restored_check(bench, copy)
    finally:
        remove_copy(copy.data_dir)
    spans, _ = report.state_spans(ops.execution_history(arn), bvp.RESTORE_STATES)
    states = report.state_seconds(spans)
    return {
        "seconds": seconds,
        "download_seconds": states.get("Download"),
        "finish_seconds": states.get("Finish"),
        "checks": shard["checks"],
        "checks_ok": all(v == "ok" for v in shard["checks"].values()),
        "states": states,
        "minio_cpu_seconds": cpu["minio"],
        **checked,
    }


# --- the peer: mariabackup --stream | zstd -3 | upload_fileobj ----------------------------------
def zstd_program() -> str | None:
    """The ``zstd`` command line tool, or None (the ``zstandard`` package is used then)."""
    return shutil.which("zstd")


def mariabackup_stream(server: MariadbServer) -> list[str]:
    """The peer's backup command, connected as the agent's mariabackup is."""
    return server.backup_command("--stream=mbstream", "--parallel=2")


def reap(process: subprocess.Popen, timeout: float = EXIT_TIMEOUT) -> float:
    """Waits for ``process`` and reaps it here, returning its user + system CPU seconds
    (``wait4``: exact for this one child; the CPU of a child reaped lazily would land on
    whatever call reaped it)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.args[0]} still running after {timeout:.0f} s")
        time.sleep(0.01)


def check_exits(processes: list[subprocess.Popen], logs: list[Path]) -> float:
    """Reaps each process; raises with its log's tail when one failed; returns their CPU
    seconds."""
    cpu = 0.0
    for process, log in zip(processes, logs, strict=True):
        cpu += reap(process)
        if process.returncode != 0:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{tail}")
    return cpu


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.contextmanager
def backup_pipe(
    server: MariadbServer, logs: Path, scratch: Path, cpu: dict[str, float]
) -> Iterator[IO[bytes]]:
    """``mariabackup --stream`` into ``zstd -3``; yields the compressed stream's reader,
    checks both exits once it has been read and puts their CPU seconds in ``cpu``."""
    names = [logs / "mariabackup.log", logs / "zstd.log"]
    with open(names[0], "wb") as backup_log, open(names[1], "wb") as zstd_log:
        backup = subprocess.Popen(
            mariabackup_stream(server), stdout=subprocess.PIPE, stderr=backup_log, cwd=scratch
        )
        processes = [backup]
        try:
            assert backup.stdout is not None
            if zstd := zstd_program():
                compress = subprocess.Popen(
                    [zstd, f"-{ZSTD_LEVEL}", "-q", "-c"],
                    stdin=backup.stdout,
                    stdout=subprocess.PIPE,
                    stderr=zstd_log,
                    cwd=scratch,
                )
                backup.stdout.close()  # zstd's now: mariabackup sees it go if zstd dies
                processes.append(compress)
                assert compress.stdout is not None
                yield compress.stdout
                compress.stdout.close()
            else:
                compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
                with compressor.stream_reader(backup.stdout) as reader:
                    yield reader  # type: ignore[misc]
            cpu["tools"] = check_exits(processes, names[: len(processes)])
        finally:
            stop_all(processes)


def peer_backup(bench: MariaBench, rnd: Round) -> dict[str, Any]:
    """The peer's backup of the round (see the module docstring), timed and listed."""
    logs = bench.root / "logs" / f"round-{rnd.index}-backup"
    scratch = bench.root / "peer-scratch"
    for directory in (logs, scratch):
        directory.mkdir(parents=True, exist_ok=True)
    key = f"round-{rnd.index}/{PEER_OBJECT}"
    minio = bench.tls_minio.process.pid
    self_before, minio_before, cpu = time.process_time(), process_cpu(minio), {"tools": 0.0}
    started = time.time()
    with backup_pipe(bench.server, logs, scratch, cpu) as stream:
        bench.peer_s3.upload_fileobj(stream, PEER_BUCKET, key, Config=TransferConfig())
    ended = time.time()
    rnd.peer_key = key
    stored = list_keys(bench.peer_s3, PEER_BUCKET, key)
    tools_cpu = cpu["tools"]
    self_cpu = time.process_time() - self_before
    return {
        "seconds": ended - started,
        "window": (started, ended),
        "copy_window": (started, ended),
        "stored_bytes": bvp.size_of(stored),
        "objects": len(stored),
        "compressor": "zstd CLI" if zstd_program() else "zstandard package",
        "client_cpu_seconds": round(tools_cpu + self_cpu, 2),
        "tools_cpu_seconds": round(tools_cpu, 2),
        "upload_cpu_seconds": round(self_cpu, 2),
        "minio_cpu_seconds": round(process_cpu(minio) - minio_before, 2),
        "scratch_left": sorted(p.name for p in scratch.iterdir()),
    }


@contextlib.contextmanager
def extract_pipe(target: Path, logs: Path) -> Iterator[IO[bytes]]:
    """``zstd -d`` into ``mbstream -x -C target``; yields the writer of the compressed stream
    and checks both exits once it is closed."""
    names = [logs / "mbstream.log", logs / "zstd.log"]
    with open(names[0], "wb") as extract_log, open(names[1], "wb") as zstd_log:
        extract = subprocess.Popen(
            [program("mbstream"), "-x", "-C", str(target)],
            stdin=subprocess.PIPE,
            stderr=extract_log,
            cwd="/",
        )
        processes = [extract]
        try:
            assert extract.stdin is not None
            if zstd := zstd_program():
                decompress = subprocess.Popen(
                    [zstd, "-d", "-q", "-c"],
                    stdin=subprocess.PIPE,
                    stdout=extract.stdin,
                    stderr=zstd_log,
                    cwd="/",
                )
                extract.stdin.close()  # zstd's now
                processes.append(decompress)
                assert decompress.stdin is not None
                yield decompress.stdin
                decompress.stdin.close()
            else:
                with zstandard.ZstdDecompressor().stream_writer(extract.stdin) as writer:
                    yield writer  # type: ignore[misc]
            check_exits(processes[::-1], names[: len(processes)][::-1])
        finally:
            stop_all(processes)


def peer_restore(bench: MariaBench, rnd: Round) -> dict[str, Any]:
    """The peer's restore of the round's object (see the module docstring)."""
    target = bench.root / "peer-restored" / bvp.SHARD_ID
    remove_copy(target)
    target.mkdir(parents=True)
    logs = bench.root / "logs" / f"round-{rnd.index}-restore"
    logs.mkdir(parents=True, exist_ok=True)
    minio = bench.tls_minio.process.pid
    minio_before = process_cpu(minio)
    started = time.monotonic()
    with extract_pipe(target, logs) as sink:
        bench.peer_s3.download_fileobj(PEER_BUCKET, rnd.peer_key, sink, Config=TransferConfig())
    extracted = time.monotonic()
    sizes = {  # untimed: their measuring is taken out of the times below
        "stream_bytes": directory_bytes(target),
        "redo_copied_bytes": (target / REDO_COPY).stat().st_size,
    }
    started += time.monotonic() - extracted
    extracted = time.monotonic()
    run([program("mariabackup"), "--no-defaults", "--prepare", f"--target-dir={target}"])
    prepared = time.monotonic()
    copy = MariadbServer(target, socket_for(target))
    try:
        copy.start()
        verdict = check_tables(copy)
        checked = time.monotonic()
        minio_cpu = process_cpu(minio) - minio_before
        result = restored_check(bench, copy)
    finally:
        remove_copy(target)
    return {
        **result,
        **sizes,
        "seconds": checked - started,
        "download_seconds": extracted - started,
        "prepare_seconds": prepared - extracted,
        "finish_seconds": checked - extracted,
        "checks": {"mariadb-check --all-databases": verdict},
        "checks_ok": verdict == "ok",
        "minio_cpu_seconds": round(minio_cpu, 2),
    }


# --- rounds -------------------------------------------------------------------------------------
BACKUP_RUNNERS: dict[str, Callable[[MariaBench, Round], dict[str, Any]]] = {
    SV: shardvault_backup,
    PEER: peer_backup,
}
RESTORE_RUNNERS: dict[str, Callable[[MariaBench, Round], dict[str, Any]]] = {
    SV_RESTORE: shardvault_restore,
    PEER_RESTORE: peer_restore,
}


def load_figures(bench: MariaBench, result: dict[str, Any]) -> dict[str, Any]:
    """The write load during the backup's window and its copy, and over a baseline window of
    the same length once the machine is settled again."""
    start, end = result.pop("window")
    during = bench.load.window(start, end)
    copy = result.pop("copy_window")
    during_copy = bench.load.window(*copy) if copy else None
    after_copy = bench.load.window(copy[1], end) if copy and end - copy[1] > 1.0 else None
    settled = settle(bench)
    base_start = time.time()
    time.sleep(end - start)
    baseline = bench.load.window(base_start, base_start + end - start)
    return {
        "load": during,
        "load_copy": during_copy,
        "load_after_copy": after_copy,
        "baseline": baseline,
        "baseline_settle": settled,
        "tps_ratio": during["tps"] / baseline["tps"],
        "transactions_short": baseline["tps"] * (end - start) - during["transactions"],
        "copy_tps_ratio": during_copy["tps"] / baseline["tps"] if during_copy else None,
        "after_copy_tps_ratio": after_copy["tps"] / baseline["tps"] if after_copy else None,
        "copy_seconds": copy[1] - copy[0] if copy else None,
    }


def record(runs: dict[str, list], name: str, rnd: Round, result: dict[str, Any]) -> None:
    runs.setdefault(name, []).append(result | {"round": rnd.index})
    stored = result.get("stored_bytes")
    stored_text = "" if stored is None else f", {stored / MiB:,.1f} MiB stored"
    tps = result.get("tps_ratio")
    tps_text = "" if tps is None else f", load tps ÷ baseline {tps:.3f}"
    say(f"  {name}: {result['seconds']:.1f} s{stored_text}{tps_text}")


def backup_step(bench: MariaBench, runs: dict[str, list], name: str, rnd: Round) -> None:
    settled = settle(bench)
    load_before = os.getloadavg()[0]
    result = BACKUP_RUNNERS[name](bench, rnd)
    if name == SV:
        bench.agents_busy_until = time.monotonic() + bench.busy_window
    result |= load_figures(bench, result)
    record(runs, name, rnd, result | {"settle": settled, "load_before": load_before})


def restore_step(bench: MariaBench, runs: dict[str, list], name: str, rnd: Round) -> None:
    settled = bvp.quiet_agents(bench)  # type: ignore[arg-type]
    os.sync()
    result = RESTORE_RUNNERS[name](bench, rnd)
    if name == SV_RESTORE:
        bench.agents_busy_until = time.monotonic() + bench.busy_window
    if not (result["checks_ok"] and result["balances_sum_ok"] and result["sbtest_rows_ok"]):
        raise RuntimeError(f"{name} of round {rnd.index} restored wrong data: {result}")
    if name == PEER_RESTORE:  # the round's stream, measured once extracted
        runs[PEER][-1] |= {k: result[k] for k in ("stream_bytes", "redo_copied_bytes")}
    record(runs, name, rnd, result | {"settle": settled})


def run_round(bench: MariaBench, rnd: Round, runs: dict[str, list]) -> None:
    bench.load.run_at(bench.setup["rate"])
    for name in rnd.order:
        backup_step(bench, runs, name, rnd)
    bench.load.pause()
    if not bench.args.no_restores:
        for name in rnd.order:
            restore_step(bench, runs, f"{name}-restore", rnd)
    delete_prefix(bench.store_s3, bench.store_bucket, rnd.sv_prefix)  # disk space; untimed
    delete_prefix(bench.peer_s3, PEER_BUCKET, rnd.peer_key)


def run_rounds(bench: MariaBench) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for index in range(1, bench.args.runs + 1):
        rnd = Round(index)
        say(f"round {index} of {bench.args.runs}: {' then '.join(rnd.order)} first")
        run_round(bench, rnd, runs)
    return runs


# --- summary ------------------------------------------------------------------------------------
def labels(runs: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Each run's row label; ShardVault's with the zstd level its backups recorded."""
    levels = sorted({run["compression_level"] for run in runs.get(SV, [])}, key=str)
    zstd = f"zstd level {', '.join(map(str, levels))}" if levels else "zstd"
    return {
        SV: f"ShardVault full backup (local stack, 1 agent, {zstd})",
        PEER: f"mariabackup --stream=mbstream --parallel=2, piped into zstd -{ZSTD_LEVEL}, "
        "upload_fileobj over TLS",
        SV_RESTORE: "ShardVault restore (+ prepare, start, mariadb-check)",
        PEER_RESTORE: "download_fileobj piped into zstd -d and mbstream -x, mariabackup "
        "--prepare, start, mariadb-check",
    }


RATIOS = (
    ("backup wall time", SV, PEER, "seconds"),
    ("bytes stored", SV, PEER, "stored_bytes"),
    ("client CPU", SV, PEER, "client_cpu_seconds"),
    ("write load's tps ratio (during ÷ baseline)", SV, PEER, "tps_ratio"),
    ("restore wall time (to a checked server)", SV_RESTORE, PEER_RESTORE, "seconds"),
)


def ratio(runs: dict[str, list], mine: str, theirs: str, key: str) -> dict[str, Any] | None:
    """``mine``'s ``key`` ÷ ``theirs``': of the medians, and per round."""
    if not (runs.get(mine) and runs.get(theirs)):
        return None
    return {
        "of_medians": report.median_of(runs[mine], key) / report.median_of(runs[theirs], key),
        "per_round": report.pair_ratios(runs[mine], runs[theirs], key),
    }


SPREAD_KEYS = (
    "seconds",
    "stored_bytes",
    "client_cpu_seconds",
    "minio_cpu_seconds",
    "tps_ratio",
    "copy_tps_ratio",
    "after_copy_tps_ratio",
    "load.tps",
    "baseline.tps",
    "load.latency_p99_ms",
    "baseline.latency_p99_ms",
    "load.worst_second_tps",
    "transactions_short",
    "copy_seconds",
    "stream_bytes",
    "redo_copied_bytes",
    "download_seconds",
    "finish_seconds",
)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    names = labels(runs)
    return {
        "tools": {
            name: {"label": names[name], **{k: spread_of(tool_runs, k) for k in SPREAD_KEYS}}
            for name, tool_runs in runs.items()
        },
        "ratios": [
            {"figure": figure, **result}
            for figure, mine, theirs, key in RATIOS
            if (result := ratio(runs, mine, theirs, key))
        ],
        "restored_ok": {
            name: all(r["checks_ok"] and r["sbtest_rows_ok"] and r["balances_sum_ok"] for r in rs)
            for name, rs in runs.items()
            if name.endswith("restore")
        },
    }


# --- Markdown -----------------------------------------------------------------------------------
def backups_table(summary: dict[str, Any]) -> str:
    rows = [
        "| backup | wall s min / median / max | of it, mariabackup's copy s | MiB copied (of it "
        "redo) | MiB stored | client CPU s | MinIO CPU s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in BACKUPS:
        if info := summary["tools"].get(name):
            rows.append(
                f"| {info['label']} | {spread_cell(info['seconds'])} | "
                f"{median_cell(info['copy_seconds'])} | "
                f"{median_cell(info['stream_bytes'], 0, MiB)} "
                f"({median_cell(info['redo_copied_bytes'], 1, MiB)}) | "
                f"{median_cell(info['stored_bytes'], 1, MiB)} | "
                f"{median_cell(info['client_cpu_seconds'])} | "
                f"{median_cell(info['minio_cpu_seconds'])} |"
            )
    return "\n".join(rows)


def load_table(summary: dict[str, Any]) -> str:
    rows = [
        "| write load during | tps during / baseline (medians) | tps ratio min / median / max "
        "| while mariabackup copied | after its copy (pack, upload) | transactions short of "
        "the baseline | p99 latency ms during / baseline | worst second's tps min / median / "
        "max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in BACKUPS:
        if info := summary["tools"].get(name):
            rows.append(
                f"| {info['label']} | {median_cell(info['load.tps'], 0)} / "
                f"{median_cell(info['baseline.tps'], 0)} | {spread_cell(info['tps_ratio'], 3)} | "
                f"{spread_cell(info['copy_tps_ratio'], 3)} | "
                f"{spread_cell(info['after_copy_tps_ratio'], 3)} | "
                f"{median_cell(info['transactions_short'], 0)} "
                f"| {median_cell(info['load.latency_p99_ms'])} / "
                f"{median_cell(info['baseline.latency_p99_ms'])} | "
                f"{spread_cell(info['load.worst_second_tps'], 0)} |"
            )
    return "\n".join(rows)


def restores_table(summary: dict[str, Any]) -> str:
    rows = [
        "| restore | wall s min / median / max | of it, download (decode, extract) | prepare, "
        "start, mariadb-check | consistent, rows = source's |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in (SV_RESTORE, PEER_RESTORE):
        if info := summary["tools"].get(name):
            ok = "yes, every round" if summary["restored_ok"][name] else "NO"
            rows.append(
                f"| {info['label']} | {spread_cell(info['seconds'])} | "
                f"{median_cell(info['download_seconds'])} | "
                f"{median_cell(info['finish_seconds'])} | "
                f"{ok} |"
            )
    return "\n".join(rows)


def ratios_table(summary: dict[str, Any]) -> str:
    rows = [
        "| ShardVault ÷ mariabackup | of the medians | per round min / median / max |",
        "| --- | --- | --- |",
    ]
    rows += [
        f"| {r['figure']} | {r['of_medians']:.3f} | {spread_cell(r['per_round'], 3)} |"
        for r in summary["ratios"]
    ]
    return "\n".join(rows)


def markdown(bench: MariaBench, summary: dict[str, Any]) -> str:
    rate = bench.setup["max_rate"]
    head = (
        f"Write load: maximum {rate['tps']:,.0f} tps (p99 {rate['latency_p99_ms']:.1f} ms); "
        f"runs at {bench.setup['rate']:,.0f} tps ({bench.args.load_fraction:.0%})."
    )
    parts = [head, "Backups:\n\n" + backups_table(summary), load_table(summary)]
    if not bench.args.no_restores:
        parts.append("Restores:\n\n" + restores_table(summary))
    parts.append("Ratios:\n\n" + ratios_table(summary))
    return "\n\n".join(parts) + "\n"


def machine(bench: MariaBench) -> dict[str, Any]:
    first = bvp._output_line
    return {
        "cpus": os.cpu_count(),
        "cpu_model": bvp._cpu_model(),
        "memory_gib": round(bvp._mem_total_gib(), 1),
        "disk": first(["df", "-h", "--output=source,fstype,size", str(bench.root)], -1),
        "mariadb": bench.server.sql("SELECT VERSION()"),
        "mariabackup": first([program("mariabackup"), "--version"], -1),
        "zstd": first([zstd, "--version"]) if (zstd := zstd_program()) else "zstandard package",
        "shardvault": bvp._git_version(),
    }


# --- main ---------------------------------------------------------------------------------------
def make_workdir(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> Path:
    """``backup_vs_peers.make_workdir`` under ``--workdir``, which is created here if absent
    and removed at the end if this made it and it is empty."""
    if not args.workdir.exists():
        args.workdir.mkdir(parents=True)
        args.workdir.chmod(0o755)
        cleanup.callback(_rmdir, args.workdir)
    return bvp.make_workdir(args, cleanup)


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, bvp._terminate)
    started = time.time()
    with contextlib.ExitStack() as cleanup:
        root = make_workdir(args, cleanup)
        bench = setup(args, root, cleanup)
        say(f"setup done in {time.time() - started:.0f} s: {json.dumps(bench.setup)}")
        runs = run_rounds(bench)
        summary = summarize(runs)
        text = markdown(bench, summary)
        path = bvp.write_results(
            bench,  # a MariaBench: args (out) and setup are all write_results reads of it
            runs,
            summary,
            started,
            name="mariadb_vs_peers",
            markdown=text,
            machine=machine(bench),
        )
        say("stopping everything")
    print(text)
    print(f"Raw results: {path}; benchmark wall time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
