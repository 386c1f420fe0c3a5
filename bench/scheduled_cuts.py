"""The cost of a scheduled cut (``shardvault.backup.cuts``): how long it pauses the commits of a
two-phase-commit workload, how much WAL it writes, and how much it adds to the WAL archive of
an idle cluster, per cut and per day.

Usage::

    PYTHONPATH=.:agents:bench .venv/bin/python bench/scheduled_cuts.py
    PYTHONPATH=.:agents:bench .venv/bin/python bench/scheduled_cuts.py --nodes 3 --cuts 20 \
        --every-seconds 6 --idle-cuts 10 --idle-minutes 4 --archive-timeout 60

The local stack (moto's Step Functions running the real ASL, MinIO as the store) and one real
PostgreSQL per node (``--nodes``), each the leader of its own shard of one cluster, built as
``tests/integration/conftest.py``'s ``ArchivingNode`` builds them: ``archive_command`` is the
system's python3 running a copy of ``walspool.py`` into the agent's spool (the agent's
``wal_spool_dir``, ``archive_poll_seconds`` 0.2), with ``archive_timeout = --archive-timeout``
(60, as docs/guide/wal-archiving.md recommends) and ``max_prepared_transactions = 20``. Every
node holds the bank database of ``tests/integration/bank.py``. The cluster's policy says
``archive: {max_delay_seconds: 1}`` and ``cut: {commit_lock: 4242, database: bank}``; the
bench starts each cut itself (``ops.start_cut``, then ``ops.wait_cut``), as the schedule would.

Terms:
- *pause*: a cut's commit pause on its longest node, from asking for the commit lock to
  letting it go (the cut item's ``cut_pause_seconds``), split from the markers each agent
  keeps (``<state_dir>/cuts/<cut id>/<shard>.json``, its ``cut_pause`` ``asked locked
  released`` and ``cut_at``) into *lock wait* (asked to granted), *to point* (granted to the
  restore point) and *hold* (the point to letting go), on the server's clock.
- *paused*: every node held the lock at one shared moment (``cut_paused``); else the cut is
  best-effort. *skew*: the spread of the restore points' creation times; *late*: how late the
  latest node came to the cut instant.
- *share of time paused*: pause / (60 x every_minutes), the fraction of time commits wait at
  that schedule.
- *segment*: a 16 MiB WAL file; *batch*: what the agent stores at once, one object and its
  index (two PUTs to the store, two calls to the archive function).

Three parts, the idle ones first: after the load, autovacuum and the checkpoint of the load's
dirty pages write WAL for minutes, which the idle windows would count as the cuts'.

1. *WAL per cut* (``--idle-cuts``, no workload): ``pg_current_wal_insert_lsn()`` on every node
   before and after each cut, the difference by ``pg_wal_lsn_diff``; the minimum over the cuts
   is the cut's own WAL (a larger one holds other records too, or the rest of a segment
   ``archive_timeout`` switched meanwhile).
2. *Archive per cut* (``--idle-minutes`` W, no workload): every node's WAL checkpointed and
   archived first; then W minutes without cuts, then W minutes with one cut every
   ``--idle-every-seconds`` (60), each window followed by ``archive_timeout`` + 6 s so that
   its last segment is archived inside it. Read from the catalog's archive counters
   (``archive_totals``: stored bytes, WAL bytes, batches) and ``pg_stat_archiver`` (segments);
   per cut and node: what the window with cuts archived / cuts / nodes (an upper bound; the
   window without is shown beside it), and per node and day at every_minutes
   5, 15 and 60. An idle server closes no segment; a cut's restore point is a record that
   ``archive_timeout`` closes a segment for, so at most one segment per archive_timeout
   whatever the cuts' rate. On a busy server the cut is lost in the load's WAL (part 3 reports
   the load's WAL rate beside part 1's bytes).
3. *Pause under load* (``--cuts`` N, one every ``--every-seconds``): the bank workload alone
   for N x every seconds, then again with the cuts, a ``WakeProbe`` (``cut_skew``) on the first
   server throughout each; per cut: paused or not, pause and its split, skew, lateness; the
   workload's transfers a second, latencies and lock retries with and without cuts.

Results go to ``--out`` (``bench/results``) as ``scheduled_cuts-<UTC time>.json``; a summary to
stdout. Everything started (the stack, its MinIO, the agents, the servers, the workload, the
probe) is stopped at exit, also on an error, Ctrl-C or SIGTERM, and the work directory (under
/tmp) removed unless ``--keep``. With the defaults it runs about 18 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from backup_vs_peers import copy_push_client, make_workdir, push_command, say, stop_postgres_at
from cut_skew import FAST_AGENT, WakeProbe, spread, wakeups
from shardvault_agent.wal import walspool

from shardvault.client import operations as ops
from shardvault.contracts.catalog import CutItem
from shardvault.contracts.cut import pause_of
from shardvault.local import demo
from shardvault.local.postgres import (
    PostgresInstance,
    give_to_postgres,
    init_instance,
    stop_process,
)
from shardvault.local.stack import LocalStack
from tests.integration import bank

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "sched"
KEY = 4242  # the commit lock, as the integration test's
ARCHIVE_DELAY_SECONDS = 1.0  # the policy's archive.max_delay_seconds
# ArchivingNode's archive poll; an idle agent reads its inbox every second too, so a lost
# doorbell ring delays a cut by a second at most (the tests' setting).
AGENT = FAST_AGENT | {"archive_poll_seconds": 0.2, "idle_inbox_poll_seconds": 1.0}
# Prepared transactions are what the workload is made of (PostgreSQL's default allows none).
SETTINGS = {"max_prepared_transactions": "20"}
WARMUP_SECONDS = 1.0  # transfers under way before the first cut
LAG_SLACK_SECONDS = 5.0  # past archive_timeout + max delay: the push and the upload
SETTLE_SLACK_SECONDS = 60.0
CUT_FIRST_ID = 10**8  # the second workload's transfer ids: the first one's stay in the tables
BANK_SPARE_SECONDS = 600  # the workload's own end, should its stop file never come
EVERY_MINUTES = (5, 15, 60)
COUNTERS = ("stored_bytes", "wal_bytes", "batches", "segments")
SPLIT = ("pause_lock_wait_seconds", "pause_to_point_seconds", "pause_hold_seconds")
POLICY = """version: 1
clusters:
  {cluster}:
    engine: postgres
    schedule: {{full: '0 2 * * *'}}
    vault: {{storage_class: GLACIER_IR, object_lock: {{mode: GOVERNANCE, days: 1}}}}
    retention: {{keep_daily: 1}}
    archive: {{max_delay_seconds: {delay}}}
    cut: {{commit_lock: {key}, database: {database}}}
