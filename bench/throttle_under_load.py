"""How much a full backup hurts a PostgreSQL write load, for several backup configurations
side by side, in one run on one machine (issue 14).

Usage::

    .venv/bin/python bench/throttle_under_load.py [--scale 100] [--rounds 1] [--max-seconds 20]
        [--load-fraction 0.7] [--fixed-mib 10,20,30,40,60] [--out bench/results]

Terms:

* *environment*: ``backup_vs_peers.py``'s, set up by its code (``setup``): one PostgreSQL 15
  (``initdb --data-checksums``, ``wal_level=replica``, ``shared_buffers=512MB``, WAL archived
  by pgBackRest's ``archive-push`` into a second MinIO over TLS) filled by ``pgbench -i -s
  SCALE`` in database ``postgres``; the local stack (moto's Step Functions running the real
  ASL, the Lambda handlers in this process, MinIO as the store) with one source agent (and
  the idle restore agent that setup starts). With ``--shardvault-archive`` ShardVault archives
  the WAL continuously too: its push into the agent's spool follows pgBackRest's
  ``archive-push`` in ``archive_command``, the agent's archiver stores the spool (the policy's
  ``archive: {max_delay_seconds: 60}``, the default), and ShardVault's backups take their WAL
  from the archive (archived tails) instead of holding and copying it. The archiver runs in
  every window, with or without a backup; *settled* then also waits until the spool is empty
  (before the write load) or holds no file older than 90 s (under it).
* *policy*: the bench cluster's entry in a policy file of the work directory (version 1,
  ``engine: postgres``, a nightly schedule, a vault, ``retention``, and the configuration's
  ``upload``), which the local stack's ``settings.policy_file`` is pointed at before each
  ShardVault backup. The stack's vault is switched off for the whole run (``vault_url``
  unset): a cluster the policy names is promoted into the vault by its backup's own
  execution (the Promote state), a copy from the store to moto's S3 that on AWS runs in
  Lambda, off the database host, and here would run in this process on the same two cores
  and lengthen the backup's window. Without a vault the execution ends when the backup is
  verified and its manifest written, as ``backup_vs_peers.py``'s backups do.
* *configurations*, each one full backup per round:

  1. ``sv-unthrottled``: ShardVault, the policy's ``upload: {throttle: static}`` and no rate
     limit (the agent has none of its own either);
  2. ``sv-fixed-<N>``, one for each rate of ``--fixed-mib`` (default 10, 20, 30, 40 and 60):
     ``upload: {throttle: static, rate_limit_mib_per_second: N}`` (the policy's default
     throttle, ``auto``, would steer it under the load);
  3. ``sv-adaptive``: ``upload: {throttle: adaptive}`` (its window and floor at the policy's
     defaults, 360 minutes and 4 MiB/s);
  4. ``pgbackrest-zst-pm2``: ``pgbackrest backup --type=full`` as ``backup_vs_peers.py`` runs
     it (``compress-type=zst`` at its default level 3, ``start-fast=y``), ``--process-max=2``;
  5. ``pgbackrest-zst-pm1``: the same with ``--process-max=1``.

* *maximum rate*: ``pgbench -N -c 4 -j 2 -T <warm-up + --max-seconds>`` on ``postgres`` (the
  simple-update script: an account updated, a history row inserted, committed), run once
  after the idle reference; its tps over the ``--max-seconds`` (default 20) after
  ``--warm-up-seconds`` (default 5) of warm-up, counted from its per-transaction log.
* *write load*: ``pgbench -N -c 4 -j 2 -R <rate> -T <LOAD_SECONDS> -l --log-prefix=<work
  dir>/load`` in a process of its own (never a thread here: the control plane runs in this
  process), where *rate* is ``--load-fraction`` (0.7) of the maximum; it runs from after the
  maximum rate's measure through every round and is stopped at the end. With ``-R`` each
  client's transactions are *scheduled* (a Poisson process at the rate's share of each
  client) and pgbench catches up when behind: the backlog is kept, not skipped. Its
  per-transaction log (one file per thread) gives, for each transaction: its completion time
  (Unix epoch), its *latency* (from its scheduled start to its end) and its *schedule lag*
  (from its scheduled start to its actual start, the time it waited in the backlog). *Latency
  without lag* is latency minus lag: the time the server took to run it.
* *backlog*: the load is *caught up* when the median schedule lag of the transactions it
  logged over its last 2 s (``CATCH_UP_SPAN``) is at most ``--backlog-ms`` (default 50).
* *settled*: the agents back at their idle poll rate (``backup_vs_peers.quiet_agents``; after
  every backup, of either tool, the machine is held ``busy_window_seconds``, 30 s, before it
  counts as settled, so every baseline starts as long after its backup), WAL archiving caught
  up and ``sync`` (``backup_vs_peers.settle``), and the write load caught up.
* *backup window*: ShardVault, ``start_backup`` to the execution's stop (its SUCCEEDED);
  pgBackRest, its process's start to its exit. *Wall time*: the window's length.
* *during*: the transactions the load completed in the window; *baseline*: those it completed
  in a window of the same length with no backup, that starts once the machine is settled
  again after the backup. Of each: *tps* (transactions ÷ the window's length), p50 and p99 of
  latency (with its lag) and of latency without lag, p99 of schedule lag, and the worst whole
  second's count. *tps ratio*: tps during ÷ tps baseline; *transactions short*: the
  baseline's tps times the window's length less the transactions completed in it.
* *busy cores*: the machine's (everything on it counts) over the window and over its
  baseline, from ``/proc/stat`` read every half second (``CpuSampler``). *CPU bound*: the
  idle reference's CPU (its agent's, the control plane's and its MinIO's) over the cores the
  baselines leave idle: the least wall time at which that backup could run on the cores the
  load does not use, and that ÷ the idle backup's wall time.
* *throttle* (ShardVault): the catalog record's ``throttle`` field as the agent last reported
  it (adaptive only: ``cuts``, ``throttled_seconds``, ``lowest_rate_bytes_per_second``,
  ``limited_by``, ``floor_bytes_per_second``), and the record's ``duration_seconds`` (the
  manifest's start to completion).
* *server cgroup*: the PostgreSQL server (its postmaster and every process it has forked, and
  so every later backend) is moved into a cgroup v2 of its own under the cgroup2 mount
  (``shardvault-bench-<pid>``), as systemd runs it (``postgresql@15-main.service``), so the
  agent's stall signal is the server's own (``throttle.pressure_files``), not the host's with
  pgbench, MinIO and the control plane in it. Where no cgroup can be made the setup says so
  (``server_cgroup``: null) and the host's is used. The agent's priority is its
  configuration's (``--agent-set low_priority=true`` stands in for the systemd unit's
  ``CPUWeight``/``IOWeight``, which need cgroup controllers this machine's hybrid hierarchy
  lacks).
* *safe*: a configuration whose backups kept the load's tps ratio at least 0.95 and its p99
  without lag at most 1.25 times its baseline's (medians over the rounds); the *fastest safe
  fixed rate* is the ``sv-fixed-<N>`` with the least median wall time among the safe ones,
  and issue 47's target is the adaptive backup safe within 1.25 times its wall time.
* *idle reference*: one ``sv-unthrottled`` backup at the start of the run, before the write
  load exists (settled machine, no client but the agent); the issue's target is each
  backup's wall time at most 2 times this one (*÷ idle*).

Each round runs every configuration once, on a settled machine, the load waited for until it
has no backlog before each backup; the order alternates (odd rounds as listed, even rounds
reversed). After each run's baseline its backup is deleted (ShardVault: its objects in the
store; pgBackRest: ``expire`` of every backup but the newest), untimed, for disk space.
Figures over several rounds are given as min / median / max. Raw results go to ``--out`` as
JSON, the tables to stdout and beside the JSON as Markdown, with the command that reproduces
them. Everything started here (the write load, both MinIO servers, PostgreSQL, the local stack
and its agents) is stopped and the work directory removed on the way out, also on failure,
Ctrl-C or SIGTERM (``--keep`` keeps the directory).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import backup_vs_peers as bvp
import boto3
import yaml
from peers import delete_prefix
from report import MiB, median_cell, spread_cell, spread_of

from shardvault.aws import lambda_support
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest
from shardvault.local.postgres import PostgresInstance, stop_process
from shardvault.local.processes import die_with_parent

DBNAME = "postgres"  # where backup_vs_peers' setup runs pgbench -i
CLIENTS, JOBS = 4, 2
LOAD_SECONDS = 86_400  # the load's -T: longer than any run; it is stopped at the end
CATCH_UP_SPAN = 2.0  # seconds of the newest logged transactions the backlog is judged on
CATCH_UP_TIMEOUT = 600.0
FRESH_SECONDS = 5.0  # the load's newest logged transaction is at most this old when caught up
LOG_TIMEOUT = 60.0  # seconds to wait for the load's log to cover a window's end
LOG_POLL = 0.2
WINDOW_SLACK = 5.0  # seconds: a thread's log lines may be out of order by less than this
IDLE = "sv-unthrottled-idle"
IDLE_TARGET = 2.0  # issue 14's: a backup's wall time at most 2x the idle unthrottled one
SAFE_TPS_RATIO = 0.95  # a *safe* backup: the load kept this share of its throughput
SAFE_P99_RATIO = 1.25  # and its p99 without lag at most this times its baseline's
ADAPTIVE_TARGET = 1.25  # issue 47's: adaptive wall time at most this times the best safe fixed
ARCHIVE_DELAY_SECONDS = 60.0  # the policy's default archive.max_delay_seconds
POLICY_BASE: dict[str, Any] = {  # the bench cluster's entry, less its upload
    "engine": "postgres",
    "schedule": {"full": "0 2 * * *"},
    "vault": {"storage_class": "GLACIER_IR", "object_lock": {"mode": "GOVERNANCE", "days": 1}},
    "retention": {"keep_daily": 1},
}

CPU_SAMPLE_SECONDS = 0.5
say = bvp.say


# --- configurations -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Configuration:
    """One backup configuration: ShardVault with a policy ``upload`` mapping, or pgBackRest
    with a ``process_max``."""

    name: str
    label: str
    upload: dict[str, Any] | None = None
    process_max: int | None = None

    @property
    def tool(self) -> str:
        return "pgbackrest" if self.process_max else "shardvault"


FIXED = "sv-fixed-"  # a fixed-rate configuration's name: this and its rate in MiB/s


def configurations(fixed_mib: list[float]) -> tuple[Configuration, ...]:
    fixed = [
        Configuration(
            f"{FIXED}{rate:g}",
            f"ShardVault, rate limit {rate:g} MiB/s",
            {"throttle": "static", "rate_limit_mib_per_second": float(rate)},
        )
        for rate in fixed_mib
    ]
    return (
        Configuration(
            "sv-unthrottled", "ShardVault, static, no rate limit", {"throttle": "static"}
        ),
        *fixed,
        Configuration("sv-adaptive", "ShardVault, adaptive throttle", {"throttle": "adaptive"}),
        Configuration("pgbackrest-zst-pm2", "pgBackRest full, zst, process-max=2", process_max=2),
        Configuration("pgbackrest-zst-pm1", "pgBackRest full, zst, process-max=1", process_max=1),
    )


def fixed_rates(text: str) -> list[float]:
    """``--fixed-mib``: comma-separated positive rates in MiB/s."""
    rates = sorted({float(part) for part in text.split(",") if part.strip()})
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError("give one or more positive rates, e.g. 10,20,40")
    return rates


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bvp.add_environment_arguments(parser)
    parser.add_argument(
        "--rounds", dest="runs", type=int, help="rounds, each configuration once a round"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=20.0, help="how long the maximum rate is measured"
    )
    parser.add_argument(
        "--warm-up-seconds", type=float, default=5.0, help="pgbench before the maximum counts"
    )
    parser.add_argument(
        "--load-fraction", type=float, default=0.7, help="the write load's rate ÷ its maximum"
    )
    parser.add_argument(
        "--fixed-mib",
        type=fixed_rates,
        default=fixed_rates("10,20,30,40,60"),
        help="the fixed rate limits to sweep, MiB/s, comma-separated (one sv-fixed-N each)",
    )
    parser.add_argument(
        "--backlog-ms",
        type=float,
        default=50.0,
        help="the load is caught up when its median schedule lag is at most this",
    )
    parser.add_argument(
        "--configs",
        default="all",
        help="comma-separated subset of sv-unthrottled, sv-fixed (every fixed rate), "
        "sv-adaptive, pgbackrest-zst-pm2, pgbackrest-zst-pm1 (default: all)",
    )
    # backup_vs_peers' setup also makes the s3transfer controls' clients; none run here.
    parser.set_defaults(runs=1, s3_chunk_mib=8, s3_concurrency=4, s3_signed_payload=False)
    args = parser.parse_args(argv)
    bvp.check_environment_arguments(parser, args)
    if not 0 < args.load_fraction <= 1:
        parser.error("--load-fraction must be in (0, 1]")
    if args.max_seconds <= 0 or args.warm_up_seconds < 0:
        parser.error("--max-seconds must be positive, --warm-up-seconds not < 0")
    names = [c.name for c in configurations(args.fixed_mib)]
    chosen = {c.strip() for c in args.configs.split(",") if c.strip()}
    if "all" in chosen:
        chosen = set(names)
    if "sv-fixed" in chosen:
        chosen = (chosen - {"sv-fixed"}) | {n for n in names if n.startswith(FIXED)}
    if unknown := sorted(chosen - set(names)):
        parser.error(f"unknown configurations {', '.join(unknown)}")
    args.configs = [name for name in names if name in chosen]
    return args


# --- pgbench's per-transaction log --------------------------------------------------------------
def percentile(values: list[float], fraction: float) -> float | None:
    """The nearest-rank percentile (None of nothing)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else None


