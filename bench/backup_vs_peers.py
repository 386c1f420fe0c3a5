"""ShardVault's full backup and restore against pgBackRest and raw s3transfer, in one run on
one machine, each tool configured as its users run it.

Usage::

    .venv/bin/python bench/backup_vs_peers.py [--scale 100] [--runs 3] [--out bench/results]

One PostgreSQL instance (``initdb --data-checksums``, ``wal_level=replica``,
``shared_buffers=512MB``, ``archive_mode=on`` with pgBackRest's ``archive-push``) is filled by
``pgbench -i -s SCALE``. Each round runs every tool once, in this order, so that noise from
other work on the machine hits all alike:

1. ``shardvault``: a full backup through the local stack (moto Step Functions executing the real
   ASL, in-process Lambda handlers, MinIO as the store, one agent process), compressed with zstd
   at the policy's ``compression.level`` (the bench cluster is not in the local policy file: the
   default, 1) and not encrypted. Timed from ``start_backup`` to the execution's SUCCEEDED: the
   checkpoint, packing (read, zstd, CRC64NVME) and uploading the data objects, the WAL tail
   after ``pg_backup_stop``, verification of every stored object and the manifest written.
2. ``shardvault-restore``: that backup restored into an empty one-node cluster (a second
   agent with a ``restore_dir``), timed from ``start_restore`` to the execution's SUCCEEDED: the
   frames downloaded, decompressed and checked, the server recovered, running on its port, and
   ``pg_amcheck --all`` passed.
3. ``s3-files`` (uncompressed control): boto3 ``upload_file`` of every file of that backup's
   data listing (read from its manifest), one call per file, into a bucket of the same MinIO;
   ``TransferConfig`` with ``--s3-chunk-mib`` parts (default 8, ShardVault's part size at this
   data size) and ``--s3-concurrency`` threads (default 4, ShardVault's ``upload_parallelism``
   per object), unsigned payload with a CRC32 checksum as over HTTPS (``--s3-signed-payload``:
   botocore's plain-HTTP default, a SHA-256 of every byte on both ends; see
   ``peers.s3_client``). Timed from the first call to the last one's return.
4. ``s3-tar`` (uncompressed control): one ``upload_file`` of an uncompressed tar of the same
   files; only the upload is timed (building the tar is not).
5. ``s3-tar-tls`` (uncompressed control): the same tar into the second, TLS MinIO: what TLS
   costs here.
6. ``pgbackrest``: ``pgbackrest backup --type=full`` as its users run it: ``compress-type=zst``
   at its default level (3; no ``compress-level`` is set), ``process-max=2``,
   ``start-fast=y``, into the TLS MinIO (pgBackRest 2.45 speaks S3 only over TLS). The same
   setting compresses the WAL that ``archive-push`` stores. Timed from the command's start to
   its exit: the checkpoint, reading, page-checksum checks, compressing and storing every
   file, waiting for the backup's last WAL segment to be archived, and its manifest.
7. ``pgbackrest-restore``: ``pgbackrest restore`` of that backup (``--type=immediate
   --target-action=promote --archive-mode=off``; it decompresses) into an empty directory,
   the server started and promoted, then the same ``pg_amcheck --all``; timed from the
   command's start to ``pg_amcheck``'s success.

*Bytes read* (``bytes``) is what a backup read from the database: ShardVault's data and tail
streams (the manifest's ``bytes``), the listed files' sizes for s3transfer (the tar's size for
the tar runs), the backup's ``size`` in ``pgbackrest info`` for pgBackRest. A restore's
``bytes`` is what it wrote.

*Stored bytes* (``stored_bytes``) is measured from the bucket, after the backup and before
anything is deleted: a ``ListObjectsV2`` of the backup's keys, sizes summed. It counts
completed objects only: parts of an unfinished multipart upload are not listed (and MinIO lists
such uploads only by exact key, so they are not looked for). The keys:

* ShardVault: everything under the backup's prefix in the store (its objects and
  ``manifest.json``). The objects alone must equal both the manifest's ``stored_bytes`` and
  the catalog record's, and there must be one per object of the manifest; the run fails if
  not. The WAL tail is in these objects.
* pgBackRest: everything under ``backup/<stanza>/<label>/`` in its repository (its files and
  ``backup.manifest`` with its copy), plus the WAL segments the backup needs to be consistent
  (``archive/<stanza>/``, from ``pgbackrest info``'s archive start to stop, and the
  ``.backup`` history file): without them it cannot be restored, as ShardVault's cannot
  without its tail. Both parts are kept in the results.
* s3transfer: the keys it uploaded (uncompressed, so stored = read).

Before each timed run the machine is *settled*: both agents are back at their idle poll rate
(an agent polls its inbox every 50 ms for 30 s after its last command, and moto answers in
this process, on the same cores: ``quiet_agents``), WAL archiving has caught up and dirty
pages are written (``sync``). *Client CPU* is the CPU time of the tool's own processes: for
ShardVault the agent plus this process (moto's Step Functions, DynamoDB and S3, and the Lambda
handlers: on AWS that part runs off the database host); for s3transfer this process; for
pgBackRest its processes. ShardVault's time is split by its execution history, the agent's log
and timing probes on the in-process Lambda steps (``probes.py``); see ``report.py``, which also
holds the targets (ShardVault's backup time and stored bytes against pgBackRest's, restore
against restore), with ratios of the medians and per round.

Raw results go to ``--out`` as JSON, the tables to stdout and beside the JSON as Markdown.
Everything started here (both MinIO servers, PostgreSQL, the local stack and its agent) is
stopped and the work directory removed on the way out, also on failure, Ctrl-C or SIGTERM
(``--keep`` keeps the directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import probes
import report
import yaml
from boto3.s3.transfer import TransferConfig
from peers import (
    PGBACKREST_BUCKET,
    PGBACKREST_REPO_PATH,
    STANZA,
    PgBackRest,
    avoid_empty_put_stall,
    build_tar,
    delete_prefix,
    ensure_bucket,
    list_keys,
    peak_rss_bytes,
    process_cpu,
    regular_files,
    s3_client,
    s3_client_for,
    start_tls_minio,
    transfer_config,
    upload_files,
    upload_one,
)
from probes import Probe
from shardvault_agent.config import AgentConfig
from shardvault_agent.wal import walspool
from shardvault_agent.wal.archiver import spool_state

from shardvault.aws.readback import load_manifest
from shardvault.aws.store import Bucket
from shardvault.client import operations as ops
from shardvault.contracts.layout import backup_prefix
from shardvault.contracts.models import (
    BackupRequest,
    Manifest,
    ManifestStream,
    Phase,
    RestoreRequest,
)
from shardvault.local import demo
from shardvault.local.minio import PINNED_MODULE, MinioServer
from shardvault.local.postgres import (
    PostgresInstance,
    attach_instance,
    ensure_traversable,
    find_pg_bin_dir,
    give_to_postgres,
    init_instance,
    pgbench_init,
    run_as_postgres,
)
from shardvault.local.stack import STATE_MACHINES, LocalStack

CLUSTER = "bench"
NODE_ID = "node-1"
SHARD_ID = "shard-1"
S3_BUCKET = "bench-s3transfer"
WAL_SEGMENT = 16 * 1024 * 1024
ARCHIVE_TIMEOUT = 1800.0
BACKUP_TIMEOUT = 3600.0
POLL = 0.5  # the wall time comes from the execution's stopDate, not from this poll
TOOLS = (
    "shardvault",
    "shardvault-restore",
    "s3-files",
    "s3-tar",
    "s3-tar-tls",
    "pgbackrest",
    "pgbackrest-restore",
)
PGBACKREST_COMPRESS_TYPE = "zst"  # at pgBackRest's default level for it (3)
WAL_FILE = re.compile(r"^[0-9A-F]{24}")  # a WAL segment's name, or a history file's start
RESTORE_CLUSTER = "bench-restored"
RESTORE_NODE = "restore-node-1"


def outer_states(states: dict) -> set[str]:
    """A state machine's states outside Maps: its top level and its Parallel states' branches
    (Release and Finalize run side by side), which share the execution's history."""
    names = set(states)
    for state in states.values():
        for branch in state.get("Branches", []):
            names |= outer_states(branch["States"])
    return names


