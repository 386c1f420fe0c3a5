"""A MinIO server for the local stack and the tests: real S3 semantics on loopback.

Terms:

* *binary*: the ``minio`` executable, built from source at a pinned version by
  ``scripts/setup.sh`` (``go install``), found by :func:`find_minio_binary`.
* *server*: one ``minio server`` process serving one *data directory* (a single drive) on
  ``127.0.0.1:<port>``, with its web console on a second loopback port.
* *root credentials*: the server's only account (``MINIO_ROOT_USER``/``MINIO_ROOT_PASSWORD``).
  The secret key is fresh per start unless given, and is never written to logs or reprs.
* *ready*: ``GET /minio/health/ready`` answers 200, i.e. the server accepts S3 requests.

MinIO dies with the process that started it (``processes.die_with_parent``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from shardvault.local.ports import free_port
from shardvault.local.processes import (
    ServerStartError,
    die_with_parent,
    go_binary,
    start_on_port,
    stop_child,
    why_missing,
)

PINNED_MODULE = "github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
INSTALL_COMMAND = f"GOFLAGS=-mod=mod go install {PINNED_MODULE}"
BINARY_ENV = "SHARDVAULT_MINIO_BIN"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class MinioNotFound(RuntimeError):
    """No MinIO binary: the message says how to get one."""

    def __init__(self, message: str = "MinIO binary not found.") -> None:
        super().__init__(
            f"{message} Fix: run scripts/setup.sh (it builds MinIO), or run "
            f"'{INSTALL_COMMAND}', or set {BINARY_ENV} to a minio executable."
        )


class MinioStartError(RuntimeError):
    """The server exited or did not become ready; the message carries its log tail."""


def find_minio_binary() -> Path | None:
    """``$SHARDVAULT_MINIO_BIN``, else ``minio`` on PATH, else the one ``go install`` built."""
    return go_binary("minio", BINARY_ENV)


def require_minio_binary() -> Path:
    """The binary, or :class:`MinioNotFound` saying what was looked at."""
    binary = find_minio_binary()
    if binary is None:
        raise MinioNotFound(why_missing("MinIO binary", "minio", BINARY_ENV))
    return binary


@dataclass
class MinioServer:
    """A running ``minio server``; :meth:`stop` it (or use it as a context manager)."""

    endpoint: str
    access_key: str
    secret_key: str = field(repr=False)
    data_dir: Path
    process: subprocess.Popen = field(repr=False)
    log_path: Path | None = None

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def is_running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then SIGKILL if MinIO has not exited within ``timeout`` seconds."""
        stop_child(self.process, timeout)

    def __enter__(self) -> MinioServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(
    binary: Path,
    data_dir: Path,
    port: int,
    env: dict[str, str],
    certs_dir: Path | None,
    log_path: Path,
) -> subprocess.Popen:
    console_port = free_port()
    while console_port == port:
        console_port = free_port()
    cmd = [
        str(binary),
        "server",
        str(data_dir),
        "--address",
        f"127.0.0.1:{port}",
        "--console-address",
        f"127.0.0.1:{console_port}",
        "--quiet",
    ]
    if certs_dir is not None:
        cmd += ["--certs-dir", str(certs_dir)]
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - only prctl runs before exec
        )


def start_minio(
    data_dir: Path,
    *,
    port: int | None = None,
    access_key: str = "shardvault",
    secret_key: str | None = None,
    certs_dir: Path | None = None,
    log_path: Path | None = None,
    timeout: float = READY_TIMEOUT,
) -> MinioServer:
    """Start ``minio server data_dir`` on loopback and return once it is ready.

    ``port``: fixed S3 port, else a free one (retried if another process wins it).
    ``secret_key``: fresh random per start unless given.
    ``certs_dir``: MinIO's ``--certs-dir``; with a ``public.crt`` in it the endpoint is https.
    ``log_path``: server output (appended); default ``<data_dir>.log`` beside the data dir.
    """
    binary = require_minio_binary()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or data_dir.with_name(f"{data_dir.name}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    secret_key = secret_key or secrets.token_hex(20)
    env = {**os.environ, "MINIO_ROOT_USER": access_key, "MINIO_ROOT_PASSWORD": secret_key}
    https = certs_dir is not None and (certs_dir / "public.crt").is_file()
    scheme = "https" if https else "http"

    def endpoint(chosen: int) -> str:
        return f"{scheme}://127.0.0.1:{chosen}"

    try:
        process, chosen = start_on_port(
            f"MinIO ({binary})",
            lambda p: _spawn(binary, data_dir, p, env, certs_dir, log_path),
            lambda p: f"{endpoint(p)}/minio/health/ready",
            log_path,
            port,
            timeout,
        )
    except ServerStartError as error:
        raise MinioStartError(str(error)) from None
    return MinioServer(endpoint(chosen), access_key, secret_key, data_dir, process, log_path)