@dataclass
class ThreadLog:
    """One pgbench thread's log file, read as it grows: per transaction, its completion time
    (epoch s), latency and schedule lag (µs; lag 0 without ``-R``)."""

    path: Path
    offset: int = 0
    rest: bytes = b""
    done: array = field(default_factory=lambda: array("d"))
    latency: array = field(default_factory=lambda: array("d"))
    lag: array = field(default_factory=lambda: array("d"))
    not_done: int = 0  # lines of failed or skipped transactions

    def read_new(self) -> None:
        with self.path.open("rb") as log:
            log.seek(self.offset)
            chunk = log.read()
        self.offset += len(chunk)
        lines = (self.rest + chunk).split(b"\n")
        self.rest = lines.pop()  # an unfinished line: pgbench writes through a stdio buffer
        for line in lines:
            self._add(line.split())

    def _add(self, fields: list[bytes]) -> None:
        # client_id transaction_no time script_no time_epoch time_us [schedule_lag] [retries]
        if len(fields) < 6:
            return
        if not fields[2].isdigit():  # "skipped" or "failed"
            self.not_done += 1
            return
        self.done.append(int(fields[4]) + int(fields[5]) / 1e6)
        self.latency.append(float(fields[2]))
        self.lag.append(float(fields[6]) if len(fields) > 6 else 0.0)

    @property
    def newest(self) -> float:
        return self.done[-1] if self.done else 0.0

    def between(self, start: float, end: float) -> list[tuple[float, float, float]]:
        """(done, latency µs, lag µs) of the transactions completed in [start, end)."""
        first = bisect.bisect_left(self.done, start - WINDOW_SLACK)
        last = bisect.bisect_left(self.done, end + WINDOW_SLACK)
        return [
            (self.done[i], self.latency[i], self.lag[i])
            for i in range(first, last)
            if start <= self.done[i] < end
        ]