TOP_LEVEL_STATES = outer_states(
    json.loads((STATE_MACHINES / "backup.asl.json").read_text())["States"]
)
RESTORE_STATES = set(json.loads((STATE_MACHINES / "restore.asl.json").read_text())["States"])


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- arguments ----------------------------------------------------------------------------------
def add_environment_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the data, the work directory and the agent: those ``setup`` reads, shared
    with ``incremental_vs_peers.py``."""
    parser.add_argument("--scale", type=int, default=100, help="pgbench scale (100 ≈ 1.5 GiB)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each tool")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results dir")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="parent of the work directory (default: TMP)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--agent-state-dir",
        type=Path,
        default=None,
        help="parent of the agent's state directory, where its spool lives (default: the work "
        "directory; e.g. /dev/shm to take spool writes off the disk)",
    )
    parser.add_argument(
        "--agent-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an agent option, e.g. upload_parallelism=8 (repeatable)",
    )
    parser.add_argument(
        "--shardvault-archive",
        action="store_true",
        help="archive the WAL continuously with ShardVault too (its push after pgBackRest's in "
        "archive_command, the agent's archiver): ShardVault's backups then take their WAL "
        "from the archive (archived tails). The bench's policy must give the cluster an "
        "archive section (throttle_under_load.py's does)",
    )


def check_environment_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.runs < 1 or args.scale < 1:
        parser.error("--runs and --scale must be at least 1")
    if bad := [s for s in args.agent_set if "=" not in s]:
        parser.error(f"--agent-set takes KEY=VALUE, not {', '.join(bad)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_environment_arguments(parser)
    parser.add_argument("--s3-chunk-mib", type=int, default=8, help="s3transfer part size")
    parser.add_argument("--s3-concurrency", type=int, default=4, help="s3transfer threads")
    parser.add_argument(
        "--s3-signed-payload",
        action="store_true",
        help="s3transfer over HTTP with botocore's default SHA-256 payload signing (default: "
        "unsigned payload with a CRC32 checksum, as s3transfer sends to S3 over HTTPS)",
    )
    parser.add_argument(
        "--tools",
        default=",".join(TOOLS),
        help=f"comma-separated subset of {','.join(TOOLS)} (shardvault is always run: the "
        "others upload its listing)",
    )
    args = parser.parse_args(argv)
    check_environment_arguments(parser, args)
    chosen = {tool.strip() for tool in args.tools.split(",") if tool.strip()}
    if unknown := chosen - set(TOOLS):
        parser.error(f"unknown tools {', '.join(sorted(unknown))}; choose from {', '.join(TOOLS)}")
    if "pgbackrest-restore" in chosen and "pgbackrest" not in chosen:
        parser.error("pgbackrest-restore restores the round's pgbackrest backup: add pgbackrest")
    args.tools = [tool for tool in TOOLS if tool in chosen | {"shardvault"}]
    return args


def labels(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    s3 = f"{args.s3_chunk_mib} MiB parts, {args.s3_concurrency} threads"
    http = f"{s3}, {'SHA-256 signed' if args.s3_signed_payload else 'unsigned'} payload"
    levels = sorted({run["compression_level"] for run in runs.get("shardvault", [])}, key=str)
    zstd = f"zstd level {', '.join(map(str, levels))}" if levels else "zstd"
    pgbackrest = f"pgBackRest 2.45, compress-type={PGBACKREST_COMPRESS_TYPE}"
    return {
        "shardvault": f"ShardVault full backup (local stack, 1 agent, {zstd})",
        "s3-files": f"control, uncompressed: s3transfer upload_file, file by file ({http})",
        "s3-tar": f"control, uncompressed: s3transfer upload_file, one tar ({http}; tar build "
        "not timed)",
        "s3-tar-tls": f"control, uncompressed: s3transfer, one tar, over TLS ({s3})",
        "pgbackrest": f"{pgbackrest} (default level 3) full, process-max=2, TLS",
        "shardvault-restore": "ShardVault restore to a running, pg_amcheck-validated server",
        "pgbackrest-restore": f"{pgbackrest} restore + start + pg_amcheck, process-max=2, TLS",
    }


# --- the machine --------------------------------------------------------------------------------
def _output_line(cmd: list[str], index: int = 0) -> str:
    """Line ``index`` of what ``cmd`` prints (stdout, else stderr)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except OSError as error:
        return f"unavailable ({error})"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[index] if lines else ""


