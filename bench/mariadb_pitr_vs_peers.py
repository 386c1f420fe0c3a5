"""ShardVault's MariaDB point-in-time restore against mariabackup's with ``mariadb-binlog``, to
the same whole-second target in the same binary logs, in one run on one machine.

Usage::

    .venv/bin/python bench/mariadb_pitr_vs_peers.py [--tables 4] [--rows 250000] [--rate 200]
        [--lead-seconds 5] [--after-seconds 60] [--mark-seconds 10] [--archive-delay 5]
        [--max-binlog-mib 64] [--out bench/results] [--workdir /tmp/mbench] [--keep]
    .venv/bin/python bench/mariadb_pitr_vs_peers.py --tables 1 --rows 10000 --rate 50 \\
        --after-seconds 12 --mark-seconds 3      # a tiny debug run

Terms:

* *server*: one MariaDB 10.11 made and started by ``shardvault.local.mariadb.init_server`` with
  binary logging (``BINLOG_OPTIONS``: ``log_bin=mysql-bin``, ``binlog_format=ROW``, no expiry),
  then ``max_binlog_size`` raised to ``--max-binlog-mib`` (64) and its buffer pool to 512 MiB
  (``SET GLOBAL``, both dynamic), everything else at MariaDB's defaults.
* *dataset*: ``mariadb_vs_peers.py``'s (its ``fill``: ``--tables`` sysbench tables of ``--rows``
  rows in ``sbtest``, and ``Transfers``' accounts and moves in ``bank``), plus
  ``bank.marks(n, at)``. After the fill, ``RESET MASTER``: the fill's binary logs are dropped
  before anything archives them, so both tools' logs start at ``mysql-bin.000001``.
* *write load*: ``mariadb_vs_peers.py``'s load process (one session, one transfer a
  transaction, open loop) at a fixed ``--rate`` (transactions a second, so the binary logs' size
  does not depend on the machine). It runs ``--lead-seconds`` before the backups, through both,
  and ``--after-seconds`` after them; then it is paused for good.
* *markers*: during the after part, one row in ``bank.marks`` every ``--mark-seconds`` (the
  first at its start), each an autocommit ``INSERT``; this process notes when it sent each and
  when it was acknowledged. *Target* ``T``: a whole second between the last two markers (the
  later of: a second after the second-to-last's acknowledgement, the floor of the midpoint),
  never after the last marker was sent: a binary log stamps each event with the second its
  statement started, so the second-to-last marker is stamped before ``T`` and the last at or
  after it. A correct restore holds every marker but the last.
* *archiving* (ShardVault): the source agent's shard has ``archive_binlogs: true`` and
  ``archive_poll_seconds`` 0.2; the bench cluster's policy (a file in the work directory the
  stack is pointed at) has ``archive: {max_delay_seconds: --archive-delay}`` (5),
  ``compression: {level: 3}`` (the peer's zstd level) and no vault (``vault_url`` unset, as
  ``throttle_under_load.py`` does: no promotion lengthens the backup). The agent closes a file
  that held changes that long, stores each closed file, and purges the server's copy once
  stored.
* *kept binlogs* (the peer's): because the agent purges, a thread here hard-links every
  ``mysql-bin.<n>`` into ``<work>/kept-binlogs`` as soon as the server creates it (polled every
  0.1 s; a file lives seconds before its purge). A hard link is the same inode, so the kept
  file is byte for byte what the server wrote and ShardVault archived. Once the load is over
  and *settled*, every closed kept file is uploaded (untimed) to the peer's bucket as
  ``binlogs/<name>.zst`` (zstd level 3, the ``zstandard`` package): the peer's binlog archive
  lives in the TLS MinIO beside its base, as its users keep one in S3.
* *settled* (binary logs): the load paused, ``FLUSH BINARY LOGS``, then wait until the agent
  purged every file but the open one (``SHOW BINARY LOGS`` lists one): every closed file is
  archived (``tests/integration/test_mariadb_pitr.py``'s ``settled``). The kept files must then
  run without a gap. What ShardVault's archive holds from its base's file on is recorded
  (``setup.archive``: each batch's files, their stored bytes, and any file stored twice).
* *bases*, taken back to back under the load: ShardVault's full backup through the local stack
  (``backup_vs_peers.shardvault_backup``, timed as there), then the peer's
  (``mariadb_vs_peers.peer_backup``: ``mariabackup --backup --stream=mbstream --parallel=2`` into
  ``zstd -3``, ``upload_fileobj`` into the TLS MinIO). Each records its binlog position:
  ShardVault's manifest marker (``binlog_file``, ``binlog_pos``), the peer's
  ``xtrabackup_binlog_info`` in its extracted copy.
* *ShardVault's restore*: ``RestoreRequest(target={"time": T})`` into an empty one-node
  cluster (the restore agent): the base downloaded and checked, ``mariabackup --prepare``,
  server started, the archived binary logs from the base's position asked of the WAL feed one
  file at a time and replayed through ``mariadb-binlog`` into one ``mariadb`` session up to the
  first transaction stamped at or after ``T``, then ``mariadb-check --all-databases``. Timed
  from ``start_restore`` to the execution's stop; the execution's states are its split (all in
  the JSON; the table shows ``Download``, the base, ``Finish``, the node's prepare, start,
  replay and check, and the other states together: planning, recording).
* *the peer's restore* (as mariabackup's users run a point-in-time restore): ``download_fileobj``
  into ``zstd -d`` into ``mbstream -x`` in an empty directory; the position from its
  ``xtrabackup_binlog_info``; each kept binlog from that file on downloaded and decompressed
  to local files; ``mariabackup --prepare``; a server started on the copy
  (``MariadbServer``, as the agent starts one); ``TZ=UTC mariadb-binlog --start-position=<pos>
  --stop-datetime='<T in UTC>' <the files>`` piped into ``mariadb`` (argument lists, no shell,
  the pipe between two ``Popen``); then the same ``mariadb-check --all-databases``. Timed from
  the download's start to the check's end, split into *base* (download, extract), *binlogs*
  (their download), *prepare*, *start*, *replay* and *check*.
* *checked* (untimed, each restored copy): its markers are exactly those before ``T``, its
  ``bank`` is consistent (``shardvault.local.mariadb.consistent``: every balance explained by
  the moves, the sum kept) and its ``sbtest`` tables hold the source's row counts.
* *binlog bytes replayed*: from the base's position to where replay stopped, summed over the
  files between (sizes from the kept files): ShardVault, to its ``replayed_to``; the peer, to
  the first event stamped at or after ``T`` past its start (what ``--stop-datetime`` stops at;
  the files' own format, rotate and list events aside), computed here from the events' headers.
  *binlog bytes fetched*: ShardVault, the restore's ``wal_bytes_fetched`` (its feed fetches
  the files replay asks for and a few ahead, whole batches, a file stored twice twice;
  ``wal_stored_bytes_fetched`` as stored); the peer, every kept file from its base's on (raw
  and as stored), since its users cannot tell which file holds ``T`` without reading them.

The *ratio* is ShardVault's restore wall time ÷ the peer's. One restore each (ShardVault
first), each on a settled machine (both agents at their idle poll rate, ``sync``). Raw results
go to ``--out`` as JSON, the table to stdout and beside the JSON as Markdown. Everything started
here (both MinIO servers, the source and both restored servers, the local stack and its agents,
the load, the keeper) is stopped and the work directory removed on the way out, also on failure,
Ctrl-C or SIGTERM (``--keep`` keeps the directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import backup_vs_peers as bvp
import mariadb_vs_peers as mvp
import probes
import report
import yaml
import zstandard
from boto3.s3.transfer import TransferConfig
from peers import ensure_bucket, s3_client_for, start_tls_minio
from report import MiB
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.mariadb.checks import check_tables
from shardvault_agent.engines.mariadb.replay import FILE_EVENTS, events
from shardvault_agent.engines.mariadb.server import MariadbServer, program, run, socket_for

from shardvault.aws import lambda_support
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest, Manifest, RestoreRequest
from shardvault.contracts.wal_archive import BINLOG_FILE, log_order
from shardvault.local.mariadb import init_server, stop_server
from shardvault.local.stack import LocalStack
from shardvault.wal import archive

SV, PEER = "shardvault-pitr", "mariabackup-pitr"
SV_BACKUP, PEER_BACKUP = "shardvault-full", "mariabackup-full"
PEER_BUCKET = mvp.PEER_BUCKET
BINLOG_PREFIX = "binlogs/"
BANK = mvp.BANK
ZSTD_LEVEL = 3
ARCHIVE_POLL_SECONDS = 0.2  # the integration tests' and pitr_vs_peers.py's
KEEP_POLL_SECONDS = 0.1
SETTLE_TIMEOUT = 300.0
POLICY: dict[str, Any] = {  # the bench cluster's entry (see *archiving*); the delay is added
    "engine": "mariadb",
    "schedule": {"full": "0 2 * * *"},
    "vault": {"storage_class": "GLACIER_IR", "object_lock": {"mode": "GOVERNANCE", "days": 1}},
    "retention": {"keep_daily": 1},
    "compression": {"level": ZSTD_LEVEL},
}

say = bvp.say


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=4, help="sbtest tables")
    parser.add_argument("--rows", type=int, default=250_000, help="rows per sbtest table")
    parser.add_argument("--rate", type=float, default=200.0, help="write load, transactions/s")
    parser.add_argument(
        "--lead-seconds", type=float, default=5.0, help="load before the backups start"
    )
    parser.add_argument(
        "--after-seconds", type=float, default=60.0, help="load (with markers) after the backups"
    )
    parser.add_argument("--mark-seconds", type=float, default=10.0, help="between two markers")
    parser.add_argument(
        "--archive-delay", type=float, default=5.0, help="policy archive.max_delay_seconds"
    )
    parser.add_argument("--max-binlog-mib", type=int, default=64, help="server max_binlog_size")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results dir")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=mvp.DEFAULT_WORKDIR,
        help="parent of the work directory (created if absent, removed at the end if empty)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if args.tables < 1 or args.rows < 1 or args.rate <= 0:
        parser.error("--tables and --rows must be at least 1, --rate above 0")
    if args.mark_seconds < 3:
        parser.error("--mark-seconds must be at least 3: T is a whole second between markers")
    if args.after_seconds < 2 * args.mark_seconds:
        parser.error("--after-seconds must hold two markers: at least twice --mark-seconds")
    if not 1 <= args.max_binlog_mib <= 256:
        parser.error("--max-binlog-mib must be 1 to 256 (the archive's batch)")
    return args


# --- the kept binlogs (the peer's archive) ------------------------------------------------------
@dataclass
class Keeper:
    """Hard-links each of the server's binary logs into ``into`` as soon as it appears (see
    *kept binlogs*): the agent purges the server's files once it stored them."""

    source: Path  # the server's binlog directory
    into: Path
    basename: str
    stopping: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> None:
        self.into.mkdir(parents=True)
        self.thread = threading.Thread(target=self._run, name="binlog-keeper", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stopping.wait(KEEP_POLL_SECONDS):
                self.link_new()
        except BaseException as error:  # reported by ``check``
            self.error = error

    def link_new(self) -> None:
        for path in self.source.glob(f"{self.basename}.*"):
            kept = self.into / path.name
            if BINLOG_FILE.fullmatch(path.name) and not kept.exists():
                with contextlib.suppress(FileNotFoundError):  # purged meanwhile: check() says
                    os.link(path, kept)

    def check(self) -> None:
        if self.error is not None or (self.thread and not self.thread.is_alive()):
            raise RuntimeError(f"the binlog keeper stopped: {self.error!r}")

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def sizes(self) -> dict[str, int]:
        """Each kept file's size, in log order."""
        names = sorted((p.name for p in self.into.iterdir()), key=log_order)
        return {name: (self.into / name).stat().st_size for name in names}


def ordinals_complete(names: list[str]) -> bool:
    """The kept files have no gap (a gap: a file purged before the keeper saw it)."""
    numbers = [log_order(n)[1] for n in names]
    return numbers == list(range(numbers[0], numbers[0] + len(numbers))) if numbers else True


# --- the environment ----------------------------------------------------------------------------
@dataclass
class Pitr:
    """What the run shares besides ``mariadb_vs_peers.MariaBench``."""

    bench: mvp.MariaBench
    keeper: Keeper
    restore_dir: Path
    marks: list[dict[str, Any]] = field(default_factory=list)
    target: datetime | None = None
    sv_manifest: Manifest | None = None
    sv_marker: dict[str, str] = field(default_factory=dict)
    peer_key: str = ""
    peer_binlogs: dict[str, dict[str, int]] = field(default_factory=dict)  # name: raw, stored

    @property
    def target_epoch(self) -> int:
        assert self.target is not None
        return int(self.target.timestamp())


def start_source(
    root: Path, args: argparse.Namespace, cleanup: contextlib.ExitStack
) -> MariadbServer:
    """The source server with binary logging (see *server*)."""
    data_dir = root / "maria" / "source"
    cleanup.callback(stop_server, data_dir)
    server = init_server(data_dir, binlog=True)
    server.sql(f"SET GLOBAL innodb_buffer_pool_size = {mvp.BUFFER_POOL}")
    server.sql(f"SET GLOBAL max_binlog_size = {args.max_binlog_mib * MiB}")
    return server


def use_policy(stack: LocalStack, root: Path, delay: float) -> dict[str, Any]:
    """The bench cluster's policy (see *archiving*), read by the control plane at each call;
    the stack's vault switched off (its services cache it, so they are made again)."""
    cluster = POLICY | {"archive": {"max_delay_seconds": delay}}
    path = root / "policy.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "clusters": {bvp.CLUSTER: cluster}}))
    stack.settings.policy_file = str(path)
    stack.settings.vault_url = None
    lambda_support.use_settings(stack.settings)
    return cluster


def agent_configs(root: Path, server: MariadbServer) -> tuple[dict, dict]:
    """``mariadb_vs_peers``' agent configs, the source's shard archiving its binary logs."""
    config, restore = mvp.agent_configs(root, server)
    config["shards"][0]["archive_binlogs"] = True
    config["archive_poll_seconds"] = ARCHIVE_POLL_SECONDS
    return config, restore


def binlog_dir(server: MariadbServer) -> tuple[Path, str]:
    basename = Path(server.sql("SELECT @@log_bin_basename"))
    return basename.parent, basename.name


def setup(args: argparse.Namespace, root: Path, cleanup: contextlib.ExitStack) -> Pitr:
    say("starting the TLS MinIO (the peer's store), the local stack and MariaDB")
    tls_minio = start_tls_minio(root / "minio-tls")
    cleanup.callback(tls_minio.stop)
    stack = LocalStack(root / "stack", require_minio=True)
    cleanup.callback(stack.stop)  # before start(): a half-started stack is stopped too
    stack.start()
    server = start_source(root, args, cleanup)
    peer_s3 = s3_client_for(tls_minio)
    ensure_bucket(peer_s3, PEER_BUCKET)
    filled = mvp.fill(server, args.tables, args.rows)
    server.sql("CREATE TABLE marks (n INT PRIMARY KEY, at DATETIME(6))", database=BANK)
    server.sql("RESET MASTER")  # the fill's logs: nobody's to archive (see *dataset*)
    source, basename = binlog_dir(server)
    keeper = Keeper(source, root / "kept-binlogs", basename)
    keeper.start()
    cleanup.callback(keeper.stop)
    filled["policy"] = use_policy(stack, root, args.archive_delay)
    config, restore_config = agent_configs(root, server)
    restore_dir = Path(restore_config["restore_dir"])
    # Registered before the agents, so run after they stopped: the restored copies' servers.
    cleanup.callback(mvp.remove_copy, restore_dir / bvp.SHARD_ID)
    cleanup.callback(mvp.remove_copy, root / "peer-restored" / bvp.SHARD_ID)
    load = mvp.WriteLoad.start(server, root / "load.bin")
    cleanup.callback(load.stop)
    bench = mvp.MariaBench(
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
        busy_window=max(
            AgentConfig.model_validate(c).busy_window_seconds for c in (config, restore_config)
        ),
        load=load,
        counts=mvp.sbtest_counts(server, args.tables),
        setup=filled,
    )
    (root / "logs").mkdir()
    return Pitr(bench, keeper, restore_dir)


# --- the bases ----------------------------------------------------------------------------------
def backups(pitr: Pitr, runs: dict[str, Any]) -> None:
    """ShardVault's full backup, then the peer's, back to back under the load."""
    bench = pitr.bench
    mvp.settle(bench)
    backup = bvp.shardvault_backup(bench, BackupRequest(cluster=bvp.CLUSTER))  # type: ignore[arg-type]
    bench.agents_busy_until = time.monotonic() + bench.busy_window
    pitr.sv_manifest = backup.manifest
    marker = backup.manifest.shards[0].marker
    pitr.sv_marker = {k: marker[k] for k in ("binlog_file", "binlog_pos") if k in marker}
    if "binlog_file" not in pitr.sv_marker:
        raise RuntimeError(f"ShardVault's backup recorded no binlog position: {marker}")
    runs[SV_BACKUP] = backup.result | {"binlog_position": pitr.sv_marker}
    say(f"  {SV_BACKUP}: {backup.result['seconds']:.1f} s, base at {position_text(marker)}")
    rnd = mvp.Round(1)
    peer = mvp.peer_backup(bench, rnd)
    pitr.peer_key = rnd.peer_key
    for key in ("window", "copy_window"):
        peer.pop(key)
    runs[PEER_BACKUP] = peer | {"command": shlex.join(mvp.mariabackup_stream(bench.server))}
    say(f"  {PEER_BACKUP}: {peer['seconds']:.1f} s, {peer['stored_bytes'] / MiB:,.1f} MiB")


def position_text(marker: dict[str, str]) -> str:
    return f"{marker.get('binlog_file')}:{marker.get('binlog_pos')}"


# --- the load after the bases, its markers and the target ---------------------------------------
def mark(server: MariadbServer, n: int) -> dict[str, Any]:
    sent = time.time()
    server.sql(f"INSERT INTO marks VALUES ({n}, NOW(6))", database=BANK)
    return {"n": n, "sent": sent, "committed": time.time()}


def write_marks(pitr: Pitr, seconds: float, every: float) -> None:
    """A marker at once and every ``every`` seconds while ``seconds`` last."""
    started = time.monotonic()
    n = 0
    while n * every < seconds:
        if (wait := started + n * every - time.monotonic()) > 0:
            time.sleep(wait)
        pitr.marks.append(mark(pitr.bench.server, n))
        pitr.keeper.check()
        n += 1
    if (rest := started + seconds - time.monotonic()) > 0:
        time.sleep(rest)


def choose_target(marks: list[dict[str, Any]]) -> datetime:
    """A whole second between the last two markers (see *markers*)."""
    before, last = marks[-2], marks[-1]
    epoch = max(
        math.floor(before["committed"]) + 1,
        math.floor((before["committed"] + last["sent"]) / 2),
    )
    if epoch > last["sent"]:
        raise RuntimeError(f"no whole second between markers {before} and {last}")
    return datetime.fromtimestamp(epoch, UTC)


def load_after(pitr: Pitr) -> dict[str, Any]:
    """The load with its markers for ``--after-seconds``, then paused; the target chosen."""
    args, load = pitr.bench.args, pitr.bench.load
    say(f"load and a marker every {args.mark_seconds:g} s for {args.after_seconds:g} s")
    start = time.time()
    write_marks(pitr, args.after_seconds, args.mark_seconds)
    end = time.time()
    figures = load.window(start, end)
    load.pause()
    pitr.target = choose_target(pitr.marks)
    return {
        "after_window": figures,
        "marks": pitr.marks,
        "target": pitr.target.isoformat(),
    }


def settle_binlogs(pitr: Pitr, timeout: float = SETTLE_TIMEOUT) -> dict[str, Any]:
    """See *settled*; returns the wait and the files the keeper holds."""
    server, started = pitr.bench.server, time.monotonic()
    server.sql("FLUSH BINARY LOGS")
    while len(logs := server.sql("SHOW BINARY LOGS").splitlines()) > 1:
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"binary logs not all archived after {timeout:.0f} s: {logs}")
        time.sleep(0.2)
    pitr.keeper.link_new()
    pitr.keeper.check()
    open_file = logs[0].split("\t")[0]
    closed = {n: s for n, s in pitr.keeper.sizes().items() if log_order(n) < log_order(open_file)}
    if not ordinals_complete(list(closed)):
        raise RuntimeError(f"the keeper missed a binlog (purged first): {sorted(closed)}")
    return {
        "wait_seconds": round(time.monotonic() - started, 1),
        "open_file": open_file,
        "closed_files": len(closed),
        "closed_bytes": sum(closed.values()),
        "sizes": closed,
    }