def thread_logs(prefix: Path, pid: int) -> list[ThreadLog]:
    """pgbench's log files: ``<prefix>.<pid>`` (thread 0) and ``<prefix>.<pid>.<n>``."""
    paths = sorted(prefix.parent.glob(f"{prefix.name}.{pid}*"))
    return [ThreadLog(path) for path in paths]


def window_figures(
    transactions: list[tuple[float, float, float]], start: float, end: float
) -> dict[str, Any]:
    """What the load did from ``start`` to ``end`` (see the module docstring)."""
    seconds = end - start
    with_lag = [latency / 1000 for _, latency, _ in transactions]
    no_lag = [(latency - lag) / 1000 for _, latency, lag in transactions]
    lags = [lag / 1000 for _, _, lag in transactions]
    per_second = Counter(int(done - start) for done, _, _ in transactions)
    return {
        "start": start,
        "seconds": seconds,
        "transactions": len(transactions),
        "tps": len(transactions) / seconds,
        "worst_second_tps": min((per_second[i] for i in range(int(seconds))), default=None),
        "latency_p50_ms": percentile(with_lag, 0.50),
        "latency_p99_ms": percentile(with_lag, 0.99),
        "latency_no_lag_p50_ms": percentile(no_lag, 0.50),
        "latency_no_lag_p99_ms": percentile(no_lag, 0.99),
        "lag_p50_ms": percentile(lags, 0.50),
        "lag_p99_ms": percentile(lags, 0.99),
    }


