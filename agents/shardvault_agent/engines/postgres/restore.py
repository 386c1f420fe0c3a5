"""PostgreSQL restores: a restored data directory becomes a recovered, checked server.

Terms:
- *recovery to the cut*: a backup with a cluster restore point
  (``shardvault.contracts.cut``) replays its tail's WAL to that point and promotes; without
  one, crash recovery replays the tail to its end (past the end point the backup label names).
- *recovery to a target*: a point-in-time restore (``shardvault.wal.pitr``) replays the WAL
  archive's batches, fed to its ``restore_command`` as it replays (``restore.walfeed``), to
  a time, an LSN, a restore point, or the archive's end.
- *served copy*: a restored copy's server runs from the shard's directory on a port of the
  agent's ``restore_ports``; its ``postmaster.pid`` names the port.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import socket
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from shardvault.contracts.pgwal import LSN, check_restore_point_name
from shardvault.contracts.wal_archive import WAL_DIR
from shardvault.errors import (
    RestoreValidationFailed,
    ShardVaultError,
    TargetOutOfRange,
    TargetTooSmall,
)
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.base import Finishing
from shardvault_agent.engines.postgres import tablespaces
from shardvault_agent.engines.postgres.checks import postgres_checks
from shardvault_agent.engines.postgres.server import attach_instance
from shardvault_agent.restore.walfeed import ASKED, FAILED, PLANNED, POLL_SECONDS, STOPPED

log = logging.getLogger("shardvault.agent.restore")


def finish(config: AgentConfig, job: Finishing) -> dict[str, Any]:
    """Starts the restored copy on a free port of ``restore_ports``: recovery replays the
    WAL in the backup to the cluster's restore point (``shardvault.contracts.cut``; a backup without
    one: to the end of its tail, past the end point the backup label names), or the archive's
    WAL to a point-in-time target; its tablespaces stay where the node placed them
    (``tablespaces.ready_for_recovery``). Then pg_amcheck on every database and the validation
    queries (``checks``)."""
    root, shard_id = job.root, job.shard_id
    cut = job.layout.get("marker", {}).get("cut_name")
    target = job.layout.get("recovery")  # a point-in-time restore (shardvault.wal.pitr)
    with open(root / "postgresql.auto.conf", "a") as conf:  # read last: it wins
        conf.write(
            "\n# shardvault restore: a copy must not archive its WAL into its source's archive\n"
            "archive_mode = 'off'\n"
        )
        if target is not None:
            conf.write(recovery_to_target(root / WAL_DIR, target))
        elif cut is not None:
            conf.write(recovery_to_cut(check_restore_point_name(cut)))
    if cut is not None or target is not None:
        (root / "recovery.signal").touch()  # targeted recovery, not crash recovery
    created = (target or {}).get("created_links") or {}
    placed = tablespaces.ready_for_recovery(root)
    taken = {s["port"] for s in job.servers_given if "port" in s} | ports_of_servers(root.parent)
    port = free_port_in(config.restore_ports, config.node_id, taken)
    job.note_server({"port": port})
    try:
        instance = attach_instance(root, port=port, tablespaces=placed)
        recovered = promoted(instance, RECOVERY_SECONDS, job.wal_progress)
        if recovered:
            job.wal_done()
        tablespaces.refuse_foreign(root, placed, shard_id)
    except RuntimeError as error:  # the server stopped: its log is in the message
        said = str(error)
        raise (
            short_of_target(said, shard_id, cut, target)
            or tablespaces.creation_reached(said, created, shard_id)
            or did_not_start(said, shard_id)
        ) from None
    # Replayed (a target's archive), or never read (an archived tail's batches' other files):
    # not part of the copy.
    shutil.rmtree(root / WAL_DIR, ignore_errors=True)
    checks = {"recovered": "ok" if recovered else "in recovery"}
    checks |= postgres_checks(
        instance,
        job.validation_queries,
        jobs=config.validation_jobs,
        heapallindexed=job.heapallindexed,
    )
    return {
        "shard_id": shard_id,
        "node_id": config.node_id,
        "path": str(root),
        "port": port,
        "socket_dir": str(instance.socket_dir),
        # The target time, the end of the archive, the cluster's restore point, or (None)
        # the end of the tail's WAL.
        "recovered_to": recovered_to(cut, target),
        "recovery_target": recovery_kind(target),
        "checks": checks,
        "checks_passed": all(v == "ok" for v in checks.values()),
    }


def adoptable(shard_id: str, result: dict[str, Any]) -> dict[str, Any]:
    """The configuration that backs up a restored copy: its data directory, and a
    connection over the socket of the server the restore started (as the ``postgres`` role,
    the one its checks used)."""
    conninfo = f"host={result['socket_dir']} port={result['port']} user=postgres dbname=postgres"
    return {"shard_id": shard_id, "data_dir": result["path"], "conninfo": conninfo}


RECOVERY_SECONDS = 600  # to replay a backup's tail to its restore point, and promote
PROMOTED_POLL_SECONDS = 0.05
PROBE_NAME = "shardvault-restore"  # the session that watches for the promotion


def recovery_to_cut(name: str) -> str:
    """The settings that recover a restored copy to its backup's restore point and open it.
    The tail's WAL is in ``pg_wal`` already; targeted recovery insists on a restore_command,
    so it is given one that finds nothing (PostgreSQL then reads ``pg_wal``)."""
    return (
        "# shardvault restore: recover to the cluster's cut, then open for writes\n"
        f"recovery_target_name = '{name}'\n"
        "recovery_target_action = 'promote'\n"
        "restore_command = 'false'\n"
    )


def recovery_to_target(wal_dir: Path, target: dict[str, Any]) -> str:
    """The settings that replay the archive's WAL (placed in ``wal_dir``) to the target
    (``shardvault.wal.pitr.recovery``: a time, an LSN, a restore point, or none: the archive's
    end), then open the copy. Each value is checked again here before it is written into
    ``postgresql.auto.conf``: a time parsed, an LSN and a name matched whole."""
    lines = [
        "# shardvault restore: replay the archive's WAL, then open for writes\n",
        f"restore_command = '{feed_command(wal_dir)}'\n",
        "recovery_target_timeline = 'latest'\n",
    ]
    setting = recovery_setting(target)
    if setting is not None:
        lines += [f"{setting[0]} = '{setting[1]}'\n", "recovery_target_action = 'promote'\n"]
    return "".join(lines)


# The command's exit status when the feed failed or stopped before the file came: above 125,
# which makes recovery stop with an error. 1 would mean "not in the archive", which ends
# recovery there and, without a target, promotes a copy short of the archive's end.
FEED_FAILED_STATUS = 200


def feed_command(wal_dir: Path) -> str:
    """The ``restore_command`` that waits for the WAL feed (``restore.walfeed``), quoted for
    ``postgresql.conf``: a file the feed does not plan is not in the archive (exit 1 at
    once); one it plans is asked for, waited for, and linked to where PostgreSQL asked for it
    (copied where ``pg_wal`` is on another file system); a failed or stopped feed, or a
    failed copy, stops recovery (``FEED_FAILED_STATUS``). Only this node's directory (quoted
    for the shell, its ``%`` doubled for PostgreSQL) and PostgreSQL's own ``%f`` and ``%p``
    reach the shell, never a request's value."""
    d = shlex.quote(str(wal_dir)).replace("%", "%%")
    fail = FEED_FAILED_STATUS
    script = (
        f'd={d}; f="%f"; [ -e "$d/{PLANNED}/$f" ] || exit 1; : >"$d/{ASKED}/$f"; '
        f'until [ -e "$d/$f" ]; do '
        f'if [ -e "$d/{FAILED}" ] || [ -e "$d/{STOPPED}" ]; then '
        f'[ -e "$d/$f" ] || exit {fail}; fi; sleep {POLL_SECONDS}; done; '
        f'ln "$d/$f" "%p" 2>/dev/null || cp "$d/$f" "%p" || exit {fail}'
    )
    return script.replace("'", "''")