def archived(pitr: Pitr) -> dict[str, Any]:
    """What ShardVault's archive holds from its base's file on: each batch's files (a file
    stored twice shows in two batches) and stored bytes."""
    assert pitr.sv_manifest is not None
    found = archive.after_backup(pitr.bench.stack.services(), pitr.sv_manifest, bvp.SHARD_ID)
    batches = found.batches if found else []
    names = [f["name"] for b in batches for f in b["files"]]
    return {
        "first": found.first if found else None,
        "last": found.last if found else None,
        "batches": [[f["name"] for f in b["files"]] for b in batches],
        "stored_bytes": sum(b.get("stored_length", 0) for b in batches),
        "stored_twice": sorted({n for n in names if names.count(n) > 1}, key=log_order),
    }


def upload_peer_binlogs(pitr: Pitr, sizes: dict[str, int]) -> dict[str, Any]:
    """The closed kept files into the peer's bucket, zstd -3 each (untimed; see *kept
    binlogs*)."""
    bench = pitr.bench
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    for name, raw in sizes.items():
        body = compressor.compress((pitr.keeper.into / name).read_bytes())
        bench.peer_s3.put_object(Bucket=PEER_BUCKET, Key=f"{BINLOG_PREFIX}{name}.zst", Body=body)
        pitr.peer_binlogs[name] = {"raw": raw, "stored": len(body)}
    stored = sum(v["stored"] for v in pitr.peer_binlogs.values())
    return {"files": len(sizes), "raw_bytes": sum(sizes.values()), "stored_bytes": stored}