def _git_version() -> str:
    """The commit of the repository, with ``+dirty`` when tracked files differ from it."""
    root = str(STATE_MACHINES.parent)
    commit = _output_line(["git", "-C", root, "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", root, "diff", "--quiet", "HEAD"], capture_output=True, check=False
    )
    return commit + ("+dirty" if dirty.returncode else "")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _mem_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024 / 1024
    return 0.0


def machine_info(bench: Bench) -> dict[str, Any]:
    import botocore
    import s3transfer

    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(_mem_total_gib(), 1),
        "kernel": platform.release(),
        "debian": Path("/etc/debian_version").read_text().strip(),
        "python": platform.python_version(),
        "boto3": boto3.__version__,
        "botocore": botocore.__version__,
        "s3transfer": s3transfer.__version__,
        "postgres": _output_line([str(bench.pg.bin_dir / "postgres"), "--version"]),
        "pgbackrest": bench.pgbackrest.version(),
        "minio": PINNED_MODULE,
        "disk": _output_line(["df", "-h", "--output=source,fstype,size", str(bench.root)], -1),
        "shardvault": _git_version(),
    }


# --- the environment ----------------------------------------------------------------------------
@dataclass
class Bench:
    """Everything the runs need; every server in it is stopped by the setup's ExitStack."""

    args: argparse.Namespace
    root: Path
    stack: LocalStack
    pg: PostgresInstance
    tls_minio: MinioServer
    pgbackrest: PgBackRest
    agent_pid: int
    store_s3: Any  # the control plane's client of the store (manifests, cleanup)
    http_s3: Any  # s3transfer's client of the same MinIO
    tls_s3: Any  # s3transfer's and the bench's client of the TLS MinIO
    transfer: TransferConfig
    probe: Probe
    restore_config: dict[str, Any]
    restore_agent_pid: int
    busy_window: float  # seconds an agent keeps polling fast after its last command
    setup: dict[str, Any] = field(default_factory=dict)
    agents_busy_until: float = 0.0  # time.monotonic() when both agents poll slowly again

    @property
    def client(self) -> ops.ClientConfig:
        return self.stack.client_config()

    @property
    def store_bucket(self) -> str:
        return self.stack.services().store.bucket

    @property
    def store_minio_pid(self) -> int:
        return self.stack._minio.process.pid  # the stack's own MinIO: the store

    @property
    def agent_log(self) -> Path:
        return self.stack.root / "agents" / f"{NODE_ID}.log"

    @property
    def restore_agent_log(self) -> Path:
        return self.stack.root / "agents" / f"{RESTORE_NODE}.log"


@dataclass
class Round:
    """One round: the data listing of its ShardVault backup, and the tar built from it; the
    ShardVault backup (removed at the round's end) and pgBackRest backup its restores read."""

    index: int
    files: list[str] = field(default_factory=list)
    tar: Path | None = None
    backup_prefix: str = ""
    pgbackrest_label: str = ""