def recovery_setting(target: dict[str, Any]) -> tuple[str, str] | None:
    """The one ``recovery_target_*`` setting of a target, checked; None: the archive's end."""
    if target.get("target_time"):
        return "recovery_target_time", datetime.fromisoformat(target["target_time"]).isoformat()
    if target.get("target_lsn"):
        if not LSN.fullmatch(target["target_lsn"]):
            raise ValueError(f"{target['target_lsn']!r} is not an LSN")
        return "recovery_target_lsn", target["target_lsn"]
    if target.get("target_name"):
        return "recovery_target_name", check_restore_point_name(target["target_name"])
    return None


def recovery_kind(target: dict[str, Any] | None) -> str | None:
    """A point-in-time restore's kind of target (None: none, the backup's own end or cut)."""
    if target is None:
        return None
    setting = recovery_setting(target)
    return setting[0].removeprefix("recovery_target_") if setting else "latest"


def recovered_to(cut: str | None, target: dict[str, Any] | None) -> str | None:
    if target is not None:
        setting = recovery_setting(target)
        return setting[1] if setting else "the end of the WAL archive"
    return cut


def short_of_target(
    log: str, shard_id: str, cut: str | None, target: dict[str, Any] | None
) -> ShardVaultError | None:
    """The named error for a server that stopped because its WAL ended before its target
    (PostgreSQL says so in its log, then exits); None for any other failure."""
    if "recovery ended before configured recovery target was reached" not in log:
        return None
    if target is not None:
        return target_not_reached(shard_id, target)
    if cut is None:
        return None
    return RestoreValidationFailed(
        f"shard {shard_id}: the WAL in its backup ends before the backup's restore point {cut}, "
        "so it cannot be recovered to the cluster's cut.",
        fix="the backup's tail is incomplete: restore another backup, and report this one.",
    )