# --- what a restore replayed --------------------------------------------------------------------
def span_bytes(sizes: dict[str, int], start: tuple[str, int], stop: tuple[str, int]) -> int:
    """Binlog bytes from ``start`` to ``stop`` (``file``, offset), over the files between."""
    total = 0
    for name, size in sizes.items():
        if log_order(start[0]) <= log_order(name) <= log_order(stop[0]):
            begin = start[1] if name == start[0] else 0
            end = stop[1] if name == stop[0] else size
            total += max(0, end - begin)
    return total


def parse_position(text: str, sizes: dict[str, int]) -> tuple[str, int]:
    """``file:offset`` (or ``file:end``, the agent's word for a whole file)."""
    name, _, offset = text.rpartition(":")
    return name, sizes[name] if offset == "end" else int(offset)


def stop_datetime_position(
    directory: Path, names: list[str], start: tuple[str, int], epoch: int
) -> tuple[str, int]:
    """Where ``--stop-datetime`` stops from ``start``: the first event stamped at or after
    ``epoch`` (the files' own events aside); the last file's end when none is."""
    for name in names:
        for offset, stamp, kind in events(directory / name):
            if name == start[0] and offset < start[1]:
                continue
            if kind not in FILE_EVENTS and stamp >= epoch:
                return name, offset
    last = names[-1]
    return last, (directory / last).stat().st_size