"""


# --- the nodes ---------------------------------------------------------------------------------
@dataclass
class Node:
    """One archiving PostgreSQL node (ArchivingNode's way) and its agent's configuration."""

    server: PostgresInstance
    config: dict[str, Any]
    spool: Path

    @property
    def node_id(self) -> str:
        return str(self.config["node_id"])

    @property
    def state_dir(self) -> Path:
        return Path(self.config["state_dir"])


def build_node(
    root: Path, index: int, push: Path, archive_timeout: int, cleanup: contextlib.ExitStack
) -> Node:
    """Node ``index``, the leader of shard-<index>, its server started (stopped at exit)."""
    home = root / f"n{index}"
    spool = home / "spool"
    spool.mkdir(parents=True)
    give_to_postgres(spool)  # the push writes as the server's user
    settings = {
        "archive_mode": "on",
        "archive_command": push_command(push, spool),
        "archive_timeout": str(archive_timeout),
        **SETTINGS,
    }
    cleanup.callback(stop_postgres_at, home / "pg")  # before initdb: a half-started one too
    server = init_instance(home / "pg", settings=settings)
    shard = {
        "shard_id": f"shard-{index}",
        "role": "leader",
        "data_dir": str(server.data_dir),
        "conninfo": server.conninfo,
        "wal_spool_dir": str(spool),
    }
    config = demo.agent_config(home, CLUSTER, f"{CLUSTER}-n{index}", "postgres", [shard])
    return Node(server, config | AGENT, spool)


def stop_agents(stack: LocalStack, nodes: list[Node]) -> None:
    """Before the servers: an agent never sees its server go."""
    for node in nodes:
        stack.stop_agent(node.node_id)


# --- one cut -----------------------------------------------------------------------------------
def take_cut(client: ops.ClientConfig) -> tuple[CutItem, float]:
    """A cut of the cluster, as the schedule starts one; its catalog item and wall seconds
    (``wait_cut`` polls every 0.5 s)."""
    started = time.monotonic()
    execution = ops.start_cut(client, CLUSTER, "bench:scheduled_cuts")
    progress = ops.wait_cut(client, execution, timeout=300)
    if progress.status != "SUCCEEDED":
        raise RuntimeError(f"cut {progress.status}: {progress.error}: {progress.cause}")
    return CutItem.model_validate(progress.record), time.monotonic() - started


def markers_of(cut: CutItem, nodes: list[Node]) -> list[dict[str, str]]:
    """The markers the agents saved for the cut's shards (absent ones left out)."""
    by_id = {node.node_id: node for node in nodes}
    found = []
    for shard_id, point in cut.shards.items():
        path = by_id[point.node_id].state_dir / "cuts" / cut.cut_id / f"{shard_id}.json"
        if path.exists():
            found.append(json.loads(path.read_text()))
    return found


def pause_split(markers: list[dict[str, str]]) -> dict[str, float]:
    """Where the longest node's pause went (cut_skew's ``pause_split``, from the saved markers):
    waiting for the lock, from the lock to the restore point, and from the point to letting go
    (the hold). Nothing when no node got the lock."""
    held = []
    for marker in markers:
        if "cut_pause" not in marker:
            continue
        asked, locked, released = pause_of(marker)
        created = float(marker["cut_at"])
        if locked:
            held.append((released - asked, locked - asked, created - locked, released - created))
    if not held:
        return {}
    _, lock_wait, to_point, hold = max(held)
    return dict(zip(SPLIT, (lock_wait, to_point, hold), strict=True))


def cut_row(cut: CutItem, wall: float, nodes: list[Node]) -> dict[str, Any]:
    return {
        "cut_id": cut.cut_id,
        "paused": cut.cut_paused,
        "pause_seconds": float(cut.cut_pause_seconds or 0),
        "skew_seconds": float(cut.cut_skew_seconds or 0),
        "late_seconds": float(cut.cut_late_seconds or 0),
        "wall_seconds": round(wall, 3),
        **pause_split(markers_of(cut, nodes)),
    }


def cuts_every(
    client: ops.ClientConfig, nodes: list[Node], count: int, every: float
) -> list[dict[str, Any]]:
    """``count`` cuts, one started every ``every`` seconds (at once after a slower one)."""
    started, rows = time.monotonic(), []
    for i in range(count):
        wait_until(started + i * every)
        cut, wall = take_cut(client)
        rows.append(cut_row(cut, wall, nodes))
        say(f"cut {i + 1}/{count}: {json.dumps(rows[-1])}")
    return rows


def cuts_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Paused x of y; pause, skew, lateness, wall time and the pause's parts (ms spreads)."""
    if not rows:
        return {"cuts": 0}
    return {
        "cuts": len(rows),
        "paused": sum(1 for r in rows if r["paused"] is True),
        "pause": spread([r["pause_seconds"] for r in rows]),
        "skew": spread([r["skew_seconds"] for r in rows]),
        "late": spread([r["late_seconds"] for r in rows]),
        "wall": spread([r["wall_seconds"] for r in rows]),
        **{
            part.removesuffix("_seconds"): spread([r[part] for r in rows if part in r])
            for part in SPLIT
            if any(part in r for r in rows)
        },
    }


def wait_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


# --- the servers' WAL --------------------------------------------------------------------------
def insert_lsn(conn: psycopg.Connection) -> str:
    return str(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def wal_since(conn: psycopg.Connection, lsn: str) -> int:
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)", (lsn,))
    return int(row.fetchone()[0])


def archived_count(conn: psycopg.Connection) -> int:
    return int(conn.execute("SELECT archived_count FROM pg_stat_archiver").fetchone()[0])


def archived_through(conn: psycopg.Connection, segment: str) -> bool:
    """Whether the server's archiver has handed over ``segment`` (it goes in order)."""
    last = conn.execute("SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver")
    return str(last.fetchone()[0])[:24] >= segment  # one timeline: names sort as the log


def spooled(node: Node) -> bool:
    """Whether the node's spool holds a WAL file the agent has not stored yet."""
    return any(walspool.WAL_FILE.fullmatch(p.name) for p in node.spool.iterdir())


def settle(conns: list[psycopg.Connection], nodes: list[Node], timeout: float) -> None:
    """Every node's WAL so far archived, stored and counted. A checkpoint first: its record is
    then the last that matters, so no timed checkpoint comes in the windows for what came
    before them; archive_timeout closes the segment it lies in (a pg_switch_wal would count
    as new activity, and bring a checkpoint after all)."""
    segments = []
    for conn in conns:
        conn.execute("CHECKPOINT")
        row = conn.execute("SELECT pg_walfile_name(pg_current_wal_insert_lsn())").fetchone()
        segments.append(str(row[0]))
    deadline = time.monotonic() + timeout
    while not all(archived_through(c, s) for c, s in zip(conns, segments, strict=True)) or any(
        spooled(n) for n in nodes
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"WAL up to {segments} not archived within {timeout:.0f} s")
        time.sleep(0.5)


# --- part 1: WAL per cut -----------------------------------------------------------------------
def wal_per_cut(
    client: ops.ClientConfig, conns: list[psycopg.Connection], nodes: list[Node], count: int
) -> dict[str, Any]:
    """The WAL each node writes across a cut of the idle cluster, over ``count`` cuts."""
    written: list[list[int]] = [[] for _ in conns]
    rows = []
    for i in range(count):
        before = [insert_lsn(c) for c in conns]
        cut, wall = take_cut(client)
        for found, conn, lsn in zip(written, conns, before, strict=True):
            found.append(wal_since(conn, lsn))
        rows.append(cut_row(cut, wall, nodes))
        say(f"idle cut {i + 1}/{count}: WAL {[w[-1] for w in written]} bytes")
    pooled = [b for found in written for b in found]
    return {
        "bytes_per_node": written,
        "min_bytes_per_node": [min(found) for found in written],
        "min_bytes": min(pooled),
        "median_bytes": statistics.median(pooled),
        "cut_rows": rows,
        **{"idle_" + k: v for k, v in cuts_summary(rows).items()},
    }


# --- part 2: archive per cut -------------------------------------------------------------------
def counters(stack: LocalStack, conns: list[psycopg.Connection]) -> dict[str, int]:
    """The cluster's archive counters (the catalog's) and its segments archived (the servers')."""
    totals = stack.services().catalog.archive_totals(CLUSTER)
    return {
        "stored_bytes": totals.stored_bytes if totals else 0,
        "wal_bytes": totals.wal_bytes if totals else 0,
        "batches": totals.batches if totals else 0,
        "segments": sum(archived_count(c) for c in conns),
    }


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTERS}


