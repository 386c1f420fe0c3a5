"""A MinIO server for the local stack and the tests: real S3 semantics on loopback.

MinIO is built from source at a pinned version (``scripts/setup.sh``); this module finds the
binary and runs it on a free port with fresh root credentials per start.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shardvault.local.ports import free_port

PINNED = "github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"


class MinioNotFound(RuntimeError):
    def __init__(self, message: str = "MinIO binary not found.") -> None:
        super().__init__(
            f"{message} Fix: run scripts/setup.sh, or 'GOFLAGS=-mod=mod go install {PINNED}', "
            "or set SHARDVAULT_MINIO_BIN to the binary."
        )


def find_minio_binary() -> Path | None:
    candidates = [os.environ.get("SHARDVAULT_MINIO_BIN"), shutil.which("minio")]
    gopath = os.environ.get("GOPATH") or str(Path.home() / "go")
    candidates.append(str(Path(gopath) / "bin" / "minio"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


@dataclass
class MinioServer:
    endpoint: str
    access_key: str
    secret_key: str
    data_dir: Path
    process: subprocess.Popen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> MinioServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_minio(
    data_dir: Path,
    *,
    port: int | None = None,
    access_key: str = "shardvault",
    secret_key: str | None = None,
    log_path: Path | None = None,
    timeout: float = 30.0,
) -> MinioServer:
    binary = find_minio_binary()
    if binary is None:
        raise MinioNotFound()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    secret_key = secret_key or secrets.token_hex(16)
    log_path = log_path or data_dir.parent / "minio.log"
    env = {**os.environ, "MINIO_ROOT_USER": access_key, "MINIO_ROOT_PASSWORD": secret_key}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [
                str(binary),
                "server",
                str(data_dir),
                "--address",
                f"127.0.0.1:{port}",
                "--console-address",
                f"127.0.0.1:{free_port()}",
                "--quiet",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = MinioServer(f"http://127.0.0.1:{port}", access_key, secret_key, data_dir, process)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{server.endpoint}/minio/health/ready", timeout=1) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    server.stop()
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise RuntimeError(f"MinIO did not become ready on port {port}:\n{tail}")