# --- the restored copies ------------------------------------------------------------------------
def marks_of(server: MariadbServer) -> list[int]:
    return [int(n) for n in server.sql("SELECT n FROM marks ORDER BY n", database=BANK).split()]


def expected_marks(pitr: Pitr) -> list[int]:
    return [m["n"] for m in pitr.marks if m["committed"] < pitr.target_epoch]


def checked(pitr: Pitr, copy: MariadbServer) -> dict[str, Any]:
    """See *checked*; the untimed look at a restored copy."""
    restored, expected = marks_of(copy), expected_marks(pitr)
    return {
        "restored_marks": restored,
        "expected_marks": expected,
        "marks_match": restored == expected,
        **mvp.restored_check(pitr.bench, copy),
    }


def all_ok(result: dict[str, Any]) -> bool:
    keys = ("marks_match", "balances_sum_ok", "sbtest_rows_ok", "checks_ok")
    return all(result[k] for k in keys)


# --- ShardVault ---------------------------------------------------------------------------------
def shardvault_pitr(pitr: Pitr, sizes: dict[str, int]) -> dict[str, Any]:
    """ShardVault's restore to T (see the module docstring), timed, then checked."""
    bench = pitr.bench
    assert pitr.target is not None
    request = RestoreRequest(
        cluster=bvp.CLUSTER,
        target_cluster=mvp.RESTORE_CLUSTER,
        replace=True,
        target={"time": pitr.target.isoformat()},
    )
    started = time.time()
    arn = ops.start_restore(bench.client, request)
    execution = bvp.wait_execution(arn)
    seconds = execution["stopDate"].timestamp() - started
    if execution["status"] != "SUCCEEDED":
        cause = ops.readable_cause(execution.get("cause", ""))
        raise RuntimeError(f"ShardVault restore {execution['status']}: {cause}")
    summary = json.loads(execution["output"])
    (shard,) = summary["shards"]
    copy = MariadbServer(Path(shard["path"]), Path(shard["socket"]))
    try:
        looked = checked(pitr, copy)
    finally:
        mvp.remove_copy(copy.data_dir)
    spans, _ = report.state_spans(ops.execution_history(arn), bvp.RESTORE_STATES)
    start = (pitr.sv_marker["binlog_file"], int(pitr.sv_marker["binlog_pos"]))
    stop = parse_position(shard["replayed_to"], sizes)
    return {
        "seconds": seconds,
        "states": report.state_seconds(spans),
        "bytes": summary.get("bytes"),
        "checks": shard["checks"],
        "checks_ok": all(v == "ok" for v in shard["checks"].values()),
        "recovered_to": shard.get("recovered_to"),
        "replay_from": f"{start[0]}:{start[1]}",
        "replayed_to": shard.get("replayed_to"),
        "binlog_replayed_bytes": span_bytes(sizes, start, stop),
        "binlog_fetched_bytes": summary.get("wal_bytes_fetched"),
        "binlog_fetched_stored_bytes": summary.get("wal_stored_bytes_fetched"),
        "binlog_batches": summary.get("wal_batches"),
        "binlog_batches_fetched": summary.get("wal_batches_fetched"),
        **looked,
    }