# --- pgbench ------------------------------------------------------------------------------------
def pgbench_command(pg: PostgresInstance, log_prefix: Path, *options: str) -> list[str]:
    """``pgbench -N -c 4 -j 2`` with a per-transaction log under ``log_prefix``."""
    return [
        str(pg.bin_dir / "pgbench"),
        "-N",
        "-c",
        str(CLIENTS),
        "-j",
        str(JOBS),
        *options,
        "-l",
        f"--log-prefix={log_prefix}",
        *pg._client_args(),
        DBNAME,
    ]


def measure_max_rate(bench: bvp.Bench, args: argparse.Namespace) -> dict[str, Any]:
    """pgbench without a rate (see *maximum rate*), its tps counted from its log."""
    seconds = math.ceil(args.warm_up_seconds + args.max_seconds) + 1
    prefix = bench.root / "max-rate"
    cmd = pgbench_command(bench.pg, prefix, "-T", str(seconds))
    say(f"maximum rate: pgbench -N -c {CLIENTS} -j {JOBS} -T {seconds}, after a warm-up")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd="/", check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pgbench (maximum rate) failed: {done.stdout}{done.stderr}")
    logs = thread_logs(prefix, _pid_of_logs(prefix))
    for log in logs:
        log.read_new()
    first = min(log.done[0] for log in logs if log.done)
    start = first + args.warm_up_seconds
    end = start + args.max_seconds
    figures = window_figures([t for log in logs for t in log.between(start, end)], start, end)
    figures = {k: v for k, v in figures.items() if "lag" not in k}  # no schedule without -R
    summary = [line for line in done.stdout.splitlines() if line.startswith(("tps", "latency"))]
    return figures | {"command": shlex.join(cmd), "pgbench_summary": summary}


def _pid_of_logs(prefix: Path) -> int:
    """The pid in the name of the log files under ``prefix`` (one pgbench run wrote them)."""
    pids = {int(p.name[len(prefix.name) + 1 :].split(".")[0]) for p in _log_paths(prefix)}
    if len(pids) != 1:
        raise RuntimeError(f"expected one pgbench run's logs under {prefix}, found pids {pids}")
    return pids.pop()


def _log_paths(prefix: Path) -> list[Path]:
    return sorted(prefix.parent.glob(f"{prefix.name}.*"))


@dataclass
class WriteLoad:
    """The write load's pgbench process and its logs (see *write load*)."""

    process: subprocess.Popen
    prefix: Path
    output: Path
    rate: float
    command: list[str]
    logs: list[ThreadLog] = field(default_factory=list)

    @classmethod
    def start(cls, pg: PostgresInstance, rate: float, prefix: Path) -> WriteLoad:
        options = ("-R", f"{rate:.3f}", "-T", str(LOAD_SECONDS))
        cmd = pgbench_command(pg, prefix, *options)
        output = prefix.with_name(f"{prefix.name}-pgbench.out")
        with output.open("wb") as out:
            process = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd="/",
                preexec_fn=die_with_parent(),  # noqa: PLW1509 - only prctl runs before exec
            )
        load = cls(process, prefix, output, rate, cmd)
        load.wait_for_logs()
        return load

    def wait_for_logs(self) -> None:
        """Until pgbench opened one log per thread (after its vacuum and connections)."""
        deadline = time.monotonic() + LOG_TIMEOUT
        while len(logs := thread_logs(self.prefix, self.process.pid)) < JOBS:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbench opened no log under {self.prefix}: {self.tail()}")
            time.sleep(LOG_POLL)
        self.logs = logs

    def tail(self) -> str:
        return self.output.read_text(errors="replace")[-2000:]

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"the write load (pgbench) exited with {self.process.returncode}: {self.tail()}"
            )

    def read_new(self) -> None:
        for log in self.logs:
            log.read_new()

    def stop(self) -> None:
        stop_process(self.process)

    def outcome(self) -> dict[str, Any]:
        """What the load's log and output say of the whole run (failed or skipped lines, a
        client's error)."""
        self.read_new()
        return {
            "load_transactions": sum(len(log.done) for log in self.logs),
            "load_not_done": sum(log.not_done for log in self.logs),
            "load_output_tail": self.tail(),
        }

    def wait_logged(self, end: float) -> None:
        """Until every thread's log holds a transaction completed at or after ``end``."""
        deadline = time.monotonic() + LOG_TIMEOUT
        while True:
            self.read_new()
            if all(log.newest >= end for log in self.logs):
                return
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the write load's log stopped before {end:.1f}")
            time.sleep(LOG_POLL)

    def window(self, start: float, end: float) -> dict[str, Any]:
        self.wait_logged(end)
        transactions = [t for log in self.logs for t in log.between(start, end)]
        return window_figures(transactions, start, end)

    def backlog_ms(self) -> float | None:
        """The median schedule lag over the newest ``CATCH_UP_SPAN`` logged (None: the log
        is not fresh)."""
        self.read_new()
        newest = max(log.newest for log in self.logs)
        if newest < time.time() - FRESH_SECONDS:
            return None
        recent = [t for log in self.logs for t in log.between(newest - CATCH_UP_SPAN, newest)]
        return statistics.median(lag / 1000 for _, _, lag in recent) if recent else None

    def catch_up(self, backlog_ms: float) -> float:
        """Waits until the load has no backlog; returns how long that took."""
        started = time.monotonic()
        while (lag := self.backlog_ms()) is None or lag > backlog_ms:
            self.check_alive()
            if time.monotonic() - started > CATCH_UP_TIMEOUT:
                raise RuntimeError(
                    f"the write load still has a backlog after {CATCH_UP_TIMEOUT:.0f} s "
                    f"(median schedule lag {lag} ms)"
                )
            time.sleep(0.5)
        return time.monotonic() - started


