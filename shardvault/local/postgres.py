"""PostgreSQL instances for the demo and the tests: real servers on Unix sockets.

The server control itself (finding the programs, starting, stopping, reaching a server) is
the agent's, which starts restored copies with it: ``shardvault_agent.engines.postgres.server``
(its docstring defines *bin dir*, *instance*, *socket only* and *postgres user*). This module
adds what only the demo and the tests do: create instances (``initdb``) with
``listen_addresses = ''`` (so instances never fight over TCP ports) and put pgbench load on
them. The server-control names are re-exported for them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from shardvault_agent.engines.postgres.server import (
    PG_USER,
    PostgresInstance,
    PostgresNotFound,
    conf_value,
    ensure_traversable,
    find_pg_bin_dir,
    give_to_postgres,
    make_dirs,
    prepare_files,
    run_as_postgres,
    run_program,
    stop_server,
)
from shardvault_agent.engines.postgres.server import attach_instance as attach_on_port

from shardvault.local.ports import free_port

__all__ = [
    "PG_USER",
    "PostgresInstance",
    "PostgresNotFound",
    "attach_instance",
    "find_pg_bin_dir",
    "give_to_postgres",
    "init_instance",
    "pgbench_init",
    "restored_instance",
    "run_as_postgres",
    "start_pgbench",
    "stop_process",
    "stop_server",
]

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


def init_instance(
    data_dir: Path, *, port: int | None = None, settings: dict[str, str] | None = None
) -> PostgresInstance:
    """``initdb --data-checksums`` into ``data_dir`` (absent or empty), configure, start.

    ``settings`` override :data:`DEFAULT_SETTINGS`; values are written to postgresql.conf
    verbatim when already quoted or a plain word/number (``128MB``), else quoted.
    """
    bin_dir = find_pg_bin_dir()
    data_dir = data_dir.absolute()
    created = make_dirs(data_dir)
    ensure_traversable(data_dir, created)
    data_dir.chmod(0o700)
    give_to_postgres(data_dir)
    instance = prepare_files(data_dir, port or free_port(), bin_dir)
    # --no-locale: the host's LANG may name a locale that is not generated (minimal images).
    initdb = [str(bin_dir / "initdb"), "-D", str(data_dir), "--data-checksums", "-A", "trust"]
    initdb += ["-U", "postgres", "--no-locale", "-E", "UTF8", "--no-instructions"]
    run_program(initdb, as_server_user=True)
    conf = {
        **DEFAULT_SETTINGS,
        "port": str(instance.port),
        "unix_socket_directories": str(instance.socket_dir),
        **(settings or {}),
    }
    # Appended to postgresql.conf (the last occurrence wins), so ALTER SYSTEM still overrides.
    with open(data_dir / "postgresql.conf", "a") as out:
        out.write("\n# shardvault local instance\n")
        out.writelines(f"{key} = {conf_value(value)}\n" for key, value in conf.items())
    instance.start()
    return instance


def attach_instance(data_dir: Path, *, port: int | None = None) -> PostgresInstance:
    """Starts a server on an existing data directory (a restored copy), on ``port`` or a
    free one."""
    return attach_on_port(data_dir, port=port or free_port())


def restored_instance(shard: dict[str, Any]) -> PostgresInstance:
    """The server a restore started for a shard (from the shard's entry in its summary)."""
    path = Path(shard["path"])
    socket_dir, log_path = Path(shard["socket_dir"]), path.with_name(f"{path.name}.log")
    return PostgresInstance(path, shard["port"], socket_dir, find_pg_bin_dir(), log_path)


# --- load -------------------------------------------------------------------------------------
def pgbench_init(instance: PostgresInstance, scale: int, dbname: str = "postgres") -> None:
    """``pgbench -i -s scale``: the TPC-B-like tables, 100,000 accounts per scale unit."""
    pgbench = str(instance.bin_dir / "pgbench")
    run_program([pgbench, "-i", "-s", str(scale), "-q", *instance._client_args(), dbname])


def start_pgbench(
    instance: PostgresInstance,
    *,
    clients: int = 2,
    jobs: int = 1,
    seconds: int = 60,
    dbname: str = "postgres",
    rate: int | None = None,
) -> subprocess.Popen:
    """A write load (TPC-B-like) for ``seconds``; the caller stops it with :func:`stop_process`.
    ``rate`` caps it at that many transactions a second (``pgbench -R``); without it pgbench
    runs as fast as the machine lets it.

    Output goes to a pipe read at the end: without progress reports pgbench prints only its
    summary and per-client errors, far below what would fill the pipe and block it.
    """
    cmd = [str(instance.bin_dir / "pgbench"), "-c", str(clients), "-j", str(jobs)]
    cmd += ["-T", str(seconds), "-n", *instance._client_args(), dbname]
    if rate is not None:
        cmd[1:1] = ["-R", str(rate)]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/"
    )


def stop_process(process: subprocess.Popen, timeout: float = 10) -> str:
    """SIGTERM, SIGKILL after ``timeout`` seconds; returns what the process printed."""
    if process.poll() is None:
        process.terminate()
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    return out or ""