# --- the peer -----------------------------------------------------------------------------------
def binlog_info(copy: Path) -> tuple[str, int]:
    """The position mariabackup recorded in the copy (file, offset)."""
    for name in ("xtrabackup_binlog_info", "mariadb_backup_binlog_info"):
        if (path := copy / name).is_file():
            file, pos, *_ = path.read_text().split()
            return file, int(pos)
    raise RuntimeError(f"the peer's copy {copy} holds no binlog position")


def download_binlogs(pitr: Pitr, names: list[str], into: Path) -> None:
    """Each named binlog from the peer's bucket, decompressed into ``into``."""
    into.mkdir(parents=True)
    for name in names:
        with (
            open(into / name, "wb") as out,
            zstandard.ZstdDecompressor().stream_writer(out, closefd=False) as writer,
        ):
            pitr.bench.peer_s3.download_fileobj(
                PEER_BUCKET, f"{BINLOG_PREFIX}{name}.zst", writer, Config=TransferConfig()
            )


def replay_command(start_pos: int, target: datetime, paths: list[Path]) -> list[str]:
    stop = target.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return [
        program("mariadb-binlog"),
        "--no-defaults",
        f"--start-position={start_pos}",
        f"--stop-datetime={stop}",
        *map(str, paths),
    ]


def replay_binlogs(copy: MariadbServer, command: list[str], logs: Path) -> None:
    """``TZ=UTC mariadb-binlog ... | mariadb`` (two ``Popen``, no shell)."""
    names = [logs / "mariadb-binlog.log", logs / "mariadb.log"]
    with open(names[0], "wb") as binlog_log, open(names[1], "wb") as client_log:
        reader = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=binlog_log,
            env={**os.environ, "TZ": "UTC"},  # --stop-datetime is read in this time zone
            cwd="/",
        )
        processes = [reader]
        try:
            client = subprocess.Popen(
                [program("mariadb"), *copy.client_args()],
                stdin=reader.stdout,
                stdout=subprocess.DEVNULL,
                stderr=client_log,
                cwd="/",
            )
            assert reader.stdout is not None
            reader.stdout.close()  # the client's now: the reader sees it go if it dies
            processes.append(client)
            mvp.check_exits(processes, names)
        finally:
            mvp.stop_all(processes)