# --- the policy and the vault -------------------------------------------------------------------
def use_policy(bench: bvp.Bench, upload: dict[str, Any]) -> Path:
    """Writes the bench cluster's policy with ``upload`` and points the stack at it (read by
    the control plane at each backup)."""
    path = bench.root / "policy.yaml"
    cluster = POLICY_BASE | {"upload": upload}
    if bench.args.shardvault_archive:  # the agent archives: its batches go once a minute
        cluster["archive"] = {"max_delay_seconds": ARCHIVE_DELAY_SECONDS}
    policy = {"version": 1, "clusters": {bvp.CLUSTER: cluster}}
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    bench.stack.settings.policy_file = str(path)
    return path


def without_vault(bench: bvp.Bench) -> None:
    """No promotion into the vault (see *policy* in the module docstring): the handlers get
    settings without one (their services cache the vault, so they are made again)."""
    bench.stack.settings.vault_url = None
    lambda_support.use_settings(bench.stack.settings)


# --- the backups --------------------------------------------------------------------------------
def plain(value: Any) -> Any:
    """A catalog value as JSON would carry it (DynamoDB's Decimals as numbers)."""
    return json.loads(json.dumps(value, default=float))


def shardvault_run(bench: bvp.Bench, config: Configuration) -> dict[str, Any]:
    """A ShardVault full backup under ``config``'s policy (``backup_vs_peers``' timing)."""
    use_policy(bench, config.upload or {})
    backup = bvp.shardvault_backup(bench, BackupRequest(cluster=bvp.CLUSTER))
    stopped = boto3.client("stepfunctions").describe_execution(executionArn=backup.arn)
    end = stopped["stopDate"].timestamp()
    record = ops.as_row(ops.show_backup(bench.client, bvp.CLUSTER, backup.manifest.backup_id))
    result = backup.result | {
        "window": (end - backup.result["seconds"], end),
        "store_prefix": backup.prefix,
        "upload_policy": config.upload,
        "catalog_duration_seconds": plain(record.get("duration_seconds")),
        "promoted": record.get("location") == "vault",  # never, without a vault
        "throttle": plain(record.get("throttle")),
        "held_log_bytes": plain(record.get("held_log_bytes")),  # the source guard's report
    }
    with contextlib.suppress(ValueError):  # a history of unexpected shape loses the split only
        result |= bvp.timeline(bench, backup.arn, backup.manifest.backup_id)
    return result


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pgbackrest_run(bench: bvp.Bench, config: Configuration) -> dict[str, Any]:
    """``pgbackrest backup --type=full --process-max=N``, timed from its start to its exit
    (``PgBackRest.backup`` takes no options, hence this wrapper of its ``run``)."""
    cpu = children_cpu()
    started = time.time()
    bench.pgbackrest.run("backup", "--type=full", f"--process-max={config.process_max}")
    ended = time.time()
    cpu = children_cpu() - cpu
    last = bench.pgbackrest.info()["backup"][-1]
    return {
        "seconds": ended - started,
        "window": (started, ended),
        "label": last["label"],
        "bytes": last["info"]["size"],
        "repo_bytes": last["info"]["repository"]["size"],
        "process_max": config.process_max,
        "compress_type": bvp.PGBACKREST_COMPRESS_TYPE,
        "client_cpu_seconds": round(cpu, 2),
    }


RUNNERS: dict[str, Callable[[bvp.Bench, Configuration], dict[str, Any]]] = {
    "shardvault": shardvault_run,
    "pgbackrest": pgbackrest_run,
}


def discard(bench: bvp.Bench, result: dict[str, Any]) -> None:
    """Deletes the run's backup (untimed; disk space): see the module docstring."""
    if prefix := result.get("store_prefix"):
        delete_prefix(bench.store_s3, bench.store_bucket, prefix)
    if label := result.get("label"):
        for backup in bench.pgbackrest.info()["backup"]:
            if backup["label"] != label:
                bench.pgbackrest.expire(backup["label"])