def make_workdir(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> Path:
    """A fresh directory the postgres OS user can traverse; removed at exit unless --keep."""
    root = Path(tempfile.mkdtemp(prefix="shardvault-bench-", dir=args.workdir)).absolute()
    root.chmod(0o711)
    if args.keep:
        cleanup.callback(say, f"work directory kept: {root}")
    else:
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
    return root


def stop_postgres_at(data_dir: Path) -> None:
    """Stops a server on ``data_dir`` if one runs, even one whose start did not complete."""
    if not (data_dir / "postmaster.pid").exists():
        return
    pg_ctl = str(find_pg_bin_dir() / "pg_ctl")
    cmd = run_as_postgres([pg_ctl, "-D", str(data_dir), "-w", "-m", "fast", "stop"])
    subprocess.run(cmd, capture_output=True, cwd="/", check=False)


def pg_settings(archive_command: str) -> dict[str, str]:
    return {
        "wal_level": "replica",
        "shared_buffers": "512MB",
        "archive_mode": "on",
        "archive_command": archive_command,
    }


# Makes the bench's pgBackRest from its base directory and the TLS MinIO (``setup``'s
# ``make_pgbackrest``; by default the one the module docstring describes).
PgBackRestMaker = Callable[[Path, MinioServer], PgBackRest]
# Fills the source instance instead of ``pgbench -i`` (``setup``'s ``load``); its answer is
# kept in the setup's figures as ``loaded``.
Load = Callable[[PostgresInstance], dict[str, Any]]


def default_pgbackrest(base: Path, minio: MinioServer) -> PgBackRest:
    return PgBackRest(base, minio, compress_type=PGBACKREST_COMPRESS_TYPE)


def start_servers(
    args: argparse.Namespace,
    root: Path,
    cleanup: contextlib.ExitStack,
    make_pgbackrest: PgBackRestMaker = default_pgbackrest,
) -> tuple[MinioServer, LocalStack, PostgresInstance, PgBackRest]:
    say("starting the TLS MinIO (pgBackRest), the local stack and PostgreSQL")
    tls_minio = start_tls_minio(root / "minio-tls")
    cleanup.callback(tls_minio.stop)
    stack = LocalStack(root / "stack", require_minio=True)
    cleanup.callback(stack.stop)  # before start(): a half-started stack is stopped too
    stack.start()
    data_dir = root / "pg" / "data"
    cleanup.callback(stop_postgres_at, data_dir)
    pgbackrest = make_pgbackrest(root / "pgbackrest", tls_minio)
    archive_command = pgbackrest.archive_command
    if args.shardvault_archive:  # both tools archive: a push must succeed for both
        archive_command += f" && {shardvault_push(root)}"
    pg = init_instance(data_dir, settings=pg_settings(archive_command))
    pgbackrest.instance = pg
    return tls_minio, stack, pg, pgbackrest


SYSTEM_PYTHON = Path("/usr/bin/python3")  # the push runs as the server's user, as on a host
SPOOL_MAX_BYTES = 1 << 34  # ArchivingNode's: never reached here, so no push is refused


def spool_dir(root: Path) -> Path:
    return root / "spool"


def copy_push_client(root: Path) -> Path:
    """walspool.py where the postgres user can read it (ArchivingNode's way)."""
    client = root / "push" / "walspool.py"
    client.parent.mkdir()
    shutil.copyfile(walspool.__file__, client)
    ensure_traversable(client.parent)
    return client


def push_command(client: Path, spool: Path) -> str:
    """ShardVault's ``archive_command``: the system python3 running ``client`` into ``spool``
    (which the server's user must own)."""
    return f"{SYSTEM_PYTHON} {client} --spool {spool} --max-bytes {SPOOL_MAX_BYTES} %p"


def shardvault_push(root: Path) -> str:
    """ShardVault's push into the agent's spool (``--shardvault-archive``), as
    ``tests/integration/conftest.py``'s ArchivingNode sets it up."""
    spool = spool_dir(root)
    spool.mkdir()
    give_to_postgres(spool)
    return push_command(copy_push_client(root), spool)


def fill(
    pg: PostgresInstance, pgbackrest: PgBackRest, scale: int, load: Load | None = None
) -> dict[str, Any]:
    """stanza-create, ``pgbench -i`` (or ``load``), then wait for the WAL archive to catch
    up."""
    pgbackrest.write_config()
    pgbackrest.stanza_create()
    started = time.monotonic()
    loaded: dict[str, Any] = {}
    if load is None:
        say(f"pgbench -i -s {scale}")
        pgbench_init(pg, scale)
    else:
        loaded["loaded"] = load(pg)
    filled = time.monotonic()
    pg.psql("CHECKPOINT")
    wait_archived(pg)
    return loaded | {
        "pgbench_init_seconds" if load is None else "load_seconds": round(filled - started, 1),
        "archive_catch_up_seconds": round(time.monotonic() - filled, 1),
        "database_bytes": int(pg.psql("SELECT pg_database_size('postgres')")),
        "data_dir_bytes": sum(p.stat().st_size for p in pg.data_dir.rglob("*") if p.is_file()),
    }


def agent_config(
    args: argparse.Namespace, root: Path, pg: PostgresInstance, cleanup: contextlib.ExitStack
) -> dict[str, Any]:
    """``demo.agent_config`` for the instance, with ``--agent-state-dir`` and ``--agent-set``."""
    shard = {
        "shard_id": SHARD_ID,
        "role": "leader",
        "data_dir": str(pg.data_dir),
        "conninfo": pg.conninfo,
    }
    if args.shardvault_archive:
        shard["wal_spool_dir"] = str(spool_dir(root))
    config = demo.agent_config(root, CLUSTER, NODE_ID, "postgres", [shard])
    if args.agent_state_dir:
        state = Path(tempfile.mkdtemp(prefix="shardvault-agent-", dir=args.agent_state_dir))
        cleanup.callback(shutil.rmtree, state, ignore_errors=True)
        config["state_dir"] = str(state)
    for setting in args.agent_set:
        key, _, value = setting.partition("=")
        config[key] = yaml.safe_load(value)
    return config


def start_agent(stack: LocalStack, config: dict[str, Any], cleanup: contextlib.ExitStack) -> int:
    """Starts an agent; it is stopped before its state directory is removed."""
    process = stack.start_agent(config)
    cleanup.callback(stack.stop_agent, config["node_id"])
    stack.wait_for_nodes([config["node_id"]])
    return process.pid


def setup(
    args: argparse.Namespace,
    root: Path,
    cleanup: contextlib.ExitStack,
    *,
    make_pgbackrest: PgBackRestMaker = default_pgbackrest,
    load: Load | None = None,
) -> Bench:
    """Everything the runs need (``Bench``). ``make_pgbackrest`` and ``load``: another
    pgBackRest configuration, another dataset than ``pgbench -i -s --scale``."""
    tls_minio, stack, pg, pgbackrest = start_servers(args, root, cleanup, make_pgbackrest)
    tls_s3 = s3_client_for(tls_minio)
    ensure_bucket(tls_s3, PGBACKREST_BUCKET)
    ensure_bucket(tls_s3, S3_BUCKET)
    store_s3 = stack.services().store_s3
    settings = stack.settings
    http_s3 = s3_client(
        settings.store_endpoint,
        settings.store_credentials,
        sign_payload=args.s3_signed_payload,
    )
    ensure_bucket(http_s3, S3_BUCKET)
    filled = fill(pg, pgbackrest, args.scale, load)
    (restore_config,) = demo.restore_targets(root, name=RESTORE_CLUSTER, engine="postgres", nodes=1)
    restore_config["node_id"] = RESTORE_NODE
    config = agent_config(args, root, pg, cleanup)
    busy_window = max(
        AgentConfig.model_validate(c).busy_window_seconds for c in (config, restore_config)
    )
    bench = Bench(
        args=args,
        root=root,
        stack=stack,
        pg=pg,
        tls_minio=tls_minio,
        pgbackrest=pgbackrest,
        agent_pid=start_agent(stack, config, cleanup),
        store_s3=store_s3,
        http_s3=http_s3,
        tls_s3=tls_s3,
        transfer=transfer_config(args.s3_chunk_mib, args.s3_concurrency),
        probe=probes.install(),
        restore_config=restore_config,
        restore_agent_pid=start_agent(stack, restore_config, cleanup),
        busy_window=busy_window,
        setup=filled,
    )
    bench.setup["idle_cpu_per_second"] = idle_cpu(bench)
    return bench


def idle_cpu(bench: Bench, seconds: float = 5.0) -> dict[str, float]:
    """CPU per second of the idle agent (inbox polls, heartbeats) and of this process (moto
    answering them): background load present during every tool's runs."""
    pids = {"agent": bench.agent_pid, "store_minio": bench.store_minio_pid}
    before = cpu_snapshot(pids)
    time.sleep(seconds)
    used = cpu_delta(before, cpu_snapshot(pids))
    return {name: round(value / seconds, 3) for name, value in used.items()}


# --- settling between runs ----------------------------------------------------------------------
def wait_archived(pg: PostgresInstance, timeout: float = ARCHIVE_TIMEOUT) -> None:
    """Waits until every completed WAL segment has been archived by pgBackRest: the segment
    before the current one is flushed (its ``.ready`` file is made once it is), and no
    ``.ready`` file of it or an older segment is left in ``pg_wal/archive_status``.
    ``pg_stat_archiver.last_archived_wal`` is not compared: a backup's ``.backup`` file,
    archived last, carries its start segment's name, which sorts before the segments
    archived after it, and waiting for it to pass the target hung an idle server."""
    target = pg.psql(f"SELECT pg_walfile_name(pg_current_wal_lsn() - {WAL_SEGMENT}::numeric)")
    deadline = time.monotonic() + timeout
    while True:
        pending, flushed, failed = pg.psql(
            "SELECT (SELECT count(*) FROM pg_ls_dir('pg_wal/archive_status') AS f "
            f"WHERE f LIKE '%.ready' AND left(f, 24) <= '{target}'), "
            f"pg_walfile_name(pg_current_wal_flush_lsn()) > '{target}', "
            "coalesce(last_failed_wal, '') FROM pg_stat_archiver"
        ).split("|")
        if pending == "0" and flushed == "t":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"WAL archiving is behind after {timeout:.0f} s: {pending} segment(s) up to "
                f"{target} wait, last failure {failed or 'none'}. Server log:\n"
                f"{pg.log_tail()}"
            )
        time.sleep(0.5)