def peer_pitr(pitr: Pitr, sizes: dict[str, int]) -> dict[str, Any]:
    """The peer's restore to T (see the module docstring), timed, then checked."""
    bench = pitr.bench
    assert pitr.target is not None
    target = bench.root / "peer-restored" / bvp.SHARD_ID
    binlogs = bench.root / "peer-binlogs"
    logs = bench.root / "logs" / "peer-restore"
    mvp.remove_copy(target)
    shutil.rmtree(binlogs, ignore_errors=True)
    target.mkdir(parents=True)
    logs.mkdir(parents=True, exist_ok=True)
    marks = [time.monotonic()]
    with mvp.extract_pipe(target, logs) as sink:
        bench.peer_s3.download_fileobj(PEER_BUCKET, pitr.peer_key, sink, Config=TransferConfig())
    marks.append(time.monotonic())  # base
    start = binlog_info(target)
    names = [n for n in pitr.peer_binlogs if log_order(n) >= log_order(start[0])]
    download_binlogs(pitr, names, binlogs)
    marks.append(time.monotonic())  # binlogs
    run([program("mariabackup"), "--no-defaults", "--prepare", f"--target-dir={target}"])
    marks.append(time.monotonic())  # prepare
    copy = MariadbServer(target, socket_for(target))
    command = replay_command(start[1], pitr.target, [binlogs / n for n in names])
    try:
        copy.start()
        marks.append(time.monotonic())  # start
        replay_binlogs(copy, command, logs)
        marks.append(time.monotonic())  # replay
        verdict = check_tables(copy)
        marks.append(time.monotonic())  # check
        looked = checked(pitr, copy)
    finally:
        mvp.remove_copy(target)
    stop = stop_datetime_position(binlogs, names, start, pitr.target_epoch)
    shutil.rmtree(binlogs, ignore_errors=True)
    steps = ("base", "binlogs", "prepare", "start", "replay", "check")
    return {
        "seconds": marks[-1] - marks[0],
        "steps": {s: round(b - a, 2) for s, (a, b) in zip(steps, pairwise(marks), strict=True)},
        "checks": {"mariadb-check --all-databases": verdict},
        "checks_ok": verdict == "ok",
        "replay_from": f"{start[0]}:{start[1]}",
        "replayed_to": f"{stop[0]}:{stop[1]}",
        "binlog_replayed_bytes": span_bytes(sizes, start, stop),
        "binlog_fetched_bytes": sum(pitr.peer_binlogs[n]["raw"] for n in names),
        "binlog_fetched_stored_bytes": sum(pitr.peer_binlogs[n]["stored"] for n in names),
        "binlog_files_fetched": len(names),
        "replay_command": "TZ=UTC " + shlex.join(command).replace(str(bench.root), "<work>"),
        **looked,
    }