def did_not_start(log: str, shard_id: str) -> ShardVaultError:
    """A restored copy whose server would not start (its files or WAL incomplete or damaged),
    with the server's last words: a named error, not a crash of the finish command."""
    fatal = [line.strip() for line in log.splitlines() if "FATAL" in line or "PANIC" in line]
    said = fatal[-1] if fatal else log.strip().splitlines()[-1] if log.strip() else "no log"
    return RestoreValidationFailed(
        f"shard {shard_id}: the restored PostgreSQL server did not start: {said}",
        fix="the backup is incomplete or damaged: run shardvault verify on it, restore "
        "another backup, and report this one.",
    )


def target_not_reached(shard_id: str, target: dict[str, Any]) -> ShardVaultError:
    kind, value = recovery_setting(target) or ("", "")
    if kind == "recovery_target_name":
        return TargetOutOfRange(
            f"shard {shard_id}: its archived WAL after the backup holds no restore point "
            f"named {value!r}.",
            fix="check the name (pg_create_restore_point's argument, or a backup id); a point "
            "made before the newest backup needs an older base: name it with --backup-id.",
        )
    return TargetOutOfRange(
        f"shard {shard_id}: its archived WAL ends before {value}: PostgreSQL "
        + (
            "found no transaction after the target in it (the archive stops short of the "
            "target, or nothing was committed after it)."
            if kind == "recovery_target_time"
            else "did not reach that position in it."
        ),
        fix="choose an earlier target, or restore with --target-latest (the end of the "
        "archive); if the target is recent, wait for the archive to catch up.",
    )


def promoted(instance: Any, timeout: float, progress: Callable[[], float] | None = None) -> bool:
    """Waits until the server has left recovery (reached its target and promoted); False
    if it has not after ``timeout`` seconds, counted from ``progress()`` when given (a WAL
    feed's last batch or ask: a long archive takes as long as it takes, a stalled one does
    not). A server in targeted recovery accepts read-only connections before it is done, and
    a session outlives the promotion: one session asks every ``PROMOTED_POLL_SECONDS`` (a
    ``psql`` each time is a process and a backend each, taken from the replay's cores)."""
    started = time.monotonic()
    try:
        with psycopg.connect(
            instance.conninfo_for("postgres"), autocommit=True, application_name=PROBE_NAME
        ) as conn:
            while True:
                deadline = max(started, progress() if progress else started) + timeout
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                if row is not None and row[0] is False:
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(PROMOTED_POLL_SECONDS)
    except psycopg.Error as error:  # the server stopped in recovery: say why from its log
        time.sleep(0.5)  # its last lines are written as it exits
        raise RuntimeError(f"{error}\nServer log:\n{instance.log_tail(60)}") from None


def ports_of_servers(restore_dir: Path) -> set[int]:
    """Ports of the servers running from restore_dir: a server that listens only on its Unix
    socket leaves its TCP port free for a bind, but its port number is still taken."""
    ports = {server_port(pid_lines(p)) for p in restore_dir.glob("*/postmaster.pid")}
    return {p for p in ports if p is not None}


def pid_lines(pid_file: Path) -> list[str]:
    """A ``postmaster.pid``'s lines: the server's process id, its data directory, its start
    time, its port, ...; none when there is no such file."""
    return pid_file.read_text(errors="replace").splitlines() if pid_file.exists() else []


def server_port(lines: list[str]) -> int | None:
    """The port a ``postmaster.pid`` names (its 4th line), None when unreadable."""
    return int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None


def running_port(data_dir: Path) -> int | None:
    """The port of the server running from ``data_dir``, None when none runs (no
    ``postmaster.pid``, or its process is gone)."""
    lines = pid_lines(data_dir / "postmaster.pid")
    if not lines or not lines[0].strip().isdigit():
        return None
    try:
        os.kill(int(lines[0]), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's (the server's)
    return server_port(lines)


def restart_replaced(final: Path, port: int) -> None:
    """Starts the copy a failed restore had replaced (and stopped) again, on its port."""
    try:
        attach_instance(final, port=port)
    except RuntimeError as error:  # put back whole; report, do not fail the undo
        log.warning("could not start the replaced copy %s again: %s", final, error)


def free_port_in(ports: tuple[int, int], node_id: str, taken: set[int]) -> int:
    """The first port of the range nothing listens on and this restore has not given out."""
    low, high = ports
    for port in range(low, high + 1):
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise TargetTooSmall(
        f"node {node_id} has no free port in restore_ports {low}-{high}.",
        fix="widen restore_ports in the agent's configuration.",
    )