def settle(bench: Bench, loaded: bool = False) -> None:
    """WAL archiving caught up, then ``sync``. ``loaded``: a write load runs, so ShardVault's
    spool (``--shardvault-archive``) is never empty: it has caught up when no file in it is
    older than the policy's delay and a margin (``SPOOL_SETTLED_AGE``)."""
    wait_archived(bench.pg)
    if bench.args.shardvault_archive:
        wait_spool_drained(spool_dir(bench.root), SPOOL_SETTLED_AGE if loaded else 0.0)
    os.sync()


SPOOL_SETTLED_AGE = 90.0  # the policy's delay (60 s) and a margin: the archiver keeps up


def wait_spool_drained(spool: Path, age: float, timeout: float = 1800.0) -> None:
    """Waits until ShardVault's spool holds no WAL file older than ``age`` (0: none at all)."""
    deadline = time.monotonic() + timeout

    def waiting() -> bool:
        size, oldest = spool_state(spool, time.time())
        return size > 0 and oldest >= age

    while waiting():
        if time.monotonic() > deadline:
            raise RuntimeError(f"ShardVault's spool {spool} did not drain in {timeout:g} s")
        time.sleep(1.0)


def quiet_agents(bench: Bench) -> dict[str, float]:
    """Waits until both agents poll at their idle rate again.

    For ``busy_window_seconds`` (30 s by default) after its last command an agent reads its
    inbox every ``busy_poll_interval_seconds`` (50 ms), and moto answers every read in this
    process: CPU taken from whatever tool runs next on the same 2 cores. Returns the wait and
    the CPU per second this process and the agents used during it (that background load)."""
    wait = bench.agents_busy_until - time.monotonic()
    if wait <= 0:
        return {"quiet_wait_seconds": 0.0}
    pids = {"agent": bench.agent_pid, "restore_agent": bench.restore_agent_pid}
    before = cpu_snapshot(pids)
    time.sleep(wait)
    used = cpu_delta(before, cpu_snapshot(pids))
    return {
        "quiet_wait_seconds": round(wait, 1),
        "busy_poll_cpu_per_second": {name: round(v / wait, 3) for name, v in used.items()},
    }


