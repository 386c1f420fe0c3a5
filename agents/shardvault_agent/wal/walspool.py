"""The WAL spool: where PostgreSQL's ``archive_command`` leaves each WAL file for the agent.

Terms:
- *spool*: one directory on the node (the agent's ``wal_spool_dir``) holding WAL files
  (segments, ``.history`` and ``.backup`` files) under their own names, until the agent has
  stored them (issue 11: continuous archiving; the upload is not built yet).
- *push*: ``shardvault-wal-push --spool DIR --max-bytes N %p``, PostgreSQL's
  ``archive_command``: a small client that imports nothing but the standard library, so a
  segment costs a process start, a copy and two fsyncs (60 to 90 ms for 16 MiB on the
  benchmarks' machine, 40 of them the start).

Rules, each what a backup product owes a WAL archive:
- A push succeeds (exit 0) only once the file is durable in the spool: written under a
  temporary name, fsynced, renamed, and the directory fsynced. PostgreSQL recycles a segment
  after its archive_command succeeds, so a crash after success loses nothing; a crash before
  it leaves a temporary file, which the next push of any file removes, and PostgreSQL pushes
  the segment again.
- The same name pushed again with the same bytes succeeds (PostgreSQL archives a segment
  again after a crash); with other bytes it fails and nothing is overwritten (a timeline's
  history must never change under a backup that needs it).
- A full spool (its bytes and this file's over ``--max-bytes``) fails the push (exit 1):
  PostgreSQL keeps the segment in ``pg_wal`` and retries. WAL is never dropped. pgBackRest's
  ``archive-push-queue-max`` drops WAL past its limit to protect the disk, which leaves a gap
  no point-in-time restore can cross; ShardVault refuses instead, and says so on stderr
  (PostgreSQL's log) at every refusal, so that an operator (and the agent's heartbeat, later)
  sees the spool fill long before ``pg_wal`` fills the disk.
- A path that is not a WAL file's fails (exit 2): the command is configured wrong.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# Segments (24 hex digits), timeline history files, backup history files, partial segments.
WAL_FILE = re.compile(r"^[0-9A-F]{24}(\.partial|\.[0-9A-F]{8}\.backup)?$|^[0-9A-F]{8}\.history$")
TEMPORARY = ".push-"  # a file being written: never a WAL file's name
CHUNK = 1 << 20

EXIT_PUSHED, EXIT_REFUSED, EXIT_MISCONFIGURED = 0, 1, 2


class PushRefused(Exception):
    """The push did not happen; PostgreSQL will try again."""


def spool_bytes(spool: Path) -> int:
    """Bytes of the WAL files in the spool (temporary files are being written or left over)."""
    return sum(p.stat().st_size for p in spool.iterdir() if WAL_FILE.fullmatch(p.name))


def same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as x, open(b, "rb") as y:
        while True:
            left, right = x.read(CHUNK), y.read(CHUNK)
            if left != right:
                return False
            if not left:
                return True


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clear_leftovers(spool: Path) -> None:
    """Removes temporary files of pushes that died (their segments are pushed again)."""
    for path in spool.glob(f"{TEMPORARY}*"):
        if not _pid_alive(path.name.rsplit("-", 1)[-1]):
            path.unlink(missing_ok=True)


def _pid_alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def push(source: Path, spool: Path, max_bytes: int) -> bool:
    """Makes ``source`` durable in ``spool``; True if it was there already (same bytes).
    Raises ``PushRefused`` when the spool is full or holds other bytes under its name."""
    name = source.name
    target = spool / name
    clear_leftovers(spool)
    if target.exists():
        if same_bytes(source, target):
            return True
        raise PushRefused(
            f"{target} holds other bytes than {source}: a WAL file is never overwritten. "
            "Look for another server archiving into this spool."
        )
    size = source.stat().st_size
    held = spool_bytes(spool)
    if held + size > max_bytes:
        raise PushRefused(
            f"the WAL spool {spool} is full ({held:,} of {max_bytes:,} bytes): {name} stays "
            "in pg_wal and PostgreSQL will push it again. Check that the agent runs and "
            "reaches the store, or raise --max-bytes in archive_command if the disk has "
            "room."
        )
    temporary = spool / f"{TEMPORARY}{name}-{os.getpid()}"
    try:
        with open(source, "rb") as src, open(temporary, "wb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.rename(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(spool)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shardvault-wal-push",
        description="PostgreSQL's archive_command: put one WAL file durably into the spool.",
    )
    parser.add_argument("--spool", type=Path, required=True, help="the agent's wal_spool_dir")
    parser.add_argument(
        "--max-bytes",
        type=int,
        required=True,
        help="the most bytes the spool may hold: a push past it fails and PostgreSQL retries",
    )
    parser.add_argument("path", type=Path, help="%%p: the WAL file, relative to the data dir")
    args = parser.parse_args(argv)
    if not WAL_FILE.fullmatch(args.path.name) or not args.path.is_file():
        print(
            f"shardvault-wal-push: {args.path} is not a WAL file: set archive_command to "
            "'shardvault-wal-push --spool DIR --max-bytes N %p'.",
            file=sys.stderr,
        )
        return EXIT_MISCONFIGURED
    if not args.spool.is_dir():
        print(
            f"shardvault-wal-push: the spool {args.spool} is not a directory: create it, "
            "writable by the server's user, or correct --spool.",
            file=sys.stderr,
        )
        return EXIT_MISCONFIGURED
    try:
        push(args.path, args.spool, args.max_bytes)
    except PushRefused as refused:
        print(f"shardvault-wal-push: {refused}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as error:  # a full disk, a permission: PostgreSQL retries
        print(f"shardvault-wal-push: {args.path.name} not spooled: {error}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_PUSHED


if __name__ == "__main__":
    sys.exit(main())
