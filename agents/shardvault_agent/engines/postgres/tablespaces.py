"""PostgreSQL's tablespaces, both directions: a shard's linked directories
(``shardvault.contracts.links``).

Terms:
- *tablespace*: a directory outside the data directory (``CREATE TABLESPACE ... LOCATION``),
  linked from ``pg_tblspc/<oid>``. The server keeps its files in a subdirectory named for its
  version, the *version directory* (``PG_<major>_<catalog version>``), so one location may
  serve the servers before and after a ``pg_upgrade``. An *in-place* tablespace (a developer
  option: ``pg_tblspc/<oid>`` a directory, not a link) is copied as part of the data directory.
- *backup*: the listing follows each link and takes only this server's version directory
  (another version's is an upgrade's leftover); the marker lists the tablespaces of
  ``pg_tablespace`` at the checkpoint, and the stop refuses a backup during which one was
  created or dropped: its recovery would replay the ``CREATE TABLESPACE``, which links the
  copy to the *source's* location (on the same host, the source's own files).
- *restore*: the node linked each tablespace to its placement before any byte arrived
  (``restore.prepare``). The backup's ``tablespace_map`` is removed: recovery would
  otherwise link each tablespace back to the directory it had on the source. Each placement
  is given to the server's user.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import psycopg

from shardvault.contracts.links import LinkedDir
from shardvault.errors import (
    EngineError,
    RestoreValidationFailed,
    ShardVaultError,
    TargetUnsupported,
)
from shardvault_agent.engines.base import tree_bytes

LINK = re.compile(r"^pg_tblspc/\d+$")  # a tablespace's link, relative to the data directory
_IN_LINK = re.compile(r"^pg_tblspc/\d+/(?P<name>[^/]+)$")  # a directory in a tablespace
MAP = "tablespace_map"  # pg_backup_stop's: each tablespace's oid and source directory

# pg_default and pg_global are the data directory's own (base/ and global/).
CATALOG = """
SELECT oid::text, spcname, pg_tablespace_location(oid)
FROM pg_tablespace
WHERE spcname NOT IN ('pg_default', 'pg_global')
ORDER BY oid
"""


def version_dir(data_dir: Path) -> str:
    """The version directory of the server of ``data_dir``: its major version (``PG_VERSION``)
    and catalog version (``pg_control``'s bytes 12 to 16, native order)."""
    major = (data_dir / "PG_VERSION").read_text().strip()
    with open(data_dir / "global" / "pg_control", "rb") as control:
        head = control.read(16)
    return f"PG_{major}_{int.from_bytes(head[12:16], sys.byteorder)}"


def other_version(rel: str, version: str) -> bool:
    """A directory in a tablespace that is not this server's version directory: skipped."""
    match = _IN_LINK.match(rel)
    return match is not None and match["name"] != version


def links(data_dir: Path) -> list[Path]:
    """The tablespaces' links in ``pg_tblspc`` (in-place tablespaces are directories: not)."""
    directory = data_dir / "pg_tblspc"
    return sorted(p for p in directory.iterdir() if p.is_symlink()) if directory.is_dir() else []


def locations(data_dir: Path) -> dict[str, str]:
    """Each tablespace's link path and its location, as the link (and the WAL's ``CREATE
    TABLESPACE``) says; none when the data directory cannot be read."""
    try:
        return {f"pg_tblspc/{link.name}": os.readlink(link) for link in links(data_dir)}
    except OSError:
        return {}


def placed_bytes(data_dir: Path) -> int:
    """The bytes in every tablespace's directory."""
    return sum(tree_bytes(link) for link in links(data_dir) if link.is_dir())


def check(data_dir: Path, shard_id: str) -> None:
    """Each tablespace link leads to a directory outside the data directory (one inside would
    be copied twice), or is refused by name with its fix: a backup that followed a broken
    link would lose that tablespace's tables."""
    root = data_dir.resolve()
    for link in links(data_dir):
        target = Path(os.readlink(link))
        where = f"PostgreSQL shard {shard_id}: tablespace {link.name} ({link} -> {target})"
        if not link.is_dir():
            raise EngineError(
                f"{where} leads to no directory.",
                fix="mount the tablespace's disk (or drop the tablespace), then back up again.",
            )
        resolved = link.resolve()
        if resolved == root or root in resolved.parents:
            raise EngineError(
                f"{where} is inside the data directory, which would copy it twice.",
                fix="move the tablespace outside the data directory (ALTER TABLE ... SET "
                "TABLESPACE to a new one, then drop it).",
            )


def catalog(conn: psycopg.Connection) -> list[LinkedDir]:
    """The tablespaces linked from the data directory, as ``pg_tablespace`` lists them (an
    in-place one, whose location is relative, is the data directory's own)."""
    return [
        LinkedDir(path=f"pg_tblspc/{oid}", name=name, source=location)
        for oid, name, location in conn.execute(CATALOG).fetchall()
        if location.startswith("/")
    ]


def refuse_changed(conn: psycopg.Connection, shard_id: str, linked: list[LinkedDir]) -> None:
    """Refuses a backup during which a tablespace was created or dropped (the module
    docstring, *backup*): ``linked``, its tablespaces at the checkpoint."""
    before = {d.path for d in linked}
    try:
        now = {d.path for d in catalog(conn)}
    except psycopg.Error as error:
        raise EngineError(
            f"PostgreSQL shard {shard_id}: its tablespaces cannot be read: {error}".strip(),
            fix="check the server log, and retry the backup.",
        ) from None
    if before != now:
        changed = ", ".join(sorted(before ^ now))
        raise EngineError(
            f"PostgreSQL shard {shard_id}: a tablespace was created or dropped during the "
            f"backup ({changed}); its recovery would replay that into the source's directory.",
            fix="retry the backup: it copies the tablespaces as they are now.",
        )


def creation_reached(log: str, created: dict[str, str], shard_id: str) -> ShardVaultError | None:
    """The named error for a recovery that stopped at the creation of a tablespace made after
    the base, its location missing on this node (``restore.linked.refuse_created`` refused
    one that exists); None for any other stop."""
    for path, location in sorted(created.items()):
        if f'directory "{location}" does not exist' in log:
            return TargetUnsupported(
                f"shard {shard_id}: recovery reached the creation of tablespace {path} (in "
                f"{location}), made after the base backup; a copy cannot replay it.",
                fix="choose a target before the tablespace was created, or restore from a "
                "backup taken after it.",
            )
    return None


def refuse_foreign(root: Path, placed: list[Path], shard_id: str) -> None:
    """After recovery: every tablespace link still leads where the node placed it. One that
    does not was created by the replay in its source directory (a creation the archive's
    batches did not show: ``restore.linked.refuse_created``), and the copy must not be used."""
    for link in links(root):
        if link.resolve() not in placed:
            raise RestoreValidationFailed(
                f"shard {shard_id}: recovery created tablespace {link.name} in "
                f"{os.readlink(link)}, outside what the restore placed: the copy writes there.",
                fix="restore from a backup taken after that tablespace was created, or onto "
                "another node; check that directory's owner (a source's tablespace?).",
            )


def ready_for_recovery(root: Path) -> list[Path]:
    """Readies a restored copy's tablespaces: removes the backup's map, so recovery keeps the
    links the node made, and returns each tablespace's directory (to give to the server's
    user). Refuses a link that leads nowhere: its tables would be lost."""
    (root / MAP).unlink(missing_ok=True)
    placed = []
    for link in links(root):
        if not link.is_dir():
            raise EngineError(
                f"restored tablespace {link.name} links to {os.readlink(link)}, which is gone.",
                fix="start the restore again.",
            )
        placed.append(link.resolve())
    return placed
