"""A MariaDB point-in-time restore: the archived binary logs replayed onto a prepared copy.

Terms (``binlogs`` defines the logs and positions):
- *run*: the archived files from the base's (the marker's ``binlog_file``) on, in order, as
  the restore's WAL stream lays them out; the first is replayed from the base's
  ``binlog_pos``, where the copy is consistent.
- *asking*: each file is asked of the WAL feed (``restore.walfeed``) as PostgreSQL's
  ``restore_command`` asks for a segment: ``.asked/<name>``, then a wait for the file (or for
  the feed's ``.failed``/``.stop``); the feed fetches it and the next few meanwhile.
- *event*: a binary log is a magic number and events, each headed by its stamp (the second,
  UTC, its statement started), type and size; a transaction's events form a *group*, begun
  by a GTID event, never split across files.
- *stop*: for a time, the start of the first group holding an event stamped at or after it
  (a transaction is replayed when its statements all started before the target: stamps are
  whole seconds, so a target is too); for a position (``file:offset``), that offset, which
  must be a group's start or the file's end. Replay stops there, at a group boundary: the copy
  never holds half a transaction. The stop is computed here from the events' headers;
  ``mariadb-binlog --stop-datetime`` would read the time in the process's time zone.
- *session*: one ``mariadb`` client takes every file's events (``mariadb-binlog``'s output fed
  to its standard input, no shell; only checked names and computed offsets reach the
  programs' arguments), so a session's state carries across files.
"""

from __future__ import annotations

import contextlib
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from shardvault.contracts.models import Phase, unpack_files
from shardvault.contracts.wal_archive import BINLOG_FILE, WAL_DIR, binlog_run
from shardvault.errors import EngineError, TargetOutOfRange
from shardvault_agent.engines.mariadb.server import MariadbServer, program
from shardvault_agent.restore.walfeed import ASKED, FAILED, POLL_SECONDS, STOPPED

MAGIC = b"\xfebin"
HEADER = struct.Struct("<IBIIIH")  # stamp, type, server id, size, next event's offset, flags
GTID_EVENT = 162
# Events outside any group: the file's own (format, GTID list, checkpoint, encryption), its
# end (rotate, stop) and heartbeats. Their stamps say when the file opened or closed.
FILE_EVENTS = frozenset({3, 4, 15, 27, 161, 163, 164})
WAIT_SECONDS = 600.0  # for a file the feed does not bring, counted from its last progress
MAX_PACKET = 1024**3  # a group's BINLOG statement may be large: the server's and client's cap


@dataclass(frozen=True)
class Stop:
    """Where replay stops: in ``file`` at ``offset`` (None: nowhere: the run's end)."""

    file: str | None = None
    offset: int = 0
    epoch: int | None = None  # a time target, in whole seconds


def events(path: Path) -> Iterator[tuple[int, int, int]]:
    """Each event of a binary log: its offset, stamp and type."""
    with open(path, "rb") as log:
        if log.read(4) != MAGIC:
            raise EngineError(f"{path.name} is not a binary log.", fix="restore another backup.")
        offset = 4
        while len(header := log.read(HEADER.size)) == HEADER.size:
            stamp, kind, _, size, _, _ = HEADER.unpack(header)
            if size < HEADER.size:
                raise EngineError(
                    f"{path.name} has a damaged event at {offset}.", fix="restore another backup."
                )
            yield offset, stamp, kind
            offset += size
            log.seek(offset)


def time_stop(path: Path, epoch: int) -> int | None:
    """The offset of the first group in ``path`` holding an event stamped at or after
    ``epoch``; None when every group is before it."""
    group = None
    for offset, stamp, kind in events(path):
        if kind == GTID_EVENT:
            group = offset
        if kind not in FILE_EVENTS and stamp >= epoch:
            return group if group is not None else offset
    return None


def group_bounds(path: Path) -> list[int]:
    """Where a position target may stop in ``path``: each group's start, and the end."""
    bounds, end = [], 4
    for offset, _, kind in events(path):
        if kind == GTID_EVENT:
            bounds.append(offset)
        end = offset
    return [*bounds, end]


def stop_of(recovery: dict[str, Any]) -> Stop:
    if recovery.get("target_time"):
        instant = datetime.fromisoformat(recovery["target_time"])
        return Stop(epoch=int(instant.timestamp()))
    if position := recovery.get("target_position"):
        file, _, offset = position.rpartition(":")
        if not BINLOG_FILE.fullmatch(file) or not offset.isdigit():
            raise ValueError(f"{position!r} is not a binary log position")
        return Stop(file=file, offset=int(offset))
    return Stop()


def run_of(layout: dict[str, Any], first: str) -> list[str]:
    """The archived files from ``first`` on, as the control plane's run counts them
    (``binlog_run``: a batch past a gap is not replayed), first copies only."""
    stream = next(s for s in layout["streams"] if s["phase"] == Phase.WAL.value)
    paths = [Path(f.path) for f in unpack_files(stream["files"])]
    return binlog_run(first, (p.name for p in paths if p.parent.as_posix() == WAL_DIR))