# --- CPU accounting -----------------------------------------------------------------------------
def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each process in ``pids`` and of this one (``self``)."""
    return {"self": time.process_time()} | {name: process_cpu(pid) for name, pid in pids.items()}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 2) for name in before}


# --- stored bytes -------------------------------------------------------------------------------
def size_of(objects: list[dict[str, Any]]) -> int:
    return sum(obj["Size"] for obj in objects)


def shardvault_stored(
    bench: Bench, manifest: Manifest, prefix: str, manifest_key: str
) -> dict[str, Any]:
    """What the backup holds under ``prefix`` in the store, listed, and checked against what
    its manifest and its catalog record say it stored (see the module docstring)."""
    keys = list_keys(bench.store_s3, bench.store_bucket, prefix)
    objects = [obj for obj in keys if obj["Key"] != manifest_key]
    record = ops.show_backup(bench.client, CLUSTER, manifest.backup_id)
    catalog = record.stored_bytes
    in_bucket = size_of(objects)
    # The manifest's ``objects`` counts the streams' objects; the shards' block maps are
    # objects too (and in its ``stored_bytes``).
    listed = sum(len(shard.objects) for shard in manifest.shards)
    if len(objects) != listed or not in_bucket == manifest.stored_bytes == catalog:
        raise RuntimeError(
            f"backup {manifest.backup_id}: the store holds {len(objects)} objects of "
            f"{in_bucket} bytes under {prefix} (besides the manifest), its manifest names "
            f"{listed} objects of {manifest.stored_bytes} bytes and its catalog record "
            f"{catalog} bytes: the stored bytes it reports are wrong."
        )
    return {
        "stored_bytes": size_of(keys),
        "stored_object_bytes": in_bucket,
        "stored_manifest_bytes": size_of(keys) - in_bucket,
        "manifest_stored_bytes": manifest.stored_bytes,
        "catalog_stored_bytes": catalog,
        "compression_level": (json.loads(record.context or "{}").get("compression") or {}).get(
            "level"
        ),
        "frame_levels": record.frame_levels,
        "pack_cpu_seconds": record.pack_cpu_seconds,
        "encrypted": manifest.encryption is not None,
    }


def pgbackrest_stored(bench: Bench, label: str) -> dict[str, Any]:
    """What pgBackRest's backup ``label`` holds in its bucket: its backup path and the WAL it
    needs (see the module docstring)."""
    backup = next(b for b in bench.pgbackrest.info()["backup"] if b["label"] == label)
    files = list_keys(bench.tls_s3, PGBACKREST_BUCKET, bench.pgbackrest.backup_prefix(label))
    archive_prefix = f"{PGBACKREST_REPO_PATH.strip('/')}/archive/{STANZA}/"
    start, stop = backup["archive"]["start"], backup["archive"]["stop"]
    wal = [
        obj
        for obj in list_keys(bench.tls_s3, PGBACKREST_BUCKET, archive_prefix)
        if (name := WAL_FILE.match(obj["Key"].rsplit("/", 1)[-1])) and start <= name[0] <= stop
    ]
    if not wal:
        raise RuntimeError(f"pgBackRest's backup {label} needs WAL {start} to {stop}: none listed")
    return {
        "objects": len(files),
        "stored_bytes": size_of(files) + size_of(wal),
        "stored_backup_path_bytes": size_of(files),
        "stored_wal_bytes": size_of(wal),
        "stored_wal_files": [obj["Key"].rsplit("/", 1)[-1] for obj in wal],
    }


# --- ShardVault ---------------------------------------------------------------------------------
def wait_execution(arn: str, timeout: float = BACKUP_TIMEOUT) -> dict[str, Any]:
    """Polls the execution (nothing else, every ``POLL`` seconds, to add little load to the
    control plane) until it is no longer running."""
    sfn = boto3.client("stepfunctions")
    deadline = time.monotonic() + timeout
    while True:
        execution = sfn.describe_execution(executionArn=arn)
        if execution["status"] != "RUNNING":
            return execution
        if time.monotonic() > deadline:
            raise TimeoutError(f"backup {arn} still running after {timeout:.0f} s")
        time.sleep(POLL)


def stream_of(manifest: Manifest, phase: Phase) -> ManifestStream:
    return next(s for shard in manifest.shards for s in shard.streams if s.phase == phase)


def timeline(bench: Bench, arn: str, backup_id: str) -> dict[str, Any]:
    """Where the backup's time went: state machine phases and the agent's commands."""
    spans, end = report.state_spans(ops.execution_history(arn), TOP_LEVEL_STATES)
    commands = report.agent_commands(bench.agent_log.read_text(), backup_id)
    return {
        "phases": report.phase_split(spans, end),
        "states": report.state_seconds(spans),
        "agent": report.agent_split(commands),
        "objects_steps": report.object_steps(commands, bench.probe.drain()),
    }


@dataclass
class ShardVaultBackup:
    """One timed ShardVault backup: its figures (``result``), its manifest and execution."""

    result: dict[str, Any]
    manifest: Manifest
    prefix: str  # the backup's prefix in the store
    arn: str


def shardvault_backup(bench: Bench, request: BackupRequest) -> ShardVaultBackup:
    """Runs ``request`` and times it (see the module docstring); the stored bytes are listed
    and checked against the manifest and the catalog record."""
    pids = {"agent": bench.agent_pid, "minio": bench.store_minio_pid}
    before = cpu_snapshot(pids)
    bench.probe.drain()
    started = time.time()
    arn = ops.start_backup(bench.client, request)
    execution = wait_execution(arn)
    # start_backup called -> execution stopped (SUCCEEDED), by this machine's clock: moto runs
    # in this process. A slow poll adds nothing to it, and little load.
    seconds = execution["stopDate"].timestamp() - started
    cpu = cpu_delta(before, cpu_snapshot(pids))
    if execution["status"] != "SUCCEEDED":
        cause = ops.readable_cause(execution.get("cause", ""))
        raise RuntimeError(
            f"ShardVault backup {execution['status']}: {execution.get('error')}: {cause}. "
            f"Agent log: {bench.agent_log}"
        )
    record = json.loads(execution["output"])
    store = Bucket(bench.store_s3, bench.store_bucket)
    manifest = load_manifest(store, record["manifest_key"])
    data, tail = stream_of(manifest, Phase.DATA), stream_of(manifest, Phase.TAIL)
    prefix = backup_prefix(bench.stack.services().store.prefix, CLUSTER, manifest.backup_id)
    stored = shardvault_stored(bench, manifest, prefix, record["manifest_key"])
    result = {
        "seconds": seconds,
        "execution_seconds": (execution["stopDate"] - execution["startDate"]).total_seconds(),
        "backup_id": manifest.backup_id,
        "bytes": record["bytes"],
        **stored,
        "data_bytes": sum(o.length for o in data.objects),
        "tail_bytes": sum(o.length for o in tail.objects),
        "objects": record["objects"],
        "parts": record["parts"],
        "part_size": manifest.part_size,
        "files": len(regular_files(data.files)),
        "shards": len(manifest.shards),
        "verification": record["verification"],
        "agent_peak_rss": peak_rss_bytes(bench.agent_pid),
        "client_cpu_seconds": cpu["agent"] + cpu["self"],
        "agent_cpu_seconds": cpu["agent"],
        "control_plane_cpu_seconds": cpu["self"],
        "minio_cpu_seconds": cpu["minio"],
    }
    return ShardVaultBackup(result, manifest, prefix, arn)


def run_shardvault(bench: Bench, rnd: Round) -> dict[str, Any]:
    backup = shardvault_backup(bench, BackupRequest(cluster=CLUSTER))
    rnd.files = regular_files(stream_of(backup.manifest, Phase.DATA).files)
    # Removed at the round's end (disk space; not timed): the restore reads it first.
    rnd.backup_prefix = backup.prefix
    return backup.result | timeline(bench, backup.arn, backup.manifest.backup_id)


# --- the peers ----------------------------------------------------------------------------------
def round_tar(bench: Bench, rnd: Round) -> Path:
    """The round's tar of the listed files, built once (untimed) and shared by both tar runs."""
    if rnd.tar is None:
        rnd.tar = bench.root / "tar" / f"round-{rnd.index}.tar"
        say(f"  building the tar of {len(rnd.files)} files (not timed)")
        build_tar(bench.pg.data_dir, rnd.files, rnd.tar)
        settle(bench)
    return rnd.tar


