"""The peers ShardVault is measured against: raw s3transfer and pgBackRest, on the same data.

* *s3transfer*: boto3's ``upload_file`` (s3transfer underneath) into a bucket of the same
  MinIO that holds ShardVault's backups, either one call per file of ShardVault's own data
  listing, or one call for a tar of those files built beforehand (not timed).
* *pgBackRest*: ``pgbackrest backup --type=full`` as the postgres OS user, into a second MinIO
  started with TLS, because pgBackRest (2.45 as 2.59) speaks S3 only over TLS. Its
  configuration file is ours (``--config``), never ``/etc/pgbackrest/pgbackrest.conf``. The
  *binary* is ``$PGBACKREST_BIN`` when set (e.g. ``/opt/pgbackrest-2.59.1/bin/pgbackrest``,
  built from its release source with ``meson setup build && ninja -C build``), else
  ``pgbackrest`` on ``PATH`` (Debian 12's 2.45); the same binary runs the commands and the
  ``archive_command``. ``PgBackRest.as_users_run_it`` is the configuration its users run:
  ``compress-type=zst`` at its default level (3), ``process-max=2``, ``repo1-bundle=y``
  (small files combined into bundles) and ``repo1-block=y`` (block incremental, which needs
  bundles; beta in 2.45: use 2.46 or later).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import resource
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import urllib3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from shardvault.contracts.models import FileEntry
from shardvault.local.minio import MinioServer, start_minio
from shardvault.local.postgres import PG_USER, PostgresInstance, run_as_postgres

MiB = 1024 * 1024
STANZA = "bench"
PGBACKREST_BUCKET = "pgbackrest"
PGBACKREST_REPO_PATH = "/repo"
PGBACKREST_BIN_ENV = "PGBACKREST_BIN"
DELETE_BATCH = 1000


# --- S3 clients and buckets ---------------------------------------------------------------------
def avoid_empty_put_stall() -> None:
    """No ``Expect: 100-continue`` on zero-length PUTs (botocore's opt-in switch).

    MinIO answers such a PUT at once without a ``100 Continue``; botocore then leaves the pooled
    connection in a state where the next request on it stalls until the read timeout (60 s)
    and is silently retried (boto/botocore#3755). A data directory holds dozens of empty files,
    so file-by-file uploads would measure these stalls, not the transfer. ShardVault's agent
    (urllib3, never an empty part) and pgBackRest are not affected.
    """
    os.environ["BOTO_EXPERIMENTAL__NO_EMPTY_CONTINUE"] = "true"


def s3_client(
    endpoint: str, credentials: tuple[str, str], *, sign_payload: bool | None = None
) -> Any:
    """An S3 client for a MinIO at ``endpoint`` (path style; a self-signed certificate is not
    verified).

    ``sign_payload``: ``None`` keeps botocore's default, which over plain HTTP puts a SHA-256 of
    every request body into the signature (client and server both hash every byte) and over
    HTTPS does not (a CRC32 checksum header only). ``False`` asks for the HTTPS behaviour on
    HTTP: what s3transfer does against S3, less the encryption.
    """
    https = endpoint.startswith("https:")
    if https:
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    s3_options: dict[str, Any] = {"addressing_style": "path"}
    if sign_payload is not None:
        s3_options["payload_signing_enabled"] = sign_payload
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=credentials[0],
        aws_secret_access_key=credentials[1],
        region_name="us-east-1",
        verify=not https,
        config=Config(signature_version="s3v4", s3=s3_options),
    )


def s3_client_for(server: MinioServer, *, sign_payload: bool | None = None) -> Any:
    return s3_client(
        server.endpoint, (server.access_key, server.secret_key), sign_payload=sign_payload
    )


def ensure_bucket(s3: Any, bucket: str) -> None:
    exists = (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists)
    with contextlib.suppress(*exists):
        s3.create_bucket(Bucket=bucket)


def list_keys(s3: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Every object under ``prefix`` (``Key`` and ``Size``)."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [obj for page in pages for obj in page.get("Contents", [])]


def delete_prefix(s3: Any, bucket: str, prefix: str) -> int:
    """Deletes every object under ``prefix``; returns how many there were."""
    keys = [obj["Key"] for obj in list_keys(s3, bucket, prefix)]
    for start in range(0, len(keys), DELETE_BATCH):
        batch = [{"Key": key} for key in keys[start : start + DELETE_BATCH]]
        s3.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
    return len(keys)


# --- s3transfer ---------------------------------------------------------------------------------
def transfer_config(chunk_mib: int, concurrency: int) -> TransferConfig:
    """Parts of ``chunk_mib`` MiB (also the multipart threshold), ``concurrency`` threads."""
    return TransferConfig(
        multipart_threshold=chunk_mib * MiB,
        multipart_chunksize=chunk_mib * MiB,
        max_concurrency=concurrency,
    )


def regular_files(files: Iterable[FileEntry]) -> list[str]:
    """The paths of a listing that are files (directory entries end with ``/``)."""
    return [f.path for f in files if not f.path.endswith("/")]


def upload_files(
    s3: Any, bucket: str, prefix: str, root: Path, paths: list[str], config: TransferConfig
) -> dict[str, Any]:
    """One ``upload_file`` per file, in listing order; timed from the first to the last."""
    sizes = [(root / path).stat().st_size for path in paths]
    started = time.monotonic()
    for path in paths:
        s3.upload_file(str(root / path), bucket, f"{prefix}/{path}", Config=config)
    seconds = time.monotonic() - started
    return {"seconds": seconds, "bytes": sum(sizes), "objects": len(paths)}


def build_tar(root: Path, paths: list[str], out: Path) -> int:
    """An uncompressed tar of ``paths`` (relative to ``root``); returns its size."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            tar.add(root / path, arcname=path, recursive=False)
    return out.stat().st_size


def upload_one(s3: Any, bucket: str, key: str, path: Path, config: TransferConfig) -> dict:
    """One ``upload_file`` of one file (the pre-built tar)."""
    size = path.stat().st_size
    started = time.monotonic()
    s3.upload_file(str(path), bucket, key, Config=config)
    return {"seconds": time.monotonic() - started, "bytes": size, "objects": 1}


# --- TLS MinIO for pgBackRest -------------------------------------------------------------------
def make_self_signed_cert(certs_dir: Path) -> None:
    """``public.crt``/``private.key`` for 127.0.0.1, as MinIO's ``--certs-dir`` expects."""
    certs_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(certs_dir / "private.key"), "-out", str(certs_dir / "public.crt"),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip


def start_tls_minio(base: Path) -> MinioServer:
    """A second MinIO, served over https with a self-signed certificate."""
    certs = base / "certs"
    make_self_signed_cert(certs)
    return start_minio(base / "data", certs_dir=certs, log_path=base / "minio.log")


# --- pgBackRest ---------------------------------------------------------------------------------
def default_pgbackrest_binary() -> str:
    """``$PGBACKREST_BIN``, else the absolute path of ``pgbackrest`` on ``PATH`` (the postgres
    OS user and the server's ``archive_command`` may have another ``PATH``), else the bare
    name."""
    return os.environ.get(PGBACKREST_BIN_ENV) or shutil.which("pgbackrest") or "pgbackrest"


@dataclass
class PgBackRest:
    """pgBackRest with its own config file, logs and lock directory under ``base``.

    ``binary``: the pgbackrest program (``default_pgbackrest_binary``). ``bundle``:
    ``repo1-bundle=y``; ``block``: ``repo1-block=y`` (block incremental), which pgBackRest
    accepts only with ``repo1-bundle=y``. Both off by default (the benches' 2.45 runs).
    """

    base: Path
    minio: MinioServer
    instance: PostgresInstance | None = None  # set once the instance exists
    process_max: int = 2
    compress_type: str = "none"
    binary: str = field(default_factory=default_pgbackrest_binary)
    bundle: bool = False
    block: bool = False

    def __post_init__(self) -> None:
        if self.block and not self.bundle:
            raise ValueError("pgBackRest's repo1-block=y needs repo1-bundle=y (bundle=True)")

    @classmethod
    def as_users_run_it(
        cls,
        base: Path,
        minio: MinioServer,
        *,
        binary: str | None = None,
        instance: PostgresInstance | None = None,
    ) -> PgBackRest:
        """zst at its default level, ``process-max=2``, bundles and block incremental."""
        return cls(
            base,
            minio,
            instance=instance,
            process_max=2,
            compress_type="zst",
            binary=binary or default_pgbackrest_binary(),
            bundle=True,
            block=True,
        )

    def settings(self) -> dict[str, Any]:
        """What a result should record of this configuration (with ``version()``)."""
        return {
            "binary": self.binary,
            "process_max": self.process_max,
            "compress_type": self.compress_type,
            "bundle": self.bundle,
            "block": self.block,
        }

    @property
    def config_path(self) -> Path:
        return self.base / "pgbackrest.conf"

    @property
    def archive_command(self) -> str:
        return f"{self.binary} --config={self.config_path} --stanza={STANZA} archive-push %p"

    def config_text(self) -> str:
        if self.instance is None:
            raise RuntimeError("pgBackRest's stanza needs the PostgreSQL instance first")
        port = self.minio.port
        return "\n".join(
            [
                "[global]",
                "repo1-type=s3",
                "repo1-s3-endpoint=127.0.0.1",
                f"repo1-storage-port={port}",
                "repo1-s3-uri-style=path",
                "repo1-storage-verify-tls=n",
                f"repo1-s3-bucket={PGBACKREST_BUCKET}",
                "repo1-s3-region=us-east-1",
                f"repo1-s3-key={self.minio.access_key}",
                f"repo1-s3-key-secret={self.minio.secret_key}",
                f"repo1-path={PGBACKREST_REPO_PATH}",
                "repo1-retention-full=1000",
                f"process-max={self.process_max}",
                f"compress-type={self.compress_type}",
                *(["repo1-bundle=y"] if self.bundle else []),
                *(["repo1-block=y"] if self.block else []),
                "start-fast=y",
                f"log-path={self.base / 'log'}",
                f"lock-path={self.base / 'lock'}",
                "log-level-console=warn",
                "log-level-file=info",
                "",
                f"[{STANZA}]",
                f"pg1-path={self.instance.data_dir}",
                f"pg1-port={self.instance.port}",
                f"pg1-socket-path={self.instance.socket_dir}",
                "",
            ]
        )

    def write_config(self) -> None:
        """The config file (it holds the MinIO key: 0600, owned by the postgres user)."""
        user = pwd.getpwnam(PG_USER) if os.geteuid() == 0 else None
        for directory in (self.base, self.base / "log", self.base / "lock"):
            directory.mkdir(parents=True, exist_ok=True)
            if user:
                os.chown(directory, user.pw_uid, user.pw_gid)
        self.config_path.write_text(self.config_text())
        self.config_path.chmod(0o600)
        if user:
            os.chown(self.config_path, user.pw_uid, user.pw_gid)

    def command(self, *args: str) -> list[str]:
        return run_as_postgres(
            [self.binary, f"--config={self.config_path}", f"--stanza={STANZA}", *args]
        )

    def run(self, *args: str) -> str:
        result = subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            cwd="/",
            check=False,
            env=tool_env(),
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"pgbackrest {' '.join(args)} exited with {result.returncode}:\n"
                f"{result.stdout}{result.stderr}\nLogs in {self.base / 'log'}."
            )
        return result.stdout

    def stanza_create(self) -> None:
        self.run("stanza-create")

    def version(self) -> str:
        """What ``binary version`` prints, e.g. ``pgBackRest 2.59.1``."""
        out = subprocess.run(
            [self.binary, "version"], capture_output=True, text=True, cwd="/", check=True
        )
        return out.stdout.strip()

    def backup(self, backup_type: str = "full") -> dict[str, Any]:
        """One timed ``backup --type=<backup_type>`` (full, diff or incr); CPU of pgBackRest's
        processes included. ``bytes`` is the database's size; ``delta_bytes`` what this backup
        copied (the files it found changed: all of them for a full)."""
        before = _children_cpu()
        started = time.monotonic()
        self.run("backup", f"--type={backup_type}")
        seconds = time.monotonic() - started
        cpu = _children_cpu() - before
        last = self.info()["backup"][-1]
        # With repo1-bundle=y pgBackRest reports no repository size of a backup (None here).
        repository = last["info"]["repository"]
        return {
            "seconds": seconds,
            "label": last["label"],
            "bytes": last["info"]["size"],
            "delta_bytes": last["info"]["delta"],
            "repo_bytes": repository.get("size"),
            "repo_delta_bytes": repository.get("delta"),
            "client_cpu_seconds": round(cpu, 2),
        }

    def backup_full(self) -> dict[str, Any]:
        return self.backup("full")

    def restore(self, label: str, target: Path) -> dict[str, Any]:
        """One timed ``restore`` of ``label`` into the empty directory ``target``: to the
        backup's consistent point, then promote, without archiving (as ShardVault restores)."""
        target.mkdir(parents=True)
        user = pwd.getpwnam(PG_USER) if os.geteuid() == 0 else None
        if user:
            os.chown(target, user.pw_uid, user.pw_gid)
        target.chmod(0o700)
        before = _children_cpu()
        started = time.monotonic()
        self.run(
            "restore",
            f"--pg1-path={target}",
            f"--set={label}",
            "--type=immediate",
            "--target-action=promote",
            "--archive-mode=off",
        )
        ended = time.monotonic()
        return {
            "seconds": ended - started,
            "ended": ended,
            "client_cpu_seconds": round(_children_cpu() - before, 2),
        }

    def expire(self, label: str) -> None:
        """Removes the backup ``label`` and the WAL only it needed (untimed, for disk space:
        ``repo1-retention-full`` is high so that no backup expires inside a timed run)."""
        self.run("expire", f"--set={label}")

    def info(self) -> dict[str, Any]:
        return json.loads(self.run("info", "--output=json"))[0]  # type: ignore[no-any-return]

    def backup_prefix(self, label: str) -> str:
        return f"{PGBACKREST_REPO_PATH.strip('/')}/backup/{STANZA}/{label}/"


def tool_env() -> dict[str, str]:
    """The environment pgBackRest runs in: without ``$PGBACKREST_BIN``, which it would take for
    an option of its own (``bin``) and warn of on stdout, before ``info``'s JSON."""
    return {k: v for k, v in os.environ.items() if k != PGBACKREST_BIN_ENV}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- CPU of running processes -------------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its reaped children (``/proc/<pid>/stat``)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text.rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return (utime + stime + cutime + cstime) / CLOCK_TICKS


def peak_rss_bytes(pid: int) -> int:
    """``VmHWM`` of ``pid``: the peak resident set size since it started."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")