# --- rounds -------------------------------------------------------------------------------------
@dataclass
class CpuSampler:
    """The machine's busy cores over any window of the run: ``/proc/stat``'s first line read
    every ``CPU_SAMPLE_SECONDS`` by a thread (everything on the machine counts)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (time, busy jiffies, all jiffies)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(CPU_SAMPLE_SECONDS):
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            idle = fields[3] + fields[4]  # idle and iowait
            self.samples.append((time.time(), sum(fields[:8]) - idle, sum(fields[:8])))

    def busy_cores(self, start: float, end: float) -> float | None:
        """The cores busy on average between the samples nearest ``start`` and ``end``."""
        times = [t for t, _, _ in self.samples]
        first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if last <= first:
            return None
        (_, busy_a, all_a), (_, busy_b, all_b) = self.samples[first], self.samples[last]
        return (busy_b - busy_a) / max(1, all_b - all_a) * (os.cpu_count() or 1)

    def stop(self) -> None:
        self.stopping.set()


@dataclass
class Harness:
    """The environment, the write load (None before it starts) and the configurations."""

    args: argparse.Namespace
    bench: bvp.Bench
    configs: dict[str, Configuration]
    load: WriteLoad | None = None
    idle_seconds: float = 0.0
    idle_result: dict[str, Any] | None = None
    cpu: CpuSampler = field(default_factory=CpuSampler)


def settle(h: Harness) -> dict[str, Any]:
    """See *settled*; returns how long each part waited."""
    quiet = bvp.quiet_agents(h.bench)
    started = time.monotonic()
    bvp.settle(h.bench, loaded=h.load is not None)
    settled = quiet | {"archive_sync_seconds": round(time.monotonic() - started, 1)}
    if h.load:
        settled["catch_up_seconds"] = round(h.load.catch_up(h.args.backlog_ms), 1)
    return settled


def backup(h: Harness, config: Configuration) -> dict[str, Any]:
    """One backup on a settled machine; the machine is then held busy (see *settled*)."""
    settled = settle(h)
    load_before = os.getloadavg()[0]
    result = RUNNERS[config.tool](h.bench, config)
    h.bench.agents_busy_until = time.monotonic() + h.bench.busy_window
    return result | {"settle": settled, "load_before": load_before}


def load_figures(h: Harness, window: tuple[float, float]) -> dict[str, Any]:
    """The load during ``window`` and over its baseline (see the module docstring)."""
    assert h.load is not None
    start, end = window
    during = h.load.window(start, end)
    settled = settle(h)
    base_start = time.time()
    time.sleep(end - start)
    baseline = h.load.window(base_start, base_start + end - start)
    during["busy_cores"] = h.cpu.busy_cores(start, end)
    baseline["busy_cores"] = h.cpu.busy_cores(base_start, base_start + end - start)
    return {
        "load": during,
        "baseline": baseline,
        "baseline_settle": settled,
        "tps_ratio": during["tps"] / baseline["tps"] if baseline["tps"] else None,
        "transactions_short": baseline["tps"] * (end - start) - during["transactions"],
    }


def measured_run(h: Harness, config: Configuration, index: int) -> dict[str, Any]:
    result = backup(h, config)
    result |= load_figures(h, result.pop("window"))
    discard(h.bench, result)
    during, base = result["load"], result["baseline"]
    p99 = (during["latency_no_lag_p99_ms"], base["latency_no_lag_p99_ms"])
    result |= {
        "round": index,
        "wall_vs_idle": result["seconds"] / h.idle_seconds,
        "p99_ratio": p99[0] / p99[1] if all(p99) else None,
    }
    say(
        f"  {config.name}: {result['seconds']:.1f} s ({result['wall_vs_idle']:.2f}x idle); "
        f"tps {during['tps']:,.0f} vs {base['tps']:,.0f} baseline "
        f"(ratio {_ratio(result['tps_ratio'])}); p99 {_ms(during['latency_p99_ms'])} vs "
        f"{_ms(base['latency_p99_ms'])} ms, lag p99 {_ms(during['lag_p99_ms'])} ms"
        f"{throttle_note(result.get('throttle'))}"
    )
    return result


def idle_reference(h: Harness) -> dict[str, Any]:
    """One unthrottled ShardVault backup before the write load exists."""
    say("idle reference: sv-unthrottled with no write load")
    result = backup(h, h.configs["sv-unthrottled"])
    result.pop("window")
    discard(h.bench, result)
    h.idle_seconds, h.idle_result = result["seconds"], result
    say(f"  {IDLE}: {result['seconds']:.1f} s")
    return result


def round_order(names: list[str], index: int) -> list[str]:
    """As listed in odd rounds, reversed in even ones."""
    return names if index % 2 else names[::-1]


def run_rounds(h: Harness) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in h.args.configs}
    for index in range(1, h.args.runs + 1):
        order = round_order(h.args.configs, index)
        say(f"round {index} of {h.args.runs}: {', '.join(order)}")
        for name in order:
            runs[name].append(measured_run(h, h.configs[name], index))
    return runs


# --- summary ------------------------------------------------------------------------------------
SPREAD_KEYS = (
    "seconds",
    "wall_vs_idle",
    "catalog_duration_seconds",
    "tps_ratio",
    "p99_ratio",
    "transactions_short",
    "load.tps",
    "baseline.tps",
    "load.latency_p50_ms",
    "baseline.latency_p50_ms",
    "load.latency_p99_ms",
    "baseline.latency_p99_ms",
    "load.latency_no_lag_p50_ms",
    "baseline.latency_no_lag_p50_ms",
    "load.latency_no_lag_p99_ms",
    "baseline.latency_no_lag_p99_ms",
    "load.lag_p99_ms",
    "baseline.lag_p99_ms",
    "load.worst_second_tps",
    "load.busy_cores",
    "baseline.busy_cores",
    "throttle.cuts",
    "throttle.throttled_seconds",
    "throttle.lowest_rate_bytes_per_second",
    "held_log_bytes",
)


def summarize(h: Harness, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    configs = {}
    for name, config_runs in runs.items():
        if name == IDLE:
            continue
        throttles = [run.get("throttle") or {} for run in config_runs]
        configs[name] = {
            "label": h.configs[name].label,
            **{key: spread_of(config_runs, key) for key in SPREAD_KEYS},
            "limited_by": sorted({t.get("limited_by") or "none" for t in throttles if t}),
            "within_idle_target": all(r["wall_vs_idle"] <= IDLE_TARGET for r in config_runs),
        }
    return {
        "idle_seconds": h.idle_seconds,
        "max_rate_tps": h.bench.setup["max_rate"]["tps"],
        "load_rate_tps": h.bench.setup["load_rate_tps"],
        "configurations": configs,
        "against_best_fixed": against_best_fixed(configs),
    }


def is_safe(info: dict[str, Any]) -> bool:
    """A configuration that kept the load whole (its medians): see *safe*."""
    tps, p99 = info["tps_ratio"], info["p99_ratio"]
    return bool(tps and p99 and tps["median"] >= SAFE_TPS_RATIO and p99["median"] <= SAFE_P99_RATIO)


def against_best_fixed(configs: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest safe fixed rate (its median wall time), and the adaptive backup's wall
    time over it (the issue's target: at most ``ADAPTIVE_TARGET``); None without both."""
    safe = {n: c for n, c in configs.items() if n.startswith(FIXED) and is_safe(c)}
    adaptive = configs.get("sv-adaptive")
    if not safe or adaptive is None:
        return None
    best = min(safe, key=lambda n: safe[n]["seconds"]["median"])
    ratio = adaptive["seconds"]["median"] / safe[best]["seconds"]["median"]
    adaptive_safe = is_safe(adaptive)
    return {
        "best_fixed": best,
        "best_fixed_seconds": safe[best]["seconds"]["median"],
        "adaptive_seconds": adaptive["seconds"]["median"],
        "ratio": ratio,
        "adaptive_safe": adaptive_safe,
        "held": ratio <= ADAPTIVE_TARGET and adaptive_safe,
    }