def replay(
    server: MariadbServer,
    root: Path,
    shard_id: str,
    layout: dict[str, Any],
    progress: Callable[[], float] | None,
) -> str:
    """Replays the run onto ``server`` to the layout's target; returns where it stopped
    (``file:offset``). Raises ``TargetOutOfRange`` for a position the run does not hold or
    that is not a group boundary, ``EngineError`` when a program fails."""
    marker, stop = layout["marker"], stop_of(layout["recovery"])
    start_file, start_pos = marker["binlog_file"], int(marker["binlog_pos"])
    files = run_of(layout, start_file)
    if not files or files[0] != start_file:
        raise EngineError(
            f"shard {shard_id}: the archive does not begin at {start_file}, where its base "
            "backup's copy ends.",
            fix="restore another backup; check the shard's binary log archive (verify).",
        )
    if stop.file is not None:
        refuse_position(shard_id, stop, files, start_file, start_pos)
    try:
        server.sql(f"SET GLOBAL max_allowed_packet = {MAX_PACKET}")
    except RuntimeError as error:
        raise EngineError(
            f"shard {shard_id}: the restored server refused the replay's settings: {error}",
            fix="see the restored server's log.",
        ) from None
    client = subprocess.Popen(
        [program("mariadb"), *server.client_args(), "--binary-mode",
         f"--max-allowed-packet={MAX_PACKET}"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/",
    )  # fmt: skip
    reached, failed = f"{files[-1]}:end", None
    try:
        for name in files:
            path = asked(root / WAL_DIR, name, shard_id, progress)
            until = None
            if name == stop.file:
                refuse_off_boundary(shard_id, path, stop.offset)
                until = stop.offset
            elif stop.epoch is not None:
                until = time_stop(path, stop.epoch)
            first = name == start_file
            if first and until is not None:
                until = max(until, start_pos)  # nothing before where the copy ends
            feed(client, path, start_pos if first else None, until)
            if until is not None:
                reached = f"{name}:{until}"
                break
            reached = f"{name}:end"
    except EngineError as error:  # the client's own failure, if it failed, is the cause
        failed = error
    finally:
        assert client.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            client.stdin.close()
        said = client.stderr.read().decode(errors="replace") if client.stderr else ""
        code = client.wait()
    if failed is not None and code == 0:
        raise failed
    if code != 0:
        raise EngineError(
            f"shard {shard_id}: replaying the binary logs failed: {said.strip()[-1000:]}",
            fix="see the restored server's log; restore to an earlier target, or another "
            "backup, and report this one.",
        )
    return reached


def refuse_position(
    shard_id: str, stop: Stop, files: list[str], start_file: str, start_pos: int
) -> None:
    assert stop.file is not None
    held = f"from {start_file}:{start_pos} to the end of {files[-1]}"
    if stop.file not in files or (stop.file == start_file and stop.offset < start_pos):
        raise TargetOutOfRange(
            f"shard {shard_id}: position {stop.file}:{stop.offset} is not in its archived "
            f"binary logs after the base ({held}).",
            fix="give a position in that range, or restore from another backup (--backup-id).",
        )


def refuse_off_boundary(shard_id: str, path: Path, offset: int) -> None:
    bounds = group_bounds(path)
    if offset not in bounds:
        before = max((b for b in bounds if b < offset), default=4)
        after = min((b for b in bounds if b > offset), default=bounds[-1])
        raise TargetOutOfRange(
            f"shard {shard_id}: {path.name}:{offset} is inside a transaction, not between two.",
            fix=f"give a transaction's boundary, e.g. {path.name}:{before} or {path.name}:{after}.",
        )


def asked(wal_dir: Path, name: str, shard_id: str, progress: Callable[[], float] | None) -> Path:
    """Asks the feed for ``name`` and waits for it (the module docstring, *asking*)."""
    (wal_dir / ASKED / name).touch()
    path, started = wal_dir / name, time.monotonic()
    while not path.exists():
        if (wal_dir / FAILED).exists() or (wal_dir / STOPPED).exists():
            if path.exists():
                break
            reason = (wal_dir / FAILED).read_text().strip() if (wal_dir / FAILED).exists() else ""
            raise EngineError(
                f"shard {shard_id}: the binary log {name} did not arrive: {reason or 'stopped'}",
                fix="start the restore again (it resumes what was downloaded).",
            )
        if time.monotonic() - max(started, progress() if progress else started) > WAIT_SECONDS:
            raise EngineError(
                f"shard {shard_id}: the binary log {name} did not arrive in {WAIT_SECONDS:g} s.",
                fix="check that the node reaches the store, and start the restore again.",
            )
        time.sleep(POLL_SECONDS)
    return path


def feed(client: subprocess.Popen, path: Path, start: int | None, until: int | None) -> None:
    """One file's events, from ``start`` to ``until``, into the client's session."""
    command = [program("mariadb-binlog"), "--no-defaults", "--verify-binlog-checksum"]
    if start is not None:
        command.append(f"--start-position={start}")
    if until is not None:
        command.append(f"--stop-position={until}")
    done = subprocess.run(
        [*command, str(path)], stdout=client.stdin, stderr=subprocess.PIPE, check=False, cwd="/"
    )
    if done.returncode != 0:
        raise EngineError(
            f"mariadb-binlog could not read {path.name}: "
            f"{done.stderr.decode(errors='replace').strip()[-500:]}",
            fix="the archived binary log is damaged: restore to an earlier target.",
        )
