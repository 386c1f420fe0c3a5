"""A Google Cloud Storage server for the tests and the local stack: ``fake-gcs-server``.

Terms:

* *binary*: the ``fake-gcs-server`` executable, built from source at a pinned version by
  ``scripts/setup.sh`` (``go install``), as MinIO is; found by :func:`find_fake_gcs_binary`.
* *server*: one process serving GCS's JSON API over plain HTTP on ``127.0.0.1:<port>``, its
  buckets and objects in memory (they go with the process).
* *ready*: ``GET /_internal/healthcheck`` answers 200.

The official client (``google-cloud-storage``) reaches it at :attr:`FakeGcsServer.endpoint`
with anonymous credentials: the fake checks none. It dies with the process that started it
(``processes.die_with_parent``).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from shardvault.local.processes import (
    ServerStartError,
    die_with_parent,
    go_binary,
    start_on_port,
    stop_child,
    why_missing,
)

PINNED_MODULE = "github.com/fsouza/fake-gcs-server@v1.56.1"
INSTALL_COMMAND = f"GOFLAGS=-mod=mod go install {PINNED_MODULE}"
BINARY_ENV = "SHARDVAULT_FAKE_GCS_BIN"
BINARY_NAME = "fake-gcs-server"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class FakeGcsNotFound(RuntimeError):
    """No fake-gcs-server binary: the message says how to get one."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message} Fix: run scripts/setup.sh (it builds it), or run "
            f"'{INSTALL_COMMAND}', or set {BINARY_ENV} to a fake-gcs-server executable."
        )


class FakeGcsStartError(RuntimeError):
    """The server exited or did not become ready; the message carries its log tail."""


def find_fake_gcs_binary() -> Path | None:
    """``$SHARDVAULT_FAKE_GCS_BIN``, else ``fake-gcs-server`` on PATH, else the one ``go
    install`` built."""
    return go_binary(BINARY_NAME, BINARY_ENV)


def require_fake_gcs_binary() -> Path:
    """The binary, or :class:`FakeGcsNotFound` saying what was looked at."""
    binary = find_fake_gcs_binary()
    if binary is None:
        raise FakeGcsNotFound(why_missing(BINARY_NAME, BINARY_NAME, BINARY_ENV))
    return binary


def endpoint(port: int) -> str:
    """Where the server on ``port`` answers (the client's ``api_endpoint``)."""
    return f"http://127.0.0.1:{port}"


@dataclass
class FakeGcsServer:
    """A running fake-gcs-server; :meth:`stop` it (or use it as a context manager)."""

    endpoint: str  # http://127.0.0.1:<port>, the client's api_endpoint
    process: subprocess.Popen = field(repr=False)
    log_path: Path

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        stop_child(self.process, timeout)

    def __enter__(self) -> FakeGcsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(binary: Path, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [
        str(binary),
        "-scheme", "http",
        "-host", "127.0.0.1",
        "-port", str(port),
        "-backend", "memory",
        # Object links (mediaLink) name this address, not the default 0.0.0.0.
        "-external-url", endpoint(port),
        "-public-host", f"127.0.0.1:{port}",
        "-log-level", "warn",
    ]  # fmt: skip
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - only prctl runs before exec
        )


def start_fake_gcs(
    log_path: Path, *, port: int | None = None, timeout: float = READY_TIMEOUT
) -> FakeGcsServer:
    """Starts fake-gcs-server on loopback and returns once it is ready. ``port``: fixed, else
    a free one (retried if another process wins it). ``log_path``: its output, appended."""
    binary = require_fake_gcs_binary()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        process, chosen = start_on_port(
            f"{BINARY_NAME} ({binary})",
            lambda p: _spawn(binary, p, log_path),
            lambda p: f"{endpoint(p)}/_internal/healthcheck",
            log_path,
            port,
            timeout,
        )
    except ServerStartError as error:
        raise FakeGcsStartError(str(error)) from None
    return FakeGcsServer(endpoint(chosen), process, log_path)