# --- Markdown -----------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _pair(info: dict[str, Any], key: str, digits: int = 1) -> str:
    during, baseline = info[f"load.{key}"], info[f"baseline.{key}"]
    return f"{median_cell(during, digits)} / {median_cell(baseline, digits)}"


def throttle_note(throttle: dict[str, Any] | None) -> str:
    if not throttle:
        return ""
    lowest = throttle.get("lowest_rate_bytes_per_second")
    lowest_text = "—" if lowest is None else f"{lowest / MiB:,.1f} MiB/s"
    return (
        f"; throttle: {throttle.get('cuts')} cuts, {throttle.get('throttled_seconds')} s "
        f"throttled, lowest {lowest_text}, limited by {throttle.get('limited_by')}"
    )


def throttle_cell(info: dict[str, Any]) -> str:
    if info["throttle.cuts"] is None:
        return "—"
    return (
        f"{median_cell(info['throttle.cuts'], 0)} cuts, "
        f"{median_cell(info['throttle.throttled_seconds'])} s throttled, lowest "
        f"{median_cell(info['throttle.lowest_rate_bytes_per_second'], 1, MiB)} MiB/s; "
        f"limited by {', '.join(info['limited_by']) or '—'}"
    )


def backups_table(summary: dict[str, Any]) -> str:
    rows = [
        f"| backup | wall s min / median / max | ÷ idle unthrottled (≤ {IDLE_TARGET:g}: every "
        "round?) | catalog duration s | WAL held on the source, MiB (median) | adaptive "
        "throttle (medians) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for info in summary["configurations"].values():
        held = "yes" if info["within_idle_target"] else "NO"
        rows.append(
            f"| {info['label']} | {spread_cell(info['seconds'])} | "
            f"{median_cell(info['wall_vs_idle'], 2)} ({held}) | "
            f"{median_cell(info['catalog_duration_seconds'])} | "
            f"{median_cell(info['held_log_bytes'], 0, MiB)} | {throttle_cell(info)} |"
        )
    return "\n".join(rows)


def load_table(summary: dict[str, Any]) -> str:
    rows = [
        "| write load during | tps during / baseline | tps ratio min / median / max | "
        "p50 ms during / baseline | p99 ms during / baseline | p50 ms without lag | "
        "p99 ms without lag (ratio) | schedule lag p99 ms | worst second's tps | "
        "busy cores during / baseline |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for info in summary["configurations"].values():
        rows.append(
            f"| {info['label']} | {_pair(info, 'tps', 0)} | {spread_cell(info['tps_ratio'], 3)} | "
            f"{_pair(info, 'latency_p50_ms')} | {_pair(info, 'latency_p99_ms')} | "
            f"{_pair(info, 'latency_no_lag_p50_ms')} | {_pair(info, 'latency_no_lag_p99_ms')} "
            f"({median_cell(info['p99_ratio'], 2)}) | {_pair(info, 'lag_p99_ms')} | "
            f"{median_cell(info['load.worst_second_tps'], 0)} | {_pair(info, 'busy_cores', 2)} |"
        )
    return "\n".join(rows)


def command_line() -> str:
    """The command as run, from the repository's root."""
    root = bvp.STATE_MACHINES.parent
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):
        python = python.relative_to(root)
    env = (
        f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if "PYTHONPATH" in os.environ else ""
    )
    return env + shlex.join([str(python), *sys.argv])


def markdown(h: Harness, summary: dict[str, Any]) -> str:
    setup, args = h.bench.setup, h.args
    rate = setup["max_rate"]
    head = (
        f"Reproduce (from the repository's root, at {bvp._git_version()}):\n\n"
        f"```sh\n{command_line()}\n```\n\n"
        f"PostgreSQL at pgbench scale {args.scale}, {args.runs} round(s). Write load: "
        f"`pgbench -N -c {CLIENTS} -j {JOBS}`; maximum {rate['tps']:,.0f} tps (p50 "
        f"{_ms(rate['latency_p50_ms'])} ms, p99 {_ms(rate['latency_p99_ms'])} ms, over "
        f"{args.max_seconds:g} s after {args.warm_up_seconds:g} s of warm-up); the runs at "
        f"`-R {setup['load_rate_tps']:.1f}` ({args.load_fraction:.0%}). Idle reference: "
        f"ShardVault unthrottled with no load, {h.idle_seconds:.1f} s. Latency is from each "
        "transaction's scheduled start (its schedule lag included) unless said *without lag*; "
        "figures are medians over the rounds unless given as min / median / max."
    )
    parts = [head, "Backups:\n\n" + backups_table(summary), load_table(summary)]
    if best := summary.get("against_best_fixed"):
        parts.append(
            f"Fastest safe fixed rate (tps ratio ≥ {SAFE_TPS_RATIO:g}, p99 without lag ≤ "
            f"{SAFE_P99_RATIO:g}x, medians): {best['best_fixed']}, "
            f"{best['best_fixed_seconds']:.1f} s. Adaptive: {best['adaptive_seconds']:.1f} s, "
            f"{best['ratio']:.2f}x it (target ≤ {ADAPTIVE_TARGET:g}x"
            f"{'' if best['adaptive_safe'] else '; the adaptive backup was not safe'}): "
            f"{'held' if best['held'] else 'NOT held'}."
        )
    if bound := cpu_bound(h, summary):
        parts.append(bound)
    return "\n\n".join(parts) + "\n"


def cpu_bound(h: Harness, summary: dict[str, Any]) -> str:
    """The least wall time a backup could take without taking CPU from the load: the idle
    reference's CPU (agent, control plane and its MinIO) over the cores the load's baselines
    leave idle, and that ÷ the idle backup's wall time."""
    idle = h.idle_result
    busy = [
        c["baseline.busy_cores"]["median"]
        for c in summary["configurations"].values()
        if c.get("baseline.busy_cores")
    ]
    if not idle or not busy:
        return ""
    cpu = idle["client_cpu_seconds"] + idle.get("minio_cpu_seconds", 0.0)
    spare = (os.cpu_count() or 1) - statistics.median(busy)
    least = cpu / spare if spare > 0 else math.inf
    return (
        f"CPU: the idle backup used {cpu:.2f} CPU-s (agent {idle['agent_cpu_seconds']:.2f}, "
        f"control plane {idle['control_plane_cpu_seconds']:.2f}, its MinIO "
        f"{idle.get('minio_cpu_seconds', 0.0):.2f}); the load's baselines keep "
        f"{statistics.median(busy):.2f} of {os.cpu_count()} cores busy, so a backup that took "
        f"no CPU from the load would need at least {least:.1f} s ({least / h.idle_seconds:.2f}x "
        "the idle backup)."
    )


# --- main ---------------------------------------------------------------------------------------
def cgroup2_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup2":
            return Path(fields[4])
    return None


def server_processes(pg: PostgresInstance) -> list[int]:
    """The postmaster and its children."""
    postmaster = int((pg.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == postmaster:
            children.append(int(stat.parent.name))
    return [postmaster, *children]


def server_cgroup(pg: PostgresInstance, cleanup: contextlib.ExitStack) -> str | None:
    """Moves the server into a cgroup of its own (see *server cgroup*); None: not possible."""
    mount = cgroup2_mount()
    if mount is None:
        return None
    group = mount / f"shardvault-bench-{os.getpid()}"
    try:
        group.mkdir()
        for pid in server_processes(pg):
            (group / "cgroup.procs").write_text(str(pid))
    except OSError as error:
        say(f"the server stays in the host's cgroup: {error}")
        return None

    def undo() -> None:  # the server stops later: put its processes back, then remove it
        for _ in range(20):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # it ended meanwhile
                    (mount / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()
                return
            time.sleep(0.1)
        say(f"{group} is left behind: a process would not leave it")

    cleanup.callback(undo)
    return str(group)


def start_load(h: Harness, cleanup: contextlib.ExitStack) -> None:
    """The maximum rate, then the write load at its share of it."""
    bench = h.bench
    bvp.quiet_agents(bench)
    bvp.settle(bench)
    bench.setup["max_rate"] = measure_max_rate(bench, h.args)
    bench.setup["load_rate_tps"] = h.args.load_fraction * bench.setup["max_rate"]["tps"]
    bvp.settle(bench)
    rate = bench.setup["load_rate_tps"]
    say(f"maximum {bench.setup['max_rate']['tps']:,.0f} tps; the write load at {rate:,.1f} tps")
    h.load = WriteLoad.start(bench.pg, rate, bench.root / "load")
    cleanup.callback(h.load.stop)
    bench.setup["load_command"] = shlex.join(h.load.command)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, bvp._terminate)
    started = time.time()
    with contextlib.ExitStack() as cleanup:
        root = bvp.make_workdir(args, cleanup)
        bench = bvp.setup(args, root, cleanup)
        without_vault(bench)
        if args.shardvault_archive:  # the archiver stores the spool once the policy says how
            use_policy(bench, {})
        bench.setup["server_cgroup"] = server_cgroup(bench.pg, cleanup)
        say(f"setup done in {time.time() - started:.0f} s: {json.dumps(bench.setup)}")
        h = Harness(args, bench, {c.name: c for c in configurations(args.fixed_mib)})
        idle = idle_reference(h)
        start_load(h, cleanup)
        runs = {IDLE: [idle], **run_rounds(h)}
        assert h.load is not None
        bench.setup |= h.load.outcome()
        summary = summarize(h, runs)
        text = markdown(h, summary)
        path = bvp.write_results(bench, runs, summary, started, name="throttle", markdown=text)
        say("stopping everything")
    print(text)
    print(f"Raw results: {path}; benchmark wall time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