def timed_upload(
    s3: Any, minio_pid: int, upload: Callable[[], dict[str, Any]], prefix: str
) -> dict[str, Any]:
    """Runs ``upload`` (it times itself), lists what it stored under ``prefix``, then deletes
    it."""
    before = cpu_snapshot({"minio": minio_pid})
    result = upload()
    cpu = cpu_delta(before, cpu_snapshot({"minio": minio_pid}))
    stored = size_of(list_keys(s3, S3_BUCKET, prefix))
    delete_prefix(s3, S3_BUCKET, prefix)  # disk space; not timed
    return result | {
        "stored_bytes": stored,
        "client_cpu_seconds": cpu["self"],
        "minio_cpu_seconds": cpu["minio"],
    }


def run_s3_files(bench: Bench, rnd: Round) -> dict[str, Any]:
    prefix = f"round-{rnd.index}/files"
    return timed_upload(
        bench.http_s3,
        bench.store_minio_pid,
        lambda: upload_files(
            bench.http_s3, S3_BUCKET, prefix, bench.pg.data_dir, rnd.files, bench.transfer
        ),
        prefix,
    )


def run_s3_tar(bench: Bench, rnd: Round) -> dict[str, Any]:
    tar, key = round_tar(bench, rnd), f"round-{rnd.index}/data.tar"
    return timed_upload(
        bench.http_s3,
        bench.store_minio_pid,
        lambda: upload_one(bench.http_s3, S3_BUCKET, key, tar, bench.transfer),
        key,
    )


def run_s3_tar_tls(bench: Bench, rnd: Round) -> dict[str, Any]:
    tar, key = round_tar(bench, rnd), f"round-{rnd.index}/data.tar"
    return timed_upload(
        bench.tls_s3,
        bench.tls_minio.process.pid,
        lambda: upload_one(bench.tls_s3, S3_BUCKET, key, tar, bench.transfer),
        key,
    )


def run_pgbackrest(bench: Bench, rnd: Round) -> dict[str, Any]:
    minio_before = process_cpu(bench.tls_minio.process.pid)
    result = bench.pgbackrest.backup_full()
    minio_cpu = process_cpu(bench.tls_minio.process.pid) - minio_before
    rnd.pgbackrest_label = result["label"]
    return (
        result
        | pgbackrest_stored(bench, result["label"])
        | {"compress_type": PGBACKREST_COMPRESS_TYPE, "minio_cpu_seconds": round(minio_cpu, 2)}
    )


# --- restores -----------------------------------------------------------------------------------
def amcheck(
    bin_dir: Path, socket_dir: Path, port: int, jobs: int, heapallindexed: bool = False
) -> None:
    """``pg_amcheck --all`` with the restore agent's ``validation_jobs``: what ShardVault's
    restore runs before it reports success (``--heapallindexed`` too when asked, as a
    restore request's ``heapallindexed`` asks of ShardVault's)."""
    cmd = [str(bin_dir / "pg_amcheck"), "-h", str(socket_dir), "-p", str(port), "-U", "postgres"]
    deeper = ["--heapallindexed"] if heapallindexed else []
    done = subprocess.run(
        [*cmd, "--all", "--install-missing", f"--jobs={jobs}", *deeper],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )
    if done.returncode != 0:
        raise RuntimeError(f"pg_amcheck failed: {done.stdout}{done.stderr}")


# Runs on a restored server, after the timed part and before the server is stopped: what the
# caller wants to know of the restored data (e.g. row counts to compare with the source).
RestoredCheck = Callable[[PostgresInstance], dict[str, Any]]


def restored_server(shard: dict[str, Any]) -> PostgresInstance:
    """The server ShardVault's restore started for ``shard`` (an entry of its summary)."""
    path = Path(shard["path"])
    return PostgresInstance(
        path, shard["port"], Path(shard["socket_dir"]), find_pg_bin_dir(), Path(f"{path}.log")
    )


def shardvault_restore(
    bench: Bench, request: RestoreRequest, check: RestoredCheck | None = None
) -> dict[str, Any]:
    """Runs the restore ``request`` into the restore agent's one-node cluster: start of the
    execution to a running server that recovered and passed pg_amcheck (the execution's end).
    ``check`` then looks at the restored server (not timed); its answer is ``checked``."""
    restore_dir = Path(bench.restore_config["restore_dir"])
    pids = {"agent": bench.restore_agent_pid, "minio": bench.store_minio_pid}
    before = cpu_snapshot(pids)
    started = time.time()
    arn = ops.start_restore(bench.client, request)
    execution = wait_execution(arn)
    seconds = execution["stopDate"].timestamp() - started
    cpu = cpu_delta(before, cpu_snapshot(pids))
    if execution["status"] != "SUCCEEDED":
        cause = ops.readable_cause(execution.get("cause", ""))
        raise RuntimeError(
            f"ShardVault restore of {request.backup_id} {execution['status']}: "
            f"{execution.get('error')}: {cause}. Restore agent log: {bench.restore_agent_log}"
        )
    summary = json.loads(execution["output"])
    checked = {}
    try:
        if check:
            checked = {
                "checked": {s["shard_id"]: check(restored_server(s)) for s in summary["shards"]}
            }
    finally:
        for shard in summary["shards"]:
            stop_postgres_at(Path(shard["path"]))
        shutil.rmtree(restore_dir / SHARD_ID, ignore_errors=True)  # disk space; not timed
    spans, _ = report.state_spans(ops.execution_history(arn), RESTORE_STATES)
    return {
        "seconds": seconds,
        "bytes": summary["bytes"],
        "stored_bytes": None,  # a restore stores nothing in the bucket
        "objects": summary["objects"],
        "agent_peak_rss": peak_rss_bytes(bench.restore_agent_pid),
        "client_cpu_seconds": cpu["agent"] + cpu["self"],
        "agent_cpu_seconds": cpu["agent"],
        "control_plane_cpu_seconds": cpu["self"],
        "minio_cpu_seconds": cpu["minio"],
        "states": report.state_seconds(spans),
        "restore_id": summary["restore_id"],
        # A point-in-time restore's WAL feed (none otherwise): what recovery was fed.
        **{k: v for k, v in summary.items() if k.startswith("wal_")},
        **checked,
    }


def run_shardvault_restore(bench: Bench, rnd: Round) -> dict[str, Any]:
    """The round's backup (the newest) restored into a one-node cluster."""
    request = RestoreRequest(cluster=CLUSTER, target_cluster=RESTORE_CLUSTER, replace=True)
    return shardvault_restore(bench, request)


