"""PostgreSQL server control: find the server programs, start, stop and reach a server.

The agent starts restored copies with it (``engines.postgres_restore``), and the local stack
builds its demo and test instances on it (``shardvault.local.postgres``).

Terms:

* *bin dir*: the directory of the server programs (``initdb``, ``pg_ctl``, ``psql``,
  ``pgbench``), e.g. ``/usr/lib/postgresql/15/bin``; found by :func:`find_pg_bin_dir`.
* *instance*: one server: a *data directory* (PGDATA), a port, a *socket directory* and a log
  file. The socket directory and the log sit beside the data directory (``<name>.sock``,
  ``<name>.log``) so that the data directory holds nothing but PostgreSQL's own files.
* *socket only*: clients connect through ``<socket dir>/.s.PGSQL.<port>``; the port is
  passed on the command line (``-p``, ``-k``) so a restored copy never takes its source's.
* *postgres user*: the OS account servers run as when we are root, because ``initdb`` and
  ``pg_ctl`` refuse to run as root. It must be able to *traverse* (search, ``x``) every
  ancestor of the data directory; as non-root everything runs as the current user.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardvault_agent.engines import serveruser
from shardvault_agent.engines.serveruser import (
    SOCKET_PATH_MAX,
    NotTraversable,
    ServerUserMissing,
    as_root,
    make_dirs,
    user_ids,
)

BIN_ENV = "SHARDVAULT_PG_BIN"
PG_USER = "postgres"
PG_ROOT = Path("/usr/lib/postgresql")
START_TIMEOUT = 120
SOCKET_NAME_MAX = len("/.s.PGSQL.65535")


class PostgresNotFound(RuntimeError):
    """No PostgreSQL server programs (or no postgres OS user): the message says the fix."""

    def __init__(self, message: str = "PostgreSQL server binaries not found.") -> None:
        super().__init__(
            f"{message} Fix: run scripts/setup.sh, or 'apt-get install postgresql-15', "
            f"or set {BIN_ENV} to the directory holding initdb."
        )


PostgresPermissionError = NotTraversable  # the postgres OS user cannot reach a directory


class PostgresCommandError(subprocess.CalledProcessError):
    """A PostgreSQL program failed; unlike its base class, ``str()`` shows what it printed."""

    def __str__(self) -> str:
        output = "\n".join(
            part.strip() for part in (self.stderr, self.output) if isinstance(part, str) and part
        )
        return f"{shlex.join(map(str, self.cmd))} exited with {self.returncode}:\n{output}"


# --- finding things ---------------------------------------------------------------------------
def _has_initdb(directory: Path) -> bool:
    return (directory / "initdb").is_file()


def _version_key(bin_dir: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", bin_dir.parent.name)) or (0,)


def find_pg_bin_dir() -> Path:
    """``$SHARDVAULT_PG_BIN``, else ``pg_config --bindir``, else the newest Debian install."""
    explicit = os.environ.get(BIN_ENV)
    if explicit:
        if _has_initdb(Path(explicit)):
            return Path(explicit)
        raise PostgresNotFound(f"{BIN_ENV}={explicit} has no initdb.")
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            bindir = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            bindir = ""
        # Debian's pg_config comes with libpq-dev: its bindir may hold only client programs.
        if bindir and _has_initdb(Path(bindir)):
            return Path(bindir)
    installed = sorted((d for d in PG_ROOT.glob("*/bin") if _has_initdb(d)), key=_version_key)
    if installed:
        return installed[-1]
    raise PostgresNotFound(f"PostgreSQL server binaries not found (no initdb under {PG_ROOT}).")


# --- running as the postgres user -------------------------------------------------------------
def run_as_postgres(cmd: list[str]) -> list[str]:
    """``cmd`` prefixed with ``runuser -u postgres --`` when running as root."""
    return ["runuser", "-u", PG_USER, "--", *cmd] if as_root() else list(cmd)


def run_program(cmd: list[str], *, as_server_user: bool = False) -> str:
    """Runs a PostgreSQL program; raises :class:`PostgresCommandError` with its output."""
    full = run_as_postgres(cmd) if as_server_user else cmd
    # cwd "/": PostgreSQL programs call getcwd() at start, which fails for the postgres user
    # in root's 0700 home ("could not identify current directory").
    result = subprocess.run(full, capture_output=True, text=True, cwd="/", check=False)
    if result.returncode != 0:
        raise PostgresCommandError(result.returncode, full, result.stdout, result.stderr)
    return result.stdout


def postgres_ids() -> tuple[int, int, set[int]]:
    """uid, primary gid and all group ids of the postgres user."""
    try:
        return user_ids(PG_USER)
    except ServerUserMissing:
        raise PostgresNotFound(
            f"There is no '{PG_USER}' OS user to run servers as (we are root)."
        ) from None


def give_to_postgres(path: Path) -> None:
    if as_root():
        uid, gid, _ = postgres_ids()
        os.chown(path, uid, gid)


def ensure_traversable(path: Path, created: frozenset[Path] = frozenset()) -> None:
    """Makes sure the postgres user can reach ``path`` (``serveruser.ensure_traversable``)."""
    postgres_ids()  # a missing user is PostgresNotFound, with its fix
    serveruser.ensure_traversable(path, PG_USER, created)


# --- instances --------------------------------------------------------------------------------
def conninfo_value(value: str) -> str:
    if value and not re.search(r"[\s'\\]", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def conf_value(value: str) -> str:
    """A postgresql.conf value: verbatim if quoted or a plain word/number, else quoted."""
    if value.startswith("'") or re.fullmatch(r"[A-Za-z0-9_.+-]+", value):
        return value
    return "'" + value.replace("'", "''") + "'"


@dataclass
class PostgresInstance:
    """A PostgreSQL server on a Unix socket; :meth:`stop` it (or use it as a context manager)."""

    data_dir: Path
    port: int
    socket_dir: Path
    bin_dir: Path
    log_path: Path

    def conninfo_for(self, dbname: str = "postgres") -> str:
        """A libpq conninfo string for ``dbname`` as the ``postgres`` role."""
        return (
            f"host={conninfo_value(str(self.socket_dir))} port={self.port} "
            f"user=postgres dbname={conninfo_value(dbname)}"
        )

    @property
    def conninfo(self) -> str:
        return self.conninfo_for("postgres")

    def _client_args(self) -> list[str]:
        return ["-h", str(self.socket_dir), "-p", str(self.port), "-U", "postgres"]

    def _pg_ctl(self, *args: str) -> str:
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args]
        return run_program(cmd, as_server_user=True)

    def start(self, timeout: int = START_TIMEOUT) -> None:
        """Starts the server (a no-op if it runs) and waits until it accepts connections."""
        if self.is_running():
            return
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        give_to_postgres(self.socket_dir)
        # -p/-k on the command line: a restored copy keeps its source's settings otherwise.
        options = f"-p {self.port} -k {shlex.quote(str(self.socket_dir))}"
        try:
            self._pg_ctl("-l", str(self.log_path), "-w", "-t", str(timeout), "-o", options, "start")
        except PostgresCommandError as error:
            raise RuntimeError(f"{error}\nServer log {self.log_path}:\n{self.log_tail()}") from None
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Polls ``pg_isready`` until the server accepts connections; a server that stopped
        meanwhile (a restored copy whose recovery ended before its target exits right after
        it first accepts connections) is said at once, not after ``timeout``."""
        cmd = [str(self.bin_dir / "pg_isready"), "-q", *self._client_args()]
        deadline = time.monotonic() + timeout
        while subprocess.run(cmd, cwd="/", check=False).returncode != 0:
            if not self.is_running():
                time.sleep(0.5)  # its last lines are written as it exits
                raise RuntimeError(
                    f"PostgreSQL on {self.socket_dir} port {self.port} stopped while it "
                    f"started. Server log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"PostgreSQL on {self.socket_dir} port {self.port} not ready after "
                    f"{timeout}s. Server log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode`` (smart, fast or immediate); a no-op if it is not running."""
        if self.is_running():
            self._pg_ctl("-w", "-m", mode, "stop")

    def is_running(self) -> bool:
        # pg_ctl status checks the postmaster PID, so a stale postmaster.pid does not count.
        cmd = run_as_postgres([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "status"])
        return subprocess.run(cmd, capture_output=True, cwd="/", check=False).returncode == 0

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Runs ``sql`` with ``psql -At``; returns its output, stripped (``a|b`` per row)."""
        cmd = [
            str(self.bin_dir / "psql"),
            "-X",
            "-A",
            "-t",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            self.conninfo_for(dbname),
            "-c",
            sql,
        ]
        return run_program(cmd).strip()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> PostgresInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def beside(data_dir: Path) -> tuple[Path, Path]:
    """The socket directory and the log a server keeps beside its data directory."""
    return data_dir.with_name(f"{data_dir.name}.sock"), data_dir.with_name(f"{data_dir.name}.log")


def socket_dir_for(data_dir: Path) -> Path:
    """``<data dir>.sock`` beside the data directory, or a short temp dir if that is too long."""
    socket_dir, _ = beside(data_dir)
    if len(os.fsencode(socket_dir)) + SOCKET_NAME_MAX <= SOCKET_PATH_MAX:
        return socket_dir
    return Path(tempfile.mkdtemp(prefix="shardvault-pg-"))


def prepare_files(data_dir: Path, port: int, bin_dir: Path) -> PostgresInstance:
    """Socket dir and log beside ``data_dir``, all reachable and owned by the postgres user."""
    socket_dir = socket_dir_for(data_dir)
    created = make_dirs(socket_dir)
    ensure_traversable(socket_dir, created)
    give_to_postgres(socket_dir)
    _, log_path = beside(data_dir)
    log_path.touch()
    give_to_postgres(log_path)
    return PostgresInstance(data_dir, port, socket_dir, bin_dir, log_path)


def attach_instance(
    data_dir: Path, *, port: int, tablespaces: Sequence[Path] = ()
) -> PostgresInstance:
    """Starts a server on an existing data directory (a restored copy), on its own port;
    ``tablespaces``: the directories its tablespaces' links lead to, given to the server's
    user with it (a walk does not follow the links)."""
    bin_dir = find_pg_bin_dir()
    data_dir = data_dir.absolute()
    for directory in [data_dir, *tablespaces]:
        ensure_traversable(directory)
        if as_root():
            uid, gid, _ = postgres_ids()
            for path in [directory, *directory.rglob("*")]:
                os.chown(path, uid, gid, follow_symlinks=False)
        directory.chmod(0o700)  # the server refuses a group/world-accessible data directory
    instance = prepare_files(data_dir, port, bin_dir)
    instance.start()
    return instance


def stop_server(data_dir: Path, mode: str = "fast") -> None:
    """Stops whatever server runs on ``data_dir`` (a no-op when none does)."""
    if not (data_dir / "postmaster.pid").exists():
        return
    pg_ctl = str(find_pg_bin_dir() / "pg_ctl")
    subprocess.run(
        run_as_postgres([pg_ctl, "-D", str(data_dir), "-m", mode, "-w", "stop"]),
        capture_output=True,
        check=False,
        cwd="/",
    )
