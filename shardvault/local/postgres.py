"""PostgreSQL instances for the demo and the tests: real servers on Unix sockets.

``initdb`` refuses to run as root, and these machines run as root: instances then run as the
``postgres`` OS user (``runuser``) in directories it owns, under a path it can traverse.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shardvault.local.ports import free_port

DEFAULT_SETTINGS = {
    "listen_addresses": "''",
    "wal_level": "replica",
    "max_wal_senders": "10",
    "max_replication_slots": "20",
    "shared_buffers": "128MB",
    "max_wal_size": "1GB",
    "full_page_writes": "on",
    "fsync": "on",
}


class PostgresNotFound(RuntimeError):
    def __init__(self) -> None:
        super().__init__(
            "PostgreSQL server binaries not found. Fix: apt-get install postgresql-15 "
            "(scripts/setup.sh does it), or set SHARDVAULT_PG_BIN to the bin directory."
        )


def find_pg_bin_dir() -> Path:
    explicit = os.environ.get("SHARDVAULT_PG_BIN")
    candidates = [Path(explicit)] if explicit else []
    candidates += sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True
    )
    for candidate in candidates:
        if (candidate / "initdb").exists():
            return candidate
    raise PostgresNotFound()


def as_postgres(cmd: list[str]) -> list[str]:
    """Prefixes ``runuser -u postgres --`` when running as root."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def own(path: Path) -> None:
    """Makes ``path`` owned by postgres (as root) and every parent traversable."""
    if os.geteuid() != 0:
        return
    shutil.chown(path, "postgres", "postgres")
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


@dataclass
class PostgresInstance:
    data_dir: Path
    port: int
    socket_dir: Path
    bin_dir: Path
    log_path: Path

    @property
    def conninfo(self) -> str:
        return f"host={self.socket_dir} port={self.port} user=postgres dbname=postgres"

    def _ctl(self, *args: str) -> None:
        cmd = [
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            *args,
        ]
        subprocess.run(as_postgres(cmd), check=True, capture_output=True)

    def start(self) -> None:
        self._ctl("-w", "-t", "120", "-o", f"-p {self.port} -k {self.socket_dir}", "start")

    def stop(self, mode: str = "fast") -> None:
        if self.is_running():
            self._ctl("-w", "-m", mode, "stop")

    def is_running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        cmd = [
            str(self.bin_dir / "psql"),
            "-h",
            str(self.socket_dir),
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            dbname,
            "-XAtqc",
            sql,
        ]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()

    def __enter__(self) -> PostgresInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def init_instance(
    base: Path, *, port: int | None = None, settings: dict[str, str] | None = None
) -> PostgresInstance:
    """``initdb --data-checksums`` under ``base`` and start the server."""
    bin_dir = find_pg_bin_dir()
    base.mkdir(parents=True, exist_ok=True)
    own(base)
    data_dir, socket_dir = base / "data", base / "run"
    socket_dir.mkdir(exist_ok=True)
    own(socket_dir)
    subprocess.run(
        as_postgres(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data_dir),
                "--data-checksums",
                "-A",
                "trust",
                "-U",
                "postgres",
            ]
        ),
        check=True,
        capture_output=True,
    )
    conf = {**DEFAULT_SETTINGS, **(settings or {})}
    with open(data_dir / "postgresql.auto.conf", "a") as out:
        out.writelines(f"{k} = {v}\n" for k, v in conf.items())
    instance = PostgresInstance(
        data_dir, port or free_port(), socket_dir, bin_dir, base / "postgres.log"
    )
    log = instance.log_path
    log.touch()
    own(log)
    instance.start()
    return instance


def attach_instance(data_dir: Path, *, port: int | None = None) -> PostgresInstance:
    """Starts a server on an existing data directory (a restored copy), on its own port."""
    bin_dir = find_pg_bin_dir()
    base = data_dir.parent
    socket_dir = base / "run"
    socket_dir.mkdir(exist_ok=True)
    for path in [data_dir, *data_dir.rglob("*"), socket_dir]:
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")
    own(base)
    data_dir.chmod(0o700)
    instance = PostgresInstance(
        data_dir, port or free_port(), socket_dir, bin_dir, base / "postgres.log"
    )
    instance.log_path.touch()
    own(instance.log_path)
    instance.start()
    return instance


def pgbench_init(instance: PostgresInstance, scale: int, dbname: str = "postgres") -> None:
    cmd = [
        str(instance.bin_dir / "pgbench"),
        "-i",
        "-s",
        str(scale),
        "-q",
        "-h",
        str(instance.socket_dir),
        "-p",
        str(instance.port),
        "-U",
        "postgres",
        dbname,
    ]
    subprocess.run(cmd, check=True, capture_output=True)


def start_pgbench(
    instance: PostgresInstance,
    *,
    clients: int = 2,
    jobs: int = 1,
    seconds: int = 60,
    dbname: str = "postgres",
) -> subprocess.Popen:
    """A write load (TPC-B-like); the caller stops it with ``stop_process``."""
    cmd = [
        str(instance.bin_dir / "pgbench"),
        "-c",
        str(clients),
        "-j",
        str(jobs),
        "-T",
        str(seconds),
        "-n",
        "-h",
        str(instance.socket_dir),
        "-p",
        str(instance.port),
        "-U",
        "postgres",
        dbname,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_process(process: subprocess.Popen, timeout: float = 10) -> str:
    if process.poll() is None:
        process.terminate()
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    return out or ""