def archive_per_cut(
    stack: LocalStack,
    client: ops.ClientConfig,
    conns: list[psycopg.Connection],
    nodes: list[Node],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Two windows of the idle cluster, as long each: without cuts, then with them."""
    lag = args.archive_timeout + ARCHIVE_DELAY_SECONDS + LAG_SLACK_SECONDS
    length = args.idle_minutes * 60 + lag
    count = max(1, int(args.idle_minutes * 60 // args.idle_every_seconds))
    say("archive: checkpoint, and wait until every node's WAL is archived")
    settle(conns, nodes, args.archive_timeout + SETTLE_SLACK_SECONDS)
    say(f"archive: {length:.0f} s without cuts")
    first = counters(stack, conns)
    time.sleep(length)
    middle = counters(stack, conns)
    say(f"archive: {length:.0f} s with {count} cuts, one every {args.idle_every_seconds} s")
    started = time.monotonic()
    rows = cuts_every(client, nodes, count, args.idle_every_seconds)
    wait_until(started + length)
    last = counters(stack, conns)
    without, with_cuts = grown(first, middle), grown(middle, last)
    # Everything the window with cuts archived, counted as the cuts' (an upper bound): the
    # window before is no clean baseline to subtract, as it archives the checkpointed WAL of
    # the bench's earlier part (9 segments of the 2026-12-06 run, where an idle server has none).
    per_cut = {k: with_cuts[k] / (count * len(nodes)) for k in COUNTERS}
    return {
        "window_seconds": round(length, 1),
        "cuts": count,
        "without_cuts": without,
        "with_cuts": with_cuts,
        "per_cut_per_node": {k: round(v, 2) for k, v in per_cut.items()},
        "stored_bytes_per_segment": (
            round(with_cuts["stored_bytes"] / with_cuts["segments"])
            if with_cuts["segments"]
            else None
        ),
        "per_node_per_day": per_day(per_cut, args.archive_timeout),
        "cut_rows": rows,
    }


def per_day(per_cut: dict[str, float], archive_timeout: int) -> dict[str, Any]:
    """Per node and day at each period: a cut a period, but at most one segment closed per
    archive_timeout (cuts closer together share one)."""
    days = {}
    for minutes in EVERY_MINUTES:
        cuts = min(24 * 60 / minutes, 24 * 3600 / archive_timeout)
        days[f"every_{minutes}_min"] = {"cuts": round(cuts, 1)} | {
            k: round(v * cuts, 1) for k, v in per_cut.items()
        }
    return days


# --- part 3: pause under load ------------------------------------------------------------------
class BankLoad:
    """tests/integration/bank.py's workload in a process of its own, run as the integration
    test runs it (``python -m`` from the repository's root), until its stop file appears."""

    def __init__(self, conninfos: list[str], stop: Path, first_id: int, seconds: float) -> None:
        self.stop_file = stop
        command = [
            sys.executable, "-m", "tests.integration.bank", "--key", str(KEY),
            "--seconds", str(seconds + BANK_SPARE_SECONDS), "--stop-file", str(stop),
            "--first-id", str(first_id), *conninfos,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)

    def finish(self) -> dict[str, Any]:
        """Stops it; what it printed (transfers, lock_retries, p50_ms, p99_ms, max_ms)."""
        self.stop_file.touch()
        out, _ = self.process.communicate(timeout=60)
        if self.process.returncode != 0:
            raise RuntimeError(f"the bank workload exited with {self.process.returncode}")
        return json.loads(out)

    def __enter__(self) -> BankLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_file.touch()  # its own way out first: a transfer is never cut in two
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self.process.poll() is None:
            stop_process(self.process)


@contextlib.contextmanager
def probing(server: PostgresInstance) -> Iterator[list[float]]:
    """cut_skew's WakeProbe on ``server`` for the block; its overshoots (seconds) fill the list
    yielded once the block ends."""
    probe = WakeProbe(server)
    probe.start()
    overshoots: list[float] = []
    try:
        yield overshoots
    finally:
        try:
            overshoots.extend(probe.stop())
        except queue.Empty:  # it died: nothing to report, and nothing may be left running
            probe.process.terminate()
            probe.process.join(timeout=10)


def load_phase(
    nodes: list[Node],
    conns: list[psycopg.Connection],
    seconds: float,
    stop: Path,
    first_id: int,
    during: Callable[[], list[dict[str, Any]]],
) -> dict[str, Any]:
    """The workload and the probe for ``seconds`` (or until ``during`` is done, if later),
    ``during`` run once the transfers are under way."""
    conninfos = [n.server.conninfo for n in nodes]
    before = [insert_lsn(c) for c in conns]
    started = time.monotonic()
    with BankLoad(conninfos, stop, first_id, seconds) as load, probing(nodes[0].server) as lag:
        time.sleep(WARMUP_SECONDS)
        rows = during()
        wait_until(started + seconds)
        ran = load.finish()
    elapsed = time.monotonic() - started
    written = [wal_since(c, lsn) for c, lsn in zip(conns, before, strict=True)]
    return {
        "seconds": round(elapsed, 1),
        "bank": ran | {"transfers_per_second": round(ran["transfers"] / elapsed, 1)},
        "wal_bytes_per_second_per_node": [round(w / elapsed) for w in written],
        "wakeup_overshoot": wakeups(lag),
        "cut_rows": rows,
    }


def pause_under_load(
    client: ops.ClientConfig,
    conns: list[psycopg.Connection],
    nodes: list[Node],
    args: argparse.Namespace,
    root: Path,
) -> dict[str, Any]:
    """The workload alone, then with ``--cuts`` cuts, as long each."""
    seconds = args.cuts * args.every_seconds
    say(f"load: the bank workload alone for {seconds:.0f} s")
    alone = load_phase(nodes, conns, seconds, root / "bank-alone.stop", 1, list)
    say(f"load: the bank workload with {args.cuts} cuts, one every {args.every_seconds} s")
    with_cuts = load_phase(
        nodes,
        conns,
        seconds,
        root / "bank-cuts.stop",
        CUT_FIRST_ID,
        lambda: cuts_every(client, nodes, args.cuts, args.every_seconds),
    )
    summary = cuts_summary(with_cuts["cut_rows"])
    return {
        "alone": alone,
        "with_cuts": with_cuts,
        **summary,
        "share_paused": share_paused(summary.get("pause")),
        "bank_ratios": ratios(alone["bank"], with_cuts["bank"]),
    }


def share_paused(pause: dict[str, float] | None) -> dict[str, dict[str, float]]:
    """The share of time the commits wait, in percent, at each period: pause / (60 x minutes)."""
    if not pause:
        return {}
    return {
        f"every_{minutes}_min": {
            key.replace("_ms", "_percent"): round(pause[key] / 1000 / (60 * minutes) * 100, 6)
            for key in ("median_ms", "p90_ms", "max_ms")
        }
        for minutes in EVERY_MINUTES
    }


def ratios(alone: dict[str, Any], with_cuts: dict[str, Any]) -> dict[str, float | None]:
    """With cuts / without, of the workload's throughput and latencies."""
    return {
        key: round(with_cuts[key] / alone[key], 3) if alone.get(key) else None
        for key in ("transfers_per_second", "p50_ms", "p99_ms", "max_ms", "lock_retries")
    }


# --- the run -----------------------------------------------------------------------------------
def run(args: argparse.Namespace, root: Path, cleanup: contextlib.ExitStack) -> dict[str, Any]:
    policy = root / "policy.yaml"
    policy.write_text(
        POLICY.format(cluster=CLUSTER, delay=ARCHIVE_DELAY_SECONDS, key=KEY, database=bank.DATABASE)
    )
    say("starting the local stack")
    stack = cleanup.enter_context(LocalStack(root / "stack", policy_file=policy))
    say(f"starting {args.nodes} PostgreSQL nodes and their agents")
    push = copy_push_client(root)
    nodes = [
        build_node(root, i, push, args.archive_timeout, cleanup) for i in range(1, args.nodes + 1)
    ]
    bank.set_up([n.server.conninfo for n in nodes])
    cleanup.callback(stop_agents, stack, nodes)
    for node in nodes:
        stack.start_agent(node.config)
    stack.wait_for_nodes([n.node_id for n in nodes])
    conns = [
        cleanup.enter_context(psycopg.connect(n.server.conninfo, autocommit=True)) for n in nodes
    ]
    client = stack.client_config()
    version = str(conns[0].execute("SHOW server_version").fetchone()[0])
    say(f"WAL per cut: {args.idle_cuts} cuts of the idle cluster")
    wal = wal_per_cut(client, conns, nodes, args.idle_cuts)
    archive = archive_per_cut(stack, client, conns, nodes, args)
    load = pause_under_load(client, conns, nodes, args, root)
    return {"postgres": version, "wal_per_cut": wal, "archive_per_cut": archive, "load": load}


def notes(result: dict[str, Any], archive_timeout: int) -> list[str]:
    """What the figures mean, in words a docs section can take."""
    load_rate = statistics.median(result["load"]["with_cuts"]["wal_bytes_per_second_per_node"])
    return [
        f"An idle server closes no segment; each cut's restore point is WAL, so archive_timeout "
        f"({archive_timeout} s) closes a segment for it: at most one segment per "
        f"archive_timeout whatever the cuts' rate (the per-day figures are capped so).",
        f"A cut writes {result['wal_per_cut']['min_bytes']} bytes of WAL per node; under the "
        f"bank load each node wrote {load_rate:.0f} bytes a second, so on a busy server the cut "
        "is lost in the load's WAL: its segments fill and close on their own, and a cut adds "
        "no segment and no batch.",
        "Each batch is two PUTs to the store (the object and its index) and two calls of the "
        "archive function (sign, record).",
        "A cut also makes the next timed checkpoint happen (checkpoint_timeout after the last), "
        "whose record closes one more segment unless it shares the cut's: counted when it fell "
        "inside the window ('segments' in archive_per_cut).",
    ]


def summary_lines(result: dict[str, Any]) -> list[str]:
    args, wal = result["args"], result["wal_per_cut"]
    archive, load = result["archive_per_cut"], result["load"]
    alone, cut = load["alone"]["bank"], load["with_cuts"]["bank"]
    lines = [
        f"Scheduled cuts: {args['nodes']} PostgreSQL {result['postgres']} nodes, archive_timeout "
        f"{args['archive_timeout']} s, {result['machine']['cpus']} cores, "
        f"{result['wall_seconds']:.0f} s.",
        "",
        f"Pause under the bank load ({load['cuts']} cuts, one every {args['every_seconds']} s):",
        f"  paused {load.get('paused', 0)}/{load['cuts']}; pause {ms(load.get('pause'))}",
        *(
            f"  {part}: {ms(load[part])}"
            for part in ("pause_lock_wait", "pause_to_point", "pause_hold")
            if part in load
        ),
        f"  skew {ms(load.get('skew'))}; late {ms(load.get('late'))}",
        "  share of time commits wait (median pause / period): "
        + ", ".join(
            f"{v['median_percent']:.4f}% every {k.split('_')[1]} min"
            for k, v in load["share_paused"].items()
        ),
        f"  bank alone:     {bank_text(alone)}",
        f"  bank with cuts: {bank_text(cut)}",
        f"  with / without: {load['bank_ratios']}",
        f"  wake-up overshoot of a 10 ms sleep, with cuts: "
        f"{ms(load['with_cuts']['wakeup_overshoot'])}",
        "",
        f"WAL a cut writes (idle, min of {wal['idle_cuts']} cuts): {wal['min_bytes']} bytes per "
        f"node (median {wal['median_bytes']:.0f}); idle pause {ms(wal.get('idle_pause'))}",
        "",
        f"Archive of the idle cluster ({archive['window_seconds']:.0f} s without cuts, as long "
        f"with {archive['cuts']}):",
        f"  without cuts (all nodes): {archive_text(archive['without_cuts'])}",
        f"  with cuts (all nodes):    {archive_text(archive['with_cuts'])}",
        f"  per cut and node (at most): {archive_text(archive['per_cut_per_node'])}",
        f"  stored bytes per segment (with cuts): {archive['stored_bytes_per_segment']}",
        *(
            f"  per node and day, {k.replace('_', ' ')}: {v['cuts']:.0f} cuts, {archive_text(v)}"
            for k, v in archive["per_node_per_day"].items()
        ),
        "",
        *(f"- {note}" for note in result["notes"]),
    ]
    return lines


def ms(values: dict[str, Any] | None) -> str:
    if not values:
        return "-"
    return f"median {values['median_ms']} ms, p90 {values['p90_ms']} ms, max {values['max_ms']} ms"


def archive_text(counts: dict[str, float]) -> str:
    return (
        f"{counts['segments']:g} segments, {counts['stored_bytes'] / 1024:.1f} KiB stored, "
        f"{counts['wal_bytes'] / 2**20:.1f} MiB of WAL, {counts['batches']:g} batches"
    )


def bank_text(ran: dict[str, Any]) -> str:
    return (
        f"{ran['transfers_per_second']} transfers/s, p50 {ran['p50_ms']} ms, p99 "
        f"{ran['p99_ms']} ms, max {ran['max_ms']} ms, {ran['lock_retries']} lock retries"
    )


def write_results(result: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"scheduled_cuts-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The cost of a scheduled cut: the commit pause under load, the WAL a cut "
        "writes, and what it adds to an idle cluster's WAL archive per day."
    )
    parser.add_argument("--nodes", type=int, default=3, help="PostgreSQL nodes (default 3)")
    parser.add_argument(
        "--cuts", type=int, default=20, help="cuts under the bank load (default 20)"
    )
    parser.add_argument(
        "--every-seconds",
        type=float,
        default=6.0,
        help="one cut under load every this many seconds; also sets how long the workload runs "
        "alone: cuts x this (default 6)",
    )
    parser.add_argument(
        "--idle-cuts", type=int, default=10, help="cuts of the idle cluster for its WAL (10)"
    )
    parser.add_argument(
        "--idle-minutes",
        type=float,
        default=4.0,
        metavar="W",
        help="the archive's windows: W minutes without cuts, then W with them (default 4)",
    )
    parser.add_argument(
        "--idle-every-seconds",
        type=float,
        default=60.0,
        help="one cut every this many seconds in the archive's window with cuts (default 60)",
    )
    parser.add_argument(
        "--archive-timeout", type=int, default=60, help="the servers' archive_timeout (60)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results", help="results directory"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if min(args.nodes - 1, args.cuts, args.idle_cuts, args.idle_minutes) <= 0:
        parser.error("--nodes must be 2 or more; --cuts, --idle-cuts, --idle-minutes positive")
    return args


def terminate(signum: int, _frame: object) -> None:
    say(f"signal {signum}: stopping everything")
    raise SystemExit(128 + signum)  # unwinds the ExitStack: everything started is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate)
    started = time.time()
    with contextlib.ExitStack() as cleanup:
        root = make_workdir(argparse.Namespace(workdir=None, keep=args.keep), cleanup)
        measured = run(args, root, cleanup)
        say("stopping everything")
    result: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "wall_seconds": round(time.time() - started, 1),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "load_average_end": os.getloadavg()},
        **measured,
    }
    result["notes"] = notes(result, args.archive_timeout)
    path = write_results(result, args.out)
    print("\n".join(summary_lines(result)))
    print(f"\nRaw results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