# --- the restores -------------------------------------------------------------------------------
RESTORES = {SV: shardvault_pitr, PEER: peer_pitr}


def restores(pitr: Pitr, sizes: dict[str, int], runs: dict[str, Any]) -> None:
    bench = pitr.bench
    for name, restore in RESTORES.items():
        quiet = bvp.quiet_agents(bench)  # type: ignore[arg-type]
        os.sync()
        result = restore(pitr, sizes) | quiet
        if name == SV:
            bench.agents_busy_until = time.monotonic() + bench.busy_window
        runs[name] = result
        say(
            f"  {name}: {result['seconds']:.1f} s, replayed {result['replay_from']} to "
            f"{result['replayed_to']} ({result['binlog_replayed_bytes'] / MiB:,.1f} MiB), "
            f"markers {'match' if result['marks_match'] else 'DIFFER'}"
        )
        if not all_ok(result):
            raise RuntimeError(f"{name} restored wrong data: {json.dumps(result, default=str)}")


# --- report -------------------------------------------------------------------------------------
def summarize(runs: dict[str, Any]) -> dict[str, Any]:
    sv, peer = runs[SV], runs[PEER]
    return {
        "ratio": sv["seconds"] / peer["seconds"],
        "seconds": {SV: sv["seconds"], PEER: peer["seconds"]},
        "binlog_replayed_bytes": {n: runs[n]["binlog_replayed_bytes"] for n in RESTORES},
        "binlog_fetched_bytes": {n: runs[n]["binlog_fetched_bytes"] for n in RESTORES},
        "restored_ok": {n: all_ok(runs[n]) for n in RESTORES},
    }


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MiB:,.1f}"


