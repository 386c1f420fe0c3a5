"""MariaDB server control: find the programs, start and stop a server, run a statement.

The agent starts restored copies with it (``engines.mariadb``), and the local stack builds its
test servers on it (``shardvault.local.mariadb``).

Terms:

* *server*: one ``mariadbd`` on a *data directory*, listening only on a Unix *socket* in a
  directory beside it (``<name>.sock/mariadb.sock``, or under the temp directory where that
  path is too long for a socket; ``skip-networking``, so servers never fight over TCP
  ports), logging to ``<name>.err`` beside it, its process id in ``<data dir>/mariadbd.pid``.
  It starts with ``--no-defaults``: nothing in the host's option files changes a restored
  copy.
* *mysql user*: the OS account servers run as when we are root (``mariadbd --user``); its
  files must be its own. As non-root everything runs as the current user.
* *client*: the ``mariadb`` program as the agent's OS user over the socket, authenticated by
  ``unix_socket`` (Debian's default for ``root``; on a host, the agent's account is created
  ``IDENTIFIED VIA unix_socket``): no password exists anywhere.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shardvault_agent.engines.serveruser import (
    SOCKET_PATH_MAX,
    as_root,
    ensure_traversable,
    give_to,
)

MARIADB_USER = "mysql"
START_TIMEOUT = 120
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])


class MariadbNotFound(RuntimeError):
    """No MariaDB programs: the message says the fix."""

    def __init__(self, program: str) -> None:
        super().__init__(
            f"MariaDB's {program} not found. Fix: run scripts/setup.sh, or "
            "'apt-get install mariadb-server mariadb-backup'."
        )


def program(name: str) -> str:
    found = shutil.which(name, path=SEARCH_PATH)
    if found is None:
        raise MariadbNotFound(name)
    return found


def give_to_mysql(path: Path) -> None:
    """Makes ``path`` (and everything under it) the mysql user's, when we are root."""
    if as_root():
        for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
            give_to(MARIADB_USER, item)


def client_user() -> str:
    return "root" if as_root() else getpass.getuser()


def run(cmd: list[str], *, timeout: float | None = None, stdin: str | None = None) -> str:
    """Runs a MariaDB program (never through a shell), ``stdin`` on its standard input;
    raises ``RuntimeError`` with what it printed when it fails."""
    done = subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, cwd="/", check=False, timeout=timeout
    )
    if done.returncode != 0:
        output = (done.stderr.strip() or done.stdout.strip())[-2000:]
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {done.returncode}: {output}")
    return done.stdout


def socket_for(data_dir: Path) -> Path:
    """``<data dir>.sock/mariadb.sock`` beside the data directory; where that path is too long
    for a socket, a directory under the temp directory named after the data directory's path
    (so the same data directory always has the same socket, and ``serving`` finds it)."""
    socket = data_dir.with_name(f"{data_dir.name}.sock") / "mariadb.sock"
    if len(os.fsencode(socket)) <= SOCKET_PATH_MAX:
        return socket
    digest = hashlib.sha256(os.fsencode(data_dir.absolute())).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"shardvault-mariadb-{digest}" / "mariadb.sock"


@dataclass
class MariadbServer:
    """A MariaDB server on a Unix socket."""

    data_dir: Path
    socket: Path
    options: tuple[str, ...] = ()  # more server options (a test server's binary logging)

    @property
    def log_path(self) -> Path:
        return self.data_dir.with_name(f"{self.data_dir.name}.err")

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "mariadbd.pid"

    def client_args(self) -> list[str]:
        return ["--no-defaults", f"--socket={self.socket}", f"--user={client_user()}"]

    def sql(self, statements: str, database: str | None = None) -> str:
        """Runs statements, given on the client's standard input (never its command line,
        which any local user can read); returns the rows tab-separated, one a line."""
        cmd = [program("mariadb"), *self.client_args(), "--batch", "--skip-column-names"]
        return run([*cmd, *([database] if database else [])], stdin=statements).strip()

    def backup_command(self, *options: str) -> list[str]:
        """``mariabackup --backup`` of this server, connected as the client is; ``options``
        say where the copy goes (``--target-dir``, ``--stream``) and how."""
        command = [program("mariabackup"), "--no-defaults", "--backup", *options]
        return [*command, f"--socket={self.socket}", f"--user={client_user()}",
                f"--datadir={self.data_dir}"]  # fmt: skip

    def answers(self) -> bool:
        ping = [program("mariadb-admin"), *self.client_args(), "--silent", "ping"]
        return subprocess.run(ping, capture_output=True, cwd="/", check=False).returncode == 0

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Starts the server (as the mysql user when root) and waits until it answers; a
        server that exits first raises ``RuntimeError`` with its log's last lines."""
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        ensure_traversable(self.socket.parent, MARIADB_USER)
        ensure_traversable(self.data_dir, MARIADB_USER)
        self.log_path.touch()
        for path in (self.data_dir, self.socket.parent, self.log_path):
            give_to_mysql(path)
        cmd = [
            program("mariadbd"),
            "--no-defaults",
            f"--datadir={self.data_dir}",
            f"--socket={self.socket}",
            "--skip-networking",
            f"--pid-file={self.pid_file}",
            f"--log-error={self.log_path}",
            "--innodb-buffer-pool-size=64M",
            *([f"--user={MARIADB_USER}"] if as_root() else []),
            *self.options,
        ]
        # A session of its own: the server outlives the agent that started it, as a server
        # that pg_ctl starts does.
        server = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while not self.answers():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"MariaDB on {self.data_dir} did not start. Server log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def running_pid(data_dir: Path) -> int | None:
    """The process id of the server running from ``data_dir``; None when none runs."""
    try:
        pid = int((data_dir / "mariadbd.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's (the server's)
    return pid if not zombie(pid) else None


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def stop_server(data_dir: Path, *, immediate: bool = False, timeout: float = 60) -> None:
    """Stops the server running from ``data_dir`` (SIGTERM: a clean shutdown; ``immediate``:
    SIGKILL, InnoDB recovers at the next start), and removes its socket's directory if that
    is one of ours under the temp directory; a no-op when none runs."""
    pid = running_pid(data_dir)
    if pid is not None:
        os.kill(pid, signal.SIGKILL if immediate else signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while running_pid(data_dir) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
    socket = socket_for(data_dir)
    if socket.parent.name.startswith("shardvault-mariadb-"):
        shutil.rmtree(socket.parent, ignore_errors=True)