def pgbackrest_restore(
    bench: Bench, label: str, check: RestoredCheck | None = None, *, heapallindexed: bool = False
) -> dict[str, Any]:
    """pgBackRest's restore of its backup ``label`` into an empty directory, the server started
    (recovery to the backup's consistent point, then promote) and checked by pg_amcheck
    (``heapallindexed``: with ``--heapallindexed``); ``check`` then looks at the server (not
    timed), as for ``shardvault_restore``."""
    target = bench.root / "pgbackrest-restored"
    shutil.rmtree(target, ignore_errors=True)
    minio_before = process_cpu(bench.tls_minio.process.pid)
    result = bench.pgbackrest.restore(label, target)
    instance = attach_instance(target)  # starts it, waits until it accepts connections
    checked = {}
    try:
        deadline = time.monotonic() + BACKUP_TIMEOUT
        while instance.psql("SELECT pg_is_in_recovery()") != "f":  # until promoted
            if time.monotonic() > deadline:
                raise TimeoutError(f"pgBackRest's restore of {label} never promoted")
            time.sleep(0.05)
        jobs = AgentConfig.model_validate(bench.restore_config).validation_jobs
        amcheck(instance.bin_dir, instance.socket_dir, instance.port, jobs, heapallindexed)
        seconds = result["seconds"] + (time.monotonic() - result["ended"])
        if check:
            checked = {"checked": {SHARD_ID: check(instance)}}
    finally:
        instance.stop()
        shutil.rmtree(target, ignore_errors=True)
    backup = next(b for b in bench.pgbackrest.info()["backup"] if b["label"] == label)
    return {
        "seconds": seconds,
        "restore_seconds": result["seconds"],
        "bytes": backup["info"]["size"],
        "stored_bytes": None,  # a restore stores nothing in the bucket
        "objects": None,  # not counted: the objects are its backup's (see pgbackrest)
        "client_cpu_seconds": result["client_cpu_seconds"],
        "minio_cpu_seconds": round(process_cpu(bench.tls_minio.process.pid) - minio_before, 2),
        **checked,
    }


def run_pgbackrest_restore(bench: Bench, rnd: Round) -> dict[str, Any]:
    return pgbackrest_restore(bench, rnd.pgbackrest_label)


RUNNERS: dict[str, Callable[[Bench, Round], dict[str, Any]]] = {
    "shardvault": run_shardvault,
    "shardvault-restore": run_shardvault_restore,
    "pgbackrest-restore": run_pgbackrest_restore,
    "s3-files": run_s3_files,
    "s3-tar": run_s3_tar,
    "s3-tar-tls": run_s3_tar_tls,
    "pgbackrest": run_pgbackrest,
}


# --- rounds -------------------------------------------------------------------------------------
def run_round(bench: Bench, rnd: Round, runs: dict[str, list[dict[str, Any]]]) -> None:
    for tool in bench.args.tools:
        quiet = quiet_agents(bench)
        settle(bench)
        load = os.getloadavg()[0]
        result = RUNNERS[tool](bench, rnd) | {"round": rnd.index, "load_before": load} | quiet
        if tool.startswith("shardvault"):
            bench.agents_busy_until = time.monotonic() + bench.busy_window
        runs[tool].append(result)
        objects = "" if result["objects"] is None else f", {result['objects']} objects"
        stored = result["stored_bytes"]
        stored_mib = "" if stored is None else f", {stored / 2**20:,.1f} MiB stored"
        say(
            f"  {tool}: {result['seconds']:.1f} s, {result['bytes'] / 2**20:,.0f} MiB read"
            f"{stored_mib}{objects} (load before {load:.2f})"
        )
    if rnd.tar:
        rnd.tar.unlink(missing_ok=True)
    if rnd.backup_prefix:
        delete_prefix(bench.store_s3, bench.store_bucket, rnd.backup_prefix)
    if rnd.pgbackrest_label:
        # Earlier rounds' backups are not needed any more (disk space; not timed). pgBackRest
        # never expires its newest backup with --set, so this round's stays until the next.
        for backup in bench.pgbackrest.info()["backup"]:
            if backup["label"] != rnd.pgbackrest_label:
                bench.pgbackrest.expire(backup["label"])


def run_rounds(bench: Bench) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {tool: [] for tool in bench.args.tools}
    for index in range(1, bench.args.runs + 1):
        say(f"round {index} of {bench.args.runs}")
        run_round(bench, Round(index), runs)
    return runs


# --- output -------------------------------------------------------------------------------------
def write_results(
    bench: Bench,
    runs: dict,
    summary: dict,
    started: float,
    *,
    name: str = "backup_vs_peers",
    markdown: str | None = None,
    machine: dict[str, Any] | None = None,
) -> Path:
    """``<name>-<UTC time>.json`` (the command, machine, setup, every run, the summary) in
    ``--out``, and the tables (``markdown``, by default ``report.markdown``) beside it.
    ``machine``: what describes the machine, by default ``machine_info``."""
    out: Path = bench.args.out
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"{name}-{stamp}.json"
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "wall_seconds": round(time.time() - started, 1),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(bench.args).items()},
        "machine": machine_info(bench) if machine is None else machine,
        "setup": bench.setup,
        "runs": runs,
        "summary": summary,
    }
    path.write_text(json.dumps(result, indent=1, default=str))
    path.with_suffix(".md").write_text(report.markdown(summary) if markdown is None else markdown)
    return path


def _terminate(signum: int, _frame: object) -> None:
    say(f"signal {signum}: stopping everything")
    raise SystemExit(128 + signum)  # unwinds the ExitStack: everything started is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    avoid_empty_put_stall()
    signal.signal(signal.SIGTERM, _terminate)
    started = time.time()
    with contextlib.ExitStack() as cleanup:
        root = make_workdir(args, cleanup)
        bench = setup(args, root, cleanup)
        say(f"setup done in {time.time() - started:.0f} s: {bench.setup}")
        runs = run_rounds(bench)
        summary = report.summarize(runs, labels(args, runs))
        path = write_results(bench, runs, summary, started)
        say("stopping everything")
    print(report.markdown(summary))
    print(f"Raw results: {path}; benchmark wall time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