def markdown(pitr: Pitr, runs: dict[str, Any], summary: dict[str, Any], command: str) -> str:
    bench, setup = pitr.bench, pitr.bench.setup
    sv, peer = runs[SV], runs[PEER]
    head = (
        "### MariaDB point-in-time restore: ShardVault against mariabackup + mariadb-binlog\n\n"
        f"```\n{command}\n```\n\n"
        f"ShardVault at {bvp._git_version()}; {bench.server.sql('SELECT VERSION()')}; "
        f"{os.cpu_count()} CPUs. {bench.args.tables} sbtest tables of {bench.args.rows:,} rows; "
        f"load {bench.args.rate:g} tps; binlogs closed after {bench.args.archive_delay:g} s "
        f"({setup['binlogs']['closed_files']} files, "
        f"{_mib(setup['binlogs']['closed_bytes'])} MiB); target {setup['target']}."
    )
    rows = [
        "| restore to T | wall s | split s | replayed from → to (MiB) | binlogs fetched MiB "
        "(stored) | markers, consistent |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, result, split in (
        (SV, sv, result_split(sv_split(sv["states"]))),
        (PEER, peer, result_split(peer["steps"])),
    ):
        rows.append(
            f"| {name} | {result['seconds']:.1f} | {split} | {result['replay_from']} → "
            f"{result['replayed_to']} ({_mib(result['binlog_replayed_bytes'])}) | "
            f"{_mib(result['binlog_fetched_bytes'])} "
            f"({_mib(result['binlog_fetched_stored_bytes'])}) | "
            f"{'yes' if all_ok(result) else 'NO'} |"
        )
    notes = [
        f"ShardVault ÷ peer wall time: **{summary['ratio']:.2f}**.",
        f"Bases (back to back, under the load): ShardVault {runs[SV_BACKUP]['seconds']:.1f} s, "
        f"mariabackup | zstd | upload {runs[PEER_BACKUP]['seconds']:.1f} s.",
        f"Peer's replay: `{peer['replay_command']} | mariadb`.",
    ]
    return "\n\n".join([head, "\n".join(rows), "\n".join(f"- {n}" for n in notes)]) + "\n"


def sv_split(states: dict[str, float]) -> dict[str, float]:
    """The restore's states as Download (the base), Finish (prepare, start, replay, check)
    and the rest (planning, recording)."""
    main = {name: states.get(name, 0.0) for name in ("Download", "Finish")}
    return main | {"other states": sum(states.values()) - sum(main.values())}


def result_split(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in parts.items())


# --- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, bvp._terminate)
    started = time.time()
    runs: dict[str, Any] = {}
    with contextlib.ExitStack() as cleanup:
        root = mvp.make_workdir(args, cleanup)
        pitr = setup(args, root, cleanup)
        bench = pitr.bench
        say(f"setup done in {time.time() - started:.0f} s: {json.dumps(bench.setup)}")
        bench.load.run_at(args.rate)
        time.sleep(args.lead_seconds)
        backups(pitr, runs)
        bench.setup |= load_after(pitr)
        bench.setup["binlogs"] = settle_binlogs(pitr)
        sizes = bench.setup["binlogs"]["sizes"]
        bench.setup["archive"] = archived(pitr)
        bench.setup["peer_binlogs"] = upload_peer_binlogs(pitr, sizes)
        say(f"binlogs archived and kept: {bench.setup['peer_binlogs']}; target {pitr.target}")
        restores(pitr, sizes, runs)
        summary = summarize(runs)
        command = shlex.join([".venv/bin/python", "bench/mariadb_pitr_vs_peers.py", *sys.argv[1:]])
        text = markdown(pitr, runs, summary, command)
        path = bvp.write_results(
            bench,  # type: ignore[arg-type]  # a MariaBench: args and setup are what it reads
            runs,
            summary,
            started,
            name="mariadb_pitr_vs_peers",
            markdown=text,
            machine=mvp.machine(bench),
        )
        say("stopping everything")
    print(text)
    print(f"Raw results: {path}; benchmark wall time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
